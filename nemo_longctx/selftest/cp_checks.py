"""Self-test section ``cp``: ring, Ulysses and hybrid attention forward+backward on spawned processes vs the fp64
reference (gloo on CPU; NCCL, or gloo with CUDA tensors staged through CPU memory); the spawn helpers."""

from __future__ import annotations

import socket
import traceback
from typing import Callable, List, Optional

import torch

from nemo_longctx.attention import kernels as K
from nemo_longctx.selftest.report import DTYPES, FAIL, PASS, SKIP, Report, dtype_label, format_error


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class _StagedWork:
    """Work handle for ops staged through CPU: waiting copies received CPU buffers back to the CUDA tensors."""

    def __init__(self, works, copy_back, shared) -> None:
        self._works, self._copy_back, self._shared = works, copy_back, shared

    def wait(self, *args, **kwargs):
        if not self._shared["done"]:
            for w in self._works:
                w.wait()
            for dst, src in self._copy_back:
                dst.copy_(src)
            self._shared["done"] = True
        return True

    def is_completed(self) -> bool:
        return self._shared["done"]


def install_cpu_staging() -> None:
    """Let gloo carry CUDA tensors: ``batch_isend_irecv`` and ``all_to_all_single`` copy them through CPU
    memory (only in selftest / bench worker processes; the library itself is untouched)."""
    import torch.distributed as dist

    if getattr(dist, "_nemo_longctx_staged", False):
        return
    orig_batch, orig_a2a = dist.batch_isend_irecv, dist.all_to_all_single

    def batch_isend_irecv(ops):
        new_ops, copy_back = [], []
        for op in ops:
            t = op.tensor
            if t.is_cuda:
                is_send = getattr(op.op, "__name__", "") in ("isend", "send")
                cpu = t.detach().to("cpu") if is_send else torch.empty(t.shape, dtype=t.dtype)
                if not is_send:
                    copy_back.append((t, cpu))
                new_ops.append(dist.P2POp(op.op, cpu, op.peer, op.group, op.tag))
            else:
                new_ops.append(op)
        works = orig_batch(new_ops)
        shared = {"done": False}
        return [_StagedWork(works, copy_back, shared)]

    def all_to_all_single(output, input, output_split_sizes=None, input_split_sizes=None, group=None,
                          async_op=False):
        if not (output.is_cuda or input.is_cuda):
            return orig_a2a(output, input, output_split_sizes, input_split_sizes, group=group, async_op=async_op)
        out_cpu = torch.empty(output.shape, dtype=output.dtype)
        orig_a2a(out_cpu, input.detach().to("cpu"), output_split_sizes, input_split_sizes, group=group)
        output.copy_(out_cpu)
        return _StagedWork([], [], {"done": True}) if async_op else None

    dist.batch_isend_irecv = batch_isend_irecv
    dist.all_to_all_single = all_to_all_single
    dist._nemo_longctx_staged = True


def _cp_worker(rank: int, world: int, port: int, backend: str, device_kind: str, dtype_name: str,
               kernel: Optional[str], shape: dict, queue) -> None:
    try:
        import torch.distributed as dist

        from nemo_longctx.attention import (hybrid_attention, make_cp_groups, ring_attention, ulysses_attention,
                                            zigzag_shard)

        torch.set_num_threads(1)
        if device_kind == "cuda":
            dev_index = rank if backend == "nccl" else 0
            torch.cuda.set_device(dev_index)
            device = torch.device("cuda", dev_index)
            if backend == "gloo":
                install_cpu_staging()
        else:
            device = torch.device("cpu")
        dist.init_process_group(backend, init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world)
        try:
            dtype = DTYPES[dtype_name]
            b, s, hq, hkv, d = (shape[x] for x in ("b", "s", "hq", "hkv", "d"))
            g = torch.Generator().manual_seed(1234)
            q, k, v, dout = (torch.randn(b, s, h, d, generator=g).to(dtype) for h in (hq, hkv, hkv, hq))
            scale = d ** -0.5
            r_out, _, r_dq, r_dk, r_dv = K.reference_attention_fp64(q, k, v, dout, True, scale)
            ug, rg = make_cp_groups(dist.group.WORLD, 2) if world % 2 == 0 else (None, None)
            algos = {
                "ring": lambda a, b_, c: ring_attention(a, b_, c, dist.group.WORLD, True, kernel=kernel),
                "ulysses": lambda a, b_, c: ulysses_attention(a, b_, c, dist.group.WORLD, True, kernel=kernel),
            }
            if ug is not None:
                algos["hybrid"] = lambda a, b_, c: hybrid_attention(a, b_, c, ug, rg, True, kernel=kernel)
            result = {}
            for name, fn in algos.items():
                shard = [zigzag_shard(x, 1, world, rank) for x in (q, k, v, dout)]
                ql, kl, vl = (x.to(device).requires_grad_() for x in shard[:3])
                out = fn(ql, kl, vl)
                out.backward(shard[3].to(device))
                errs = {}
                for key, got, want in (("out", out, r_out), ("dq", ql.grad, r_dq), ("dk", kl.grad, r_dk),
                                       ("dv", vl.grad, r_dv)):
                    errs[key] = K.rel_err(got.detach().cpu(), zigzag_shard(want, 1, world, rank))
                result[name] = errs
            queue.put((rank, True, result))
        finally:
            dist.destroy_process_group()
    except BaseException:  # noqa: BLE001 - report to the parent
        queue.put((rank, False, traceback.format_exc()))


def run_spawned(target: Callable, world: int, args: tuple, timeout: float = 600) -> List[object]:
    """Spawn ``world`` processes running ``target(rank, world, port, *args, queue)``; results by rank."""
    import torch.multiprocessing as mp

    ctx = mp.get_context("spawn")
    queue = ctx.Queue()
    port = _free_port()
    procs = [ctx.Process(target=target, args=(r, world, port, *args, queue), daemon=True) for r in range(world)]
    for p in procs:
        p.start()
    results, errors = {}, []
    try:
        for _ in range(world):
            rank, ok, payload = queue.get(timeout=timeout)
            if ok:
                results[rank] = payload
            else:
                errors.append(f"rank {rank}: {payload}")
                break
    finally:
        for p in procs:
            p.join(timeout=5 if errors else 60)
            if p.is_alive():
                p.kill()
    if errors:
        raise RuntimeError("\n".join(errors))
    return [results[r] for r in range(world)]


def _cp_rows(rep: Report, device_kind: str, dtype: torch.dtype, results: List[dict], transport: str) -> None:
    tol = K.TOLERANCE[dtype]
    for algo in results[0]:
        worst = {key: max(r[algo][key] for r in results) for key in results[0][algo]}
        ok = all(v <= tol for v in worst.values())
        rep.add("cp", f"{algo} P={len(results)}", device_kind, dtype_label(dtype), PASS if ok else FAIL,
                f"{transport}; worst rel err over ranks: "
                + " ".join(f"{k2} {format_error(v)}" for k2, v in worst.items()) + f" (tol {tol:g})")


def section_cp(rep: Report, cuda: bool, kernel: Optional[str], quick: bool) -> None:
    world = 4
    shape = dict(b=1, s=8 * world * 4, hq=8, hkv=2, d=32)
    try:
        res = run_spawned(_cp_worker, world, ("gloo", "cpu", "fp32", None, shape))
        _cp_rows(rep, "cpu", torch.float32, res, "gloo, 4 processes")
    except Exception as e:  # noqa: BLE001
        rep.add("cp", "ring/ulysses/hybrid", "cpu", "fp32", FAIL, f"{type(e).__name__}: {e}"[:2000])
    if not cuda:
        rep.add("cp", "ring/ulysses/hybrid", "cuda", "-", SKIP, "skipped: no CUDA")
        return
    n = torch.cuda.device_count()
    backend = "nccl" if n >= world else "gloo"
    transport = (f"nccl, {world} GPUs" if backend == "nccl"
                 else f"gloo with CPU staging, {world} processes on 1 GPU ({n} visible)")
    shape = dict(b=1, s=1024 if not quick else 256, hq=8, hkv=2, d=128)
    for dtype in (torch.bfloat16,):
        try:
            res = run_spawned(_cp_worker, world, (backend, "cuda", dtype_label(dtype), kernel, shape))
            _cp_rows(rep, "cuda", dtype, res, transport + f", kernel {kernel or 'auto'}")
        except Exception as e:  # noqa: BLE001
            rep.add("cp", "ring/ulysses/hybrid", "cuda", dtype_label(dtype), FAIL, f"{type(e).__name__}: {e}"[:2000])
