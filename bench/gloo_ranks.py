"""Run a bench body on N local gloo processes (CPU) and return rank 0's result.

The bench scripts run as ``python bench/<name>.py``, so ``bench/`` is on ``sys.path`` (and the spawned ranks get
the parent's ``sys.path``): ``from gloo_ranks import run_ranks``. ``fn`` must be a module-level function of the
script (the spawn context pickles it by name; the ranks re-import the script as ``__mp_main__``).

The ranks meet in a file (torch's FileStore in a temporary directory), not on a TCP port: a port found free and
then bound by rank 0 can be taken in between by another process. Each rank reports ``(rank, ok, value or
traceback)``; the parent raises on the first failure (or on a rank that exits without reporting), so a failed rank
does not leave it waiting out the timeout, and it joins the ranks, terminating those still alive.
"""

from __future__ import annotations

import os
import queue as queue_mod
import shutil
import tempfile
import time
import traceback
from typing import Any, Callable, Optional

import torch
import torch.distributed as dist
import torch.multiprocessing as mp


def _rank(rank: int, world: int, store: str, fn: Callable, args: tuple, threads: int, results) -> None:
    try:
        torch.set_num_threads(threads)
        dist.init_process_group("gloo", init_method=f"file://{store}", rank=rank, world_size=world)
        try:
            value = fn(rank, world, *args)
        finally:
            dist.destroy_process_group()
        results.put((rank, True, value if rank == 0 else None))  # only rank 0's value travels
    except BaseException:  # noqa: BLE001 - every failure goes to the parent, with its traceback
        results.put((rank, False, traceback.format_exc()))


def run_ranks(fn: Callable, world: int, *args: Any, threads: int = 1, timeout: Optional[float] = 3600) -> Any:
    """Run ``fn(rank, world, *args)`` on ``world`` spawned gloo ranks of ``threads`` threads each; return rank 0's
    return value. A rank's exception is re-raised here (``RuntimeError`` carrying that rank's traceback);
    ``timeout`` (seconds, ``None``: no limit) bounds the wait for all the ranks' reports."""
    ctx = mp.get_context("spawn")
    results = ctx.Queue()
    store_dir = tempfile.mkdtemp(prefix="bench_gloo_")
    store = os.path.join(store_dir, "store")
    procs = [ctx.Process(target=_rank, args=(r, world, store, fn, args, threads, results)) for r in range(world)]
    deadline = None if timeout is None else time.monotonic() + timeout
    failure = None
    value = None
    finished = False  # every rank reported success (else: do not wait long for the others)
    try:
        for p in procs:
            p.start()
        pending = set(range(world))
        while pending and failure is None:
            try:
                rank, ok, payload = results.get(timeout=1.0)
            except queue_mod.Empty:
                # a rank that died without a report (killed, segfault) would otherwise leave us waiting
                dead = [r for r in sorted(pending) if procs[r].exitcode not in (None, 0)]
                if dead:
                    failure = f"rank {dead[0]} exited with code {procs[dead[0]].exitcode} without a result"
                elif deadline is not None and time.monotonic() > deadline:
                    failure = f"ranks {sorted(pending)} gave no result within {timeout} s"
                continue
            pending.discard(rank)
            if not ok:
                failure = f"rank {rank} failed:\n{payload}"
            elif rank == 0:
                value = payload
        finished = failure is None
    finally:
        for p in procs:
            if p.pid is None:  # never started
                continue
            p.join(timeout=60 if finished else 5)
            if p.is_alive():
                p.terminate()
                p.join(timeout=5)
            if p.is_alive():
                p.kill()
                p.join()
        results.close()
        shutil.rmtree(store_dir, ignore_errors=True)
    if failure is not None:
        raise RuntimeError(failure)
    return value
