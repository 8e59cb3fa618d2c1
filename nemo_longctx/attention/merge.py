"""Numerically stable merging of partial attention results by their log-sum-exp.

Partials over disjoint key sets of the same query rows combine exactly:

    lse = log(exp(lse_a) + exp(lse_b))
    out = out_a * exp(lse_a - lse) + out_b * exp(lse_b - lse)

Layouts: ``out`` [b, s, h, d] and ``lse`` [b, h, s] (as returned by the kernels). Accumulators are float32
(or float64); the incoming partial may be bf16/fp16/fp32 and is upcast. Rows that have seen no key carry
``lse = -inf`` and ``out = 0``; merging with them is exact.
"""

from __future__ import annotations

from typing import Tuple

import torch

Tensor = torch.Tensor


def _weights(lse_a: Tensor, lse_b: Tensor) -> Tuple[Tensor, Tensor, Tensor]:
    lse = torch.logaddexp(lse_a, lse_b)
    # Where both are -inf, lse is -inf and the weights would be nan: define them as 0.
    finite = torch.isfinite(lse)
    safe = torch.where(finite, lse, torch.zeros_like(lse))
    wa = torch.where(finite, torch.exp(lse_a - safe), torch.zeros_like(lse))
    wb = torch.where(finite, torch.exp(lse_b - safe), torch.zeros_like(lse))
    return lse, wa, wb


def _as_row_weight(w: Tensor) -> Tensor:
    """[b, h, s] -> [b, s, h, 1] (a view) to scale an [b, s, h, d] output."""
    return w.transpose(1, 2).unsqueeze(-1)


def merge_attention(out_a: Tensor, lse_a: Tensor, out_b: Tensor, lse_b: Tensor) -> Tuple[Tensor, Tensor]:
    """Return the merged (out, lse) of two partials; out in float32 (float64 if an input is float64)."""
    acc = torch.float64 if torch.float64 in (out_a.dtype, out_b.dtype, lse_a.dtype) else torch.float32
    lse, wa, wb = _weights(lse_a.to(acc), lse_b.to(acc))
    out = out_a.to(acc) * _as_row_weight(wa) + out_b.to(acc) * _as_row_weight(wb)
    return out, lse


def merge_attention_(acc_out: Tensor, acc_lse: Tensor, out: Tensor, lse: Tensor) -> None:
    """In-place merge of a partial (out, lse) into float32/float64 accumulators (which may be slices).

    Assumes every row of the accumulator already has a finite lse (true for ring attention, where each row
    sees its own diagonal block first). Sigmoid form, with the two output-sized passes done in place and no
    output-sized temporary (the partial is upcast inside the fused multiply-add, not copied):
    out_acc = sigmoid(lse_acc - lse) * out_acc + sigmoid(lse - lse_acc) * out;  lse_acc = logaddexp(lse_acc, lse).
    """
    lse = lse.to(acc_lse.dtype)
    diff = lse - acc_lse
    w_new = torch.sigmoid(diff)
    w_acc = torch.sigmoid(diff.neg_())
    acc_out.mul_(_as_row_weight(w_acc)).addcmul_(out, _as_row_weight(w_new))
    torch.logaddexp(acc_lse, lse, out=acc_lse)
