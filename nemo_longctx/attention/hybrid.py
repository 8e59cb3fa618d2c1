"""Hybrid context parallelism: Ulysses (all-to-all) inside groups of consecutive ranks, ring (P2P) across them.

A CP group of N = U * R ranks (cp rank r = rho * U + u) is split into
  * Ulysses groups of U consecutive cp ranks  {rho*U, ..., rho*U + U - 1}   (intra-node), and
  * ring groups of R ranks with the same u    {u, U + u, ..., (R-1)*U + u}  (across nodes),
by ``make_cp_groups(cp_group, U)``.

Layout: the input is the usual zigzag shard over all N ranks: cp rank r holds global chunks r and 2N-1-r of
2N, q [b, s_local, hq, d], k/v [b, s_local, hkv, d]. Group the 2N chunks into 2R super-chunks of U chunks.
After the Ulysses all-to-all in group rho, each rank holds (for its hq/U query heads and their KV heads) the
first chunks rho*U ... rho*U+U-1 of its U sources (= super-chunk rho, in order) and their second chunks
2N-1-rho*U ... 2N-U-rho*U (= super-chunk 2R-1-rho, once the sources are taken in reverse order). Put in that
order -- the same reorder pure Ulysses uses to reach natural order -- the local sequence is exactly the zigzag
shard of ring rank rho over R ranks, and all R members of a ring group hold the same heads. So the ring over
``ring_group`` (``ring.ring_attention_forward/backward``, GQA-native) is exact, and the all-to-all back
restores the caller's layout. U = N is pure Ulysses, U = 1 pure ring (plus head chunking if asked).
"""

from __future__ import annotations

from typing import Dict, Optional, Tuple

import torch
import torch.distributed as dist

from .comm import group_size_and_rank
from .kernels import resolve_softmax_scale, select_kernel
from .ring import ring_attention
from .sinks import resolve_sinks
from .ulysses import check_ulysses_inputs, thd_order_for, ulysses_core
from .input_checks import check_window

Tensor = torch.Tensor

_group_cache: Dict[Tuple[Tuple[int, ...], int, int], Tuple[dist.ProcessGroup, dist.ProcessGroup]] = {}


def _new_group(ranks, cp_group, cp_ranks):
    if list(ranks) == list(cp_ranks):
        return cp_group
    # Only the members create a group (each rank knows only its own CP group); every rank creates its
    # Ulysses group first and its ring group second, so the member-local rendezvous cannot deadlock.
    return dist.new_group(ranks=list(ranks), use_local_synchronization=True)


def make_cp_groups(cp_group: dist.ProcessGroup, ulysses_size: int) -> Tuple[dist.ProcessGroup, dist.ProcessGroup]:
    """(ulysses_group, ring_group) of the calling rank for a CP group split as ulysses_size x ring_size.

    Ulysses groups are runs of ``ulysses_size`` consecutive cp ranks, ring groups take every
    ``ulysses_size``-th cp rank (module docstring). Every member of ``cp_group`` must call this with the same
    ``ulysses_size`` (collective over the new groups' members; results are cached per (group, size)).
    ``ulysses_size`` 1 gives (a one-rank group, cp_group); ``ulysses_size`` = N gives (cp_group, a one-rank group).
    """
    if not (dist.is_available() and dist.is_initialized()):
        raise ValueError("make_cp_groups: torch.distributed is not initialized")
    cp_ranks = dist.get_process_group_ranks(cp_group)
    n = len(cp_ranks)
    if isinstance(ulysses_size, bool) or not isinstance(ulysses_size, int) or ulysses_size < 1 or n % ulysses_size:
        raise ValueError(
            f"make_cp_groups: ulysses_size={ulysses_size!r} must be a positive divisor of the CP group size {n}"
        )
    me = dist.get_rank()
    key = (tuple(cp_ranks), ulysses_size, me)
    if key in _group_cache:
        return _group_cache[key]
    cp_rank = cp_ranks.index(me)
    rho, u = divmod(cp_rank, ulysses_size)
    ulysses_ranks = cp_ranks[rho * ulysses_size:(rho + 1) * ulysses_size]
    ring_ranks = cp_ranks[u::ulysses_size]
    groups = (_new_group(ulysses_ranks, cp_group, cp_ranks), _new_group(ring_ranks, cp_group, cp_ranks))
    _group_cache[key] = groups
    return groups


def hybrid_attention(
    q: Tensor,
    k: Tensor,
    v: Tensor,
    ulysses_group: Optional[dist.ProcessGroup],
    ring_group: Optional[dist.ProcessGroup],
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
    """Exact attention, Ulysses over ``ulysses_group`` x ring over ``ring_group`` (groups from ``make_cp_groups``).

    q [b, s_local, hq, d], k [b, s_local, hkv, d], v [b, s_local, hkv, dv] (dv may differ from d: MLA),
    zigzag-sharded over the whole CP group (U*R ranks) -> [b, s_local, hq, dv]. Needs hq % U == 0 and ``head_chunks``
    dividing hq / U; KV heads are replicated only
    as far as U needs (the ring is GQA-native). ``regather_in_backward`` as in ``ulysses_attention``.
    ``cu_seqlens`` / ``cu_seqlens_padded``: a packed sequence (per-document zigzag over all U*R ranks, see ``thd``);
    after the all-to-all each rank holds, per document, the zigzag shard of its ring rank over R ranks, and the
    THD ring (``ring_thd``) runs over ``ring_group``. ``window_size``: sliding-window attention; the ring part
    exchanges only the K/V the window needs (``ring_window``). ``sinks`` / ``softmax_type``: attention sinks as in
    ``ring.ring_attention``, applied once to the ring's final rows of the heads a rank holds after the all-to-all;
    each rank's sinks gradient is its partial sum (zeros for heads it does not hold): sum it over the CP group.
    Raises ValueError before communicating.
    """
    u_size, _ = group_size_and_rank(ulysses_group)
    r_size, _ = group_size_and_rank(ring_group)
    plan = check_ulysses_inputs(q, k, v, u_size, r_size, causal, head_chunks, global_seq_len, fn="hybrid_attention")
    thd = thd_order_for(q, u_size, ring_group, cu_seqlens, cu_seqlens_padded, fn="hybrid_attention")
    window = check_window(window_size, causal, u_size * r_size, q.shape[1], thd is not None, fn="hybrid_attention")
    sink_logits = resolve_sinks(sinks, softmax_type, q, fn="hybrid_attention")
    if u_size == 1 and head_chunks == 1 and not regather_in_backward:  # pure ring: nothing to exchange or reorder
        return ring_attention(q, k, v, ring_group, causal, softmax_scale, kernel=kernel, global_seq_len=global_seq_len,
                              cu_seqlens=cu_seqlens, cu_seqlens_padded=cu_seqlens_padded, window_size=window_size,
                              sinks=sinks, softmax_type=softmax_type)
    scale = resolve_softmax_scale(softmax_scale, q.shape[-1])
    kern = select_kernel(q.device, q.dtype, kernel, head_dim=q.shape[-1], value_dim=v.shape[-1])
    return ulysses_core(
        q, k, v, plan, ulysses_group if u_size > 1 else None, ring_group if r_size > 1 else None, causal, scale, kern,
        bool(regather_in_backward), thd, window, sink_logits,
    )
