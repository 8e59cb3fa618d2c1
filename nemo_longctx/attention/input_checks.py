"""Input checks shared by the context-parallel attention functions; all raise ValueError before any
communication happens."""

from __future__ import annotations

from typing import Optional

import torch

Tensor = torch.Tensor


def check_attention_inputs(
    q: Tensor,
    k: Tensor,
    v: Tensor,
    cp_size: int,
    causal: bool,
    global_seq_len: Optional[int] = None,
    fn: str = "attention",
) -> None:
    """Validate q [b, s_local, hq, d], k [b, s_local, hkv, d], v [b, s_local, hkv, dv] (dv may differ from d:
    MLA) for a zigzag-sharded CP group of ``cp_size``."""
    for name, t in (("q", q), ("k", k), ("v", v)):
        if not isinstance(t, torch.Tensor):
            raise ValueError(f"{fn}: {name} must be a torch.Tensor, got {type(t).__name__}")
        if t.dim() != 4:
            raise ValueError(f"{fn}: {name} must be 4-D [batch, seq, heads, head_dim], got shape {tuple(t.shape)}")
        if not t.is_floating_point():
            raise ValueError(f"{fn}: {name} must be a floating-point tensor, got {t.dtype}")
    if not (q.dtype == k.dtype == v.dtype):
        raise ValueError(f"{fn}: q, k, v must share a dtype, got {q.dtype}, {k.dtype}, {v.dtype}")
    if not (q.device == k.device == v.device):
        raise ValueError(f"{fn}: q, k, v must be on one device, got {q.device}, {k.device}, {v.device}")
    if k.shape[:3] != v.shape[:3]:
        raise ValueError(
            f"{fn}: k and v must agree in batch, sequence length and heads (the value head dim may differ), got "
            f"{tuple(k.shape)} and {tuple(v.shape)}"
        )
    b, s, hq, d = q.shape
    if k.shape[0] != b or k.shape[1] != s or k.shape[3] != d:
        raise ValueError(
            f"{fn}: q {tuple(q.shape)} and k/v {tuple(k.shape)} must agree in batch, local sequence length and "
            "head_dim (layout [batch, seq, heads, head_dim])"
        )
    hkv = k.shape[2]
    if hkv < 1 or hq % hkv != 0:
        raise ValueError(f"{fn}: query heads ({hq}) must be a multiple of key/value heads ({hkv})")
    if s < 1:
        raise ValueError(f"{fn}: empty sequence")
    if cp_size > 1 and causal and s % 2 != 0:
        raise ValueError(
            f"{fn}: local sequence length {s} must be even: the causal zigzag layout holds two equal chunks "
            f"per rank (global length divisible by 2*cp = {2 * cp_size})"
        )
    if global_seq_len is not None and s * cp_size != global_seq_len:
        raise ValueError(
            f"{fn}: group size {cp_size} does not match the layout: local length {s} x {cp_size} ranks != "
            f"global sequence length {global_seq_len}"
        )


def check_window(window_size, causal: bool, cp_size: int, s_local: int, packed: bool, fn: str = "attention"):
    """Normalized sliding window ((left, right), ``window.INF`` for unbounded sides) or None; ValueError on bad
    values or unsupported combinations. With packed sequences (``packed``) the window applies within documents."""
    from .window import normalize_window

    window = normalize_window(window_size, causal, fn=fn)
    if window is None:
        return None
    if not packed and cp_size > 1 and s_local % 2:
        raise ValueError(f"{fn}: sliding-window attention needs the zigzag layout: local sequence length {s_local} "
                         f"must be even (global length divisible by 2*cp = {2 * cp_size})")
    return window
