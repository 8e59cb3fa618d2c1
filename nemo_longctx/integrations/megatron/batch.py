"""Shard a full-sequence training batch over the context-parallel group (zigzag, identical to Megatron-core's
``megatron.core.utils.get_batch_on_this_cp_rank``).

Batch keys ``tokens``, ``labels``, ``loss_mask``, ``position_ids`` are ``[b, S]`` (sequence on dim 1); an
``attention_mask`` would be ``[b, 1, S, S]`` (sharded on dim 2, like Megatron). Labels are already shifted by the
dataset (labels[i] = tokens[i+1]), so sharding tokens and labels with the same index keeps every pair together,
including at chunk boundaries.
"""

from __future__ import annotations

from typing import Any, Dict

from nemo_longctx.attention import zigzag_shard


def seq_dim_of(key: str) -> int:
    return 2 if key == "attention_mask" else 1


def shard_batch_for_cp(batch: Dict[str, Any], cp_size: int, cp_rank: int) -> Dict[str, Any]:
    """New dict with every tensor value replaced by this CP rank's zigzag shard (None values kept)."""
    if cp_size == 1:
        return dict(batch)
    out = {}
    for key, val in batch.items():
        if val is None:
            out[key] = None
            continue
        dim = seq_dim_of(key)
        if val.shape[dim] % (2 * cp_size) != 0:
            raise ValueError(
                f"batch[{key!r}] has sequence length {val.shape[dim]}, not divisible by 2*cp.size = {2 * cp_size}"
            )
        out[key] = zigzag_shard(val, dim, cp_size, cp_rank)
    return out
