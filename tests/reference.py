"""fp64 reference attention on the full (unsharded) sequence, written independently of the package."""

from __future__ import annotations

import torch


def reference_attention(q, k, v, causal: bool, scale: float | None = None):
    """q [b, s, hq, d], k/v [b, s, hkv, d] -> [b, s, hq, d]; computed in float64 with repeated KV heads."""
    q, k, v = q.double(), k.double(), v.double()
    g = q.shape[2] // k.shape[2]
    k = k.repeat_interleave(g, dim=2)
    v = v.repeat_interleave(g, dim=2)
    scale = q.shape[-1] ** -0.5 if scale is None else scale
    scores = torch.einsum("bshd,bthd->bhst", q, k) * scale
    if causal:
        s = q.shape[1]
        scores = scores.masked_fill(~torch.ones(s, s, dtype=torch.bool).tril(), float("-inf"))
    return torch.einsum("bhst,bthd->bshd", torch.softmax(scores, -1), v)


def reference_forward_backward(q, k, v, dout, causal: bool, scale: float | None = None):
    """(out, dq, dk, dv) in float64."""
    q, k, v = (t.detach().double().requires_grad_() for t in (q, k, v))
    out = reference_attention(q, k, v, causal, scale)
    out.backward(dout.double())
    return out.detach(), q.grad, k.grad, v.grad


def rel_err(got: torch.Tensor, want: torch.Tensor) -> float:
    """max |got - want| / max |want| (float64)."""
    want = want.double()
    return ((got.double() - want).abs().max() / want.abs().max().clamp_min(1e-30)).item()
