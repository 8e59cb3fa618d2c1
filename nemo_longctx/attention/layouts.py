"""Zigzag (load-balanced causal) sequence layout, identical to Megatron-core's.

The global sequence of length S is viewed as ``2 * cp`` equal chunks; context-parallel rank r holds chunks
``r`` and ``2*cp - 1 - r``, concatenated in that order (``megatron.core.utils.get_batch_on_this_cp_rank``;
RoPE's ``get_pos_emb_on_this_cp_rank`` assumes the same). S must be divisible by ``2 * cp``.
"""

from __future__ import annotations

from typing import Optional, Sequence

import torch

Tensor = torch.Tensor


def _check(seq_len: int, cp_size: int, cp_rank: int) -> None:
    if cp_size < 1:
        raise ValueError(f"cp_size must be >= 1, got {cp_size}")
    if not 0 <= cp_rank < cp_size:
        raise ValueError(f"cp_rank must be in [0, {cp_size}), got {cp_rank}")
    if seq_len % (2 * cp_size) != 0:
        raise ValueError(
            f"sequence length {seq_len} must be divisible by 2*cp_size = {2 * cp_size} for the zigzag layout"
        )


def zigzag_chunk_ids(cp_size: int, cp_rank: int) -> tuple:
    """The two global chunk indices (out of 2*cp_size) held by ``cp_rank``, in local order."""
    return cp_rank, 2 * cp_size - 1 - cp_rank


def zigzag_indices(seq_len: int, cp_size: int, cp_rank: int, device: Optional[torch.device] = None) -> Tensor:
    """Global token positions held by ``cp_rank``, in local order: a LongTensor of length seq_len / cp_size."""
    _check(seq_len, cp_size, cp_rank)
    c = seq_len // (2 * cp_size)
    first, second = zigzag_chunk_ids(cp_size, cp_rank)
    return torch.cat(
        [torch.arange(first * c, (first + 1) * c, device=device), torch.arange(second * c, (second + 1) * c, device=device)]
    )


def zigzag_position_ids(seq_len: int, cp_size: int, cp_rank: int, device: Optional[torch.device] = None) -> Tensor:
    """Position ids of the local shard (same as ``zigzag_indices``; named for use as RoPE positions)."""
    return zigzag_indices(seq_len, cp_size, cp_rank, device)


def zigzag_shard(x: Tensor, dim: int, cp_size: int, cp_rank: int) -> Tensor:
    """The local shard of a full-sequence tensor: chunks r and 2*cp-1-r along ``dim``, concatenated."""
    dim = dim % x.dim()
    _check(x.shape[dim], cp_size, cp_rank)
    if cp_size == 1:
        return x
    chunks = x.chunk(2 * cp_size, dim=dim)
    first, second = zigzag_chunk_ids(cp_size, cp_rank)
    return torch.cat([chunks[first], chunks[second]], dim=dim)


def zigzag_unshard(chunks: Sequence[Tensor], dim: int) -> Tensor:
    """Inverse of ``zigzag_shard``: ``chunks[r]`` is rank r's shard; returns the full sequence along ``dim``."""
    cp_size = len(chunks)
    if cp_size == 0:
        raise ValueError("zigzag_unshard needs at least one shard")
    dim = dim % chunks[0].dim()
    lengths = {t.shape[dim] for t in chunks}
    if len(lengths) != 1:
        raise ValueError(f"all shards must have the same length along dim {dim}, got {sorted(lengths)}")
    (local,) = lengths
    if local % 2 != 0:
        raise ValueError(f"shard length {local} along dim {dim} must be even (two zigzag chunks)")
    pieces = [None] * (2 * cp_size)
    for r, t in enumerate(chunks):
        front, back = t.chunk(2, dim=dim)
        first, second = zigzag_chunk_ids(cp_size, r)
        pieces[first], pieces[second] = front, back
    return torch.cat(pieces, dim=dim)
