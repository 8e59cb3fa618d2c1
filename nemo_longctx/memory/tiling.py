"""Sequence tiling for long context: the public entry points, re-exported from one place.

- ``tiled_mlp`` / ``TiledMLP`` (tiled_mlp.py): run an MLP over sequence tiles, keep only its input, recompute per
  tile in backward, so one tile's intermediate is the only one alive.
- ``chunked_output_cross_entropy`` (chunked_loss.py): output layer + (vocab-parallel) cross entropy per sequence
  chunk, so the full ``[s, vocab]`` logits never exist; ``shift_labels`` builds next-token labels before sharding.
- policies (tile_policy.py): "off" | "auto" | positive int, validated with ValueErrors that name the field.
"""

from .chunked_loss import chunked_output_cross_entropy, shift_labels
from .tile_policy import (
    DEFAULT_LOSS_CHUNK_TOKENS,
    DEFAULT_MLP_TILE_TOKENS,
    TilePolicy,
    check_tiling_policy,
    resolve_tiles,
    tile_bounds,
)
from .tiled_mlp import TiledMLP, tiled_mlp

__all__ = [
    "TilePolicy",
    "DEFAULT_MLP_TILE_TOKENS",
    "DEFAULT_LOSS_CHUNK_TOKENS",
    "check_tiling_policy",
    "resolve_tiles",
    "tile_bounds",
    "tiled_mlp",
    "TiledMLP",
    "chunked_output_cross_entropy",
    "shift_labels",
]
