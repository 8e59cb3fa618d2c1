"""Ring (P2P) attention over a packed sequence (THD): per-document attention, per-document zigzag layout.

Layout and semantics: ``thd`` (rank r holds chunks r and 2P-1-r of every document; pad positions never act as
keys; padding queries give 0). The ring is the one of ``ring``: K/V (only the hkv real heads, K and V at their
own head dims) travel around the ring, the next exchange posted before the current step's compute; in backward
a float32 dK/dV accumulator per block travels one step behind and arrives home after P-1 exchanges. Each step
computes only the dense sub-blocks with an unmasked pair (``ThdLayout.blocks``): documents never attend to each
other, and a step in which no document has such a pair computes nothing (its K/V still travel, since the ring
needs them further on). With a sliding window (``window``) the sub-blocks are cut to the band within each
document (``ThdLayout.window_blocks``); the K/V still make the whole ring. Partials merge by log-sum-exp into
float32 (float64) accumulators that start at (0, -inf), so padding rows stay (0, -inf).
"""

from __future__ import annotations

from typing import Optional, Tuple

import torch
import torch.distributed as dist

from .comm import RingExchange, group_size_and_rank
from .kernels import AttentionKernel
from .sinks import apply_sinks, sinks_grad
from .thd import ThdLayout, empty_accumulators, merge_rows_, varlen_backward, varlen_forward
from .window import window_backward_blocks, window_forward_blocks

Tensor = torch.Tensor


def _accumulator_dtype(dtype: torch.dtype) -> torch.dtype:
    return torch.float64 if dtype == torch.float64 else torch.float32


def ring_thd_forward(
    q: Tensor, k: Tensor, v: Tensor, group: Optional[dist.ProcessGroup], causal: bool, scale: float,
    kernel: AttentionKernel, layout: ThdLayout, window=None, sinks: Optional[Tensor] = None,
) -> Tuple[Tensor, Tensor]:
    """(out [1, s_local, hq, dv] in q.dtype, lse [1, hq, s_local] fp32/fp64; padding rows 0 / -inf).
    ``sinks`` ([hq] logits): applied once to the final rows (``sinks.apply_sinks``; padding rows stay 0 / -inf)."""
    size, rank = group_size_and_rank(group)
    ring = RingExchange(group) if size > 1 else None
    acc_out, acc_lse = empty_accumulators(q, v, _accumulator_dtype(q.dtype))
    kv = (k, v)
    for step in range(size):
        pending = ring.start(kv) if step < size - 1 else None
        if window is None:
            blocks = layout.blocks(size, rank, (rank - step) % size, causal)
            varlen_forward(q, kv[0], kv[1], blocks, scale, kernel, acc_out, acc_lse)
        else:
            blocks = layout.window_blocks(size, rank, (rank - step) % size, causal, window)
            window_forward_blocks(q, kv[0], kv[1], blocks, window, scale, kernel, acc_out, acc_lse, merge_rows_)
        if pending is not None:
            kv = tuple(pending.wait())
    if sinks is not None:
        acc_out, acc_lse = apply_sinks(acc_out, acc_lse, sinks)
    return acc_out.to(q.dtype), acc_lse


def ring_thd_backward(
    dout: Tensor, q: Tensor, k: Tensor, v: Tensor, out: Tensor, lse: Tensor, group: Optional[dist.ProcessGroup],
    causal: bool, scale: float, kernel: AttentionKernel, layout: ThdLayout, window=None,
) -> Tuple[Tensor, Tensor, Tensor]:
    """Gradients (dq, dk, dv) given the forward's final ``out`` and ``lse``; zero on padding positions."""
    size, rank = group_size_and_rank(group)
    ring = RingExchange(group) if size > 1 else None
    acc = _accumulator_dtype(q.dtype)
    dq = torch.zeros(q.shape, dtype=acc, device=q.device)
    dk_own = torch.zeros(k.shape, dtype=acc, device=k.device)
    dv_own = torch.zeros(v.shape, dtype=acc, device=v.device)
    kv = (k, v)
    dkv_pending = None
    for step in range(size):
        kv_pending = ring.start(kv) if step < size - 1 else None
        src = (rank - step) % size
        if step == 0:  # our own block's gradient stays here and is added when its accumulator comes home
            dk_blk, dv_blk = dk_own, dv_own
        elif step == 1:
            dk_blk = torch.zeros(k.shape, dtype=acc, device=k.device)
            dv_blk = torch.zeros(v.shape, dtype=acc, device=v.device)
        else:  # the accumulator of the block we now hold, filled by the ranks that held it before us
            dk_blk, dv_blk = dkv_pending.wait()
        if window is None:
            varlen_backward(dout, q, kv[0], kv[1], out, lse, layout.blocks(size, rank, src, causal), scale, kernel,
                            dq, dk_blk, dv_blk)
        else:
            window_backward_blocks(dout, q, kv[0], kv[1], out, lse,
                                   layout.window_blocks(size, rank, src, causal, window), window, scale, kernel,
                                   dq, dk_blk, dv_blk)
        if step > 0:
            dkv_pending = ring.start((dk_blk, dv_blk))
        if kv_pending is not None:
            kv = tuple(kv_pending.wait())
    if ring is not None:
        dk_home, dv_home = dkv_pending.wait()  # our block's accumulator after visiting the P-1 other ranks
        dk_own.add_(dk_home)
        dv_own.add_(dv_home)
    return dq.to(q.dtype), dk_own.to(k.dtype), dv_own.to(v.dtype)


class _RingAttentionTHD(torch.autograd.Function):
    @staticmethod
    def forward(ctx, q, k, v, group, causal, scale, kernel: AttentionKernel, layout: ThdLayout, window=None,
                sinks=None):
        out, lse = ring_thd_forward(q, k, v, group, causal, scale, kernel, layout, window, sinks)
        ctx.save_for_backward(q, k, v, out, lse, sinks)
        ctx.args = (group, causal, scale, kernel, layout, window)
        return out

    @staticmethod
    def backward(ctx, dout):
        q, k, v, out, lse, sinks = ctx.saved_tensors
        dq, dk, dv = ring_thd_backward(dout, q, k, v, out, lse, *ctx.args)
        dsinks = sinks_grad(dout, out, lse, sinks) if ctx.needs_input_grad[9] else None
        return dq, dk, dv, None, None, None, None, None, None, dsinks


def ring_thd_attention(q, k, v, group, causal: bool, scale: float, kernel: AttentionKernel,
                       layout: ThdLayout, window=None, sinks: Optional[Tensor] = None) -> Tensor:
    """Differentiable THD ring attention on validated inputs (``ring.ring_attention(..., cu_seqlens=...)``);
    ``window``: a normalized sliding window, applied within each document (the whole K/V still travel);
    ``sinks``: [hq] sink logits (``sinks.resolve_sinks``) or None."""
    return _RingAttentionTHD.apply(q, k, v, group, causal, scale, kernel, layout, window, sinks)
