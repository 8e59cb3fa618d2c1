"""The NeMo 2 app's checkpoints, verified before one is loaded (no NeMo import: the launching process runs this).

``newest_intact(directory, unfinished)``  ``checkpoint.resume=auto``'s choice: the newest checkpoint of the directory
    that is finished (no ``<name>-unfinished`` marker: NeMo's ModelCheckpoint removes it once every rank has written)
    and whole (``checkpoint_integrity.checkpoint_problem``), with the name and reason of every one skipped. Newest =
    the highest ``step=N`` in the name, NeMo's ``-last`` copy first on a tie, then the newest mtime; only the
    checkpoints newer than the one chosen are verified (each check reads its ``.metadata`` and stats its files).
``resume_problems(resume)``  ``checkpoint.resume=<path>`` to a damaged checkpoint: one line naming the key, the path,
    the reason and the newest intact checkpoint beside it; refused before any rank starts (``RunSpec.key_problems``).
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any, Callable, List, Optional, Tuple

from nemo_longctx.shared.app_keys import RESUME_MODES
from nemo_longctx.shared.checkpoint_integrity import NEMO_WEIGHTS, checkpoint_problem
from nemo_longctx.shared.path_checks import is_checkpoint, newest_first, unfinished_marker

def newest_intact(directory: str, unfinished: Optional[Callable[[Any], bool]] = None
                  ) -> Tuple[Optional[Path], List[Tuple[str, str]]]:
    """(the newest finished and intact checkpoint directory of ``directory`` or None, [(name, why skipped)]: every
    unfinished one, and every damaged one newer than the one chosen). ``unfinished``: the marker test (default: NeMo's
    rule, ``unfinished_marker``)."""
    unfinished = unfinished or unfinished_marker
    candidates, skipped = [], []
    for d in sorted(Path(directory).iterdir()):
        if not d.is_dir():
            continue
        if unfinished(d):
            skipped.append((d.name, "unfinished (its save was cut off)"))
        else:
            candidates.append(d)
    for d in sorted(candidates, key=newest_first, reverse=True):
        why = checkpoint_problem(str(d))
        if why is None:
            return d, skipped
        skipped.append((d.name, f"damaged ({why})"))
    return None, skipped


def resume_problems(resume: Any) -> List[str]:
    """``checkpoint.resume=<path>`` naming a checkpoint that is damaged (a storage file shorter than its metadata says,
    a metadata file missing or unreadable): one line naming the key, the path and why, plus the newest intact
    checkpoint beside it. A path that is not a directory, or a directory that is not a checkpoint (a folder of
    them, or none: ``path_checks.checkpoint_folder_hint``), is ``RunSpec.resume_problems``' to name; auto/never have
    nothing to check here (auto verifies as it chooses). ``resume``: the value of ``checkpoint.resume``."""
    if not isinstance(resume, str) or not resume or resume in RESUME_MODES:
        return []
    path = Path(os.path.abspath(os.path.expanduser(resume)))
    if not path.is_dir() or not is_checkpoint(path):
        return []
    why = checkpoint_problem(str(path))
    if why is None:
        return []
    msg = f"checkpoint.resume={resume}: this checkpoint is damaged: {why}"
    newest, _ = newest_intact(str(path.parent.parent if path.name == NEMO_WEIGHTS else path.parent))
    if newest is not None:
        msg += f"; the newest intact checkpoint beside it: {newest}"
    return [msg]
