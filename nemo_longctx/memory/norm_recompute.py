"""Norm recompute that works under saved-tensor hooks (activation tracker, offload scopes).

A normalisation ``y = norm(x)`` whose output is consumed by one module (e.g. the QKV projection) costs the consumer's
saved copy of ``y`` (plus the norm's own saved statistics). ``RecomputedNorm`` runs the norm without a graph, keeps
only ``x`` for backward (through ``ctx.save_for_backward``, so saved-tensor hooks see it), and once the consumer has
run, ``discard(consumer_output)`` releases ``y``'s storage (``resize_(0)``: the tensor keeps its metadata, so the
consumer's saved reference stays valid) and registers a gradient hook on the consumer's output. That hook fires
before the consumer's backward: it recomputes ``y`` from ``x`` with a graph and copies it back into the released
storage, which the consumer's saved tensor then reads. The norm's backward uses the recomputed graph
(``torch.autograd.grad`` on the detached copy of ``x`` and the norm's parameters) and returns the gradients of ``x`` and
of the parameters through this Function's own inputs: nothing depends on the identity of the objects that were
saved (Megatron's ``CheckpointWithoutOutput`` reads ``.grad`` of the very tensors it saved, which saved-tensor hooks
replace, and silently loses the input gradient).

Accounting: ``x`` is a saved tensor (the tracker counts it; an offload scope may move it); ``y``'s bytes are
reported released to the trackers when its storage is freed (``tracker.report_released``).

Under a hook that copies ``y`` when the consumer saves it (offload), the consumer reads its own copy: the refilled
storage is then unused but harmless. The norm must be deterministic (no dropout inside it).
"""

from __future__ import annotations

from typing import Callable, Optional, Sequence

import torch

from .tracker import in_backward, report_released

Tensor = torch.Tensor


class RecomputedNorm:
    """One call of a norm under recompute (see module docstring): ``y = RecomputedNorm(fn, params)(x)``, then
    ``discard(consumer_output)`` after the consumer of ``y`` has run."""

    __slots__ = ("fn", "params", "ctx", "output", "storage", "graph", "discarded", "__weakref__")

    def __init__(self, fn: Callable[[Tensor], Tensor], params: Sequence[Tensor] = ()) -> None:
        self.fn = fn
        self.params = tuple(params)
        self.ctx = None
        self.output: Optional[Tensor] = None
        self.storage = None
        self.graph = None
        self.discarded = False

    def __call__(self, x: Tensor) -> Tensor:
        if not torch.is_grad_enabled() or in_backward():
            return self.fn(x)
        y = _RecomputedNormFn.apply(self, x, *self.params)
        self.output = y
        return y

    def discard(self, consumer_output: Tensor) -> None:
        """Release ``y``'s storage and recompute it when the gradient of ``consumer_output`` is computed."""
        y, self.output = self.output, None
        if y is None or self.ctx is None:
            return  # no graph was built (no grad, or evaluation)
        if not isinstance(consumer_output, Tensor) or not consumer_output.requires_grad:
            return  # no backward will run through the consumer: nothing to restore, y stays as it is
        if y.storage_offset() != 0 or not y.is_contiguous():
            raise RuntimeError("RecomputedNorm: the norm output must be a contiguous tensor at storage offset 0 "
                               f"(got offset {y.storage_offset()}, strides {y.stride()})")
        self.storage = y.untyped_storage()
        report_released(y)
        self.storage.resize_(0)
        self.discarded = True
        consumer_output.register_hook(self._refill)

    def _recompute(self):
        (x,) = self.ctx.saved_tensors
        x_d = x.detach().requires_grad_(x.requires_grad)
        with torch.enable_grad():
            y = self.fn(x_d)
        return x_d, y

    def _refill(self, grad):
        if self.graph is None and self.ctx is not None:
            self.graph = self._recompute()
            y = self.graph[1]
            with torch.no_grad():
                src = y.untyped_storage()
                self.storage.resize_(src.nbytes())
                self.storage.copy_(src)
        return None


class _RecomputedNormFn(torch.autograd.Function):
    @staticmethod
    def forward(ctx, state: RecomputedNorm, x: Tensor, *params: Tensor) -> Tensor:
        with torch.no_grad():
            y = state.fn(x)
        ctx.save_for_backward(x)
        ctx.state = state
        state.ctx = ctx
        return y

    @staticmethod
    def backward(ctx, dy):
        state: RecomputedNorm = ctx.state
        graph = state.graph if state.graph is not None else state._recompute()
        state.graph = state.ctx = state.storage = None
        ctx.state = None
        x_d, y = graph
        wanted = [x_d] + list(state.params)
        needs = [ctx.needs_input_grad[1]] + list(ctx.needs_input_grad[2:])
        inputs = [t for t, n in zip(wanted, needs) if n]
        grads = iter(torch.autograd.grad(y, inputs, dy, allow_unused=True) if inputs else ())
        out = [next(grads) if n else None for n in needs]
        return (None, *out)
