"""``python -m nemo_longctx.shared.reaper TOKEN``: the local launcher's reaper (``launch._Reaper``; standard library
only).

Blocks until its stdin reaches EOF -- the launcher closed the pipe at its end, or the kernel did because the launcher
died, a SIGKILL included -- then SIGKILLs every process whose environment carries ``NEMO_LONGCTX_RUN_TOKEN=TOKEN``
(the ranks and whatever they started: checkpoint writers, their resource trackers), until none is left.
"""

from __future__ import annotations

import os
import signal
import sys
import time

RUN_TOKEN_VAR = "NEMO_LONGCTX_RUN_TOKEN"


def carriers(token: str) -> list:
    """Pids of the live processes (this one excepted) whose environment holds ``RUN_TOKEN_VAR=token``."""
    mark = f"{RUN_TOKEN_VAR}={token}".encode()
    found = []
    for entry in os.listdir("/proc"):
        if not entry.isdigit() or int(entry) == os.getpid():
            continue
        try:
            with open(f"/proc/{entry}/environ", "rb") as f:
                if mark in f.read().split(b"\0"):
                    found.append(int(entry))
        except OSError:
            pass
    return found


def sweep(token: str, rounds: int = 50) -> int:
    """SIGKILL the carriers of ``token`` until none is left (a dying rank may still start one); how many were killed."""
    killed = set()
    for _ in range(rounds):
        found = carriers(token)
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
    sweep(sys.argv[1])
