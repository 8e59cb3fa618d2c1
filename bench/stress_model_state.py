"""Stress check for the model-state options (issue 20): train each ``optim`` x recompute/offload combination many times
back to back beside CPU hogs, and count the runs that fail.

Every run is the shared model-state job of tests/model_state_runs.py (tiny GQA Llama with odd widths, cp=ring
cp.size=2 on two gloo processes, bf16-mixed, seq 2048) for ``--steps`` steps, started like the tests start it
(``ulimit -v``, PYTHONUNBUFFERED). ``--hogs`` busy-looping processes run beside it for the whole bench, so that the
ranks are preempted at arbitrary points (the 2-core CI machine is the target). A failed run's launcher report
(``nemo-longctx: FAILED ...`` and the dead rank's last stderr lines) is printed under the table.

    python bench/stress_model_state.py --runs 30 --hogs 2                  # every combination below
    python bench/stress_model_state.py --runs 30 --configs fsdp fsdp_rc    # some of them
    python bench/stress_model_state.py --runs 6 --hogs 2 --configs fsdp --steps 300 --set model.num_layers=8 \
        model.seq_length=512                                               # many more collectives per run

Prints one row per combination: runs, failures, median and max wall seconds.
"""

from __future__ import annotations

import argparse
import multiprocessing as mp
import statistics
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "tests"))

from app_runner import run_app  # noqa: E402
from model_state_runs import COMMON, RUNS  # noqa: E402

DEFAULT = ["fsdp", "fsdp_rc", "distributed", "distributed_rc", "cpu_offload_half_rc", "precision_aware_half_rc"]


def _hog() -> None:
    while True:
        pass


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--runs", type=int, default=30)
    ap.add_argument("--hogs", type=int, default=1, help="busy-looping processes beside the runs")
    ap.add_argument("--steps", type=int, default=6)
    ap.add_argument("--configs", nargs="+", default=DEFAULT, choices=sorted(RUNS))
    ap.add_argument("--set", nargs="*", default=[], metavar="KEY=VALUE",
                    help="more overrides, e.g. model.num_layers=8 model.seq_length=512 (more collectives per second)")
    args = ap.parse_args()
    replaced = tuple(kv.split("=", 1)[0] + "=" for kv in args.set) + ("trainer.max_steps=", "run.timeout_s=")
    common = [c for c in COMMON if not c.startswith(replaced)] + list(args.set)
    common += [f"trainer.max_steps={args.steps}", f"run.timeout_s={max(300, 60 + 3 * args.steps)}"]
    hogs = [mp.Process(target=_hog, daemon=True) for _ in range(args.hogs)]
    for h in hogs:
        h.start()
    results: dict = {name: [] for name in args.configs}
    failures = []
    try:
        with tempfile.TemporaryDirectory(prefix="stress_model_state_") as tmp:
            for i in range(args.runs):
                for name in args.configs:  # interleaved: every combination sees the same machine conditions
                    out = Path(tmp) / f"{name}.{i}"
                    t0 = time.perf_counter()
                    code, log = run_app([sys.executable, "-m", "nemo_longctx.apps.train", f"output_dir={out}", *common,
                                         *RUNS[name][0]], timeout=max(400, 120 + 4 * args.steps))
                    results[name].append((code, time.perf_counter() - t0))
                    if code != 0:
                        report = [ln for ln in log.splitlines() if ln.startswith("nemo-longctx:")][-40:]
                        failures.append((name, i, code, report))
                    print(f"{name} run {i + 1}/{args.runs}: exit {code}", file=sys.stderr, flush=True)
    finally:
        for h in hogs:
            h.terminate()
    print(f"\nstress: {args.runs} runs per combination, {args.steps} steps each, {args.hogs} CPU hog(s) beside them"
          + (f", with {' '.join(args.set)}" if args.set else ""))
    print(f"{'combination':28s} {'overrides':62s} {'runs':>5s} {'failed':>6s} {'median s':>9s} {'max s':>7s}")
    for name, rows in results.items():
        secs = [s for _, s in rows]
        print(f"{name:28s} {' '.join(RUNS[name][0])[:62]:62s} {len(rows):5d} {sum(c != 0 for c, _ in rows):6d} "
              f"{statistics.median(secs):9.1f} {max(secs):7.1f}")
    for name, i, code, report in failures:
        print(f"\n--- {name} run {i + 1}: exit {code}")
        print("\n".join(report))
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main())
