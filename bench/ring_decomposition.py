"""Ring decomposition efficiency on one device: the per-rank block schedule of ring attention vs one kernel call.

Ring attention splits causal attention over P ranks into blocks (``ring._block_plan``: the diagonal block, then
P-1 unmasked half blocks, zigzag-balanced) plus LSE merges and float32 gradient accumulation. This script
runs, on ONE device and without communication, exactly the kernel calls, merges and accumulations each rank
of a P-rank ring performs (fwd+bwd), using the K/V shards every rank would receive, and compares with one
fwd+bwd kernel call on the whole sequence (NCCL needs two GPUs; this isolates the compute part):

    efficiency   = T_full / sum_r T_rank(r)      (1.0: the decomposition costs nothing; target >= 0.95)
    balance      = mean_r T_rank / max_r T_rank  (1.0: every rank does the same work)
    exact        = the assembled ring output/gradients vs the whole-sequence call (rel err, same kernel)

    python bench/ring_decomposition.py                       # CUDA: S=16K,64K, Llama-3-8B heads, bf16, P=2,4,8
    python bench/ring_decomposition.py --sizes 32768 --ps 2 4 8 --kernel sdpa_flash
    python bench/ring_decomposition.py --cpu-small            # reduced CPU form (what the tests run)
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from nemo_longctx.attention import kernels as K  # noqa: E402
from nemo_longctx.attention.layouts import zigzag_shard, zigzag_unshard  # noqa: E402
from nemo_longctx.attention.merge import merge_attention_  # noqa: E402
from nemo_longctx.attention.ring import _accumulator_dtype, _block_plan, _grad_accumulator  # noqa: E402

DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}


def _sync(dev: torch.device) -> None:
    if dev.type == "cuda":
        torch.cuda.synchronize(dev)


def rank_schedule(kern, qs_all, ks_all, vs_all, douts_all, rank: int, P: int, scale: float):
    """Forward + backward of rank ``rank`` in a P-rank causal ring, with the K/V of rank (rank - step) at each
    step taken from the local lists (what the ring would have delivered). Returns (out, dq, dk_parts, dv_parts):
    dk/dv contributions this rank makes to every source block (summed over ranks by the caller)."""
    q, dout = qs_all[rank], douts_all[rank]
    c = q.shape[1] // 2
    acc = _accumulator_dtype(q.dtype)
    acc_out = acc_lse = None
    for step in range(P):
        src = (rank - step) % P
        qsl, kvs, causal = _block_plan(step, rank, P, True, c)
        out, lse = kern.forward(q[:, qsl], ks_all[src][:, kvs], vs_all[src][:, kvs], causal, scale)
        if step == 0:
            acc_out, acc_lse = out.to(acc), lse.to(acc)
        else:
            merge_attention_(acc_out[:, qsl], acc_lse[:, :, qsl], out, lse)
    out = acc_out.to(q.dtype)
    dq = None
    dk_parts, dv_parts = {}, {}
    for step in range(P):  # the accumulation of ring.ring_attention_backward, with each block's buffer kept apart
        src = (rank - step) % P
        qsl, kvs, causal = _block_plan(step, rank, P, True, c)
        dq_i, dk_i, dv_i = kern.backward(dout[:, qsl], q[:, qsl], ks_all[src][:, kvs], vs_all[src][:, kvs],
                                         out[:, qsl], acc_lse[:, :, qsl], causal, scale)
        if step == 0:
            dq = dq_i.to(acc)
        else:
            dq[:, qsl].add_(dq_i)
        dk_parts[src] = _grad_accumulator(dk_i, kvs, ks_all[src], acc)
        dv_parts[src] = _grad_accumulator(dv_i, kvs, vs_all[src], acc)
    return out, dq.to(q.dtype), dk_parts, dv_parts


def measure(S: int, P: int, hq: int, hkv: int, d: int, dtype: torch.dtype, dev: torch.device, kernel: str,
            repeats: int) -> dict:
    kern = K.select_kernel(dev, dtype, kernel)
    g = torch.Generator().manual_seed(0)
    q, k, v, dout = (torch.randn(1, S, h, d, generator=g).to(device=dev, dtype=dtype) for h in (hq, hkv, hkv, hq))
    scale = d ** -0.5
    shards = [[zigzag_shard(t, 1, P, r).contiguous() for r in range(P)] for t in (q, k, v, dout)]

    def full():
        o, lse = kern.forward(q, k, v, True, scale)
        return (o,) + tuple(kern.backward(dout, q, k, v, o, lse, True, scale))

    def one_rank(r):
        return rank_schedule(kern, *shards, r, P, scale)

    def timed(fn):
        _sync(dev)
        t0 = time.perf_counter()
        res = fn()
        _sync(dev)
        return time.perf_counter() - t0, res

    full_ref = full()  # warm-up
    results = [one_rank(r) for r in range(P)]
    t_full, t_ranks = [], [[] for _ in range(P)]
    for _ in range(repeats):  # alternate full / ring so drift hits both alike
        t_full.append(timed(full)[0])
        for r in range(P):
            t_ranks[r].append(timed(lambda: one_rank(r))[0])
    tf = statistics.median(t_full)
    tr = [statistics.median(x) for x in t_ranks]
    # exactness of the decomposition vs the whole-sequence call (same kernel, same dtype)
    out = zigzag_unshard([res[0] for res in results], 1)
    dq = zigzag_unshard([res[1] for res in results], 1)
    dk = zigzag_unshard([sum(res[2][src] for res in results) for src in range(P)], 1)
    dv = zigzag_unshard([sum(res[3][src] for res in results) for src in range(P)], 1)
    err = max(K.rel_err(a, b) for a, b in zip((out, dq, dk, dv), full_ref))
    return dict(S=S, P=P, t_full=tf, t_ranks=tr, efficiency=tf / sum(tr), balance=statistics.mean(tr) / max(tr),
                err=err, kernel=kern.name)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--sizes", type=int, nargs="+", default=None)
    ap.add_argument("--ps", type=int, nargs="+", default=[2, 4, 8])
    ap.add_argument("--hq", type=int, default=32)
    ap.add_argument("--hkv", type=int, default=8)
    ap.add_argument("--d", type=int, default=128)
    ap.add_argument("--dtype", choices=sorted(DTYPES), default=None)
    ap.add_argument("--kernel", default="auto")
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--device", default=None)
    ap.add_argument("--cpu-small", action="store_true", help="reduced CPU form: S=512, hq=4 hkv=2 d=32, fp32")
    ap.add_argument("--min-efficiency", type=float, default=None, help="exit 1 if any efficiency is below this")
    args = ap.parse_args(argv)
    dev = torch.device(args.device or ("cuda" if torch.cuda.is_available() and not args.cpu_small else "cpu"))
    if args.cpu_small:
        args.sizes, args.hq, args.hkv, args.d = args.sizes or [512], 4, 2, 32
        args.ps, args.repeats = [p for p in args.ps if p <= 4], min(args.repeats, 2)
        args.dtype = args.dtype or "fp32"
    if dev.type == "cpu":
        torch.set_num_threads(1)  # steadier on a shared CPU
    sizes = args.sizes or ([16384, 65536] if dev.type == "cuda" else [2048])
    dtype = DTYPES[args.dtype or ("bf16" if dev.type == "cuda" else "fp32")]
    name = torch.cuda.get_device_name(dev) if dev.type == "cuda" else "CPU"
    print(f"ring decomposition on one device ({name}, torch {torch.__version__}): causal fwd+bwd, "
          f"hq={args.hq} hkv={args.hkv} d={args.d} {str(dtype).replace('torch.', '')}, median of {args.repeats}")
    print("| S | P | kernel | T_full (ms) | sum of rank schedules (ms) | slowest rank (ms) | efficiency | balance |"
          " rel err vs full |")
    print("|---|---|---|---:|---:|---:|---:|---:|---:|")
    worst = 1.0
    for S in sizes:
        for P in args.ps:
            if S % (2 * P):
                continue
            r = measure(S, P, args.hq, args.hkv, args.d, dtype, dev, args.kernel, args.repeats)
            worst = min(worst, r["efficiency"])
            print(f"| {S} | {P} | {r['kernel']} | {r['t_full'] * 1e3:.2f} | {sum(r['t_ranks']) * 1e3:.2f} | "
                  f"{max(r['t_ranks']) * 1e3:.2f} | {r['efficiency']:.3f} | {r['balance']:.3f} | {r['err']:.1e} |",
                  flush=True)
    if args.min_efficiency is not None and worst < args.min_efficiency:
        print(f"efficiency {worst:.3f} < {args.min_efficiency}")
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
