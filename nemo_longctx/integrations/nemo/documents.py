"""``data=documents``: raw text documents -> a Megatron indexed dataset -> NeMo's ``PreTrainingDataModule``.

Sources (``data.paths``): JSONL files (one JSON object per line, the document in ``data.text_key``, default ``text``)
and directories (every ``*.jsonl``/``*.json`` file in them read the same way, every ``*.txt`` file one document),
read in sorted order. Each document is tokenized with a Hugging Face tokenizer from a local directory through NeMo's
``AutoTokenizer`` (``data.tokenizer``; null: the tokenizer of ``init_from``'s checkpoint) and written with Megatron's
own ``IndexedDatasetBuilder`` (``add_document`` + EOD, as Megatron's ``preprocess_data.py --append-eod`` does).
Megatron's ``GPTDataset`` (inside NeMo's ``PreTrainingDataModule``) then cuts the token stream into samples of
``model.seq_length``: shorter documents are concatenated (EOD between them), longer ones are split over samples.
(Per-document attention over the concatenation is ``data.packing=documents``.)

The dataset is written once, before any rank starts (rank 0; the others wait), into
``<data.cache_dir or output_dir/data>/documents-<key>`` where the key hashes the sources (paths, sizes, mtimes), the
text key and the tokenizer files: a later run with the same inputs reuses it, changed inputs get a new one.
"""

from __future__ import annotations

import hashlib
import json
import os
import time
from pathlib import Path
from typing import Iterator, List, Optional, Tuple

from nemo_longctx.options import raise_problems
from nemo_longctx.shared.run_spec import RunSpec
from nemo_longctx.shared.progress import Progress, wait_for

PREFIX_NAME = "documents_text_document"
DONE = "done.json"


def source_files(paths: List[str]) -> List[Path]:
    out: List[Path] = []
    for p in map(Path, paths):
        if p.is_dir():
            out += sorted(f for f in p.rglob("*") if f.is_file() and f.suffix in (".jsonl", ".json", ".txt"))
        else:
            out.append(p)
    return out


def documents_problems(spec: RunSpec) -> List[str]:
    """Config-level problems of ``data=documents`` (each naming its field)."""
    data = spec.data
    if str(data.kind) != "documents":
        return []
    problems = []
    paths = data.paths
    if paths is None or "paths" in data.missing:
        return ["data.paths must list JSONL files or directories of documents (data.paths=[/data/docs.jsonl])"]
    paths = [paths] if isinstance(paths, str) else list(paths)
    for p in paths:
        if not Path(str(p)).exists():
            problems.append(f"data.paths: {p} does not exist")
    if not problems and not source_files([str(p) for p in paths]):
        problems.append(f"data.paths={paths}: no .jsonl/.json/.txt files found")
    if data.tokenizer is None and spec.init_from.path is None:
        problems.append("data.tokenizer must name a local Hugging Face tokenizer directory (or set init_from: its "
                        "checkpoint's tokenizer is used)")
    elif data.tokenizer is not None and not Path(str(data.tokenizer)).is_dir():
        problems.append(f"data.tokenizer={data.tokenizer} is not a local tokenizer directory")
    return problems


def tokenizer_dir(spec: RunSpec) -> Path:
    """``data.tokenizer``, else the tokenizer saved in init_from's checkpoint context (NeMo's ``nemo_tokenizer``)."""
    if spec.data.tokenizer is not None:
        return Path(str(spec.data.tokenizer))
    from nemo_longctx.integrations.nemo.pretrained import checkpoint_path

    return checkpoint_path(spec) / "context" / "nemo_tokenizer"


def dataset_dir(spec: RunSpec) -> Path:
    h = hashlib.sha256()
    files = source_files(spec.data.path_list)
    for f in files:
        st = f.stat()
        h.update(f"{f.resolve()}|{st.st_size}|{st.st_mtime_ns}\n".encode())
    h.update(str(spec.data.text_key).encode())
    tok = tokenizer_dir(spec)
    for name in sorted(os.listdir(tok)) if tok.is_dir() else []:
        h.update(name.encode() + (tok / name).read_bytes() if (tok / name).is_file() else b"")
    base = spec.data.cache_dir or os.path.join(str(spec.output_dir), "data")
    return Path(os.path.abspath(str(base))) / f"documents-{h.hexdigest()[:16]}"


def dataset_prefix(spec: RunSpec) -> str:
    return str(dataset_dir(spec) / PREFIX_NAME)


def read_documents(files: List[Path], text_key: str) -> Iterator[Tuple[str, str, int]]:
    """(where, text, bytes read for it) of every document, in order (the bytes of the blank lines before a JSON line
    count with it)."""
    for f in files:
        if f.suffix == ".txt":
            data = f.read_bytes()
            yield str(f), data.decode("utf-8"), len(data)
            continue
        with open(f, "rb") as fh:
            skipped = 0
            for n, raw in enumerate(fh, 1):
                line = raw.decode("utf-8")
                if not line.strip():
                    skipped += len(raw)
                    continue
                try:
                    obj = json.loads(line)
                except ValueError as e:
                    raise ValueError(f"data.paths: {f}:{n} is not a JSON line ({e})") from None
                if not isinstance(obj, dict) or not isinstance(obj.get(text_key), str):
                    raise ValueError(f"data.text_key={text_key!r}: {f}:{n} has no string field {text_key!r}")
                yield f"{f}:{n}", obj[text_key], skipped + len(raw)
                skipped = 0


def build_indexed_dataset(spec: RunSpec, out_dir: Path) -> dict:
    """Tokenize every document (NeMo's AutoTokenizer over the HF tokenizer dir), append EOD, write ``.bin``/``.idx``
    with Megatron's IndexedDatasetBuilder into a temporary directory, rename it into place when complete."""
    import shutil
    import tempfile

    import numpy
    import torch
    from megatron.core.datasets.indexed_dataset import DType, IndexedDatasetBuilder
    from nemo.collections.common.tokenizers.huggingface.auto_tokenizer import AutoTokenizer

    tok = AutoTokenizer(str(tokenizer_dir(spec)))
    eod = tok.eos_id
    if eod is None:
        raise ValueError(f"data.tokenizer={tokenizer_dir(spec)}: the tokenizer has no EOS token to end documents with")
    out_dir.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{out_dir.name}.partial-", dir=str(out_dir.parent)))
    try:
        builder = IndexedDatasetBuilder(str(tmp / f"{PREFIX_NAME}.bin"), dtype=DType.optimal_dtype(tok.vocab_size))
        docs = tokens = 0
        files = source_files(spec.data.path_list)
        with Progress("data=documents: tokenizing", total=sum(f.stat().st_size for f in files), unit="B",
                      rate_of="tokens") as progress:
            for _, text, size in read_documents(files, str(spec.data.text_key)):
                ids = tok.text_to_ids(text) + [eod]
                builder.add_document(torch.tensor(ids, dtype=torch.int64), [len(ids)])
                docs, tokens = docs + 1, tokens + len(ids)
                progress.update(size, documents=1, tokens=len(ids))
        if docs == 0:
            raise ValueError(f"data.paths={spec.data.path_list}: no documents found")
        builder.finalize(str(tmp / f"{PREFIX_NAME}.idx"))
        summary = {"documents": docs, "tokens": tokens, "eod": int(eod), "tokenizer": str(tokenizer_dir(spec)),
                   "dtype": numpy.dtype(DType.optimal_dtype(tok.vocab_size)).name}
        (tmp / DONE).write_text(json.dumps(summary))
        os.replace(tmp, out_dir)
    finally:
        if tmp.exists():
            shutil.rmtree(tmp, ignore_errors=True)
    return summary


def split_problems(spec: RunSpec, num_documents: int) -> List[str]:
    """Megatron's GPTDataset loops forever building a split that has samples requested but no document
    (``_get_num_epochs`` never reaches the requested tokens): refuse a non-zero ``data.split`` part that gets none of
    the documents (the same rounding as Megatron's ``_get_split_indices``)."""
    split = spec.data.split
    weights = [float(x) for x in str(split).replace("/", ",").split(",")]
    weights += [0.0] * (3 - len(weights))
    total = sum(weights)
    if total <= 0:
        return [f"data.split={split!r} must have a positive part"]
    bounds = [0]
    for w in weights:
        bounds.append(bounds[-1] + int(round(w / total * float(num_documents))))
    names = ("train", "validation", "test")
    return [f"data.split={split!r}: the {names[i]} part gets none of the {num_documents} documents "
            f"(Megatron's dataset builder would loop forever on it): set that part to 0 or add documents"
            for i, w in enumerate(weights[:3]) if w > 0 and bounds[i + 1] - bounds[i] == 0]


def prepare(spec: RunSpec, rank: int = 0, timeout_s: float = 3600, local_rank: Optional[int] = None
            ) -> Optional[Path]:
    """Write the indexed dataset of ``data=documents`` once (rank 0, showing its progress; the other ranks wait,
    one per node saying so: ``progress.wait_for``). No-op for other data."""
    if str(spec.data.kind) != "documents":
        return None
    out = dataset_dir(spec)
    if (out / DONE).is_file():
        _check_split(spec, out)
        return out
    if rank != 0:
        wait_for((out / DONE).is_file, f"tokenize the documents into {out} (data=documents)", rank=rank,
                 local_rank=local_rank, timeout_s=timeout_s)
        return out
    t0 = time.perf_counter()
    summary = build_indexed_dataset(spec, out)
    print(f"nemo-longctx: data=documents: {summary['documents']} documents, {summary['tokens']} tokens (EOD "
          f"{summary['eod']} after each) -> {out} in {time.perf_counter() - t0:.1f} s", flush=True)
    _check_split(spec, out)
    return out


def _check_split(spec: RunSpec, out: Path) -> None:
    raise_problems(split_problems(spec, int(json.loads((out / DONE).read_text())["documents"])))
