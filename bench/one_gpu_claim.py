"""The one-GPU claim, measured: does the planner's plan for a long sequence on one GPU of a given size really fit?

For each length the planner is asked for its plan on ONE GPU of ``--gpu-gib`` (the train app's accepted options, the
``local_gpu`` coefficients: Megatron's local spec, which is what runs without TransformerEngine). Then a Megatron-core
GPTModel of the model's layer shape with ``--layers`` real layers (embedding and output layer included) is built with
that plan's memory options (full recompute in sequence chunks, layer-input offload at the plan's prefetch depth, MLP
tiles, loss chunks), and the device bytes the plan assigns to the model state of the layers not built (weights,
gradients and optimizer state on the device, less what the real layers hold) are allocated and held. On CUDA the
allocator is capped at ``--gpu-gib`` (``torch.cuda.set_per_process_memory_fraction``), so a GPU with more memory
answers for the smaller one. One forward + backward runs; the row says whether it completed under the cap, the
allocator's peak (everything: held state, real model, step) against the planner's total for the whole model, and the
step's own peak against ``predicted_peak_bytes`` for the built layers.

    python bench/one_gpu_claim.py                                  # CUDA: Llama-3-8B at 1M and at the planner's
                                                                   #   longest length on one 80 GiB GPU, 1 layer
    python bench/one_gpu_claim.py --seqs 1048576 --layers 2        # 2 real layers (about twice the time)
    python bench/one_gpu_claim.py --cpu-small                      # CPU rehearsal: a tiny shape, no cap (the tracker)
    python bench/one_gpu_claim.py --json out.json                  # also the rows as JSON

On the CPU the shape is tiny, the device cap is not enforced (the activation tracker's peak stands in for the
allocator's) and the held state is a host tensor: the rehearsal runs every line of the CUDA form but proves nothing
about a GPU. Exit status: 0 when every measured row completed (fits or not: an OOM under the cap is a result), 1 on
any other failure, 2 on bad arguments.
"""

from __future__ import annotations

import argparse
import gc
import json
from dataclasses import replace
import math
import sys
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(Path(__file__).resolve().parent))

import max_seqlen  # noqa: E402  (build, step, _init_parallel: the same model and step as the max-length search)

from nemo_longctx.planner.model_shapes import KNOWN_SHAPES  # noqa: E402
from nemo_longctx.planner.search import (  # noqa: E402
    GIB,
    LOCAL_CPU,
    LOCAL_GPU,
    Hardware,
    Precision,
    plan,
    predicted_peak_bytes,
)

CPU_SHAPE = replace(max_seqlen.TINY, name="tiny8", num_layers=8)
GRANULARITY = 16384


def search_space(gpu: bool, precision: Precision) -> dict:
    """The plan app's default search (conf/plan.yaml's plan.search) filtered by the train app's own validation."""
    import yaml

    from nemo_longctx.apps.plan import search_space as app_search_space

    search = yaml.safe_load((ROOT / "conf" / "plan.yaml").read_text())["plan"]["search"]
    return app_search_space(search, precision, "gpu" if gpu else "cpu")


def planned(shape, seq: int, hw: Hardware, coef, search: dict, precision: Precision):
    return plan(shape, seq, hw, precision, coef, **search).chosen


def longest(shape, hw: Hardware, coef, search: dict, precision: Precision, start: int, granularity: int,
            max_len: int) -> int:
    """The longest multiple of ``granularity`` up to ``max_len`` with a fitting plan (doubling from ``start``, then
    bisection)."""
    ok, bad, s = 0, None, start
    while bad is None:
        if planned(shape, s, hw, coef, search, precision) is None:
            bad = s
        elif s >= max_len:
            return s
        else:
            ok, s = s, min(s * 2, max_len)
    while bad - ok > granularity:
        mid = (ok + bad) // 2 // granularity * granularity
        if mid <= ok:
            break
        ok, bad = (mid, bad) if planned(shape, mid, hw, coef, search, precision) is not None else (ok, mid)
    return ok


def parameter_bytes(model) -> int:
    return sum(p.numel() * p.element_size() * 2 for p in model.parameters())  # weights + their .grad


def measure(shape_full, layers: int, seq: int, ev, hw: Hardware, device, coef, precision: Precision) -> dict:
    """One step of ``seq`` tokens with plan ``ev`` (see the module docstring); sizes in the row are GiB."""
    c = ev.candidate
    shape = replace(shape_full, num_layers=layers)
    cuda = device.type == "cuda"
    dtype = torch.bfloat16 if cuda else torch.float32
    b = precision.activation_bytes
    row = {"seq": seq, "plan": c.label(), "layers": layers, "gpu_gib": hw.gpu_memory_gb,
           "planner_total_gib": ev.memory.total / GIB,
           "planner_state_gib": (ev.memory.weights + ev.memory.grads + ev.memory.optimizer) / GIB}
    if c.cp_size != 1 or c.tp != 1 or c.recompute not in ("full", "full_keep_attn"):
        raise SystemExit(f"one_gpu_claim: the plan at {seq} ({c.label()}) is not a one-GPU full-recompute plan: "
                         "this script builds only those")
    model, runtime = max_seqlen.build(
        shape, "longctx", device=device, dtype=dtype, max_len=seq, recompute=c.recompute,
        tile_tokens=math.ceil(seq / max(1, c.mlp_tiles)), chunk_tokens=math.ceil(seq / max(1, c.loss_chunks)),
        sequence_chunks=c.sequence_chunks, prefetch_depth=c.prefetch_depth, recompute_layers=c.recompute_layers,
        offload=c.offload)
    state = ev.memory.weights + ev.memory.grads + ev.memory.optimizer
    hold_bytes = max(0, int(state) - parameter_bytes(model))
    row["held_gib"] = hold_bytes / GIB
    held = torch.empty(hold_bytes, dtype=torch.uint8, device=device)
    if cuda:
        torch.cuda.synchronize(device)
        start_bytes = torch.cuda.memory_allocated(device)
    t0 = time.perf_counter()
    try:
        step_peak = max_seqlen.step(model, runtime, seq, device, shape.vocab_size, track=not cuda)
        row["fits"] = True
    except torch.OutOfMemoryError as e:
        row["fits"], row["error"] = False, str(e).splitlines()[0][:200]
        step_peak = None
    row["step_s"] = time.perf_counter() - t0
    predicted = predicted_peak_bytes(shape, seq, c, coef, b)
    row["predicted_step_gib"] = predicted / GIB
    if step_peak is not None:
        row["measured_step_gib"] = step_peak / GIB
        row["measured_over_predicted"] = step_peak / predicted
        total = (start_bytes + step_peak) if cuda else (hold_bytes + parameter_bytes(model) + step_peak)
        row["measured_total_gib"] = total / GIB
    del held, model, runtime
    gc.collect()
    if cuda:
        torch.cuda.empty_cache()
    return row


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="llama3_8b", choices=sorted(KNOWN_SHAPES))
    ap.add_argument("--gpu-gib", type=float, default=80.0, help="the GPU size planned for (and the CUDA cap)")
    ap.add_argument("--seqs", nargs="+", default=["1048576", "max"],
                    help="lengths to check; 'max' = the longest length the planner finds for one GPU")
    ap.add_argument("--layers", type=int, default=1, help="real layers built (the rest is held model state)")
    ap.add_argument("--host-gib", type=float, default=1024.0,
                    help="host memory per node the plan assumes (the plan app's default; only the built layers' "
                         "offload and no optimizer state use this machine's host memory)")
    ap.add_argument("--cpu-small", action="store_true", help="CPU rehearsal: tiny shape, short lengths, no cap")
    ap.add_argument("--json", default=None)
    ap.add_argument("--time-budget-s", type=float, default=None,
                    help="skip a length whose step, estimated from the previous one (quadratic in the length), would "
                         "end past this many seconds from the start (its row says so)")
    a = ap.parse_args(argv)
    t_start = time.monotonic()
    cuda = torch.cuda.is_available() and not a.cpu_small
    if not cuda and not a.cpu_small:
        print("one_gpu_claim: no CUDA device; run with --cpu-small for the CPU rehearsal", file=sys.stderr)
        return 2
    device = torch.device("cuda", torch.cuda.current_device()) if cuda else torch.device("cpu")
    shape = KNOWN_SHAPES[a.model] if cuda else CPU_SHAPE
    host = a.host_gib
    gpu_gib = a.gpu_gib if cuda else 0.05  # the rehearsal plans a tiny model for a tiny "GPU" (50 MiB)
    hw = Hardware(gpus=1, gpu_memory_gb=gpu_gib, host_memory_gb=host,
                  reserve_gb=5.0 if cuda else 0.0, host_reserve_gb=16.0 if cuda else 0.0)
    coef = LOCAL_GPU if cuda else LOCAL_CPU
    # bf16 weights and activations on CUDA (NeMo's bf16-mixed); the CPU rehearsal runs fp32
    precision = Precision() if cuda else Precision(activation_bytes=4, param_bytes=4)
    search = search_space(cuda, precision)
    max_seqlen._init_parallel(device)
    if cuda:
        total = torch.cuda.get_device_properties(device).total_memory
        if gpu_gib * GIB > total:
            print(f"one_gpu_claim: --gpu-gib {gpu_gib:g} is more than this GPU's {total / GIB:.1f} GiB",
                  file=sys.stderr)
            return 2
        torch.cuda.set_per_process_memory_fraction(gpu_gib * GIB / total, device)
    gran = GRANULARITY if cuda else 256
    seqs = []
    for s in a.seqs:
        if s == "max":
            seqs.append(longest(shape, hw, coef, search, precision, 131072 if cuda else 1024, gran,
                                1 << 24 if cuda else 16384))
        else:
            seqs.append(int(s) if cuda else min(int(s), 4096))
    where = (f"{torch.cuda.get_device_name(device)}, capped at {gpu_gib:g} GiB, torch {torch.__version__}" if cuda
             else "CPU rehearsal (tiny shape, tracker peak, no cap)")
    print(f"one-GPU claim: {shape.name} ({shape.num_layers} layers; {a.layers} built, the others' model state held), "
          f"{'bf16' if cuda else 'fp32'}, {where}; planner coefficients {'local_gpu' if cuda else 'local_cpu'}, "
          f"host {host:.0f} GiB")
    print()
    unit, scale = ("GiB", 1.0) if cuda else ("MiB", 1024.0)  # the rehearsal's sizes are MiB
    print(f"| seq | plan | fits | planner total {unit} (whole model) | measured total {unit} | step peak {unit}: "
          "measured / predicted | ratio | step s |")
    print("|---:|---|---|---:|---:|---:|---:|---:|")
    rows, last = [], None
    for seq in seqs:
        if a.time_budget_s is not None and last is not None:
            estimate = last[1] * (seq / last[0]) ** 2
            if time.monotonic() - t_start + estimate > a.time_budget_s:
                print(f"| {seq} | skipped: its step (about {estimate:.0f} s, from the previous row) would end past "
                      f"--time-budget-s {a.time_budget_s:g} | - | - | - | - | - | - |")
                rows.append({"seq": seq, "plan": None, "skipped_s": estimate})
                continue
        ev = planned(shape, seq, hw, coef, search, precision) if seq else None
        if ev is None:
            print(f"| {seq} | no plan fits | - | - | - | - | - | - |")
            rows.append({"seq": seq, "plan": None})
            continue
        r = measure(shape, min(a.layers, shape.num_layers), seq, ev, hw, device, coef, precision)
        rows.append(r)
        last = (seq, r["step_s"])
        meas = f"{r['measured_total_gib'] * scale:.1f}" if "measured_total_gib" in r else "OOM"
        step = (f"{r['measured_step_gib'] * scale:.2f} / {r['predicted_step_gib'] * scale:.2f}"
                if "measured_step_gib" in r else f"- / {r['predicted_step_gib'] * scale:.2f}")
        ratio = f"{r['measured_over_predicted']:.3f}" if "measured_over_predicted" in r else "-"
        print(f"| {seq} | `{r['plan']}` | {'yes' if r['fits'] else 'NO (OOM)'} | "
              f"{r['planner_total_gib'] * scale:.1f} | {meas} | {step} | {ratio} | {r['step_s']:.1f} |", flush=True)
    if a.json:
        Path(a.json).write_text(json.dumps({"where": where, "model": shape.name, "rows": rows}, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
