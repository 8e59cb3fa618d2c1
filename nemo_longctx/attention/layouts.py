"""Zigzag (load-balanced causal) sequence layout, identical to Megatron-core's.

The global sequence of length S is viewed as ``2 * cp`` equal chunks; context-parallel rank r holds chunks
``r`` and ``2*cp - 1 - r``, concatenated in that order (``megatron.core.utils.get_batch_on_this_cp_rank``;
RoPE's ``get_pos_emb_on_this_cp_rank`` assumes the same). S must be divisible by ``2 * cp``.

Packed sequences (THD, ``cu_seqlens_padded`` given): the zigzag is applied per document, exactly like
Megatron/TE's THD partitioning: document i occupies global positions ``[cu_seqlens_padded[i],
cu_seqlens_padded[i+1])`` (its padded length a multiple of 2*cp), is viewed as 2*cp chunks, and rank r holds
chunks r and 2*cp-1-r of every document, documents in order (at cp = 1: the packed sequence as is).
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
        [torch.arange(first * c, (first + 1) * c, device=device),
         torch.arange(second * c, (second + 1) * c, device=device)]
    )


def zigzag_position_ids(seq_len: int, cp_size: int, cp_rank: int, device: Optional[torch.device] = None) -> Tensor:
    """Position ids of the local shard (same as ``zigzag_indices``; named for use as RoPE positions)."""
    return zigzag_indices(seq_len, cp_size, cp_rank, device)


def _padded_lengths(cu_seqlens_padded, cp_size: int) -> list:
    cu = [int(x) for x in (cu_seqlens_padded.tolist() if isinstance(cu_seqlens_padded, Tensor)
                           else cu_seqlens_padded)]
    if len(cu) < 2 or cu[0] != 0:
        raise ValueError(f"cu_seqlens_padded must start at 0 and hold at least one document, got {cu[:8]}")
    lengths = [b - a for a, b in zip(cu, cu[1:])]
    for i, n in enumerate(lengths):
        if n < 0 or (cp_size > 1 and n % (2 * cp_size)):
            raise ValueError(
                f"document {i} has padded length {n} (cu_seqlens_padded): every document must be padded to a "
                f"multiple of 2*cp_size = {2 * cp_size}"
            )
    return lengths


def thd_zigzag_indices(cu_seqlens_padded, cp_size: int, cp_rank: int,
                       device: Optional[torch.device] = None) -> Tensor:
    """Global positions (LongTensor) a CP rank holds of a packed sequence, in local order: chunks r and
    2*cp-1-r of every document (per-document zigzag, Megatron/TE's THD partitioning)."""
    if cp_size < 1 or not 0 <= cp_rank < cp_size:
        raise ValueError(f"need cp_size >= 1 and 0 <= cp_rank < cp_size, got {cp_size}, {cp_rank}")
    pieces, start = [], 0
    first, second = zigzag_chunk_ids(cp_size, cp_rank)
    lengths = _padded_lengths(cu_seqlens_padded, cp_size)
    if cp_size == 1:  # the natural packed order (no padding rule)
        return torch.arange(sum(lengths), device=device)
    for n in lengths:
        c = n // (2 * cp_size)
        pieces += [torch.arange(start + first * c, start + (first + 1) * c),
                   torch.arange(start + second * c, start + (second + 1) * c)]
        start += n
    return torch.cat(pieces).to(device) if pieces else torch.zeros(0, dtype=torch.long, device=device)


def zigzag_shard(x: Tensor, dim: int, cp_size: int, cp_rank: int, *, cu_seqlens_padded=None) -> Tensor:
    """The local shard of a full-sequence tensor: chunks r and 2*cp-1-r along ``dim``, concatenated.

    With ``cu_seqlens_padded`` (a packed sequence, int tensor or list, cumulative padded document lengths): the
    per-document zigzag (module docstring); its total must equal the length of ``dim``."""
    dim = dim % x.dim()
    if cu_seqlens_padded is not None:
        idx = thd_zigzag_indices(cu_seqlens_padded, cp_size, cp_rank, device=x.device)
        total = sum(_padded_lengths(cu_seqlens_padded, cp_size))
        if total != x.shape[dim]:
            raise ValueError(f"cu_seqlens_padded covers {total} positions but dim {dim} has length {x.shape[dim]}")
        return x.index_select(dim, idx)
    _check(x.shape[dim], cp_size, cp_rank)
    if cp_size == 1:
        return x
    chunks = x.chunk(2 * cp_size, dim=dim)
    first, second = zigzag_chunk_ids(cp_size, cp_rank)
    return torch.cat([chunks[first], chunks[second]], dim=dim)


def zigzag_unshard(chunks: Sequence[Tensor], dim: int, *, cu_seqlens_padded=None) -> Tensor:
    """Inverse of ``zigzag_shard``: ``chunks[r]`` is rank r's shard; returns the full sequence along ``dim``."""
    cp_size = len(chunks)
    if cp_size == 0:
        raise ValueError("zigzag_unshard needs at least one shard")
    dim = dim % chunks[0].dim()
    if cu_seqlens_padded is not None:
        idx = torch.cat([thd_zigzag_indices(cu_seqlens_padded, cp_size, r) for r in range(cp_size)])
        shards = torch.cat(list(chunks), dim=dim)
        if shards.shape[dim] != idx.numel():
            raise ValueError(f"shards hold {shards.shape[dim]} positions along dim {dim}, cu_seqlens_padded "
                             f"{idx.numel()}")
        return shards.index_select(dim, torch.argsort(idx).to(shards.device))
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
