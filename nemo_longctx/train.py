"""``nemo-longctx train`` / ``python -m nemo_longctx.train``: the Hydra app for NeMo 2 pre-training with nemo_longctx
context parallelism.

Flow: compose the config (``conf/train.yaml`` + overrides) -> [no torchrun/srun and world > 1: spawn the local
processes, each re-running this app] -> build the NeMo objects (model config with our core attention in every
layer, ``LongContextStrategy``, ``nl.Trainer``, data module, optimizer) -> validate (messages name the config
fields) -> ``trainer.fit``. ``run.dry_run=true`` builds and validates the same objects in one process, proves
that every layer's ``core_attention`` resolves to ``LongContextCoreAttention``, prints a summary, and exits.

Extension points for other features: see ``feature_callbacks`` / ``feature_model_overrides`` (config groups
``recompute``, ``offload``, ``tiling``), ``cp_algorithms.register_cp_algorithm`` and ``conf/cp/*.yaml``.
"""

from __future__ import annotations

import os
import sys
import time
from dataclasses import dataclass
from typing import Any, Dict, List, Optional

import hydra
from omegaconf import DictConfig, OmegaConf

from nemo_longctx.integrations.nemo.launch import Launch, detect_external_launch, spawn_local

CONFIG_PATH = "pkg://nemo_longctx.conf"
CONFIG_NAME = "train"
FEATURE_GROUPS = ("recompute", "offload", "tiling")


# ------------------------------------------------------------------------------------------------ config helpers
def parallel_sizes(cfg: DictConfig) -> Dict[str, int]:
    s = cfg.trainer.strategy
    return {"cp": int(cfg.cp.size), "tp": int(s.tensor_model_parallel_size), "pp": int(s.pipeline_model_parallel_size)}


def world_size_of(cfg: DictConfig, launch: Optional[Launch] = None) -> int:
    if launch is not None:
        return launch.world_size
    return int(cfg.trainer.devices) * int(cfg.trainer.num_nodes)


def global_batch_size(cfg: DictConfig, world_size: int) -> int:
    p = parallel_sizes(cfg)
    dp = max(1, world_size // (p["cp"] * p["tp"] * p["pp"]))
    mbs = int(cfg.trainer.micro_batch_size)
    gbs = cfg.trainer.global_batch_size
    gbs = mbs * dp if gbs is None else int(gbs)
    if gbs % (mbs * dp) != 0:
        raise ValueError(
            f"trainer.global_batch_size={gbs} must be a multiple of trainer.micro_batch_size={mbs} x data-parallel "
            f"size {dp}"
        )
    return gbs


def cp_algorithm_kwargs(cfg: DictConfig) -> Dict[str, Any]:
    node = cfg.cp.get("kwargs")
    return OmegaConf.to_container(node, resolve=True) if node else {}


def feature_callbacks(cfg: DictConfig) -> List[Any]:
    """Lightning callbacks declared by the optional feature groups (``<group>.callbacks: [{_target_: ...}]``)."""
    out = []
    for group in FEATURE_GROUPS:
        node = cfg.get(group)
        if node is not None and node.get("callbacks"):
            out.extend(_instantiate_callback(c) for c in node.callbacks)
    return out


def _instantiate_callback(node: Any) -> Any:
    """``hydra.utils.instantiate``, re-raising a callback's own ValueError (its config check names the field)
    instead of Hydra's InstantiationException wrapper."""
    from hydra.errors import InstantiationException

    try:
        return hydra.utils.instantiate(node, _convert_="all")
    except InstantiationException as e:
        if isinstance(e.__cause__, ValueError):
            raise e.__cause__ from None
        raise


def memory_options_of(cfg: DictConfig) -> Any:
    """``MemoryOptions`` of the ``recompute`` and ``offload`` groups (absent groups: none)."""
    from nemo_longctx.integrations.megatron.memory_options import memory_options

    def group(name: str) -> Optional[Dict[str, Any]]:
        node = cfg.get(name)
        return OmegaConf.to_container(node, resolve=True) if node is not None else None

    return memory_options(group("recompute"), group("offload"))


def feature_model_overrides(cfg: DictConfig) -> Dict[str, Any]:
    """Model-config fields set by the optional feature groups (``<group>.model_overrides: {field: value}``)."""
    out: Dict[str, Any] = {}
    for group in FEATURE_GROUPS:
        node = cfg.get(group)
        if node is not None and node.get("model_overrides"):
            out.update(OmegaConf.to_container(node.model_overrides, resolve=True))
    return out


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


def te_available() -> bool:
    import importlib.util

    return importlib.util.find_spec("transformer_engine") is not None


def build_model_config(cfg: DictConfig) -> Any:
    from nemo_longctx.integrations.nemo.model import enable_long_context

    kwargs = {}
    if cfg.model.get("apply_rope_fusion", True) and not te_available():
        # Megatron refuses apply_rope_fusion without TransformerEngine (TransformerConfig.__post_init__); a kernel
        # choice only, so it is turned off where TE is missing (CPU machines) and kept as configured elsewhere.
        kwargs["apply_rope_fusion"] = False
    config = hydra.utils.instantiate(cfg.model, _convert_="all", **kwargs)
    for field, value in feature_model_overrides(cfg).items():
        if not hasattr(config, field):
            raise ValueError(f"model_overrides: {type(config).__name__} has no field {field!r}")
        setattr(config, field, value)
    return enable_long_context(config, str(cfg.cp.algorithm), **cp_algorithm_kwargs(cfg))


def build_data(cfg: DictConfig, model_config: Any, gbs: int) -> Any:
    kind = cfg.data.kind
    mbs = int(cfg.trainer.micro_batch_size)
    if kind == "synthetic":
        from nemo_longctx.integrations.nemo.data import SyntheticDataModule

        if model_config.vocab_size is None:
            raise ValueError("model.vocab_size must be set for data=synthetic")
        return SyntheticDataModule(
            seq_length=model_config.seq_length, vocab_size=model_config.vocab_size, micro_batch_size=mbs,
            global_batch_size=gbs, num_train_samples=int(cfg.data.num_train_samples), period=int(cfg.data.period),
            skew=float(cfg.data.skew), seed=int(cfg.data.seed),
        )
    if kind == "indexed":
        from nemo.collections.common.tokenizers.huggingface.auto_tokenizer import AutoTokenizer
        from nemo.collections.llm.gpt.data.pre_training import PreTrainingDataModule

        paths = OmegaConf.to_container(cfg.data.paths, resolve=True)
        return PreTrainingDataModule(
            paths=paths, seq_length=model_config.seq_length, tokenizer=AutoTokenizer(cfg.data.tokenizer),
            micro_batch_size=mbs, global_batch_size=gbs, split=str(cfg.data.split),
            num_workers=int(cfg.data.num_workers), seed=int(cfg.data.seed), reset_attention_mask=False,
            reset_position_ids=False, create_attention_mask=False,
        )
    raise ValueError(f"data.kind={kind!r} is not known (synthetic | indexed)")


def build_optimizer(cfg: DictConfig, precision: str) -> Any:
    from megatron.core.optimizer import OptimizerConfig
    from nemo import lightning as nl
    from nemo.lightning.pytorch.optim import CosineAnnealingScheduler

    o = cfg.optim
    opt_config = OptimizerConfig(
        optimizer=str(o.optimizer), lr=float(o.lr), weight_decay=float(o.weight_decay), clip_grad=float(o.clip_grad),
        adam_beta2=float(o.adam_beta2), use_distributed_optimizer=bool(o.use_distributed_optimizer),
        bf16=precision.startswith("bf16"), fp16=precision.startswith("16"),
    )
    sched = CosineAnnealingScheduler(
        max_steps=int(cfg.trainer.max_steps), warmup_steps=int(o.warmup_steps), constant_steps=0, min_lr=float(o.min_lr)
    )
    return nl.MegatronOptimizerModule(config=opt_config, lr_scheduler=sched)


def build(cfg: DictConfig, launch: Optional[Launch] = None, extra_callbacks: Optional[List[Any]] = None) -> Built:
    """Build (and validate) every NeMo object of the run; nothing is launched or trained."""
    import torch
    from lightning.pytorch.plugins.environments import TorchElasticEnvironment
    from nemo import lightning as nl
    from nemo.collections import llm

    from nemo_longctx.integrations.megatron import cpu_compat
    from nemo_longctx.integrations.megatron.memory_options import apply_recompute_fields, validate_memory_options
    from nemo_longctx.integrations.nemo.memory_callbacks import ActivationMemoryMetrics, MemoryOptionsCallback
    from nemo_longctx.integrations.nemo.callbacks import SaveFinalParameters, StepMetrics, VerifyLongContextAttention
    from nemo_longctx.integrations.nemo.strategy import LongContextStrategy

    cpu_compat.apply()  # no-op with CUDA
    world = world_size_of(cfg, launch)
    p = parallel_sizes(cfg)
    model_config = build_model_config(cfg)
    memory = memory_options_of(cfg)  # recompute/offload groups: validated, Megatron's recompute fields set
    validate_memory_options(memory, str(cfg.cp.algorithm), model_config, p["pp"])
    apply_recompute_fields(model_config, memory)

    strategy = LongContextStrategy(
        tensor_model_parallel_size=p["tp"], pipeline_model_parallel_size=p["pp"], context_parallel_size=p["cp"],
        sequence_parallel=bool(cfg.trainer.strategy.sequence_parallel), cp_algorithm=str(cfg.cp.algorithm),
        cp_algorithm_kwargs=cp_algorithm_kwargs(cfg),
        ckpt_load_strictness=None,
    )
    strategy.validate_model(model_config, world_size=world)  # before anything else is built: fail early
    gbs = global_batch_size(cfg, world)

    precision = str(cfg.trainer.precision)
    model = llm.GPTModel(model_config, optim=build_optimizer(cfg, precision))
    data = build_data(cfg, model_config, gbs)

    accelerator = cfg.trainer.accelerator
    if accelerator == "auto":
        accelerator = "gpu" if torch.cuda.is_available() else "cpu"
    devices = launch.local_world_size if launch is not None else int(cfg.trainer.devices)
    num_nodes = launch.num_nodes if launch is not None else int(cfg.trainer.num_nodes)
    plugins: List[Any] = [nl.MegatronMixedPrecision(precision=precision)]
    if launch is not None:
        plugins.append(TorchElasticEnvironment())
    tokens_per_step = gbs * int(model_config.seq_length)
    mem_cfg = cfg.get("memory") or {}
    mem_metrics = ActivationMemoryMetrics(
        count_peak=bool(mem_cfg.get("track_peak", False)),
        track_activations=bool(mem_cfg.get("track", True)) and not memory.breaks_saved_tensor_hooks,
    )  # before StepMetrics: its step-end hook closes the tracker that StepMetrics then reads
    callbacks: List[Any] = [mem_metrics, StepMetrics(str(cfg.output_dir), tokens_per_step, int(cfg.run.print_every),
                                                     extra=mem_metrics),
                            VerifyLongContextAttention(p["cp"], str(cfg.cp.algorithm), p["pp"])]
    if not memory.trivial:
        callbacks.append(MemoryOptionsCallback(memory, str(cfg.cp.algorithm)))
    if cfg.run.save_final_params:
        callbacks.append(SaveFinalParameters(os.path.join(str(cfg.output_dir), "final_params.pt")))
    callbacks += feature_callbacks(cfg) + list(extra_callbacks or [])
    trainer = nl.Trainer(
        accelerator=accelerator, devices=devices, num_nodes=num_nodes, max_steps=int(cfg.trainer.max_steps),
        strategy=strategy, plugins=plugins, callbacks=callbacks, logger=False, enable_checkpointing=False,
        enable_progress_bar=False, limit_val_batches=0, num_sanity_val_steps=0, log_every_n_steps=1,
        use_distributed_sampler=False,
    )
    return Built(model_config, model, strategy, trainer, data, world, gbs)


# ------------------------------------------------------------------------------------------------ run modes
def dry_run(cfg: DictConfig) -> Dict[str, Any]:
    """Build + validate the real NeMo objects, resolve every layer's core_attention from the layer/block spec,
    print a summary; no process group, no training. Returns the summary dict."""
    from megatron.core.transformer.transformer_block import _get_block_submodules

    from nemo_longctx.integrations.megatron.core_attention import LongContextCoreAttention
    from nemo_longctx.integrations.megatron.spec import core_attention_modules
    from nemo_longctx.integrations.nemo.tiling import tiling_of

    built = build(cfg)
    config = built.model_config
    built.strategy.connect(built.model)  # the real attach path: parallel sizes -> config, extension, validation
    layer_spec = config.transformer_layer_spec(config)
    modules = []
    for pp_rank in range(int(config.pipeline_model_parallel_size)):  # every pipeline stage's layers
        modules += core_attention_modules(_get_block_submodules(config, layer_spec, vp_stage=None, pp_rank=pp_rank))
    if len(modules) != config.num_layers or not all(m is LongContextCoreAttention for m in modules):
        raise RuntimeError(f"core_attention does not resolve to LongContextCoreAttention in every layer: {modules}")
    p = parallel_sizes(cfg)
    summary = {
        "model": type(config).__name__,
        "num_layers": config.num_layers,
        "hidden_size": config.hidden_size,
        "heads": f"{config.num_attention_heads}q/{config.num_query_groups}kv",
        "seq_length": config.seq_length,
        "cp": f"{cfg.cp.algorithm} x {p['cp']}",
        "tp": p["tp"], "pp": p["pp"], "dp": built.world_size // (p["cp"] * p["tp"] * p["pp"]),
        "world_size": built.world_size,
        "tokens_per_cp_rank": config.seq_length // p["cp"],
        "global_batch_size": built.global_batch_size,
        "context_parallel_size_on_config": config.context_parallel_size,
        "layer_spec": getattr(layer_spec.submodules.self_attention.submodules.linear_qkv, "__name__", "?"),
        "core_attention": f"{len(modules)}/{config.num_layers} layers {LongContextCoreAttention.__name__}",
        "strategy": type(built.strategy).__name__,
        "trainer": f"{type(built.trainer).__name__}(devices={cfg.trainer.devices}, num_nodes={cfg.trainer.num_nodes})",
        "data": type(built.data).__name__,
        "memory": memory_options_of(cfg).describe(),
        "tiling": tiling_of(cfg),
    }
    print("dry run OK (nothing trained):")
    for k, v in summary.items():
        print(f"  {k:32s} {v}")
    return summary


def train_rank(cfg: DictConfig, launch: Optional[Launch]) -> int:
    """This process's part of the run (one rank, or the only process)."""
    import torch

    threads = cfg.launcher.threads_per_process
    local = launch.local_world_size if launch is not None else 1
    torch.set_num_threads(int(threads) if threads else max(1, (os.cpu_count() or 1) // local))
    import lightning.pytorch as pl

    pl.seed_everything(int(cfg.seed), verbose=False)
    built = build(cfg, launch)
    if built.trainer.global_rank == 0:
        print(
            f"nemo-longctx train: {type(built.model_config).__name__} seq {built.model_config.seq_length}, "
            f"cp={cfg.cp.algorithm} x {cfg.cp.size}, world {built.world_size}, {cfg.trainer.max_steps} steps, "
            f"metrics -> {os.path.join(str(cfg.output_dir), 'metrics.jsonl')}",
            flush=True,
        )
    built.trainer.fit(built.model, built.data)
    return 0


def run(cfg: DictConfig) -> int:
    from nemo_longctx.integrations.megatron.memory_options import validate_memory_options

    validate_memory_options(memory_options_of(cfg), str(cfg.cp.algorithm))  # config-level checks, before any spawn
    from nemo_longctx.integrations.nemo.tiling import tiling_of

    tiling_of(cfg)  # tiling group: policies and tiles/chunks vs tokens per rank, before any spawn
    from nemo_longctx.integrations.megatron.cp_algorithms import check_cp_options

    check_cp_options(str(cfg.cp.algorithm), int(cfg.cp.size), cp_algorithm_kwargs(cfg))  # cp.* (heads: at build)
    if cfg.run.dry_run:
        dry_run(cfg)
        return 0
    launch = detect_external_launch()
    world = world_size_of(cfg, launch)
    if launch is None and world > 1:
        from hydra.core.hydra_config import HydraConfig

        argv = list(HydraConfig.get().overrides.task) + ["hydra.output_subdir=null"]
        local = int(cfg.trainer.devices)
        if int(cfg.trainer.num_nodes) != 1:
            raise ValueError("trainer.num_nodes > 1 needs torchrun or srun to start the processes")
        threads = cfg.launcher.threads_per_process or max(1, (os.cpu_count() or 1) // local)
        print(f"nemo-longctx: spawning {local} local processes ({threads} thread(s) each)", flush=True)
        t0 = time.perf_counter()
        code = spawn_local(local, argv, int(threads), cfg.run.timeout_s)
        print(f"nemo-longctx: {'finished' if code == 0 else f'FAILED (exit {code})'} in {time.perf_counter() - t0:.1f} s",
              flush=True)
        return code
    return train_rank(cfg, launch)


@hydra.main(config_path=CONFIG_PATH, config_name=CONFIG_NAME, version_base=None)
def _hydra_main(cfg: DictConfig) -> int:
    return run(cfg)


def main() -> None:
    code = _hydra_main()
    sys.exit(code if isinstance(code, int) else 0)


if __name__ == "__main__":
    main()
