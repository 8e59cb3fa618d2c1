"""Ring (P2P) context-parallel attention, GQA/MQA-native, zigzag-balanced, comm overlapped with compute.

Layout: q [b, s_local, hq, d], k [b, s_local, hkv, d], v [b, s_local, hkv, dv], the sequence zigzag-sharded
over the CP group (rank r holds global chunks r and 2P-1-r of 2P; see ``layouts``). Returns [b, s_local, hq, dv].
dv may differ from d (MLA: d = 192, dv = 128): K and V travel at their own sizes, nothing is padded for
communication (a kernel may pad locally, see ``kernels``).

Forward: K/V (only the hkv real heads) travel around the ring; step i+1's exchange is posted before step
i's block is computed. With causal masking each step does the same work on every rank:
  step 0          own K/V, causal over the local 2c tokens (c = s_local / 2);
  source < rank   all 2c queries x the source's first chunk (c keys), no mask;
  source > rank   the second query chunk (c) x all 2c source keys, no mask.
Partials are merged by log-sum-exp into float32 accumulators.

Backward: K/V rotate again; each rank keeps its own block's dK/dV, and a float32 dK/dV accumulator per
block travels one step behind the K/V, visiting the P-1 other ranks and arriving home after P-1 exchanges
(the minimum); dQ accumulates locally in float32. Block gradients use the
final (out, lse) of each row, so no forward state per step is stored.
"""

from __future__ import annotations

from typing import Optional, Tuple

import torch
import torch.distributed as dist

from .comm import RingExchange, group_size_and_rank
from .kernels import AttentionKernel, resolve_softmax_scale, select_kernel
from .merge import merge_attention_
from .ring_thd import ring_thd_attention
from .ring_window import ring_window_attention
from .sinks import apply_sinks, resolve_sinks, sinks_grad
from .thd import thd_layout_or_none
from .input_checks import check_attention_inputs, check_window

Tensor = torch.Tensor


def _accumulator_dtype(dtype: torch.dtype) -> torch.dtype:
    return torch.float64 if dtype == torch.float64 else torch.float32


def _block_plan(step: int, rank: int, size: int, causal: bool, c: int):
    """(q_slice, kv_slice, causal_block) for the block computed at ``step`` (source rank = rank - step)."""
    full = slice(None)
    if step == 0:
        return full, full, causal
    if not causal:
        return full, full, False
    source = (rank - step) % size
    if source < rank:
        return full, slice(0, c), False
    return slice(c, None), full, False


def ring_attention_forward(
    q: Tensor, k: Tensor, v: Tensor, group: Optional[dist.ProcessGroup], causal: bool, scale: float,
    kernel: AttentionKernel, sinks: Optional[Tensor] = None,
) -> Tuple[Tensor, Tensor]:
    """Forward pass without autograd: (out [b, s_local, hq, dv] in q.dtype, lse [b, hq, s_local] fp32/fp64).

    ``sinks`` ([hq] sink logits, ``sinks.resolve_sinks``): applied once, to the final rows (``sinks.apply_sinks``),
    before the cast to q.dtype; the returned (out, lse) are then the sink-including ones the backward takes."""
    size, rank = group_size_and_rank(group)
    if size == 1:  # one block: the kernel's own result (an accumulator would only add a copy of out in fp32)
        out, lse = kernel.forward(q, k, v, causal, scale)
        if sinks is not None:
            out, lse = apply_sinks(out, lse.to(_accumulator_dtype(q.dtype)), sinks)
        return out.to(q.dtype), lse.to(_accumulator_dtype(q.dtype))
    ring = RingExchange(group)
    c = q.shape[1] // 2
    acc_dtype = _accumulator_dtype(q.dtype)
    acc_out = acc_lse = None
    kv = (k, v)
    for step in range(size):
        pending = ring.start(kv) if step < size - 1 else None
        qs, kvs, blk_causal = _block_plan(step, rank, size, causal, c)
        out, lse = kernel.forward(q[:, qs], kv[0][:, kvs], kv[1][:, kvs], blk_causal, scale)
        if step == 0:
            acc_out, acc_lse = out.to(acc_dtype), lse.to(acc_dtype)
        else:
            merge_attention_(acc_out[:, qs], acc_lse[:, :, qs], out, lse)
        if pending is not None:
            kv = tuple(pending.wait())
    if sinks is not None:
        acc_out, acc_lse = apply_sinks(acc_out, acc_lse, sinks)
    return acc_out.to(q.dtype), acc_lse


def ring_attention_backward(
    dout: Tensor, q: Tensor, k: Tensor, v: Tensor, out: Tensor, lse: Tensor,
    group: Optional[dist.ProcessGroup], causal: bool, scale: float, kernel: AttentionKernel,
) -> Tuple[Tensor, Tensor, Tensor]:
    """Gradients (dq, dk, dv) given the forward's final ``out`` and ``lse`` (shapes as in the forward)."""
    size, rank = group_size_and_rank(group)
    dout = dout.contiguous() if dout.stride(-1) != 1 else dout
    if size == 1:  # one block: the kernel's own gradients (no fp32 dq accumulator: 4 bytes per q element saved)
        dq, dk, dv = kernel.backward(dout, q, k, v, out, lse, causal, scale)
        return dq.to(q.dtype), dk.to(k.dtype), dv.to(v.dtype)
    ring = RingExchange(group)
    c = q.shape[1] // 2
    acc_dtype = _accumulator_dtype(q.dtype)
    kv = (k, v)
    dq = dkv_pending = None
    dk_own = dv_own = None
    for step in range(size):
        kv_pending = ring.start(kv) if step < size - 1 else None
        qs, kvs, blk_causal = _block_plan(step, rank, size, causal, c)
        dq_i, dk_i, dv_i = kernel.backward(
            dout[:, qs], q[:, qs], kv[0][:, kvs], kv[1][:, kvs], out[:, qs], lse[:, :, qs], blk_causal, scale
        )
        if step == 0:
            # the diagonal block covers every query row: it starts the dq accumulator (no zero fill); our own
            # block's dK/dV stay here, in the kernel's dtype, until its accumulator comes home
            dq = dq_i.to(acc_dtype)
            dk_own, dv_own = dk_i, dv_i
        else:
            dq[:, qs].add_(dq_i)
            if step == 1:
                # the accumulator of the block we now hold starts here: our part, zeros where we added nothing
                dk_blk, dv_blk = (_grad_accumulator(g, kvs, full, acc_dtype) for g, full in ((dk_i, k), (dv_i, v)))
            else:
                # the accumulator of the block we now hold, filled by the ranks that held it before us
                dk_blk, dv_blk = dkv_pending.wait()
                dk_blk[:, kvs].add_(dk_i)
                dv_blk[:, kvs].add_(dv_i)
            dkv_pending = ring.start((dk_blk, dv_blk))
        if kv_pending is not None:
            kv = tuple(kv_pending.wait())
    dk_home, dv_home = dkv_pending.wait()  # our block's accumulator after visiting the P-1 other ranks
    dk_home.add_(dk_own)
    dv_home.add_(dv_own)
    return dq.to(q.dtype), dk_home.to(k.dtype), dv_home.to(v.dtype)


def _grad_accumulator(grad: Tensor, rows: slice, like: Tensor, dtype: torch.dtype) -> Tensor:
    """A ``dtype`` buffer shaped like ``like`` holding ``grad`` at ``rows`` (dim 1) and zeros elsewhere, written
    once per element (a copy where the block has rows, a fill only where it has none)."""
    if rows == slice(None):
        return grad.to(dtype)
    buf = torch.empty(like.shape, dtype=dtype, device=like.device)
    buf[:, rows].copy_(grad)
    start, stop, _ = rows.indices(like.shape[1])
    buf[:, :start].zero_()
    buf[:, stop:].zero_()
    return buf


class _RingAttention(torch.autograd.Function):
    @staticmethod
    def forward(ctx, q, k, v, group, causal, scale, kernel: AttentionKernel, sinks=None):
        out, lse = ring_attention_forward(q, k, v, group, causal, scale, kernel, sinks)
        ctx.save_for_backward(q, k, v, out, lse, sinks)
        ctx.args = (group, causal, scale, kernel)
        return out

    @staticmethod
    def backward(ctx, dout):
        q, k, v, out, lse, sinks = ctx.saved_tensors
        dq, dk, dv = ring_attention_backward(dout, q, k, v, out, lse, *ctx.args)
        dsinks = sinks_grad(dout, out, lse, sinks) if ctx.needs_input_grad[7] else None
        return dq, dk, dv, None, None, None, None, dsinks


def ring_attention(
    q: Tensor,
    k: Tensor,
    v: Tensor,
    group: Optional[dist.ProcessGroup] = None,
    causal: bool = True,
    softmax_scale: Optional[float] = None,
    *,
    kernel: Optional[str] = None,
    global_seq_len: Optional[int] = None,
    cu_seqlens=None,
    cu_seqlens_padded=None,
    window_size=None,
    sinks: Optional[Tensor] = None,
    softmax_type: Optional[str] = None,
) -> Tensor:
    """Exact attention over a zigzag-sharded sequence split across ``group`` (see module docstring).

    ``group=None`` or a one-rank group computes plain (local) attention. ``kernel`` names a local kernel
    (``kernels.KERNELS``) or "auto". ``global_seq_len``, if given, is checked against s_local * group size.
    ``cu_seqlens`` / ``cu_seqlens_padded`` (int32, global, the same on every rank): a packed sequence of
    documents on [1, s_local, h, d] tensors, per-document zigzag and attention (``thd``, ``ring_thd``).
    ``window_size=(left, right)``: sliding-window attention (flash-attn convention, ``(-1, -1)`` = none, causal
    SWA = ``(W, 0)``); only the K/V the window needs travel (``ring_window``).
    ``sinks`` ([hq] learnable sink logits, any float dtype, differentiable) / ``softmax_type`` ("vanilla",
    "off-by-one", "learnable"; None: "learnable" iff ``sinks`` is given): attention sinks (``sinks`` module); the
    sinks' gradient on each rank is the partial sum over its rows (sum it over the CP group).
    Raises ValueError on inconsistent inputs before communicating.
    """
    size, _ = group_size_and_rank(group)
    check_attention_inputs(q, k, v, size, causal, global_seq_len, fn="ring_attention")
    layout = thd_layout_or_none(q, size, cu_seqlens, cu_seqlens_padded, fn="ring_attention")
    window = check_window(window_size, causal, size, q.shape[1], layout is not None, fn="ring_attention")
    sink_logits = resolve_sinks(sinks, softmax_type, q, fn="ring_attention")
    scale = resolve_softmax_scale(softmax_scale, q.shape[-1])
    kern = select_kernel(q.device, q.dtype, kernel, head_dim=q.shape[-1], value_dim=v.shape[-1])
    group = group if size > 1 else None
    if layout is not None:
        return ring_thd_attention(q, k, v, group, causal, scale, kern, layout, window, sink_logits)
    if window is not None:
        return ring_window_attention(q, k, v, group, causal, scale, kern, window, sink_logits)
    return _RingAttention.apply(q, k, v, group, causal, scale, kern, sink_logits)


def local_attention(
    q: Tensor, k: Tensor, v: Tensor, causal: bool = True, softmax_scale: Optional[float] = None, *,
    kernel: Optional[str] = None, cu_seqlens=None, cu_seqlens_padded=None, window_size=None,
    sinks: Optional[Tensor] = None, softmax_type: Optional[str] = None,
) -> Tensor:
    """Differentiable single-device attention with the same layout and kernels (CP size 1); ``sinks`` /
    ``softmax_type`` as in ``ring_attention``."""
    return ring_attention(q, k, v, None, causal, softmax_scale, kernel=kernel, cu_seqlens=cu_seqlens,
                          cu_seqlens_padded=cu_seqlens_padded, window_size=window_size, sinks=sinks,
                          softmax_type=softmax_type)
