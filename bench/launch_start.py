"""How the local launcher's start methods compare: the CPU demo trained with ``launcher.start_method=spawn`` (a fresh
interpreter per rank, each importing NeMo, Megatron-core and Lightning) and ``forkserver`` (one server imports them
once and forks every rank), side by side, at each rank count asked for.

Each run is ``nemo-longctx train`` of the demo (seq 1024, a few steps, ring CP over all ranks) in a process that
waits for every descendant (a Linux child subreaper), so the CPU column is the whole run's: the launcher, the fork
server and the ranks. Prints one row per (ranks, start method): wall seconds, CPU seconds, final loss (equal across
start methods: the same training), and exits 1 when the losses differ.

    python bench/launch_start.py                     # 2 and 4 ranks, 6 steps, one run each
    python bench/launch_start.py --ranks 2 --repeat 2
"""

from __future__ import annotations

import argparse
import ctypes
import json
import os
import resource
import subprocess
import sys
import tempfile
import time
from pathlib import Path

PR_SET_CHILD_SUBREAPER = 36
CLI = str(Path(sys.executable).parent / "nemo-longctx")


def run_once(ranks: int, method: str, steps: int) -> dict:
    """One run in a child of this process; (wall s, CPU s of it and all its descendants, final loss)."""
    out = tempfile.mkdtemp(prefix=f"launch_{method}_{ranks}_")
    cmd = [CLI, "train", f"output_dir={out}", "model.seq_length=1024", f"trainer.max_steps={steps}",
           f"trainer.devices={ranks}", f"cp.size={ranks}", "memory.track=false", f"launcher.start_method={method}"]
    before = resource.getrusage(resource.RUSAGE_CHILDREN)
    t0 = time.perf_counter()
    p = subprocess.run(cmd, capture_output=True, text=True)
    while True:  # the fork server outlives the launcher by a moment: wait for it (and so count its ranks' CPU)
        try:
            os.waitpid(-1, 0)
        except ChildProcessError:
            break
    wall = time.perf_counter() - t0
    after = resource.getrusage(resource.RUSAGE_CHILDREN)
    cpu = (after.ru_utime - before.ru_utime) + (after.ru_stime - before.ru_stime)
    if p.returncode != 0:
        raise SystemExit(f"{' '.join(cmd)} failed ({p.returncode}):\n{p.stdout[-2000:]}{p.stderr[-2000:]}")
    rows = [json.loads(line) for line in Path(out, "metrics.jsonl").read_text().splitlines() if line.strip()]
    return {"wall_s": wall, "cpu_s": cpu, "loss": [r["loss"] for r in rows if "loss" in r][-1]}


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--ranks", type=int, nargs="+", default=[2, 4])
    ap.add_argument("--steps", type=int, default=6)
    ap.add_argument("--repeat", type=int, default=1)
    args = ap.parse_args(argv)
    ctypes.CDLL("libc.so.6", use_errno=True).prctl(PR_SET_CHILD_SUBREAPER, 1, 0, 0, 0)
    print(f"{'ranks':>5} {'start method':>12} {'wall s':>7} {'CPU s':>7} {'final loss':>12}")
    ok = True
    for ranks in args.ranks:
        losses = set()
        for _ in range(args.repeat):
            for method in ("spawn", "forkserver"):  # alternated: the machine's drift hits both
                r = run_once(ranks, method, args.steps)
                losses.add(r["loss"])
                print(f"{ranks:>5} {method:>12} {r['wall_s']:>7.1f} {r['cpu_s']:>7.1f} {r['loss']:>12.6f}", flush=True)
        ok &= len(losses) == 1
    if not ok:
        print("the start methods trained different losses", file=sys.stderr)
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
