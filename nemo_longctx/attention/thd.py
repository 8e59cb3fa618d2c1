"""Packed sequences (THD): documents packed into one sequence, attention only within each document.

API (TE/Megatron naming): ``cu_seqlens`` -- cumulative *real* document lengths ``[0, L_0, L_0+L_1, ...]``;
``cu_seqlens_padded`` -- cumulative padded lengths, the layout (default: ``cu_seqlens``). Both are integer
tensors (int32 as Megatron passes them) or lists, global and the same on every rank. Document i occupies global
positions ``[cu_seqlens_padded[i], cu_seqlens_padded[i+1])``; its first ``L_i`` positions are real tokens, the rest
padding. Every padded length is a multiple of 2*cp (any length at cp = 1); rank r holds chunks r and 2*cp-1-r of
every document, in document order (``layouts.thd_zigzag_indices``), on ``[1, s_local, h, d]`` tensors.

Semantics: a real query attends to the real keys of its own document (causally or not); padding never acts as a
key; padding queries get output 0 (lse -inf) and their gradients are 0.

``ThdLayout.blocks(size, q_rank, kv_rank, causal)`` is the work of one (query shard, key/value shard) pair: a list
of dense sub-blocks ``(q_slice, kv_slice, causal)`` in local coordinates, one per (document, query chunk, key chunk)
with at least one unmasked pair: a query chunk a and key chunk b of one document (chunk size c = padded / 2P) give
  a > b: all real queries of chunk a x the real keys of chunk b (no mask);
  a = b: the diagonal (causal, top-left aligned; real queries = real keys);
  a < b: nothing (causal); without a causal mask every pair with real queries and keys is one full block.
Empty pairs are skipped, so the work is proportional to the sum of squared document lengths.
"""

from __future__ import annotations

from typing import Dict, List, Optional, Sequence, Tuple

import torch

Tensor = torch.Tensor
Block = Tuple[slice, slice, bool]


def _as_list(x, name: str, fn: str) -> List[int]:
    if isinstance(x, Tensor):
        if x.dim() != 1 or x.is_floating_point() or x.is_complex() or x.dtype == torch.bool:
            raise ValueError(f"{fn}: {name} must be a 1-D integer tensor (int32), got {x.dtype} {tuple(x.shape)}")
        return [int(v) for v in x.tolist()]
    if isinstance(x, (list, tuple)) and all(isinstance(v, int) and not isinstance(v, bool) for v in x):
        return list(x)
    raise ValueError(f"{fn}: {name} must be a 1-D integer tensor or a list of ints, got {type(x).__name__}")


class ThdLayout:
    """Per-document real and padded lengths of a packed sequence, checked for a CP group of ``cp_size``."""

    def __init__(self, cu_seqlens, cu_seqlens_padded=None, cp_size: int = 1, fn: str = "attention") -> None:
        cu = _as_list(cu_seqlens, "cu_seqlens", fn)
        cup = cu if cu_seqlens_padded is None else _as_list(cu_seqlens_padded, "cu_seqlens_padded", fn)
        if len(cu) < 2 or len(cu) != len(cup):
            raise ValueError(f"{fn}: cu_seqlens ({len(cu)} entries) and cu_seqlens_padded ({len(cup)}) must have "
                             "the same length >= 2 (number of documents + 1)")
        if cu[0] != 0 or cup[0] != 0:
            raise ValueError(f"{fn}: cu_seqlens and cu_seqlens_padded must start at 0")
        self.lengths = [b - a for a, b in zip(cu, cu[1:])]
        self.padded = [b - a for a, b in zip(cup, cup[1:])]
        for i, (n, p) in enumerate(zip(self.lengths, self.padded)):
            if n < 0 or n > p:
                raise ValueError(f"{fn}: document {i} has real length {n} and padded length {p} (cu_seqlens, "
                                 "cu_seqlens_padded): need 0 <= real <= padded")
            if cp_size > 1 and p % (2 * cp_size):
                raise ValueError(f"{fn}: document {i} has padded length {p}: every document must be padded to a "
                                 f"multiple of 2*cp = {2 * cp_size} (cu_seqlens_padded)")
        self.starts = cup[:-1]
        self.total = cup[-1]
        self.cp_size = cp_size
        self._cache: Dict[tuple, List[Block]] = {}

    @property
    def num_docs(self) -> int:
        return len(self.lengths)

    def blocks(self, size: int, q_rank: int, kv_rank: int, causal: bool) -> List[Block]:
        """Dense sub-blocks of (this rank's queries) x (``kv_rank``'s keys) for a layout over ``size`` ranks."""
        key = (size, q_rank, kv_rank, causal)
        if key not in self._cache:
            self._cache[key] = self._blocks(*key)
        return self._cache[key]

    def window_blocks(self, size: int, q_rank: int, kv_rank: int, causal: bool, window) -> list:
        """Like ``blocks`` under a sliding window: ``window.windowed_blocks`` items (local slices, kind, global
        bounds) of every (document, query chunk, key chunk) pair, each cut to the window's band (``window`` is
        normalized: under causal masking its right side is 0, which also removes the keys after a query)."""
        from .window import band_blocks

        key = (size, q_rank, kv_rank, causal, tuple(window))
        if key not in self._cache:
            out = []
            for lq, nq, gq, lk, nk, gk, _, _ in self._doc_pairs(size, q_rank, kv_rank):
                for qa, qb, ka, kb, kind in band_blocks(gq, gq + nq, gk, gk + nk, *window):
                    out.append((slice(lq + qa - gq, lq + qb - gq), slice(lk + ka - gk, lk + kb - gk), kind,
                                (qa, qb, ka, kb)))
            self._cache[key] = out
        return self._cache[key]

    def _doc_pairs(self, size: int, q_rank: int, kv_rank: int):
        """(q local start, nq, q global start, k local start, nk, k global start, a, b) for every (document,
        query chunk a, key chunk b) with real queries and real keys."""
        if size == 1:  # the local layout is the natural packed order: one pair per document
            for start, n in zip(self.starts, self.lengths):
                if n:
                    yield start, n, start, start, n, start, 0, 0
            return
        q_chunks = ((0, q_rank), (1, 2 * size - 1 - q_rank))
        kv_chunks = ((0, kv_rank), (1, 2 * size - 1 - kv_rank))
        for start, n, p in zip(self.starts, self.lengths, self.padded):
            if not n:
                continue
            c, base = p // (2 * size), start // size
            for sa, a in q_chunks:
                nq = min(max(n - a * c, 0), c)
                if not nq:
                    continue
                for sb, b in kv_chunks:
                    nk = min(max(n - b * c, 0), c)
                    if nk:
                        yield base + sa * c, nq, start + a * c, base + sb * c, nk, start + b * c, a, b

    def _blocks(self, size: int, q_rank: int, kv_rank: int, causal: bool) -> List[Block]:
        out: List[Block] = []
        for lq, nq, _, lk, nk, _, a, b in self._doc_pairs(size, q_rank, kv_rank):
            if causal and a < b:
                continue
            out.append((slice(lq, lq + nq), slice(lk, lk + nk), causal and a == b))
        return out


def check_thd_inputs(q: Tensor, cp_size: int, cu_seqlens, cu_seqlens_padded, fn: str) -> ThdLayout:
    """Validate a packed sequence for a CP group of ``cp_size`` (ValueError naming the problem); return its layout."""
    if q.shape[0] != 1:
        raise ValueError(f"{fn}: packed sequences (cu_seqlens) need batch size 1 ([1, s_local, heads, head_dim]), "
                         f"got q {tuple(q.shape)}")
    layout = ThdLayout(cu_seqlens, cu_seqlens_padded, cp_size, fn=fn)
    if layout.total != q.shape[1] * cp_size:
        raise ValueError(f"{fn}: cu_seqlens_padded covers {layout.total} positions but the local length "
                         f"{q.shape[1]} x {cp_size} ranks is {q.shape[1] * cp_size}")
    return layout


def merge_rows_(acc_out: Tensor, acc_lse: Tensor, out: Tensor, lse: Tensor) -> None:
    """In-place log-sum-exp merge of a partial into accumulator rows that may not have seen a key yet
    (``acc_lse = -inf``, ``acc_out = 0``); the partial's rows have seen at least one key (finite lse). No
    output-sized temporary: the partial is upcast inside the fused multiply-add."""
    lse = lse.to(acc_lse.dtype)
    new = torch.logaddexp(acc_lse, lse)
    w_acc = torch.exp(acc_lse - new).transpose(1, 2).unsqueeze(-1)
    w_new = torch.exp(lse - new).transpose(1, 2).unsqueeze(-1)
    acc_out.mul_(w_acc).addcmul_(out, w_new)
    acc_lse.copy_(new)


def varlen_forward(q: Tensor, k: Tensor, v: Tensor, blocks: Sequence[Block], scale: float, kernel,
                   acc_out: Tensor, acc_lse: Tensor) -> None:
    """Run ``kernel`` on every sub-block and merge the partials into the accumulators (rows of q)."""
    for qs, ks, causal in blocks:
        out, lse = kernel.forward(q[:, qs], k[:, ks], v[:, ks], causal, scale)
        merge_rows_(acc_out[:, qs], acc_lse[:, :, qs], out, lse)


def varlen_backward(dout: Tensor, q: Tensor, k: Tensor, v: Tensor, out: Tensor, lse: Tensor,
                    blocks: Sequence[Block], scale: float, kernel, dq: Tensor, dk: Tensor, dv: Tensor) -> None:
    """Add every sub-block's gradients into dq (rows of q) and dk/dv (rows of k/v)."""
    for qs, ks, causal in blocks:
        dq_i, dk_i, dv_i = kernel.backward(dout[:, qs], q[:, qs], k[:, ks], v[:, ks], out[:, qs], lse[:, :, qs],
                                           causal, scale)
        dq[:, qs].add_(dq_i)
        dk[:, ks].add_(dk_i)
        dv[:, ks].add_(dv_i)


def empty_accumulators(q: Tensor, v: Tensor, dtype: torch.dtype) -> Tuple[Tensor, Tensor]:
    """(out zeros [b, s, hq, dv], lse -inf [b, hq, s]) in ``dtype``: padding rows keep these values."""
    b, s, hq = q.shape[:3]
    return (torch.zeros(b, s, hq, v.shape[-1], dtype=dtype, device=q.device),
            torch.full((b, hq, s), float("-inf"), dtype=dtype, device=q.device))


def thd_layout_or_none(q: Tensor, cp_size: int, cu_seqlens, cu_seqlens_padded, fn: str) -> Optional[ThdLayout]:
    if cu_seqlens is None:
        if cu_seqlens_padded is not None:
            raise ValueError(f"{fn}: cu_seqlens_padded given without cu_seqlens")
        return None
    return check_thd_inputs(q, cp_size, cu_seqlens, cu_seqlens_padded, fn)
