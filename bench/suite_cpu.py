"""Where a test run's CPU goes: every Python process it starts, by kind (framework imports vs work).

    python bench/suite_cpu.py -- .venv/bin/python -m pytest -n 2 --dist loadfile -m 'not slow' -q
    python bench/suite_cpu.py --log /tmp/cpu.jsonl            # the table of an earlier run's log

Runs the command with a ``sitecustomize`` hook on ``PYTHONPATH`` (the command's Python processes and every Python
process they start, as long as the environment is passed on) that appends one JSON line per process when it ends
(``atexit`` and ``os._exit``): its CPU seconds (user + system, its own, not its children's), whether NeMo
(``nemo.collections.llm``) and Megatron-core were imported, whether it was forked from a process that had NeMo
imported already, and, for a forked process, its parent's CPU seconds at the fork (a fork server killed at the end of
its run writes no line of its own: its CPU at the first fork is its import). Then prints CPU seconds by kind.
Processes killed by SIGKILL (a run's fork server, ranks stopped by a failure test) are counted only through the fork
servers' first fork; non-Python processes (Slurm's daemons, shells) not at all.
"""

from __future__ import annotations

import argparse
import collections
import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Dict, List

HOOK = r'''
import atexit, json, os, resource, sys, time
_LOG = os.environ.get("NEMO_LONGCTX_CPU_LOG")
_FORKED = None  # None: exec'd; else whether NeMo was imported in the parent at the fork
_PARENT_CPU = None
_START = time.time()
def _record(*_):
    if not _LOG:
        return
    try:
        r = resource.getrusage(resource.RUSAGE_SELF)
        line = {"pid": os.getpid(), "argv": " ".join(sys.argv)[:500], "cpu": round(r.ru_utime + r.ru_stime, 2),
                "nemo": "nemo.collections.llm" in sys.modules, "mcore": "megatron.core" in sys.modules,
                "forked": _FORKED, "parent_cpu": _PARENT_CPU, "start": _START, "end": time.time()}
        with open(_LOG, "a") as f:
            f.write(json.dumps(line) + "\n")
    except Exception:
        pass
def _after_fork():
    global _FORKED, _PARENT_CPU, _START
    _START = time.time()
    _FORKED = "nemo.collections.llm" in sys.modules
    try:
        stat = open(f"/proc/{os.getppid()}/stat").read().rsplit(")", 1)[1].split()
        _PARENT_CPU = [os.getppid(), (int(stat[11]) + int(stat[12])) / os.sysconf("SC_CLK_TCK")]
    except Exception:
        pass
atexit.register(_record)
_exit = os._exit
def _recorded_exit(code):
    _record()
    _exit(code)
os._exit = _recorded_exit
os.register_at_fork(after_in_child=_after_fork)
'''


def read_log(path: Path) -> List[dict]:
    """One row per process: a process writes at ``atexit`` and at ``os._exit`` (the larger CPU is kept); processes are
    told apart by pid and start time (pids are reused over a long run)."""
    rows: Dict[tuple, dict] = {}
    for line in path.read_text().splitlines():
        try:
            r = json.loads(line)
        except ValueError:
            continue
        key = (r["pid"], r.get("start"))
        if key not in rows or r["cpu"] > rows[key]["cpu"]:
            rows[key] = r
    return list(rows.values())


def kind(r: dict) -> str:
    a = r["argv"]
    if r["forked"] is True:
        return "forked from a process with NeMo imported (an app run's ranks)"
    if r["forked"] is False:
        return "forked from a process without NeMo (tests' gloo ranks, the Bridge app's ranks)"
    if r["nemo"]:
        return "started with NeMo imported (spawned/srun ranks, CLIs that import it, pytest workers)"
    if r["mcore"]:
        return "started with Megatron-core imported, no NeMo"
    if "reaper" in a:
        return "started, light: the launchers' reapers"
    return "started, light: launchers, dry runs, refusals, planners, pip"


def table(rows: List[dict]) -> str:
    by_pid = collections.defaultdict(list)
    for r in rows:
        by_pid[r["pid"]].append(r)
    # fork servers: the parents of forked processes (the app's per-run server, the tests' gloo server, the Bridge
    # app's). One that wrote a line counts with its own CPU; one killed at the end of its run wrote none: its CPU at
    # the first fork (its import) stands for it. Told apart by pid and the time of the fork (pids are reused).
    servers: Dict[tuple, float] = {}
    logged_servers = set()
    for r in sorted((r for r in rows if r["forked"] is not None and r["parent_cpu"]), key=lambda r: r["start"]):
        pid, cpu = r["parent_cpu"]
        parent = next((p for p in by_pid[pid] if p["start"] <= r["start"] <= p["end"]), None)
        if parent is not None:
            logged_servers.add(id(parent))
        elif not any(k[0] == pid and servers[k] <= cpu and r["start"] - k[1] < 3600 for k in servers):
            servers[(pid, r["start"])] = cpu
    by = collections.defaultdict(lambda: [0, 0.0])
    server_kind = "fork servers: their imports (their CPU; the CPU at the first fork of one killed at the end)"
    for r in rows:
        k = server_kind if id(r) in logged_servers else kind(r)
        by[k][0] += 1
        by[k][1] += r["cpu"]
    by[server_kind][0] += len(servers)
    by[server_kind][1] += sum(servers.values())
    total = sum(v[1] for v in by.values())
    out = ["| kind | processes | CPU s | share |", "|---|---:|---:|---:|"]
    for k, (n, cpu) in sorted(by.items(), key=lambda kv: -kv[1][1]):
        out.append(f"| {k} | {n} | {cpu:,.0f} | {cpu / total:.0%} |")
    out.append(f"| all | {sum(v[0] for v in by.values())} | {total:,.0f} ({total / 60:.1f} CPU-min) | |")
    return "\n".join(out)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--log", type=Path, help="a log to read (with a command: where to write it)")
    ap.add_argument("command", nargs=argparse.REMAINDER, help="-- then the command to run")
    args = ap.parse_args()
    command = args.command[1:] if args.command[:1] == ["--"] else args.command
    if not command:
        if not args.log:
            ap.error("give a command after --, or --log of an earlier run")
        print(table(read_log(args.log)))
        return 0
    with tempfile.TemporaryDirectory(prefix="suite-cpu-") as hook_dir:
        Path(hook_dir, "sitecustomize.py").write_text(HOOK)
        log = args.log or Path(hook_dir) / "cpu.jsonl"
        env = {**os.environ, "NEMO_LONGCTX_CPU_LOG": str(log),
               "PYTHONPATH": os.pathsep.join(p for p in (hook_dir, os.environ.get("PYTHONPATH")) if p)}
        code = subprocess.call(command, env=env)
        print(table(read_log(Path(log))) if Path(log).exists() else "no process wrote to the log", file=sys.stderr)
    return code


if __name__ == "__main__":
    sys.exit(main())
