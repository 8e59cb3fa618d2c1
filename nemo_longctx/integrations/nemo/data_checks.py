"""Config-level checks of the ``data`` group (no torch, no NeMo import): what the launching process can know before
any rank starts and before any tokenizer or model is read -- the data kind, packing against the micro batch, the
files each kind reads, and that the tokenizer is on this machine (a hub id that is not in the local cache would make
every rank retry the hub, offline, for minutes)."""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any, List, Optional

from nemo_longctx.shared.run_spec import RunSpec

DATA_KINDS = ("synthetic", "indexed", "documents", "packed_sft")
PACKING_MODES = ("none", "documents")


def packing_problems(packing: Any, micro_batch_size: Any) -> List[str]:
    if packing not in PACKING_MODES:
        return [f"data.packing={packing!r} must be one of {list(PACKING_MODES)}"]
    if packing == "documents" and micro_batch_size != 1:
        return [f"data.packing=documents needs trainer.micro_batch_size=1 (got {micro_batch_size}): a packed "
                "sequence is one row of documents"]
    return []


def _is_weight(text: str) -> bool:
    try:
        float(text)
        return True
    except ValueError:
        return False


def tokenizer_problems(tokenizer: Optional[str], init_from: Optional[str], key: str = "data.tokenizer") -> List[str]:
    """A tokenizer that is a local directory, a Hugging Face id already in the local cache, or (null) the one
    ``init_from``'s checkpoint carries."""
    if tokenizer in (None, ""):
        if init_from in (None, ""):
            return [f"{key}=null needs init_from (whose checkpoint holds the tokenizer): set {key}=<local Hugging "
                    "Face tokenizer directory> or init_from=<checkpoint or HF model dir>"]
        return []
    if Path(str(tokenizer)).is_dir():
        return []
    if str(tokenizer).startswith(("/", ".", "~")) or os.sep + os.sep in str(tokenizer):
        return [f"{key}={tokenizer}: no such directory"]
    if _in_hf_cache(str(tokenizer)):
        return []
    return [f"{key}={tokenizer}: not a local directory, and not in the Hugging Face cache of this machine "
            f"(HF_HOME); download it first (huggingface-cli download {tokenizer} --include 'tokenizer*') or pass "
            "the directory"]


def _in_hf_cache(repo_id: str) -> bool:
    try:
        from huggingface_hub import try_to_load_from_cache
    except ImportError:  # pragma: no cover - huggingface_hub comes with NeMo
        return False
    for name in ("tokenizer_config.json", "tokenizer.json", "tokenizer.model"):
        try:
            if isinstance(try_to_load_from_cache(repo_id, name), str):
                return True
        except Exception:  # an id the hub client refuses (bad characters): not cached
            return False
    return False


def data_problems(spec: RunSpec) -> List[str]:
    """Every config-level problem of the ``data`` group, each naming its key."""
    data, memory = spec.data, spec.options.memory
    kind = data.kind
    if kind not in DATA_KINDS:
        return [f"data.kind={kind!r} must be one of {list(DATA_KINDS)} (choose a data group: data=synthetic|"
                "indexed|documents|packed_sft)"]
    mbs = spec.trainer.micro_batch_size
    init_from = spec.init_from.path
    if kind == "packed_sft":
        p = [] if mbs == 1 else [f"data=packed_sft needs trainer.micro_batch_size=1 (got {mbs}): a packed "
                                 "sequence is one row of documents"]
        for key in ("packed_train", "packed_val"):
            path = None if data.absent(key) else str(getattr(data, key))
            if path is None or not path.endswith(".npy") or not os.path.isfile(path):
                p.append(f"data.{key}={path!r} must be an existing packed .npy file (NeMo's "
                         "prepare_packed_sequence_data output)")
        tok = None if data.absent("tokenizer") else str(data.tokenizer)
        return p + memory.packed_problems("data=packed_sft") + tokenizer_problems(tok, init_from)
    p = packing_problems(data.packing, mbs)
    if data.packing == "documents":
        p += memory.packed_problems("data.packing=documents")
    if kind == "documents":
        from nemo_longctx.integrations.nemo.documents import documents_problems

        return p + documents_problems(spec)
    if kind == "indexed":
        if data.absent("paths"):
            p.append("data=indexed needs data.paths: the .bin/.idx prefixes of Megatron indexed datasets "
                     "(data.paths=[/data/corpus_text_document]; nemo-longctx's data=documents writes them from JSONL)")
        else:
            for prefix in data.path_list:
                if _is_weight(prefix):  # a blend: [weight, prefix, weight, prefix, ...]
                    continue
                absent = [ext for ext in (".bin", ".idx") if not os.path.isfile(prefix + ext)]
                if absent:
                    p.append(f"data.paths: {prefix} has no {' / '.join(prefix + e for e in absent)} (a Megatron "
                             "indexed dataset is a .bin/.idx pair; give the prefix without the extension)")
        tok = None if data.absent("tokenizer") else str(data.tokenizer)
        p += tokenizer_problems(tok, init_from)
    return p
