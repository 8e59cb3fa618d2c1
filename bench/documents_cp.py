"""Document-aware CP on a long-tail length distribution: per-document zigzag vs short documents kept whole.

Data (stated, seeded): documents with Pareto lengths (shape ``--alpha`` 1.1, minimum ``--min-len`` 64 tokens, capped at
the sequence length: median ~120, mean ~700, about 1 % of documents 4K+), concatenated and cut into packed sequences
of ``--seq`` tokens as Megatron's GPT dataset does (a document crossing a sequence boundary continues in the next
one), ``--batches`` sequences from ``--seed``. Each sequence is one micro-batch of causal attention, forward +
backward, q [1, S, hq, d], k/v [1, S, hkv, d] fp32, on P gloo ranks x 1 thread (ring CP):

  (a) zigzag     every document split over the P ranks (per-document zigzag: the default layout);
  (b) documents  ``cp.split_min_tokens=auto``: the cost model (calibrated here: one kernel call, one pair, one K/V
                 token sent, in the same unit; a padding position priced as the rest of a layer with hidden = hq x d
                 and a 4x gated MLP, which this attention-only bench does not run) picks each sequence's threshold;
                 shorter documents stay whole on one rank, assigned by attention cost;
  (c) bound      (b) with perfect balance: (b)'s time of each sequence x its mean / max rank cost (cost model).

tokens/s = real tokens / summed step time (slowest rank, median of ``--repeats``, variants interleaved per sequence,
their order alternating between repeats); balance = max / mean rank attention cost (the cost model's pairs + calls +
sends; mean over the sequences); CPU time = max / mean of the ranks' thread time (each rank's own work, waiting
excluded); predicted = the cost model's attention speedup over (a) for ring CP (slowest rank's cost; (c): the mean
rank's). The whole-layer prediction (``planner.documents.predict_gain``, padding priced) goes to stderr. Every
output is checked against ring (a)'s on the same tokens (they must agree to fp32 rounding), so a fast wrong answer
cannot appear in the table.

    python bench/documents_cp.py                       # P = 2 and 4, 8 sequences of 8192 tokens
    python bench/documents_cp.py --ranks 4 --batches 4 --repeats 2
"""

from __future__ import annotations

import argparse
import random
import statistics
import sys
import time

import torch
import torch.distributed as dist

from gloo_ranks import run_ranks  # bench/ (the script's directory)


def long_tail_sequences(seq: int, batches: int, seed: int, alpha: float, min_len: int):
    """``batches`` packed sequences of ``seq`` tokens, each a list of document (piece) lengths (module docstring)."""
    from nemo_longctx.planner.documents import pack_documents

    rng = random.Random(seed)

    def lengths():
        while True:
            yield min(seq, int(min_len / (1.0 - rng.random()) ** (1.0 / alpha)))

    return pack_documents(lengths(), seq, max_sequences=batches)


def calibrate(hq: int, hkv: int, d: int):
    """The CPU's cost model (``AttentionCostModel``): one causal (query, key) pair and one kernel call (forward +
    backward, this process, 1 thread), and one K/V token moved between two gloo ranks, all in pairs' worth."""
    from nemo_longctx.attention.kernels import select_kernel
    from nemo_longctx.planner.documents import AttentionCostModel

    kern = select_kernel(torch.device("cpu"), torch.float32, None, head_dim=d, value_dim=d)

    def fwd_bwd(n, reps):
        q, k, v = torch.randn(1, n, hq, d), torch.randn(1, n, hkv, d), torch.randn(1, n, hkv, d)
        best = float("inf")
        for _ in range(reps):
            t0 = time.perf_counter()
            out, lse = kern.forward(q, k, v, True, 0.125)
            kern.backward(torch.ones_like(out), q, k, v, out, lse, True, 0.125)
            best = min(best, time.perf_counter() - t0)
        return best

    t_big, t_small = fwd_bwd(1024, 3), fwd_bwd(8, 50)
    pair = (t_big - t_small) / (1024 * 1025 // 2 - 8 * 9 // 2)
    return AttentionCostModel(pair=1.0, call=t_small / pair), pair


def _send_time(rank, n, hkv, d, reps=5):
    """Seconds to move n K/V tokens (K and V, fp32) to the next rank and receive the previous rank's."""
    from nemo_longctx.attention import RingExchange

    ring = RingExchange(dist.group.WORLD)
    kv = (torch.randn(1, n, hkv, d), torch.randn(1, n, hkv, d))
    best = float("inf")
    for _ in range(reps):
        dist.barrier()
        t0 = time.perf_counter()
        ring.start(kv).wait()
        best = min(best, time.perf_counter() - t0)
    t = torch.tensor([best])
    dist.all_reduce(t, op=dist.ReduceOp.MAX)
    return t.item()


def _step(rank, world, algorithm, placement, shard_tensors):
    """One causal fwd+bwd of this rank's shard under ``placement``: (wall s, slowest rank; this rank's CPU s; out)."""
    from nemo_longctx.attention import ring_attention, ulysses_attention
    from nemo_longctx.attention.documents import DocumentShard, document_attention

    cu, cup = placement.split_layout()
    shard = DocumentShard(placement.split_local, cu, cup, *placement.kept_layout(rank))
    q, k, v = (t.detach().requires_grad_() for t in shard_tensors[:3])
    group = dist.group.WORLD
    fn = ring_attention if algorithm == "ring" else ulysses_attention
    dist.barrier()
    c0, t0 = time.thread_time(), time.perf_counter()
    out = document_attention(q, k, v, shard, lambda a, b, c, **thd: fn(a, b, c, group, True, **thd), causal=True)
    out.backward(shard_tensors[3])
    dt, cpu = time.perf_counter() - t0, time.thread_time() - c0
    t = torch.tensor([dt])
    dist.all_reduce(t, op=dist.ReduceOp.MAX)
    return t.item(), cpu, out.detach()


def _worker(rank, world, args, alpha, cost):
    """One rank's measurements (run_ranks: gloo, 1 thread); rank 0's result goes back to the parent."""
    from dataclasses import replace

    from nemo_longctx.planner.documents import layer_token_pairs, place_documents, predict_gain, resolve_placement

    send = _send_time(rank, 1024, args.hkv, args.d) / 1024 / cost[1]
    hidden = args.hq * args.d
    token = layer_token_pairs(hidden, args.hq, args.hkv, args.d, 4 * hidden) if args.layer_tokens else 0.0
    model = replace(cost[0], send=send, token=token)
    seqs = long_tail_sequences(args.seq, args.batches, args.seed, alpha, args.min_len)
    gen = torch.Generator().manual_seed(args.seed)
    rows = {(algo, key): [] for algo in args.algorithms for key in "ab"}
    for lengths in seqs:
        T = sum(lengths)
        full = [torch.randn(1, T, h, args.d, generator=gen) for h in (args.hq, args.hkv, args.hkv, args.hq)]
        starts = [sum(lengths[:i]) for i in range(len(lengths))]
        plans = {"a": place_documents(lengths, world, None, model),
                 "b": resolve_placement(lengths, world, "auto", model)}
        shards, index = {}, {}
        for key, pl in plans.items():
            docs, offs = pl.token_sources(rank)
            src = torch.tensor([starts[i] + o if i >= 0 else 0 for i, o in zip(docs, offs)])
            real = torch.tensor([i >= 0 for i in docs])
            shards[key] = [(t[:, src] * real[None, :, None, None]).contiguous() for t in full]
            index[key] = (src, real)
        variants = [(algo, key) for algo in args.algorithms for key in plans]
        times = {v: [] for v in variants}
        cpus = {v: [] for v in variants}
        outs = {}
        for rep in range(args.repeats + 1):  # the first round is a warm-up; the order alternates (drift)
            for algo, key in (variants if rep % 2 else variants[::-1]):
                dt, cpu, out = _step(rank, world, algo, plans[key], shards[key])
                outs[(algo, key)] = out
                if rep:
                    times[(algo, key)].append(dt)
                    cpus[(algo, key)].append(cpu)
        # every variant against ring (a) on the same tokens: scatter the shards' real rows to packed positions
        got = {}
        for algo, key in variants:
            src, real = index[key]
            buf = torch.zeros(T, args.hq, args.d)
            buf[src[real]] = outs[(algo, key)][0, real]
            dist.all_reduce(buf)
            got[(algo, key)] = buf
        base = got[(args.algorithms[0], "a")]
        cpu_t = torch.tensor([[statistics.median(cpus[v]) for v in variants]])
        gathered = [torch.zeros_like(cpu_t) for _ in range(world)]
        dist.all_gather(gathered, cpu_t)
        cpu_all = torch.cat(gathered)  # [world, variants]
        for j, (algo, key) in enumerate(variants):
            pl = plans[key]
            col = cpu_all[:, j]
            t = statistics.median(times[(algo, key)])
            rows[(algo, key)].append(dict(
                tokens=T, time=t, balance=pl.balance, measured=(col.max() / col.mean()).item(),
                kept=len(pl.kept), docs=sum(1 for n in lengths if n), split_min=pl.split_min_tokens,
                local=pl.local_len, zigzag_local=plans["a"].local_len,
                err=(got[(algo, key)] - base).abs().max().item(), bound=t / pl.balance,
                cost_max=max(pl.costs), cost_mean=sum(pl.costs) / len(pl.costs)))
    gain = predict_gain(seqs, world, "auto", model)
    return dict(rows=rows, gain=gain, model=model, seqs=seqs)


def fmt(x):
    return "-" if x is None else f"{x:.2f}"


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--ranks", type=int, nargs="+", default=[2, 4])
    ap.add_argument("--seq", type=int, default=8192)
    ap.add_argument("--batches", type=int, default=8)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--alphas", type=float, nargs="+", default=[1.1, 2.0])
    ap.add_argument("--algorithms", nargs="+", default=["ring", "ulysses"], choices=["ring", "ulysses"])
    ap.add_argument("--min-len", type=int, default=64)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--hq", type=int, default=8)
    ap.add_argument("--hkv", type=int, default=2)
    ap.add_argument("--d", type=int, default=64)
    ap.add_argument("--no-layer-tokens", dest="layer_tokens", action="store_false",
                    help="place without charging padding positions (default: each costs the rest of a layer with "
                         "hidden = hq x d and a 4x gated MLP, planner.documents.layer_token_pairs)")
    args = ap.parse_args(argv)
    torch.set_num_threads(1)
    cost = calibrate(args.hq, args.hkv, args.d)
    print(f"causal fwd+bwd, hq={args.hq} hkv={args.hkv} d={args.d} fp32, gloo x 1 thread per rank, {args.batches} "
          f"packed sequences of {args.seq} tokens per distribution, seed {args.seed}, median of {args.repeats}")
    print(f"cost model (this CPU): one kernel call = {cost[0].call:.0f} pairs, one pair = {cost[1] * 1e9:.2f} ns")
    print("| distribution | P | CP | layout | tokens/s | vs (a) | predicted | balance (cost model) | "
          "balance (CPU time) | kept | local length | max abs diff |")
    print("|---|---|---|---|---:|---:|---:|---:|---:|---:|---:|---:|")
    for alpha in args.alphas:
        seqs = long_tail_sequences(args.seq, args.batches, args.seed, alpha, args.min_len)
        docs = [n for s in seqs for n in s]
        short = sum(n * n for n in docs if n < args.seq // 8) / sum(n * n for n in docs)
        dist_name = (f"Pareto {alpha:g} (median {statistics.median(docs):.0f}, longest {max(docs)}; "
                     f"{100 * short:.0f}% of pairs in docs < {args.seq // 8})")
        for world in args.ranks:
            res = run_ranks(_worker, world, args, alpha, cost, timeout=7200)
            rows, gain = res["rows"], res["gain"]
            for algo in args.algorithms:
                ra, rb = rows[(algo, "a")], rows[(algo, "b")]
                tokens = sum(r["tokens"] for r in ra)
                ta, tb, tc = (sum(r["time"] for r in ra), sum(r["time"] for r in rb), sum(r["bound"] for r in rb))
                mean = lambda rs, f: statistics.mean(r[f] for r in rs)  # noqa: E731
                kept, total = sum(r["kept"] for r in rb), sum(r["docs"] for r in rb)
                # the cost model's attention-only prediction (ring's per-document blocks): what this bench times
                pa = sum(r["cost_max"] for r in ra)
                pred = pa / sum(r["cost_max"] for r in rb) if algo == "ring" else None
                bound = pa / sum(r["cost_mean"] for r in rb) if algo == "ring" else None
                la, lb = sum(r["zigzag_local"] for r in rb), sum(r["local"] for r in rb)
                print(f"| {dist_name} | {world} | {algo} | (a) zigzag | {tokens / ta:,.0f} | 1.00 | 1.00 | "
                      f"{mean(ra, 'balance'):.3f} | {mean(ra, 'measured'):.3f} | 0 / {total} | 1.00 | "
                      f"{max(r['err'] for r in ra):.1e} |")
                print(f"| {dist_name} | {world} | {algo} | (b) documents | {tokens / tb:,.0f} | {ta / tb:.2f} | "
                      f"{fmt(pred)} | {mean(rb, 'balance'):.3f} | {mean(rb, 'measured'):.3f} | {kept} / {total} | "
                      f"{lb / la:.2f} | {max(r['err'] for r in rb):.1e} |")
                print(f"| {dist_name} | {world} | {algo} | (c) bound | {tokens / tc:,.0f} | {ta / tc:.2f} | "
                      f"{fmt(bound)} | 1.000 | - | - | - | - |")
            print(f"  ({dist_name}, P={world}: one K/V token sent = {res['model'].send:.0f} pairs, one padding "
                  f"position {res['model'].token:.0f}; predicted whole-layer gain {gain.speedup:.2f} (bound "
                  f"{gain.perfect_speedup:.2f}); thresholds chosen: "
                  f"{[r['split_min'] for r in rows[(args.algorithms[0], 'b')]]})", file=sys.stderr)
            sys.stdout.flush()


if __name__ == "__main__":
    main()
