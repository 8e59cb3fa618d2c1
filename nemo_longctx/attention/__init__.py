"""Context-parallel attention in plain PyTorch (no megatron / nemo imports).

Layout everywhere: ``[batch, seq, heads, head_dim]``; the sequence is zigzag-sharded over the CP group.
"""

from .comm import ByteCounter, RingExchange, count_bytes_sent
from .kernels import KERNELS, AttentionKernel, default_softmax_scale, select_kernel
from .layouts import zigzag_indices, zigzag_position_ids, zigzag_shard, zigzag_unshard
from .merge import merge_attention, merge_attention_
from .ring import local_attention, ring_attention, ring_attention_backward, ring_attention_forward
from .validation import check_attention_inputs

__all__ = [
    "AttentionKernel",
    "ByteCounter",
    "KERNELS",
    "RingExchange",
    "check_attention_inputs",
    "count_bytes_sent",
    "default_softmax_scale",
    "local_attention",
    "merge_attention",
    "merge_attention_",
    "ring_attention",
    "ring_attention_backward",
    "ring_attention_forward",
    "select_kernel",
    "zigzag_indices",
    "zigzag_position_ids",
    "zigzag_shard",
    "zigzag_unshard",
]
