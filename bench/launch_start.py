"""How the local launcher's start methods compare: the CPU demo trained with ``launcher.start_method=spawn`` (a fresh
interpreter per rank, each importing NeMo, Megatron-core and Lightning), ``forkserver`` (one server per run imports
them once and forks every rank) and ``shared`` (``forkserver`` with the ranks forked from one warm server this
process started for all runs: ``NEMO_LONGCTX_RANK_SERVER``, ``shared/rank_server.py``), side by side, at each rank
count asked for.

Each run is ``nemo-longctx train`` of the demo (seq 1024, a few steps, ring CP over all ranks) in a process that
waits for every descendant (a Linux child subreaper), so the CPU column is the whole run's: the launcher, the fork
server and the ranks (for ``shared``: the launcher, and the ranks' CPU as the shared server counts its children's;
the server's own imports are paid once, before the timed runs, and printed on a line of their own). Prints one row
per (ranks, start method): wall seconds, CPU seconds, final loss (equal across start methods: the same training),
and exits 1 when the losses differ.

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

from nemo_longctx.apps.train import RANK_PRELOAD
from nemo_longctx.shared import rank_server
from nemo_longctx.shared.reaper import proc_stat

PR_SET_CHILD_SUBREAPER = 36
CLI = str(Path(sys.executable).parent / "nemo-longctx")


def _cpu_of(pid: int, children: bool = False) -> float:
    """CPU seconds of process ``pid`` itself, or (``children``) of the children it has waited for."""
    stat = proc_stat(pid)
    ticks = (int(stat[13]) + int(stat[14])) if children else (int(stat[11]) + int(stat[12]))
    return ticks / os.sysconf("SC_CLK_TCK")


def run_once(ranks: int, method: str, steps: int, server=None) -> dict:
    """One run in a child of this process; (wall s, CPU s of it and all its descendants, final loss). ``server``:
    the shared rank server (method ``shared``)."""
    out = tempfile.mkdtemp(prefix=f"launch_{method}_{ranks}_")
    start = "forkserver" if method == "shared" else method
    cmd = [CLI, "train", f"output_dir={out}", "model.seq_length=1024", f"trainer.max_steps={steps}",
           f"trainer.devices={ranks}", f"cp.size={ranks}", "memory.track=false", f"launcher.start_method={start}"]
    env = {k: v for k, v in os.environ.items() if k != rank_server.VAR}
    if method == "shared":
        env[rank_server.VAR] = server.env()
    staying = set(rank_server.children_of(os.getpid(), zombies=True))  # the shared server and its resource tracker
    before = resource.getrusage(resource.RUSAGE_CHILDREN)
    served = _cpu_of(server.pid, children=True) if method == "shared" else 0.0
    t0 = time.perf_counter()
    p = subprocess.run(cmd, capture_output=True, text=True, env=env)
    while True:  # the fork server outlives the launcher by a moment: wait for it (and so count its ranks' CPU)
        others = [pid for pid in rank_server.children_of(os.getpid(), zombies=True) if pid not in staying]
        if not others:
            break
        for pid in others:
            try:
                os.waitpid(pid, 0)
            except ChildProcessError:
                pass
    wall = time.perf_counter() - t0
    after = resource.getrusage(resource.RUSAGE_CHILDREN)
    cpu = (after.ru_utime - before.ru_utime) + (after.ru_stime - before.ru_stime)
    if method == "shared":
        cpu += _cpu_of(server.pid, children=True) - served  # the ranks, reaped by the server
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
    server = rank_server.start(RANK_PRELOAD)
    run_once(args.ranks[0], "shared", 1, server)  # not printed: the server's imports done before any timed run
    imports = _cpu_of(server.pid)
    print(f"{'ranks':>5} {'start method':>12} {'wall s':>7} {'CPU s':>7} {'final loss':>12}")
    ok = True
    for ranks in args.ranks:
        losses = set()
        for _ in range(args.repeat):
            for method in ("spawn", "forkserver", "shared"):  # alternated: the machine's drift hits each
                r = run_once(ranks, method, args.steps, server)
                losses.add(r["loss"])
                print(f"{ranks:>5} {method:>12} {r['wall_s']:>7.1f} {r['cpu_s']:>7.1f} {r['loss']:>12.6f}", flush=True)
        ok &= len(losses) == 1
    print(f"the shared server's own imports (once, before the runs): {imports:.1f} CPU s")
    server.close()
    if not ok:
        print("the start methods trained different losses", file=sys.stderr)
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
