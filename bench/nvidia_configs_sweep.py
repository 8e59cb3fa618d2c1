"""Sweep every GPTConfig NVIDIA ships in ``nemo.collections.llm.gpt.model`` under cp=none, ring, Ulysses and hybrid
CP (2 gloo ranks, CPU, fp32) and print a Markdown table: per config (configs identical once shrunk share a row)
whether each CP mode's per-step losses match cp=none's (5e-6 relative), or what refused it.

What is run, and how, is ``tests/nvidia_configs.py``'s docstring: NVIDIA's defaults shrunk by one generic rule,
NeMo's model build (``enable_long_context`` + ``configure_model``) and Megatron-core's training machinery (DDP,
``get_forward_backward_func``, NeMo's ``MaskedTokenLossReduction``), 3 SGD steps from the same initial weights.
The configs are discovered (every ``GPTConfig`` subclass), so a config class NeMo adds gets a row by itself.

The parent process discovers and deduplicates; the groups run in spawned 2-rank jobs of ``--chunk-size`` groups
(a job that dies costs its chunk only). Each job also runs the no-communication control (every core attention
with CP size 1 under CP=2) on its first config whose ring run matched; it must differ from cp=none by > 1e-4.

Usage: .venv/bin/python bench/nvidia_configs_sweep.py [--only Llama3Config8B MixtralConfig8x7B] [--chunk-size 12]
"""

from __future__ import annotations

import argparse
import os
import sys
import time

ROOT = os.path.join(os.path.dirname(os.path.abspath(__file__)), "..")
sys.path.insert(0, os.path.join(ROOT, "tests"))
sys.path.insert(0, ROOT)
import nvidia_configs as nc  # noqa: E402  (tests/nvidia_configs.py: discovery, shrink, the per-rank job, tables)
from distributed import run_distributed  # noqa: E402  (tests/distributed.py: spawn gloo ranks)


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--only", nargs="+", metavar="NAME", help="config class names to run (default: all)")
    parser.add_argument("--chunk-size", type=int, default=12, help="config groups per spawned 2-rank job")
    parser.add_argument("--timeout", type=float, default=3600, help="seconds one job may take")
    parser.add_argument("--out", help="also write the report (table, messages, control, summary) to this file (the "
                                      "ranks' own log lines share stdout)")
    args = parser.parse_args(argv)

    t0 = time.perf_counter()
    from nemo_longctx.integrations.nemo import compat

    compat.apply()  # NeMo's configs are instantiated here (to deduplicate): the CPU fixes first
    found = nc.discover_gpt_configs()
    if args.only:
        unknown = set(args.only) - {c.__name__ for _, c in found}
        if unknown:
            parser.error(f"not NeMo GPT configs: {sorted(unknown)}")
        found = [(m, c) for m, c in found if c.__name__ in args.only]
    groups = nc.plan(found)
    print(f"{len(found)} configs, {len(groups)} distinct once shrunk; discovery and plan "
          f"{time.perf_counter() - t0:.0f} s", file=sys.stderr, flush=True)

    results, controls, failures = [], [], []
    chunks = [groups[i:i + args.chunk_size] for i in range(0, len(groups), args.chunk_size)]
    for n, chunk in enumerate(chunks, 1):
        t1 = time.perf_counter()
        try:
            out = run_distributed(nc.sweep_job, 2, chunk, timeout=args.timeout)[0]
        except Exception as e:  # noqa: BLE001 - a dead job is reported for its configs, the others go on
            message = str(e).strip().splitlines()[-1] if str(e).strip() else type(e).__name__
            failures.append((chunk, str(e)))
            for group in chunk:
                results.append({"names": group["names"], "modules": group["modules"],
                                **{m: {"status": "job died", "error": message} for m in nc.MODES}})
            print(f"job {n}/{len(chunks)} died after {time.perf_counter() - t1:.0f} s: {message}", file=sys.stderr,
                  flush=True)
            continue
        results += out["results"]
        controls.append(out["control"])
        print(f"job {n}/{len(chunks)}: {len(chunk)} groups in {time.perf_counter() - t1:.0f} s", file=sys.stderr,
              flush=True)

    report = [nc.format_table(results), "\nMessages (verbatim, where raised, which config/mode):\n",
              nc.format_messages(results) or "none",
              "\nNo-communication control (each rank's core attention with CP size 1 under CP=2), per job:"]
    report += [f"- job {n}: {c or 'not run (no config of this job matched under ring)'}"
               for n, c in enumerate(controls, 1)]
    report += [f"\nJob over {[g['names'][0] for g in chunk]} died:\n{error}" for chunk, error in failures]
    counts: dict = {}
    for res in results:
        for mode in nc.MODES:
            cell = nc._cell(res, mode).split(" ")[0]
            counts.setdefault(mode, {}).setdefault(cell, 0)
            counts[mode][cell] += 1
    report.append(f"\nSummary: {len(found)} configs, {len(groups)} runs; " + "; ".join(
        f"{mode}: " + ", ".join(f"{k} {v}" for k, v in sorted(c.items())) for mode, c in counts.items()))
    report.append(f"Total time {time.perf_counter() - t0:.0f} s ({len(chunks)} jobs of 2 ranks)")
    text = "\n".join(report)
    print("\n" + "=" * 40 + " report " + "=" * 40 + "\n" + text)
    if args.out:
        with open(args.out, "w") as f:
            f.write(text + "\n")
    worst = [nc.check_control(c) for c in controls if c is not None]  # raises if a control matched cp=none
    assert worst, "no job ran the no-communication control"
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main())
