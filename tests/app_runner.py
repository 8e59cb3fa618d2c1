"""Run the train app (or any command) in a subprocess with bounded time and memory, from the repository root."""

from __future__ import annotations

import json
import os
import shlex
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import Callable, Optional, Sequence, Tuple

ROOT = Path(__file__).resolve().parents[1]
MEMORY_LIMIT_KB = 8_000_000


_SERVER = {}  # this test process's warm rank server (rank_server.start), started by its first run_app
_SERVER_LOCK = threading.Lock()  # (a fixture may run apps from two threads)


def rank_server_env() -> dict:
    """``{NEMO_LONGCTX_RANK_SERVER: ...}`` for a launch of the train app: its ranks fork from one server this test
    process starts once (NeMo & co. imported once per pytest worker instead of once per run: ~10 s of one core each);
    ``{}`` while the launches' start-up or Hugging Face settings differ from the server's (a test's own: read as
    the interpreter starts or the frameworks are imported, ``rank_server.import_time_settings``), so that launch
    starts a server of its own."""
    import resource

    from nemo_longctx.apps.train import RANK_PRELOAD
    from nemo_longctx.shared import rank_server

    with _SERVER_LOCK:
        if "server" not in _SERVER:
            # the server and the ranks it forks under the memory bound a launch gets (``ulimit -v`` in run_app)
            soft, hard = resource.getrlimit(resource.RLIMIT_AS)
            resource.setrlimit(resource.RLIMIT_AS, (MEMORY_LIMIT_KB * 1024, hard))
            unbuffered = os.environ.get("PYTHONUNBUFFERED")
            os.environ["PYTHONUNBUFFERED"] = "1"  # as run_app's launches have it
            try:
                _SERVER["server"] = rank_server.start(RANK_PRELOAD)
            finally:
                resource.setrlimit(resource.RLIMIT_AS, (soft, hard))
                if unbuffered is None:
                    os.environ.pop("PYTHONUNBUFFERED")
                else:
                    os.environ["PYTHONUNBUFFERED"] = unbuffered
        server = _SERVER["server"]
    return {rank_server.VAR: server.env()} if server.serves(launch_env()) else {}


def launch_env() -> dict:
    """The environment of ``run_app``'s launches (without the rank server's address)."""
    return {**os.environ, "PYTHONUNBUFFERED": "1"}


def run_app(cmd: Sequence[str], timeout: float = 400, shared_ranks: bool = True) -> Tuple[int, str]:
    """Run ``cmd`` under ``ulimit -v`` with PYTHONUNBUFFERED; return (returncode, stdout + stderr); 124 and the output
    so far when it runs past ``timeout`` (the launcher's reaper and the ranks' watch of the launcher end its ranks).
    A local launch forks its ranks from this process's warm rank server (``rank_server_env``), unless
    ``shared_ranks=False`` (a server of its own, as a launch from a shell has)."""
    shell = f"ulimit -v {MEMORY_LIMIT_KB}; exec {' '.join(shlex.quote(str(c)) for c in cmd)}"
    env = {**launch_env(), **(rank_server_env() if shared_ranks else {})}
    try:
        p = subprocess.run(["bash", "-c", shell], cwd=ROOT, capture_output=True, text=True, timeout=timeout, env=env)
    except subprocess.TimeoutExpired as e:  # the output so far, for the assertion message (the process was killed)
        def text(b):
            return b.decode(errors="replace") if isinstance(b, bytes) else (b or "")

        return 124, text(e.stdout) + text(e.stderr) + f"\n[app_runner: killed after {timeout} s]"
    return p.returncode, p.stdout + p.stderr



def printed_command(stdout: str, start: str = "nemo-longctx train ") -> str:
    """The command ``nemo-longctx plan`` printed, on one line: the first line starting with ``start`` and its
    `` \\`` continuation lines, joined as a shell joins them."""
    lines = stdout.splitlines()
    i = next(n for n, line in enumerate(lines) if line.startswith(start))
    parts = [lines[i]]
    while parts[-1].endswith(" \\"):
        parts[-1] = parts[-1][:-2]
        i += 1
        parts.append(lines[i].strip())
    return " ".join(parts)


# the frameworks a launching process must not import before it refuses a config or prints help (each costs seconds)
HEAVY = ("nemo", "megatron", "lightning", "pytorch_lightning", "transformers")


def importtime_split(text: str, heavy: Sequence[str] = HEAVY) -> Tuple[str, list]:
    """Split the output of a ``python -X importtime`` process into (its own output, the heavy frameworks it imported):
    a check of "it did not wait for NeMo" that holds on a loaded machine, where a wall-time bound does not."""
    own, imported = [], set()
    for ln in text.splitlines(keepends=True):
        if ln.startswith("import time:"):
            name = ln.rsplit("|", 1)[-1].strip()
            if name.split(".")[0] in heavy:
                imported.add(name.split(".")[0])
        else:
            own.append(ln)
    return "".join(own), sorted(imported)


def run_importtime(args: Sequence[str], cwd: Path, heavy: Sequence[str] = HEAVY, timeout: float = 60,
                   env: Optional[dict] = None) -> Tuple[int, str, str, list, float]:
    """Run ``python -X importtime ARGS`` (a script path or ``-c CODE`` and its arguments): (exit code, stdout, stderr
    without the import lines, the heavy frameworks it imported, seconds)."""
    t0 = time.perf_counter()
    p = subprocess.run([sys.executable, "-X", "importtime", *map(str, args)], cwd=cwd, capture_output=True, text=True,
                       timeout=timeout, env=env)
    stderr, imported = importtime_split(p.stderr, heavy)
    return p.returncode, p.stdout, stderr, imported, time.perf_counter() - t0


def metrics_rows(out_dir: Path) -> list:
    """The rows of a run's ``metrics.jsonl`` (train steps and validation rows)."""
    return [json.loads(line) for line in (Path(out_dir) / "metrics.jsonl").read_text().splitlines() if line.strip()]


def live_processes(match: Callable[[str, list], bool]) -> list:
    """Live (not zombie) processes for which ``match(cmdline, environ entries)`` holds, as "pid: command" lines."""
    found = []
    for proc in Path("/proc").iterdir():
        if not proc.name.isdigit():  # self, thread-self: this process again
            continue
        try:
            env = (proc / "environ").read_bytes().split(b"\0")
            state = next(ln for ln in (proc / "status").read_text().splitlines() if ln.startswith("State:"))
            cmdline = (proc / "cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace")
        except (OSError, StopIteration):
            continue
        if "zombie" not in state and match(cmdline, env):
            found.append(f"{proc.name}: {cmdline[:200]}")
    return found


def leftover_processes() -> list:
    """Live processes started by a local launch of the calling test: ranks and everything they started (they carry
    NEMO_LONGCTX_SPAWNED=1 and this test's PYTEST_CURRENT_TEST in their environment), and any live process forked by
    this test process's rank server (its ranks: once a run has ended, none; tests of one process run one at a time)."""
    ours = f"PYTEST_CURRENT_TEST={os.environ.get('PYTEST_CURRENT_TEST', '').rsplit(' (', 1)[0]} (".encode()
    server = _SERVER.get("server")
    forked = [f"{pid}: (forked by the rank server)" for pid in server.children()] if server is not None else []
    return live_processes(lambda _, env: b"NEMO_LONGCTX_SPAWNED=1" in env and any(v.startswith(ours) for v in env)) \
        + forked


def train_config(overrides):
    """The train config of ``overrides``, composed as the app composes it (``shared.overrides.compose``: the tiny
    demo models get the demo's recipe); a problem composing fails the test."""
    from nemo_longctx.shared.overrides import compose

    cfg, problems = compose("train", list(overrides))
    assert cfg is not None and not problems, problems
    return cfg


def train_spec(overrides):
    """The run spec of ``overrides`` (``train_config`` read by the app's one reader, ``read_run_spec``)."""
    from nemo_longctx.shared.run_spec import read_run_spec

    return read_run_spec(train_config(overrides))


DRY_RUNS = r"""
import json, sys, traceback
from nemo_longctx.apps import train
from nemo_longctx.shared.overrides import compose
results = []
for n, args in enumerate(json.loads(sys.argv[1])):
    print(f"@@RUN {n}", flush=True)
    try:
        cfg, problems = compose("train", args)
        if problems:
            raise train.ConfigError(problems)
        results.append([args, train.run(cfg), ""])
    except BaseException as e:
        results.append([args, 1, "".join(traceback.format_exception_only(type(e), e))])
print("@@RESULTS " + json.dumps(results))
"""


def dry_runs_in_one_process(runs: Sequence[Sequence[str]], cwd: Path, timeout: float = 600) -> list:
    """Compose and run each argument list of ``runs`` (``nemo-longctx train`` overrides; add ``run.dry_run=true``)
    in ONE Python process (NeMo imported once); returns [(args, exit code, exception text, the run's stdout)]."""
    r = subprocess.run([sys.executable, "-c", DRY_RUNS, json.dumps([list(a) for a in runs])], cwd=cwd,
                       capture_output=True, text=True, timeout=timeout)
    marker = next((ln for ln in r.stdout.splitlines() if ln.startswith("@@RESULTS ")), None)
    assert marker is not None, r.stdout[-3000:] + r.stderr[-3000:]
    outputs = [""] * len(runs)
    n = None
    for ln in r.stdout.splitlines():
        if ln.startswith("@@RUN "):
            n = int(ln.split()[1])
        elif n is not None and not ln.startswith("@@RESULTS "):
            outputs[n] += ln + "\n"
    return [(args, code, err, outputs[i]) for i, (args, code, err) in enumerate(json.loads(marker[len("@@RESULTS "):]))]
