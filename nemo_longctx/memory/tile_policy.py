"""Tile/chunk-count policies shared by the sequence-tiled MLP and the chunked output layer + loss.

A policy is ``"off"`` (no tiling: callers should use the plain path), ``"auto"`` (``ceil(tokens / tile_tokens)``,
capped at ``tokens``) or a positive int (a fixed count, which must not exceed the number of tokens).

``check_tiling_policy`` validates a policy without knowing the sequence length (for config validation before
step 0); ``resolve_tiles`` turns it into a count for a given number of tokens.
"""

from __future__ import annotations

from typing import Union

# "auto" and its default tile sizes mean the same everywhere (config, planner, layers): defined once, with the
# tiling options
from nemo_longctx.options import DEFAULT_LOSS_CHUNK_TOKENS, DEFAULT_MLP_TILE_TOKENS, auto_tiles  # noqa: F401

TilePolicy = Union[int, str]


def check_tiling_policy(policy: TilePolicy, name: str = "tiles") -> None:
    """Raise ValueError (naming ``name``) unless ``policy`` is "off", "auto" or a positive int."""
    if isinstance(policy, bool) or not isinstance(policy, (int, str)):
        raise ValueError(f"{name} must be 'off', 'auto' or a positive int, got {policy!r}")
    if isinstance(policy, str):
        if policy not in ("off", "auto"):
            raise ValueError(f"{name} must be 'off', 'auto' or a positive int, got {policy!r}")
        return
    if policy <= 0:
        raise ValueError(f"{name} must be a positive number of tiles (or 'off'/'auto'), got {policy}")


def resolve_tiles(policy: TilePolicy, tokens: int, tile_tokens: int, name: str = "tiles") -> int:
    """Number of tiles for a sequence of ``tokens`` tokens: 1 for "off", ``ceil(tokens / tile_tokens)`` for "auto".

    Raises ValueError for a bad policy, a non-positive ``tile_tokens``, or a fixed count larger than ``tokens``.
    """
    check_tiling_policy(policy, name)
    if tokens <= 0:
        raise ValueError(f"{name}: the sequence has no tokens (length {tokens})")
    if policy == "off":
        return 1
    if policy == "auto":
        if isinstance(tile_tokens, bool) or not isinstance(tile_tokens, int) or tile_tokens <= 0:
            raise ValueError(f"{name}: tile_tokens must be a positive int, got {tile_tokens!r}")
        return auto_tiles(tokens, tile_tokens)
    if policy > tokens:
        raise ValueError(f"{name}={policy} exceeds the {tokens} tokens of the local sequence")
    return policy


def tile_bounds(tokens: int, tiles: int) -> list:
    """``[(start, length), ...]`` of ``tiles`` contiguous tiles covering ``tokens`` (first tiles one longer if
    ragged)."""
    base, extra = divmod(tokens, tiles)
    bounds, start = [], 0
    for i in range(tiles):
        length = base + (1 if i < extra else 0)
        bounds.append((start, length))
        start += length
    return bounds

