"""Sliding-window attention under context parallelism: only the K/V the window needs travel.

Layout: the zigzag shard of ``layouts`` (rank r holds global chunks r and 2P-1-r of 2P, chunk c = s_local / 2),
q [b, s_local, hq, d], k [b, s_local, hkv, d], v [b, s_local, hkv, dv]. Window: ``window.normalize_window``.

Instead of rotating whole K/V blocks around the ring, each rank works out (every rank knows the layout) which key
positions of every other rank its queries can see -- for each of its two query chunks, the keys within
``[first - left, last + right]`` that lie in the peer's chunks -- and the peers send exactly those, all at once
(one batch of point-to-point messages, K and V at their own sizes). A window shorter than a chunk needs a halo
of at most ``left`` (+ ``right``) tokens from the one or two ranks holding the neighbouring chunks; a window
covering everything degenerates to an all-gather of K/V (prefer the plain ring then: ``window_size=(-1, -1)``).
The own block is computed while the messages are in flight. Blocks are split into dense sub-blocks by
``window.band_blocks`` (unmasked, top-left causal, or small masked edges).

Backward: the same K/V pieces are exchanged again (nothing but q, k, v, out, lse is saved), each rank computes
the gradients of the pieces it received in float32 (float64), and sends them back to their owners, who add them.
"""

from __future__ import annotations

from typing import List, Optional, Tuple

import torch
import torch.distributed as dist

from .comm import group_size_and_rank, record_bytes_sent
from .kernels import AttentionKernel
from .sinks import apply_sinks, sinks_grad
from .thd import empty_accumulators, merge_rows_
from .window import INF, window_backward_blocks, window_forward_blocks, windowed_blocks

Tensor = torch.Tensor
Segment = Tuple[int, int, int]  # (global start, local start, length)


def _acc_dtype(dtype: torch.dtype) -> torch.dtype:
    return torch.float64 if dtype == torch.float64 else torch.float32


def segments(size: int, rank: int, s_local: int) -> List[Segment]:
    if size == 1:
        return [(0, 0, s_local)]
    c = s_local // 2
    return [(rank * c, 0, c), ((2 * size - 1 - rank) * c, c, c)]


def needed_ranges(size: int, q_rank: int, kv_rank: int, s_local: int, window) -> List[Segment]:
    """Key ranges of ``kv_rank``'s shard that ``q_rank``'s queries see: (global start, kv_rank-local start, n)."""
    left, right = window
    out: List[Segment] = []
    for gk, lk, nk in segments(size, kv_rank, s_local):
        lo, hi = gk + nk, gk  # union over the query segments (an interval: the window is one band)
        for gq, _, nq in segments(size, q_rank, s_local):
            a = max(gk, gq - left) if left < INF else gk
            b = min(gk + nk, gq + nq + right) if right < INF else gk + nk
            if a < b:
                lo, hi = min(lo, a), max(hi, b)
        if lo < hi:
            out.append((lo, lk + lo - gk, hi - lo))
    return out


def _pack(x: Tensor, ranges: List[Segment]) -> Tensor:
    return torch.cat([x[:, l:l + n] for _, l, n in ranges], dim=1).contiguous()


class _Exchange:
    """Send each peer the pieces it needs from us and receive the pieces we need, in one batch of P2P ops."""

    def __init__(self, group, size: int, rank: int, s_local: int, window) -> None:
        self.group, self.size, self.rank = group, size, rank
        self.peers = [p for p in range(size) if p != rank]
        self.send_ranges = {p: needed_ranges(size, p, rank, s_local, window) for p in self.peers}
        self.recv_ranges = {p: needed_ranges(size, rank, p, s_local, window) for p in self.peers}

    def _run(self, send: dict, recv: dict) -> list:
        ops = []
        for p in self.peers:
            peer = dist.get_global_rank(self.group, p)
            pairs = [(dist.isend, t) for t in send.get(p, ())] + [(dist.irecv, t) for t in recv.get(p, ())]
            # lower rank sends first, so that transports pairing operations in order match up
            if self.rank > p:
                pairs = [x for x in pairs if x[0] is dist.irecv] + [x for x in pairs if x[0] is dist.isend]
            for op, t in pairs:
                ops.append(dist.P2POp(op, t, peer, self.group))
                if op is dist.isend:
                    record_bytes_sent(t.numel() * t.element_size())
        return dist.batch_isend_irecv(ops) if ops else []

    def start_kv(self, k: Tensor, v: Tensor):
        send = {p: (_pack(k, r), _pack(v, r)) for p, r in self.send_ranges.items() if r}
        recv = {}
        for p, r in self.recv_ranges.items():
            n = sum(x[2] for x in r)
            if n:
                recv[p] = (k.new_empty(k.shape[0], n, *k.shape[2:]), v.new_empty(v.shape[0], n, *v.shape[2:]))
        works = self._run(send, recv)
        return works, send, recv

    def key_segments(self, p: int) -> List[Segment]:
        """The received pieces of peer p as key segments (global start, offset in the received buffer, n)."""
        out, off = [], 0
        for g, _, n in self.recv_ranges[p]:
            out.append((g, off, n))
            off += n
        return out


def _wait(works) -> None:
    for w in works:
        w.wait()


def ring_window_forward(q, k, v, group, causal: bool, scale: float, kernel: AttentionKernel, window,
                        sinks: Optional[Tensor] = None) -> Tuple[Tensor, Tensor]:
    """(out in q.dtype, lse fp32/fp64) of the windowed rows; ``sinks`` ([hq] logits) applied once to the final
    rows (``sinks.apply_sinks``)."""
    size, rank = group_size_and_rank(group)
    s = q.shape[1]
    segs = segments(size, rank, s)
    acc_out, acc_lse = empty_accumulators(q, v, _acc_dtype(q.dtype))
    ex = _Exchange(group, size, rank, s, window) if size > 1 else None
    works, _, recv = ex.start_kv(k, v) if ex is not None else ([], {}, {})
    window_forward_blocks(q, k, v, windowed_blocks(segs, segs, window), window, scale, kernel, acc_out, acc_lse,
                          merge_rows_)
    _wait(works)
    for p, (kp, vp) in recv.items():
        blocks = windowed_blocks(segs, ex.key_segments(p), window)
        window_forward_blocks(q, kp, vp, blocks, window, scale, kernel, acc_out, acc_lse, merge_rows_)
    if sinks is not None:
        acc_out, acc_lse = apply_sinks(acc_out, acc_lse, sinks)
    return acc_out.to(q.dtype), acc_lse


def ring_window_backward(dout, q, k, v, out, lse, group, causal: bool, scale: float, kernel: AttentionKernel,
                         window) -> Tuple[Tensor, Tensor, Tensor]:
    size, rank = group_size_and_rank(group)
    s = q.shape[1]
    segs = segments(size, rank, s)
    acc = _acc_dtype(q.dtype)
    dq = torch.zeros(q.shape, dtype=acc, device=q.device)
    dk = torch.zeros(k.shape, dtype=acc, device=k.device)
    dv = torch.zeros(v.shape, dtype=acc, device=v.device)
    ex = _Exchange(group, size, rank, s, window) if size > 1 else None
    works, send, recv = ex.start_kv(k, v) if ex is not None else ([], {}, {})
    window_backward_blocks(dout, q, k, v, out, lse, windowed_blocks(segs, segs, window), window, scale, kernel,
                           dq, dk, dv)
    _wait(works)
    grads = {}
    for p, (kp, vp) in recv.items():
        dkp = torch.zeros(kp.shape, dtype=acc, device=kp.device)
        dvp = torch.zeros(vp.shape, dtype=acc, device=vp.device)
        blocks = windowed_blocks(segs, ex.key_segments(p), window)
        window_backward_blocks(dout, q, kp, vp, out, lse, blocks, window, scale, kernel, dq, dkp, dvp)
        grads[p] = (dkp, dvp)
    if ex is not None:  # the pieces' gradients go home: we receive, for each piece we sent, its gradient
        back = {p: tuple(torch.empty(t.shape, dtype=acc, device=t.device) for t in pair) for p, pair in send.items()}
        _wait(ex._run(grads, back))
        for p, (dkp, dvp) in back.items():
            off = 0
            for _, l, n in ex.send_ranges[p]:
                dk[:, l:l + n].add_(dkp[:, off:off + n])
                dv[:, l:l + n].add_(dvp[:, off:off + n])
                off += n
    return dq.to(q.dtype), dk.to(k.dtype), dv.to(v.dtype)


class _RingWindowAttention(torch.autograd.Function):
    @staticmethod
    def forward(ctx, q, k, v, group, causal, scale, kernel, window, sinks=None):
        out, lse = ring_window_forward(q, k, v, group, causal, scale, kernel, window, sinks)
        ctx.save_for_backward(q, k, v, out, lse, sinks)
        ctx.args = (group, causal, scale, kernel, window)
        return out

    @staticmethod
    def backward(ctx, dout):
        q, k, v, out, lse, sinks = ctx.saved_tensors
        dq, dk, dv = ring_window_backward(dout, q, k, v, out, lse, *ctx.args)
        dsinks = sinks_grad(dout, out, lse, sinks) if ctx.needs_input_grad[8] else None
        return dq, dk, dv, None, None, None, None, None, dsinks


def ring_window_attention(q, k, v, group: Optional[dist.ProcessGroup], causal: bool, scale: float,
                          kernel: AttentionKernel, window, sinks: Optional[Tensor] = None) -> Tensor:
    """Differentiable windowed CP attention on validated inputs (``ring.ring_attention(..., window_size=...)``);
    ``sinks``: [hq] sink logits (``sinks.resolve_sinks``) or None."""
    return _RingWindowAttention.apply(q, k, v, group, causal, scale, kernel, window, sinks)
