"""Python's cyclic garbage collector during a process's start-up: paused while the frameworks import, then back on.

Importing NeMo, Megatron-core and Lightning creates ~1M long-lived objects; with the collector on, each import keeps
triggering collections that traverse them again (a quarter of the import time of a rank), and a library's own
``gc.collect()`` at exit traverses them once more (leptonai's atexit handler: ~1.5 s per rank). So an app pauses the
collector at its entry and resumes it where the work starts (before the training loop, before the launcher starts its
ranks): one collection then frees what was made meanwhile (nothing is kept that a collection would free), the
survivors -- modules, classes, the built model's objects -- are frozen out of every later collection's traversal
(``gc.freeze``), and the collector is on again for the rest of the process.
"""

from __future__ import annotations

import gc

_STATE = {"paused": False}


def pause() -> None:
    """Turn the collector off until ``resume`` (at a process's entry, before the heavy imports)."""
    if gc.isenabled():
        gc.disable()
        _STATE["paused"] = True


def resume() -> None:
    """After ``pause``: one collection, the survivors frozen, the collector on again; otherwise nothing."""
    if not _STATE["paused"]:
        return
    _STATE["paused"] = False
    gc.collect()
    gc.freeze()
    gc.enable()
