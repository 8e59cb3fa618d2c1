"""Output layer + (vocab-parallel) cross entropy per sequence chunk: the full ``[s, vocab]`` logits never exist.

``chunked_output_cross_entropy(hidden, weight, labels, chunks)`` computes, for each chunk of ``t`` tokens,
``logits = hidden_chunk @ weight.T`` (``[t*b, v_local]``, cast to fp32 like Megatron's cross entropy), the
vocab-parallel max / sum-exp / target-logit statistics (all-reduced over ``tp_group`` exactly like
``megatron.core.tensor_parallel.vocab_parallel_cross_entropy``) and the per-token loss in fp32; only the per-token
log-sum-exp (``[s, b]`` fp32) is kept. Gradients are formed chunk by chunk from ``(softmax - onehot) * grad``:
that chunk's ``grad_hidden`` rows and its ``grad_weight`` contribution (accumulated in fp32), so one chunk's
logits are the largest transient. By default this happens in forward, for a unit gradient per token, while the
chunk's logits exist (no recompute); backward rescales (``precompute_grads``). These precomputed gradients
(``grad_hidden`` like ``hidden``, ``grad_weight`` ``[v_local, h]`` in fp32) are held for backward outside autograd's
saved tensors; they are reported to the activation tracker as saved device bytes (``report_saved_on_device``)
for as long as their storage lives, like the saved ``hidden`` and log-sum-exp. Otherwise (or when the upstream
gradient differs between counted tokens) backward recomputes each chunk's logits from the saved log-sum-exp.

Layouts are Megatron's: ``hidden [s, b, h]``, ``weight [v_local, h]`` (the TP shard of the output layer, vocab rows
``[vocab_start_index, vocab_start_index + v_local)``), ``labels [b, s]`` already shifted (``labels[i]`` is the token
after ``tokens[i]``, shifted before any CP sharding; see ``shift_labels``), ``loss_mask [b, s]``. Returns the
per-token loss ``[b, s]`` in fp32 (fp64 for fp64 inputs; like Megatron's ``compute_language_model_loss``),
multiplied by ``loss_mask`` and 0 where ``labels == ignore_index``.

Tensor parallelism: with ``tp_group`` of size > 1 the gradient w.r.t. ``hidden`` is all-reduced over the group
in backward (``reduce_grad_hidden=True``, what ColumnParallelLinear does for its input). With sequence parallelism
pass the all-gathered hidden through Megatron's gather region (whose backward reduce-scatters) and set
``reduce_grad_hidden=False``.
"""

from __future__ import annotations

from typing import Optional, Tuple

import torch
import torch.distributed as dist
from torch import Tensor
from torch.autograd.function import once_differentiable

from .tile_policy import DEFAULT_LOSS_CHUNK_TOKENS, TilePolicy, resolve_tiles, tile_bounds
from .tracker import report_saved_on_device


def _stats_dtype(dtype: torch.dtype) -> torch.dtype:
    """fp32 for half-precision inputs (Megatron casts logits to fp32), else the input dtype (fp32 / fp64)."""
    return torch.promote_types(dtype, torch.float32)


def _group_size_rank(group) -> Tuple[int, int]:
    if group is None:
        return 1, 0
    return dist.get_world_size(group), dist.get_rank(group)


def _chunk_rows(hidden: Tensor, labels: Tensor, start: int, length: int) -> Tuple[Tensor, Tensor]:
    """hidden rows ``[t*b, h]`` and labels ``[t*b]`` of the chunk, both in (s, b) order."""
    h = hidden.narrow(0, start, length).reshape(-1, hidden.shape[-1])
    y = labels.narrow(1, start, length).t().reshape(-1)
    return h, y


def _row_scale(mask, labels_rows: Tensor, start: int, length: int, ignore_index: int, dtype) -> Tensor:
    """Per-row factor in ``dtype``: loss_mask (in (s, b) order) times (label != ignore_index)."""
    scale = (labels_rows != ignore_index).to(dtype)
    if mask is not None:
        scale = scale * mask.narrow(1, start, length).t().reshape(-1).to(dtype)
    return scale


def _softmax_grad_(probs: Tensor, y: Tensor, scale: Tensor, vocab_start: int) -> Tensor:
    """In place: softmax rows ``probs [N, v_local]`` -> ``(softmax - onehot(y)) * scale`` (this rank's vocab shard)."""
    v_local = probs.shape[1]
    local = (y >= vocab_start) & (y < vocab_start + v_local)
    rows = torch.arange(y.numel(), device=y.device)[local]
    probs[rows, y[local] - vocab_start] -= 1.0
    return probs.mul_(scale.unsqueeze(-1))


def _add_chunk_grads(grad_logits: Tensor, h: Tensor, weight: Tensor, grad_hidden_rows, grad_weight) -> None:
    """grad_hidden_rows <- grad_logits @ weight; grad_weight += grad_logits.T @ h (in its accumulation dtype)."""
    g = grad_logits.to(weight.dtype)
    if grad_hidden_rows is not None:
        grad_hidden_rows.copy_(torch.matmul(g, weight).view_as(grad_hidden_rows))
    if grad_weight is not None:
        if grad_weight.dtype == weight.dtype:
            grad_weight.addmm_(g.t(), h)
        else:
            grad_weight.add_(torch.matmul(g.t(), h))


def _new_grad_weight(weight: Tensor) -> Tensor:
    dtype = torch.float32 if weight.dtype in (torch.float16, torch.bfloat16) else weight.dtype
    return torch.zeros(weight.shape, dtype=dtype, device=weight.device)


class _ChunkedOutputCrossEntropy(torch.autograd.Function):
    """See the module docstring. With ``precompute`` the gradients for a unit upstream gradient per token are
    formed in forward while each chunk's logits exist (no recompute); backward scales them (see ``backward``)."""

    @staticmethod
    def forward(ctx, hidden, weight, labels, loss_mask, bounds, group, vocab_start, reduce_grad_hidden, ignore_index,
                precompute):
        s, b, _ = hidden.shape
        v_local = weight.shape[0]
        acc = _stats_dtype(hidden.dtype)
        need_h, need_w = ctx.needs_input_grad[0], ctx.needs_input_grad[1]
        precompute = precompute and (need_h or need_w)
        grad_hidden = torch.empty_like(hidden) if precompute and need_h else None
        grad_weight = _new_grad_weight(weight) if precompute and need_w else None
        loss = torch.empty(b, s, dtype=acc, device=hidden.device)
        lse = torch.empty(s, b, dtype=acc, device=hidden.device)
        for start, length in bounds:
            h, y = _chunk_rows(hidden, labels, start, length)
            logits = torch.matmul(h, weight.t()).to(acc)
            logits_max = logits.max(dim=-1).values
            if group is not None:
                dist.all_reduce(logits_max, op=dist.ReduceOp.MAX, group=group)
            logits.sub_(logits_max.unsqueeze(-1))
            local = (y >= vocab_start) & (y < vocab_start + v_local)
            idx = (y - vocab_start).clamp(0, v_local - 1)
            target_logit = logits.gather(1, idx.unsqueeze(-1)).squeeze(-1) * local
            sum_exp = logits.exp_().sum(dim=-1)
            stats = torch.stack([target_logit, sum_exp])
            if group is not None:
                dist.all_reduce(stats, op=dist.ReduceOp.SUM, group=group)
            log_sum_exp = stats[1].log()
            scale = _row_scale(loss_mask, y, start, length, ignore_index, acc)
            loss.narrow(1, start, length).copy_(((log_sum_exp - stats[0]) * scale).view(length, b).t())
            lse.narrow(0, start, length).copy_((log_sum_exp + logits_max).view(length, b))
            if precompute:
                probs = _softmax_grad_(logits.div_(stats[1].unsqueeze(-1)), y, scale, vocab_start)
                rows = grad_hidden.narrow(0, start, length) if grad_hidden is not None else None
                _add_chunk_grads(probs, h, weight, rows, grad_weight)
                del probs
            del logits
        ctx.save_for_backward(hidden, weight, labels, loss_mask, lse)
        ctx.bounds, ctx.group, ctx.vocab_start = bounds, group, vocab_start
        ctx.reduce_grad_hidden, ctx.ignore_index = reduce_grad_hidden, ignore_index
        ctx.precomputed = precompute
        ctx.grad_hidden, ctx.grad_weight = grad_hidden, grad_weight
        for held in (grad_hidden, grad_weight):  # kept for backward on ctx: bytes the tracker must see
            if held is not None:
                report_saved_on_device(held)
        return loss

    @staticmethod
    def _recompute(ctx, grad_rows: Tensor, grad_hidden, grad_weight) -> None:
        """Recompute each chunk's softmax from the saved log-sum-exp and add its gradients."""
        hidden, weight, labels, loss_mask, lse = ctx.saved_tensors
        for start, length in ctx.bounds:
            h, y = _chunk_rows(hidden, labels, start, length)
            scale = _row_scale(loss_mask, y, start, length, ctx.ignore_index, lse.dtype)
            scale = scale * grad_rows.narrow(0, start, length).reshape(-1).to(lse.dtype)
            probs = torch.matmul(h, weight.t()).to(lse.dtype)
            probs.sub_(lse.narrow(0, start, length).reshape(-1, 1)).exp_()
            _softmax_grad_(probs, y, scale, ctx.vocab_start)
            rows = grad_hidden.narrow(0, start, length) if grad_hidden is not None else None
            _add_chunk_grads(probs, h, weight, rows, grad_weight)
            del probs

    @staticmethod
    @once_differentiable
    def backward(ctx, grad_loss):
        hidden, weight, labels, loss_mask, lse = ctx.saved_tensors
        need_h, need_w = ctx.needs_input_grad[0], ctx.needs_input_grad[1]
        grad_rows = grad_loss.t()  # [s, b], like the saved rows
        if not ctx.precomputed:
            grad_hidden = torch.empty_like(hidden) if need_h else None
            grad_weight = _new_grad_weight(weight) if need_w else None
            _ChunkedOutputCrossEntropy._recompute(ctx, grad_rows, grad_hidden, grad_weight)
        else:
            grad_hidden, grad_weight = ctx.grad_hidden, ctx.grad_weight
            ctx.grad_hidden = ctx.grad_weight = None
            # Row r's grad_hidden depends on its own loss only: scale it by grad_loss[r] (in fp32 per chunk).
            if grad_hidden is not None:
                for start, length in ctx.bounds:
                    rows = grad_hidden.narrow(0, start, length)
                    g = grad_rows.narrow(0, start, length).unsqueeze(-1).to(lse.dtype)
                    rows.copy_(rows.to(lse.dtype) * g)
            # grad_weight sums over rows: exact by one factor only if grad_loss is the same on every row that
            # has a loss (sum or masked mean, with the mask passed in); otherwise recompute it.
            if grad_weight is not None:
                y_all = labels.t().reshape(-1)
                counted = _row_scale(loss_mask, y_all, 0, labels.shape[1], ctx.ignore_index, lse.dtype) != 0
                g = grad_rows.reshape(-1)[counted]
                if g.numel() == 0:
                    grad_weight.zero_()
                elif bool((g == g[0]).all()):
                    grad_weight.mul_(g[0].to(grad_weight.dtype))
                else:
                    grad_weight.zero_()
                    _ChunkedOutputCrossEntropy._recompute(ctx, grad_rows, None, grad_weight)
        if grad_hidden is not None and ctx.group is not None and ctx.reduce_grad_hidden:
            dist.all_reduce(grad_hidden, op=dist.ReduceOp.SUM, group=ctx.group)
        if grad_weight is not None and grad_weight.dtype != weight.dtype:
            grad_weight = grad_weight.to(weight.dtype)
        return grad_hidden, grad_weight, None, None, None, None, None, None, None, None


def chunked_output_cross_entropy(
    hidden: Tensor,
    weight: Tensor,
    labels: Tensor,
    chunks: TilePolicy = "auto",
    *,
    loss_mask: Optional[Tensor] = None,
    tp_group: Optional[dist.ProcessGroup] = None,
    vocab_start_index: Optional[int] = None,
    reduce_grad_hidden: bool = True,
    ignore_index: int = -100,
    chunk_tokens: int = DEFAULT_LOSS_CHUNK_TOKENS,
    precompute_grads: bool = True,
) -> Tensor:
    """Per-token cross entropy ``[b, s]`` (fp32) of ``hidden [s, b, h] @ weight.T`` against ``labels [b, s]``.

    ``chunks``: "auto" (``ceil(s / chunk_tokens)``), a positive int <= s, or "off" (one chunk; integrations
    should use their plain path instead). ``weight [v_local, h]`` is this rank's vocab shard starting at
    ``vocab_start_index`` (default ``tp_rank * v_local``); ``tp_group=None`` means no tensor parallelism.
    Labels outside ``[0, vocab)`` other than ``ignore_index`` behave as in Megatron (loss = log-sum-exp).

    ``precompute_grads=True`` (default): gradients are formed in forward (3 matmuls per chunk in all, like the
    untiled path) and kept until backward (``grad_hidden`` and an fp32 ``grad_weight``). They are exact for any
    upstream gradient w.r.t. ``hidden``; w.r.t. ``weight`` when the upstream gradient is equal on all tokens that
    have a loss (``loss.sum()``, or a masked mean with the mask passed as ``loss_mask``), else the weight gradient
    is recomputed chunk by chunk (one host sync decides). ``False``: backward always recomputes (4 matmuls).
    """
    if not isinstance(hidden, Tensor) or hidden.dim() != 3:
        raise ValueError(f"hidden must be [s, b, h], got shape {getattr(hidden, 'shape', None)}")
    s, b, h = hidden.shape
    if not isinstance(weight, Tensor) or weight.dim() != 2 or weight.shape[1] != h:
        raise ValueError(f"weight must be [v_local, {h}], got shape {tuple(getattr(weight, 'shape', ()))}")
    if not isinstance(labels, Tensor) or tuple(labels.shape) != (b, s):
        raise ValueError(f"labels must be [b, s] = [{b}, {s}], got shape {tuple(getattr(labels, 'shape', ()))}")
    if labels.dtype.is_floating_point or labels.dtype == torch.bool:
        raise ValueError(f"labels must be integer token ids, got dtype {labels.dtype}")
    if loss_mask is not None and tuple(loss_mask.shape) != (b, s):
        raise ValueError(f"loss_mask must be [b, s] = [{b}, {s}], got shape {tuple(loss_mask.shape)}")
    if weight.dtype != hidden.dtype:
        raise ValueError(f"hidden ({hidden.dtype}) and weight ({weight.dtype}) must have the same dtype")
    num_chunks = resolve_tiles(chunks, s, chunk_tokens, name="loss chunks")
    tp_size, tp_rank = _group_size_rank(tp_group)
    group = tp_group if tp_size > 1 else None
    if vocab_start_index is None:
        vocab_start_index = tp_rank * weight.shape[0]
    hidden = hidden.contiguous()
    labels = labels.long()
    return _ChunkedOutputCrossEntropy.apply(
        hidden,
        weight,
        labels,
        loss_mask,
        tile_bounds(s, num_chunks),
        group,
        int(vocab_start_index),
        bool(reduce_grad_hidden),
        int(ignore_index),
        bool(precompute_grads),
    )


def shift_labels(tokens: Tensor, loss_mask: Optional[Tensor] = None, ignore_index: int = -100):
    """Next-token labels for unshifted ``tokens [b, s]``: ``labels[:, i] = tokens[:, i + 1]``; the last is ignored.

    Returns ``(labels [b, s], loss_mask [b, s] float)`` with the last position masked out (and ``loss_mask``
    shifted along if given, so ``mask[:, i]`` is the given mask of the predicted token ``i + 1``). Call this on the
    FULL sequence, before zigzag/CP sharding: after sharding, the next token of a local chunk's last token lives
    in another chunk (often on another rank).
    """
    if tokens.dim() != 2:
        raise ValueError(f"tokens must be [b, s], got shape {tuple(tokens.shape)}")
    if loss_mask is not None and loss_mask.shape != tokens.shape:
        raise ValueError(f"loss_mask must match tokens {tuple(tokens.shape)}, got {tuple(loss_mask.shape)}")
    labels = torch.full_like(tokens, ignore_index)
    labels[:, :-1] = tokens[:, 1:]
    mask = torch.zeros(tokens.shape, dtype=torch.float32, device=tokens.device)
    mask[:, :-1] = 1.0 if loss_mask is None else loss_mask[:, 1:].float()
    return labels, mask
