"""Bytes of the model states that Megatron actually holds on this rank (weights, gradients, optimizer states), split
into what stays on the device and what its ``HybridDeviceOptimizer`` keeps on the host. What the planner's
``model_state_bytes`` predicts is compared with it by tests/test_planner_model_state_bytes.py; the app writes it to
``<output_dir>/model_state_bytes.rank<R>.json`` after the first optimizer step (``ModelStateCheck``).

``measured_model_state_bytes(model_chunks, optimizer)``: every tensor is counted by its storage, once (a view of a
storage already counted adds nothing: fp32 weights are their own master under the distributed optimizer, whose fp32
"shard" is a view of the parameter buffer; main grads handed to the optimizer are views of the DDP grad buffer), in
this order:

  device  weights      storages of the module's parameters (Megatron DDP's param buffer under the distributed
                       optimizer, padded; the parameters themselves otherwise)
          grads        storages of the parameters' ``main_grad`` (DDP's grad buffers, padded) and of any ``.grad``
                       of them or of the parameters the optimizer steps
          main_params  storages of the parameters the optimizer steps (its fp32 master copies/shards; with
                       ``HybridDeviceOptimizer`` the fp32 shards it was given: the device keeps them when offloaded)
          moments      ``exp_avg`` / ``exp_avg_sq`` of the device optimizer (HybridDeviceOptimizer's "gpu" one)
          other        any other tensor of the device optimizer's state (Adam's ``step`` scalars)
  host    main_params  HybridDeviceOptimizer's host copies of the offloaded parameters
          grads        its host gradient copies
          moments      ``exp_avg`` / ``exp_avg_sq`` of its host ("cpu") optimizers
          other        any other tensor of their state (``step``)
  padding weights / grads: elements Megatron's buffers add for bucket / alignment padding (distributed optimizer:
          each parameter starts on a multiple of 64 elements, each bucket ends on a multiple of lcm(dp x cp, 128)),
          in bytes; included in device weights / grads above
  numel   params / param_tensors: elements / tensors of the module's parameters; buckets: DDP buckets;
          optimizer_device / optimizer_host: elements the device / host optimizer steps (this rank's shard)

Megatron-FSDP: its sharded bf16 weight, fp32 master-weight and fp32 main-grad buffers (the optimizer's DTensor
master shards are views into them) are device weights / main_params / grads; the module's parameters are then views
of the unsharded weight buckets it has gathered at that moment (after a step: the next step's first buckets, which
``overlap_param_gather`` prefetches), counted as weights too; its unsharded gradient buckets are freed after their
reduce-scatter, so they are not here (the planner's gathered units count them as a backward transient).

"Device" and "host" are roles, not ``tensor.device``: on a CPU-only build everything lives in host memory, and
cpu_compat fix 9 lets the parameters stand in for device tensors while HybridDeviceOptimizer sorts them.
"""

from __future__ import annotations

from typing import Any, Dict, Iterable, List

MOMENTS = ("exp_avg", "exp_avg_sq")


def _local(t: Any) -> Any:
    """A DTensor (Megatron-FSDP's parameters and master shards): this rank's local tensor; anything else as is."""
    return t.to_local() if hasattr(t, "to_local") and hasattr(t, "device_mesh") else t


class _Counter:
    def __init__(self) -> None:
        self.seen: set = set()

    def add(self, tensors: Iterable[Any]) -> int:
        total = 0
        for t in tensors:
            t = _local(t)
            if t is None or not hasattr(t, "untyped_storage"):
                continue
            s = t.untyped_storage()
            key = (s.data_ptr(), s.nbytes(), str(t.device))
            if s.nbytes() == 0 or key in self.seen:
                continue
            self.seen.add(key)
            total += s.nbytes()
        return total


def _inner_optimizers(optimizer: Any) -> List[Any]:
    """The torch optimizers inside a (chained) MegatronOptimizer."""
    chained = getattr(optimizer, "chained_optimizers", None) or [optimizer]
    return [getattr(o, "optimizer", o) for o in chained]


def _state_tensors(opt: Any, moments: bool) -> List[Any]:
    out = []
    for state in opt.state.values():
        for k, v in state.items():
            if hasattr(v, "untyped_storage") and (k in MOMENTS) == moments and k != "master_param":
                out.append(v)
    return out


def _fsdp_buffers(chunks: List[Any]) -> Dict[str, List[Any]]:
    """Megatron-FSDP's persistent (sharded) buffers of every parameter group: bf16 weights, fp32 master weights, fp32
    main grads (the unsharded buckets it gathers for a layer's forward / backward are temporary: freed by then)."""
    out: Dict[str, List[Any]] = {"weights": [], "main_params": [], "grads": []}
    for m in chunks:
        for g in getattr(getattr(m, "param_and_grad_buffer", None), "parameter_groups", None) or []:
            for key, name in (("weights", "model_weight_buffer"), ("main_params", "main_weight_buffer"),
                              ("grads", "main_grad_buffer")):
                data = getattr(getattr(g, name, None), "data", None)
                if data is not None:
                    out[key].append(data)
    return out


def measured_model_state_bytes(model_chunks: Iterable[Any], optimizer: Any) -> Dict[str, Dict[str, int]]:
    """This rank's model-state bytes (see the module docstring); ``model_chunks``: the (DDP-wrapped) model modules,
    ``optimizer``: the MegatronOptimizer (chained or not). Call after the first optimizer step (Adam's moments and
    HybridDeviceOptimizer's host gradient copies are allocated by it)."""
    from megatron.core.optimizer.cpu_offloading.hybrid_optimizer import HybridDeviceOptimizer

    chunks = list(model_chunks)
    params = [p for m in chunks for p in m.parameters()]
    stepped = [p for inner in _inner_optimizers(optimizer) for g in inner.param_groups for p in g["params"]]
    c = _Counter()
    fsdp = _fsdp_buffers(chunks)  # counted first: the DTensor parameters / master shards are views into them
    device = {"weights": c.add(fsdp["weights"] + params)}
    device["grads"] = c.add(fsdp["grads"] + [getattr(p, "main_grad", None) for p in params]
                            + [p.grad for p in params + stepped])
    device["main_params"] = c.add(fsdp["main_params"])
    padding, n_buckets = {"weights": 0, "grads": 0}, 0
    for m in chunks:
        bufs = getattr(m, "buffers", None)
        for b in (bufs if isinstance(bufs, list) else []) + list(getattr(m, "expert_parallel_buffers", []) or []):
            if not hasattr(b, "buckets"):  # Megatron-FSDP's ParamAndGradBuffer: see _fsdp_buffers
                continue
            n_buckets += len(b.buckets)
            pad = int(b.numel) - sum(int(p.numel()) for p in b.params)  # alignment gaps + bucket-end padding
            if getattr(b, "param_data", None) is not None:
                padding["weights"] += pad * b.param_data.element_size()
            padding["grads"] += pad * b.grad_data.element_size()
    host = {"main_params": 0, "grads": 0, "moments": 0, "other": 0}
    device_opts = []
    numel = {"params": sum(p.numel() for p in params), "param_tensors": len(params), "buckets": n_buckets,
             "optimizer_device": 0, "optimizer_host": 0}
    for inner in _inner_optimizers(optimizer):
        if isinstance(inner, HybridDeviceOptimizer):
            if inner.gpu_optimizer is not None:
                device_opts.append(inner.gpu_optimizer)
                numel["optimizer_device"] += sum(p.numel() for g in inner.gpu_optimizer.param_groups
                                                 for p in g["params"])
            host_copies = list(inner.gpu_params_map_cpu_copy.values())
            numel["optimizer_host"] += sum(p.numel() for p in host_copies)
            host["main_params"] += c.add(host_copies)
            host["grads"] += c.add(list(inner.cpu_copy_map_grad.values()))
            for o in inner.cpu_optimizers:
                host["moments"] += c.add(_state_tensors(o, True))
                host["other"] += c.add(_state_tensors(o, False))
        else:
            device_opts.append(inner)
            numel["optimizer_device"] += sum(_local(p).numel() for g in inner.param_groups for p in g["params"])
    device["main_params"] += c.add(stepped)
    device["moments"] = sum(c.add(_state_tensors(o, True)) for o in device_opts)
    device["other"] = sum(c.add(_state_tensors(o, False)) for o in device_opts)
    return {"device": device, "host": host, "padding": padding, "numel": numel}


def summary_line(b: Dict[str, Dict[str, int]]) -> str:
    d, h = b["device"], b["host"]
    return (f"model state bytes (this rank): device weights {d['weights']} grads {d['grads']} master "
            f"{d['main_params']} moments {d['moments']} | host master {h['main_params']} grads {h['grads']} "
            f"moments {h['moments']} | buffer padding {b['padding']['weights'] + b['padding']['grads']}")
