"""Sliding-window attention: flash-attn's ``window_size=(left, right)`` convention, as dense sub-blocks.

Query at global position i sees key j iff ``i - left <= j <= i + right`` (``-1`` = unbounded on that side;
``(-1, -1)`` = no window); with causal masking ``right`` is 0 (causal sliding window = ``(W, 0)``).

``band_blocks(q_range, k_range, window, tile)`` splits (queries x keys) into dense sub-blocks in global
positions: query tiles of ``tile`` rows; for each tile, the keys no row sees are dropped, the keys every row sees
form one unmasked block, and the two edges of the band are either the top-left causal diagonal (the kernels'
``causal=True``) or a small masked block (tile x tile at most). Rows that see no key of a block are not part of
it, so every computed row has a finite log-sum-exp. Work and mask memory are O(S * (left + right + tile)).

``masked_forward/backward`` run one masked block with a kernel: ``cpu_flash`` takes the additive mask natively
(``attn_mask`` of torch's CPU flash op), ``math`` applies it itself; other kernels fall back to ``math`` for
masked blocks (their unmasked and causal blocks still use the kernel).
"""

from __future__ import annotations

from typing import List, Optional, Tuple

import torch

from .kernels import AttentionKernel

Tensor = torch.Tensor
INF = 1 << 62  # an unbounded window side

# (q_lo, q_hi, k_lo, k_hi, kind) in global positions, kind in {"full", "causal", "mask"}
Band = Tuple[int, int, int, int, str]

DEFAULT_TILE = 256


def normalize_window(window_size, causal: bool, fn: str = "attention") -> Optional[Tuple[int, int]]:
    """(left, right) with INF for unbounded sides and right <= 0 under causal masking; None = no window."""
    if window_size is None:
        return None
    try:
        left, right = window_size
    except (TypeError, ValueError):
        raise ValueError(f"{fn}: window_size must be a pair (left, right), got {window_size!r}") from None
    for name, val in (("left", left), ("right", right)):
        if isinstance(val, bool) or not isinstance(val, int) or val < -1:
            raise ValueError(f"{fn}: window_size {name}={val!r} must be an int >= 0, or -1 for unbounded")
    left = INF if left == -1 else left
    right = INF if right == -1 else right
    if causal:
        right = 0
    if left >= INF and (right >= INF or causal):
        return None  # the plain (causal or full) attention
    return left, right


def _classify(qa: int, qb: int, ka: int, kb: int, left: int, right: int) -> str:
    if kb - 1 <= qa + right and ka >= qb - 1 - left:
        return "full"
    if ka == qa and kb == qb and right == 0 and left >= qb - 1 - qa:
        return "causal"
    return "mask"


def _rows_seeing(qa: int, qb: int, ka: int, kb: int, left: int, right: int) -> Tuple[int, int]:
    """The query rows of [qa, qb) that see at least one key of [ka, kb)."""
    return max(qa, ka - right), min(qb, kb + left) if left < INF else qb


def band_blocks(q_lo: int, q_hi: int, k_lo: int, k_hi: int, left: int, right: int,
                tile: Optional[int] = None) -> List[Band]:
    """Dense sub-blocks of queries [q_lo, q_hi) x keys [k_lo, k_hi) under the window (module docstring);
    ``tile`` defaults to ``DEFAULT_TILE`` (read at call time)."""
    tile = tile or DEFAULT_TILE
    out: List[Band] = []
    for t0 in range(q_lo, q_hi, tile):
        t1 = min(q_hi, t0 + tile)
        lo = max(k_lo, t0 - left) if left < INF else k_lo
        hi = min(k_hi, t1 + right) if right < INF else k_hi
        if lo >= hi:
            continue
        qa, qb = _rows_seeing(t0, t1, lo, hi, left, right)
        if qa >= qb:
            continue
        # keys every row of [qa, qb) sees
        f_lo = max(lo, qb - 1 - left) if left < INF else lo
        f_hi = min(hi, qa + right + 1) if right < INF else hi
        regions = [(lo, hi)] if f_lo >= f_hi else [(lo, f_lo), (f_lo, f_hi), (f_hi, hi)]
        for ka, kb in regions:
            if ka >= kb:
                continue
            ra, rb = _rows_seeing(qa, qb, ka, kb, left, right)
            if ra < rb:
                out.append((ra, rb, ka, kb, _classify(ra, rb, ka, kb, left, right)))
    return out


def window_mask(qa: int, qb: int, ka: int, kb: int, left: int, right: int, dtype, device) -> Tensor:
    """Additive mask [qb-qa, kb-ka]: 0 where the window allows the pair, -inf elsewhere."""
    i = torch.arange(qa, qb, device=device).unsqueeze(1)
    j = torch.arange(ka, kb, device=device).unsqueeze(0)
    ok = (j >= i - min(left, INF)) & (j <= i + min(right, INF))
    return torch.zeros(ok.shape, dtype=dtype, device=device).masked_fill_(~ok, float("-inf"))


def _math_masked_scores(q, k, mask, scale, ct):
    b, sq, hq, d = q.shape
    hkv = k.shape[2]
    qg = q.to(ct).view(b, sq, hkv, hq // hkv, d)
    return torch.einsum("bshgd,bthd->bhgst", qg, k.to(ct)) * scale + mask.to(ct)


def _ct(dtype):
    return torch.float64 if dtype == torch.float64 else torch.float32


def masked_forward(kernel: AttentionKernel, q: Tensor, k: Tensor, v: Tensor, mask: Tensor, scale: float
                   ) -> Tuple[Tensor, Tensor]:
    """(out, lse) of one block with an additive mask (every row has an allowed key)."""
    if kernel.name == "cpu_flash" and q.device.type == "cpu" and q.shape[-1] == v.shape[-1]:
        out, lse = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu(
            q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), 0.0, False, attn_mask=mask.to(q.dtype),
            scale=scale)
        return out.transpose(1, 2), lse
    b, sq, hq, _ = q.shape
    ct = _ct(q.dtype)
    scores = _math_masked_scores(q, k, mask, scale, ct)
    lse = torch.logsumexp(scores, -1)
    probs = torch.exp(scores - lse.unsqueeze(-1))
    out = torch.einsum("bhgst,bthd->bshgd", probs, v.to(ct)).reshape(b, sq, hq, v.shape[-1])
    return out.to(q.dtype), lse.reshape(b, hq, sq)


def masked_backward(kernel: AttentionKernel, dout: Tensor, q: Tensor, k: Tensor, v: Tensor, out: Tensor,
                    lse: Tensor, mask: Tensor, scale: float) -> Tuple[Tensor, Tensor, Tensor]:
    """(dq, dk, dv) of one masked block given the row's final (out, lse) (the split-KV contract)."""
    if kernel.name == "cpu_flash" and q.device.type == "cpu" and q.shape[-1] == v.shape[-1]:
        dq, dk, dv = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu_backward(
            dout.transpose(1, 2), q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2),
            out.to(q.dtype).transpose(1, 2), lse, 0.0, False,
            attn_mask=mask.to(q.dtype), scale=scale)
        return dq.transpose(1, 2), dk.transpose(1, 2), dv.transpose(1, 2)
    b, sq, hq, d = q.shape
    hkv, e = k.shape[2], v.shape[-1]
    g = hq // hkv
    ct = _ct(q.dtype)
    scores = _math_masked_scores(q, k, mask, scale, ct)
    probs = torch.exp(scores - lse.to(ct).view(b, hkv, g, sq, 1))
    do = dout.to(ct).view(b, sq, hkv, g, e)
    delta = (do * out.to(ct).view(b, sq, hkv, g, e)).sum(-1).permute(0, 2, 3, 1).unsqueeze(-1)
    dv = torch.einsum("bhgst,bshgd->bthd", probs, do)
    ds = probs * (torch.einsum("bshgd,bthd->bhgst", do, v.to(ct)) - delta) * scale
    dq = torch.einsum("bhgst,bthd->bshgd", ds, k.to(ct)).reshape(b, sq, hq, d)
    dk = torch.einsum("bhgst,bshgd->bthd", ds, q.to(ct).view(b, sq, hkv, g, d))
    return dq.to(q.dtype), dk.to(k.dtype), dv.to(v.dtype)


def _local(lo_global: int, seg_global: int, seg_local: int) -> int:
    return lo_global - seg_global + seg_local


def windowed_blocks(q_segs, k_segs, window: Tuple[int, int], tile: Optional[int] = None):
    """Band blocks between query segments and key segments, each ``(global_start, local_start, length)``;
    yields (q_slice, k_slice, kind, (qa, qb, ka, kb)) with local slices and global bounds."""
    left, right = window
    for gq, lq, nq in q_segs:
        for gk, lk, nk in k_segs:
            for qa, qb, ka, kb, kind in band_blocks(gq, gq + nq, gk, gk + nk, left, right, tile):
                yield (slice(_local(qa, gq, lq), _local(qb, gq, lq)), slice(_local(ka, gk, lk), _local(kb, gk, lk)),
                       kind, (qa, qb, ka, kb))


def window_forward_blocks(q, k, v, blocks, window, scale, kernel, acc_out, acc_lse, merge) -> None:
    """Compute every windowed block of ``windowed_blocks`` and merge it into the accumulators."""
    left, right = window
    for qs, ks, kind, (qa, qb, ka, kb) in blocks:
        if kind == "mask":
            out, lse = masked_forward(kernel, q[:, qs], k[:, ks], v[:, ks],
                                      window_mask(qa, qb, ka, kb, left, right, q.dtype, q.device), scale)
        else:
            out, lse = kernel.forward(q[:, qs], k[:, ks], v[:, ks], kind == "causal", scale)
        merge(acc_out[:, qs], acc_lse[:, :, qs], out, lse)


def window_backward_blocks(dout, q, k, v, out, lse, blocks, window, scale, kernel, dq, dk, dv) -> None:
    left, right = window
    for qs, ks, kind, (qa, qb, ka, kb) in blocks:
        args = (dout[:, qs], q[:, qs], k[:, ks], v[:, ks], out[:, qs], lse[:, :, qs])
        if kind == "mask":
            dq_i, dk_i, dv_i = masked_backward(kernel, *args, window_mask(qa, qb, ka, kb, left, right, q.dtype,
                                                                          q.device), scale)
        else:
            dq_i, dk_i, dv_i = kernel.backward(*args, kind == "causal", scale)
        dq[:, qs].add_(dq_i)
        dk[:, ks].add_(dk_i)
        dv[:, ks].add_(dv_i)

