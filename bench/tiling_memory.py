"""Peak bytes and step time of the sequence-tiled MLP and the chunked output layer + loss vs the untiled paths.

CPU, fp32, batch 1, a Llama-like SwiGLU MLP (hidden 512, ffn 2048 by default) and a 32K vocab. Each row is one
forward + backward of the block alone; peak bytes come from ``nemo_longctx.memory.tracker.ActivationTracker``
(live bytes allocated inside the region; inputs and the upstream gradient pre-exist and are not counted).
Step time: the best of ``--reps`` timed runs after one run under the tracker (which doubles as warm-up).

    .venv/bin/python bench/tiling_memory.py                 # the docs/benchmarks.md table (8K and 32K)
    .venv/bin/python bench/tiling_memory.py --sweep         # tile/chunk sizes (how the defaults were chosen)

Targets (issue 5): MLP peak <= 1.2 x one tile's untiled fwd+bwd peak + the saved input (+ the full output, the
full input gradient and one extra set of weight gradients, which tiling adds by design); loss peak transient
<= 1/8 of the full fp32 logits at the default chunking; tiling step-time overhead <= 15% at 32K.

The untiled loss at 32K would hold ~3 x 4 GiB of fp32 logits; it runs only when ``--untiled-loss-max`` allows.
The machine these numbers come from is shared: compare rows of one run, not numbers across runs.
"""

from __future__ import annotations

import argparse
import time

import torch
import torch.nn as nn
import torch.nn.functional as F
from torch.utils.checkpoint import checkpoint

from nemo_longctx.memory.tiling import (
    DEFAULT_LOSS_CHUNK_TOKENS,
    DEFAULT_MLP_TILE_TOKENS,
    chunked_output_cross_entropy,
    resolve_tiles,
    tiled_mlp,
)
from nemo_longctx.memory.tracker import ActivationTracker

MIB = 2**20


class SwiGLUMLP(nn.Module):
    """Llama MLP in Megatron's layout: [s, b, h] -> ([s, b, h], None)."""

    def __init__(self, hidden: int, ffn: int):
        super().__init__()
        self.fc1 = nn.Linear(hidden, 2 * ffn, bias=False)
        self.fc2 = nn.Linear(ffn, hidden, bias=False)

    def forward(self, x):
        gate, up = self.fc1(x).chunk(2, dim=-1)
        return self.fc2(F.silu(gate) * up), None


def measure(step, reps: int, params):
    """(peak bytes of one fwd+bwd under the tracker, best wall time of ``reps`` untracked runs)."""
    with ActivationTracker(device="cpu", params=params) as tracker:
        step()
    peak = tracker.stats().peak_bytes
    times = []
    for _ in range(reps):
        t0 = time.perf_counter()
        step()
        times.append(time.perf_counter() - t0)
    return peak, (min(times) if times else None)


def mlp_step(model, x, grad, mode, tile_tokens):
    def step():
        model.zero_grad(set_to_none=True)
        x.grad = None
        if mode == "checkpoint":
            out = checkpoint(lambda t: model(t)[0], x, use_reentrant=False)
        else:
            out, _ = tiled_mlp(model, x, mode, tile_tokens=tile_tokens)
        out.backward(grad)

    return step


def loss_step(hidden, weight, labels, mask, mode, chunk_tokens):
    def step():
        hidden.grad = weight.grad = None
        if mode == "off":
            logits = torch.matmul(hidden, weight.t())  # [s, b, V]
            loss = F.cross_entropy(logits.permute(1, 2, 0), labels, reduction="none") * mask
        else:
            loss = chunked_output_cross_entropy(hidden, weight, labels, mode, loss_mask=mask, chunk_tokens=chunk_tokens)
        (loss.sum() / mask.sum()).backward()

    return step


def mlp_rows(seq, args, model):
    x = torch.randn(seq, 1, args.hidden, requires_grad=True)
    grad = torch.randn_like(x)
    params = list(model.parameters())
    rows = {}
    for mode in ("off", "checkpoint", "auto"):
        rows[mode] = measure(mlp_step(model, x, grad, mode, args.tile_tokens), args.reps, params)
    tiles = resolve_tiles("auto", seq, args.tile_tokens)
    tile = min(seq, -(-seq // tiles))
    xt = x[:tile].detach().requires_grad_()
    one_tile_peak, _ = measure(mlp_step(model, xt, grad[:tile], "off", args.tile_tokens), 0, params)
    act = x.numel() * x.element_size()
    param_bytes = sum(p.numel() * p.element_size() for p in params)
    bound = 1.2 * one_tile_peak + act + 2 * act + param_bytes
    return rows, tiles, one_tile_peak, bound


def loss_rows(seq, args, run_untiled):
    g = torch.Generator().manual_seed(seq)
    hidden = torch.randn(seq, 1, args.hidden, generator=g).requires_grad_()
    weight = (torch.randn(args.vocab, args.hidden, generator=g) / args.hidden**0.5).requires_grad_()
    labels = torch.randint(0, args.vocab, (1, seq), generator=g)
    mask = torch.ones(1, seq)
    rows = {}
    for mode in (("off",) if run_untiled else ()) + ("auto",):
        rows[mode] = measure(loss_step(hidden, weight, labels, mask, mode, args.chunk_tokens), args.reps, [weight])
    chunks = resolve_tiles("auto", seq, args.chunk_tokens)
    grads = (hidden.numel() + weight.numel() + 2 * seq) * 4  # grad_hidden, grad_weight, loss, lse
    return rows, chunks, grads


def sweep(args):
    torch.manual_seed(0)
    seq = args.seqs[0]
    model = SwiGLUMLP(args.hidden, args.ffn)
    x = torch.randn(seq, 1, args.hidden, requires_grad=True)
    grad = torch.randn_like(x)
    print(f"\nMLP tile_tokens sweep (seq {seq}, hidden {args.hidden}, ffn {args.ffn})\n")
    print("| tile_tokens | tiles | peak MiB | fwd+bwd s |\n|---|---|---|---|")
    for tt in (seq, 4096, 2048, 1024, 512):
        peak, t = measure(mlp_step(model, x, grad, "auto", tt), args.reps, list(model.parameters()))
        print(f"| {tt} | {resolve_tiles('auto', seq, tt)} | {peak / MIB:.0f} | {t:.2f} |")
    print(f"\nloss chunk_tokens sweep (seq {seq}, vocab {args.vocab})\n")
    print("| chunk_tokens | chunks | peak MiB | fwd+bwd s |\n|---|---|---|---|")
    for ct in (2048, 1024, 512, 256):
        args.chunk_tokens = ct
        rows, chunks, _ = loss_rows(seq, args, run_untiled=False)
        peak, t = rows["auto"]
        print(f"| {ct} | {chunks} | {peak / MIB:.0f} | {t:.2f} |")


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--seqs", type=int, nargs="+", default=[8192, 32768])
    parser.add_argument("--hidden", type=int, default=512)
    parser.add_argument("--ffn", type=int, default=2048)
    parser.add_argument("--vocab", type=int, default=32000)
    parser.add_argument("--tile-tokens", type=int, default=DEFAULT_MLP_TILE_TOKENS)
    parser.add_argument("--chunk-tokens", type=int, default=DEFAULT_LOSS_CHUNK_TOKENS)
    parser.add_argument("--reps", type=int, default=2)
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--untiled-loss-max", type=int, default=8192, help="largest seq for the untiled loss")
    parser.add_argument("--sweep", action="store_true")
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    if args.sweep:
        sweep(args)
        return
    torch.manual_seed(0)
    model = SwiGLUMLP(args.hidden, args.ffn)
    print(
        f"\nCPU fp32, {args.threads} thread(s), batch 1; MLP hidden {args.hidden} ffn {args.ffn} SwiGLU "
        f"(tile_tokens {args.tile_tokens}); loss vocab {args.vocab} (chunk_tokens {args.chunk_tokens}).\n"
        "Peak = live bytes allocated during one fwd+bwd (tracker). Overhead = step time vs the untiled row.\n"
    )
    print("| block | seq | mode | tiles | peak MiB | step s | overhead | target | met |")
    print("|---|---|---|---|---|---|---|---|---|")
    for seq in args.seqs:
        rows, tiles, one_tile, bound = mlp_rows(seq, args, model)
        base_t = rows["off"][1]
        for mode, (peak, t) in rows.items():
            n = tiles if mode == "auto" else 1
            target, met = "", ""
            if mode == "auto":
                target = f"peak <= {bound / MIB:.0f} MiB (1.2 x one tile {one_tile / MIB:.0f} + x, out, dx, dW)"
                met = "yes" if peak <= bound else "no"
                target += "; time <= 1.15 x off"
                met += " / " + ("yes" if t <= 1.15 * base_t else "no")
            label = {"off": "off", "checkpoint": "off + checkpoint", "auto": "tiled (auto)"}[mode]
            print(
                f"| MLP | {seq} | {label} | {n} | {peak / MIB:.0f} | {t:.2f} | {t / base_t - 1:+.0%} | "
                f"{target} | {met} |"
            )
        untiled = seq <= args.untiled_loss_max
        rows, chunks, grad_bytes = loss_rows(seq, args, untiled)
        full_logits = seq * args.vocab * 4
        base_t = rows["off"][1] if untiled else None
        for mode, (peak, t) in rows.items():
            n = chunks if mode == "auto" else 1
            over = f"{t / base_t - 1:+.0%}" if base_t else "n/a"
            target = met = ""
            if mode == "auto":
                transient = peak - grad_bytes
                target = (
                    f"transient {transient / MIB:.0f} MiB (peak - dW, dh, loss) <= full logits/8 = "
                    f"{full_logits / 8 / MIB:.0f} MiB"
                )
                met = "yes" if transient <= full_logits / 8 else "no"
                if base_t:
                    target += "; time <= 1.15 x off"
                    met += " / " + ("yes" if t <= 1.15 * base_t else "no")
            label = "off (full logits + F.cross_entropy)" if mode == "off" else "chunked (auto)"
            print(f"| loss | {seq} | {label} | {n} | {peak / MIB:.0f} | {t:.2f} | {over} | {target} | {met} |")
        if not untiled:
            print(f"| loss | {seq} | off: not run (full fp32 logits alone {full_logits / MIB:.0f} MiB) | | | | | | |")


if __name__ == "__main__":
    main()
