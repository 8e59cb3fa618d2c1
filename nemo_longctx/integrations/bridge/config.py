"""The option model on a Megatron-Bridge ``ConfigContainer`` (the Bridge front end's mapping; no second definition or
validation of any option: ``nemo_longctx.options`` checks them, ``integrations/megatron`` maps them onto Megatron).

``enable_long_context(cfg, options)``  checks the options against the container (ConfigError naming every problem)
                                       and writes them onto it: the provider's CP size and a layer spec with our core
                                       attention (``LongContextSpec``; ``cp_comm_type`` aligned with cp.algorithm),
                                       the memory options (``integrations.bridge.memory``: Megatron's recompute fields,
                                       the tiled MLP spec, a pre-wrap hook wiring offload / kept attention / chunked
                                       loss into the built model), and the model-state options on Bridge's own
                                       ``OptimizerConfig`` / ``DistributedDataParallelConfig``;
``long_context_callbacks(cfg)``        the Bridge callbacks of those options (per-step activation memory, the
                                       offload check): pass them to ``pretrain(cfg, forward_step, callbacks=...)``;
``allow_our_targets()``                 our ``_target_`` prefix on Bridge's allow-list for saved run configs (Bridge's
                                       ``register_allowed_target_prefix``; done by ``enable_long_context``);
``model_problems_of(cfg, options, world_size)``  the checks against the model (heads, sequence length vs 2*cp,
                                       layers per stage, ...), once, before any process group exists.

``spec_of_container(cfg, options)``   the container as a run spec (Bridge's dialect): ``spec.context()`` is what the
                                       option checks need.

Bridge's own keys keep their names in messages (``BRIDGE_KEYS``: ``model.tensor_model_parallel_size``, ...).
"""

from __future__ import annotations

import logging
from typing import Any, Dict, List, Mapping, Optional, Union

from nemo_longctx.integrations.bridge.memory import LongContextMemory, memory_of
from nemo_longctx.integrations.megatron.cp_algorithms import align_cp_comm_type
from nemo_longctx.integrations.megatron.spec import LongContextSpec
from nemo_longctx.integrations.megatron.tiled_mlp_layer import TiledMLPLayerSpec
from nemo_longctx.options import Context, LongContextOptions, raise_problems
from nemo_longctx.shared.app_keys import BRIDGE_KEYS
from nemo_longctx.shared.run_spec import CheckpointSpec, DataSpec, Layout, ModelSpec, RunSpec, TrainerSpec


TARGET_PREFIX = "nemo_longctx"  # the _target_ prefix of our classes in a saved run config


def allow_our_targets() -> None:
    """Let Bridge's config loader instantiate our classes: megatron-bridge (0.6) instantiates a saved run config's
    ``_target_`` only under allowed module prefixes (``utils.instantiate_utils``: megatron., torch., nvidia., ...); our
    prefix is added through Bridge's own ``register_allowed_target_prefix``. Called by ``enable_long_context``; call it
    before loading a run config of ours (``ConfigContainer.from_yaml``, ``model_load_save.load_model_config``) in a
    process that has not."""
    from megatron.bridge.utils.instantiate_utils import register_allowed_target_prefix

    register_allowed_target_prefix(TARGET_PREFIX)


def precision_of(cfg: Any) -> str:
    """The container's precision in the option model's words (``bf16-mixed`` | ``16-mixed`` | ``32``)."""
    mp = cfg.mixed_precision
    name = mp if isinstance(mp, str) else ("bf16_mixed" if getattr(mp, "bf16", False) else
                                            "fp16_mixed" if getattr(mp, "fp16", False) else None)
    if name is None:
        return "bf16-mixed" if getattr(cfg.model, "bf16", False) else "16-mixed" if getattr(cfg.model, "fp16",
                                                                                             False) else "32"
    return "bf16-mixed" if "bf16" in name else "16-mixed" if "fp16" in name or "16" in name else "32"


def spec_of_container(cfg: Any, options: Union[LongContextOptions, Mapping[str, Any], None] = None,
                      packed_documents: Optional[bool] = False) -> RunSpec:
    """The run spec of a Bridge ``ConfigContainer``, in Bridge's dialect (``BRIDGE_KEYS``): the trainer (steps,
    precision, batch sizes) and the provider's layout, where and every how many steps ``checkpoint`` saves (it saves
    with ``checkpoint.save`` and a ``save_interval``), the provider's model fields, and the data
    (``packed_documents``: packed documents, ``data.packing=documents``: our forward step,
    ``integrations.bridge.documents``; None: not known). The world size is the launch's (``spec.context(world)``)."""
    m, train, ckpt = cfg.model, getattr(cfg, "train", None), cfg.checkpoint
    save = getattr(ckpt, "save", None)
    interval = getattr(ckpt, "save_interval", None)
    layout = Layout(tp=m.tensor_model_parallel_size, pp=m.pipeline_model_parallel_size,
                    sequence_parallel=bool(m.sequence_parallel))
    trainer = TrainerSpec(devices=None, num_nodes=None, max_steps=getattr(train, "train_iters", None),
                          precision=precision_of(cfg), micro_batch_size=getattr(train, "micro_batch_size", None),
                          global_batch_size=getattr(train, "global_batch_size", None), layout=layout)
    checkpoint = CheckpointSpec(every_n_steps=interval, dir=save, async_save=getattr(ckpt, "async_save", None),
                                saving=bool(save) and bool(interval))
    data = None if packed_documents is None else DataSpec(packing="documents" if packed_documents else "none")
    model = {name: getattr(m, name) for name in ModelSpec.ADAPTED_FIELDS if getattr(m, name, None) is not None}
    return RunSpec(options=as_options(options), trainer=trainer, checkpoint=checkpoint, data=data,
                   model=ModelSpec(fields=model), app="bridge", dialect="bridge")


def as_options(options: Union[LongContextOptions, Mapping[str, Any], None]) -> LongContextOptions:
    return options if isinstance(options, LongContextOptions) else LongContextOptions.from_dict(options or {})


def enable_long_context(cfg: Any, options: Union[LongContextOptions, Mapping[str, Any], None] = None, *,
                        packed_documents: bool = False, **groups: Any) -> Any:
    """Write the long-context options onto ``cfg`` (a Bridge ``ConfigContainer``) in place; returns it. The options
    are a ``LongContextOptions``, a mapping of the option groups, or the groups as keywords::

        enable_long_context(cfg, cp={"algorithm": "ring", "size": 8}, recompute={"name": "full"})

    ``packed_documents``: the run trains on packed documents with our forward step
    (``documents.packed_documents_forward_step``; the dataset's ``reset_position_ids`` is set): only then is
    ``cp.split_min_tokens`` taken. Without it, a dataset asking for per-document attention
    (``dataset.reset_attention_mask``) or, on a rotary model, per-document positions (``dataset.reset_position_ids``)
    is refused (``documents.dense_document_problems``): Bridge's forward step would train across the documents; so is
    Megatron's ``dataset.inter_document_masking``, whose ``cu_seqlens`` path fails at the first step.

    Every problem is raised at once (``ConfigError``, each naming its key, Bridge's names for Bridge's keys)."""
    import torch

    if groups:
        if options is not None:
            raise TypeError("enable_long_context: pass the options either as one object/mapping or as keywords")
        options = dict(groups)
    options = as_options(options)
    problems = options.problems(spec_of_container(cfg, options, packed_documents).context(
        cuda=torch.cuda.is_available()))
    if not packed_documents:  # Bridge's own forward step: the dataset's per-document flags it would not honour
        from nemo_longctx.integrations.bridge.documents import dense_document_problems

        problems += dense_document_problems(cfg)
    raise_problems(problems)
    if packed_documents:
        from nemo_longctx.integrations.bridge.documents import packed_documents_problems, use_packed_documents

        raise_problems(packed_documents_problems(cfg) + options.memory.packed_problems("data.packing=documents"))
        use_packed_documents(cfg)
    allow_our_targets()  # the run config Bridge saves names our layer spec
    m = cfg.model
    cp = options.cp
    m.context_parallel_size = cp.size
    # our algorithms are chosen by cp.algorithm: a provider's TE comm-type hint yields to it, a contradicting value
    # the user set is refused (ValueError naming both keys)
    note = align_cp_comm_type(m, cp.algorithm)
    if note is not None:
        logging.getLogger(__name__).info(note)
    base = m.transformer_layer_spec
    while isinstance(base, (LongContextSpec, TiledMLPLayerSpec)):  # enable_long_context again: from the user's base
        base = base.base
    m.transformer_layer_spec = LongContextSpec(base, cp.algorithm, cp.attention_kwargs)
    LongContextMemory(options).configure(cfg)  # after our spec: the tiled MLP wraps it
    _apply_model_state(cfg, options)
    return cfg


def long_context_callbacks(cfg: Any, packed_documents: bool = False) -> List[Any]:
    """The Bridge callbacks ``enable_long_context`` set up for ``cfg`` (pass them to Bridge's ``pretrain``);
    ``packed_documents``: with our forward step for packed documents (its placement policy set at train start on
    every rank; the run guards judge the documents' layout)."""
    memory = memory_of(cfg)
    if memory is None:
        raise ValueError("long_context_callbacks: call enable_long_context(cfg, options) first")
    from nemo_longctx.integrations.bridge.guards import run_guards_callback

    out = [memory.callback(), run_guards_callback(cfg, packed_documents)]
    if packed_documents:
        from nemo_longctx.integrations.bridge.documents import placement_callback

        out.insert(0, placement_callback(memory.options))
    return out


def _apply_model_state(cfg: Any, options: LongContextOptions) -> None:
    """The ``optim`` options on Bridge's ``OptimizerConfig`` / ``DistributedDataParallelConfig`` fields (the same
    fields Megatron's own ``OptimizerConfig`` has: ``integrations.megatron.model_state.optimizer_fields``)."""
    from nemo_longctx.integrations.megatron.model_state import (
        MEGATRON_FSDP_DDP_FIELDS,
        grad_reduce_in_fp32,
        optimizer_fields,
    )

    s = options.optim.state
    o, ddp = cfg.optimizer, cfg.ddp
    for name, value in optimizer_fields(s).items():
        setattr(o, name, value)
    ddp.use_distributed_optimizer = o.use_distributed_optimizer
    ddp.use_megatron_fsdp = False
    if s.megatron_fsdp:
        for name, value in MEGATRON_FSDP_DDP_FIELDS.items():
            setattr(ddp, name, value)
    ddp.grad_reduce_in_fp32 = grad_reduce_in_fp32(s)


def model_problems_of(cfg: Any, options: LongContextOptions, world_size: int) -> List[str]:
    """Every problem of the options against the container's model (before any process group exists)."""
    from nemo_longctx.integrations.megatron.validation import model_problems

    m = cfg.model
    return model_problems(m, options, world_size, m.tensor_model_parallel_size, m.pipeline_model_parallel_size,
                          Context(keys=BRIDGE_KEYS))


def cpu_problems(cfg: Any, options: LongContextOptions) -> List[str]:
    """Without CUDA: the model-state options that cannot run on a CPU (``validation.model_state_cpu_problems``);
    the run saves checkpoints whenever ``checkpoint.save`` is set (at its interval, at the end, on a signal); and the
    MoE settings Megatron's local layers cannot train (``validation.moe_cpu_problems``)."""
    from nemo_longctx.integrations.megatron.validation import model_state_cpu_problems, moe_cpu_problems

    return model_state_cpu_problems(options.optim.state, checkpointing=cfg.checkpoint.save is not None,
                                    saving="checkpoint.save=<dir>",
                                    no_saving="checkpoint.save=null") + moe_cpu_problems(cfg.model)


def describe(cfg: Any, options: LongContextOptions) -> Dict[str, str]:
    return {"cp": options.cp.describe(), **options.describe(), "seq_length": str(cfg.model.seq_length)}
