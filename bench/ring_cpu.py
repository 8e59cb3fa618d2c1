"""Ring attention on CPU: P gloo processes x 1 thread vs one process x 1 thread on the whole problem.

For each global sequence length S, causal fwd+bwd of q [1, S, hq, d], k/v [1, S, hkv, d]:
  T_full   one process computes the whole problem with the same local kernel (rank 0, the others idle)
  T_ring   every rank runs ring_attention on its zigzag shard; the slowest rank's time counts
  efficiency = T_full / (P * T_ring)   (1.0 = perfect scaling)
Both are measured in the same processes, alternating, repeat after repeat (this VM drifts ~20% minute to
minute); the table reports medians. Bytes sent per rank are counted and compared with the minimum
  forward  (P-1) * 2 * S/P * hkv * d * itemsize                 (K and V of hkv real heads)
  backward the same again + (P-1) * 2 * S/P * hkv * d * 4       (float32 dK/dV accumulators)

    python bench/ring_cpu.py                      # S in 4K, 8K, 16K; hq=8, hkv=2 (GQA 4:1), d=64, fp32
    python bench/ring_cpu.py --sizes 8192 --repeats 5
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time

import torch
import torch.distributed as dist

from gloo_ranks import run_ranks  # bench/ (the script's directory)

DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16}


def _inputs(S, hq, hkv, d, dtype, seed=0):
    g = torch.Generator().manual_seed(seed)
    return (torch.randn(1, S, hq, d, generator=g).to(dtype), torch.randn(1, S, hkv, d, generator=g).to(dtype),
            torch.randn(1, S, hkv, d, generator=g).to(dtype), torch.randn(1, S, hq, d, generator=g).to(dtype))


def _fwd_bwd(fn, q, k, v, dout):
    q, k, v = (t.detach().requires_grad_() for t in (q, k, v))
    t0 = time.perf_counter()
    out = fn(q, k, v)
    out.backward(dout)
    return time.perf_counter() - t0


def _worker(rank, world, args):
    """One rank's measurements (run_ranks: gloo, 1 thread); rank 0's rows go back to the parent."""
    from nemo_longctx.attention import count_bytes_sent, local_attention, ring_attention, zigzag_shard

    dtype = DTYPES[args.dtype]
    rows = []
    for S in args.sizes:
        q, k, v, dout = _inputs(S, args.hq, args.hkv, args.d, dtype)
        shard = [zigzag_shard(t, 1, world, rank).contiguous() for t in (q, k, v, dout)]
        ring = lambda a, b, c: ring_attention(a, b, c, dist.group.WORLD, causal=True)  # noqa: E731
        # warm-up (also counts bytes once)
        with count_bytes_sent() as fwd_c:
            qq, kk, vv = (t.detach().requires_grad_() for t in shard[:3])
            out = ring(qq, kk, vv)
        with count_bytes_sent() as bwd_c:
            out.backward(shard[3])
        full_times, ring_times = [], []
        for _ in range(args.repeats):
            dist.barrier()
            if rank == 0:
                full_times.append(_fwd_bwd(lambda a, b, c: local_attention(a, b, c, causal=True), q, k, v, dout))
            dist.barrier()
            t = torch.tensor([_fwd_bwd(ring, *shard)], dtype=torch.float64)
            dist.all_reduce(t, op=dist.ReduceOp.MAX)
            ring_times.append(t.item())
        if rank == 0:
            rows.append(dict(S=S, t_full=statistics.median(full_times), t_ring=statistics.median(ring_times),
                             fwd_bytes=fwd_c.bytes_sent, bwd_bytes=bwd_c.bytes_sent,
                             itemsize=torch.empty(0, dtype=dtype).element_size()))
    return rows


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--sizes", type=lambda s: [int(x) for x in s.split(",")], default=[4096, 8192, 16384])
    p.add_argument("--world", type=int, default=2)
    p.add_argument("--hq", type=int, default=8)
    p.add_argument("--hkv", type=int, default=2)
    p.add_argument("--d", type=int, default=64)
    p.add_argument("--dtype", choices=sorted(DTYPES), default="fp32")
    p.add_argument("--repeats", type=int, default=3)
    args = p.parse_args(argv)
    for S in args.sizes:
        if S % (2 * args.world):
            sys.exit(f"--sizes: {S} is not divisible by 2*world = {2 * args.world}")
    rows = run_ranks(_worker, args.world, args, timeout=None)
    P = args.world
    print(f"ring attention, causal fwd+bwd, P={P} gloo ranks x 1 thread vs 1 process x 1 thread; "
          f"hq={args.hq} hkv={args.hkv} d={args.d} {args.dtype}; median of {args.repeats}")
    print("| S | T_full (s) | T_ring slowest rank (s) | efficiency | fwd bytes/rank (x min) | bwd bytes/rank (x min) |")
    print("|---|---|---|---|---|---|")
    for r in rows:
        kv = 2 * (r["S"] // P) * args.hkv * args.d
        fwd_min = (P - 1) * kv * r["itemsize"]
        bwd_min = fwd_min + (P - 1) * kv * 4
        eff = r["t_full"] / (P * r["t_ring"])
        print(f"| {r['S']} | {r['t_full']:.3f} | {r['t_ring']:.3f} | {eff:.3f} | "
              f"{r['fwd_bytes'] / 2**20:.2f} MiB ({r['fwd_bytes'] / fwd_min:.2f}) | "
              f"{r['bwd_bytes'] / 2**20:.2f} MiB ({r['bwd_bytes'] / bwd_min:.2f}) |")


if __name__ == "__main__":
    main()
