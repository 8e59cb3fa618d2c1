"""Activation memory and step time of every recompute x offload option on the app's tiny Llama (CPU, fp32).

Model: conf/model/tiny_llama (2 layers, hidden 256, ffn 512, 8 query / 2 KV heads, vocab 1024, no biases), as a
Megatron GPTModel with nemo_longctx core attention, at seq 8192 with CP=2 ring attention over 2 gloo ranks
(1 thread each; ``--cp 1`` for one process). One step = forward + backward of one sequence.

Columns (rank 0): device-resident saved-for-backward bytes per token per layer (the layers' tracker scopes at the
step's peak of saved bytes, / local tokens / layers), the same moved to host memory by offload, all saved bytes on
the device (including embedding, output layer and loss), and the step time (best of ``--reps`` untracked steps,
the options interleaved round by round) as a ratio to recompute=none offload=none.

Targets (issue 4): full + layer_input device-resident saved bytes <= 2% of none; full_keep_attn faster than full
with the ring on, and its memory between selective and full.
Selective recompute of layernorm runs nemo_longctx's norm recompute (integrations/megatron/norm_recompute_layer.py), \
which
works under the tracker's saved-tensor hooks.
The machine is shared and noisy: compare rows of one run only.

    .venv/bin/python bench/memory_table.py [--seq 8192] [--cp 2] [--reps 5] [--only full_keep_attn ...]
"""

from __future__ import annotations

import argparse
import os
import sys

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "tests"))
from distributed import run_distributed  # noqa: E402  (tests/distributed.py: spawn gloo ranks)

ROWS = [
    ("none", "none", {}),
    ("none", "modules[mlp]", dict(offload="modules", offload_modules=("mlp",))),
    ("none", "modules[self_attention,mlp]", dict(offload="modules", offload_modules=("self_attention", "mlp"))),
    ("selective[core_attn]", "none", dict(recompute="selective", recompute_modules=("core_attn",))),
    ("selective[mlp]", "none", dict(recompute="selective", recompute_modules=("mlp",))),
    ("selective[core_attn,mlp]", "none", dict(recompute="selective", recompute_modules=("core_attn", "mlp"))),
    ("selective[layernorm]", "none", dict(recompute="selective", recompute_modules=("layernorm",))),
    ("selective[mlp,layernorm]", "none", dict(recompute="selective", recompute_modules=("mlp", "layernorm"))),
    ("selective[core_attn]", "modules[mlp]", dict(recompute="selective", recompute_modules=("core_attn",),
                                                  offload="modules", offload_modules=("mlp",))),
    ("full", "none", dict(recompute="full")),
    ("full", "layer_input", dict(recompute="full", offload="layer_input")),
    ("full_keep_attn", "none", dict(recompute="full_keep_attn")),
    ("full_keep_attn", "layer_input", dict(recompute="full_keep_attn", offload="layer_input")),
]


def _worker(rank: int, world: int, seq: int, cp: int, reps: int, rows=None):

    from nemo_longctx.integrations.megatron import cpu_compat

    cpu_compat.apply()
    from megatron.core import parallel_state as ps
    from megatron.core import tensor_parallel

    from nemo_longctx.integrations.megatron.memory_options import MemoryOptions
    from nemo_longctx.integrations.megatron.memory_probe import (
        build_probe_model, full_batches, layer_device_bytes, layer_host_bytes, run_probe_steps, tiny_gpt_config)

    ps.initialize_model_parallel(context_parallel_size=cp)
    tensor_parallel.model_parallel_cuda_manual_seed(1)
    cfg = tiny_gpt_config(num_layers=2, hidden_size=256, heads=8, groups=2, ffn_hidden_size=512, cp=cp)
    vocab = 1024
    batch = full_batches(1, seq, vocab, seed=3)
    init, _ = build_probe_model(cfg, MemoryOptions(), vocab_size=vocab, seq_length=seq)
    models = {}
    mem = {}
    for rec, off, kw in rows or ROWS:
        model, rt = build_probe_model(cfg, MemoryOptions(**kw), vocab_size=vocab, seq_length=seq, params_from=init)
        r = run_probe_steps(model, rt, batch, keep_grads=False)  # tracked step (also the warm-up)
        s = r.stats[0]
        mem[(rec, off)] = (layer_device_bytes(s), layer_host_bytes(s), s.activation_bytes_device, r.losses[0])
        models[(rec, off)] = (model, rt)
    times = {k: [] for k in models}
    for _ in range(reps):  # interleaved: each round times every option once
        for k, (model, rt) in models.items():
            times[k] += run_probe_steps(model, rt, batch, keep_grads=False, track=False).step_times
    ps.destroy_model_parallel()
    return {"mem": mem, "times": {k: min(v) for k, v in times.items()}, "local_tokens": seq // cp,
            "layers": cfg.num_layers}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--seq", type=int, default=8192)
    ap.add_argument("--cp", type=int, default=2)
    ap.add_argument("--reps", type=int, default=5)
    ap.add_argument("--only", nargs="*", default=None,
                    help="rows whose 'recompute offload' label contains one of these strings (none,none always)")
    a = ap.parse_args()
    rows = ROWS if not a.only else [ROWS[0]] + [r for r in ROWS[1:] if any(o in f"{r[0]} {r[1]}" for o in a.only)]
    res = run_distributed(_worker, a.cp, a.seq, a.cp, a.reps, rows, timeout=3000)[0]
    per = res["local_tokens"] * res["layers"]
    base_dev = res["mem"][("none", "none")][0]
    base_t = res["times"][("none", "none")]
    print(f"tiny Llama (2 layers, hidden 256), seq {a.seq}, CP={a.cp} ring, fp32, CPU (rank 0, "
          f"{res['local_tokens']} local tokens); step time: best of {a.reps} (interleaved rounds)")
    print()
    print("| recompute | offload | device saved B/token/layer | % of none | host B/token/layer | "
          "all device saved MiB | step s | step / none | loss |")
    print("|---|---|---:|---:|---:|---:|---:|---:|---:|")
    for rec, off, _ in rows:
        dev, host, total, loss = res["mem"][(rec, off)]
        t = res["times"][(rec, off)]
        print(f"| {rec} | {off} | {dev / per:.0f} | {100 * dev / base_dev:.1f}% | {host / per:.0f} | "
              f"{total / 2**20:.1f} | {t:.2f} | {t / base_t:.2f} | {loss:.6f} |")


if __name__ == "__main__":
    main()
