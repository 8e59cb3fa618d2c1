"""Activation offload on the device: pinned copy bandwidth, exactness and step-time overlap.

  bandwidth   D2H / H2D GB/s between device memory and a pinned host buffer (256 MiB)
  exact       loss and gradients with offload (modules mode, checkpointed layer_input mode) vs without: bit-exact
  overlap     median step time (fwd+bwd) of a checkpointed residual-MLP stack without offload and with
              layer_input offload + prefetch 1; overhead = T_offload / T_plain - 1, and the number of host-blocking
              Event/Stream.synchronize calls during the offloaded steps (must be 0)

    python bench/offload_overlap.py                    # CUDA: 8 layers, d=2048, 8K tokens, bf16; also 4K/16K
    python bench/offload_overlap.py --tokens 4096 16384 --d 4096
    python bench/offload_overlap.py --cpu-small         # reduced CPU form (exactness + plain/offload step time)
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from nemo_longctx.selftest import ToyModel, offload_exactness, offload_overlap, pinned_bandwidth  # noqa: E402


def cpu_step_times(layers: int, d: int, tokens: int, steps: int) -> dict:
    from nemo_longctx.memory import ActivationOffloader

    torch.manual_seed(0)
    model = ToyModel(layers, d)
    x = torch.randn(tokens, d)
    engine = ActivationOffloader(min_bytes=1024, prefetch_depth=1)
    times = {"plain": [], "offload": []}
    for _ in range(steps):
        for key, eng in (("plain", None), ("offload", engine)):
            t0 = time.perf_counter()
            model(x, engine=eng, checkpointed=True).backward()
            times[key].append(time.perf_counter() - t0)
    return {k: statistics.median(v) for k, v in times.items()}


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--layers", type=int, default=8)
    ap.add_argument("--d", type=int, default=2048)
    ap.add_argument("--tokens", type=int, nargs="+", default=[4096, 8192, 16384])
    ap.add_argument("--steps", type=int, default=5)
    ap.add_argument("--cpu-small", action="store_true")
    args = ap.parse_args(argv)
    failed = False
    if args.cpu_small or not torch.cuda.is_available():
        torch.set_num_threads(1)
        layers, d, tokens = (4, 64, 256) if args.cpu_small else (args.layers, 256, 2048)
        res = offload_exactness(torch.device("cpu"), torch.float32, layers, d, tokens)
        print(f"CPU (no CUDA streams, synchronous copies): {layers} layers d={d} tokens={tokens} fp32")
        for mode, r in res.items():
            print(f"  {mode}: bit-exact={r['exact']}, {r['bytes'] / 2**20:.2f} MiB offloaded/step, "
                  f"pool in use after {r['pool_in_use']}, release errors {r['release_errors']}")
            failed |= not r["exact"]
        t = cpu_step_times(layers, d, tokens, 3)
        print(f"  step time: plain {t['plain'] * 1e3:.1f} ms, layer_input offload {t['offload'] * 1e3:.1f} ms "
              f"({(t['offload'] / t['plain'] - 1) * 100:+.1f}%)")
        return 1 if failed else 0
    dev = torch.device("cuda", torch.cuda.current_device())
    print(f"{torch.cuda.get_device_name(dev)}, torch {torch.__version__}, CUDA {torch.version.cuda}")
    bw = pinned_bandwidth(dev)
    print(f"pinned copy bandwidth (256 MiB): D2H {bw['d2h']:.1f} GB/s, H2D {bw['h2d']:.1f} GB/s")
    res = offload_exactness(dev, torch.bfloat16, 4, 1024, 4096)
    for mode, r in res.items():
        print(f"exact {mode}: {r['exact']} (max grad diff {r['max_grad_diff']:.1e}), pinned={r['pinned']}")
        failed |= not r["exact"]
    print(f"\n{args.layers} layers, d={args.d}, bf16, checkpointed residual MLP, median of {args.steps} steps")
    print("| tokens | offloaded/step (MiB) | T_plain (ms) | T_offload (ms) | overhead | copy time at D2H bw (ms) |"
          " host syncs |")
    print("|---:|---:|---:|---:|---:|---:|---:|")
    for tokens in args.tokens:
        ov = offload_overlap(dev, torch.bfloat16, args.layers, args.d, tokens, steps=args.steps)
        mib = ov["bytes_per_step"] / 2**20
        copy_ms = ov["bytes_per_step"] / (bw["d2h"] * 1e9) * 1e3
        print(f"| {tokens} | {mib:.0f} | {ov['t_base'] * 1e3:.1f} | {ov['t_offload'] * 1e3:.1f} | "
              f"{ov['overhead'] * 100:+.1f}% | {copy_ms:.1f} | {ov['host_syncs']} |", flush=True)
        failed |= ov["host_syncs"] != 0
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
