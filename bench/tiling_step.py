"""Whole training-step time with and without sequence tiling (the issue-5 step-time target).

``bench/tiling_memory.py`` times the MLP block and the loss alone; this script times a full fwd+bwd step of a
small Llama-style model (``--layers`` x [RMSNorm -> QKV -> causal GQA attention -> out-proj, RMSNorm -> SwiGLU
MLP], final norm, output layer + cross entropy) in Megatron's ``[s, b, h]`` layout on CPU, for:

  off        untiled MLP, full logits + F.cross_entropy
  mlp        tiled MLP (policy ``auto``), full logits
  mlp+loss   tiled MLP and chunked output layer + loss (both ``auto``)

Each mode runs ``--reps`` times, modes interleaved; the best time per mode is reported with its overhead vs off.
Peak memory is not measured here (see tiling_memory.py; the tracker's dispatch mode would perturb timings).

    .venv/bin/python bench/tiling_step.py                    # seq 32768, hidden 512, ffn 2048, 2 layers
"""

from __future__ import annotations

import argparse
import os
import sys
import time

import torch
import torch.nn as nn
import torch.nn.functional as F

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from tiling_memory import SwiGLUMLP  # noqa: E402

from nemo_longctx.attention import local_attention  # noqa: E402
from nemo_longctx.memory.tiling import (  # noqa: E402
    DEFAULT_LOSS_CHUNK_TOKENS,
    DEFAULT_MLP_TILE_TOKENS,
    chunked_output_cross_entropy,
    tiled_mlp,
)

MODES = ("off", "mlp", "mlp+loss")


class Layer(nn.Module):
    def __init__(self, hidden: int, ffn: int, heads: int, kv_heads: int):
        super().__init__()
        self.heads, self.kv_heads, self.d = heads, kv_heads, hidden // heads
        self.norm1, self.norm2 = nn.RMSNorm(hidden), nn.RMSNorm(hidden)
        self.qkv = nn.Linear(hidden, (heads + 2 * kv_heads) * self.d, bias=False)
        self.proj = nn.Linear(heads * self.d, hidden, bias=False)
        self.mlp = SwiGLUMLP(hidden, ffn)

    def forward(self, x: torch.Tensor, tile_mlp: bool) -> torch.Tensor:
        s, b, _ = x.shape
        q, k, v = self.qkv(self.norm1(x)).split(
            [self.heads * self.d, self.kv_heads * self.d, self.kv_heads * self.d], dim=-1)
        q = q.view(s, b, self.heads, self.d).transpose(0, 1)
        k = k.view(s, b, self.kv_heads, self.d).transpose(0, 1).contiguous()
        v = v.view(s, b, self.kv_heads, self.d).transpose(0, 1).contiguous()
        attn = local_attention(q, k, v, causal=True).transpose(0, 1).reshape(s, b, -1)
        x = x + self.proj(attn)
        h = self.norm2(x)
        out, _ = (tiled_mlp(self.mlp, h, "auto", tile_tokens=DEFAULT_MLP_TILE_TOKENS) if tile_mlp else self.mlp(h))
        return x + out


class Model(nn.Module):
    def __init__(self, args):
        super().__init__()
        self.layers = nn.ModuleList(Layer(args.hidden, args.ffn, args.heads, args.kv_heads) for _ in range(args.layers))
        self.norm = nn.RMSNorm(args.hidden)
        self.output = nn.Linear(args.hidden, args.vocab, bias=False)

    def loss(self, x: torch.Tensor, labels: torch.Tensor, mode: str) -> torch.Tensor:
        for layer in self.layers:
            x = layer(x, tile_mlp=mode != "off")
        h = self.norm(x)
        if mode == "mlp+loss":
            mask = torch.ones_like(labels, dtype=torch.float32)
            per_token = chunked_output_cross_entropy(h, self.output.weight, labels, "auto", loss_mask=mask,
                                                     chunk_tokens=DEFAULT_LOSS_CHUNK_TOKENS)
            return per_token.sum() / mask.sum()
        logits = self.output(h).transpose(0, 1).float()  # [b, s, V]
        return F.cross_entropy(logits.reshape(-1, logits.shape[-1]), labels.reshape(-1))


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--seq", type=int, default=32768)
    p.add_argument("--layers", type=int, default=2)
    p.add_argument("--hidden", type=int, default=512)
    p.add_argument("--ffn", type=int, default=2048)
    p.add_argument("--heads", type=int, default=8)
    p.add_argument("--kv-heads", type=int, default=2)
    p.add_argument("--vocab", type=int, default=32000)
    p.add_argument("--reps", type=int, default=2)
    p.add_argument("--threads", type=int, default=2)
    args = p.parse_args(argv)
    torch.set_num_threads(args.threads)
    torch.manual_seed(0)
    model = Model(args)
    x = torch.randn(args.seq, 1, args.hidden)
    labels = torch.randint(0, args.vocab, (1, args.seq))
    times = {m: [] for m in MODES}
    losses = {}
    for _ in range(args.reps):
        for mode in MODES:
            model.zero_grad(set_to_none=True)
            t0 = time.perf_counter()
            loss = model.loss(x, labels, mode)
            loss.backward()
            times[mode].append(time.perf_counter() - t0)
            losses[mode] = loss.item()
    base = min(times["off"])
    print(f"training step fwd+bwd: seq {args.seq}, {args.layers} layers, hidden {args.hidden}, ffn {args.ffn} "
          f"(SwiGLU), heads {args.heads}/{args.kv_heads}, vocab {args.vocab}, fp32, {args.threads} threads; "
          f"best of {args.reps}")
    print("| mode | step s | overhead vs off | loss |")
    print("|---|---:|---:|---:|")
    for mode in MODES:
        t = min(times[mode])
        print(f"| {mode} | {t:.2f} | {100 * (t / base - 1):+.1f}% | {losses[mode]:.6f} |")


if __name__ == "__main__":
    main()
