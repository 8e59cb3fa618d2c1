"""Compare context-parallel attention variants on CPU gloo: ring vs Ulysses vs hybrid, head_chunks 1/2/4.

For each world size P (default 2 and 4; one process per rank, 1 thread each) and each variant, one causal
attention forward+backward over a zigzag-sharded sequence is timed; the table reports
  * time      median over --iters of the slowest rank's fwd+bwd wall time (variants interleaved per iter),
  * sent      bytes this rank sent (max over ranks), forward + backward (``comm.count_bytes_sent``),
  * a2a buf   peak all-to-all staging-buffer bytes (``all_to_all.track_a2a_buffer_bytes``; ring has none;
              with regather the reused gather buffers count too),
  * live      peak bytes of tensors allocated during fwd+bwd and alive at once, seen at op boundaries by a
              dispatch-mode probe (includes the output and the gradients; excludes the inputs),
  * held      of those, the bytes alive between forward and backward: the output plus what the autograd
              graph saved (what a model holds per attention layer until its backward).
Usage: .venv/bin/python bench/cp_compare.py [--seq 4096 --heads 16 --kv-heads 4 --head-dim 64 --iters 3]
The machines here are shared and noisy, and P ranks share the available cores: compare rows of one run only.
"""

from __future__ import annotations

import argparse
import gc
import os
import statistics
import sys
import time

import torch

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "tests"))
from distributed import run_distributed  # noqa: E402  (tests/distributed.py: spawn gloo ranks)

MIB = 1024 * 1024


class LiveTensorBytes(torch.utils._python_dispatch.TorchDispatchMode):
    """Peak bytes of storages created inside the mode and still referenced, checked after every op."""

    def __init__(self, existing=()) -> None:
        super().__init__()
        from torch.multiprocessing.reductions import StorageWeakRef

        self._weakref = StorageWeakRef
        self.live: dict = {}
        self.current = 0
        self.peak = 0
        for t in existing:  # storages allocated before (the inputs): views of them cost nothing
            self.live[t.untyped_storage().data_ptr()] = (StorageWeakRef(t.untyped_storage()), 0)

    def sweep(self) -> int:
        """Forget storages that died; return the bytes still alive."""
        for key, (ref, nbytes) in list(self.live.items()):
            if ref.expired():
                self.current -= nbytes
                del self.live[key]
        return self.current

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        self.sweep()
        for t in torch.utils._pytree.tree_leaves(out):
            if isinstance(t, torch.Tensor) and t.layout == torch.strided:
                storage = t.untyped_storage()
                key, nbytes = storage.data_ptr(), storage.nbytes()
                if nbytes and key not in self.live:
                    self.live[key] = (self._weakref(storage), nbytes)
                    self.current += nbytes
        self.peak = max(self.peak, self.current)
        return out


def variants(world_size, hq, chunks_list):
    """ring; Ulysses and each hybrid U x R with every head_chunks, then with regather_in_backward."""
    out = [dict(name="ring", kind="ring", ulysses=1, chunks=1, regather=False)]
    layouts = [("ulysses", "ulysses", world_size)]
    layouts += [(f"hybrid {u}x{world_size // u}", "hybrid", u) for u in range(2, world_size) if world_size % u == 0]
    for regather in (False, True):
        for label, kind, u in layouts:
            for c in chunks_list:
                name = f"{label} c={c}" + (" regather" if regather else "")
                out.append(dict(name=name, kind=kind, ulysses=u, chunks=c, regather=regather))
    return [v for v in out if (hq // v["ulysses"]) % v["chunks"] == 0 and hq % v["ulysses"] == 0]


def _bench_worker(rank, world_size, cfg):
    import torch.distributed as dist

    from nemo_longctx.attention import (
        count_bytes_sent, hybrid_attention, make_cp_groups, ring_attention, track_a2a_buffer_bytes,
        ulysses_attention,
    )

    world = dist.group.WORLD
    dtype = {"fp32": torch.float32, "bf16": torch.bfloat16}[cfg["dtype"]]
    b, s_local, d = cfg["batch"], cfg["seq"] // world_size, cfg["head_dim"]
    gen = torch.Generator().manual_seed(rank)
    q, k, v, dout = (torch.randn(b, s_local, h, d, generator=gen).to(dtype)
                     for h in (cfg["heads"], cfg["kv_heads"], cfg["kv_heads"], cfg["heads"]))
    vs = variants(world_size, cfg["heads"], cfg["chunks"])
    groups = {u: make_cp_groups(world, u) for u in {v_["ulysses"] for v_ in vs if v_["kind"] == "hybrid"}}

    def forward(var):
        ql, kl, vl = (t.detach().requires_grad_() for t in (q, k, v))
        if var["kind"] == "ring":
            out = ring_attention(ql, kl, vl, world, causal=True)
        elif var["kind"] == "ulysses":
            out = ulysses_attention(ql, kl, vl, world, causal=True, head_chunks=var["chunks"],
                                    regather_in_backward=var["regather"])
        else:
            ug, rg = groups[var["ulysses"]]
            out = hybrid_attention(ql, kl, vl, ug, rg, causal=True, head_chunks=var["chunks"],
                                   regather_in_backward=var["regather"])
        return out

    def run(var):
        forward(var).backward(dout)

    times = {v_["name"]: [] for v_ in vs}
    for it in range(cfg["warmup"] + cfg["iters"]):
        order = vs if it % 2 == 0 else vs[::-1]
        for var in order:
            dist.barrier()
            t0 = time.perf_counter()
            run(var)
            elapsed = torch.tensor([time.perf_counter() - t0], dtype=torch.float64)
            dist.all_reduce(elapsed, op=dist.ReduceOp.MAX)
            if it >= cfg["warmup"]:
                times[var["name"]].append(elapsed.item())
    rows = []
    for var in vs:
        with count_bytes_sent() as sent, track_a2a_buffer_bytes() as a2a:
            live = LiveTensorBytes(existing=(q, k, v, dout))
            with live:
                out = forward(var)
                gc.collect()  # count only what is referenced, not garbage awaiting the cycle collector
                held = live.sweep()  # the output plus what the graph saved for backward
                out.backward(dout)
                del out
        stats = torch.tensor([sent.bytes_sent, a2a.peak_bytes, live.peak, held], dtype=torch.float64)
        dist.all_reduce(stats, op=dist.ReduceOp.MAX)
        rows.append(dict(var, time=statistics.median(times[var["name"]]), sent=stats[0].item(),
                         a2a=stats[1].item(), live=stats[2].item(), held=stats[3].item()))
    return rows


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--seq", type=int, default=4096, help="global sequence length")
    p.add_argument("--batch", type=int, default=1)
    p.add_argument("--heads", type=int, default=16, help="query heads")
    p.add_argument("--kv-heads", type=int, default=4)
    p.add_argument("--head-dim", type=int, default=64)
    p.add_argument("--dtype", choices=("fp32", "bf16"), default="fp32")
    p.add_argument("--world-sizes", default="2,4")
    p.add_argument("--chunks", default="1,2,4", help="head_chunks values for Ulysses/hybrid")
    p.add_argument("--iters", type=int, default=3)
    p.add_argument("--warmup", type=int, default=1)
    args = p.parse_args(argv)
    cfg = dict(seq=args.seq, batch=args.batch, heads=args.heads, kv_heads=args.kv_heads, head_dim=args.head_dim,
               dtype=args.dtype, chunks=[int(c) for c in args.chunks.split(",")], iters=args.iters,
               warmup=args.warmup)
    print(f"causal attention fwd+bwd, S={args.seq}, b={args.batch}, hq={args.heads}, hkv={args.kv_heads}, "
          f"d={args.head_dim}, {args.dtype}; CPU gloo, 1 thread per rank, {os.cpu_count()} cores on this machine; "
          f"median of {args.iters} (after {args.warmup} warm-up), slowest rank. Shared, noisy machine: compare "
          "rows of one run only.\n")
    print("| P | variant | time fwd+bwd (s) | sent/rank (MiB) | peak a2a buffers (MiB) "
          "| peak live attention tensors (MiB) | held fwd->bwd (MiB) |")
    print("|---|---|---|---|---|---|---|")
    for ws in [int(w) for w in args.world_sizes.split(",")]:
        if args.seq % (2 * ws):
            print(f"| {ws} | skipped: --seq must be divisible by {2 * ws} | | | | | |")
            continue
        for r in run_distributed(_bench_worker, ws, cfg, threads=1, timeout=3600)[0]:
            a2a = "-" if r["kind"] == "ring" else f"{r['a2a'] / MIB:.1f}"
            print(f"| {ws} | {r['name']} | {r['time']:.3f} | {r['sent'] / MIB:.1f} | {a2a} | {r['live'] / MIB:.1f} "
                  f"| {r['held'] / MIB:.1f} |", flush=True)


if __name__ == "__main__":
    main()
