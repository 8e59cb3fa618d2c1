"""Packed documents and sliding windows under CP on CPU: what skipping masked work and sending only a halo buys.

Section "packed" (P=2 gloo ranks x 1 thread): causal fwd+bwd of q [1, S, hq, d], k/v [1, S, hkv, d] as one dense
sequence vs the same S tokens as 16 documents of S/16 (``cu_seqlens``, per-document zigzag), for the ring and for
Ulysses; ratio = T(packed) / T(dense) (ideal 1/16 = 0.0625: the work is proportional to the sum of squared
document lengths; the ring's K/V still travel).
Section "swa" (P=4 gloo ranks): causal SWA with window W < chunk (S / 2P) vs full causal attention, ring: bytes
sent per rank (forward + backward; ``comm.count_bytes_sent``) and time. Only the halo of W keys from the
neighbouring chunks travels (target <= 1/(P-1) of the full ring's bytes).
Every variant is checked against the other algorithm's output (packed: ring vs Ulysses; swa: ring vs a
single-process reference on rank 0), so a fast wrong answer cannot appear in the table. Times: median over
repeats (variants interleaved), slowest rank.

    python bench/packed_swa.py                         # packed at S=16K, 32K; swa at S=16K, W=512, P=4
    python bench/packed_swa.py --sections packed --sizes 16384 --repeats 3
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time

import torch
import torch.distributed as dist

from gloo_ranks import run_ranks  # bench/ (the script's directory)


def _inputs(S, hq, hkv, d, seed=0):
    g = torch.Generator().manual_seed(seed)
    return (torch.randn(1, S, hq, d, generator=g), torch.randn(1, S, hkv, d, generator=g),
            torch.randn(1, S, hkv, d, generator=g), torch.randn(1, S, hq, d, generator=g))


def _timed(fn, shard):
    from nemo_longctx.attention import count_bytes_sent

    q, k, v = (t.detach().requires_grad_() for t in shard[:3])
    dist.barrier()
    with count_bytes_sent() as sent:
        t0 = time.perf_counter()
        out = fn(q, k, v)
        out.backward(shard[3])
        dt = time.perf_counter() - t0
    t = torch.tensor([dt])
    dist.all_reduce(t, op=dist.ReduceOp.MAX)
    return t.item(), sent.bytes_sent, out.detach()


def _packed(rank, world, args):
    from nemo_longctx.attention import ring_attention, ulysses_attention, zigzag_shard

    rows = []
    for S in args.sizes:
        q, k, v, dout = _inputs(S, args.hq, args.hkv, args.d)
        n = S // args.docs
        cu = torch.arange(0, S + 1, n, dtype=torch.int32)
        dense = [zigzag_shard(t, 1, world, rank).contiguous() for t in (q, k, v, dout)]
        packed = [zigzag_shard(t, 1, world, rank, cu_seqlens_padded=cu).contiguous() for t in (q, k, v, dout)]
        fns = {
            ("ring", "dense"): lambda a, b, c: ring_attention(a, b, c, dist.group.WORLD, True),
            ("ring", "packed"): lambda a, b, c: ring_attention(a, b, c, dist.group.WORLD, True, cu_seqlens=cu,
                                                                cu_seqlens_padded=cu),
            ("ulysses", "dense"): lambda a, b, c: ulysses_attention(a, b, c, dist.group.WORLD, True),
            ("ulysses", "packed"): lambda a, b, c: ulysses_attention(a, b, c, dist.group.WORLD, True, cu_seqlens=cu,
                                                                      cu_seqlens_padded=cu),
        }
        times = {key: [] for key in fns}
        outs = {}
        for rep in range(args.repeats + 1):  # the first round is a warm-up
            for key, fn in fns.items():
                dt, sent, out = _timed(fn, packed if key[1] == "packed" else dense)
                outs[key] = out
                if rep:
                    times[key].append(dt)
        err = {kind: (outs[("ring", kind)] - outs[("ulysses", kind)]).abs().max().item()
               for kind in ("dense", "packed")}
        for algo in ("ring", "ulysses"):
            td, tp = statistics.median(times[(algo, "dense")]), statistics.median(times[(algo, "packed")])
            rows.append(dict(S=S, algo=algo, dense=td, packed=tp, ratio=tp / td, err=max(err.values())))
    return rows


def _swa(rank, world, args):
    from nemo_longctx.attention import local_attention, ring_attention, zigzag_shard

    rows = []
    S, W = args.swa_size, args.window
    q, k, v, dout = _inputs(S, args.hq, args.hkv, args.d)
    shard = [zigzag_shard(t, 1, world, rank).contiguous() for t in (q, k, v, dout)]
    fns = {"full": lambda a, b, c: ring_attention(a, b, c, dist.group.WORLD, True),
           "swa": lambda a, b, c: ring_attention(a, b, c, dist.group.WORLD, True, window_size=(W, 0))}
    times = {key: [] for key in fns}
    sent, outs = {}, {}
    for rep in range(args.repeats + 1):
        for key, fn in fns.items():
            dt, b, out = _timed(fn, shard)
            sent[key], outs[key] = b, out
            if rep:
                times[key].append(dt)
    err = 0.0
    if rank == 0:  # the windowed result vs one process on the whole sequence (same kernels, no CP)
        ref = local_attention(q, k, v, True, window_size=(W, 0))
        err = (outs["swa"] - zigzag_shard(ref, 1, world, 0)).abs().max().item()
    b = torch.tensor([sent["full"], sent["swa"]], dtype=torch.float64)
    dist.all_reduce(b, op=dist.ReduceOp.MAX)
    rows.append(dict(S=S, W=W, P=world, chunk=S // (2 * world), full_t=statistics.median(times["full"]),
                     swa_t=statistics.median(times["swa"]), full_b=b[0].item(), swa_b=b[1].item(), err=err))
    return rows


def _worker(rank, world, section, args):
    """One rank of a section (run_ranks: gloo, 1 thread); rank 0's rows go back to the parent."""
    return _packed(rank, world, args) if section == "packed" else _swa(rank, world, args)


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--sections", default="packed,swa")
    ap.add_argument("--sizes", type=int, nargs="+", default=[16384, 32768])
    ap.add_argument("--docs", type=int, default=16)
    ap.add_argument("--swa-size", type=int, default=16384)
    ap.add_argument("--window", type=int, default=512)
    ap.add_argument("--swa-ranks", type=int, default=4)
    ap.add_argument("--repeats", type=int, default=2)
    ap.add_argument("--hq", type=int, default=8)
    ap.add_argument("--hkv", type=int, default=2)
    ap.add_argument("--d", type=int, default=64)
    args = ap.parse_args(argv)
    sections = args.sections.split(",")
    if "packed" in sections:
        rows = run_ranks(_worker, 2, "packed", args, timeout=3600)
        print(f"packed vs dense, causal fwd+bwd, P=2 gloo ranks x 1 thread, {args.docs} documents of S/{args.docs}, "
              f"hq={args.hq} hkv={args.hkv} d={args.d} fp32, median of {args.repeats}, slowest rank")
        print("| S | algorithm | dense (s) | packed (s) | packed / dense | max abs diff ring vs Ulysses |")
        print("|---|---|---:|---:|---:|---:|")
        for r in rows:
            print(f"| {r['S']} | {r['algo']} | {r['dense']:.3f} | {r['packed']:.3f} | {r['ratio']:.3f} | "
                  f"{r['err']:.1e} |")
        sys.stdout.flush()
    if "swa" in sections:
        rows = run_ranks(_worker, args.swa_ranks, "swa", args, timeout=3600)
        print(f"\nsliding window vs full causal, ring, fwd+bwd, hq={args.hq} hkv={args.hkv} d={args.d} fp32, median of "
              f"{args.repeats}, slowest rank; bytes = max over ranks of bytes sent (forward + backward)")
        print("| S | P | chunk | window | full: sent/rank (MiB) | SWA: sent/rank (MiB) | SWA / full bytes | 1/(P-1) "
              "| full (s) | SWA (s) | max abs err vs 1 process |")
        print("|---|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|")
        for r in rows:
            print(f"| {r['S']} | {r['P']} | {r['chunk']} | {r['W']} | {r['full_b'] / 2**20:.2f} | "
                  f"{r['swa_b'] / 2**20:.2f} | {r['swa_b'] / r['full_b']:.3f} | {1 / (r['P'] - 1):.3f} | "
                  f"{r['full_t']:.3f} | {r['swa_t']:.3f} | {r['err']:.1e} |")


if __name__ == "__main__":
    main()
