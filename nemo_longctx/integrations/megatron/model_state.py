"""Model-state options (the ``optim`` group) on Megatron: how weights, gradients and optimizer states are kept.

The options (``ModelStateOptions``, defined with every rule that needs no model in ``nemo_longctx.options``) map onto:
``optimizer_config(opts, ...)``   Megatron's ``OptimizerConfig``;
``ddp_config(opts)``              Megatron's ``DistributedDataParallelConfig`` for Megatron-FSDP (None otherwise);
``checkpoint_settings(opts)``     the distributed-checkpoint format settings the options need;
``model_state_problems(opts, precision=..., pp=..., checkpointing=...)``
                                  the option rules plus the refusals of what cannot run on a CPU-only build
                                  (``validation.model_state_cpu_problems``: one place for them);
``optimizer_layout`` / ``check_optimizer_layout``  what Megatron built, checked against the options at fit start.

Everything is Megatron-core 0.15.3 machinery, used the way NeMo's and Megatron-Bridge's recipes use it.
"""

from __future__ import annotations

from typing import Any, Dict, List, Mapping, Optional

from nemo_longctx.options import Context, ModelStateOptions, OptimOptions


def model_state_options(optim: Optional[Mapping[str, Any]] = None) -> ModelStateOptions:
    """``ModelStateOptions`` of the ``optim`` group (a plain dict); ``OptimOptions.problems`` reports its keys."""
    return OptimOptions.from_dict(optim).state


def model_state_problems(opts: ModelStateOptions, precision: str = "bf16-mixed", pp: int = 1,
                         checkpointing: bool = False, te_available: Optional[bool] = None,
                         target_cuda: Optional[bool] = None, keys: Optional[Dict[str, str]] = None) -> List[str]:
    """Every problem with ``opts`` (empty = valid), each naming its ``optim.*`` key; the CPU-only refusals of
    ``cpu_compat`` are added when the target has no CUDA. ``te_available`` / ``target_cuda``: None = this process
    (the app); the planner passes True for both (it plans for GPU nodes running the NGC NeMo image).
    ``keys``: the front end's names of precision / pp / checkpointing (``options.Context.keys``)."""
    from nemo_longctx.integrations.megatron.cpu_compat import needed
    from nemo_longctx.integrations.megatron.validation import model_state_cpu_problems

    te = _te_available() if te_available is None else te_available
    cuda = (not needed()) if target_cuda is None else bool(target_cuda)
    ctx = Context(precision=str(precision), pp=pp, checkpointing=checkpointing, cuda=cuda, te=te, keys=keys or {})
    p = opts.problems(ctx)
    if not target_cuda:
        p += model_state_cpu_problems(opts, force=target_cuda is False, checkpointing=checkpointing,
                                      checkpoint_key=ctx.key("checkpointing"))
    return p


def _te_available() -> bool:
    import importlib.util

    return importlib.util.find_spec("transformer_engine") is not None


# ---------------------------------------------------------------------------------------------- Megatron objects
def _torch_dtype(name: str) -> Any:
    import torch

    return {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}[name]


def optimizer_fields(opts: ModelStateOptions) -> Dict[str, Any]:
    """The model-state fields of Megatron's ``OptimizerConfig`` (the same names on Bridge's and on a NeMo recipe's
    optimizer config): what every front end writes for ``opts``."""
    return dict(
        optimizer=opts.optimizer, use_distributed_optimizer=bool(opts.use_distributed_optimizer),
        optimizer_cpu_offload=bool(opts.optimizer_cpu_offload),
        optimizer_offload_fraction=float(opts.optimizer_offload_fraction) if opts.optimizer_cpu_offload else 0.0,
        use_precision_aware_optimizer=bool(opts.use_precision_aware_optimizer),
        main_grads_dtype=_torch_dtype(opts.main_grads_dtype), main_params_dtype=_torch_dtype(opts.main_params_dtype),
        exp_avg_dtype=_torch_dtype(opts.exp_avg_dtype), exp_avg_sq_dtype=_torch_dtype(opts.exp_avg_sq_dtype),
    )


def optimizer_config(opts: ModelStateOptions, lr: float, weight_decay: float, clip_grad: float, adam_beta2: float,
                     precision: str, adam_beta1: float = 0.9, adam_eps: float = 1e-8) -> Any:
    """Megatron's ``OptimizerConfig`` for ``opts`` (Adam's beta1 and epsilon default to Megatron's)."""
    from megatron.core.optimizer import OptimizerConfig

    return OptimizerConfig(lr=lr, weight_decay=weight_decay, clip_grad=clip_grad, adam_beta1=adam_beta1,
                           adam_beta2=adam_beta2, adam_eps=adam_eps,
                           bf16=precision.startswith("bf16"), fp16=precision.startswith("16"), **optimizer_fields(opts))


def grad_reduce_in_fp32(opts: ModelStateOptions) -> bool:
    """``MegatronMixedPrecision(grad_reduce_in_fp32=...)``: main grads (DDP buffers) in fp32 unless bf16 asked."""
    return opts.main_grads_dtype == "fp32"


# the DistributedDataParallelConfig fields that switch Megatron-FSDP on (ZeRO-3), as NeMo's and Bridge's recipes set
# them
MEGATRON_FSDP_DDP_FIELDS = {"use_distributed_optimizer": True, "use_megatron_fsdp": True,
                            "data_parallel_sharding_strategy": "optim_grads_params"}


def ddp_config(opts: ModelStateOptions) -> Any:
    """Megatron-FSDP's ``DistributedDataParallelConfig`` (ZeRO-3: optimizer states, grads and params sharded), the
    way NeMo's and Megatron-Bridge's recipes enable it; None without Megatron-FSDP (the framework's default DDP)."""
    if not opts.megatron_fsdp:
        return None
    from megatron.core.distributed import DistributedDataParallelConfig

    return DistributedDataParallelConfig(check_for_nan_in_grad=True, **MEGATRON_FSDP_DDP_FIELDS)


def checkpoint_settings(opts: ModelStateOptions) -> Dict[str, Any]:
    """What the options need of the distributed checkpoint: ``format`` (Megatron-FSDP saves ``fsdp_dtensor``, the
    rest ``torch_dist``) and ``optim_fully_reshardable`` (optimizer CPU offload: HybridDeviceOptimizer's
    per-parameter state holds torch AdamW's scalar ``step``, which Megatron's default dp_reshardable optimizer format
    asserts against at the first save; its fully_reshardable format handles it)."""
    return {"format": "fsdp_dtensor" if opts.megatron_fsdp else "torch_dist",
            "optim_fully_reshardable": bool(opts.optimizer_cpu_offload and not opts.megatron_fsdp)}


def allow_offload_optimizer_classes_in_checkpoints() -> None:
    """``optimizer_cpu_offload``: HybridDeviceOptimizer keeps its sub-optimizer classes (``cpu_optimizer_cls`` /
    ``gpu_optimizer_cls``) in its param groups, so the checkpoint's common state holds them and Megatron's
    ``load_common`` (``torch.load``, weights_only by default since torch 2.6) refuses to resume ("Unsupported global:
    torch.optim.adamw.AdamW"). Allow-list exactly the classes Megatron's ``get_megatron_optimizer`` may put there
    (torch's documented ``add_safe_globals``)."""
    import torch
    from megatron.core import optimizer as mopt

    torch.serialization.add_safe_globals([c for c in {mopt.Adam, mopt.SGD, mopt.CPUAdam, mopt.CPUSGD}
                                          if isinstance(c, type)])


# ---------------------------------------------------------------------------------------------- runtime check
def optimizer_layout(optimizer: Any) -> Dict[str, Any]:
    """What the built Megatron optimizer keeps where (this rank): {'kind', 'distributed', 'hybrid',
    'host_numel', 'device_numel', 'moment_dtypes'}; ``optimizer``: a MegatronOptimizer (chained or not)."""
    from megatron.core.optimizer.cpu_offloading.hybrid_optimizer import HybridDeviceOptimizer
    from megatron.core.optimizer.distrib_optimizer import DistributedOptimizer

    chained = getattr(optimizer, "chained_optimizers", None) or [optimizer]
    out = {"kind": [type(o).__name__ for o in chained], "distributed": all(isinstance(o, DistributedOptimizer)
                                                                             for o in chained),
           "hybrid": False, "host_numel": 0, "device_numel": 0, "moment_dtypes": set(),
           # precision-aware: Megatron's live flag (decoupled bf16/fp32 grads, no device fp32 main params)
           "precision_aware": all(bool(getattr(getattr(o, "config", None),
                                               "use_precision_aware_optimizer_no_fp8_or_ds_fp8", False))
                                  for o in chained),
           "grad_buffer_dtypes": set(), "grad_reduce_in_fp32": set(), "device_main_params": 0,
           "master_dtypes": set()}
    for o in chained:
        for b in getattr(o, "buffers", None) or [b for m in getattr(o, "model_chunks", []) or []
                                                 for b in getattr(m, "buffers", [])]:
            if hasattr(b, "grad_dtype"):
                out["grad_buffer_dtypes"].add(_dtype_name(b.grad_dtype))
            else:  # Megatron-FSDP's ParamAndGradBuffer: a main-grad buffer per parameter group
                out["grad_buffer_dtypes"].update(_dtype_name(g.main_grad_buffer.dtype) for g in b.parameter_groups
                                                 if g.main_grad_buffer is not None)
        ddp = getattr(o, "ddp_config", None) or getattr((getattr(o, "model_chunks", None) or [None])[0],
                                                         "ddp_config", None)
        if ddp is not None:
            out["grad_reduce_in_fp32"].add(bool(ddp.grad_reduce_in_fp32))
        # fp32 main params the distributed optimizer keeps on the device (None per shard when precision-aware)
        out["device_main_params"] += sum(1 for g in getattr(o, "shard_fp32_from_float16_groups", []) or []
                                         for p in g if p is not None)
        inner = getattr(o, "optimizer", None)
        if isinstance(inner, HybridDeviceOptimizer):
            out["hybrid"] = True
            out["host_numel"] += sum(p.numel() for p in inner.gpu_params_map_cpu_copy.values())
            out["device_numel"] += sum(p.numel() for g in inner.gpu_param_groups for p in g["params"])
        # what the (sub-)optimizers step on: their master weights
        for sub in (inner.sub_optimizers if isinstance(inner, HybridDeviceOptimizer) else [inner] if inner else []):
            out["master_dtypes"].update(_dtype_name(p.dtype) for g in sub.param_groups for p in g["params"])
        for state in getattr(inner, "state", {}).values():
            for k in ("exp_avg", "exp_avg_sq"):
                if k in state and hasattr(state[k], "dtype"):
                    out["moment_dtypes"].add(_dtype_name(state[k].dtype))
    for k in ("moment_dtypes", "grad_buffer_dtypes", "grad_reduce_in_fp32", "master_dtypes"):
        out[k] = sorted(out[k])
    out.update(fsdp_layout([c for o in chained for c in getattr(o, "model_chunks", None) or []]))
    return out


def _dtype_name(dtype: Any) -> str:
    return {"float32": "fp32", "bfloat16": "bf16", "float16": "fp16"}.get(str(dtype).replace("torch.", ""),
                                                                         str(dtype).replace("torch.", ""))


def fsdp_layout(model_chunks: List[Any]) -> Dict[str, Any]:
    """How Megatron-FSDP sharded the model (this rank): {'fsdp': a chunk is Megatron-FSDP's
    ``FullyShardedDataParallel``, 'fsdp_params' / 'fsdp_dtensor_params': parameters of its module / those that are
    DTensors, 'fsdp_total_numel' / 'fsdp_local_numel': their global / this rank's element counts, 'fsdp_shards': the
    data-parallel x CP group it shards over, 'fsdp_mesh': the DTensor meshes' device types, 'fsdp_unsharded_buffers':
    weight / master-weight / main-grad buffers held whole}."""
    from torch.distributed.tensor import DTensor

    try:
        from megatron.core.distributed.fsdp.mcore_fsdp_adapter import FullyShardedDataParallel
    except ImportError:  # a Megatron without Megatron-FSDP: nothing can be wrapped in it
        FullyShardedDataParallel = ()
    fsdp = [c for c in model_chunks if FullyShardedDataParallel and isinstance(c, FullyShardedDataParallel)]
    out = {"fsdp": bool(fsdp), "fsdp_params": 0, "fsdp_dtensor_params": 0, "fsdp_total_numel": 0,
           "fsdp_local_numel": 0, "fsdp_shards": 0, "fsdp_mesh": set(), "fsdp_unsharded_buffers": []}
    for c in fsdp:
        out["fsdp_shards"] = max(out["fsdp_shards"], c.megatron_fsdp_dist_index.get_dp_group().size())
        for p in {id(p): p for p in c.parameters()}.values():
            out["fsdp_params"] += 1
            if isinstance(p, DTensor):
                out["fsdp_dtensor_params"] += 1
                out["fsdp_total_numel"] += p.numel()
                out["fsdp_local_numel"] += p.to_local().numel()
                out["fsdp_mesh"].add(p.device_mesh.device_type)
        for i, g in enumerate(c.param_and_grad_buffer.parameter_groups):
            for name in ("model_weight_buffer", "main_weight_buffer", "main_grad_buffer"):
                b = getattr(g, name, None)
                if b is not None and not b.is_data_distributed:
                    out["fsdp_unsharded_buffers"].append(f"group {i} {name}")
    out["fsdp_mesh"] = sorted(out["fsdp_mesh"])
    if fsdp:  # cpu_compat_fsdp F6: on gloo every parameter all-gather completes before the caller goes on
        from megatron.core.distributed.fsdp.src.megatron_fsdp.param_and_grad_buffer import AllGatherPipeline

        from nemo_longctx.integrations.megatron import cpu_compat

        out["fsdp_gather_sync_required"] = cpu_compat.is_applied()
        out["fsdp_gather_sync"] = bool(getattr(AllGatherPipeline.all_gather_params, "_nemo_longctx", False))
    return out


def check_fsdp_layout(opts: ModelStateOptions, layout: Dict[str, Any]) -> str:
    """Raise RuntimeError unless the model is Megatron-FSDP-sharded exactly when ``opts.megatron_fsdp`` asks for it
    (every parameter a DTensor on the mesh, this rank holding about 1/shards of the elements, weights, master
    weights and grads in sharded buffers); else the summary's Megatron-FSDP part ('' without it)."""
    if "fsdp" not in layout:
        return ""
    if bool(opts.megatron_fsdp) != layout["fsdp"]:
        raise RuntimeError(f"optim.megatron_fsdp={opts.megatron_fsdp} but the model is "
                           f"{'' if layout['fsdp'] else 'not '}wrapped in Megatron-FSDP")
    if not layout["fsdp"]:
        return ""
    n, nd, total, local, shards = (layout[k] for k in ("fsdp_params", "fsdp_dtensor_params", "fsdp_total_numel",
                                                         "fsdp_local_numel", "fsdp_shards"))
    if not n or nd != n:
        raise RuntimeError(f"optim.megatron_fsdp=true but {n - nd} of {n} parameters are not DTensors")
    if layout["fsdp_unsharded_buffers"]:
        raise RuntimeError(f"optim.megatron_fsdp=true (optim_grads_params) but Megatron-FSDP keeps whole: "
                           f"{layout['fsdp_unsharded_buffers']}")
    # the flat buffers are cut evenly (a parameter may straddle ranks); padding stays below a few percent
    if shards > 1 and not abs(local * shards - total) <= 0.05 * total:
        raise RuntimeError(f"optim.megatron_fsdp=true over {shards} ranks but this rank holds {local} of {total} "
                           "parameter elements")
    if layout.get("fsdp_gather_sync_required") and not layout.get("fsdp_gather_sync"):
        raise RuntimeError("Megatron-FSDP on gloo with asynchronous parameter all-gathers (cpu_compat_fsdp F6 is not "
                           "applied): a gloo all-gather in flight beside the training thread crashed ranks (issue 20)")
    gather = ", all-gathers synchronous (gloo)" if layout.get("fsdp_gather_sync") else ""
    return (f" | Megatron-FSDP: {nd} DTensor params on a {'+'.join(layout['fsdp_mesh'])} mesh, this rank holds "
            f"{local} of {total} elements over {shards} shards{gather}")


def check_optimizer_layout(opts: ModelStateOptions, layout: Dict[str, Any]) -> str:
    """Raise RuntimeError when the built optimizer is not what ``opts`` asked for; else a one-line summary."""
    if bool(opts.use_distributed_optimizer) != layout["distributed"]:
        raise RuntimeError(f"optim.use_distributed_optimizer={opts.use_distributed_optimizer} but the built optimizer "
                           f"is {layout['kind']}")
    if bool(opts.optimizer_cpu_offload) != layout["hybrid"]:
        raise RuntimeError(f"optim.optimizer_cpu_offload={opts.optimizer_cpu_offload} but the built optimizer "
                           f"{'has' if layout['hybrid'] else 'has no'} HybridDeviceOptimizer")
    total = layout["host_numel"] + layout["device_numel"]
    if opts.optimizer_cpu_offload and total:
        frac = layout["host_numel"] / total
        # HybridDeviceOptimizer moves whole shard tensors until the fraction is reached: at least the fraction
        if frac + 1e-9 < float(opts.optimizer_offload_fraction) or (opts.optimizer_offload_fraction == 0 and frac):
            raise RuntimeError(f"optim.optimizer_offload_fraction={opts.optimizer_offload_fraction} but "
                               f"{frac:.3f} of the optimizer's parameters are on the host")
    pa = bool(opts.use_precision_aware_optimizer)
    if "precision_aware" in layout and pa != layout["precision_aware"]:
        raise RuntimeError(f"optim.use_precision_aware_optimizer={opts.use_precision_aware_optimizer} but Megatron's "
                           f"use_precision_aware_optimizer_no_fp8_or_ds_fp8 is {layout['precision_aware']}")
    if layout.get("grad_buffer_dtypes"):
        want = opts.main_grads_dtype
        if layout["grad_buffer_dtypes"] != [want] or layout["grad_reduce_in_fp32"] != [want == "fp32"]:
            raise RuntimeError(f"optim.main_grads_dtype={want} but the DDP grad buffers are "
                               f"{layout['grad_buffer_dtypes']} (grad_reduce_in_fp32={layout['grad_reduce_in_fp32']})")
    if pa and layout.get("device_main_params"):
        raise RuntimeError(f"optim.use_precision_aware_optimizer=true but the distributed optimizer keeps "
                           f"{layout['device_main_params']} fp32 main param shards on the device")
    fsdp = check_fsdp_layout(opts, layout)
    line = f"model state: {opts.describe()} | optimizer {'+'.join(sorted(set(layout['kind'])))}{fsdp}"
    if layout["hybrid"]:
        line += f" | host Adam for {layout['host_numel']} of {total} parameters (this rank)"
    if layout.get("grad_buffer_dtypes"):
        line += f" | main grads {'+'.join(layout['grad_buffer_dtypes'])}"
    if pa:
        line += (f" | precision-aware live: decoupled grads, no device main params, master "
                 f"{'+'.join(layout['master_dtypes'])}")
    return line
