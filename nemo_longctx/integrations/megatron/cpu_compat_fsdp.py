"""Megatron-FSDP (megatron-core 0.15.3, ``optim=fsdp``) on a CPU-only torch build over gloo.

Applied by the Megatron-core patch ledger (``patches.py``; only on a CPU-only build, after ``cpu_compat``'s fixes 1-2:
no-op CUDA streams and events, ``current_device()`` = the CPU; fix 3 maps ``device="cuda"`` / ``.cuda()`` to the
CPU). Megatron-FSDP's real
sharding, all-gathers (``all_gather_into_tensor``) and reduce-scatters (``reduce_scatter_tensor``, coalesced) run
unchanged: gloo implements both (torch 2.13 here). The fixes:

F1. ``FullyShardedDataParallel`` (the adapter NeMo's ``MegatronStrategy(fsdp="megatron")`` builds without a
    ``device``) defaults its device to ``torch.device(f"cuda:{torch.cuda.current_device()}")``: with no device
    given, the CPU is passed through its own ``device`` argument.
F2. The adapter's ``_init_dist_index`` builds its DTensor ``DeviceMesh.from_group(..., device_type="cuda")``: a CUDA
    mesh over gloo groups would make DTensor look for NCCL/CUDA tensors. Inside the adapter module only, the name
    ``DeviceMesh`` is bound to a subclass whose ``from_group`` builds the same mesh (same groups, same rank layout,
    same dim names) with ``device_type="cpu"``.
F3. ``MegatronFSDP.__init__`` compares its device with ``torch.device(f"cuda:{torch.cuda.current_device()}")``, which
    is an invalid device string once ``current_device()`` returns the CPU (cpu_compat fix 2). During that
    ``__init__`` only, ``current_device()`` answers ``0`` (the device index it stands for: tensors named
    ``cuda:0`` are mapped to the CPU by cpu_compat fix 3); its "device differs" warning is not emitted for the CPU.

F4. Megatron-FSDP's gradient reduce-scatter pre-multiplies by 1/data-parallel-size inside the collective
    (``ReduceOp`` from ``torch.distributed._make_nccl_premul_sum``, chosen when
    ``DistributedDataParallelConfig.gradient_reduce_div_fusion`` is true and the gradients are not bf16), an
    NCCL-only op (gloo: "Cannot use ReduceOp.PREMUL_SUM with Gloo"). The adapter (F1) sets
    ``gradient_reduce_div_fusion=False`` on the DDP config it is given: Megatron's own unfused path,
    ``grad.mul_(1/dp)`` then ``SUM`` (what it does for bf16 gradients) -- the same products summed.

F5. With ``overlap_param_gather`` (Megatron-FSDP turns it on for ``optim_grads_params``), the optimizer step ends with
    ``start_param_sync``: all-gathers of the next step's first buckets (asynchronous without F6), awaited by the next
    forward. After the last step nobody awaits them. NCCL does not care; gloo completes them on its worker threads,
    and one that completes while Python finalizes (the peer rank a little behind) needs the GIL to release the tensors:
    the thread is unwound and the rank aborts ("FATAL: exception not rethrown", glibc; 3 of 25 runs here).
    ``wait_for_param_gathers()`` waits for them with Megatron-FSDP's own ``synchronize_param_gather()``: the train
    app calls it after a successful fit, before it destroys the process groups, and an ``atexit`` hook (before
    finalization) calls it for any other way out.

F6. Megatron-FSDP issues its parameter all-gathers asynchronously (``AllGatherPipeline.all_gather_params``, always
    ``async_param_gather=True``: prefetched buckets of the next module in forward and backward order, and the next
    step's first buckets after the optimizer step) and waits for each one only when its bucket is needed. On a GPU
    that overlaps NCCL with compute. On gloo the coalesced all-gather runs on one of the process group's worker
    threads (``AsyncAllgatherCoalescedWork::run``: it allocates a flat output, receives into it and copies it into
    the bucket with ATen ops, under the issuing thread's thread-local state), concurrently with the main thread's
    forward/backward, the ring's point-to-point exchange on the CP group and the synchronous gradient
    reduce-scatters issued on the same group's other worker thread. That is the one place where this app keeps a
    gloo collective in flight while the training thread goes on, and runs with it corrupt the heap (issue 20): a
    core dump shows glibc's ``malloc(): unaligned tcache chunk detected`` raised in a gloo worker thread inside
    ``AsyncAllgatherCoalescedWork::allgather_coalesced`` -> ``at::empty``; other runs die by SIGSEGV in the training
    thread (RoPE, ``_grad_acc``'s copy, a reduce-scatter's wait) with up to 8 all-gathers in flight. No Megatron-FSDP
    buffer is freed or resized while an all-gather on it is in flight (checked for every collective of a crashing
    run), the collectives match across ranks (``TORCH_DISTRIBUTED_DEBUG=DETAIL``), and the same collectives without
    the model do not crash (gloo alone, 60K iterations): the writer is inside torch/gloo's worker-thread path, which
    only runs beside the training thread when an all-gather is asynchronous. Measured beside two CPU hogs
    (8 layers, seq 512, 300 steps): asynchronous 2 of 6 runs crashed, synchronous 0 of 6; 30 steps of the test's
    shape: 1 of 19 vs 0 of 10. Every all-gather is issued with
    ``async_param_gather=False``: Megatron-FSDP's own synchronous path (the coalesced work is waited for before
    ``all_gather_params`` returns; the bucket state machine is unchanged), so at most one gloo collective is in
    flight per process, in program order -- the same order on every rank. On a CPU there is nothing to overlap
    (gloo's threads and the compute share the same cores); the losses are bit-identical to the asynchronous path's
    (30 steps, fsdp with recompute=full offload=layer_input).

Nothing else is changed: the numerics (bf16/fp32 buffers, gradient scaling, the sharded optimizer step) are
Megatron-FSDP's own.
"""

from __future__ import annotations

import atexit
import functools
import inspect
import logging
import warnings
import weakref
from typing import Any

import torch

log = logging.getLogger(__name__)
CPU = torch.device("cpu")
_INSTANCES: "weakref.WeakSet" = weakref.WeakSet()  # F5: the live MegatronFSDP modules
_AT_EXIT = False


def _patch_adapter_device() -> None:  # F1
    from megatron.core.distributed.fsdp import mcore_fsdp_adapter as adapter

    original = adapter.FullyShardedDataParallel.__init__
    if getattr(original, "_nemo_longctx", False):
        return

    signature = inspect.signature(original)

    @functools.wraps(original)
    def __init__(self, *args: Any, **kwargs: Any) -> None:
        bound = signature.bind(self, *args, **kwargs)
        if bound.arguments.get("device") is None:
            bound.arguments["device"] = CPU  # F1
        # F4: gloo has no PREMUL_SUM: Megatron's own unfused scaling. Set on the strategy's own config object (not a
        # copy): Megatron-FSDP writes overlap_param_gather/overlap_grad_reduce into it, and NeMo reads them back
        bound.arguments["ddp_config"].gradient_reduce_div_fusion = False
        original(*bound.args, **bound.kwargs)

    __init__._nemo_longctx = True  # type: ignore[attr-defined]
    adapter.FullyShardedDataParallel.__init__ = __init__


def _patch_adapter_mesh() -> None:  # F2
    from megatron.core.distributed.fsdp import mcore_fsdp_adapter as adapter
    from torch.distributed.device_mesh import DeviceMesh

    if getattr(adapter.DeviceMesh, "_nemo_longctx", False):
        return

    class _CpuDeviceMesh(DeviceMesh):
        _nemo_longctx = True

        @staticmethod
        def from_group(group: Any, device_type: str, *args: Any, **kwargs: Any) -> DeviceMesh:
            return DeviceMesh.from_group(group, "cpu", *args, **kwargs)  # F2: a gloo mesh is a CPU mesh

    adapter.DeviceMesh = _CpuDeviceMesh


def _patch_megatron_fsdp_init() -> None:  # F3
    from megatron.core.distributed.fsdp.src.megatron_fsdp import megatron_fsdp as mfsdp

    original = mfsdp.MegatronFSDP.__init__
    if getattr(original, "_nemo_longctx", False):
        return

    class _SameDeviceWarningFilter(logging.Filter):
        def filter(self, record: logging.LogRecord) -> bool:
            return "instead of the current device" not in record.getMessage()

    mfsdp.logger.addFilter(_SameDeviceWarningFilter())

    @functools.wraps(original)
    def __init__(self, *args: Any, **kwargs: Any) -> None:
        cuda = torch.cuda
        current_device = cuda.current_device
        cuda.current_device = lambda: 0  # F3: "cuda:0" stands for the CPU here (cpu_compat fix 3)
        try:
            original(self, *args, **kwargs)
        finally:
            cuda.current_device = current_device
        _INSTANCES.add(self)  # F5

    __init__._nemo_longctx = True  # type: ignore[attr-defined]
    mfsdp.MegatronFSDP.__init__ = __init__


def _patch_synchronous_param_gather() -> None:  # F6
    from megatron.core.distributed.fsdp.src.megatron_fsdp import param_and_grad_buffer as pgb

    original = pgb.AllGatherPipeline.all_gather_params
    if getattr(original, "_nemo_longctx", False):
        return

    @functools.wraps(original)
    def all_gather_params(self, params, *args: Any, **kwargs: Any) -> Any:
        kwargs["async_param_gather"] = False  # F6: every gloo all-gather completes before the caller goes on
        return original(self, params, *args, **kwargs)

    all_gather_params._nemo_longctx = True  # type: ignore[attr-defined]
    pgb.AllGatherPipeline.all_gather_params = all_gather_params


def wait_for_param_gathers() -> None:  # F5
    """Wait for the all-gathers the live Megatron-FSDP modules left in flight (the app calls it after a successful
    fit, before it destroys the process groups; the exit hook calls it again, a no-op then)."""
    for m in list(_INSTANCES):
        try:
            with warnings.catch_warnings():
                warnings.simplefilter("ignore")  # "There are still pending all-gather tasks, process them."
                m.synchronize_param_gather()  # F5: Megatron-FSDP's own wait for its in-flight all-gathers
        except Exception as e:  # a peer gone after a failure: nothing left to wait for
            log.debug("Megatron-FSDP: pending all-gathers not awaited at exit: %s", e)


def _wait_for_param_gathers_at_exit() -> None:  # F5
    global _AT_EXIT
    if _AT_EXIT:
        return
    _AT_EXIT = True
    atexit.register(wait_for_param_gathers)


# F1-F6 are rows of the Megatron-core patch ledger (``patches.py``), applied in its order on a CPU-only build.

