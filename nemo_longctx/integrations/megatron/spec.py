"""Swap nemo_longctx's core attention into Megatron GPT layer specs (local or TransformerEngine specs).

``long_context_layer_spec(spec, cp_algorithm="ring", **algorithm_kwargs)`` returns a copy of a layer ``ModuleSpec``
(or of a block spec, ``TransformerBlockSubmodules`` with ``layer_specs``) whose every
``submodules.self_attention.submodules.core_attention`` is
``ModuleSpec(module=LongContextCoreAttention, params={"cp_algorithm": ..., "cp_algorithm_kwargs": {...}})``.
Only ``core_attention`` changes: the projections, norms and MLP stay as the original spec built them; a layer of
exactly Megatron's ``TransformerLayer`` becomes ``chunked_layer.LongContextTransformerLayer`` (the same layer, which
can also run one call in sequence chunks) -- except Megatron's own MoE layer, whose routing is made CP-correct
(``integrations.megatron.moe``; same parameters, same state
dict): its router becomes ``moe.GroupSinkhornRouter`` (Sinkhorn balanced over the whole sequence), and on a
Megatron-core older than 0.19 the layer becomes ``moe.LongContextMoELayer``, which also gives the auxiliary losses the
CP-size gradient factor those versions leave out (before 0.17; 0.19 with ``calculate_per_token_loss``).
"""

from __future__ import annotations

import copy
import dataclasses
import functools
import inspect
from typing import Any, Iterable, Optional

from megatron.core.transformer.spec_utils import ModuleSpec
from megatron.core.transformer.transformer_layer import TransformerLayer

from .chunked_layer import LongContextTransformerLayer
from .core_attention import LongContextCoreAttention
from .cp_algorithms import get_cp_algorithm


def core_attention_spec(cp_algorithm: str = "ring", **algorithm_kwargs: Any) -> ModuleSpec:
    get_cp_algorithm(cp_algorithm)  # unknown names fail here, at spec time
    return ModuleSpec(
        module=LongContextCoreAttention,
        params={"cp_algorithm": cp_algorithm, "cp_algorithm_kwargs": dict(algorithm_kwargs)},
    )


def layer_specs_of(spec: Any) -> Iterable[ModuleSpec]:
    """The per-layer ModuleSpecs of a layer spec (itself) or of a block spec (its ``layer_specs``)."""
    if isinstance(spec, ModuleSpec):
        return [spec]
    layer_specs = getattr(spec, "layer_specs", None)
    if layer_specs is not None:  # TransformerBlockSubmodules
        return list(layer_specs)
    raise ValueError("expected a Megatron layer ModuleSpec or a block spec with layer_specs, "
                     f"got {type(spec).__name__}")


def resolve_layer_spec(base: Any, config: Any, vp_stage: Optional[int] = None) -> Any:
    """A model config's ``transformer_layer_spec`` as a spec: a ModuleSpec/block spec as is, a callable called
    with ``(config, vp_stage=...)`` when it takes ``vp_stage`` and with ``(config)`` otherwise."""
    if isinstance(base, ModuleSpec) or hasattr(base, "layer_specs"):
        return base
    if "vp_stage" in inspect.signature(base).parameters:
        return base(config, vp_stage=vp_stage)
    return base(config)


def long_context_layer_spec(spec: Any, cp_algorithm: str = "ring", *, norm_recompute: bool = False,
                            **algorithm_kwargs: Any) -> Any:
    """Copy of ``spec`` (layer ModuleSpec or block spec) with our core attention in every layer; with
    ``norm_recompute`` (the model config asks for ``recompute_modules`` with ``layernorm``) each layer's input and
    pre-MLP norms are built for nemo_longctx's norm recompute (``norm_recompute_layer.recomputable_norm_spec``)."""
    try:
        new = copy.deepcopy(spec)
    except (TypeError, copy.Error) as e:  # e.g. "cannot pickle 'cell' object": placeholders of missing TE modules
        raise ValueError(
            f"model.transformer_layer_spec cannot be copied to put our core attention in ({type(e).__name__}: {e}): "
            "this model config builds its layers from modules that are placeholders here (NeMo's Gemma 2/3 specs "
            "need TransformerEngine layers); it cannot be trained without TransformerEngine") from e
    for i, layer in enumerate(layer_specs_of(new)):
        attn = getattr(getattr(layer, "submodules", None), "self_attention", None)
        attn_sub = getattr(attn, "submodules", None)
        if attn_sub is None or not hasattr(attn_sub, "core_attention"):
            raise ValueError(
                f"layer spec {i} has no self_attention.submodules.core_attention (module "
                f"{getattr(attn, 'module', attn)!r}); only standard (GQA/MHA) self-attention layers are supported"
            )
        attn_sub.core_attention = core_attention_spec(cp_algorithm, **algorithm_kwargs)
        if getattr(layer, "module", None) is TransformerLayer:  # the same layer, able to run a call in sequence
            layer.module = LongContextTransformerLayer  # chunks (recompute.sequence_chunks, chunked_layer.py)
        _fix_moe_routing_for_cp(layer)
        if norm_recompute:
            _recomputable_norms(layer)
    return new


def _recomputable_norms(layer: Any) -> None:
    """The layer's input and pre-MLP norm entries built inside ``RecomputableNorm`` (norm recompute)."""
    from .norm_recompute_layer import recomputable_norm_spec

    sub = getattr(layer, "submodules", None)
    for name in ("input_layernorm", "pre_mlp_layernorm"):
        if sub is not None and getattr(sub, name, None) is not None:
            setattr(sub, name, recomputable_norm_spec(getattr(sub, name)))


def _fix_moe_routing_for_cp(layer: Any) -> None:
    """Megatron's own MoE layer gets CP-correct routing (see ``integrations.megatron.moe``): its router entry becomes
    ``moe.GroupSinkhornRouter`` where Megatron-core has one (0.19 on, where the MoE spec is
    ``functools.partial(MoELayer, submodules=MoESubmodules(...))``), and the layer becomes ``moe.LongContextMoELayer``
    where this Megatron-core leaves the CP factor out of the auxiliary-loss gradient or has no router entry (before
    0.19: a ``ModuleSpec``); any other MLP module stays."""
    layer_sub = getattr(layer, "submodules", None)
    mlp = getattr(layer_sub, "mlp", None)
    from megatron.core.transformer.moe.moe_layer import MoELayer
    from megatron.core.transformer.moe.router import TopKRouter

    from .moe import GroupSinkhornRouter, LongContextMoELayer, has_router_submodule, needs_long_context_moe_layer

    if isinstance(mlp, ModuleSpec):
        module, moe_sub = mlp.module, mlp.submodules
    elif isinstance(mlp, functools.partial):
        module, moe_sub = mlp.func, mlp.keywords.get("submodules")
    else:
        return
    if module is not MoELayer:
        return
    if has_router_submodule() and moe_sub is not None and getattr(moe_sub, "router", None) is TopKRouter:
        moe_sub = dataclasses.replace(moe_sub, router=GroupSinkhornRouter)
    new_module = LongContextMoELayer if needs_long_context_moe_layer() else MoELayer
    if isinstance(mlp, ModuleSpec):
        mlp.module, mlp.submodules = new_module, moe_sub
    else:
        layer_sub.mlp = functools.partial(new_module, *mlp.args, **{**mlp.keywords, "submodules": moe_sub})


class LongContextSpec:
    """A callable layer spec ``spec(config, vp_stage=None)``: the ``base`` spec (a ModuleSpec, block spec or a
    callable of the model config) with our core attention in every layer. What a front end puts into its model
    config's ``transformer_layer_spec`` (Megatron-Bridge's provider calls it with itself; NeMo 2 subclasses it to
    record it in its checkpoint context). Called when the model is built, after the recompute fields are on the config:
    a config that asks for layernorm recompute gets its norms built for nemo_longctx's norm recompute."""

    def __init__(self, base: Any, cp_algorithm: str = "ring", algorithm_kwargs: Optional[dict] = None) -> None:
        self.base = base
        self.cp_algorithm = cp_algorithm
        self.algorithm_kwargs = dict(algorithm_kwargs or {})

    def base_spec(self, config: Any, vp_stage: Optional[int] = None) -> Any:
        return resolve_layer_spec(self.base, config, vp_stage)

    def __call__(self, config: Any, vp_stage: Optional[int] = None) -> Any:
        from .norm_recompute_layer import norm_recompute_configured

        return long_context_layer_spec(self.base_spec(config, vp_stage), self.cp_algorithm,
                                       norm_recompute=norm_recompute_configured(config), **self.algorithm_kwargs)

    def __repr__(self) -> str:
        return f"{type(self).__name__}(base={self.base!r}, cp_algorithm={self.cp_algorithm!r})"

    def to_cfg_dict(self) -> dict:
        """How a saved run config holds it (Megatron's config containers call this when they write YAML: Bridge's
        ``run_config.yaml``): this class with its arguments, so the config's loader rebuilds it."""
        return {"_target_": f"{type(self).__module__}.{type(self).__qualname__}", "base": _cfg_value(self.base),
                "cp_algorithm": self.cp_algorithm, "algorithm_kwargs": dict(self.algorithm_kwargs)}


def _cfg_value(value: Any) -> Any:
    """A nested spec wrapper as its own ``to_cfg_dict`` (functions and partials are written by the YAML writer)."""
    return value.to_cfg_dict() if hasattr(value, "to_cfg_dict") else value


def core_attention_modules(spec: Any) -> list:
    """The core_attention module class of every layer in a layer or block spec (for checks and dry runs)."""
    out = []
    for layer in layer_specs_of(spec):
        ca = layer.submodules.self_attention.submodules.core_attention
        out.append(ca.module if isinstance(ca, ModuleSpec) else ca)
    return out
