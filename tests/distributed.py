"""Run a function on N gloo processes (CPU) and collect each rank's return value.

One start is slow (and much slower when megatron is imported), so tests pass a function that runs many
cases and returns a list of results; assertions happen in the parent on the returned values, and any
exception in a worker is re-raised in the parent with its traceback.

Ranks start from Python's fork server (one per test process, started at the first job), which has imported torch,
Megatron-core and NeMo once (``PRELOAD``): each rank is a fresh fork of that server, which runs no test code (no
state of earlier jobs or of the test process), and does not pay those imports again (about half the time of the
Megatron-heavy test files).
"""

from __future__ import annotations

import os
import shutil
import sys
import tempfile
import traceback
from typing import Any, Callable, List

import torch
import torch.distributed as dist
import torch.multiprocessing as mp


def _worker(rank: int, world_size: int, store: str, fn: Callable, args: tuple, queue, threads: int) -> None:
    try:
        torch.set_num_threads(threads)
        # the ranks meet in a file (torch's FileStore), not on a TCP port: a port found free and then bound by the
        # first rank can be taken in between by another test process (EADDRINUSE)
        dist.init_process_group("gloo", init_method=f"file://{store}", rank=rank, world_size=world_size)
        try:
            result = fn(rank, world_size, *args)
        finally:
            dist.destroy_process_group()
        queue.put((rank, True, result))
    except BaseException:  # noqa: BLE001 - report everything to the parent
        queue.put((rank, False, traceback.format_exc()))
    # the result is on its way (the queue's feeder thread has written it); then the process ends at once: no module
    # teardown (~1.7 s once Megatron is imported: nemo_longctx/shared/process_exit.py) and no atexit handlers either
    # (NeMo's imports register some, a full garbage collection among them: ~0.6 s per rank; a test rank needs none)
    queue.close()
    queue.join_thread()
    for stream in (sys.stdout, sys.stderr):
        stream.flush()
    os._exit(0)


# what the fork server imports before it forks any rank: the imports the ranks of these tests pay, NeMo's included
# (about 7 s of one core, once per test process instead of once per rank of the jobs that build NeMo's configs; the
# app's own fork server forks its ranks from NeMo imported the same way). Module names only: the server (Python 3.11)
# does not get the test process's sys.path, and it skips a module it cannot import (NeMo on a stack whose PyPI NeMo
# cannot run), leaving it to the ranks that need it.
PRELOAD = ["torch", "torch.distributed", "megatron.core", "megatron.core.transformer.transformer_config",
           "megatron.core.models.gpt", "nemo.collections.llm", "nemo.lightning", "lightning.pytorch",
           "nemo_longctx.attention", "nemo_longctx.integrations.megatron"]


def _context():
    ctx = mp.get_context("forkserver")
    ctx.set_forkserver_preload(PRELOAD)  # (read when the server starts: at the first job of this process)
    return ctx


def run_distributed(fn: Callable, world_size: int, *args: Any, threads: int = 1, timeout: float = 600) -> List[Any]:
    """Run ``fn(rank, world_size, *args)`` on ``world_size`` gloo ranks; return the results by rank."""
    ctx = _context()
    queue = ctx.Queue()
    store_dir = tempfile.mkdtemp(prefix="nemo_longctx_store_")
    store = os.path.join(store_dir, "store")
    procs = [
        ctx.Process(target=_worker, args=(r, world_size, store, fn, args, queue, threads), daemon=True)
        for r in range(world_size)
    ]
    for p in procs:
        p.start()
    results: dict = {}
    errors = []
    try:
        for _ in range(world_size):
            rank, ok, payload = queue.get(timeout=timeout)
            if ok:
                results[rank] = payload
            else:
                errors.append(f"rank {rank} failed:\n{payload}")
                break
    finally:
        for p in procs:
            p.join(timeout=5 if errors else 60)
            if p.is_alive():
                p.kill()
        shutil.rmtree(store_dir, ignore_errors=True)
    if errors:
        raise RuntimeError("\n".join(errors))
    return [results[r] for r in range(world_size)]
