"""Megatron-Bridge's own checkpointing through ``nemo-longctx bridge`` (no second mechanism: Bridge's ``checkpoint.*``
and ``train.*`` keys, passed as Bridge overrides, drive Bridge's ``save_checkpoint`` / ``load_checkpoint``).

Save every N steps and stop after step K with the same schedule as an uninterrupted run (same ``train.train_iters``)::

    nemo-longctx bridge train.train_iters=6 checkpoint.save=/ckpt checkpoint.save_interval=3 train.exit_interval=3
    nemo-longctx bridge train.train_iters=6 checkpoint.load=/ckpt cp=ulysses        # steps 4..6

A Bridge checkpoint (``torch_dist``) is resharded on load: resuming at another CP algorithm or CP size (another world
size) works (``tests_bridge/test_bridge_checkpoint.py``).

``checkpoint_problems(container, bridge_overrides)``  the launching process's checks (before any rank starts), each
    naming its key: an explicit ``checkpoint.load`` with no Bridge checkpoint (Bridge would silently start from step 0;
    ``checkpoint.load`` equal to ``checkpoint.save`` is the resume-if-present pattern and is left alone), a missing
    ``checkpoint.pretrained_checkpoint`` (Bridge asserts on every rank), a ``checkpoint.ckpt_step`` without its
    ``iter_*`` directory (Bridge raises on every rank); without CUDA, ``checkpoint.async_save=true`` (its worker
    process dies on ``torch.cuda.set_device`` and the rank then waits forever: measured, a hang).
``quiet_planned_exit()``  Bridge ends a run stopped by ``train.exit_interval`` (or its other exit conditions) with
    ``sys.exit(0)`` inside ``pretrain``, whose handler logs that as "Pretrain failed ... SystemExit: 0" with a
    traceback on every rank; that one record is dropped (the exit itself, its cleanup and exit code 0 are Bridge's).
"""

from __future__ import annotations

import logging
import os
from typing import Any, List, Optional, Set

_EXPLICIT = ("checkpoint.load", "checkpoint.pretrained_checkpoint", "checkpoint.ckpt_step")


def override_keys(bridge_overrides: List[str]) -> Set[str]:
    """The keys the Bridge overrides set (``+key=``, ``++key=`` included; ``~key`` deletions are not settings)."""
    return {a.lstrip("+").split("=", 1)[0] for a in bridge_overrides if "=" in a and not a.startswith("~")}


def _no_checkpoint(path: str) -> Optional[str]:
    """Why ``path`` holds no checkpoint Bridge would load (None: it holds one), by Bridge's own test."""
    from megatron.bridge.training.utils.checkpoint_utils import checkpoint_exists, is_hf_checkpoint_dir

    if checkpoint_exists(path) or is_hf_checkpoint_dir(path):
        return None
    if not os.path.exists(path):
        return "no such directory"
    return ("a directory without a Bridge checkpoint (no latest_train_state.pt / latest_checkpointed_iteration.txt, "
            "not an iter_* directory)")


def checkpoint_problems(container: Any, bridge_overrides: List[str], cuda: Optional[bool] = None) -> List[str]:
    """Every problem of the container's explicit checkpoint sources and of its saving, each naming its key
    (``cuda``: whether CUDA is available; default: ask torch)."""
    c = container.checkpoint
    keys = override_keys(bridge_overrides)
    out = []
    load, save = c.load, c.save
    if "checkpoint.load" in keys and load is not None:
        same_as_save = save is not None and os.path.abspath(str(load)) == os.path.abspath(str(save))
        why = None if same_as_save else _no_checkpoint(str(load))
        if why is not None:
            out.append(f"checkpoint.load={load}: {why}; Bridge would not resume but start from step 0. Point it at "
                       "the directory a run's checkpoint.save wrote (or set checkpoint.load to checkpoint.save's "
                       "directory to resume only when a checkpoint exists there)")
        elif c.ckpt_step is not None and "checkpoint.ckpt_step" in keys and not same_as_save:
            from megatron.bridge.training.utils.checkpoint_utils import (get_checkpoint_name,
                                                                         is_checkpoint_iteration_directory)

            it = get_checkpoint_name(str(load), int(c.ckpt_step), release=False)
            if not is_checkpoint_iteration_directory(str(load)) and not os.path.isdir(it):
                out.append(f"checkpoint.ckpt_step={c.ckpt_step}: no {it} (checkpoint.load={load})")
    pre = getattr(c, "pretrained_checkpoint", None)
    if "checkpoint.pretrained_checkpoint" in keys and pre is not None and not os.path.exists(str(pre)):
        out.append(f"checkpoint.pretrained_checkpoint={pre}: no such file or directory")
    if cuda is None:
        import torch

        cuda = torch.cuda.is_available()
    if getattr(c, "async_save", False) and save is not None and not cuda:
        out.append("checkpoint.async_save=true: Megatron-core's async checkpoint worker is a new process that calls "
                   "torch.cuda.set_device(rank % torch.cuda.device_count()) (dist_checkpointing/strategies/"
                   "async_utils.py:565): without a GPU it dies and the rank waits for it forever (CPU only; "
                   "checkpoint.async_save=false saves synchronously)")
    return out


class _PlannedExit(logging.Filter):
    def filter(self, record: logging.LogRecord) -> bool:
        exc = record.exc_info[1] if record.exc_info else None
        return not (isinstance(exc, SystemExit) and exc.code in (0, None))


def quiet_planned_exit() -> None:
    log = logging.getLogger("megatron.bridge.training.pretrain")
    if not any(isinstance(f, _PlannedExit) for f in log.filters):
        log.addFilter(_PlannedExit())
