"""Sequence-chunked layer recompute: a transformer layer run chunk by chunk over its local sequence, in forward and
in its recomputed backward, so that no full-sequence activation of the layer's inside is ever materialized.

Only core attention mixes tokens; everything else in a layer (norms, projections, RoPE, MLP, residuals) is per token.
So a layer can run on one sequence chunk at a time if its core attention sees the keys and values of the *whole*
sequence. ``sequence_chunked_checkpoint(run_chunk, hidden, n_chunks)`` runs ``run_chunk(x_c, start, end)`` (the
layer on rows [start, end) of ``hidden`` along ``seq_dim``) under an active ``ChunkState``; the layer's core
attention (an integration calls ``chunk_core_attention`` when ``active_sequence_chunking()`` is not None) then
attends its chunk's queries to K/V buffers of the whole local sequence:

Forward (no grad, like a reentrant full-recompute checkpoint: only the layer input is saved):
  * causal layers (keys at or before the query only): one pass in chunk order; each chunk writes its K/V rows into
    the buffers and attends to the rows written so far;
  * otherwise (no mask, a window reaching forward): a K/V pass first (``kv`` mode: the layer runs up to its core
    attention, which stores K/V and stops the layer with ``StopAfterKV``), then the chunk pass.
Backward (recompute):
  1. K/V pass, no grad: the K/V buffers of the whole local sequence (the only full-length tensors besides the layer
     input, its gradient, and dK/dV accumulated in float32);
  2. chunk pass with grad, in reverse chunk order: the chunk's layer is recomputed and differentiated; its core
     attention's backward adds the chunk's dK/dV contributions (every key block it attended) into the float32
     accumulators. For causal layers the accumulator rows of the chunk itself are complete once that chunk's
     attention backward ran (later chunks came first), so they flow into the chunk's own K/V graph at once (fused);
  3. otherwise a K/V pass with grad after all chunks: the K/V part of each chunk's layer is recomputed and
     differentiated with the completed dK/dV rows.
Parameter gradients accumulate as in any reentrant checkpoint (``torch.autograd.backward`` inside backward).

Attention blocks: query chunk [a, b) against the buffered keys, split with ``attention.window.windowed_blocks``
(unmasked blocks, the causal diagonal, masked band edges of a sliding window), each computed by the layer's kernel
and merged by log-sum-exp in float32 (the ring's block algebra over chunks of time instead of ranks); block
gradients use the chunk's final (out, lse) (the kernels' split-KV contract). Results equal the unchunked layer up
to floating-point summation order.

Ring context parallelism (``group``: the local sequence is the rank's zigzag shard, ``ring_window.segments``): each
chunk's queries attend to every rank's K/V, which pass around the ring once per chunk (and once more in the chunk's
backward, with the float32 dK/dV accumulators travelling one step behind, as in ``attention.ring``); the K/V pass
runs first (other ranks need this rank's whole K/V) and dK/dV are complete only after the last chunk (no fused path).

Ulysses context parallelism (``ulysses_group``): each chunk's queries, keys and values go to the group's ranks by
head with one all-to-all each (this rank's query heads and the KV heads they use, replicated when the KV heads do
not divide by the group size, as in ``attention.ulysses``), so the buffers hold this rank's heads of the whole
sequence (as many bytes as the rank's own K/V of all heads); the chunk's output, its gradient and dQ travel back
the same way, and each chunk's completed dK/dV rows return to their owners after the last chunk (``kv_grads``).
Hybrid CP is both: Ulysses inside groups of consecutive ranks, and the ring across them passes the buffers (the
ring rank's share of the sequence, ``attention.hybrid``'s layout). Chunking adds no all-to-all traffic over the
unchunked Ulysses attention (the same tensors travel, in N pieces).

Packed documents (``documents``: THD's cu_seqlens and cu_seqlens_padded, each document zigzag-sharded on its own
under CP): the same blocks, cut to each document's real tokens and paired only within a document.

Not here (refused by the integration, by name): random ops inside the layer (dropout), a layer whose K/V for a
token depend on other tokens.
"""

from __future__ import annotations

from typing import Callable, List, Optional, Sequence, Tuple

import torch

from ..attention.all_to_all import all_to_all_equal
from ..attention.comm import RingExchange, group_size_and_rank
from ..attention.kernels import AttentionKernel
from ..attention.ring_window import Segment, segments
from ..attention.thd import ThdLayout, empty_accumulators, merge_rows_
from ..attention.ulysses import UlyssesHeadPlan, plan_ulysses_heads
from ..attention.window import INF, normalize_window, window_backward_blocks, window_forward_blocks, windowed_blocks
from ..options import DEFAULT_SEQUENCE_CHUNK_TOKENS, auto_tiles

Tensor = torch.Tensor


def auto_sequence_chunks(tokens: int, chunk_tokens: int = DEFAULT_SEQUENCE_CHUNK_TOKENS) -> int:
    """The number of chunks ``recompute.sequence_chunks=auto`` means for ``tokens`` local tokens (options.auto_tiles:
    ceil(tokens / chunk_tokens), at least 1)."""
    return auto_tiles(int(tokens), int(chunk_tokens))


def chunk_bounds(length: int, n_chunks: int) -> List[Tuple[int, int]]:
    """``n_chunks`` contiguous row ranges covering [0, length), sizes differing by at most one (the first ones
    larger); ValueError when there are more chunks than rows."""
    if isinstance(n_chunks, bool) or not isinstance(n_chunks, int) or n_chunks < 1:
        raise ValueError(f"sequence chunks must be a positive int, got {n_chunks!r}")
    if n_chunks > length:
        raise ValueError(f"recompute.sequence_chunks={n_chunks} exceeds the {length} tokens of the local sequence")
    base, extra = divmod(length, n_chunks)
    out, start = [], 0
    for i in range(n_chunks):
        end = start + base + (1 if i < extra else 0)
        out.append((start, end))
        start = end
    return out


class StopAfterKV(Exception):
    """Raised by ``chunk_core_attention`` in ``kv`` mode once the chunk's K/V are stored: the rest of the layer is
    not needed for that pass."""


class ChunkState:
    """One pass of a chunked layer: the chunk being run, the mode, the K/V buffers and (backward) their float32
    gradient accumulators. ``mode``: ``kv`` (store K/V, stop the layer) or ``attend`` (attend and go on)."""

    def __init__(self, bounds: Sequence[Tuple[int, int]], group=None, ulysses_group=None, documents=None) -> None:
        self.bounds = list(bounds)
        self.length = self.bounds[-1][1]  # local rows
        self.index = 0
        self.mode = "attend"
        self.k: Optional[Tensor] = None  # [b, key_length, hkv (this rank's Ulysses share), d]
        self.v: Optional[Tensor] = None
        self.filled = 0  # local rows [0, filled) have their K/V in the buffers
        self.dk: Optional[Tensor] = None  # float32/float64 accumulators, backward only
        self.dv: Optional[Tensor] = None
        self.fused = False  # backward: the attention returns its own chunk's completed dK/dV rows
        self.captured: Optional[Tuple[Tensor, Tensor]] = None  # kv mode: the chunk's k, v (with their graph)
        self.causal_like: Optional[bool] = None  # learned from the layer's core attention
        self.ring_size, self.ring_rank = group_size_and_rank(group)
        self.ulysses_size, self.ulysses_rank = group_size_and_rank(ulysses_group)
        self.group = group if self.ring_size > 1 else None  # the ring group (None: no ring)
        self.ulysses_group = ulysses_group if self.ulysses_size > 1 else None  # the all-to-all group
        # hybrid's numbering (attention.hybrid): Ulysses groups are runs of consecutive CP ranks
        self.cp_size = self.ring_size * self.ulysses_size
        self.cp_rank = self.ring_rank * self.ulysses_size + self.ulysses_rank
        # the buffers hold the ring rank's share of the sequence: its Ulysses group's shards for this rank's heads
        self.key_length = self.length * self.ulysses_size
        self.heads: Optional[UlyssesHeadPlan] = None  # which heads go to which Ulysses rank (set by plan_heads)
        # packed documents (cu_seqlens, cu_seqlens_padded): attention within each document's real tokens only
        self.docs: Optional[ThdLayout] = None
        if documents is not None:
            self.docs = ThdLayout(*documents, cp_size=self.cp_size, fn="sequence-chunked layer")
            if self.docs.total != self.length * self.cp_size:
                raise ValueError(f"sequence-chunked layer: cu_seqlens_padded covers {self.docs.total} positions but "
                                 f"the local sequence has {self.length} tokens on each of {self.cp_size} CP ranks")
        elif self.cp_size > 1 and self.length % 2:
            raise ValueError(f"sequence-chunked layer under context parallelism: {self.length} local tokens are not "
                             "two zigzag halves")

    @property
    def rows(self) -> Tuple[int, int]:
        return self.bounds[self.index]

    def begin(self, index: int, mode: str) -> None:
        self.index, self.mode, self.captured = index, mode, None

    def plan_heads(self, hq: int, hkv: int) -> None:
        """Under Ulysses: which query and key/value heads each Ulysses rank attends (``ulysses.plan_ulysses_heads``:
        KV heads are replicated when their count does not divide by the group size)."""
        if self.ulysses_size > 1 and self.heads is None:
            self.heads = plan_ulysses_heads(hq, hkv, self.ulysses_size, 1, fn="sequence-chunked attention")

    def store(self, k: Tensor, v: Tensor) -> None:
        """Write the current chunk's K/V ([b, rows, h, d]) into the buffers (allocated at the first chunk); under
        Ulysses, this rank's heads of every Ulysses rank's chunk, at their places in the ring rank's share."""
        a, b = self.rows
        if k.shape[1] != b - a or v.shape[1] != b - a:
            raise ValueError(f"sequence-chunked layer: core attention got {k.shape[1]} key rows for chunk "
                             f"{self.index} of {b - a} rows (sequence parallelism or a layer that changes the "
                             "sequence length is not supported)")
        with torch.no_grad():
            k, v = self.gather_kv(k), self.gather_kv(v)
            if self.k is None:
                self.k = k.new_empty((k.shape[0], self.key_length) + tuple(k.shape[2:]))
                self.v = v.new_empty((v.shape[0], self.key_length) + tuple(v.shape[2:]))
            for row, n, buf in self.buffer_rows((a, b)):
                self.k[:, buf:buf + n].copy_(k[:, row:row + n])
                self.v[:, buf:buf + n].copy_(v[:, row:row + n])
        self.filled = max(self.filled, b)

    def buffer_rows(self, rows: Tuple[int, int]) -> List[Tuple[int, int, int]]:
        """(row of the gathered chunk, length, buffer row) pieces of a chunk's rows [a, b): where each Ulysses rank's
        part of the chunk lives in the ring rank's buffers (without Ulysses: the rows themselves)."""
        own = self._layout(self.ring_size, self.ring_rank, self.key_length)
        out = []
        for g, row, n, _ in self.query_segments(rows):
            for gs, buf, ns, _ in own:
                lo, hi = max(g, gs), min(g + n, gs + ns)
                if lo < hi:
                    out.append((row + lo - g, hi - lo, buf + lo - gs))
        return out

    def _send(self, x: Tensor, heads) -> Tensor:
        """[b, rows, h, d] -> [U, b, rows, h/U, d]: the heads ``heads(j)`` picks for Ulysses rank j, in slot j."""
        return torch.stack([x[:, :, heads(j)] for j in range(self.ulysses_size)])

    def _gather(self, x: Tensor, heads) -> Tensor:
        send = self._send(x, heads)
        recv = all_to_all_equal(send, torch.empty_like(send), self.ulysses_group)
        return recv.transpose(0, 1).flatten(1, 2)  # [b, U*rows, h/U, d]: source rank by source rank

    def gather_q(self, x: Tensor) -> Tensor:
        """Under Ulysses: a chunk's queries (or output gradients) [b, rows, hq, d] -> this rank's query heads of every
        Ulysses rank's chunk [b, U*rows, hq/U, d] (one all-to-all); without Ulysses ``x``."""
        if self.ulysses_group is None:
            return x
        return self._gather(x, lambda j: self.heads.q_heads(j, 0))

    def gather_kv(self, x: Tensor) -> Tensor:
        """``gather_q`` for keys or values: the (replicated) KV heads this rank's query heads use."""
        if self.ulysses_group is None:
            return x
        return self._gather(x, lambda j: self.heads.kv_heads(j, 0, x.device))

    def _scatter(self, x: Tensor) -> Tensor:
        """[b, U*rows, h/U, d] (this rank's heads of every Ulysses rank's chunk) -> [U, b, rows, h/U, d] received:
        slot j holds Ulysses rank j's heads of this rank's chunk (the all-to-all back)."""
        u = self.ulysses_size
        send = x.unflatten(1, (u, x.shape[1] // u)).transpose(0, 1).contiguous()
        return all_to_all_equal(send, torch.empty_like(send), self.ulysses_group)

    def scatter_q(self, x: Tensor) -> Tensor:
        """The inverse of ``gather_q`` (attention outputs, query gradients): [b, rows, hq, d]."""
        if self.ulysses_group is None:
            return x
        recv = self._scatter(x)
        return recv.permute(1, 2, 0, 3, 4).flatten(2, 3)  # query heads are contiguous per Ulysses rank

    def kv_grads(self, index: int, dtype: torch.dtype) -> Tuple[Tensor, Tensor]:
        """The completed dK/dV of chunk ``index``'s own rows [b, rows, hkv, d] (Ulysses: every rank's share of the
        accumulators comes back by all-to-all, replicated KV heads summed)."""
        a, b = self.bounds[index]
        if self.ulysses_group is None:  # the buffers' rows are the local rows
            return self.dk[:, a:b].to(dtype), self.dv[:, a:b].to(dtype)
        grads = []
        for acc in (self.dk, self.dv):
            rows = acc.new_empty((acc.shape[0], (b - a) * self.ulysses_size) + tuple(acc.shape[2:]))
            for row, n, buf in self.buffer_rows((a, b)):
                rows[:, row:row + n].copy_(acc[:, buf:buf + n])
            recv = self._scatter(rows)  # slot j: this chunk's rows of the KV heads Ulysses rank j attended
            hkv = self.heads.hkv
            out = acc.new_zeros((acc.shape[0], b - a, hkv) + tuple(acc.shape[3:]))
            for j in range(self.ulysses_size):
                idx = self.heads.kv_heads(j, 0, acc.device)
                if isinstance(idx, slice):
                    out[:, :, idx] += recv[j]
                else:  # replicated KV heads: their gradients add up
                    out.index_add_(2, idx, recv[j])
            grads.append(out.to(dtype))
        return grads[0], grads[1]

    def check_group(self, group, ulysses_group=None) -> None:
        """The core attention's CP groups must be the ones the chunked layer runs under (its K/V pass and its ring
        passes must agree on the layout)."""
        for name, got, want in (("ring", group_size_and_rank(group), (self.ring_size, self.ring_rank)),
                                ("Ulysses", group_size_and_rank(ulysses_group),
                                 (self.ulysses_size, self.ulysses_rank))):
            if got != want:
                raise ValueError(f"sequence-chunked layer: its core attention runs with a {name} group of {got[0]} "
                                 f"ranks (rank {got[1]}) but the layer was chunked for {want[0]} (rank {want[1]})")

    def _layout(self, size: int, rank: int, length: int) -> List[Tuple[int, int, int, int]]:
        """(global start, local row, length, document) pieces of ``rank``'s ``length`` rows in a zigzag layout over
        ``size`` ranks: the two halves of the sequence's 2*size chunks (``ring_window.segments``, document 0), or,
        with packed documents, the two chunks of each document's 2*size (``layouts.thd_zigzag_indices``)."""
        if self.docs is None:
            return [(g, row, n, 0) for g, row, n in segments(size, rank, length)]
        out, row = [], 0
        for doc, (start, padded) in enumerate(zip(self.docs.starts, self.docs.padded)):
            if size == 1:
                out.append((start, row, padded, doc))
            else:
                c = padded // (2 * size)
                out += [(start + rank * c, row, c, doc), (start + (2 * size - 1 - rank) * c, row + c, c, doc)]
            row += padded // size
        return out

    def query_segments(self, rows: Tuple[int, int]) -> List[Tuple[int, int, int, int]]:
        """The queries of a chunk's rows [a, b) as (global start, row, length, document): one piece without CP
        (one per document when packed); under CP each rank's part of the chunk lies in its two zigzag halves (of each
        document); under Ulysses the attention sees every Ulysses rank's chunk (source by source, ``gather_q``), so
        rows count from ``u * (b - a)`` for source u."""
        a, b = rows
        out = []
        for u in range(self.ulysses_size):
            rank = self.ring_rank * self.ulysses_size + u
            for g, lo, n, doc in self._layout(self.cp_size, rank, self.length):
                ra, rb = max(a, lo), min(b, lo + n)
                if ra < rb:
                    out.append((g + ra - lo, u * (b - a) + ra - a, rb - ra, doc))
        return out

    def key_segments(self, rank: int, key_rows: int) -> List[Tuple[int, int, int, int]]:
        """Rows [0, key_rows) of ring rank ``rank``'s K/V buffers as (global start, buffer row, length, document)."""
        if self.cp_size == 1:
            return [(g, row, min(n, key_rows - row), doc) for g, row, n, doc in self._layout(1, 0, self.length)
                    if row < key_rows]
        return self._layout(self.ring_size, rank, self.key_length)

    def real(self, pieces, doc: int) -> List[Segment]:
        """``pieces`` of document ``doc`` cut to its real tokens (padding is never a key and its queries attend
        nothing), as (global start, row, length); without packed documents: all of them."""
        if self.docs is None:
            return [(g, row, n) for g, row, n, _ in pieces]
        lo, hi = self.docs.starts[doc], self.docs.starts[doc] + self.docs.lengths[doc]
        out = []
        for g, row, n, d in pieces:
            a, b = max(g, lo), min(g + n, hi)
            if d == doc and a < b:
                out.append((a, row + a - g, b - a))
        return out

    def alloc_grads(self) -> None:
        acc = torch.float64 if self.k.dtype == torch.float64 else torch.float32
        self.dk = torch.zeros(self.k.shape, dtype=acc, device=self.k.device)
        self.dv = torch.zeros(self.v.shape, dtype=acc, device=self.v.device)


_ACTIVE: List[ChunkState] = []


def active_sequence_chunking() -> Optional[ChunkState]:
    """The chunk state of the layer being run chunk by chunk, or None (a core attention then runs as usual)."""
    return _ACTIVE[-1] if _ACTIVE else None


class _Active:
    def __init__(self, state: ChunkState) -> None:
        self.state = state

    def __enter__(self) -> ChunkState:
        _ACTIVE.append(self.state)
        return self.state

    def __exit__(self, *exc) -> None:
        _ACTIVE.pop()


def _window(causal: bool, window_size) -> Tuple[int, int]:
    w = normalize_window(window_size, causal, fn="sequence-chunked attention")
    if w is None:
        return (INF, 0) if causal else (INF, INF)
    return w


def _blocks(state: ChunkState, rows: Tuple[int, int], window: Tuple[int, int], key_rows: int, rank: int):
    """Blocks of the chunk's queries (``rows``, gathered under Ulysses) against ring rank ``rank``'s K/V buffers."""
    # one query tile unless a finite window bands it
    tile = (rows[1] - rows[0]) * state.ulysses_size if window[0] >= INF else None
    queries, keys = state.query_segments(rows), state.key_segments(rank, key_rows)
    out = []
    for doc in sorted({q[3] for q in queries}):  # packed documents: each document's queries attend its own keys
        out += windowed_blocks(state.real(queries, doc), state.real(keys, doc), window, tile)
    return split_key_blocks(out, max(1, (rows[1] - rows[0]) * state.ulysses_size))


def split_key_blocks(blocks, key_tile: int):
    """Unmasked blocks cut along their keys into pieces of at most ``key_tile`` keys (the chunk's query count), so no
    kernel call sees more keys than the chunk has queries: a kernel's backward buffers per key (the CUDA flash kernels
    form dK/dV at the query heads under GQA: 2 x hq x d x 2 B per key in bf16) stay chunk-sized instead of growing with
    the whole local sequence. The pieces' partials merge by log-sum-exp like any other block."""
    out = []
    for qs, ks, kind, (qa, qb, ka, kb) in blocks:
        if kind != "full" or kb - ka <= key_tile:
            out.append((qs, ks, kind, (qa, qb, ka, kb)))
            continue
        for a in range(ka, kb, key_tile):
            b = min(kb, a + key_tile)
            start = ks.start + (a - ka)
            out.append((qs, slice(start, start + (b - a)), kind, (qa, qb, a, b)))
    return out


def _key_rows(state: ChunkState, window: Tuple[int, int]) -> int:
    """How many buffer rows the current chunk's queries may see (all of them unless the layer is causal-like and
    runs without CP)."""
    a, b = state.rows
    need = state.length if window[1] >= INF or state.cp_size > 1 else min(state.length, b + window[1])
    if need > state.filled:
        raise RuntimeError(f"sequence-chunked attention: chunk {state.index} needs key rows up to {need} but only "
                           f"{state.filled} are computed (a K/V pass must run first for non-causal layers and under "
                           "context parallelism)")
    return state.key_length if state.cp_size > 1 else need


def _sources(state: ChunkState):
    """Yields (step, source rank, (k, v) of that source, the ring exchange or None) for one ring pass of the K/V
    buffers: step 0 is this rank's own; each later source's K/V arrive from the previous rank while the current block
    is computed (the exchange is posted first)."""
    size, rank = state.ring_size, state.ring_rank
    ring = RingExchange(state.group) if size > 1 else None
    kv = (state.k, state.v)
    for step in range(size):
        pending = ring.start(kv) if step < size - 1 else None
        yield step, (rank - step) % size, kv, ring
        if pending is not None:
            kv = tuple(pending.wait())


class _ChunkAttention(torch.autograd.Function):
    """Attention of one query chunk to the buffered K/V (and, under ring CP, to every other rank's, passed around
    the ring once per chunk); k_c/v_c (the chunk's own keys, as the layer computed them) are inputs only so that
    their gradient can be returned (fused backward) -- the values come from the buffers."""

    @staticmethod
    def forward(ctx, q, k_c, v_c, state, window, scale, kernel):
        key_rows = _key_rows(state, window)
        acc = torch.float64 if q.dtype == torch.float64 else torch.float32
        q = state.gather_q(q)  # Ulysses: this rank's heads of every Ulysses rank's chunk
        out, lse = empty_accumulators(q, state.v, acc)
        for _, src, (k, v), _ in _sources(state):
            blocks = _blocks(state, state.rows, window, key_rows, src)
            window_forward_blocks(q, k, v, blocks, window, scale, kernel, out, lse, merge_rows_)
        out = out.to(q.dtype)
        ctx.save_for_backward(q, out, lse)
        ctx.state, ctx.key_rows, ctx.window, ctx.scale, ctx.kernel = state, key_rows, window, scale, kernel
        ctx.rows, ctx.fused = state.rows, state.fused
        return state.scatter_q(out)

    @staticmethod
    def backward(ctx, dout):
        q, out, lse = ctx.saved_tensors
        st = ctx.state
        dq = torch.zeros(q.shape, dtype=st.dk.dtype, device=q.device)
        dout = st.gather_q(dout.contiguous() if dout.stride(-1) != 1 else dout)
        args = (ctx.window, ctx.scale, ctx.kernel, dq)
        pending = None
        for step, src, (k, v), ring in _sources(st):
            blocks = _blocks(st, ctx.rows, ctx.window, ctx.key_rows, src)
            if step == 0:  # our own K/V: straight into the accumulators
                window_backward_blocks(dout, q, k, v, out, lse, blocks, *args, st.dk, st.dv)
                continue
            # another rank's K/V: their gradient goes into that block's accumulator, which travels one step behind
            # the K/V and arrives home after visiting every other rank (ring.py's backward)
            if pending is None:
                dk, dv = torch.zeros_like(st.dk), torch.zeros_like(st.dv)
            else:
                dk, dv = pending.wait()
            window_backward_blocks(dout, q, k, v, out, lse, blocks, *args, dk, dv)
            pending = ring.start((dk, dv))
        if pending is not None:
            dk, dv = pending.wait()
            st.dk.add_(dk)
            st.dv.add_(dv)
        dq = st.scatter_q(dq.to(q.dtype))
        if not ctx.fused:
            return dq, None, None, None, None, None, None
        a, b = ctx.rows  # complete: every later chunk ran its backward before this one
        return dq, st.dk[:, a:b].to(st.k.dtype), st.dv[:, a:b].to(st.v.dtype), None, None, None, None


def chunk_core_attention(q: Tensor, k: Tensor, v: Tensor, *, causal: bool, scale: float, kernel: AttentionKernel,
                         window_size=None, group=None, ulysses_group=None) -> Tensor:
    """What a core attention returns under an active ``ChunkState`` (see the module docstring): q [b, sc, hq, d]
    (the chunk's queries), k/v [b, sc, hkv, d|dv] (the chunk's own keys and values) -> out [b, sc, hq, dv].
    ``kv`` mode stores k/v (keeping them, with their graph, when grad is enabled) and raises ``StopAfterKV``.
    ``group``: the ring CP group (the local sequence is the rank's zigzag shard, ``ring_window.segments``); every
    chunk's queries then see every rank's K/V, passed around the ring once per chunk (forward, and again in its
    backward with the dK/dV accumulators travelling home). ``ulysses_group``: Ulysses CP (hybrid with ``group``
    the ring across Ulysses groups): each chunk's queries, keys and values reach the group's ranks by head with one
    all-to-all each, the output and gradients come back the same way."""
    state = active_sequence_chunking()
    if state is None:
        raise RuntimeError("chunk_core_attention called outside a sequence-chunked layer")
    state.check_group(group, ulysses_group)
    state.plan_heads(q.shape[2], k.shape[2])
    window = _window(causal, window_size)
    causal_like = window[1] == 0
    if state.causal_like is None:
        state.causal_like = causal_like
    elif state.causal_like != causal_like:
        raise ValueError("sequence-chunked layer: its core attention changed between causal and non-causal")
    if state.mode == "kv":
        if state.dk is None:  # the buffers are being filled (the grad pass only reads them)
            state.store(k, v)
        state.captured = (k, v)
        raise StopAfterKV()
    if state.dk is None and state.filled < state.rows[1]:  # forward: the chunk's keys join the buffers before it
        state.store(k, v)  # attends (after a K/V pass they are there already)
    return _ChunkAttention.apply(q, k, v, state, window, float(scale), kernel)


def _run_kv(run_chunk: Callable, hidden: Tensor, state: ChunkState, seq_dim: int, index: int, x: Tensor = None):
    a, b = state.bounds[index]
    state.begin(index, "kv")
    try:
        run_chunk(hidden.narrow(seq_dim, a, b - a) if x is None else x, a, b)
    except StopAfterKV:
        return state.captured
    raise RuntimeError("sequence-chunked layer: the layer finished without calling its core attention (is it "
                       "nemo_longctx's core attention?)")


class _ParamGrads:
    """Parameter gradients of one layer summed over its chunks (float32 for half-precision parameters), handed to
    autograd once at the end: gradient-accumulation hooks (Megatron DDP's grad-ready hook with overlap_grad_reduce,
    which refuses a second gradient per step) then fire once per parameter and step, as with an unchunked layer.
    ``params=None``: the chunks' gradients accumulate into ``.grad`` directly (hooks fire once per chunk)."""

    def __init__(self, params: Optional[Sequence[Tensor]]) -> None:
        self.params = None if params is None else [p for p in params if p.requires_grad]
        self.sums: List[Optional[Tensor]] = [None] * len(self.params or ())

    def backward(self, outputs, grads, x: Tensor) -> None:
        """Differentiate ``outputs`` with ``grads``: x.grad gets x's gradient, the parameters' add to the sums."""
        if self.params is None:
            torch.autograd.backward(outputs, grads)
            return
        got = torch.autograd.grad(outputs, [x] + self.params, grads, allow_unused=True)
        if got[0] is not None:
            x.grad = got[0] if x.grad is None else x.grad + got[0]
        for i, g in enumerate(got[1:]):
            if g is None:
                continue
            if self.sums[i] is None:
                acc = torch.float32 if g.dtype in (torch.float16, torch.bfloat16) else g.dtype
                self.sums[i] = g.to(acc, copy=True)
            else:
                self.sums[i].add_(g)

    def deliver(self) -> None:
        pairs = [(p, g) for p, g in zip(self.params or (), self.sums) if g is not None]
        if pairs:  # a view per parameter: one pass through each parameter's gradient accumulator
            with torch.enable_grad():  # (backward runs with grad mode off)
                views = [p.view_as(p) for p, _ in pairs]
            torch.autograd.backward(views, [g.to(p.dtype) for p, g in pairs])
        self.sums = [None] * len(self.sums)


class _SequenceChunkedLayer(torch.autograd.Function):
    @staticmethod
    def forward(ctx, run_chunk, n_chunks, seq_dim, kv_first, params, groups, hidden):
        bounds = chunk_bounds(hidden.shape[seq_dim], n_chunks)
        state = ChunkState(bounds, *groups)
        kv_first = kv_first or state.cp_size > 1  # other ranks' queries need this rank's whole K/V
        out = None  # written chunk by chunk (no list of chunk outputs next to a concatenated copy)
        with torch.no_grad(), _Active(state):
            if kv_first:
                for i in range(len(bounds)):
                    _run_kv(run_chunk, hidden, state, seq_dim, i)
            for i, (a, b) in enumerate(bounds):
                state.begin(i, "attend")
                y = run_chunk(hidden.narrow(seq_dim, a, b - a), a, b)
                if out is None:
                    shape = list(y.shape)
                    shape[seq_dim] = state.length
                    out = y.new_empty(shape)
                out.narrow(seq_dim, a, b - a).copy_(y)
                del y
        ctx.run_chunk, ctx.bounds, ctx.seq_dim, ctx.params, ctx.groups = run_chunk, bounds, seq_dim, params, groups
        ctx.save_for_backward(hidden)
        return out

    @staticmethod
    def backward(ctx, grad_out):
        (hidden,) = ctx.saved_tensors
        run_chunk, bounds, seq_dim = ctx.run_chunk, ctx.bounds, ctx.seq_dim
        state = ChunkState(bounds, *ctx.groups)
        grad_in = torch.zeros_like(hidden)
        param_grads = _ParamGrads(ctx.params)
        with _Active(state):
            with torch.no_grad():
                for i in range(len(bounds)):
                    _run_kv(run_chunk, hidden, state, seq_dim, i)
            state.alloc_grads()
            # a causal chunk's own dK/dV rows are complete after its backward only without CP (under ring CP a later
            # rank's earlier chunks still attend them)
            state.fused = bool(state.causal_like) and state.cp_size == 1
            inputs = {}
            for i in reversed(range(len(bounds))):
                a, b = bounds[i]
                x = hidden.narrow(seq_dim, a, b - a).detach().requires_grad_(True)
                state.begin(i, "attend")
                with torch.enable_grad():
                    y = run_chunk(x, a, b)
                param_grads.backward(y, grad_out.narrow(seq_dim, a, b - a), x)
                grad_in.narrow(seq_dim, a, b - a).copy_(x.grad)
                if not state.fused:
                    x.grad = None
                    inputs[i] = x
            if not state.fused:  # dK/dV are complete only now: differentiate each chunk's K/V part with them
                for i, x in inputs.items():
                    a, b = bounds[i]
                    with torch.enable_grad():
                        k, v = _run_kv(run_chunk, hidden, state, seq_dim, i, x=x)
                    param_grads.backward([k, v], list(state.kv_grads(i, k.dtype)), x)
                    grad_in.narrow(seq_dim, a, b - a).add_(x.grad)
        param_grads.deliver()
        return None, None, None, None, None, None, grad_in


def sequence_chunked_checkpoint(run_chunk: Callable[[Tensor, int, int], Tensor], hidden: Tensor, n_chunks: int,
                                *, seq_dim: int = 0, kv_first: bool = False,
                                params: Optional[Sequence[Tensor]] = None, group=None,
                                ulysses_group=None, documents=None) -> Tensor:
    """Run a layer chunk by chunk as a full-recompute checkpoint (module docstring).

    ``run_chunk(x, start, end)`` runs the layer on ``x`` = rows [start, end) of ``hidden`` along ``seq_dim`` and
    returns those rows of its output; its core attention must call ``chunk_core_attention`` while a chunked layer
    is active. ``kv_first``: the layer's attention may look at later tokens (no causal mask): compute every chunk's
    K/V before the first chunk attends. Only ``hidden`` is saved for backward (an offload scope around this call
    moves it to the host). Random ops inside the layer are not replayed: the caller must not have any.
    ``params``: the layer's parameters; their chunk gradients are summed and reach autograd once per backward
    (gradient-accumulation hooks fire once, as Megatron DDP's overlapped grad reduce requires). Without it each chunk's
    backward accumulates into ``.grad``. ``group``: the ring CP group when ``hidden`` is this rank's zigzag shard
    (``ring_window.segments``); ``ulysses_group``: the Ulysses CP group (alone, or with ``group`` as hybrid's ring
    across Ulysses groups); the core attention must pass the same groups to ``chunk_core_attention``.
    ``documents``: (cu_seqlens, cu_seqlens_padded) of packed documents (``attention.thd``'s convention, global;
    ``hidden`` is the rank's per-document zigzag shard): each query attends the real keys of its own document only,
    padding rows attend nothing. The layer itself runs without packed-sequence parameters (``run_chunk`` gives its
    RoPE the positions within each document)."""
    if not torch.is_grad_enabled():  # evaluation: the same chunked forward, nothing saved
        return _SequenceChunkedLayer.forward(_NoCtx(), run_chunk, n_chunks, seq_dim, kv_first, params,
                                             (group, ulysses_group, documents), hidden)
    if not hidden.requires_grad:  # e.g. frozen embeddings: the layer's parameters still need their gradients
        hidden = hidden.detach().requires_grad_(True)
    return _SequenceChunkedLayer.apply(run_chunk, n_chunks, seq_dim, kv_first, params,
                                       (group, ulysses_group, documents), hidden)


class _NoCtx:
    def save_for_backward(self, *tensors) -> None:
        pass
