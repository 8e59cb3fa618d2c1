"""Ulysses (all-to-all) context-parallel attention, GQA/MQA-aware, with chunked heads ("untied" Ulysses).

Layout: q [b, s_local, hq, d], k [b, s_local, hkv, d], v [b, s_local, hkv, dv], the sequence zigzag-sharded
over the Ulysses group of P ranks (rank r holds global chunks r and 2P-1-r of 2P; see ``layouts``). Returns
[b, s_local, hq, dv]. dv may differ from d (MLA): the staging buffers hold each tensor's heads x head-dim
columns, so q/k and v (and their gradients) travel at their own sizes.

Forward, per head chunk t (of ``head_chunks``):
  1. one all-to-all turns [b, s_local, heads, d] shards into the full sequence of this rank's heads: rank j
     receives query heads ``j*hq/P + t*nqc ...`` (nqc = hq/(P*head_chunks)) of every rank's shard, plus the
     key/value heads those queries use;
  2. the received shards (source order: chunks 0, 2P-1, 1, 2P-2, ...) are copied into natural sequence order
     [b, S, heads, d] (non-causal attention needs no order and keeps source order);
  3. local attention (``kernels``), or a ring over ``ring_group`` for the hybrid layout (see ``hybrid``);
  4. one all-to-all sends the output back to the owners of the sequence shards.
Every chunk reuses one pair of send/receive buffers, so the staging memory is ~1/head_chunks of sending all
heads at once (``all_to_all.track_a2a_buffer_bytes`` measures it). When a chunk is smaller than a KV group
(hq/hkv query heads per KV head), consecutive chunks share KV heads: those are sent once, and their
gradients are summed locally and sent back once, so chunking never adds all-to-all traffic.
Saved for backward: the gathered q/k/v, out and lse of each chunk (as many bytes as q, k, v, out themselves;
with replicated KV heads, k/v times rep). Backward: dout travels like q, the kernel (or ring) backward runs,
and dq/dk/dv travel back like the output. With ``regather_in_backward=True`` only q, k, v, out (the caller's
tensors) and lse are saved, and backward all-to-alls q/k/v/out again with dout, chunk by chunk, so the
gathered full-sequence tensors never exist for more than one chunk at a time (about 1.5x the traffic).
Communication is not overlapped with compute.

GQA/MQA: only key/value heads travel, never repeated query-side. When hkv % P == 0 each rank gets hkv/P of
them. Otherwise each KV head is replicated rep = P / gcd(hkv, P) times (the least rep with hkv*rep % P == 0;
replica e serves query heads e*g ... e*g+g-1 with g = hq / (hkv*rep), which keeps the query -> KV grouping
exact), replicas are gathered only while packing the send buffer, and their gradients are summed back.

Attention sinks (``sinks`` module): after the all-to-all a rank computes query heads ``q_heads(rank, t)`` of every
chunk, so it applies those heads' sink logits to its final rows (in the local kernel's or the inner ring's final
merge, once) and returns the sinks' gradient for those heads, zeros for the others.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import List, Optional, Union

import torch
import torch.distributed as dist

from .all_to_all import all_to_all_equal, hold_buffers
from .comm import group_size_and_rank
from .kernels import AttentionKernel, resolve_softmax_scale, select_kernel
from .layouts import thd_zigzag_indices
from .ring import ring_attention_backward, ring_attention_forward
from .ring_thd import ring_thd_backward, ring_thd_forward
from .ring_window import ring_window_backward, ring_window_forward
from .sinks import resolve_sinks, sinks_grad
from .thd import ThdLayout, thd_layout_or_none
from .input_checks import check_attention_inputs, check_window

Tensor = torch.Tensor
HeadIndex = Union[slice, Tensor]


@dataclass(frozen=True)
class UlyssesHeadPlan:
    """Which heads go to which rank in each head chunk, for hq query / hkv KV heads over P ranks."""

    size: int  # P, the Ulysses group size
    hq: int
    hkv: int
    head_chunks: int

    @property
    def kv_replicas(self) -> int:
        """Times each KV head is replicated so that the replicated count divides by P (1 = no replication)."""
        return self.size // math.gcd(self.hkv, self.size)

    @property
    def group(self) -> int:
        """Query heads per (replicated) KV head."""
        return self.hq // (self.hkv * self.kv_replicas)

    @property
    def q_per_chunk(self) -> int:
        return self.hq // self.size // self.head_chunks

    @property
    def kv_per_chunk(self) -> int:
        return max(1, self.q_per_chunk // self.group)

    def chunk_starts_kv_block(self, chunk: int) -> bool:
        """False when ``chunk`` uses the same KV heads as ``chunk - 1`` (chunks smaller than a KV group):
        those KV heads are not sent again, and their gradients are summed locally and sent back once."""
        if chunk == 0:
            return True
        return (chunk * self.q_per_chunk) // self.group != ((chunk - 1) * self.q_per_chunk) // self.group

    def q_heads(self, rank: int, chunk: int) -> slice:
        start = rank * (self.hq // self.size) + chunk * self.q_per_chunk
        return slice(start, start + self.q_per_chunk)

    def kv_heads(self, rank: int, chunk: int, device: torch.device) -> HeadIndex:
        """Original KV head indices (a slice, or a LongTensor with repeats when replicating)."""
        first = self.q_heads(rank, chunk).start // self.group  # first replicated KV head
        if self.kv_replicas == 1:
            return slice(first, first + self.kv_per_chunk)
        return torch.arange(first, first + self.kv_per_chunk, device=device) // self.kv_replicas


def plan_ulysses_heads(hq: int, hkv: int, ulysses_size: int, head_chunks: int = 1,
                       fn: str = "ulysses") -> UlyssesHeadPlan:
    """Check the head counts for Ulysses over ``ulysses_size`` ranks (no tensors needed: usable at config
    time) and return the head plan. Raises ValueError naming the problem (e.g. "hq % ulysses_size != 0")."""
    for name, val in (("hq", hq), ("hkv", hkv), ("ulysses_size", ulysses_size), ("head_chunks", head_chunks)):
        if isinstance(val, bool) or not isinstance(val, int) or val < 1:
            raise ValueError(f"{fn}: {name} must be a positive int, got {val!r}")
    if hq % hkv != 0:
        raise ValueError(f"{fn}: query heads ({hq}) must be a multiple of key/value heads ({hkv})")
    if hq % ulysses_size != 0:
        raise ValueError(
            f"{fn}: hq % ulysses_size != 0: {hq} query heads cannot be split over ulysses_size={ulysses_size} ranks"
        )
    per_rank = hq // ulysses_size
    if per_rank % head_chunks != 0:
        raise ValueError(
            f"{fn}: head_chunks={head_chunks} must divide the query heads per rank (hq / ulysses_size = {per_rank})"
        )
    plan = UlyssesHeadPlan(ulysses_size, hq, hkv, head_chunks)
    nqc, g = plan.q_per_chunk, plan.group
    if nqc % g != 0 and g % nqc != 0:
        raise ValueError(
            f"{fn}: head_chunks={head_chunks} gives {nqc} query heads per chunk, which must be a multiple or a "
            f"divisor of the query heads per KV head ({g}) so that no chunk splits a KV group"
        )
    return plan


def check_ulysses_inputs(
    q: Tensor, k: Tensor, v: Tensor, ulysses_size: int, ring_size: int, causal: bool, head_chunks: int,
    global_seq_len: Optional[int], fn: str,
) -> UlyssesHeadPlan:
    """Validate inputs (ValueError naming the problem, before any communication); return the head plan."""
    check_attention_inputs(q, k, v, ulysses_size * ring_size, causal, global_seq_len, fn=fn)
    return plan_ulysses_heads(q.shape[2], k.shape[2], ulysses_size, head_chunks, fn=fn)


# ----------------------------------------------------------------------------------------------------------
# Sequence order after the all-to-all: received shard i (chunks i and 2P-1-i) <-> natural order.
# ----------------------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class ThdOrder:
    """Packed sequences: where the all-to-all's source-order tokens go. ``gather[t]`` is the source-order index
    of target token t, ``scatter`` its inverse; the target is the per-document zigzag shard of ring rank rho over
    the R ring ranks (R = 1: the natural packed order), ``layout`` the packed layout for that ring."""

    gather: Tensor
    scatter: Tensor
    layout: ThdLayout


def thd_order(layout: ThdLayout, cu_seqlens_padded, ulysses_size: int, ring_size: int, ring_rank: int,
              device) -> ThdOrder:
    """The ThdOrder of Ulysses group ``ring_rank`` (cp ranks ring_rank*U ... ring_rank*U+U-1 of N = U*R)."""
    n = ulysses_size * ring_size
    src = torch.cat([thd_zigzag_indices(cu_seqlens_padded, n, ring_rank * ulysses_size + j)
                     for j in range(ulysses_size)])
    tgt = thd_zigzag_indices(cu_seqlens_padded, ring_size, ring_rank)
    where = torch.full((layout.total,), -1, dtype=torch.long)
    where[src] = torch.arange(src.numel())
    gather = where[tgt]
    return ThdOrder(gather.to(device), torch.argsort(gather).to(device), layout)


def _gather_sequence(recv: Tensor, dst: Tensor, natural) -> None:
    """recv [P, b, s, n, d] (may be strided) -> dst [b, P*s, n, d] (contiguous).

    ``natural``: recv[i] holds zigzag chunks i and 2P-1-i; dst gets the 2P chunks in order. A ``ThdOrder``:
    dst gets the tokens in its target order. Otherwise dst is recv's shards concatenated in source order."""
    size, b, s, n, d = recv.shape
    if isinstance(natural, ThdOrder):
        dst.copy_(recv.transpose(0, 1).reshape(b, size * s, n, d).index_select(1, natural.gather))
        return
    if not natural:
        dst.view(b, size, s, n, d).copy_(recv.transpose(0, 1))
        return
    half = s // 2
    chunks = dst.view(b, 2 * size, half, n, d)
    chunks[:, :size].copy_(recv[:, :, :half].transpose(0, 1))
    for i in range(size):
        chunks[:, 2 * size - 1 - i].copy_(recv[i, :, half:])


def _scatter_sequence(src: Tensor, send: Tensor, natural) -> None:
    """Inverse of ``_gather_sequence``: src [b, P*s, n, d] -> send [P, b, s, n, d] (may be strided)."""
    size, b, s, n, d = send.shape
    if isinstance(natural, ThdOrder):
        send.copy_(src.index_select(1, natural.scatter).view(b, size, s, n, d).transpose(0, 1))
        return
    if not natural:
        send.copy_(src.reshape(b, size, s, n, d).transpose(0, 1))
        return
    half = s // 2
    chunks = src.reshape(b, 2 * size, half, n, d)
    send[:, :, :half].copy_(chunks[:, :size].transpose(0, 1))
    for i in range(size):
        send[i, :, half:].copy_(chunks[:, 2 * size - 1 - i])


def _pick_heads(x: Tensor, heads: HeadIndex) -> Tensor:
    return x[:, :, heads] if isinstance(heads, slice) else x.index_select(2, heads)


# ----------------------------------------------------------------------------------------------------------
# The autograd function shared by ulysses_attention and hybrid_attention.
# ----------------------------------------------------------------------------------------------------------


def _inner_forward(q, k, v, ring_group, causal, scale, kernel, thd=None, window=None, sinks=None):
    """(out, lse) of the gathered heads; ``sinks``: those heads' sink logits, applied once to the final rows."""
    if thd is not None:
        return ring_thd_forward(q, k, v, ring_group, causal, scale, kernel, thd.layout, window, sinks)
    if window is not None:
        return ring_window_forward(q, k, v, ring_group, causal, scale, kernel, window, sinks)
    if ring_group is None and sinks is None:
        return kernel.forward(q, k, v, causal, scale)
    return ring_attention_forward(q, k, v, ring_group, causal, scale, kernel, sinks)


def _inner_backward(dout, q, k, v, out, lse, ring_group, causal, scale, kernel, thd=None, window=None):
    if thd is not None:
        return ring_thd_backward(dout, q, k, v, out, lse, ring_group, causal, scale, kernel, thd.layout, window)
    if window is not None:
        return ring_window_backward(dout, q, k, v, out, lse, ring_group, causal, scale, kernel, window)
    if ring_group is None:
        return kernel.backward(dout, q, k, v, out, lse, causal, scale)
    return ring_attention_backward(dout, q, k, v, out, lse, ring_group, causal, scale, kernel)


def _front(buf: Tensor, f: int) -> Tensor:
    """A contiguous [P, b, s, f] view on the front of a [P, b, s, F] buffer's storage (f <= F)."""
    size, b, s, _ = buf.shape
    return buf.view(-1)[: size * b * s * f].view(size, b, s, f)


def _features(t: Tensor) -> int:
    """Elements per token of a [b, s, n, e] tensor: n heads of e (tensors of different head dims share a
    buffer by their flattened head x head-dim columns, so K and V travel at their own sizes)."""
    return t.shape[2] * t.shape[3]


def _to_heads(sources, outs, send, recv, group, natural) -> None:
    """All-to-all sequence shards -> full sequence of a few heads.

    ``sources``: (x [b, s_local, H, e], heads_of(j) -> x's head index for rank j); ``outs``: matching
    [b, P*s_local, n, e] tensors (e may differ per tensor). Uses the front of the reused ``send``/``recv``
    buffers ([P, b, s_local, F], F >= the outs' total features)."""
    widths = [_features(o) for o in outs]
    snd, rcv = _front(send, sum(widths)), _front(recv, sum(widths))
    for j in range(snd.shape[0]):
        lo = 0
        for (x, heads_of), o, w in zip(sources, outs, widths):
            snd[j, :, :, lo:lo + w].unflatten(-1, o.shape[2:]).copy_(_pick_heads(x, heads_of(j)))
            lo += w
    all_to_all_equal(snd, rcv, group)
    lo = 0
    for o, w in zip(outs, widths):
        _gather_sequence(rcv[..., lo:lo + w].unflatten(-1, o.shape[2:]), o, natural)
        lo += w


def _to_sequence(tensors, receivers, send, recv, group, natural) -> None:
    """Inverse of ``_to_heads``: for [b, P*s_local, n, e] ``tensors``, ``receivers[i](j, part)`` receives the
    [b, s_local, n, e] part of tensor i that rank j computed for this rank's sequence shard."""
    widths = [_features(t) for t in tensors]
    snd, rcv = _front(send, sum(widths)), _front(recv, sum(widths))
    lo = 0
    for t, w in zip(tensors, widths):
        _scatter_sequence(t, snd[..., lo:lo + w].unflatten(-1, t.shape[2:]), natural)
        lo += w
    all_to_all_equal(snd, rcv, group)
    for j in range(rcv.shape[0]):
        lo = 0
        for t, receive, w in zip(tensors, receivers, widths):
            receive(j, rcv[j, :, :, lo:lo + w].unflatten(-1, t.shape[2:]))
            lo += w


class _UlyssesAttention(torch.autograd.Function):
    @staticmethod
    def forward(ctx, q, k, v, plan: UlyssesHeadPlan, group, ring_group, causal, scale, kernel: AttentionKernel,
                regather: bool, thd: Optional[ThdOrder] = None, window=None, sinks=None):
        size, b, s, d, dv = plan.size, q.shape[0], q.shape[1], q.shape[3], v.shape[3]
        rank = group_size_and_rank(group)[1]
        nqc, nkc, seq = plan.q_per_chunk, plan.kv_per_chunk, plan.size * q.shape[1]
        # non-causal attention does not depend on the sequence order; packed documents always do
        natural = thd if thd is not None else (causal or window is not None) and size > 1
        # reused by every chunk: [q | k | v] heads, each at its own head dim (flattened columns)
        send = q.new_empty(size, b, s, nqc * d + nkc * (d + dv))
        recv = torch.empty_like(send)
        out = q.new_empty(b, s, q.shape[2], dv)
        saved: List[Tensor] = []
        staging = [send, recv]
        if regather:  # gathered q/k/v are not saved: one set of buffers serves every chunk
            ql, kl, vl = q.new_empty(b, seq, nqc, d), q.new_empty(b, seq, nkc, d), q.new_empty(b, seq, nkc, dv)
            staging += [ql, kl, vl]

        def out_into(t):
            return lambda j, part: out[:, :, plan.q_heads(j, t)].copy_(part)

        with hold_buffers(*staging):
            for t in range(plan.head_chunks):
                new_kv = plan.chunk_starts_kv_block(t)  # else: the previous chunk's KV heads serve this one
                if not regather:
                    ql = q.new_empty(b, seq, nqc, d)
                    if new_kv:
                        kl, vl = q.new_empty(b, seq, nkc, d), q.new_empty(b, seq, nkc, dv)
                sources = [(q, lambda j: plan.q_heads(j, t))]
                outs = [ql]
                if new_kv:
                    kv_of = lambda j: plan.kv_heads(j, t, q.device)  # noqa: E731
                    sources += [(k, kv_of), (v, kv_of)]
                    outs += [kl, vl]
                _to_heads(sources, outs, send, recv, group, natural)
                head_sinks = None if sinks is None else sinks[plan.q_heads(rank, t)]
                ol, lse = _inner_forward(ql, kl, vl, ring_group, causal, scale, kernel, thd, window, head_sinks)
                _to_sequence([ol], [out_into(t)], send, recv, group, natural)
                saved += [lse] if regather else [ql, kl, vl, ol, lse]
        if regather:
            saved = [q, k, v, out] + saved
        ctx.save_for_backward(*saved, sinks)
        ctx.args = (plan, group, ring_group, causal, scale, kernel, regather, thd, window)
        ctx.rank = rank
        ctx.kv_dtype = k.dtype
        ctx.head_dim = d
        return out

    @staticmethod
    def backward(ctx, dout):
        plan, group, ring_group, causal, scale, kernel, regather, thd, window = ctx.args
        *saved, sinks = ctx.saved_tensors
        dsinks = torch.zeros_like(sinks) if ctx.needs_input_grad[12] else None
        if regather:
            q, k, v, out = saved[:4]
            saved = saved[4:]
        size, (b, s, hq, dvh), d = plan.size, dout.shape, ctx.head_dim
        nqc, nkc, seq = plan.q_per_chunk, plan.kv_per_chunk, plan.size * s
        k_shape, v_shape = (b, s, plan.hkv, d), (b, s, plan.hkv, dvh)
        natural = thd if thd is not None else (causal or window is not None) and size > 1
        # in: dout (+ q, out, k, v when regathering); back: dq, dk, dv -- each at its own head dim
        width_in = nqc * dvh + (nqc * (d + dvh) + nkc * (d + dvh) if regather else 0)
        width_back = nqc * d + nkc * (d + dvh)
        send = dout.new_empty(size, b, s, max(width_in, width_back))
        recv = torch.empty_like(send)
        dout_l = dout.new_empty(b, seq, nqc, dvh)
        staging = [send, recv, dout_l]
        if regather:
            ql, ol = dout.new_empty(b, seq, nqc, d), dout.new_empty(b, seq, nqc, dvh)
            kl, vl = dout.new_empty(b, seq, nkc, d), dout.new_empty(b, seq, nkc, dvh)
            staging += [ql, ol, kl, vl]
        dq = dout.new_empty(b, s, hq, d)
        acc_dtype = torch.float64 if ctx.kv_dtype == torch.float64 else torch.float32
        if plan.kv_replicas > 1:  # replicas' gradients are summed into the original KV heads
            dk = torch.zeros(k_shape, dtype=acc_dtype, device=dout.device)
            dv = torch.zeros(v_shape, dtype=acc_dtype, device=dout.device)
        else:
            dk, dv = dout.new_empty(k_shape), dout.new_empty(v_shape)

        def dq_into(t):
            return lambda j, part: dq[:, :, plan.q_heads(j, t)].copy_(part)

        def kv_into(t, grad):
            def receive(j, part):
                idx = plan.kv_heads(j, t, dout.device)
                if isinstance(idx, slice):
                    grad[:, :, idx].copy_(part)  # each KV head's gradient arrives exactly once
                else:
                    grad.index_add_(2, idx, part.to(grad.dtype))
            return receive

        dkl_acc = dvl_acc = None
        with hold_buffers(*staging):
            for t in range(plan.head_chunks):
                new_kv = plan.chunk_starts_kv_block(t)
                q_of = lambda j: plan.q_heads(j, t)  # noqa: E731
                if regather:
                    lse = saved[t]
                    sources, outs = [(dout, q_of), (q, q_of), (out, q_of)], [dout_l, ql, ol]
                    if new_kv:
                        kv_of = lambda j: plan.kv_heads(j, t, dout.device)  # noqa: E731
                        sources += [(k, kv_of), (v, kv_of)]
                        outs += [kl, vl]
                    _to_heads(sources, outs, send, recv, group, natural)
                else:
                    ql, kl, vl, ol, lse = saved[5 * t: 5 * t + 5]
                    _to_heads([(dout, q_of)], [dout_l], send, recv, group, natural)
                dql, dkl, dvl = _inner_backward(dout_l, ql, kl, vl, ol, lse, ring_group, causal, scale, kernel, thd,
                                                window)
                if dsinks is not None:  # (ol, lse) are the sink-including rows of this rank's heads
                    heads = plan.q_heads(ctx.rank, t)
                    dsinks[heads] += sinks_grad(dout_l, ol, lse, sinks[heads])
                # chunks that share KV heads sum their KV gradients locally; they travel once, with the last one
                last_kv = t == plan.head_chunks - 1 or plan.chunk_starts_kv_block(t + 1)
                if not (new_kv and last_kv):
                    if new_kv:
                        dkl_acc, dvl_acc = dkl.to(acc_dtype), dvl.to(acc_dtype)
                    else:
                        dkl_acc.add_(dkl)
                        dvl_acc.add_(dvl)
                    dkl, dvl = dkl_acc, dvl_acc
                if last_kv:
                    _to_sequence([dql, dkl, dvl], [dq_into(t), kv_into(t, dk), kv_into(t, dv)],
                                 send, recv, group, natural)
                    dkl_acc = dvl_acc = None
                else:
                    _to_sequence([dql], [dq_into(t)], send, recv, group, natural)
                del dql, dkl, dvl
        return (dq, dk.to(ctx.kv_dtype), dv.to(ctx.kv_dtype), None, None, None, None, None, None, None, None, None,
                dsinks)


def ulysses_core(
    q: Tensor, k: Tensor, v: Tensor, plan: UlyssesHeadPlan, group: Optional[dist.ProcessGroup],
    ring_group: Optional[dist.ProcessGroup], causal: bool, scale: float, kernel: AttentionKernel,
    regather_in_backward: bool = False, thd: Optional[ThdOrder] = None, window=None, sinks: Optional[Tensor] = None,
) -> Tensor:
    """Differentiable Ulysses attention on already validated inputs (``ring_group`` None: local kernel;
    ``thd``: a packed sequence, see ``thd_order``; ``window``: a normalized sliding window; ``sinks``: the [hq]
    sink logits of ``sinks.resolve_sinks``, or None)."""
    return _UlyssesAttention.apply(q, k, v, plan, group, ring_group, causal, scale, kernel, regather_in_backward,
                                   thd, window, sinks)


def thd_order_for(q: Tensor, ulysses_size: int, ring_group, cu_seqlens, cu_seqlens_padded,
                  fn: str) -> Optional[ThdOrder]:
    """Validate a packed sequence for Ulysses x ring (ValueError before communicating) and build its ThdOrder."""
    ring_size, ring_rank = group_size_and_rank(ring_group)
    layout = thd_layout_or_none(q, ulysses_size * ring_size, cu_seqlens, cu_seqlens_padded, fn=fn)
    if layout is None:
        return None
    ring_layout = ThdLayout(cu_seqlens, cu_seqlens_padded, ring_size, fn=fn)
    cup = cu_seqlens if cu_seqlens_padded is None else cu_seqlens_padded
    return thd_order(ring_layout, cup, ulysses_size, ring_size, ring_rank, q.device)


def ulysses_attention(
    q: Tensor,
    k: Tensor,
    v: Tensor,
    group: Optional[dist.ProcessGroup] = None,
    causal: bool = True,
    softmax_scale: Optional[float] = None,
    head_chunks: int = 1,
    *,
    kernel: Optional[str] = None,
    global_seq_len: Optional[int] = None,
    regather_in_backward: bool = False,
    cu_seqlens=None,
    cu_seqlens_padded=None,
    window_size=None,
    sinks: Optional[Tensor] = None,
    softmax_type: Optional[str] = None,
) -> Tensor:
    """Exact attention over a zigzag-sharded sequence split across ``group`` by all-to-all (module docstring).

    q [b, s_local, hq, d], k [b, s_local, hkv, d], v [b, s_local, hkv, dv] -> [b, s_local, hq, dv] (dv may
    differ from d). Needs hq % P == 0 (P = group size)
    and ``head_chunks`` dividing hq / P. ``group=None`` or a one-rank group computes local attention.
    ``kernel`` names a local kernel (``kernels.KERNELS``) or "auto". ``regather_in_backward=True`` saves only
    q, k, v, out and lse and all-to-alls q/k/v/out again in backward, chunk by chunk (less memory, about 1.5x
    the traffic). ``cu_seqlens`` / ``cu_seqlens_padded`` (int32, global, the same on every rank): a packed
    sequence on [1, s_local, h, d] tensors (per-document zigzag, see ``thd``); after the all-to-all the tokens
    are put in natural packed order and each document attends only to itself. ``window_size=(left, right)``:
    sliding-window attention (flash-attn convention), applied by the local attention after the all-to-all.
    ``sinks`` / ``softmax_type``: attention sinks as in ``ring.ring_attention``; each rank's sinks gradient holds
    the heads it computed after the all-to-all (zeros for the others): sum it over the group.
    Raises ValueError before communicating.
    """
    size, _ = group_size_and_rank(group)
    plan = check_ulysses_inputs(q, k, v, size, 1, causal, head_chunks, global_seq_len, fn="ulysses_attention")
    thd = thd_order_for(q, size, None, cu_seqlens, cu_seqlens_padded, fn="ulysses_attention")
    window = check_window(window_size, causal, size, q.shape[1], thd is not None, fn="ulysses_attention")
    sink_logits = resolve_sinks(sinks, softmax_type, q, fn="ulysses_attention")
    scale = resolve_softmax_scale(softmax_scale, q.shape[-1])
    kern = select_kernel(q.device, q.dtype, kernel, head_dim=q.shape[-1], value_dim=v.shape[-1])
    group = group if size > 1 else None
    return ulysses_core(q, k, v, plan, group, None, causal, scale, kern, bool(regather_in_backward), thd, window,
                        sink_logits)
