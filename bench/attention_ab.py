"""Our core attention against Megatron's own, training side by side: the same model, seed, data and optimizer.

Two Megatron-core GPTModels of one Llama shape are built from Megatron's local layer spec: one as it comes
(Megatron's DotProductAttention, which materialises the [heads, s, s] scores: TransformerEngine is not used), one with
nemo_longctx's core attention in every layer (``long_context_layer_spec``, CP size 1). Core attention has no
parameters, so both start from the same weights (checked). Each trains ``--steps`` steps of AdamW on the same batches
(random token ids from a fixed seed); the per-step losses are printed side by side with their relative difference,
and tokens/s and model FLOPs utilisation for each (``nemo_longctx.planner.flops``: 6 x parameters + 6 x layers x
query width x sequence per token, causal attention counted once), against the device's bf16 dense peak when it is
known.

    python bench/attention_ab.py                        # CUDA: a ~1.5B Llama shape, bf16 autocast, seq 2048, 20 steps
    python bench/attention_ab.py --seq 4096 --steps 30
    python bench/attention_ab.py --cpu-small            # CPU rehearsal: a tiny shape in fp32, 6 steps (CI)

Agreement: fp32 (the CPU form) every step within ``--tol`` (default 1e-5 relative); bf16 within 2 % per step and 0.5 %
on the mean of the last five (the two attentions round differently; the curves must not drift apart). Exit 1 when they
do not agree, 2 on bad arguments.
"""

from __future__ import annotations

import argparse
import json
from dataclasses import replace
import statistics
import sys
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(Path(__file__).resolve().parent))

import max_seqlen  # noqa: E402  (_init_parallel: one-rank process group and Megatron's parallel state)

from nemo_longctx.planner.flops import flops_per_token, peak_flops  # noqa: E402
from nemo_longctx.planner.model_shapes import ModelShape, shape_from_config  # noqa: E402

# ~1.5B parameters (untied embeddings): Llama-3.2-1B's layer shape (16 layers, hidden 2048, 32/8 heads, ffn 8192)
# and Llama 3's vocabulary
LLAMA_1B = ModelShape("llama_1b", num_layers=16, hidden_size=2048, ffn_hidden_size=8192, num_attention_heads=32,
                      num_query_groups=8, vocab_size=128256)
TINY = ModelShape("tiny", num_layers=2, hidden_size=64, ffn_hidden_size=128, num_attention_heads=4, num_query_groups=2,
                  vocab_size=256)


def peak_tflops(device) -> float | None:
    """The device's bf16 dense peak (the package's table, ``planner.flops.PEAK_TFLOPS_16BIT``); None on a CPU or an
    unknown GPU."""
    if device.type != "cuda":
        return None
    peak = peak_flops(torch.cuda.get_device_name(device), "bf16-mixed")
    return None if peak is None else peak / 1e12


def build(shape: ModelShape, ours: bool, device, seq: int, seed: int):
    import torch.nn.functional as F
    from megatron.core import tensor_parallel
    from megatron.core.models.gpt import GPTModel
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec
    from megatron.core.transformer.transformer_config import TransformerConfig

    from nemo_longctx.integrations.megatron.spec import long_context_layer_spec

    torch.manual_seed(seed)
    tensor_parallel.model_parallel_cuda_manual_seed(seed)
    cfg = TransformerConfig(
        num_layers=shape.num_layers, hidden_size=shape.hidden_size, ffn_hidden_size=shape.ffn_hidden_size,
        num_attention_heads=shape.num_attention_heads, num_query_groups=shape.num_query_groups,
        kv_channels=shape.head_dim, gated_linear_unit=True, activation_func=F.silu, normalization="RMSNorm",
        add_bias_linear=False, hidden_dropout=0.0, attention_dropout=0.0, init_method_std=0.02,
        use_cpu_initialization=True, masked_softmax_fusion=False, bias_activation_fusion=False,
        persist_layer_norm=False, bias_dropout_fusion=False, apply_rope_fusion=False,
        gradient_accumulation_fusion=False)
    spec = get_gpt_layer_local_spec(normalization="RMSNorm")
    if ours:
        spec = long_context_layer_spec(spec, "ring")
    model = GPTModel(cfg, spec, vocab_size=shape.vocab_size, max_sequence_length=seq, position_embedding_type="rope",
                     rotary_base=500000, share_embeddings_and_output_weights=False)
    return model.to(device)


def summarize_app(run_dir: Path, device) -> int:
    """One line for a `nemo-longctx train` run: steps, first/last loss, median tokens/s, model TFLOP/s, MFU (the
    model's shape from the config Hydra wrote into the run's output_dir)."""
    import yaml

    rows = [json.loads(line) for line in open(run_dir / "metrics.jsonl") if line.strip()]
    if not rows:
        print(f"app: {run_dir / 'metrics.jsonl'} holds no steps", file=sys.stderr)
        return 1
    m = yaml.safe_load((run_dir / ".hydra" / "config.yaml").read_text())["model"]
    shape = shape_from_config(m, name="app")
    tps = statistics.median(r["tokens_per_s"] for r in (rows[1:] or rows))
    tflops = tps * flops_per_token(shape, int(m["seq_length"])) / 1e12
    peak = peak_tflops(device)
    print(f"app: {shape.parameters() / 1e9:.3f}B parameters, seq {m['seq_length']}, {len(rows)} steps, loss "
          f"{rows[0]['loss']:.4f} -> {rows[-1]['loss']:.4f}, {tps:,.0f} tokens/s (median after the first step), "
          f"{tflops:.2f} model TFLOP/s, MFU " + (f"{tflops / peak:.3f}" if peak else "n/a (peak unknown)"))
    return 0


def train(model, batches, device, amp: bool, lr: float):
    opt = torch.optim.AdamW(model.parameters(), lr=lr, betas=(0.9, 0.95), eps=1e-8, weight_decay=0.1)
    losses, times = [], []
    seq = batches[0].shape[1] - 1
    pos = torch.arange(seq, device=device)[None]
    for ids in batches:
        ids = ids.to(device)
        tokens, labels = ids[:, :-1], ids[:, 1:]
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        t0 = time.perf_counter()
        with torch.autocast(device.type, dtype=torch.bfloat16, enabled=amp):
            loss = model(tokens, pos, None, labels=labels).float().mean()
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        opt.zero_grad(set_to_none=True)
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        times.append(time.perf_counter() - t0)
        losses.append(float(loss))
    return losses, times


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--seq", type=int, default=None)
    ap.add_argument("--steps", type=int, default=None)
    ap.add_argument("--layers", type=int, default=None)
    ap.add_argument("--lr", type=float, default=3e-4)
    ap.add_argument("--seed", type=int, default=1234)
    ap.add_argument("--tol", type=float, default=None, help="per-step relative loss difference allowed")
    ap.add_argument("--cpu-small", action="store_true")
    ap.add_argument("--json", default=None)
    ap.add_argument("--summarize-app", metavar="OUTPUT_DIR", default=None,
                    help="instead: tokens/s and MFU of a `nemo-longctx train` run (its output_dir: metrics.jsonl and "
                         "the model config Hydra wrote)")
    a = ap.parse_args(argv)
    cuda = torch.cuda.is_available() and not a.cpu_small
    if a.summarize_app:
        return summarize_app(Path(a.summarize_app), device=torch.device("cuda" if cuda else "cpu"))
    if not cuda and not a.cpu_small:
        print("attention_ab: no CUDA device; run with --cpu-small for the CPU rehearsal", file=sys.stderr)
        return 2
    device = torch.device("cuda", torch.cuda.current_device()) if cuda else torch.device("cpu")
    shape = LLAMA_1B if cuda else TINY
    if a.layers:
        shape = replace(shape, num_layers=a.layers)
    # Megatron's local attention keeps [heads, s, s] fp32 scores per layer for backward: at 8192 that is 8 GiB a
    # layer and the 16-layer model runs out of an H200's 141 GiB, so the CUDA default is a length both sides fit
    seq = a.seq or (2048 if cuda else 256)
    steps = a.steps or (20 if cuda else 6)
    tol = a.tol if a.tol is not None else (2e-2 if cuda else 1e-5)
    max_seqlen._init_parallel(device)
    g = torch.Generator().manual_seed(a.seed)
    batches = [torch.randint(0, shape.vocab_size, (1, seq + 1), generator=g) for _ in range(steps)]
    results, params = {}, None
    for name, ours in (("megatron", False), ("nemo_longctx", True)):
        model = build(shape, ours, device, seq, a.seed)
        state = {k: v.detach().clone().cpu() for k, v in model.state_dict().items() if torch.is_tensor(v)}
        if params is None:
            params, first_state = sum(p.numel() for p in model.parameters()), state
        elif any(not torch.equal(first_state[k], v) for k, v in state.items() if k in first_state):
            print("attention_ab: the two models do not start from the same weights", file=sys.stderr)
            return 1
        try:
            results[name] = train(model, batches, device, cuda, a.lr)
        except torch.OutOfMemoryError as e:
            results[name] = None
            print(f"attention_ab: {name} ran out of device memory at seq {seq}: {str(e).splitlines()[0][:160]}")
        del model
        if cuda:
            torch.cuda.empty_cache()
    where = (f"{torch.cuda.get_device_name(device)}, torch {torch.__version__}, bf16 autocast" if cuda
             else f"CPU, torch {torch.__version__}, fp32")
    print(f"attention A/B: {shape.name} ({params / 1e9:.3f}B parameters, {shape.num_layers} layers, hidden "
          f"{shape.hidden_size}, heads {shape.num_attention_heads}/{shape.num_query_groups}), seq {seq}, {steps} steps "
          f"of AdamW lr {a.lr:g}, one device: {where}")
    if any(r is None for r in results.values()):
        print("attention A/B: not compared (a run did not fit)")
        return 1
    (lm, tm), (lo, to) = results["megatron"], results["nemo_longctx"]
    rel = [abs(x - y) / abs(x) for x, y in zip(lm, lo)]
    print()
    print("| step | loss, Megatron attention | loss, nemo_longctx attention | relative difference |")
    print("|---:|---:|---:|---:|")
    for i, (x, y, r) in enumerate(zip(lm, lo, rel), 1):
        print(f"| {i} | {x:.6f} | {y:.6f} | {r:.2e} |")
    fpt, peak = flops_per_token(shape, seq, parameters=params), peak_tflops(device)
    print()
    print("| attention | tokens/s (median step, after the first) | model TFLOP/s | MFU |")
    print("|---|---:|---:|---:|")
    rows = {}
    for name, times in (("megatron", tm), ("nemo_longctx", to)):
        t = statistics.median(times[1:] if len(times) > 1 else times)
        tps = seq / t
        tflops = tps * fpt / 1e12
        mfu = f"{tflops / peak:.3f}" if peak else "n/a (peak unknown)"
        rows[name] = {"tokens_per_s": tps, "model_tflops": tflops, "mfu": tflops / peak if peak else None}
        print(f"| {name} | {tps:,.0f} | {tflops:.1f} | {mfu} |")
    tail = slice(max(0, steps - 5), steps)
    mean_rel = abs(statistics.mean(lm[tail]) - statistics.mean(lo[tail])) / abs(statistics.mean(lm[tail]))
    ok = max(rel) <= tol and (not cuda or mean_rel <= 5e-3)
    print()
    print(f"agreement: worst step {max(rel):.2e} (bound {tol:g}), last-5 mean {mean_rel:.2e}"
          + (" (bound 5e-3)" if cuda else "") + (": OK" if ok else ": FAILED"))
    if a.json:
        Path(a.json).write_text(json.dumps({"where": where, "shape": shape.name, "params": params, "seq": seq,
                                            "losses": {"megatron": lm, "nemo_longctx": lo}, "speed": rows,
                                            "agree": ok}, indent=1))
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
