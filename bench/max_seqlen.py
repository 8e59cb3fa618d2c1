"""Maximum sequence length of a Llama-3-8B-shaped Megatron-core GPTModel on one device: nemo_longctx's memory stack vs
Megatron's defaults, found by real forward + backward steps, with the planner's prediction beside it.

Stacks (one device, no CP/TP, micro batch 1, gradients in buffers allocated before the step, no optimizer step):
  megatron   Megatron-core's local layer spec as it comes (its own DotProductAttention, which materialises the
             [heads, s, s] scores; no recompute; untiled MLP; full-logit cross entropy). TransformerEngine is not
             used (not installed): Megatron with TE's fused attention would reach further than this column.
  longctx    nemo_longctx: our core attention (flash-style, no s^2 term), ``recompute`` (full or full_keep_attn),
             offload=layer_input (each layer's input, and the kept attention output/LSE, to pinned host memory),
             tiled MLP (``--tile-tokens`` per tile) and the chunked loss (``--chunk-tokens`` per chunk).

Search: lengths double from ``--start`` until a step fails, then bisect down to ``--granularity`` tokens. A step
"fits" when it completes: on CUDA, without an out-of-memory error (the real limit of the device); on CPU (the tiny
form, for tests), when the activation tracker's peak of live bytes stays within ``--cap-mib`` (an emulated memory
cap). Planner: the largest length whose ``predicted_peak_bytes`` (the larger of the head's and a layer's
backward, calibrated on CPU against the tracker; ``local_cpu`` coefficients: the same local spec) fits the same \
budget: ``--cap-mib`` on
CPU, on CUDA the free device memory after the weights and gradient buffers are allocated. The planner models only
the longctx stack (Megatron's DotProductAttention is not in its search space).

    python bench/max_seqlen.py                 # CUDA: Llama-3-8B shape, bf16
    python bench/max_seqlen.py --layers 8      # fewer layers (same per-layer shape), faster steps
    python bench/max_seqlen.py --time-budget-s 240   # bounded search (an 8B step at 256K tokens takes minutes)
    python bench/max_seqlen.py --cpu-tiny      # CPU: 2 layers, hidden 64, fp32, 8 MiB cap (seconds)
    python bench/max_seqlen.py --cpu-tiny --recompute full --sequence-chunks 8   # with sequence-chunked layers
    python bench/max_seqlen.py --layers 2 --peak-breakdown 262144   # CUDA: what is live at one step's peak, by site

Every parameter is cast to the activation dtype after the build, as Megatron's Float16Module does in training (the
first H200 measurement, 2026-11-26, did not: the torch norms then kept fp32 weights and promoted their outputs to fp32,
~52 KiB/token more at the peak; bench/results/h200_2026-11-26b/).

Status: the CPU tiny form is tested (tests/test_gpu_bench.py); the CUDA form has not run yet (no GPU in the session
that wrote it): a GPU session runs it (scripts/gpu_check.sh runs it with GPU_CHECK_BENCH=1).
"""

from __future__ import annotations

import argparse
import gc
import math
import os
import sys
import time
from dataclasses import replace
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from nemo_longctx.planner.model_shapes import KNOWN_SHAPES, ModelShape  # noqa: E402
from nemo_longctx.planner.search import (  # noqa: E402
    LOCAL_CPU,
    LOCAL_GPU,
    Candidate,
    Hardware,
    Precision,
    memory_breakdown,
    predicted_peak_bytes,
)

TINY = ModelShape("tiny", num_layers=2, hidden_size=64, ffn_hidden_size=224, num_attention_heads=4,
                  num_query_groups=2, vocab_size=256)


def _init_parallel(device: torch.device) -> None:
    import torch.distributed as dist

    from nemo_longctx.integrations.megatron import cpu_compat

    if device.type == "cpu":
        cpu_compat.apply()
    if not dist.is_initialized():
        os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
        os.environ.setdefault("MASTER_PORT", str(29500 + os.getpid() % 1000))
        dist.init_process_group("nccl" if device.type == "cuda" else "gloo", rank=0, world_size=1)
    from megatron.core import parallel_state as ps
    from megatron.core import tensor_parallel

    if not ps.model_parallel_is_initialized():
        ps.initialize_model_parallel(1, 1)
    tensor_parallel.model_parallel_cuda_manual_seed(1234)


def build(shape: ModelShape, stack: str, *, device, dtype, max_len: int, recompute: str, tile_tokens: int,
          chunk_tokens: int, sequence_chunks: int = 1, prefetch_depth: int = 1, recompute_layers: int = 1,
          offload: str = "layer_input"):
    """(model, memory runtime or None) of ``shape`` for ``stack`` (see the module docstring)."""
    import torch.nn.functional as F
    from megatron.core.models.gpt import GPTModel
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec
    from megatron.core.transformer.transformer_config import TransformerConfig

    cfg = TransformerConfig(
        num_layers=shape.num_layers, hidden_size=shape.hidden_size, ffn_hidden_size=shape.ffn_hidden_size,
        num_attention_heads=shape.num_attention_heads, num_query_groups=shape.num_query_groups,
        kv_channels=shape.head_dim, gated_linear_unit=shape.gated_mlp, activation_func=F.silu,
        normalization="RMSNorm", add_bias_linear=False, hidden_dropout=0.0, attention_dropout=0.0,
        params_dtype=dtype, bf16=dtype == torch.bfloat16, use_cpu_initialization=device.type == "cpu",
        masked_softmax_fusion=False, bias_activation_fusion=False, persist_layer_norm=False,
        bias_dropout_fusion=False, apply_rope_fusion=False, gradient_accumulation_fusion=False)
    spec = get_gpt_layer_local_spec(normalization="RMSNorm")
    runtime = None
    if stack == "longctx":
        from nemo_longctx.integrations.megatron.memory_options import (
            MemoryOptions, apply_recompute_fields, attach_memory_options)
        from nemo_longctx.integrations.megatron.spec import long_context_layer_spec
        from nemo_longctx.integrations.megatron.tiled_mlp_layer import tiled_mlp_layer_spec

        opts = MemoryOptions(recompute=recompute, offload=offload, min_bytes=0, prefetch_depth=prefetch_depth,
                             recompute_num_layers=recompute_layers,
                             sequence_chunks=sequence_chunks if sequence_chunks > 1 else "off")
        apply_recompute_fields(cfg, opts)
        spec = long_context_layer_spec(spec, "ring")
        if sequence_chunks == 1:  # a chunked layer's MLP is chunk-sized: no tiling next to it
            spec = tiled_mlp_layer_spec(spec, "auto", tile_tokens=tile_tokens)
    if stack == "longctx":  # the chunked loss is built in (its policy set below)
        from nemo_longctx.integrations.megatron.gpt_chunked_loss import ChunkedLossGPTModel as GPTModel
    model = GPTModel(cfg, spec, vocab_size=shape.vocab_size, max_sequence_length=max_len,
                     position_embedding_type="rope", share_embeddings_and_output_weights=False).to(device)
    model = model.to(dtype)  # as Megatron's Float16Module does: every parameter (the norms' too) in bf16
    if stack == "longctx":
        from nemo_longctx.integrations.megatron.gpt_chunked_loss import use_chunked_loss

        use_chunked_loss(model, "auto", chunk_tokens)
        runtime = attach_memory_options(model, opts)
    for p in model.parameters():  # gradient buffers exist before the step (as Megatron DDP's main_grad buffers)
        p.grad = torch.zeros_like(p)
    model.train()
    return model, runtime


def step(model, runtime, seq: int, device, vocab: int, track: bool):
    """One forward + backward of ``seq`` tokens; returns the peak of live bytes during it (tracker on CPU, the CUDA
    allocator's peak on CUDA)."""
    from nemo_longctx.integrations.megatron.gpt_chunked_loss import loss_mask_scope
    from nemo_longctx.memory.tracker import ActivationTracker

    g = torch.Generator().manual_seed(seq)
    ids = torch.randint(0, vocab, (1, seq + 1), generator=g).to(device)
    tokens, labels = ids[:, :-1], ids[:, 1:]
    mask = torch.ones(1, seq, device=device)
    pos = torch.arange(seq, device=device)[None]
    gc.collect()
    tracker = ActivationTracker(device.type, params=model.parameters(), count_peak=track) if track else None
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(device)
        base = torch.cuda.memory_allocated(device)
    if tracker is not None:
        tracker.__enter__()
    try:
        with loss_mask_scope(mask):
            token_loss = model(tokens, pos, None, labels=labels)
        (token_loss.float() * mask).sum().backward()
        del token_loss
    finally:
        if tracker is not None:
            tracker.__exit__(None, None, None)
    if runtime is not None:
        runtime.after_step()
    if device.type == "cuda":
        torch.cuda.synchronize(device)
        return torch.cuda.max_memory_allocated(device) - base
    return tracker.stats().peak_bytes


def search(fits, start: int, granularity: int, max_len: int, deadline: float = float("inf")):
    """Largest length (multiple of ``granularity``) for which ``fits`` is true: doubling, then bisection, until
    ``deadline`` (time.monotonic()). Returns (length or 0, [(length, fits, peak_or_reason)], bracket upper bound or
    None when the search finished)."""
    log, ok, bad = [], 0, None
    s = start
    while s <= max_len:
        if time.monotonic() > deadline:
            return ok, log, s
        good, info = fits(s)
        log.append((s, good, info))
        if not good:
            bad = s
            break
        ok, s = s, s * 2
    if bad is not None and ok:
        while bad - ok > granularity:
            mid = (ok + bad) // 2 // granularity * granularity
            if mid <= ok:
                break
            if time.monotonic() > deadline:
                return ok, log, bad
            good, info = fits(mid)
            log.append((mid, good, info))
            ok, bad = (mid, bad) if good else (ok, mid)
    return ok, log, None


def planner_max(shape, cand_for, budget: float, granularity: int, max_len: int, activation_bytes: int,
                host_budget: float = float("inf"), coef=LOCAL_CPU) -> int:
    """Largest multiple of ``granularity`` <= max_len whose predicted peak fits ``budget`` and whose offloaded bytes
    fit ``host_budget`` (both are monotonic in the length)."""
    def fits(s):
        c = cand_for(s)
        if predicted_peak_bytes(shape, s, c, coef, activation_bytes) > budget:
            return False
        host = memory_breakdown(shape, s, Hardware(gpus=1), c, Precision(activation_bytes=activation_bytes),
                                coef).host_offload
        return host <= host_budget

    lo, hi = 0, max_len // granularity
    while lo < hi:
        mid = (lo + hi + 1) // 2
        lo, hi = (mid, hi) if fits(mid * granularity) else (lo, mid - 1)
    return lo * granularity


def live_at_peak(events, base: int = 0, top: int = 20):
    """Replay a CUDA allocator trace (``torch.cuda.memory._snapshot()["device_traces"][i]``: dicts with ``action``,
    ``addr``, ``size``, ``frames``) and return (peak bytes above ``base``, index of the event that reached it, rows)
    where rows are the allocations live at that moment grouped by allocation site: (bytes, count, site), largest
    first, at most ``top``. A block counts from ``alloc`` until ``free_completed`` (the allocator's own accounting).
    Site = the innermost frame in nemo_longctx or megatron code (else the innermost frame)."""
    def site(frames):
        frames = frames or []
        for f in frames:
            if "nemo_longctx" in f.get("filename", "") or "megatron" in f.get("filename", ""):
                return f"{Path(f['filename']).name}:{f['line']} {f['name']}"
        return f"{Path(frames[0]['filename']).name}:{frames[0]['line']} {frames[0]['name']}" if frames else "?"

    live, total, peak, peak_i = {}, base, base, -1
    for i, e in enumerate(events):
        if e["action"] == "alloc":
            live[e["addr"]] = i
            total += e["size"]
        elif e["action"] == "free_completed" and e["addr"] in live:
            del live[e["addr"]]
            total -= e["size"]
        if total > peak:
            peak, peak_i = total, i
    live = {}
    for e in events[:peak_i + 1]:  # the live set at the peak, by replaying again up to it
        if e["action"] == "alloc":
            live[e["addr"]] = e
        elif e["action"] == "free_completed":
            live.pop(e["addr"], None)
    groups = {}
    for e in live.values():
        key = site(e.get("frames"))
        b, n = groups.get(key, (0, 0))
        groups[key] = (b + e["size"], n + 1)
    rows = sorted(((b, n, k) for k, (b, n) in groups.items()), reverse=True)[:top]
    return peak - base, peak_i, rows


def peak_breakdown(model, runtime, seq: int, device, vocab: int) -> None:
    """CUDA: one step of ``seq`` tokens with the allocator's history recorded; prints what is live at the peak,
    grouped by allocation site, and the site whose allocation reached it (the phase)."""
    torch.cuda.memory._record_memory_history(enabled="all", context="alloc", stacks="python", max_entries=2_000_000)
    try:
        peak = step(model, runtime, seq, device, vocab, track=False)
        snap = torch.cuda.memory._snapshot()
    finally:
        torch.cuda.memory._record_memory_history(enabled=None)
    events = snap["device_traces"][device.index or 0]
    gained, peak_i, rows = live_at_peak(events)
    at = events[peak_i] if peak_i >= 0 else {}
    frames = at.get("frames") or []
    print(f"peak breakdown at seq {seq}: allocator peak {peak / 2**20:.1f} MiB above the step's start "
          f"({peak / seq / 1024:.1f} KiB/token); trace replay {gained / 2**20:.1f} MiB over {len(events)} events")
    print("allocation that reached the peak: " + " <- ".join(
        f"{Path(f['filename']).name}:{f['line']} {f['name']}" for f in frames[:8]))
    print()
    print("| live at the peak, by site | MiB | bytes/token | blocks |")
    print("|---|---:|---:|---:|")
    for b, n, k in rows:
        print(f"| {k} | {b / 2**20:.1f} | {b / seq:.1f} | {n} |")
    print()


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--cpu-tiny", action="store_true", help="tiny model on CPU, memory cap emulated (for tests)")
    ap.add_argument("--layers", type=int, default=None, help="layers (default: the shape's)")
    ap.add_argument("--recompute", choices=("full", "full_keep_attn"), default="full_keep_attn")
    ap.add_argument("--stacks", nargs="+", choices=("megatron", "longctx"), default=["megatron", "longctx"])
    ap.add_argument("--start", type=int, default=None)
    ap.add_argument("--granularity", type=int, default=None)
    ap.add_argument("--max-len", type=int, default=None)
    ap.add_argument("--cap-mib", type=float, default=8.0, help="CPU: emulated activation memory cap")
    ap.add_argument("--tile-tokens", type=int, default=None)
    ap.add_argument("--sequence-chunks", type=int, default=1,
                    help="longctx: recompute.sequence_chunks=N (needs --recompute full; replaces the tiled MLP)")
    ap.add_argument("--chunk-tokens", type=int, default=None)
    ap.add_argument("--time-budget-s", type=float, default=None,
                    help="per stack: stop the search after this many seconds and report the bracket")
    ap.add_argument("--inject-oom-above", type=int, default=None,
                    help="test hook: the last layer's forward raises torch.OutOfMemoryError for lengths above this "
                         "(exercises the failure path mid-step, with offload/kept state left behind, on CPU)")
    ap.add_argument("--host-gib", type=float, default=None,
                    help="host memory for offload in the planner's prediction (default: 90%% of MemAvailable on "
                         "CUDA, unlimited on CPU)")
    ap.add_argument("--peak-breakdown", type=int, default=None, metavar="SEQ",
                    help="CUDA: instead of the search, one longctx step of SEQ tokens with the allocator's history "
                         "recorded; prints what is live at the peak by allocation site, and the planner's breakdown")
    a = ap.parse_args(argv)

    cuda = torch.cuda.is_available() and not a.cpu_tiny
    if not cuda and not a.cpu_tiny:
        print("max_seqlen: no CUDA device; run with --cpu-tiny for the CPU form", file=sys.stderr)
        return 2
    device = torch.device("cuda", torch.cuda.current_device()) if cuda else torch.device("cpu")
    shape = KNOWN_SHAPES["llama3_8b"] if cuda else TINY
    if a.layers:
        shape = replace(shape, num_layers=a.layers)
    dtype = torch.bfloat16 if cuda else torch.float32
    b = 2 if cuda else 4
    start = a.start or (4096 if cuda else 128)
    gran = a.granularity or (4096 if cuda else 64)
    max_len = a.max_len or (1 << 22 if cuda else 1 << 14)
    tile_tokens = a.tile_tokens or (16384 if cuda else 256)
    chunk_tokens = a.chunk_tokens or (8192 if cuda else 256)
    _init_parallel(device)
    host_budget = float("inf")
    if a.host_gib is not None:
        host_budget = a.host_gib * 2**30
    elif cuda:
        with open("/proc/meminfo") as f:
            avail = next(int(line.split()[1]) for line in f if line.startswith("MemAvailable:"))
        host_budget = 0.9 * avail * 1024

    if a.sequence_chunks > 1 and a.recompute != "full":
        print("max_seqlen: --sequence-chunks needs --recompute full", file=sys.stderr)
        return 2

    def cand_for(s):
        tiles = 1 if a.sequence_chunks > 1 else math.ceil(s / tile_tokens)
        return Candidate("none", 1, 1, 1, a.recompute, "layer_input", tiles, math.ceil(s / chunk_tokens),
                         sequence_chunks=a.sequence_chunks)

    if a.peak_breakdown:
        if not cuda:
            print("max_seqlen: --peak-breakdown needs CUDA (the allocator's history)", file=sys.stderr)
            return 2
        model, runtime = build(shape, "longctx", device=device, dtype=dtype, max_len=max_len, recompute=a.recompute,
                               tile_tokens=tile_tokens, chunk_tokens=chunk_tokens, sequence_chunks=a.sequence_chunks)
        step(model, runtime, min(a.peak_breakdown, 8192), device, shape.vocab_size, track=False)  # warm-up
        peak_breakdown(model, runtime, a.peak_breakdown, device, shape.vocab_size)
        s, c = a.peak_breakdown, cand_for(a.peak_breakdown)
        br = memory_breakdown(shape, s, Hardware(gpus=1), c, Precision(activation_bytes=b), LOCAL_GPU)
        print(f"planner (local_gpu coefficients) at seq {s}: peak phase {br.peak_phase}, GiB "
              + ", ".join(f"{k} {v:.2f}" for k, v in br.gib().items()))
        print(f"planner predicted_peak_bytes {predicted_peak_bytes(shape, s, c, LOCAL_GPU, b) / 2**20:.1f} MiB")
        return 0

    rows = []
    budget = None
    for stack in a.stacks:
        t0 = time.perf_counter()
        # the only reference: [model, rt]
        held = list(build(shape, stack, device=device, dtype=dtype, max_len=max_len, recompute=a.recompute,
                          tile_tokens=tile_tokens, chunk_tokens=chunk_tokens, sequence_chunks=a.sequence_chunks))
        if cuda:
            free, total = torch.cuda.mem_get_info(device)
            budget = float(free)
        else:
            budget = a.cap_mib * 2**20

        def fits(s, _held=held, _stack=stack):
            reason = None
            hook = None
            if a.inject_oom_above is not None and s > a.inject_oom_above:
                from nemo_longctx.integrations.megatron.memory_options import transformer_blocks

                def _raise(*_):
                    raise torch.OutOfMemoryError(f"out of memory (injected at seq {s})")

                hook = transformer_blocks(_held[0])[0].layers[-1].register_forward_pre_hook(_raise)
            try:
                peak = step(_held[0], _held[1], s, device, shape.vocab_size, track=not cuda)
            except RuntimeError as e:  # device OOM (torch.OutOfMemoryError) or a failed pinned host allocation
                if "out of memory" not in str(e).lower():
                    raise
                reason = "OOM" if isinstance(e, torch.OutOfMemoryError) else "host OOM"
            finally:
                if hook is not None:
                    hook.remove()
            if reason is None:
                return (cuda or peak <= budget), peak
            # outside the except block (its traceback holds the step's tensors): drop the model, whose offload and
            # kept-attention state the failed step left behind, and build a fresh one
            _held[0] = _held[1] = None
            gc.collect()
            if cuda:
                torch.cuda.empty_cache()
            _held[:] = build(shape, _stack, device=device, dtype=dtype, max_len=max_len, recompute=a.recompute,
                             tile_tokens=tile_tokens, chunk_tokens=chunk_tokens, sequence_chunks=a.sequence_chunks)
            return False, reason

        deadline = time.monotonic() + a.time_budget_s if a.time_budget_s else float("inf")
        best, log, stopped_below = search(fits, start, gran, max_len, deadline)
        predicted = (planner_max(shape, cand_for, budget, gran, max_len, b, host_budget,
                                 LOCAL_GPU if cuda else LOCAL_CPU) if stack == "longctx" else None)
        rows.append((stack, best, predicted, log, time.perf_counter() - t0, stopped_below))
        held.clear()
        del fits
        gc.collect()
        if cuda:
            torch.cuda.empty_cache()

    where = (f"{torch.cuda.get_device_name(device)}, torch {torch.__version__}" if cuda
             else f"CPU, emulated cap {a.cap_mib:g} MiB of activation peak (tracker)")
    print(f"max sequence length: {shape.name} shape ({shape.num_layers} layers, hidden {shape.hidden_size}, "
          f"heads {shape.num_attention_heads}/{shape.num_query_groups}, vocab {shape.vocab_size}), "
          f"{'bf16' if cuda else 'fp32'}, one device: {where}; granularity {gran}")
    mlp = (f"recompute.sequence_chunks={a.sequence_chunks}" if a.sequence_chunks > 1
           else f"tiling.mlp_tiles=auto({tile_tokens})")
    print(f"longctx = recompute={a.recompute} offload=layer_input {mlp} "
          f"tiling.loss_chunks=auto({chunk_tokens}), nemo_longctx core attention")
    print()
    print("| stack | measured max seq | planner max seq | planner / measured | steps | search s |")
    print("|---|---:|---:|---:|---:|---:|")
    for stack, best, predicted, log, secs, stopped_below in rows:
        ratio = f"{predicted / best:.2f}" if predicted and best and stopped_below is None else "n/a"
        pred = f"{predicted}" if predicted is not None else "n/a (not modelled)"
        measured = f"{best}" if stopped_below is None else f"{best} (time budget: < {stopped_below} not tried)"
        print(f"| {stack} | {measured} | {pred} | {ratio} | {len(log)} | {secs:.1f} |")
    print()
    for stack, _, _, log, _, _ in rows:
        trail = ", ".join(f"{s}:{'ok' if ok else 'no'}({info if isinstance(info, str) else f'{info / 2**20:.2f}MiB'})"
                          for s, ok, info in log)
        print(f"{stack} steps: {trail}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
