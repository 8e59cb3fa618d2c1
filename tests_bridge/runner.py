"""Run ``python -m nemo_longctx.apps.bridge`` in a subprocess from the repository root (the Bridge tests' helper)."""

from __future__ import annotations

import atexit
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Dict, List, Optional, Tuple

ROOT = Path(__file__).resolve().parents[1]


_SERVER: dict = {}  # this test process's warm rank server, started by its first run_bridge


def rank_server_env(env: Optional[Dict[str, str]] = None) -> Dict[str, str]:
    """``{NEMO_LONGCTX_RANK_SERVER: ...}``: the ranks of every run of this test process fork from one server
    (``shared/rank_server.py``) that imports Megatron-Bridge once, instead of one server per run. ``{}`` for a run
    whose environment (``os.environ`` and ``env``) has other start-up or Hugging Face settings than the server's
    (a test's offline hub cache, a sitecustomize on PYTHONPATH: read as the interpreter starts or the frameworks are
    imported, ``rank_server.import_time_settings``): it starts a server of its own."""
    from nemo_longctx.apps.bridge import RANK_PRELOAD
    from nemo_longctx.shared import rank_server

    if "server" not in _SERVER:
        _SERVER["server"] = rank_server.start(RANK_PRELOAD)
    server = _SERVER["server"]
    return {rank_server.VAR: server.env()} if server.serves({**os.environ, **(env or {})}) else {}


def run_bridge(tmp_path: Path, name: str, *args: str, timeout: float = 600,
               env: Optional[Dict[str, str]] = None) -> Tuple[int, str, List[dict]]:
    """(exit code, stdout + stderr, rank 0's metrics rows) of one ``nemo-longctx bridge`` run writing to
    ``tmp_path/name``; ``env``: extra environment variables (inherited by the ranks and their children). Its ranks
    fork from this process's rank server (``rank_server_env``) when its start-up settings are the server's."""
    out = tmp_path / name
    p = subprocess.run([sys.executable, "-m", "nemo_longctx.apps.bridge", f"output_dir={out}", *args],
                       capture_output=True, text=True, timeout=timeout, cwd=ROOT,
                       env={**os.environ, **rank_server_env(env), **(env or {})})
    metrics = out / "metrics.jsonl"
    rows = [json.loads(line) for line in metrics.read_text().splitlines()] if metrics.exists() else []
    return p.returncode, p.stdout + p.stderr, rows


def processes_with_env(name: str, value: str, wait_s: float = 0.0) -> List[str]:
    """The live processes (``pid: command line``) of this user whose environment has ``name=value``, and the live
    ranks of this process's rank server (a rank forked from it carries the server's environment as the kernel shows
    it; tests of one process run one at a time, so between runs it has none); polls up to ``wait_s`` seconds for
    them to go."""
    marker = f"{name}={value}".encode()
    deadline = time.monotonic() + wait_s
    while True:
        server = _SERVER.get("server")
        found = [f"{pid}: (forked by the rank server)" for pid in server.children()] if server is not None else []
        for pid in (p for p in os.listdir("/proc") if p.isdigit()):
            try:
                with open(f"/proc/{pid}/environ", "rb") as f:
                    if marker not in f.read().split(b"\0"):
                        continue
                with open(f"/proc/{pid}/cmdline", "rb") as f:
                    cmd = f.read().replace(b"\0", b" ").decode(errors="replace")
                found.append(f"{pid}: {cmd[:200]}")
            except OSError:  # gone, or not ours
                continue
        if not found or time.monotonic() >= deadline:
            return found
        time.sleep(0.5)


_SHARED: Dict[Tuple[str, ...], Tuple[int, str, List[dict]]] = {}
_SHARED_DIRS: Dict[Tuple[str, ...], Path] = {}


def shared_run(*args: str, timeout: float = 600) -> Tuple[int, str, List[dict]]:
    """``run_bridge`` once per distinct argument list per test session: the reference runs several test files compare
    against (e.g. the demo at ring CP=2) are trained once. Each run writes to its own temporary directory."""
    key = tuple(args)
    if key not in _SHARED:
        tmp = Path(tempfile.mkdtemp(prefix="nemo-longctx-bridge-shared-"))
        atexit.register(shutil.rmtree, tmp, ignore_errors=True)
        _SHARED[key] = run_bridge(tmp, "run", *args, timeout=timeout)
        _SHARED_DIRS[key] = tmp / "run"
    return _SHARED[key]


def shared_dir(*args: str) -> Path:
    """The output directory of ``shared_run(*args)`` (run first)."""
    return _SHARED_DIRS[tuple(args)]
