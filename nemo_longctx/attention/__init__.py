"""Context-parallel attention in plain PyTorch (no megatron / nemo imports).

Layout everywhere: ``[batch, seq, heads, head_dim]``; the sequence is zigzag-sharded over the CP group.
Attention sinks (GPT-OSS learnable per-head sink logits, or the off-by-one softmax): the ``sinks`` /
``softmax_type`` arguments of every attention function (``sinks`` module).
"""

from .all_to_all import A2ABufferProbe, all_to_all_equal, track_a2a_buffer_bytes
from .comm import ByteCounter, RingExchange, count_bytes_sent
from .kernels import KERNELS, AttentionKernel, default_softmax_scale, select_kernel
from .layouts import thd_zigzag_indices, zigzag_indices, zigzag_position_ids, zigzag_shard, zigzag_unshard
from .merge import merge_attention, merge_attention_
from .hybrid import hybrid_attention, make_cp_groups
from .sinks import SOFTMAX_TYPES, apply_sinks, sinks_grad
from .ring import local_attention, ring_attention, ring_attention_backward, ring_attention_forward
from .thd import ThdLayout
from .ulysses import UlyssesHeadPlan, check_ulysses_inputs, plan_ulysses_heads, ulysses_attention
from .input_checks import check_attention_inputs

__all__ = [
    "A2ABufferProbe",
    "AttentionKernel",
    "ByteCounter",
    "KERNELS",
    "RingExchange",
    "SOFTMAX_TYPES",
    "UlyssesHeadPlan",
    "all_to_all_equal",
    "apply_sinks",
    "check_attention_inputs",
    "check_ulysses_inputs",
    "count_bytes_sent",
    "default_softmax_scale",
    "hybrid_attention",
    "local_attention",
    "make_cp_groups",
    "merge_attention",
    "merge_attention_",
    "plan_ulysses_heads",
    "ring_attention",
    "ring_attention_backward",
    "ring_attention_forward",
    "select_kernel",
    "sinks_grad",
    "ThdLayout",
    "thd_zigzag_indices",
    "track_a2a_buffer_bytes",
    "ulysses_attention",
    "zigzag_indices",
    "zigzag_position_ids",
    "zigzag_shard",
    "zigzag_unshard",
]
