"""Run the train app (or any command) in a subprocess with bounded time and memory, from the repository root."""

from __future__ import annotations

import os
import shlex
import subprocess
from pathlib import Path
from typing import Sequence, Tuple

ROOT = Path(__file__).resolve().parents[1]
MEMORY_LIMIT_KB = 8_000_000


def run_app(cmd: Sequence[str], timeout: float = 400) -> Tuple[int, str]:
    """Run ``cmd`` under ``ulimit -v`` with PYTHONUNBUFFERED; return (returncode, stdout + stderr); 124 and the output
    so far when it runs past ``timeout`` (the ranks of a local launch die with it: PR_SET_PDEATHSIG)."""
    shell = f"ulimit -v {MEMORY_LIMIT_KB}; exec {' '.join(shlex.quote(str(c)) for c in cmd)}"
    try:
        p = subprocess.run(["bash", "-c", shell], cwd=ROOT, capture_output=True, text=True, timeout=timeout,
                           env={**os.environ, "PYTHONUNBUFFERED": "1"})
    except subprocess.TimeoutExpired as e:  # the output so far, for the assertion message (the process was killed)
        def text(b):
            return b.decode(errors="replace") if isinstance(b, bytes) else (b or "")

        return 124, text(e.stdout) + text(e.stderr) + f"\n[app_runner: killed after {timeout} s]"
    return p.returncode, p.stdout + p.stderr


def leftover_processes() -> list:
    """Live processes started by a local launch of the calling test (ranks and everything they started: they carry
    NEMO_LONGCTX_SPAWNED=1 and this test's PYTEST_CURRENT_TEST in their environment), as "pid: command" lines."""
    test = os.environ.get("PYTEST_CURRENT_TEST", "").rsplit(" (", 1)[0]
    found = []
    for proc in Path("/proc").iterdir():
        try:
            env = (proc / "environ").read_bytes().split(b"\0")
            state = next(ln for ln in (proc / "status").read_text().splitlines() if ln.startswith("State:"))
            cmdline = (proc / "cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace")
        except (OSError, StopIteration):
            continue
        ours = f"PYTEST_CURRENT_TEST={test} (".encode()
        if b"NEMO_LONGCTX_SPAWNED=1" in env and any(v.startswith(ours) for v in env) and "zombie" not in state:
            found.append(f"{proc.name}: {cmdline[:200]}")
    return found
