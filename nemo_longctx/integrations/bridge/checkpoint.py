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
    process dies on ``torch.cuda.set_device`` and the rank then waits forever: measured, a hang); a damaged checkpoint
    Bridge would load (``damaged_checkpoint_problems``).
``damaged_checkpoint_problems(container)``  the iteration directory a run would load -- ``checkpoint.load`` itself
    when it is one, else ``iter_<checkpoint.ckpt_step>``, else the one Bridge's tracker names
    (``latest_train_state.pt``, else Megatron-LM's ``latest_checkpointed_iteration.txt``); the same for
    ``checkpoint.pretrained_checkpoint`` when ``checkpoint.load`` holds none (or under PEFT) -- verified by
    ``checkpoint_integrity`` (every storage file its torch DCP metadata lists, with the bytes it lists): a damaged one
    is named with its key, the file and the newest intact ``iter_*`` beside it, before any rank starts (Bridge would
    load it on every rank and fail there).
``quiet_planned_exit()``  Bridge ends a run stopped by ``train.exit_interval`` (or its other exit conditions) with
    ``sys.exit(0)`` inside ``pretrain``, whose handler logs that as "Pretrain failed ... SystemExit: 0" with a
    traceback on every rank; that one record is dropped (the exit itself, its cleanup and exit code 0 are Bridge's).
"""

from __future__ import annotations

import logging
import os
import re
from typing import Any, List, Optional, Set, Tuple

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
    out += damaged_checkpoint_problems(container)
    if save is not None and (getattr(c, "save_interval", None) or 0) > 0:  # where it saves: a real write probe
        from nemo_longctx.shared.path_checks import writable_dir_problem

        out += [m for m in [writable_dir_problem("checkpoint.save", str(save))] if m]
    if cuda is None:
        import torch

        cuda = torch.cuda.is_available()
    if getattr(c, "async_save", False) and save is not None and not cuda:
        out.append("checkpoint.async_save=true: Megatron-core's async checkpoint worker is a new process that calls "
                   "torch.cuda.set_device(rank % torch.cuda.device_count()) (dist_checkpointing/strategies/"
                   "async_utils.py:565): without a GPU it dies and the rank waits for it forever (CPU only; "
                   "checkpoint.async_save=false saves synchronously)")
    return out


def _iteration_to_load(path: str, ckpt_step: Optional[int]) -> Tuple[Optional[str], str]:
    """(the iteration directory Bridge loads from ``path`` or None, what chose it), by Bridge's own rule
    (``checkpointing._resolve_checkpoint_iteration``). A tracker file that cannot be read is a ``ValueError``."""
    from megatron.bridge.training.utils.checkpoint_utils import (TRACKER_PREFIX, get_checkpoint_name,
                                                                 get_checkpoint_tracker_filename,
                                                                 get_checkpoint_train_state_filename,
                                                                 is_checkpoint_iteration_directory, read_train_state)

    if is_checkpoint_iteration_directory(path):
        return path, "an iteration directory itself"
    if ckpt_step is not None:
        return get_checkpoint_name(path, int(ckpt_step), release=False), f"checkpoint.ckpt_step={ckpt_step}"
    tracker = get_checkpoint_train_state_filename(path, prefix=TRACKER_PREFIX)
    if os.path.isfile(tracker):
        try:
            step = int(read_train_state(tracker).step)
        except Exception as e:  # a truncated torch file: Bridge raises on every rank
            raise ValueError(f"{os.path.basename(tracker)} cannot be read ({type(e).__name__}: "
                             f"{str(e).strip().splitlines()[0][:160] if str(e).strip() else ''})") from e
        return get_checkpoint_name(path, step, release=False), f"named by {os.path.basename(tracker)}"
    legacy = get_checkpoint_tracker_filename(path)
    if os.path.isfile(legacy):
        text = open(legacy).read().strip()
        if text == "release":
            return get_checkpoint_name(path, 0, release=True), f"named by {os.path.basename(legacy)}"
        if not text.isdigit():
            raise ValueError(f"{os.path.basename(legacy)} holds {text[:40]!r}, not an iteration number")
        return get_checkpoint_name(path, int(text), release=False), f"named by {os.path.basename(legacy)}"
    return None, ""


def newest_intact_iteration(path: str, but: str = "") -> Optional[str]:
    """The newest ``iter_*`` directory of ``path`` (other than ``but``) that ``checkpoint_problem`` passes, or None."""
    from nemo_longctx.shared.checkpoint_integrity import checkpoint_problem

    names = [n for n in os.listdir(path) if re.fullmatch(r"iter_\d+", n) and os.path.isdir(os.path.join(path, n))]
    for name in sorted(names, key=lambda n: int(n[5:]), reverse=True):
        d = os.path.join(path, name)
        if os.path.abspath(d) != os.path.abspath(but or "/nonexistent") and checkpoint_problem(d) is None:
            return d
    return None


def damaged_checkpoint_problems(container: Any) -> List[str]:
    """The checkpoints this run would load, verified before any rank starts: ``checkpoint.load`` when it holds one,
    ``checkpoint.pretrained_checkpoint`` (a Bridge checkpoint, not an HF directory) when ``checkpoint.load`` holds none
    or under PEFT (whose pre-wrap hook loads it first, ignoring ``checkpoint.ckpt_step``). One problem per damaged one,
    naming the key, the iteration directory and the file. Global or local non-persistent checkpoints
    (``checkpoint.non_persistent_ckpt_type``) are Bridge's to choose and are not checked here."""
    from megatron.bridge.training.utils.checkpoint_utils import checkpoint_exists, is_hf_checkpoint_dir

    c = container.checkpoint
    if getattr(c, "non_persistent_ckpt_type", None) is not None:
        return []
    load, pre = c.load, getattr(c, "pretrained_checkpoint", None)
    step, peft = getattr(c, "ckpt_step", None), getattr(container, "peft", None) is not None
    targets = []
    resumes = load is not None and checkpoint_exists(str(load))
    if resumes:
        targets.append(("checkpoint.load", str(load), step))
    if pre is not None and (peft or not resumes) and checkpoint_exists(str(pre)) and not is_hf_checkpoint_dir(str(pre)):
        targets.append(("checkpoint.pretrained_checkpoint", str(pre), None if peft else step))
    return [m for key, path, s in targets for m in [_damaged(key, path, s)] if m]


def _damaged(key: str, path: str, step: Optional[int]) -> Optional[str]:
    """The problem of the iteration directory Bridge loads from ``path`` (``key``'s value), or None."""
    from nemo_longctx.shared.checkpoint_integrity import checkpoint_problem

    try:
        it, how = _iteration_to_load(path, step)
    except ValueError as e:
        return f"{key}={path}: {e}; Bridge would fail reading it on every rank"
    if it is None or not os.path.isdir(it):
        return None  # a missing iter_<ckpt_step> is checkpoint_problems' to name; a missing tracker target, Bridge's
    why = checkpoint_problem(it)
    if why is None:
        return None
    name = os.path.basename(os.path.normpath(it))
    if os.path.abspath(it) == os.path.abspath(path):
        msg = f"{key}={path}: this checkpoint is damaged: {why}"
    else:
        msg = f"{key}={path}: {name} ({how}), the checkpoint it would load, is damaged: {name}/{why}"
    base = os.path.dirname(os.path.abspath(it))
    intact = newest_intact_iteration(base, but=it)
    if intact is not None and key == "checkpoint.load" and os.path.abspath(base) == os.path.abspath(path):
        msg += (f"; the newest intact one is {os.path.basename(intact)}: add checkpoint.ckpt_step="
                f"{int(os.path.basename(intact)[5:])} to resume from it")
    elif intact is not None:
        msg += f"; the newest intact checkpoint beside it: {intact}"
    return msg


class _PlannedExit(logging.Filter):
    def filter(self, record: logging.LogRecord) -> bool:
        exc = record.exc_info[1] if record.exc_info else None
        return not (isinstance(exc, SystemExit) and exc.code in (0, None))


def quiet_planned_exit() -> None:
    log = logging.getLogger("megatron.bridge.training.pretrain")
    if not any(isinstance(f, _PlannedExit) for f in log.filters):
        log.addFilter(_PlannedExit())
