"""Where a run writes, checked before it starts (plain Python: no torch, no NeMo; both front ends' preflight).

``writable_dir_problem(key, path)``   the directory exists or can be created, and a file can be written in it: a real
                                      probe (a temporary directory made and removed in the nearest existing folder),
                                      so a read-only mount, a path through a file or missing permissions are named
                                      before the first step instead of at the first save
``free_space_problem(key, path, need)`` the filesystem holding ``path`` has ``need`` bytes free
``checkpoint_folder_hint(path)``      for a ``resume`` directory that is not a checkpoint, why: the folder holding
                                      checkpoints (naming the newest inside it) or a directory without one
"""

from __future__ import annotations

import os
import re
import shutil
import tempfile
from pathlib import Path
from typing import Optional

_STEP = re.compile(r"step=(\d+)")
UNFINISHED_SUFFIX = "-unfinished"  # nemo.lightning.pytorch.callbacks.ModelCheckpoint.UNFINISHED_CHECKPOINT_SUFFIX


def unfinished_marker(path: Path) -> bool:
    """NeMo's test (``ModelCheckpoint.is_checkpoint_unfinished``: a ``<name>-unfinished`` file beside the checkpoint
    until every rank has written it) without importing NeMo."""
    return Path(str(path) + UNFINISHED_SUFFIX).exists()


def newest_first(d: Path) -> tuple:
    """Sort key of checkpoint directories, newest largest: the highest ``step=N`` in the name, NeMo's ``-last`` copy
    first on a tie, then the newest mtime."""
    m = _STEP.search(d.name)
    return (int(m.group(1)) if m else -1), d.name.endswith("-last"), d.stat().st_mtime


def _existing_ancestor(path: Path) -> Path:
    p = path
    while not p.exists() and p != p.parent:
        p = p.parent
    return p


def writable_dir_problem(key: str, path: str) -> Optional[str]:
    """None when ``path`` is (or can be made) a directory this process can write in, else one line naming ``key``."""
    p = Path(os.path.abspath(os.path.expanduser(str(path))))
    if p.exists() and not p.is_dir():
        return f"{key}={path}: is a file, not a directory"
    base = _existing_ancestor(p)
    if not base.is_dir():
        return f"{key}={path}: cannot be created: {base} is a file, not a directory"
    try:
        probe = tempfile.mkdtemp(prefix=".nemo-longctx-probe-", dir=base)
        try:
            with open(os.path.join(probe, "probe"), "wb") as f:
                f.write(b"0")
        finally:
            shutil.rmtree(probe, ignore_errors=True)
    except OSError as e:
        what = "is not writable" if p.exists() else f"cannot be created in {base}"
        return f"{key}={path}: {what} ({e.strerror or e})"
    return None


def free_bytes(path: str) -> int:
    return shutil.disk_usage(_existing_ancestor(Path(os.path.abspath(str(path))))).free


def free_space_problem(key: str, path: str, need: float, what: str) -> Optional[str]:
    """None when the filesystem of ``path`` has ``need`` bytes free, else one line naming ``key`` and ``what`` needs
    them."""
    free = free_bytes(path)
    if free >= need:
        return None
    return (f"{key}={path}: {gb(free)} free on its filesystem, {what} need about {gb(need)}: free space, point it "
            "elsewhere, or lower checkpoint.keep")


def gb(n: float) -> str:
    return f"{n / 1e9:,.0f} GB" if n >= 1e11 else f"{n / 1e9:.3g} GB"


def is_checkpoint(path: Path) -> bool:
    """A NeMo 2 / Megatron distributed checkpoint directory (its weights or its torch_dist metadata inside)."""
    return (path / "weights").is_dir() or (path / "metadata.json").is_file() or (path / ".metadata").is_file()


def checkpoint_folder_hint(path: str) -> Optional[str]:
    """For a directory that is not a checkpoint, why (None for a checkpoint): the folder holding checkpoints ("name
    one of them (the newest: <path>) or auto"), or a directory without one."""
    p = Path(path)
    if not p.is_dir() or is_checkpoint(p):
        return None
    inner = [d for d in p.iterdir() if d.is_dir() and is_checkpoint(d) and not unfinished_marker(d)]
    if not inner:
        return "is a directory but not a checkpoint (no weights/ or distributed-checkpoint metadata inside)"
    newest = max(inner, key=newest_first)
    return (f"is the folder that holds checkpoints, not a checkpoint: name one of them (the newest: {newest}), or "
            "use checkpoint.resume=auto with checkpoint.dir set to this folder")


def tree_bytes(path: str) -> int:
    """Bytes of the files under ``path`` (0 when it does not exist)."""
    total = 0
    for root, _, files in os.walk(path):
        for f in files:
            try:
                total += os.lstat(os.path.join(root, f)).st_size
            except OSError:
                pass
    return total
