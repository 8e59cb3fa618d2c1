"""Memory frontier: the planner's longest trainable sequence, with options the train app accepts, next to ALST's and
UPipe's measured numbers.

    python bench/frontier.py                 # the table (markdown) + what limits the 1-GPU Llama-3-8B plan
    python bench/frontier.py --json out.json
    python bench/frontier.py --checkpoints   # only layouts that can save checkpoints (plan.checkpoints=true)

For each setting the planner (nemo_longctx.planner.search with the plan app's search space from conf/plan.yaml and
its `app_accepts` filter: the train app's own option checks, GPU target = the NGC image with CUDA and
TransformerEngine) is asked for increasing sequence lengths; the frontier is the longest multiple of 16K tokens with a
fitting plan (binary search; the planner's memory is monotonic in the sequence length). Host memory: 1024 GiB per
node (plan.host_memory_gb). The frontier is that of every layout the train app accepts (plan.checkpoints=false:
Megatron-FSDP included, which cannot save checkpoints in this version); --checkpoints: of the layouts that can save
(plan.checkpoints=true, the plan app's default).

What is measured and what is modelled (nothing here has run on a GPU):
  * every number in the "planner" columns is modelled: weights / grads / optimizer states from Megatron's allocation
    rules (planner.model_state_bytes), activations with the `te_gpu` coefficients (counted from Megatron's TE layer
    code), transients, CP buffers and a fixed reserve (5 GiB per GPU);
  * on CPU the saved-activation terms are calibrated against the tracker on Megatron's local spec (issue 13 part B,
    tests/test_planner_calibration.py) and every model-state option runnable on CPU trained with DDP's losses
    (tests/test_model_state.py), with the bytes Megatron holds equal to planner.model_state_bytes
    (tests/test_planner_model_state_bytes.py: DDP, distributed optimizer, optimizer offload); Megatron-FSDP and the
    precision-aware optimizer have not run at all (CUDA only);
  * ALST (Arctic Long Sequence Training) and UPipe columns are their papers' measured maxima as cited in issue 13
    (H100 80 GB; different stacks: DeepSpeed ZeRO-3 + CPU offload / FSDP).
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from nemo_longctx.apps.plan import conf_dir, inputs_from_config  # noqa: E402
from nemo_longctx.shared.run_spec import read_plan_spec  # noqa: E402
from nemo_longctx.planner.search import plan  # noqa: E402

STEP = 16384
SETTINGS = [  # (label, model group, gpu preset, gpus[, host GiB per node when not plan.host_memory_gb's 1024])
    ("Llama-3.1-8B", "llama3_8b", "h100", 1),
    ("Llama-3.1-8B", "llama3_8b", "h200", 1),
    ("Llama-3.1-8B", "llama3_8b", "h100", 8),
    ("Llama-3.1-8B", "llama3_8b", "h100", 8, 1862),  # a DGX H100 has 2 TB (1862 GiB) of host memory
    ("Llama-3.1-8B", "llama3_8b", "h100", 32),
    ("Qwen3-32B", "qwen3_32b", "h100", 8),
    ("Qwen3-32B", "qwen3_32b", "h100", 32),
    ("Llama-3-70B", "llama3_70b", "h100", 8),
    ("Llama-3-70B", "llama3_70b", "h100", 32),
]
ALST = {("llama3_8b", "h100", 1): 500_000, ("llama3_8b", "h100", 8): 3_700_000, ("llama3_8b", "h100", 32): 15_000_000,
        ("qwen3_32b", "h100", 8): 230_000, ("qwen3_32b", "h100", 32): 1_550_000,
        ("llama3_70b", "h100", 8): 200_000, ("llama3_70b", "h100", 32): 1_200_000}
UPIPE = {("llama3_8b", "h100", 8): 5_000_000}
TARGETS = {("llama3_8b", "h100", 1): 1_000_000, ("llama3_8b", "h100", 8): 5_000_000,
           ("llama3_70b", "h100", 32): 4_000_000}


def _inputs(model: str, gpu: str, gpus: int, host_gb: int | None = None, checkpoints: bool = False):
    from hydra import compose, initialize_config_dir

    extra = [f"plan.host_memory_gb={host_gb}"] if host_gb else []
    extra.append(f"plan.checkpoints={str(checkpoints).lower()}")
    with initialize_config_dir(config_dir=conf_dir(), version_base=None):
        cfg = compose("plan", overrides=[f"model={model}", f"plan={gpu}", f"plan.gpus={gpus}", *extra])
    return inputs_from_config(read_plan_spec(cfg)), float(cfg.plan.cost_tolerance)


def frontier(model: str, gpu: str, gpus: int, hi: int = 1 << 27, host_gb: int | None = None,
             checkpoints: bool = False):
    """(longest fitting seq multiple of STEP, its Plan); (0, None) when not even STEP fits. ``checkpoints``: only
    layouts that can save checkpoints (plan.checkpoints)."""
    (shape, _, hw, precision, coef, cost, search), tol = _inputs(model, gpu, gpus, host_gb, checkpoints)

    def fits(seq):
        p = plan(shape, seq, hw, precision, coef, cost, tol, **search)
        return p if p.chosen is not None else None

    lo_k, hi_k, best = 0, hi // STEP, None
    while lo_k < hi_k:  # largest k with fits(k * STEP)
        mid = (lo_k + hi_k + 1) // 2
        p = fits(mid * STEP)
        if p is not None:
            lo_k, best = mid, p
        else:
            hi_k = mid - 1
    return lo_k * STEP, best, (shape, hw, precision, coef, cost, search, tol)


def _fmt(n):
    if not n:
        return "-"
    return f"{n / 1e6:.2f}M" if n >= 1e6 else f"{n / 1e3:.0f}K"


def limits_at(seq: int, ctx) -> dict:
    """The smallest-memory candidate at `seq` that fits (device and host), else the smallest-memory one (the
    planner's best miss): its breakdown, largest terms first."""
    shape, hw, precision, coef, cost, search, tol = ctx
    p = plan(shape, seq, hw, precision, coef, cost, tol, **search)
    fitting = [e for e in p.evaluations if e.fits]
    best = min(fitting or p.evaluations, key=lambda e: e.memory.total)
    m = best.memory.gib()
    terms = {k: round(m[k], 1) for k in ("weights", "grads", "optimizer", "activations", "transient", "comm",
                                          "reserve")}
    return {"seq_length": seq, "candidate": best.candidate.label(), "total_gib": round(m["total"], 1),
            "fits": best.fits, "fits_gpu": best.fits_gpu, "fits_host": best.fits_host,
            "host_gib_per_node": round(m["host_per_node"]), "peak_phase": best.memory.peak_phase,
            "terms_gib": dict(sorted(terms.items(), key=lambda kv: -kv[1]))}


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--json", help="write the rows as JSON here")
    ap.add_argument("--checkpoints", action="store_true",
                    help="only layouts that can save checkpoints (plan.checkpoints=true: no Megatron-FSDP)")
    args = ap.parse_args(argv)
    rows, t0 = [], time.time()
    ctxs = {}
    for label, model, gpu, gpus, *host in SETTINGS:
        host_gb = host[0] if host else None
        seq, p, ctx = frontier(model, gpu, gpus, host_gb=host_gb, checkpoints=args.checkpoints)
        if host_gb is None:
            ctxs[(model, gpu, gpus)] = ctx
        ev = p.chosen if p else None
        m = ev.memory.gib() if ev else {}
        key = (model, gpu, gpus)
        rows.append({"model": label, "gpu": gpu.upper() + (f", {host_gb} GiB host" if host_gb else ""), "gpus": gpus,
                     "planner_max_seq": seq,
                     "chosen": ev.candidate.label() if ev else None,
                     "gib_per_gpu": round(m.get("total", 0.0), 1),
                     "host_gib_per_node": round(m.get("host_per_node", 0.0)),
                     "model_states_gib": round(m.get("weights", 0) + m.get("grads", 0) + m.get("optimizer", 0), 1),
                     "activations_gib": round(m.get("activations", 0) + m.get("transient", 0) + m.get("comm", 0), 1),
                     "alst": ALST.get(key), "upipe": UPIPE.get(key), "target": TARGETS.get(key)})
    print("| model | GPUs | planner max seq | chosen plan | GiB/GPU (states + act.) | host GiB/node | ALST measured "
          "| UPipe measured | target |")
    print("|---|---|---|---|---|---|---|---|---|")
    for r in rows:
        print(f"| {r['model']} | {r['gpus']}x{r['gpu']} | {_fmt(r['planner_max_seq'])} | `{r['chosen']}` | "
              f"{r['gib_per_gpu']} ({r['model_states_gib']} + {r['activations_gib']}) | {r['host_gib_per_node']} | "
              f"{_fmt(r['alst'])} | {_fmt(r['upipe'])} | {_fmt(r['target'])}"
              + (" met" if r["target"] and r["planner_max_seq"] >= r["target"] else (" not met" if r["target"] else ""))
              + " |")
    lim = {f"{m}/{g}x{n}@{_fmt(s)}": limits_at(s, ctxs[(m, g, n)])
           for (m, g, n), s in ((("llama3_8b", "h100", 1), 1 << 20), (("llama3_8b", "h100", 8), 5 << 20),
                                (("llama3_70b", "h100", 32), 4 << 20))}
    print("\nwhat limits the targets (the smallest-memory fitting candidate at the target length, else the smallest "
          "miss):")
    for k, v in lim.items():
        verdict = "fits" if v["fits"] else ", ".join(
            w for w, ok in (("device memory exceeded", v["fits_gpu"]), ("host memory exceeded", v["fits_host"]))
            if not ok)
        print(f"  {k}: {v['total_gib']} GiB/GPU, host {v['host_gib_per_node']} GiB/node ({verdict}; peak in the "
              f"{v['peak_phase']} backward) {v['candidate']}: "
              + ", ".join(f"{t} {g}" for t, g in v["terms_gib"].items()))
    print(f"\n({time.time() - t0:.0f} s)")
    if args.json:
        Path(args.json).write_text(json.dumps({"rows": rows, "limits": lim}, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
