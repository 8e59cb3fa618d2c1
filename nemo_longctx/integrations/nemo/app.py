"""The train app's NeMo side: run spec -> validated NeMo objects (nothing is launched or trained here).

Every function here takes the run's ``RunSpec`` (``shared/run_spec.py``: read once from the composed config by
``read_run_spec``; nothing here reads a ``DictConfig``, the model group's node goes to Hydra's ``instantiate`` unread):

``resolve_recipe(spec)``   the spec with its recipe's values in the keys left null (``training_recipe.resolve``);
``config_problems(spec)``  every config-level problem at once (no model needed; run in the launching process before
                           any rank starts): the spec's own (the app's keys, the option model's), the data, init_from,
                           the model fields, the paths the run writes;
``build(spec, launch)``    the run's NeMo objects: the model config with our core attention
                           (``enable_long_context``), ``LongContextStrategy``, ``nl.Trainer``, the data module,
                           ``nl.MegatronOptimizerModule``, ``nl.NeMoLogger`` (TensorBoard + ``nl.ModelCheckpoint``) and
                           ``nl.AutoResume``; the checks against the model config run here, once, all together;
``fit(built)``             ``llm.train`` -- NeMo's own entry point: logger set-up, auto-resume, fit;
``dry_run(spec)``          build + validate in one process and prove every layer's core attention is ours.
"""

from __future__ import annotations

import os
from pathlib import Path
from dataclasses import dataclass
from typing import Any, Dict, List, Optional

from nemo_longctx.integrations.nemo.pretrained import init_from_problems
from nemo_longctx.options import (  # noqa: F401  (ConfigError, raise_problems: the app's error type, re-exported)
    ConfigError,
    Context,
    LongContextOptions,
    raise_problems,
)
from nemo_longctx.shared.app_keys import DEMO_SETTINGS, NEMO_KEYS
from nemo_longctx.shared.console import rank_from_env
from nemo_longctx.shared.launch import Launch
from nemo_longctx.shared.run_spec import RunSpec, read_run_spec
from nemo_longctx.shared.signals import signals_of


# ------------------------------------------------------------------------------------------------ validation
def model_field_types() -> Dict[str, type]:
    """The scalar type of every model field the shipped model configs (conf/model/*.yaml) set: int, float or bool
    (a field set as int in one and float in another is a float)."""
    import yaml

    from nemo_longctx.shared.overrides import conf_dir

    types: Dict[str, type] = {}
    for f in sorted((Path(conf_dir()) / "model").glob("*.yaml")):
        for k, v in (yaml.safe_load(f.read_text()) or {}).items():
            t = type(v)
            if t in (int, float, bool):
                types[k] = float if {types.get(k, t), t} == {int, float} else types.get(k, t)
    return types


def model_field_problems(spec: RunSpec) -> List[str]:
    """A model field given a value of the wrong kind (``model.seq_length=4k``) is refused naming it, before NeMo builds
    the config in every rank. Fields are typed by the shipped model configs (``model_field_types``)."""
    types, problems = model_field_types(), []
    for k, v in spec.model.fields.items():
        t = types.get(k)
        if t is None or v is None or (t is float and type(v) is int) or type(v) is t:
            continue
        kind = {int: "an integer", float: "a number", bool: "true or false"}[t]
        problems.append(f"model.{k}={v!r}: must be {kind} (got {type(v).__name__})")
    return problems


def planner_precision(spec: RunSpec) -> Any:
    """The planner's ``Precision`` of ``trainer.precision``: fp32 weights and activations for "32", else its bf16
    defaults (bf16 weights and activations, fp32 main grads)."""
    from nemo_longctx.planner.search import Precision

    return Precision(activation_bytes=4, param_bytes=4) if str(spec.trainer.precision) == "32" else Precision()


def planner_shape(spec: RunSpec) -> tuple:
    """(the planner's ``ModelShape`` of the model group, None) or (None, why it cannot be sized: init_from runs and
    configs naming no known shape)."""
    from nemo_longctx.planner.model_shapes import shape_from_config

    try:
        return shape_from_config(dict(spec.model.fields)), None
    except (ValueError, TypeError, KeyError) as e:
        return None, str(e)


def run_path_problems(spec: RunSpec) -> List[str]:
    """Where the run writes, probed before launch: ``output_dir`` and (when it saves) ``checkpoint.dir`` can be
    created and written in, and the checkpoint filesystem has room for ``checkpoint.keep`` checkpoints of this model
    (the planner's size estimate: weights + fp32 master + Adam moments, less what the folder already holds)."""
    from nemo_longctx.shared.path_checks import free_space_problem, gb, tree_bytes, writable_dir_problem

    problems = [m for m in [writable_dir_problem("output_dir", str(spec.output_dir))] if m]
    c = spec.checkpoint
    if problems or not c.saves:  # (a bad interval is the spec's key_problems')
        return problems
    directory, key = spec.checkpoint_dir, "checkpoint.dir" if c.dir else "output_dir"
    if c.dir and (m := writable_dir_problem("checkpoint.dir", directory)):
        return [m]
    from nemo_longctx.planner.search import checkpoint_bytes

    shape, _ = planner_shape(spec)
    if shape is None or spec.run.dry_run:  # a model the planner cannot size (init_from: sized by its
        return problems  # checkpoint); a dry run (often on a login node) reports the size in its summary instead
    size = checkpoint_bytes(shape, planner_precision(spec))
    keep = c.keep if isinstance(c.keep, int) and c.keep > 0 else 1
    need = size * keep - tree_bytes(directory)
    shown = directory if key == "checkpoint.dir" else str(spec.output_dir)
    m = free_space_problem(key, shown, need, f"checkpoint.keep={keep} checkpoint(s) of {gb(size)}")
    return problems + ([m] if m else [])


def config_problems(spec: RunSpec, world_size: Optional[int] = None, target_cuda: Optional[bool] = None
                    ) -> List[str]:
    """Every config-level problem (no model config needed, no NeMo import), each naming its key; ``world_size``
    (default: the launch's, else trainer.devices x trainer.num_nodes) for the layout's world-size rule;
    ``target_cuda``: check for a target with (True: CUDA and TransformerEngine) or without CUDA instead of this
    process's build (the planner's targets). A spec whose recipe is still pending gets its values first."""
    from nemo_longctx.integrations.megatron.cpu_compat import needed
    from nemo_longctx.integrations.megatron.validation import model_state_cpu_problems
    from nemo_longctx.integrations.nemo.data_checks import data_problems
    from nemo_longctx.shared.launch import detect_external_launch

    if recipe_pending(spec):  # (a spec read without the app: the recipe's values first, as the app does)
        try:
            spec = resolve_recipe(spec)
        except ConfigError as e:
            return e.problems
    options = spec.options
    problems = spec.key_problems()
    if not problems:
        world_size = world_size or spec.world_size(detect_external_launch())
    cuda = not needed() if target_cuda is None else target_cuda
    te = te_available() if target_cuda is None else target_cuda
    ctx = spec.context(world_size, cuda=cuda, te=te) if not problems else Context(keys=NEMO_KEYS, cuda=cuda, te=te)
    problems += spec.choice_problems()
    problems += options.problems(ctx)
    if not cuda and not options.optim.state.problems():  # what cannot run on a CPU-only build
        problems += model_state_cpu_problems(options.optim.state, force=target_cuda is False,
                                             checkpointing=ctx.checkpointing,
                                             checkpoint_key=NEMO_KEYS["checkpointing"])
    problems += init_from_problems(spec)  # init_from: the path and the model fields the command line overrides
    problems += data_problems(spec)  # the data kind, packing, the files it reads, a tokenizer on this machine
    problems += model_field_problems(spec)  # model.seq_length=4k: the field's kind, named
    problems += run_path_problems(spec)  # output_dir / checkpoint.dir writable, room for the checkpoints kept
    if not problems:
        _collect(problems, lambda: spec.global_batch_size(world_size))
    return problems


def preflight(args: List[str], config_name: str = "train", target_cuda: Optional[bool] = None) -> List[str]:
    """What ``nemo-longctx train <args>`` would refuse before building anything: the command line composed by Hydra's
    compose API (a malformed override, an unknown group choice or key), read into the run spec, the recipe's
    settings filled in (``training_recipe.resolve``: a real model's recipe is read from NeMo) and every config-level
    problem. The app runs it in the launching process; tests call it in-process for many command lines."""
    from nemo_longctx.shared.overrides import compose

    cfg, problems = compose(config_name, args, hydra_config=True)
    if problems or cfg is None:  # None: a Hydra flag it does not model (the run's own checks still apply)
        return problems
    spec = read_run_spec(cfg)
    try:
        spec = resolve_recipe(spec)
    except ConfigError as e:
        return e.problems
    return config_problems(spec, target_cuda=target_cuda)


def recipe_pending(spec: RunSpec) -> bool:
    """Whether a train spec still has keys its recipe fills (``resolve_recipe``)."""
    return spec.app == "train" and spec.recipe_pending([k for k in DEMO_SETTINGS if k != "trainer.global_batch_size"])


def resolve_recipe(spec: RunSpec, world_size: Optional[int] = None) -> RunSpec:
    """The spec with its recipe's values in the keys it leaves null (``training_recipe.resolve``), for the model group
    chosen (the spec's Hydra choices); a spec with nothing left to fill is returned as it is."""
    from nemo_longctx.integrations.nemo import training_recipe

    if not recipe_pending(spec):
        return spec
    return training_recipe.resolve(spec, training_recipe.model_choice(spec.choices), world_size)


def save_time_warning(spec: RunSpec) -> Optional[str]:
    """With save-on-signal: a warning when the planner's estimate of one checkpoint save exceeds
    ``run.signal_grace_s`` (``planner.save_time_warning``), else None."""
    if not spec.checkpoint.save_on_signal:
        return None
    from nemo_longctx.planner.search import save_time_warning as estimated

    return estimated(dict(spec.model.fields), planner_precision(spec).param_bytes, float(spec.run.signal_grace_s))


def vocabulary_problems(spec: RunSpec, config: Any) -> List[str]:
    """A data tokenizer whose ids reach past the model's embedding table would fail in the training step (an
    IndexError in the embedding lookup): refused when the model config is built (``build``), naming both sizes."""
    if str(spec.data.kind) not in ("indexed", "documents", "packed_sft"):
        return []
    from nemo_longctx.integrations.nemo.documents import tokenizer_dir

    tok = spec.data.tokenizer
    if tok is None and spec.init_from.path is None:
        return []
    path = tokenizer_dir(spec)
    if not path.is_dir():
        return []  # a cached hub id: read by the ranks (config-level checks found it in the cache)
    from transformers import AutoTokenizer

    size = len(AutoTokenizer.from_pretrained(str(path)))
    vocab = getattr(config, "vocab_size", None)
    if vocab is not None and size > int(vocab):
        key = "data.tokenizer" if tok is not None else "init_from's tokenizer"
        return [f"{key} ({path}) has {size} tokens but the model's vocabulary (model.vocab_size) is {vocab}: token "
                f"ids >= {vocab} would index past the embedding table; use the model's own tokenizer or set "
                f"model.vocab_size >= {size}"]
    return []


# ------------------------------------------------------------------------------------------------ builders
@dataclass
class Built:
    model_config: Any
    model: Any
    strategy: Any
    trainer: Any
    data: Any
    world_size: int
    global_batch_size: int
    log: Any = None      # nl.NeMoLogger
    resume: Any = None   # nl.AutoResume or None
    options: Any = None  # the run's LongContextOptions
    spec: Any = None     # the run's RunSpec


def te_available() -> bool:
    import importlib.util

    return importlib.util.find_spec("transformer_engine") is not None


def build_model_config(spec: RunSpec, notes: Optional[List[str]] = None) -> Any:
    """The model config the model group (or ``init_from``) describes, extended with our layer spec; what was changed
    on the way that the user should know (``model.cp_comm_type`` aligned with ``cp.algorithm``) is appended to
    ``notes``. The model group's node goes to Hydra's ``instantiate`` (its ``_target_``) unread."""
    import hydra

    from nemo_longctx.integrations.nemo.model import align_cp_comm_type_with_io, enable_long_context

    options = spec.options
    kwargs = {}
    if spec.model.get("apply_rope_fusion", True) and not te_available():
        # Megatron refuses apply_rope_fusion without TransformerEngine (TransformerConfig.__post_init__); a kernel
        # choice only, so it is turned off where TE is missing (CPU machines) and kept as configured elsewhere.
        kwargs["apply_rope_fusion"] = False
    if spec.init_from.path is not None:  # the checkpoint's config + the command line's safe model.<field> overrides
        from nemo_longctx.integrations.nemo.hf import cpu_kernel_flags_off
        from nemo_longctx.integrations.nemo.pretrained import pretrained_model_config

        config = pretrained_model_config(spec)[0]
        if not te_available():
            cpu_kernel_flags_off(config)  # fused kernels of the checkpoint's config that need CUDA/TE/Apex
    else:
        config = hydra.utils.instantiate(spec.model.node, _convert_="all", **kwargs)
    if spec.data.packed:
        # Packed documents: the CP ranks hold different numbers of real tokens (each document padded to 2*cp), and
        # Megatron otherwise averages each rank's own token mean; per-token loss (Megatron divides the summed
        # gradients by the tokens of the whole batch) weighs every real token the same, as at cp=none. NeMo
        # requires the same for packed fine-tuning under CP.
        config.calculate_per_token_loss = True
    note = align_cp_comm_type_with_io(config, options.cp.algorithm, explicit="cp_comm_type" in spec.model.fields)
    if note is not None and notes is not None:
        notes.append(note)
    return enable_long_context(config, options.cp.algorithm, **options.cp.attention_kwargs)


def build_data(spec: RunSpec, model_config: Any, gbs: int, balance: bool = False) -> Any:
    """The data module of ``data.kind``: synthetic | indexed (Megatron indexed dataset; both take
    ``data.packing=documents``: per-document attention, documents from the reset position ids) | packed_sft (NeMo's
    packed fine-tuning data: ``PackedSequenceSpecs`` with the packed ``.npy`` files). ``balance`` (document-aware
    CP): with ``data.packing=documents`` each global batch's samples are spread over the data-parallel ranks by
    attention cost (``data_balance.CostBalancedBatches``)."""
    from nemo_longctx.integrations.nemo.data import check_packing

    d = spec.data
    kind = d.kind
    mbs = int(spec.trainer.micro_batch_size)
    packing = check_packing(str(d.packing), mbs) if kind != "packed_sft" else "none"
    if kind == "synthetic":
        from nemo_longctx.integrations.nemo.data import SyntheticDataModule

        if model_config.vocab_size is None:
            raise ValueError("model.vocab_size must be set for data=synthetic")
        return SyntheticDataModule(
            seq_length=model_config.seq_length, vocab_size=model_config.vocab_size, micro_batch_size=mbs,
            global_batch_size=gbs, num_train_samples=int(d.num_train_samples),
            num_val_samples=int(d.num_val_samples), period=int(d.period),
            skew=float(d.skew), seed=int(d.seed), packing=packing,
            doc_length=int(d.doc_length), balance_data_parallel=balance,
        )
    if kind in ("indexed", "documents"):
        from nemo.collections.common.tokenizers.huggingface.auto_tokenizer import AutoTokenizer

        from nemo_longctx.integrations.nemo.data import pretraining_data_module
        from nemo_longctx.integrations.nemo.documents import dataset_prefix, tokenizer_dir

        if kind == "documents":  # raw documents, written as an indexed dataset before the ranks started
            paths = [dataset_prefix(spec)]
        else:
            paths = list(d.paths) if isinstance(d.paths, tuple) else d.paths
        documents = packing == "documents"
        tokenizer = AutoTokenizer(str(tokenizer_dir(spec)))  # data.tokenizer, else init_from's
        return pretraining_data_module(
            documents, balance_data_parallel=balance, paths=paths, seq_length=model_config.seq_length,
            tokenizer=tokenizer, micro_batch_size=mbs, global_batch_size=gbs, split=str(d.split),
            num_workers=int(d.num_workers), seed=int(d.seed), reset_attention_mask=documents,
            reset_position_ids=documents, create_attention_mask=False,
        )
    if kind == "packed_sft":
        from nemo_longctx.integrations.nemo.data import packed_sft_data_module

        return packed_sft_data_module(d, model_config.seq_length, mbs, gbs)
    raise ValueError(f"data.kind={kind!r} is not known (synthetic | indexed | documents | packed_sft)")


def build_optimizer(spec: RunSpec, precision: str) -> Any:
    from megatron.core.optimizer import OptimizerConfig
    from nemo import lightning as nl
    from nemo.lightning.pytorch.optim import CosineAnnealingScheduler

    from nemo_longctx.integrations.megatron.model_state import optimizer_config

    o = spec.options.optim
    opt_config = optimizer_config(o.state, lr=float(o.lr), weight_decay=float(o.weight_decay),
                                  clip_grad=float(o.clip_grad), adam_beta1=float(o.adam_beta1),
                                  adam_beta2=float(o.adam_beta2), adam_eps=float(o.adam_eps), precision=precision)
    assert isinstance(opt_config, OptimizerConfig)
    sched = CosineAnnealingScheduler(
        max_steps=int(spec.trainer.max_steps), warmup_steps=int(o.warmup_steps), constant_steps=0,
        min_lr=float(o.min_lr),
    )
    return nl.MegatronOptimizerModule(config=opt_config, lr_scheduler=sched)


def build_checkpointing(spec: RunSpec) -> tuple:
    """(``nl.NeMoLogger``, ``nl.AutoResume`` or None, ``nl.ModelCheckpoint`` or None) of the ``checkpoint`` group.

    NeMo's own log files go to ``<output_dir>/logs`` (NeMoLogger moves a previous run's files into ``run_N`` there),
    TensorBoard events to ``<output_dir>/tensorboard``, ``metrics.jsonl`` stays in ``output_dir``; checkpoints go to
    ``checkpoint.dir`` in Megatron's distributed format (torch_dist, through the strategy's MegatronCheckpointIO),
    named by step and consumed samples; the ``checkpoint.keep`` most recent are kept (plus NeMo's ``-last`` copy).
    """
    from lightning.pytorch.loggers import TensorBoardLogger
    from nemo import lightning as nl

    out = os.path.abspath(str(spec.output_dir))
    c = spec.checkpoint
    every = int(c.every_n_steps or 0)
    minutes = float(c.every_minutes or 0)
    ckpt = None
    if every > 0 or minutes > 0:
        from datetime import timedelta

        interval = ({"every_n_train_steps": every} if every > 0 else
                    {"train_time_interval": timedelta(minutes=minutes)})
        ckpt = nl.ModelCheckpoint(
            dirpath=os.path.abspath(spec.checkpoint_dir), filename="{step}-{consumed_samples}",
            **interval, save_top_k=int(c.keep), monitor="step", mode="max",
            save_last=True, save_on_train_epoch_end=False, save_optim_on_train_end=True,  # resumable at the end too
            always_save_context=True, save_context_on_train_end=True,
            verbose=False,
        )
    tb = TensorBoardLogger(save_dir=out, name="tensorboard", version="") if spec.log.tensorboard else None
    log = nl.NeMoLogger(explicit_log_dir=os.path.join(out, "logs"), ckpt=ckpt, tensorboard=tb,
                        update_logger_directory=False)
    mode = str(c.resume)
    resume = None
    if mode == "auto":
        resume = _auto_resume_class()(resume_if_exists=True, resume_ignore_no_checkpoint=True,
                                      resume_from_directory=os.path.abspath(spec.checkpoint_dir))
    elif mode != "never":
        resume = _auto_resume_class()(resume_from_path=os.path.abspath(mode))
    if spec.init_from.path is not None:  # pretrained weights, unless this run resumes from its own checkpoint
        from nemo_longctx.integrations.nemo.pretrained import restore_config

        resume = resume or _auto_resume_class()(resume_if_exists=False)
        resume.restore_config = restore_config(spec)
    return log, resume, ckpt


def newest_complete_checkpoint(directory: str) -> tuple:
    """(the newest complete and intact checkpoint directory of ``directory`` or None, [(name, why)] of those skipped).

    NeMo's ModelCheckpoint marks a checkpoint ``<name>-unfinished`` (a file beside it) until every rank has written
    it; a finished one is also verified against its own distributed-checkpoint metadata (a storage file cut short or
    missing, ``.metadata`` unreadable: ``checkpoint_integrity``); newest = the highest ``step=N`` in the name, NeMo's
    ``-last`` copy first on a tie, then the newest mtime (``resume_checks.newest_intact``)."""
    from nemo.lightning.pytorch.callbacks.model_checkpoint import ModelCheckpoint

    from nemo_longctx.shared.resume_checks import newest_intact

    return newest_intact(directory, ModelCheckpoint.is_checkpoint_unfinished)


def resume_line(path: Any, searched: Any, skipped_damaged: bool = False, restore: Any = None) -> Optional[str]:
    """What auto-resume (``searched``: the directory it looked in, None when it did not look) or
    ``checkpoint.resume=<path>`` decided, in one line: ``resuming from <checkpoint>: N steps done, training continues
    at step N+1`` or ``no checkpoint in <dir>: starting at step 0`` (from init_from's weights when ``restore``, NeMo's
    RestoreConfig, is set). NeMo names a checkpoint by the step index logged during its last step (``step=3`` holds 4
    finished steps)."""
    import re

    if path:
        steps = re.findall(r"step=(\d+)", str(path))
        done = int(steps[-1]) + 1 if steps else None
        return f"resuming from {path}" + (f": {done} steps done, training continues at step {done + 1}"
                                          if done is not None else "")
    if not searched:
        return None
    start = "starting at step 0" + (f" from the weights of {restore.path}" if getattr(restore, "path", None) else "")
    return f"no {'intact ' if skipped_damaged else ''}checkpoint in {searched}: {start}"


def _auto_resume_class() -> type:
    """``nl.AutoResume`` that also works when this run saves no checkpoints (``checkpoint.every_n_steps=0``): NeMo's
    ``setup`` records the restored path on ``trainer.checkpoint_callback``, which is then absent."""
    from nemo import lightning as nl

    class AutoResume(nl.AutoResume):
        def _find_trainer_ckpt_path(self) -> Any:
            """``checkpoint.resume=auto``: the newest *complete and intact* checkpoint of the directory, naming every
            unfinished or damaged one it skips (NeMo's own search reads only ``*-last`` and gives up when that one is
            unfinished; a damaged one it would load, and fail on every rank)."""
            if not self.resume_from_directory or not os.path.isdir(str(self.resume_from_directory)):
                return super()._find_trainer_ckpt_path()
            path, skipped = newest_complete_checkpoint(str(self.resume_from_directory))
            self._skipped_damaged = any(why.startswith("damaged") for _, why in skipped)
            if skipped and rank_from_env() == 0:
                for name, why in skipped:
                    print(f"nemo-longctx: auto-resume skips {name}: {why}", flush=True)
            return path

        def get_trainer_ckpt_path(self, model: Any = None) -> Any:
            """The checkpoint this run resumes from, said on rank 0 (NeMo's own message is filtered as noise)."""
            path = super().get_trainer_ckpt_path(model)
            if rank_from_env() == 0:
                line = resume_line(path, self.resume_from_directory if self.resume_if_exists else None,
                                   getattr(self, "_skipped_damaged", False), self.restore_config)
                if line:
                    print(f"nemo-longctx: {line}", flush=True)
            return path

        def setup(self, trainer: Any, model: Any = None) -> None:
            if trainer.checkpoint_callback is not None:
                return super().setup(trainer, model)
            path = self.get_trainer_ckpt_path(model)
            if path:
                trainer.ckpt_path = path
            elif self.restore_config is not None:  # init_from: the strategy loads these weights after building
                self.restore_config.path = str(self._extract_path(path=self.restore_config.path))
                trainer.strategy.restore_config = self.restore_config

    return AutoResume


def build(spec: RunSpec, launch: Optional[Launch] = None, extra_callbacks: Optional[List[Any]] = None,
          checked: bool = False) -> Built:
    """Build and validate every NeMo object of the run; nothing is launched or trained. ``checked``: the spec's
    config-level problems were already reported (by the launching process) and are not checked again. Every problem
    found -- config-level and against the model config -- is raised together (``ConfigError``)."""
    import torch
    from lightning.pytorch.plugins.environments import TorchElasticEnvironment
    from nemo import lightning as nl
    from nemo.collections import llm

    from nemo_longctx.integrations.megatron.model_state import grad_reduce_in_fp32
    from nemo_longctx.integrations.megatron.validation import model_problems
    from nemo_longctx.integrations.nemo.callbacks import (
        ConfigConsensus,
        FaultInjection,
        SaveFinalParameters,
        RunGuards,
        StepMetrics,
        VerifyLongContextAttention,
    )
    from nemo_longctx.integrations.nemo.memory_callbacks import ActivationMemoryMetrics, MemoryOptionsCallback
    from nemo_longctx.integrations.nemo.model_state_callback import FsdpCheckpointState, ModelStateCheck
    from nemo_longctx.integrations.nemo.sequence_tiling import SequenceTiling
    from nemo_longctx.integrations.nemo.strategy import LongContextStrategy, strategy_kwargs

    if recipe_pending(spec):  # (a spec read without the app: the recipe's values first, as the app does)
        spec = resolve_recipe(spec, world_size=spec.world_size(launch))
    options = spec.options
    problems = [] if checked else config_problems(spec)
    raise_problems(problems)  # the model checks below assume valid options
    world = spec.world_size(launch)
    p = spec.parallel_sizes()
    cp = options.cp
    notes: List[str] = []
    model_config = _collect(problems, lambda: build_model_config(spec, notes))
    if launch is None or launch.rank == 0:
        for note in notes:
            print(f"nemo-longctx: {note}", flush=True)
    gbs = _collect(problems, lambda: spec.global_batch_size(world))
    if model_config is not None:
        problems += model_problems(model_config, options, world, p["tp"], p["pp"], Context(keys=NEMO_KEYS))
        problems += vocabulary_problems(spec, model_config)
    raise_problems(problems)
    from nemo_longctx.integrations.megatron.batch import cost_model_of, set_document_placement

    # how this process's data step lays packed documents out over the CP ranks (cp.split_min_tokens)
    set_document_placement(cp.split_min_tokens if cp.document_aware else "off", cost_model_of(model_config))

    backend = str(spec.launcher.backend)
    state = options.optim.state
    state_kwargs = {"save_ckpt_format": "torch_dist", **strategy_kwargs(state)}
    if state.optimizer_cpu_offload:
        from nemo_longctx.integrations.megatron.model_state import allow_offload_optimizer_classes_in_checkpoints

        allow_offload_optimizer_classes_in_checkpoints()  # resume: its param groups hold optimizer classes
    strategy = LongContextStrategy(
        tensor_model_parallel_size=p["tp"], pipeline_model_parallel_size=p["pp"], context_parallel_size=cp.size,
        sequence_parallel=bool(spec.trainer.layout.sequence_parallel), cp_algorithm=cp.algorithm,
        cp_algorithm_kwargs=cp.attention_kwargs, collective_timeout_s=spec.launcher.timeout_s,
        process_group_backend=None if backend == "auto" else backend,
        ckpt_load_strictness=None, **state_kwargs,
        # NeMo's asynchronous save needs CUDA: on a CPU build the checkpoint is written synchronously
        ckpt_async_save=bool(spec.checkpoint.async_save) and torch.cuda.is_available(),
    )
    strategy.validated_config = model_config  # checked above: connect() does not check it again

    precision = str(spec.trainer.precision)
    model_cls, tokenizer = llm.GPTModel, None
    if spec.init_from.path is not None:  # LlamaModel/Qwen2Model (NeMo's HF exporter is registered on them)
        from nemo_longctx.integrations.nemo.hf import pretrained_model
        from nemo_longctx.integrations.nemo.pretrained import checkpoint_path

        model_cls, _, tokenizer = pretrained_model(checkpoint_path(spec))
    model = model_cls(model_config, optim=build_optimizer(spec, precision), tokenizer=tokenizer)
    data = build_data(spec, model_config, gbs, balance=cp.document_aware)
    log, resume, ckpt = build_checkpointing(spec)

    accelerator = spec.trainer.accelerator
    if accelerator == "auto":
        accelerator = "gpu" if torch.cuda.is_available() else "cpu"
    devices = launch.local_world_size if launch is not None else int(spec.trainer.devices)
    num_nodes = launch.num_nodes if launch is not None else int(spec.trainer.num_nodes)
    plugins: List[Any] = [nl.MegatronMixedPrecision(precision=precision,
                                                    grad_reduce_in_fp32=grad_reduce_in_fp32(state))]
    if launch is not None:
        plugins.append(TorchElasticEnvironment())
    tokens_per_step = gbs * int(model_config.seq_length)
    metrics = options.metrics
    mem_metrics = ActivationMemoryMetrics(count_peak=metrics.track_peak, track_activations=metrics.track)
    # ^ before StepMetrics: its step-end hook closes the tracker that StepMetrics then reads
    callbacks: List[Any] = [
        ConfigConsensus(spec.config_hash(), os.environ.get("NEMO_LONGCTX_CONFIG_HASH")),
        mem_metrics,
        StepMetrics(str(spec.output_dir), tokens_per_step, metrics.print_every, extra=mem_metrics,
                    balance=spec.data.packed),
        VerifyLongContextAttention(cp.size, cp.algorithm, p["pp"]),
        RunGuards(cp.size, tokens_per_step, metrics.print_every),
    ]
    if not options.memory.trivial:
        callbacks.append(MemoryOptionsCallback(options.memory))
    if options.tiling.active:
        callbacks.append(SequenceTiling(options.tiling))
    callbacks.append(ModelStateCheck(state, output_dir=str(spec.output_dir)))
    if state.megatron_fsdp and ckpt is not None:
        callbacks.append(FsdpCheckpointState())
    run = spec.run
    if run.save_final_params:
        callbacks.append(SaveFinalParameters(os.path.join(str(spec.output_dir), "final_params.pt")))
    if run.fault:
        callbacks.append(FaultInjection.parse(str(run.fault)))
    if spec.checkpoint.save_on_signal:
        from nemo_longctx.integrations.nemo.preemption import SaveOnSignal

        callbacks.append(SaveOnSignal(signals_of(run.signals), float(run.signal_grace_s)))
    callbacks += list(extra_callbacks or [])
    if ckpt is not None:
        callbacks.append(ckpt)
    vci = spec.trainer.val_check_interval
    trainer = nl.Trainer(
        accelerator=accelerator, devices=devices, num_nodes=num_nodes, max_steps=int(spec.trainer.max_steps),
        strategy=strategy, plugins=plugins, callbacks=callbacks, logger=False, enable_checkpointing=ckpt is not None,
        enable_progress_bar=False, log_every_n_steps=1, use_distributed_sampler=False,
        limit_val_batches=int(spec.trainer.limit_val_batches) if vci else 0,
        val_check_interval=int(vci) if vci else None, check_val_every_n_epoch=None if vci else 1,
        num_sanity_val_steps=0,
    )
    _keep_checkpoint_context_loadable(trainer)
    return Built(model_config, model, strategy, trainer, data, world, gbs, log, resume, options, spec)


def _collect(problems: List[str], check: Any) -> Any:
    """Run one builder; a ValueError (its message names the key) becomes a problem instead of stopping the pass."""
    try:
        return check()
    except ConfigError as e:
        problems.extend(e.problems)
    except ValueError as e:
        problems.append(str(e))
    return None


def _keep_checkpoint_context_loadable(trainer: Any) -> None:
    """NeMo writes the trainer's constructor arguments into every checkpoint's context (``io.json``), pickling the
    objects it cannot describe, and its loader (``nemo.lightning.io.load_context``) unpickles only NeMo/torch/
    Lightning/... classes: our callbacks in that record made a full ``load_context`` of a checkpoint fail (NeMo's
    ``HFQwen2Exporter`` does one). They are run machinery, not part of the model: the record keeps NeMo's and
    Lightning's own callbacks only (the running trainer keeps all of them), and no cluster environment (rebuilding
    torchrun's outside torchrun fails)."""
    from lightning.fabric.plugins.environments import ClusterEnvironment

    record = getattr(trainer, "__io__", None)
    if record is not None and getattr(record, "callbacks", None):
        record.callbacks = [c for c in record.callbacks
                            if type(c).__module__.split(".")[0] in ("nemo", "lightning", "pytorch_lightning")]
    if record is not None and getattr(record, "plugins", None):  # the launcher's environment (torchrun/srun) too:
        record.plugins = [p for p in record.plugins if not isinstance(p, ClusterEnvironment)]  # absent at load time


def fit(built: Built) -> None:
    """Train with NeMo's own entry point (``llm.train``: NeMoLogger set-up, AutoResume, fit)."""
    from nemo.collections import llm

    llm.train(built.model, built.data, built.trainer, log=built.log, resume=built.resume)


def predicted_memory(spec: RunSpec, seq_length: int, p: Dict[str, int], world_size: int) -> str:
    """The planner's per-GPU device memory and per-node host memory for this exact configuration (one line), or
    why it has none."""
    from nemo_longctx.integrations.megatron.cpu_compat import needed
    from nemo_longctx.planner.search import ACTIVATION_PRESETS, GIB, Hardware, candidate_of, memory_breakdown

    shape, why = planner_shape(spec)
    if shape is None:
        return f"not modelled ({why})"
    c = candidate_of(spec.options, seq_length, p["tp"], bool(spec.trainer.layout.sequence_parallel))
    if c is None or p["pp"] > 1:
        return "not modelled (offload=modules, selective recompute of other modules, or pipeline parallelism)"
    precision = planner_precision(spec)
    # this process's device, else the accelerator the config asks for (a dry run on a login node for a GPU job)
    if not needed():
        coef = "te_gpu" if te_available() else "local_gpu"
    else:
        coef = "te_gpu" if str(spec.trainer.accelerator) in ("gpu", "cuda") else "local_cpu"
    hw = Hardware(gpus=world_size, gpus_per_node=max(1, int(spec.trainer.devices)))
    m = memory_breakdown(shape, seq_length, hw, c, precision, ACTIVATION_PRESETS[coef])
    parts = ", ".join(f"{k} {v / GIB:.2f}" for k, v in (("weights", m.weights), ("grads", m.grads),
                                                          ("optimizer", m.optimizer), ("activations", m.activations),
                                                          ("transient", m.transient), ("comm", m.comm)))
    return (f"{(m.total - m.reserve) / GIB:.2f} GiB per GPU at the step's peak ({parts}; {m.peak_phase} phase) + "
            f"{m.reserve / GIB:g} GiB reserve; host {m.host_offload / GIB:.2f} GiB per GPU process (planner, "
            f"{coef} coefficients)")


def recipe_line(spec: RunSpec, global_batch: int, seq_length: int) -> Optional[str]:
    """A real model's start line: the recipe and the values the run trains with (None for the CPU demo)."""
    if spec.recipe in (None, "demo"):
        return None
    o = spec.options.optim
    return (f"nemo-longctx train: recipe {spec.recipe} (NVIDIA NeMo): {spec.trainer.precision}, lr {o.lr:g} -> "
            f"{o.min_lr:g} after {o.warmup_steps} warm-up steps, {global_batch} sequences "
            f"({global_batch * seq_length:,} tokens) per step, checkpoints {spec.checkpoint.interval()}")


def checkpoint_summary(spec: RunSpec) -> str:
    """The dry run's checkpoint line: interval, where, how many kept, the size of one, asynchronous or not, resume."""
    c = spec.checkpoint
    resume = f"resume={c.resume}"
    if not c.saves:
        return f"none (a requeued or restarted run starts over), {resume}"
    every = c.interval() + (" of training" if "minutes" in c.interval() else "")
    size = ""
    shape, _ = planner_shape(spec)
    if shape is not None:
        from nemo_longctx.planner.search import checkpoint_bytes

        size = f", {checkpoint_bytes(shape, planner_precision(spec)) / 1e9:.1f} GB each"
    import torch

    mode = ("synchronous" if not c.async_save else "asynchronous" if torch.cuda.is_available()
            else "asynchronous on GPUs, synchronous on this CPU machine")
    return (f"{every} and at the end -> {spec.checkpoint_dir} (keep {c.keep}{size}; {mode}), {resume}, save "
            f"on a signal: {'yes' if c.save_on_signal else 'no'}")


def data_summary(spec: RunSpec) -> str:
    """The dry run's data line: the kind and what it reads."""
    d = spec.data
    kind = str(d.kind)
    packed = ", packed documents" if d.packed else ""
    if kind == "synthetic":
        return "synthetic (random tokens)" + packed
    paths = d.paths or d.packed_train
    return (f"{kind}: {list(paths) if isinstance(paths, tuple) else paths}, tokenizer "
            f"{d.tokenizer or 'of init_from'}" + packed)


def dry_run(spec: RunSpec, checked: bool = False) -> Dict[str, Any]:
    """Build + validate the real NeMo objects, resolve every layer's core_attention from the layer/block spec,
    print a summary; no process group, no training. Returns the summary dict."""
    from nemo_longctx.integrations.megatron.core_attention import LongContextCoreAttention
    from nemo_longctx.integrations.megatron.mcore_versions import block_submodules
    from nemo_longctx.integrations.megatron.spec import core_attention_modules, layer_specs_of

    built = build(spec, checked=checked)
    spec, options = built.spec, built.options
    config = built.model_config
    built.strategy.connect(built.model)  # the real attach path: parallel sizes -> config, extension, validation
    layer_spec = config.transformer_layer_spec(config)
    modules = []
    for pp_rank in range(int(config.pipeline_model_parallel_size)):  # every pipeline stage's layers
        modules += core_attention_modules(block_submodules(config, layer_spec, pp_rank))
    if len(modules) != config.num_layers or not all(m is LongContextCoreAttention for m in modules):
        raise RuntimeError(f"core_attention does not resolve to LongContextCoreAttention in every layer: {modules}")
    p, t, o = spec.parallel_sizes(), spec.trainer, options.optim
    summary = {
        "model": type(config).__name__,
        "num_layers": config.num_layers,
        "hidden_size": config.hidden_size,
        "heads": f"{config.num_attention_heads}q/{config.num_query_groups}kv",
        "seq_length": config.seq_length,
        "cp": options.cp.describe(),
        "tp": p["tp"], "pp": p["pp"], "dp": built.world_size // (p["cp"] * p["tp"] * p["pp"]),
        "world_size": built.world_size,
        "tokens_per_cp_rank": config.seq_length // p["cp"],
        "global_batch_size": built.global_batch_size,
        "context_parallel_size_on_config": config.context_parallel_size,
        "layer_spec": getattr(getattr(layer_specs_of(layer_spec)[0].submodules.self_attention.submodules,
                                      "linear_qkv", None), "__name__", "?"),  # a block spec's first layer; MLA: ?
        "core_attention": f"{len(modules)}/{config.num_layers} layers {LongContextCoreAttention.__name__}",
        "strategy": type(built.strategy).__name__,
        "trainer": f"{type(built.trainer).__name__}(devices={t.devices}, num_nodes={t.num_nodes})",
        "recipe": (f"{spec.recipe} (NVIDIA NeMo's recipe: its values fill the keys left null)"
                   if spec.recipe not in (None, "demo") else "demo (the CPU demo's settings)"),
        "precision": str(t.precision),
        "optimizer": (f"{o.state.optimizer} lr {o.lr:g} -> min {o.min_lr:g} (cosine), warm-up "
                      f"{o.warmup_steps} steps, weight decay {o.weight_decay:g}, clip "
                      f"{o.clip_grad:g}, betas ({o.adam_beta1:g}, {o.adam_beta2:g}), eps "
                      f"{o.adam_eps:g}"),
        "steps": f"{t.max_steps} x {built.global_batch_size * config.seq_length:,} tokens per step",
        "init_from": (f"{spec.init_from.path} ({type(built.model).__name__}, weights restored by NeMo's "
                      "RestoreConfig)" if spec.init_from.path else "none (random initialisation)"),
        "memory": options.memory.describe(),
        "model_state": options.optim.state.describe(),
        "tiling": options.tiling.describe(config.seq_length, p["cp"], p["tp"], bool(config.sequence_parallel)),
        "checkpoint": checkpoint_summary(spec),
        "data": data_summary(spec),
        "predicted_memory": predicted_memory(spec, config.seq_length, p, built.world_size),
        "config_hash": spec.config_hash()[:16],
    }
    print("dry run OK (nothing trained):")
    for k, v in summary.items():
        print(f"  {k:32s} {v}")
    return summary
