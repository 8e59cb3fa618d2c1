"""Sequence-chunked layers on CPU: step time and activation peak against plain full recompute, side by side.

    python bench/sequence_chunks.py [--seq 8192] [--chunks 2 4 8] [--rounds 3] [--hidden 256 --layers 2]

One process (CP size 1, gloo), a Llama-like Megatron GPTModel (local spec, our core attention, GQA 8q/2kv, fp32),
``recompute=full`` with and without ``recompute.sequence_chunks=N``: the same 2 steps per setting, settings
alternated for ``--rounds`` rounds (this VM drifts ~20%: compare within one run). Prints a markdown table: median
step time, its ratio to full recompute, the tracker's activation peak (MiB) and the planner's predicted peak
(LOCAL_CPU coefficients, fp32).
"""

from __future__ import annotations

import argparse
import statistics
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "tests"))


def _bench(rank, world, seq, hidden, layers, chunk_counts, rounds):
    import torch

    from nemo_longctx.integrations.megatron import cpu_compat

    cpu_compat.apply()
    from megatron.core import parallel_state as ps
    from megatron.core import tensor_parallel

    from nemo_longctx.integrations.megatron.memory_options import MemoryOptions
    from nemo_longctx.integrations.megatron.memory_probe import (
        build_probe_model, full_batches, run_probe_steps, tiny_gpt_config)

    ps.initialize_model_parallel(context_parallel_size=1)
    tensor_parallel.model_parallel_cuda_manual_seed(3)
    cfg = tiny_gpt_config(num_layers=layers, hidden_size=hidden, heads=8, groups=2, ffn_hidden_size=hidden * 11 // 4)
    vocab = 512
    init, _ = build_probe_model(cfg, MemoryOptions(), vocab_size=vocab, seq_length=seq)
    settings = {1: MemoryOptions(recompute="full")}
    settings.update({n: MemoryOptions(recompute="full", sequence_chunks=n) for n in chunk_counts})
    models = {n: build_probe_model(cfg, o, vocab_size=vocab, seq_length=seq, params_from=init)
              for n, o in settings.items()}
    batches = full_batches(2, seq, vocab, seed=1)
    times = {n: [] for n in settings}
    peaks, losses = {}, {}
    for _ in range(rounds):
        for n, (model, rt) in models.items():
            r = run_probe_steps(model, rt, batches, count_peak=True, keep_grads=False)
            times[n] += r.step_times
            peaks[n] = max(s.peak_bytes for s in r.stats)
            losses[n] = r.losses
    ps.destroy_model_parallel()
    torch.set_num_threads(torch.get_num_threads())
    return {"times": times, "peaks": peaks, "losses": losses, "vocab": vocab, "ffn": cfg.ffn_hidden_size}


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--seq", type=int, default=8192)
    ap.add_argument("--hidden", type=int, default=256)
    ap.add_argument("--layers", type=int, default=2)
    ap.add_argument("--chunks", type=int, nargs="+", default=[2, 4, 8])
    ap.add_argument("--rounds", type=int, default=3)
    a = ap.parse_args(argv)
    from distributed import run_distributed

    from nemo_longctx.planner.model_shapes import ModelShape
    from nemo_longctx.planner.search import LOCAL_CPU, Candidate, predicted_peak_bytes

    res = run_distributed(_bench, 1, a.seq, a.hidden, a.layers, a.chunks, a.rounds, timeout=3000, threads=2)[0]
    shape = ModelShape("bench", a.layers, a.hidden, res["ffn"], 8, 2, res["vocab"])
    base = statistics.median(res["times"][1])
    print(f"seq {a.seq}, hidden {a.hidden}, {a.layers} layers, fp32, CPU (2 threads), {a.rounds} rounds x 2 steps\n")
    print("| setting | median step (s) | vs full | peak MiB (tracker) | predicted MiB | pred/meas | loss step 2 |")
    print("|---|---|---|---|---|---|---|")
    for n, ts in res["times"].items():
        med = statistics.median(ts)
        pred = predicted_peak_bytes(shape, a.seq, Candidate(recompute="full", sequence_chunks=n), LOCAL_CPU, 4)
        peak = res["peaks"][n]
        name = "recompute=full" if n == 1 else f"+ sequence_chunks={n}"
        print(f"| {name} | {med:.2f} | {med / base:.2f}x | {peak / 2**20:.1f} | {pred / 2**20:.1f} | "
              f"{pred / peak:.3f} | {res['losses'][n][-1]:.7f} |")


if __name__ == "__main__":
    main()
