"""``recompute.modules=[layernorm]`` for Megatron TransformerLayers with nemo_longctx's own norm recompute
(``memory.norm_recompute.RecomputedNorm``), which works under saved-tensor hooks (tracker, offload).

Megatron builds a layer with ``recompute_input_layernorm`` / ``recompute_pre_mlp_layernorm`` set when
``"layernorm" in config.recompute_modules``; its ``CheckpointWithoutOutput`` path loses the norm-input gradient
whenever a saved-tensor hook is active. ``install_norm_recompute(layer)`` turns those two flags off (Megatron then
calls the norms plainly) and instead:
  * the norm instance's ``forward`` runs through ``RecomputedNorm`` (the class's forward without a graph, only the
    norm input saved); parameters, state dict and class are untouched;
  * a forward hook on the consumer (``self_attention`` for the input norm, ``mlp`` for the pre-MLP norm) releases
    the norm output's storage once the consumer has run and recomputes it when the consumer output's gradient is
    computed (as Megatron does). When the consumer runs without grad (``recompute.modules`` also has ``mlp``: the
    MLP runs inside Megatron's checkpoint), the release waits for the layer's output and the recompute happens
    when the layer's output gradient arrives.
``remove()`` on the returned handle restores the plain norms (and Megatron's flags).
"""

from __future__ import annotations

from typing import Any, List

import torch

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


class NormRecomputeHandle:
    def __init__(self) -> None:
        self._undo: List[Any] = []

    def remove(self) -> None:
        while self._undo:
            self._undo.pop()()


def install_norm_recompute(layer: Any) -> NormRecomputeHandle:
    """Replace Megatron's layernorm recompute of ``layer`` (a TransformerLayer built with
    ``recompute_modules`` containing ``layernorm``) by ``RecomputedNorm``; returns a handle with ``remove()``."""
    if uses_fp8_or_fp4(layer.config):
        raise ValueError("recompute.modules=[layernorm] with fp8/fp4 is not supported by nemo_longctx's norm recompute")
    handle = NormRecomputeHandle()
    deferred: List[RecomputedNorm] = []
    for flag, norm_name, consumer_name in _PAIRS:
        if not getattr(layer, flag, False):
            continue
        norm, consumer = getattr(layer, norm_name), getattr(layer, consumer_name)
        plain = type(norm).forward.__get__(norm)
        params = tuple(norm.parameters())
        pending: List[RecomputedNorm] = []

        def forward(x, _plain=plain, _params=params, _pending=pending):
            rn = RecomputedNorm(_plain, _params)
            y = rn(x)
            if rn.output is not None:
                _pending.append(rn)
            return y

        def after_consumer(mod, args, out, _pending=pending):
            if not _pending:
                return
            rn = _pending.pop()
            hook_tensor = _first_tensor(out)
            if torch.is_grad_enabled() or (hook_tensor is not None and hook_tensor.requires_grad):
                rn.discard(hook_tensor)  # (no-op when no gradient flows through the consumer)
            else:
                deferred.append(rn)  # consumer ran inside a checkpoint's no-grad forward: release after the layer

        norm.forward = forward
        h = consumer.register_forward_hook(after_consumer)
        setattr(layer, flag, False)

        def undo(_norm=norm, _h=h, _flag=flag):
            _h.remove()
            del _norm.forward
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
