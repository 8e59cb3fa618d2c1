"""``recompute.modules=[layernorm]`` for Megatron TransformerLayers with nemo_longctx's own norm recompute
(``memory.norm_recompute.RecomputedNorm``), which works under saved-tensor hooks (tracker, offload).

Megatron builds a layer with ``recompute_input_layernorm`` / ``recompute_pre_mlp_layernorm`` set when
``"layernorm" in config.recompute_modules``; its ``CheckpointWithoutOutput`` path loses the norm-input gradient
whenever a saved-tensor hook is active. So the layer's two norms are built from a norm spec
(``recomputable_norm_spec``, put in by ``spec.long_context_layer_spec`` when the model config asks for layernorm
recompute): ``RecomputableNorm`` builds the norm of the original spec entry and holds its parameters itself (same
names, same state dict), its own forward running that norm plainly or -- once ``install_norm_recompute`` has armed it
-- through ``RecomputedNorm`` (the norm without a graph, only the norm input saved).
``install_norm_recompute(layer)`` turns Megatron's two flags off (Megatron then calls the norms plainly), arms the norms
and hooks the consumers:
  * a forward hook on the consumer (``self_attention`` for the input norm, ``mlp`` for the pre-MLP norm) releases
    the norm output's storage once the consumer has run and recomputes it when the consumer output's gradient is
    computed (as Megatron does). When the consumer runs without grad (``recompute.modules`` also has ``mlp``: the
    MLP runs inside Megatron's checkpoint), the release waits for the layer's output and the recompute happens
    when the layer's output gradient arrives.
``remove()`` on the returned handle disarms the norms (they run plainly again) and restores Megatron's flags.
"""

from __future__ import annotations

from typing import Any, List, Optional

import torch
from torch.func import functional_call

from nemo_longctx.memory.norm_recompute import RecomputedNorm

from .mcore_versions import uses_fp8_or_fp4

_PAIRS = (("recompute_input_layernorm", "input_layernorm", "self_attention"),
          ("recompute_pre_mlp_layernorm", "pre_mlp_layernorm", "mlp"))


def _first_tensor(out: Any):
    if isinstance(out, torch.Tensor):
        return out
    if isinstance(out, (tuple, list)):
        for o in out:
            if isinstance(o, torch.Tensor):
                return o
    return None


class RecomputableNorm(torch.nn.Module):
    """A layer norm built from a norm spec entry ``norm`` (Megatron's ``build_module`` arguments: config, hidden size,
    eps): the built norm's parameters and buffers are this module's own (same names: the state dict is the plain
    norm's), and its forward is computed with them (``torch.func.functional_call``), plainly -- bit for bit the plain
    norm -- or, once armed by ``install_norm_recompute``, through ``RecomputedNorm``."""

    def __init__(self, config: Any, hidden_size: int, eps: float = 1e-5, *, norm: Any = None, **kwargs: Any) -> None:
        super().__init__()
        from megatron.core.transformer.spec_utils import build_module

        built = build_module(norm, config=config, hidden_size=hidden_size, eps=eps, **kwargs)
        if (any(True for _ in built.children())
                or type(built).get_extra_state is not torch.nn.Module.get_extra_state):
            raise ValueError(f"recompute.modules=[layernorm]: the layer's norm {type(built).__name__} has submodules "
                             "or extra state; nemo_longctx's norm recompute takes a plain norm module")
        for name, p in built.named_parameters(recurse=False):
            self.register_parameter(name, p)
        for name, b in built.named_buffers(recurse=False):
            self.register_buffer(name, b, persistent=name not in built._non_persistent_buffers_set)
        self.norm_class = type(built)
        object.__setattr__(self, "_norm", built)  # not a submodule: its parameters are this module's
        self._pending: Optional[List[RecomputedNorm]] = None  # armed by install_norm_recompute

    def plain(self, x: torch.Tensor) -> torch.Tensor:
        """The built norm's forward with this module's current parameters and buffers."""
        tensors = dict(self.named_parameters(recurse=False))
        tensors.update(self.named_buffers(recurse=False))
        return functional_call(self._norm, tensors, (x,))

    @property
    def armed(self) -> bool:
        return self._pending is not None

    def arm(self, pending: Optional[List[RecomputedNorm]]) -> None:
        """Run through ``RecomputedNorm`` from now on, each call's state appended to ``pending`` (None: plainly)."""
        self._pending = pending

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self._pending is None:
            return self.plain(x)
        rn = RecomputedNorm(self.plain, tuple(self.parameters(recurse=False)))
        y = rn(x)
        if rn.output is not None:
            self._pending.append(rn)
        return y

    def extra_repr(self) -> str:
        return f"{self.norm_class.__name__}{', recomputed' if self.armed else ''}"


def recomputable_norm_spec(norm: Any) -> Any:
    """The spec entry of a layer norm under nemo_longctx's norm recompute: ``norm`` (the original entry) built inside
    ``RecomputableNorm``. ``IdentityOp`` (a norm fused into the next linear) stays as it is."""
    from megatron.core.transformer.identity_op import IdentityOp
    from megatron.core.transformer.spec_utils import ModuleSpec

    module = norm.module if isinstance(norm, ModuleSpec) else norm
    if module is IdentityOp or module is RecomputableNorm:
        return norm
    return ModuleSpec(module=RecomputableNorm, params={"norm": norm})


def norm_recompute_configured(config: Any) -> bool:
    """Whether ``config`` (a TransformerConfig with Megatron's recompute fields set) asks for layernorm recompute."""
    return (getattr(config, "recompute_granularity", None) == "selective"
            and "layernorm" in (getattr(config, "recompute_modules", None) or ()))


class NormRecomputeHandle:
    def __init__(self) -> None:
        self._undo: List[Any] = []

    def remove(self) -> None:
        while self._undo:
            self._undo.pop()()


def install_norm_recompute(layer: Any) -> NormRecomputeHandle:
    """Replace Megatron's layernorm recompute of ``layer`` (a TransformerLayer built with ``recompute_modules``
    containing ``layernorm``, its norms from ``recomputable_norm_spec``) by ``RecomputedNorm``; returns a handle with
    ``remove()``."""
    if uses_fp8_or_fp4(layer.config):
        raise ValueError("recompute.modules=[layernorm] with fp8/fp4 is not supported by nemo_longctx's norm recompute")
    handle = NormRecomputeHandle()
    deferred: List[RecomputedNorm] = []
    for flag, norm_name, consumer_name in _PAIRS:
        if not getattr(layer, flag, False):
            continue
        norm, consumer = getattr(layer, norm_name), getattr(layer, consumer_name)
        if not isinstance(norm, RecomputableNorm):
            raise ValueError(f"recompute.modules=[layernorm]: layer {getattr(layer, 'layer_number', '?')}'s "
                             f"{norm_name} is a {type(norm).__name__}, not built from nemo_longctx's norm spec "
                             "(spec.long_context_layer_spec with a model config that asks for layernorm recompute)")
        pending: List[RecomputedNorm] = []

        def after_consumer(mod, args, out, _pending=pending):
            if not _pending:
                return
            rn = _pending.pop()
            hook_tensor = _first_tensor(out)
            if torch.is_grad_enabled() or (hook_tensor is not None and hook_tensor.requires_grad):
                rn.discard(hook_tensor)  # (no-op when no gradient flows through the consumer)
            else:
                deferred.append(rn)  # consumer ran inside a checkpoint's no-grad forward: release after the layer

        norm.arm(pending)
        h = consumer.register_forward_hook(after_consumer)
        setattr(layer, flag, False)

        def undo(_norm=norm, _h=h, _flag=flag):
            _h.remove()
            _norm.arm(None)
            setattr(layer, _flag, True)

        handle._undo.append(undo)

    if handle._undo:
        def after_layer(mod, args, out):
            hook_tensor = _first_tensor(out)
            while deferred:
                deferred.pop().discard(hook_tensor)

        h = layer.register_forward_hook(after_layer)
        handle._undo.append(h.remove)
    return handle
