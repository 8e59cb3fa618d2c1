"""One training run, many assertions: a run shared by test files, done at most once per pytest session even when the
files land on different pytest-xdist workers (a file lock and a directory in the session's shared temporary folder).

``shared_run(name, cmd, tmp_path_factory)`` runs ``cmd`` (``output_dir`` is the caller's: put ``run_dir(name, ...)``
in it) the first time any worker asks for ``name`` and returns (exit code, output); later calls, on any worker, wait
for that run and return what it printed. A run that failed is not retried: every caller sees its exit code.
"""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any, Callable, Sequence, Tuple

from filelock import FileLock

from app_runner import run_app


def session_dir(tmp_path_factory) -> Path:
    """The temporary folder every worker of this session shares (a worker's own base folder is one level below)."""
    base = Path(tmp_path_factory.getbasetemp())
    return base.parent if os.environ.get("PYTEST_XDIST_WORKER") else base


def run_dir(name: str, tmp_path_factory) -> Path:
    """The output folder of the shared run ``name``."""
    return session_dir(tmp_path_factory) / "shared_runs" / name


def shared_result(name: str, compute: Callable[[], Any], tmp_path_factory) -> Any:
    """``compute()`` (a JSON-serializable value) the first time any worker of the session asks for ``name``; what it
    returned, read back, for every later call on any worker."""
    where = session_dir(tmp_path_factory) / "shared_runs"
    where.mkdir(parents=True, exist_ok=True)
    done = where / f"{name}.json"
    with FileLock(str(where / f"{name}.lock")):
        if not done.exists():
            done.write_text(json.dumps(compute()))
        return json.loads(done.read_text())


def shared_run(name: str, cmd: Sequence[str], tmp_path_factory, timeout: float = 400) -> Tuple[int, str]:
    def run() -> dict:
        code, log = run_app(cmd, timeout)
        return {"cmd": [str(c) for c in cmd], "code": code, "log": log}

    record = shared_result(name, run, tmp_path_factory)
    assert record["cmd"] == [str(c) for c in cmd], f"shared run {name!r} asked for with another command line"
    return record["code"], record["log"]
