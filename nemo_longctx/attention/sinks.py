"""Attention sinks: one extra logit per query head in the softmax denominator (GPT-OSS; "off-by-one" softmax).

With scores s_j of a query row of head h and a sink logit sigma_h,

    p_j = exp(s_j) / (sum_j exp(s_j) + exp(sigma_h)),    out = sum_j p_j v_j    (the sink has no value).

``softmax_type`` (Megatron-core's names): "vanilla" (no sink), "off-by-one" (a fixed sigma_h = 0, i.e. the
denominator + 1; nothing to learn) or "learnable" (``sinks`` [num_query_heads], a parameter). Left as None it
is "learnable" when ``sinks`` is given, else "vanilla".

Every algorithm of this package computes the final (out, lse) of each query row before its backward; the sink
enters there, once (never per ring block), by ``apply_sinks``:

    lse' = logaddexp(lse, sigma_h),    out' = out * exp(lse - lse')

The algorithms' backwards are exact when given (out', lse') in place of (out, lse): the kernels recompute
p_j = exp(s_j - lse') and D = rowsum(dout * out'), which is sum_j p_j (dout . v_j) with the sink included. The
sink's gradient (``sinks_grad``) is

    dsigma_h = -sum over rows of exp(sigma_h - lse'_row) * rowsum(dout_row * out'_row),

summed over the rows (and batch) a rank holds: under context parallelism each rank returns its partial sum, for
the heads it computed (zeros elsewhere); data-parallel gradient reduction over the CP group (Megatron's DDP)
completes it. Rows that saw no key (packed-sequence padding: lse = -inf, out = 0) are left as they are and add
nothing to the gradient.
"""

from __future__ import annotations

from typing import Optional, Tuple

import torch

Tensor = torch.Tensor

SOFTMAX_TYPES = ("vanilla", "off-by-one", "learnable")


def _accumulator_dtype(dtype: torch.dtype) -> torch.dtype:
    return torch.float64 if dtype == torch.float64 else torch.float32


def resolve_sinks(sinks: Optional[Tensor], softmax_type: Optional[str], q: Tensor,
                  fn: str = "attention") -> Optional[Tensor]:
    """Validate ``sinks`` / ``softmax_type`` for q [b, s, hq, d] and return the sink logits the algorithms use:
    None for vanilla softmax, else an [hq] tensor in the accumulator dtype (float32; float64 for float64 q) --
    for "learnable" a differentiable cast of ``sinks`` (its gradient flows back in ``sinks``' dtype), for
    "off-by-one" zeros that need no gradient. Raises ValueError (before any communication)."""
    if softmax_type is not None and softmax_type not in SOFTMAX_TYPES:
        raise ValueError(f"{fn}: softmax_type={softmax_type!r} must be one of {SOFTMAX_TYPES} (or None: "
                         "'learnable' when sinks are given, else 'vanilla')")
    kind = softmax_type or ("learnable" if sinks is not None else "vanilla")
    if kind != "learnable":
        if sinks is not None:
            raise ValueError(f"{fn}: sinks given with softmax_type={kind!r}: only 'learnable' takes a sink tensor "
                             "(off-by-one uses a fixed sink logit of 0)")
        if kind == "vanilla":
            return None
        return torch.zeros(q.shape[2], dtype=_accumulator_dtype(q.dtype), device=q.device)
    if sinks is None:
        raise ValueError(f"{fn}: softmax_type='learnable' needs sinks (a [num_query_heads] tensor)")
    if not isinstance(sinks, Tensor):
        raise ValueError(f"{fn}: sinks must be a torch.Tensor, got {type(sinks).__name__}")
    if not sinks.is_floating_point():
        raise ValueError(f"{fn}: sinks must be a floating-point tensor, got {sinks.dtype}")
    if sinks.dim() != 1 or sinks.shape[0] != q.shape[2]:
        raise ValueError(f"{fn}: sinks must have shape [num_query_heads] = [{q.shape[2]}] (one logit per query "
                         f"head, all heads on every rank), got {tuple(sinks.shape)}")
    if sinks.device != q.device:
        raise ValueError(f"{fn}: sinks must be on q's device {q.device}, got {sinks.device}")
    return sinks.to(_accumulator_dtype(q.dtype))


def _row_weight(w: Tensor) -> Tensor:
    """[b, h, s] -> [b, s, h, 1] (a view) to scale an [b, s, h, d] output."""
    return w.transpose(1, 2).unsqueeze(-1)


def apply_sinks(out: Tensor, lse: Tensor, sinks: Tensor) -> Tuple[Tensor, Tensor]:
    """(out', lse') of final rows out [b, s, h, dv], lse [b, h, s] with the sink logits ``sinks`` [h] (all three in
    any float dtypes; computed in lse's dtype): lse' = logaddexp(lse, sink), out' = out * exp(lse - lse'). Rows
    with lse = -inf (no key) keep lse' = -inf and out' = 0. New tensors; out' in the promoted dtype of out and lse."""
    sink = sinks.to(lse.dtype).view(1, -1, 1)
    seen = lse > float("-inf")
    weight = torch.where(seen, torch.sigmoid(lse - sink), torch.zeros_like(lse))  # exp(lse - lse')
    new_lse = torch.where(seen, torch.logaddexp(lse, sink), lse)
    return out * _row_weight(weight), new_lse


def sinks_grad(dout: Tensor, out: Tensor, lse: Tensor, sinks: Tensor) -> Tensor:
    """d loss / d sinks [h] (in ``sinks``' dtype) from the rows a rank holds: dout [b, s, h, dv], and the final
    out' [b, s, h, dv], lse' [b, h, s] that ``apply_sinks`` returned. Rows with lse' = -inf add nothing."""
    ct = lse.dtype
    sink = sinks.to(ct).view(1, -1, 1)
    delta = torch.einsum("bshd,bshd->bhs", dout.to(ct), out.to(ct))  # rowsum(dout * out')
    seen = lse > float("-inf")
    p_sink = torch.where(seen, torch.exp(sink - lse), torch.zeros_like(lse))  # the sink's softmax probability
    return (p_sink * delta).sum((0, 2)).neg().to(sinks.dtype)
