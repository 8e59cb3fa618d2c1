"""Building block of the ``full_keep_attn`` recompute mode: full-layer recompute that keeps the core-attention
output and its LSE, so backward does not run attention forward again (with ring CP: one ring pass less per
layer and step).

Mechanism (reentrant full recompute, e.g. Megatron's ``tensor_parallel.checkpoint`` or
``torch.utils.checkpoint(use_reentrant=True)``: the layer runs under ``no_grad`` in forward and again with
grad enabled in backward):
  * forward, grad disabled, training: ``kept_ring_attention`` computes (out, lse) with
    ``ring_attention_forward`` and pushes them on the FIFO of ``key`` (one entry per microbatch);
  * recompute, grad enabled and an entry exists for ``key``: q, k, v are recomputed by the layer, the entry
    is popped and ``out`` is returned through an autograd.Function whose backward is
    ``ring_attention_backward(dout, q, k, v, out, lse)`` -- no forward ring pass;
  * grad enabled and no entry (a layer that is not recomputed): plain differentiable ring attention;
  * grad disabled and not training (evaluation): plain forward, nothing kept.

Offload: when the no-grad forward runs inside an activation-offload scope (``offload=layer_input``: the checkpoint
call of the layer runs in ``ActivationOffloader.offload_scope``), the kept out and LSE join that scope's group: they
go to the host pool with the layer input and come back with it (same prefetch) when the recompute pops them; only
what is below the offloader's ``min_bytes`` stays on the device.

Layout: q [b, s_local, hq, d], k/v [b, s_local, hkv, d] zigzag-sharded over ``group``; out like q,
lse [b, hq, s_local] float32. The returned ``out`` is the kept tensor itself: do not modify it in place
(detected at pop time through its version counter).
"""

from __future__ import annotations

from collections import deque
from typing import Deque, Dict, Hashable, Optional, Tuple

import torch
import torch.distributed as dist

from ..attention.comm import group_size_and_rank
from ..attention.kernels import resolve_softmax_scale, select_kernel
from ..attention.ring import ring_attention, ring_attention_backward, ring_attention_forward
from ..attention.input_checks import check_attention_inputs
from .offload import is_offloaded, offload_into_active_scope, restore

Tensor = torch.Tensor


class _Entry:
    """out/lse are the tensors, or offload handles when an offload scope took them (see module docstring)."""

    __slots__ = ("out", "lse", "meta", "out_version", "nbytes", "offloaded_bytes")

    def __init__(self, out: Tensor, lse: Tensor, meta: tuple) -> None:
        self.meta = meta
        self.nbytes = out.numel() * out.element_size() + lse.numel() * lse.element_size()
        self.out = offload_into_active_scope(out)  # reports the bytes (device or host) to the trackers
        self.lse = offload_into_active_scope(lse)
        # an offloaded copy cannot be modified in place by the layer: only a kept device tensor is checked
        self.out_version = None if is_offloaded(self.out) else out._version
        self.offloaded_bytes = sum(x.nbytes for x in (self.out, self.lse) if is_offloaded(x))


class KeptAttentionCache:
    """Per-key FIFOs of (out, lse) kept from the no-grad forward until the recompute consumes them.

    One cache per model (or per pipeline stage); ``key`` is the layer's identity (e.g. its layer number).
    ``max_entries_per_key`` bounds each FIFO (more in-flight microbatches than that means entries are
    pushed and never consumed, e.g. an evaluation run under no_grad flagged as training).
    """

    def __init__(self, max_entries_per_key: int = 64) -> None:
        if not isinstance(max_entries_per_key, int) or max_entries_per_key < 1:
            raise ValueError(
                f"KeptAttentionCache: max_entries_per_key must be an int >= 1, got {max_entries_per_key!r}"
            )
        self.max_entries_per_key = max_entries_per_key
        self._fifos: Dict[Hashable, Deque[_Entry]] = {}
        self.bytes_held = 0  # kept out + lse, on the device or offloaded
        self.peak_bytes_held = 0
        self.bytes_offloaded = 0  # cumulative bytes of kept out/lse that went to an offload host pool
        self.pushes = 0
        self.pops = 0

    def __len__(self) -> int:
        return sum(len(f) for f in self._fifos.values())

    def has(self, key: Hashable) -> bool:
        return bool(self._fifos.get(key))

    def push(self, key: Hashable, out: Tensor, lse: Tensor, meta: tuple) -> None:
        fifo = self._fifos.setdefault(key, deque())
        if len(fifo) >= self.max_entries_per_key:
            raise RuntimeError(
                f"KeptAttentionCache: key {key!r} already holds {len(fifo)} entries that no recompute consumed; "
                "kept attention is pushed in training forwards run without grad (full recompute) and must be "
                "popped by the recompute in backward. Pass training=False for evaluation, or call clear()."
            )
        entry = _Entry(out, lse, meta)
        fifo.append(entry)
        self.bytes_held += entry.nbytes
        self.peak_bytes_held = max(self.peak_bytes_held, self.bytes_held)
        self.bytes_offloaded += entry.offloaded_bytes
        self.pushes += 1

    def pop(self, key: Hashable, meta: tuple) -> Tuple[Tensor, Tensor]:
        fifo = self._fifos.get(key)
        if not fifo:
            raise RuntimeError(f"KeptAttentionCache: nothing kept for key {key!r}")
        entry = fifo[0]
        if entry.meta != meta:
            raise RuntimeError(
                f"KeptAttentionCache: the recompute of key {key!r} does not match the kept forward "
                f"(kept {_describe(entry.meta)}, recompute {_describe(meta)}); keys must identify one layer "
                "and microbatches must be recomputed in the order they ran forward"
            )
        if entry.out_version is not None and entry.out._version != entry.out_version:
            raise RuntimeError(
                f"KeptAttentionCache: the kept attention output of key {key!r} was modified in place after the "
                "forward; the layer must not write into the attention output"
            )
        fifo.popleft()
        if not fifo:
            del self._fifos[key]
        self.bytes_held -= entry.nbytes
        self.pops += 1
        out, lse = restore(entry.out), restore(entry.lse)
        entry.out = entry.lse = None  # an offloaded handle dies here: its host buffer returns to the pool
        return out, lse

    def held(self) -> Dict[Hashable, int]:
        """{key: number of kept entries}."""
        return {k: len(f) for k, f in self._fifos.items()}

    def check_empty(self, where: str = "") -> None:
        """Raise if entries are left (call after each step's backward)."""
        if self._fifos:
            raise RuntimeError(
                f"KeptAttentionCache{' ' + where if where else ''}: {len(self)} kept attention entries were never "
                f"recomputed (per key: {self.held()}); every layer that ran forward with kept attention needs a "
                "backward with recompute"
            )

    def clear(self) -> None:
        self._fifos.clear()
        self.bytes_held = 0


def _describe(meta: tuple) -> str:
    q_shape, kv_shape, dtype, device, causal, scale, cp = meta
    return f"q{list(q_shape)} kv{list(kv_shape)} {dtype} {device} causal={causal} scale={scale:.6g} cp={cp}"


class _KeptAttention(torch.autograd.Function):
    """Returns the kept ``out``; backward replays only the ring backward with the recomputed q, k, v."""

    @staticmethod
    def forward(ctx, q, k, v, out, lse, group, causal, scale, kernel):
        ctx.save_for_backward(q, k, v, out, lse)
        ctx.args = (group, causal, scale, kernel)
        return out.view_as(out)

    @staticmethod
    def backward(ctx, dout):
        q, k, v, out, lse = ctx.saved_tensors
        dq, dk, dv = ring_attention_backward(dout, q, k, v, out, lse, *ctx.args)
        return dq, dk, dv, None, None, None, None, None, None


def kept_ring_attention(
    q: Tensor,
    k: Tensor,
    v: Tensor,
    group: Optional[dist.ProcessGroup] = None,
    causal: bool = True,
    softmax_scale: Optional[float] = None,
    *,
    cache: KeptAttentionCache,
    key: Hashable,
    training: bool = True,
    kernel: Optional[str] = None,
    global_seq_len: Optional[int] = None,
) -> Tensor:
    """Ring attention (see ``attention.ring``) that keeps (out, lse) across a reentrant full recompute.

    ``cache``/``key``: where this layer's kept results live (see module docstring). ``training``: whether a
    no-grad call is a training forward to be recomputed (pass ``module.training``). Returns [b, s_local, hq, d].
    """
    if not isinstance(cache, KeptAttentionCache):
        raise ValueError(f"kept_ring_attention: cache must be a KeptAttentionCache, got {type(cache).__name__}")
    if key is None:
        raise ValueError("kept_ring_attention: key must identify the layer (e.g. its layer number), got None")
    size, _ = group_size_and_rank(group)
    check_attention_inputs(q, k, v, size, causal, global_seq_len, fn="kept_ring_attention")
    scale = resolve_softmax_scale(softmax_scale, q.shape[-1])
    kern = select_kernel(q.device, q.dtype, kernel)
    ring_group = group if size > 1 else None
    meta = (tuple(q.shape), tuple(k.shape), q.dtype, q.device, bool(causal), scale, size)
    if not torch.is_grad_enabled():
        out, lse = ring_attention_forward(q, k, v, ring_group, causal, scale, kern)
        if training:
            cache.push(key, out, lse, meta)
        return out
    if cache.has(key):
        out, lse = cache.pop(key, meta)
        return _KeptAttention.apply(q, k, v, out, lse, ring_group, causal, scale, kern)
    return ring_attention(q, k, v, group, causal, scale, kernel=kernel)
