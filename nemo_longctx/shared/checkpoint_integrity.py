"""Is a checkpoint on disk whole? Checked before it is loaded, by both front ends (plain Python + PyTorch: no NeMo,
no Megatron import).

A torch distributed checkpoint (``torch_dist``, what NeMo 2 and Megatron-Bridge save through Megatron-core) is a
directory holding ``.metadata`` (torch DCP's pickled ``Metadata``) and the storage files it lists
(``__<rank>_<n>.distcp``); ``metadata.storage_data`` maps every saved item to ``_StorageInfo(relative_path, offset,
length)``, so the bytes each storage file must hold are known without reading it. Megatron-core adds
``metadata.json`` (the backend, written last: a save that did not finish has none) and, up to 0.15
(``"common_backend"`` in metadata.json), ``common.pt`` (rank 0's non-sharded state, a ``torch.save`` zip; later
versions keep it in the DCP files).

Where that directory is, by layout (as NeMo 2.7 / Megatron-core 0.15 and Megatron-Bridge 0.6 / Megatron-core 0.19
write them):
  * NeMo 2 app checkpoint ``<dir>/step=N-consumed_samples=M[-last]/``: ``weights/`` (``.metadata``, ``__R_N.distcp``,
    ``common.pt``, ``metadata.json``), beside ``context/``;
  * NeMo 2 app checkpoint of Megatron-FSDP (the ``fsdp_dtensor`` format, ``MegatronStrategy._save_fsdp_dtensor_
    checkpoint``): the DCP files (``.metadata``, ``__R_0.distcp``) in the step directory itself, beside ``context/``,
    then ``common.pt`` (NeMo's non-sharded state, a ``torch.save`` written after the DCP save: required);
  * Megatron-Bridge ``<checkpoint.save>/iter_NNNNNNN/``: the iteration directory itself (``.metadata``,
    ``__R_0.distcp``, ``metadata.json``, ``train_state.pt``, ``run_config.yaml``); which iteration a resume loads is
    Bridge's tracker's (``integrations/bridge/checkpoint.py``);
  * the DCP directory itself (``.metadata`` or ``metadata.json`` in it).

``checkpoint_problem(path)`` -> None when the checkpoint is complete, else one short reason naming the file relative to
``path`` ("weights/__0_0.distcp is 1234 bytes, its metadata needs 5678", "weights/.metadata is missing",
"weights/.metadata cannot be read (UnpicklingError: ...)"). It reads only ``.metadata`` (tens of KB) and stats the
storage files: milliseconds, whatever the checkpoint's size.
"""

from __future__ import annotations

import json
import zipfile
from pathlib import Path
from typing import Dict, Optional, Tuple

DCP_METADATA = ".metadata"  # torch.distributed.checkpoint.filesystem._metadata_fn
MCORE_CONFIG = "metadata.json"  # megatron.core.dist_checkpointing.core.CONFIG_FNAME
MCORE_COMMON = "common.pt"  # megatron.core.dist_checkpointing.strategies.common.COMMON_STATE_FNAME
NEMO_WEIGHTS = "weights"  # nemo.lightning.ckpt_utils.WEIGHTS_PATH
BRIDGE_TRAIN_STATE = "train_state.pt"  # megatron.bridge.training.utils.checkpoint_utils.TRAIN_STATE_FILE


def dcp_directory(path: str) -> Tuple[Path, str]:
    """(the directory holding the checkpoint's distributed-checkpoint files, its name relative to ``path`` as a prefix
    for messages: ``"weights/"`` for a NeMo 2 checkpoint, ``""`` when ``path`` is that directory itself)."""
    root = Path(path)
    if (root / DCP_METADATA).exists() or (root / MCORE_CONFIG).exists() or (root / MCORE_COMMON).exists():
        return root, ""
    if (root / NEMO_WEIGHTS).is_dir():
        return root / NEMO_WEIGHTS, NEMO_WEIGHTS + "/"
    if (root / "context").is_dir() and any(root.glob("*.distcp")):  # NeMo 2's fsdp_dtensor layout, .metadata missing
        return root, ""
    if (root / "context").is_dir():
        return root / NEMO_WEIGHTS, NEMO_WEIGHTS + "/"
    return root, ""


def _file_size(p: Path) -> Optional[int]:
    try:
        return p.stat().st_size
    except OSError:
        return None


def _torch_file_problem(p: Path) -> Optional[str]:
    """Why the ``torch.save`` file ``p`` is not whole (None: it is, or it is not a zip this can judge): torch.save
    writes a zip, whose end record is its last bytes, so a file cut short has none."""
    try:
        with open(p, "rb") as f:
            head = f.read(4)
    except OSError as e:
        return f"cannot be read ({e.strerror or e})"
    if head.startswith(b"PK") and not zipfile.is_zipfile(p):
        return f"is cut off ({_file_size(p)} bytes, no zip end record)"
    return None


def _megatron_problem(d: Path, prefix: str) -> Tuple[Optional[str], bool]:
    """(the problem of Megatron-core's own files of a torch_dist checkpoint or None, whether its storage files are
    torch DCP's to check): metadata.json (there and readable; the backend it names), common.pt (whole; there when
    metadata.json names a ``common_backend``: Megatron-core 0.15's format, newer ones keep the common state in the
    DCP files) and, in a Megatron-Bridge iteration directory, train_state.pt (whole)."""
    cfg = d / MCORE_CONFIG
    if not cfg.exists():
        return f"{prefix}{MCORE_CONFIG} is missing (Megatron-core writes it last: the save did not finish)", False
    try:
        config = json.loads(cfg.read_text())
        backend = config.get("sharded_backend")
    except (OSError, ValueError, AttributeError) as e:
        return f"{prefix}{MCORE_CONFIG} cannot be read ({type(e).__name__}: {e})", False
    if config.get("common_backend") is not None and not (d / MCORE_COMMON).exists():  # Megatron-core < 0.16's format
        return f"{prefix}{MCORE_COMMON} is missing", False
    for name in (MCORE_COMMON, BRIDGE_TRAIN_STATE):
        why = _torch_file_problem(d / name) if (d / name).exists() else None
        if why is not None:
            return f"{prefix}{name} {why}", False
    return None, backend in (None, "torch_dist")  # another sharded backend (zarr, ...): no torch DCP files


def checkpoint_problem(path: str) -> Optional[str]:
    """None when the checkpoint at ``path`` is complete: every storage file its torch distributed-checkpoint metadata
    lists exists with at least the bytes (offset + length) the metadata gives it (and, for Megatron-core's format,
    ``metadata.json`` and ``common.pt`` are there and whole). Else one short reason naming the file."""
    root = Path(path)
    if not root.is_dir():
        return "no such directory" if not root.exists() else "not a directory"
    d, prefix = dcp_directory(path)
    if not d.is_dir():
        return f"{prefix.rstrip('/')} is missing"
    if not prefix and (root / "context").is_dir() and not (d / MCORE_CONFIG).exists():
        # NeMo 2's fsdp_dtensor layout: no metadata.json; common.pt is written after the DCP files
        if not (d / MCORE_COMMON).exists():
            return f"{MCORE_COMMON} is missing (NeMo writes it after the distributed checkpoint: the save did not " \
                   "finish)"
        why = _torch_file_problem(d / MCORE_COMMON)
        if why is not None:
            return f"{MCORE_COMMON} {why}"
        megatron = False
    else:
        megatron = bool(prefix) or (d / MCORE_CONFIG).exists() or (d / MCORE_COMMON).exists()
    if megatron:
        why, dcp = _megatron_problem(d, prefix)
        if why is not None or not dcp:
            return why
    meta = d / DCP_METADATA
    if not meta.exists():
        return f"{prefix}{DCP_METADATA} is missing"
    from torch.distributed.checkpoint import FileSystemReader

    try:
        metadata = FileSystemReader(str(d)).read_metadata()
        storage = metadata.storage_data
        needed: Dict[str, int] = {}
        for info in storage.values():
            end = int(info.offset) + int(info.length)
            needed[info.relative_path] = max(needed.get(info.relative_path, 0), end)
    except Exception as e:  # a truncated or foreign pickle: EOFError, UnpicklingError, AttributeError, ...
        text = str(e).strip().splitlines()[0][:160] if str(e).strip() else ""
        return f"{prefix}{DCP_METADATA} cannot be read ({type(e).__name__}{': ' + text if text else ''})"
    for rel in sorted(needed):
        size = _file_size(d / rel)
        if size is None:
            return f"{prefix}{rel} is missing (its metadata lists {needed[rel]} bytes)"
        if size < needed[rel]:
            return f"{prefix}{rel} is {size} bytes, its metadata needs {needed[rel]}"
    return None

