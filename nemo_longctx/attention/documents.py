"""Attention over a document-aware CP shard: split documents through the CP algorithm, kept ones locally.

A rank's shard of a packed batch under document-aware placement (``nemo_longctx.planner.documents``) is
``[1, local_len, h, d]``: its first ``split_local`` positions are the split documents' per-document zigzag shards
(the same count on every rank: the CP algorithm -- ring, Ulysses or hybrid -- runs over them as over any packed
sequence, ``split_cu_seqlens`` / ``split_cu_seqlens_padded`` global), the rest is the rank's kept region: whole
documents attended on this rank alone (``kept_cu_seqlens`` / ``kept_cu_seqlens_padded``, local; padding entries
have 0 real tokens). Every head stays local for the kept region (no all-to-all), and no byte moves for it.

Semantics are those of the packed sequence (``thd``): a real query attends to the real keys of its own document
(causally or not, within a sliding window if given); padding never acts as a key, padding rows give 0 and have
zero gradients. When no document is split (``split_local`` 0 on every rank: the placement is the same on all), the
CP algorithm is not called and nothing is communicated.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, Optional, Sequence

import torch

from .ring import local_attention

Tensor = torch.Tensor


@dataclass(frozen=True)
class DocumentShard:
    """One rank's part of a document-aware placement (plain lists of ints, cumulative like ``cu_seqlens``)."""

    split_local: int
    split_cu_seqlens: Sequence[int]
    split_cu_seqlens_padded: Sequence[int]
    kept_cu_seqlens: Sequence[int]
    kept_cu_seqlens_padded: Sequence[int]

    @property
    def local_len(self) -> int:
        return self.split_local + int(self.kept_cu_seqlens_padded[-1])

    def split_tokens(self) -> int:
        """Real tokens of the split documents (global)."""
        return int(self.split_cu_seqlens[-1])


def document_attention(
    q: Tensor, k: Tensor, v: Tensor, shard: DocumentShard, split_attention: Callable[..., Tensor], *,
    causal: bool = True, softmax_scale: Optional[float] = None, kernel: Optional[str] = None, window_size=None,
    sinks: Optional[Tensor] = None, softmax_type: Optional[str] = None, fn: str = "document_attention",
) -> Tensor:
    """q [1, local_len, hq, d], k [1, local_len, hkv, d], v [1, local_len, hkv, dv] -> [1, local_len, hq, dv].

    ``split_attention(q, k, v, cu_seqlens=..., cu_seqlens_padded=...)`` runs the CP algorithm over the split part
    (the caller binds the group, mask, scale, window and sinks); the kept region runs ``ring.local_attention`` with
    ``kernel``, ``window_size`` and ``sinks``/``softmax_type``. Raises ValueError before communicating."""
    if q.dim() != 4 or q.shape[0] != 1:
        raise ValueError(f"{fn}: document-aware packed sequences need [1, s_local, heads, head_dim] tensors, got q "
                         f"{tuple(q.shape)}")
    if shard.split_local < 0 or q.shape[1] != shard.local_len or k.shape[1] != q.shape[1] or v.shape[1] != q.shape[1]:
        raise ValueError(f"{fn}: the shard holds {shard.split_local} split + "
                         f"{int(shard.kept_cu_seqlens_padded[-1])} kept positions but q/k/v have "
                         f"{q.shape[1]}/{k.shape[1]}/{v.shape[1]}")
    a = shard.split_local
    outs = []
    if a > 0:  # some document is split (the same on every rank)
        cu = torch.tensor(list(shard.split_cu_seqlens), dtype=torch.int32)
        cup = torch.tensor(list(shard.split_cu_seqlens_padded), dtype=torch.int32)
        outs.append(split_attention(q[:, :a], k[:, :a], v[:, :a], cu_seqlens=cu, cu_seqlens_padded=cup))
    if q.shape[1] > a:
        cu = torch.tensor(list(shard.kept_cu_seqlens), dtype=torch.int32)
        cup = torch.tensor(list(shard.kept_cu_seqlens_padded), dtype=torch.int32)
        outs.append(local_attention(q[:, a:], k[:, a:], v[:, a:], causal, softmax_scale, kernel=kernel,
                                    cu_seqlens=cu, cu_seqlens_padded=cup, window_size=window_size, sinks=sinks,
                                    softmax_type=softmax_type))
    if not outs:
        raise ValueError(f"{fn}: empty shard (no split documents and no kept region)")
    return outs[0] if len(outs) == 1 else torch.cat(outs, dim=1)
