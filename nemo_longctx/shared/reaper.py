"""``python -m nemo_longctx.shared.reaper TOKEN [PID_DIR]``: the local launcher's reaper (``launch._Reaper``; standard
library only).

Blocks until its stdin reaches EOF -- the launcher closed the pipe at its end, or the kernel did because the launcher
died, a SIGKILL included -- then SIGKILLs every process whose environment carries ``NEMO_LONGCTX_RUN_TOKEN=TOKEN``
(whatever the ranks started: checkpoint writers, their resource trackers; and every rank started with the launcher's
environment) and every process in the session of a rank whose pid file is in ``PID_DIR`` (each rank leads its own
session; a rank forked from a fork server shared by many runs was not started with the token), until none is left;
then removes ``PID_DIR``.
"""

from __future__ import annotations

import os
import shutil
import signal
import sys
import time
from typing import List, Optional

RUN_TOKEN_VAR = "NEMO_LONGCTX_RUN_TOKEN"


def proc_stat(pid: int) -> Optional[List[str]]:
    """The fields of ``/proc/<pid>/stat`` after the command name (state, ppid, pgrp, session, ...); None when the
    process is gone."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()
    except (OSError, IndexError):
        return None


def session_of(pid: int) -> int:
    """The session id of process ``pid`` (-1 when it is gone)."""
    stat = proc_stat(pid)
    return int(stat[3]) if stat else -1


def rank_sessions(pid_dir: str) -> set:
    """The session ids of the ranks that wrote their pids to ``pid_dir`` (a rank's session id is its pid, and stays
    that of what it started after it ended); not one whose pid now belongs to a process in another session."""
    sessions = set()
    for name in os.listdir(pid_dir) if pid_dir and os.path.isdir(pid_dir) else ():
        try:
            with open(os.path.join(pid_dir, name)) as f:
                pid = int(f.read().strip())
        except (OSError, ValueError):
            continue
        if session_of(pid) in (pid, -1):
            sessions.add(pid)
    return sessions


def targets(token: str, sessions: set) -> list:
    """Pids of the live (not zombie) processes, this one excepted, whose environment holds ``RUN_TOKEN_VAR=token`` or
    that are in one of ``sessions``."""
    mark = f"{RUN_TOKEN_VAR}={token}".encode()
    found = []
    for entry in os.listdir("/proc"):
        if not entry.isdigit() or int(entry) == os.getpid():
            continue
        stat = proc_stat(int(entry))
        if stat is None or stat[0] == "Z":
            continue
        if int(stat[3]) in sessions:
            found.append(int(entry))
            continue
        try:
            with open(f"/proc/{entry}/environ", "rb") as f:
                if mark in f.read().split(b"\0"):
                    found.append(int(entry))
        except OSError:
            pass
    return found


def sweep(token: str, pid_dir: str = "", rounds: int = 50) -> int:
    """SIGKILL the processes carrying ``token`` and those in the ranks' sessions (``targets``) until none is left (a
    dying rank may still start one); how many were killed."""
    killed = set()
    sessions = rank_sessions(pid_dir)
    for _ in range(rounds):
        found = targets(token, sessions)
        if not found:
            break
        for pid in found:
            try:
                os.kill(pid, signal.SIGKILL)
                killed.add(pid)
            except OSError:
                pass
        time.sleep(0.1)
    return len(killed)


if __name__ == "__main__":
    sys.stdin.buffer.read()
    sweep(sys.argv[1], sys.argv[2] if len(sys.argv) > 2 else "")
    if len(sys.argv) > 2:
        shutil.rmtree(sys.argv[2], ignore_errors=True)
