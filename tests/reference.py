"""fp64 reference attention on the full (unsharded) sequence, written independently of the package."""

from __future__ import annotations

import torch


def reference_attention(q, k, v, causal: bool, scale: float | None = None):
    """q [b, s, hq, d], k/v [b, s, hkv, d] -> [b, s, hq, d]; computed in float64 with repeated KV heads."""
    s = q.shape[1]
    allowed = torch.ones(s, s, dtype=torch.bool).tril() if causal else None
    return reference_sink_attention(q, k, v, None, allowed, scale)


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


def reference_sink_attention(q, k, v, sinks, allowed=None, scale: float | None = None):
    """fp64 attention with one sink logit per query head in the softmax denominator (GPT-OSS):
    p = softmax over [the allowed scores of the row, sinks[h]], the sink's column dropped before P @ V.

    q [b, s, hq, d], k [b, t, hkv, d], v [b, t, hkv, dv] -> [b, s, hq, dv]; ``sinks`` [hq] (None: plain softmax);
    ``allowed`` [s, t] bool (None: every key). With a sink, a row with no allowed key gives 0."""
    q, k, v = q.double(), k.double(), v.double()
    g = q.shape[2] // k.shape[2]
    k = k.repeat_interleave(g, dim=2)
    v = v.repeat_interleave(g, dim=2)
    scale = q.shape[-1] ** -0.5 if scale is None else scale
    scores = torch.einsum("bshd,bthd->bhst", q, k) * scale
    if allowed is not None:
        scores = scores.masked_fill(~allowed, float("-inf"))
    if sinks is not None:
        b, h, s, _ = scores.shape
        scores = torch.cat([scores, sinks.double().view(1, h, 1, 1).expand(b, h, s, 1)], dim=-1)
    probs = torch.softmax(scores, -1)
    if sinks is not None:
        probs = probs[..., :-1]
    return torch.einsum("bhst,bthd->bshd", probs, v)


def reference_sinks_forward_backward(q, k, v, dout, sinks, allowed=None, scale: float | None = None):
    """(out, dq, dk, dv, dsinks) in float64 by autograd through ``reference_sink_attention``."""
    q, k, v, sinks = (t.detach().double().requires_grad_() for t in (q, k, v, sinks))
    out = reference_sink_attention(q, k, v, sinks, allowed, scale)
    out.backward(dout.double())
    return out.detach(), q.grad, k.grad, v.grad, sinks.grad
