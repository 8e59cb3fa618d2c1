"""Activation memory for long context, in plain PyTorch (no megatron / nemo imports).

- tracker.py         ActivationTracker: saved-for-backward bytes on device / host, per scope, and peak bytes
- offload.py         ActivationOffloader: layer-input / per-module offload to a host pool with prefetch
- keep_attention.py  KeptAttentionCache + kept_ring_attention: full recompute that keeps attention's (out, lse)
                     (offloaded with the layer input inside an offload scope)
- norm_recompute.py  RecomputedNorm: norm output released after its consumer, recomputed in backward; works under
                     saved-tensor hooks (tracker, offload)
- tiling.py          tiled_mlp and chunked_output_cross_entropy (sequence tiling of the MLP and the loss)
"""

from .host_pool import HostPool
from .keep_attention import KeptAttentionCache, kept_ring_attention
from .norm_recompute import RecomputedNorm
from .offload import ActivationOffloader
from .tiling import TiledMLP, check_tiling_policy, chunked_output_cross_entropy, resolve_tiles, shift_labels, tiled_mlp
from .tracker import ActivationTracker, MemoryStats, memory_scope, track_activation_memory

__all__ = [
    "ActivationOffloader",
    "ActivationTracker",
    "HostPool",
    "KeptAttentionCache",
    "MemoryStats",
    "RecomputedNorm",
    "TiledMLP",
    "check_tiling_policy",
    "chunked_output_cross_entropy",
    "kept_ring_attention",
    "memory_scope",
    "resolve_tiles",
    "shift_labels",
    "tiled_mlp",
    "track_activation_memory",
]
