"""Shard a full-sequence training batch over the context-parallel group (zigzag, identical to Megatron-core's
``megatron.core.utils.get_batch_on_this_cp_rank``).

Batch keys ``tokens``, ``labels``, ``loss_mask``, ``position_ids`` are ``[b, S]`` (sequence on dim 1); an
``attention_mask`` would be ``[b, 1, S, S]`` (sharded on dim 2, like Megatron). Labels are already shifted by the
dataset (labels[i] = tokens[i+1]), so sharding tokens and labels with the same index keeps every pair together,
including at chunk boundaries.

Packed documents (THD, ``shard_packed_batch_for_cp``): a ``[1, T]`` batch with NeMo's ``cu_seqlens`` keys is laid out
per document (each padded to a multiple of 2*cp) and sharded per document like Megatron/TE's THD partitioning
(``thd_get_partitioned_indices``); the model gets Megatron's ``PackedSeqParams``.
"""

from __future__ import annotations

import itertools
from typing import Any, Dict, List, Sequence, Tuple

from nemo_longctx.attention import zigzag_shard


def seq_dim_of(key: str) -> int:
    return 2 if key == "attention_mask" else 1


# the last sharded micro-batch of this process: one sequence's tokens before sharding and this rank's share of the
# micro-batch's tokens (the run guards compare them with what the attention saw and what the layout promises); None
# where unknown (a middle pipeline stage of a dense batch gets no token tensors)
LAST_SHARD: Dict[str, Any] = {"sequence_tokens": None, "local_tokens": None}


def _note_shard(sequence_tokens: Any, local_tokens: Any) -> None:
    LAST_SHARD["sequence_tokens"], LAST_SHARD["local_tokens"] = sequence_tokens, local_tokens


def shard_batch_for_cp(batch: Dict[str, Any], cp_size: int, cp_rank: int) -> Dict[str, Any]:
    """New dict with every tensor value replaced by this CP rank's zigzag shard (None values kept)."""
    ref = next((v for k, v in batch.items() if k in TOKEN_KEYS and v is not None), None)
    if ref is not None:  # (tokens of the micro-batch: batch x sequence)
        _note_shard(int(ref.shape[1]), int(ref.numel()) // max(1, cp_size))
    if cp_size == 1:
        return dict(batch)
    out = {}
    for key, val in batch.items():
        if val is None:
            out[key] = None
            continue
        dim = seq_dim_of(key)
        if val.shape[dim] % (2 * cp_size) != 0:
            raise ValueError(
                f"batch[{key!r}] has sequence length {val.shape[dim]}, not divisible by 2*cp.size = {2 * cp_size}"
            )
        out[key] = zigzag_shard(val, dim, cp_size, cp_rank)
    return out


# ------------------------------------------------------------------------------------------------ packed (THD)
PACKED_KEYS = ("cu_seqlens", "cu_seqlens_argmin", "cu_seqlens_unpadded", "cu_seqlens_unpadded_argmin", "max_seqlen")
TOKEN_KEYS = ("tokens", "labels", "loss_mask", "position_ids")


def _trim(cu: Any, argmin: Any, name: str) -> List[int]:
    """One sample's cumulative lengths without NeMo's trailing -1 fill (``[b=1, n]`` or ``[n]``)."""
    import torch

    if cu.dim() == 2:
        if cu.shape[0] != 1:
            raise ValueError(f"packed sequences need micro batch size 1: batch[{name!r}] "
                             f"has shape {tuple(cu.shape)}")
        cu = cu[0]
    vals = [int(x) for x in cu.tolist()]
    if argmin is not None:
        vals = vals[: int(torch.as_tensor(argmin).reshape(-1)[0])]
    elif -1 in vals:
        vals = vals[: vals.index(-1)]
    if len(vals) < 2 or vals[0] != 0 or any(b < a for a, b in zip(vals, vals[1:])):
        raise ValueError(f"batch[{name!r}] must be cumulative document lengths starting at 0, got {vals[:8]}...")
    return vals


def packed_documents(batch: Dict[str, Any]) -> Tuple[List[int], List[int]]:
    """(starts, real lengths) of the documents of a packed batch in NeMo's format (``GPTSFTPackedDataset``:
    ``cu_seqlens`` = the packed layout, ``cu_seqlens_unpadded`` = the real lengths, both -1 filled, with their
    ``*_argmin``; our ``data.packing=documents`` yields the same keys). Without ``cu_seqlens_unpadded`` every position
    of a document is real."""
    layout = _trim(batch["cu_seqlens"], batch.get("cu_seqlens_argmin"), "cu_seqlens")
    starts = layout[:-1]
    padded = [b - a for a, b in zip(layout, layout[1:])]
    if batch.get("cu_seqlens_unpadded") is None:
        return starts, padded
    real_cu = _trim(batch["cu_seqlens_unpadded"], batch.get("cu_seqlens_unpadded_argmin"), "cu_seqlens_unpadded")
    real = [b - a for a, b in zip(real_cu, real_cu[1:])]
    if len(real) != len(padded) or any(r > p for r, p in zip(real, padded)):
        raise ValueError(f"batch['cu_seqlens_unpadded'] ({len(real)} documents) does not fit batch['cu_seqlens'] "
                         f"({len(padded)} documents): need the same documents, real length <= padded length")
    return starts, real


def cp_packed_layout(lengths: Sequence[int], cp_size: int) -> List[int]:
    """``cu_seqlens_padded`` of documents of real ``lengths`` laid out for ``cp_size`` ranks: every document padded
    to a multiple of 2*cp (Megatron/TE's THD rule; at cp = 1 no padding)."""
    mult = 2 * cp_size if cp_size > 1 else 1
    out = [0]
    for n in lengths:
        out.append(out[-1] + -(-n // mult) * mult)
    return out


def shard_packed_batch_for_cp(batch: Dict[str, Any], cp_size: int, cp_rank: int) -> Dict[str, Any]:
    """This CP rank's part of a packed batch (``[1, T]`` token tensors + ``cu_seqlens`` keys, NeMo's format).

    The documents are re-laid out for the CP group -- each keeps its real tokens and is padded to a multiple of
    2*cp -- and sharded per document (rank r holds chunks r and 2*cp-1-r of every document, Megatron/TE's THD
    partitioning). Pad positions get loss_mask 0 (token, label 0; position ids continue the document), so padding
    contributes nothing to the loss or gradients. Returns the token keys ``[1, t_local]`` plus ``packed_seq_params``
    (Megatron's ``PackedSeqParams``, qkv_format 'thd': ``cu_seqlens_q/kv`` = real lengths, ``*_padded`` = the
    layout, int32, global; ``max_seqlen_*`` = the longest padded document) for the model's forward."""
    import torch
    from megatron.core.packed_seq_params import PackedSeqParams

    starts, lengths = packed_documents(batch)
    # a middle pipeline stage gets no token keys (all None): only the layout (PackedSeqParams) is built
    ref = next((batch[k] for k in TOKEN_KEYS if batch.get(k) is not None), None)
    if ref is not None and (ref.dim() != 2 or ref.shape[0] != 1):
        raise ValueError(f"packed sequences need micro batch size 1: tokens have shape "
                         f"{tuple(ref.shape)}")
    if ref is not None and starts and starts[-1] + lengths[-1] > ref.shape[1]:
        raise ValueError(f"batch['cu_seqlens'] covers {starts[-1] + lengths[-1]} positions but the packed sequence "
                         f"has {ref.shape[1]}")
    layout = cp_packed_layout(lengths, cp_size)
    total = layout[-1]
    src = torch.zeros(total, dtype=torch.long)   # position in the packed batch each laid-out position reads
    real = torch.zeros(total, dtype=torch.bool)
    offset = torch.zeros(total, dtype=torch.long)  # position within the document (pads continue it)
    for start, n, a, b in zip(starts, lengths, layout, layout[1:]):
        if n:
            src[a:a + n] = torch.arange(start, start + n)
            real[a:a + n] = True
        offset[a:b] = torch.arange(b - a)
    idx = zigzag_shard(torch.arange(total), 0, cp_size, cp_rank, cu_seqlens_padded=layout)
    out: Dict[str, Any] = {}
    for key in TOKEN_KEYS:
        val = batch.get(key)
        if val is None:
            out[key] = None
            continue
        picked = val.index_select(1, src[idx].to(val.device))
        keep = real[idx].to(val.device)
        if key == "position_ids":
            picked = offset[idx].to(val.device, val.dtype)[None]
        elif key == "loss_mask":
            picked = picked * keep.to(picked.dtype)
        else:
            picked = picked.masked_fill(~keep, 0)
        out[key] = picked
    device = ref.device if ref is not None else torch.device("cpu")
    cu = torch.tensor([0] + list(itertools.accumulate(lengths)), dtype=torch.int32, device=device)
    cu_padded = torch.tensor(layout, dtype=torch.int32, device=device)
    max_len = max(b - a for a, b in zip(layout, layout[1:]))
    # the attention covers the laid-out documents; the tokens guard is not applied to packed rows (their layout pads
    # each document for CP, and NeMo's packed fine-tuning rows need not fill the sequence)
    _note_shard(total, None)
    out["packed_seq_params"] = PackedSeqParams(
        qkv_format="thd", cu_seqlens_q=cu, cu_seqlens_kv=cu, cu_seqlens_q_padded=cu_padded,
        cu_seqlens_kv_padded=cu_padded, max_seqlen_q=max_len, max_seqlen_kv=max_len)
    return out


def documents_from_position_ids(position_ids: Any) -> List[int]:
    """Document lengths of one ``[S]`` sample whose position ids restart at 0 at every document start (Megatron's
    ``reset_position_ids``: a document ends after each EOD token)."""
    import torch

    pos = position_ids.reshape(-1)
    starts = torch.nonzero(pos == 0).reshape(-1).tolist()
    if not starts or starts[0] != 0:
        raise ValueError("per-document position_ids must start at 0")
    bounds = starts + [pos.numel()]
    return [b - a for a, b in zip(bounds, bounds[1:])]
