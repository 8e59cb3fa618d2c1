"""Sequence-tiled Megatron MLP, injected through the layer spec (``submodules.mlp``).

``TiledMegatronMLP`` is a subclass of ``megatron.core.transformer.mlp.MLP`` (same submodules, same parameters,
same state dict) whose forward runs ``nemo_longctx.memory.tiling.tiled_mlp`` over the sequence dim of its input
``[s_local, b, h]`` (``s_local = seq_length / cp``, divided by TP under sequence parallelism): one tile's
``[t, b, ffn/tp]`` intermediate is the only one alive, and each tile is recomputed in backward. Megatron's RNG
tracker states are captured per tile and restored for its recompute (like ``tensor_parallel.checkpoint``).

``tiled_mlp_layer_spec(spec, tiles, tile_tokens)`` returns a copy of a layer spec (or block spec) whose every
dense MLP is this subclass; MoE / other MLP modules are refused with a ValueError naming ``tiling.mlp_tiles``.

Note: ``TransformerLayer`` passes ``tp_group=pg_collection.tp`` only to modules that are exactly ``MLP`` (and
logs "Unknown MLP type" for subclasses); the subclass then takes the default TP group from parallel_state,
which is the model's TP group unless a custom ``pg_collection`` is used.
"""

from __future__ import annotations

import copy
import functools
from typing import Any, List, Optional

from megatron.core import tensor_parallel
from megatron.core.transformer.mlp import MLP
from megatron.core.transformer.spec_utils import ModuleSpec

from nemo_longctx.integrations.megatron.spec import layer_specs_of, resolve_layer_spec
from nemo_longctx.memory.tiling import DEFAULT_MLP_TILE_TOKENS, check_tiling_policy, tiled_mlp


def _tracker_hooks():
    """(get_states, set_states) of Megatron's model-parallel RNG tracker (tensor states are cloned)."""
    tracker = tensor_parallel.get_cuda_rng_tracker()

    def get_states():
        return {k: (v.clone() if hasattr(v, "clone") else v) for k, v in tracker.get_states().items()}

    return get_states, tracker.set_states


class TiledMegatronMLP(MLP):
    """Megatron ``MLP`` computed over ``mlp_tiles`` sequence tiles ("auto" = ceil(s / tile_tokens), an int, or
    "off"). Input ``[s, b, h]``, output ``([s, b, h], bias or None)`` exactly as ``MLP.forward``."""

    def __init__(self, *args: Any, mlp_tiles: Any = "auto", tile_tokens: int = DEFAULT_MLP_TILE_TOKENS,
                 **kwargs: Any) -> None:
        check_tiling_policy(mlp_tiles, "tiling.mlp_tiles")
        if isinstance(tile_tokens, bool) or not isinstance(tile_tokens, int) or tile_tokens <= 0:
            raise ValueError(f"tiling.mlp_tile_tokens must be a positive int, got {tile_tokens!r}")
        super().__init__(*args, **kwargs)
        self.mlp_tiles = mlp_tiles
        self.tile_tokens = tile_tokens

    def forward(self, hidden_states, *args: Any, **kwargs: Any):
        if self.mlp_tiles == "off":
            return super().forward(hidden_states, *args, **kwargs)

        def untiled(x):
            return MLP.forward(self, x, *args, **kwargs)

        return tiled_mlp(
            untiled,
            hidden_states,
            self.mlp_tiles,
            seq_dim=0,
            params=[p for p in self.parameters() if p.requires_grad],
            tile_tokens=self.tile_tokens,
            rng_state_hooks=_tracker_hooks(),
        )

    def extra_repr(self) -> str:
        return f"mlp_tiles={self.mlp_tiles!r}, tile_tokens={self.tile_tokens}"

    @classmethod
    def as_tiled_mlp_submodule(cls, *args: Any, mlp_tiles: Any = "auto", tile_tokens: int = DEFAULT_MLP_TILE_TOKENS,
                               **kwargs: Any) -> "TiledMegatronMLP":
        """Megatron-core >= 0.19 builds a layer's MLP by calling ``submodules.mlp(config=..., pg_collection=...,
        is_mtp_layer=..., name=...)`` (``functools.partial(MLP.as_mlp_submodule, submodules=...)`` in its specs):
        the same builder, then the tile policy."""
        check_tiling_policy(mlp_tiles, "tiling.mlp_tiles")
        mlp = cls.as_mlp_submodule(*args, **kwargs)
        mlp.mlp_tiles, mlp.tile_tokens = mlp_tiles, int(tile_tokens)
        return mlp


def _mlp_class(mlp: Any) -> Any:
    """The MLP class a layer spec's ``mlp`` entry builds: a ModuleSpec's module, the class of a
    ``partial(<MLP class>.as_mlp_submodule, ...)`` (megatron-core >= 0.19), else the entry itself."""
    if isinstance(mlp, ModuleSpec):
        return mlp.module
    if isinstance(mlp, functools.partial) and isinstance(getattr(mlp.func, "__self__", None), type):
        return mlp.func.__self__
    return mlp


def tiled_mlp_layer_spec(spec: Any, tiles: Any = "auto", tile_tokens: int = DEFAULT_MLP_TILE_TOKENS) -> Any:
    """Copy of ``spec`` (layer ModuleSpec or block spec) whose every dense MLP is ``TiledMegatronMLP``: a ModuleSpec
    where Megatron builds MLPs with ``build_module`` (<= 0.18), the ``as_mlp_submodule`` builder where it calls the
    spec entry (>= 0.19: ``MLP.as_mlp_submodule`` exists)."""
    check_tiling_policy(tiles, "tiling.mlp_tiles")
    new = copy.deepcopy(spec)
    for i, layer in enumerate(layer_specs_of(new)):
        sub = getattr(layer, "submodules", None)
        mlp = getattr(sub, "mlp", None)
        module = _mlp_class(mlp)
        if module not in (MLP, TiledMegatronMLP):
            raise ValueError(
                f"tiling.mlp_tiles={tiles!r}: layer spec {i} has MLP module {getattr(module, '__name__', module)!r}; "
                "only Megatron's dense MLP can be tiled (not MoE layers or custom MLPs): set tiling.mlp_tiles=off"
            )
        if isinstance(mlp, ModuleSpec):
            params, submodules = dict(mlp.params), mlp.submodules
        elif isinstance(mlp, functools.partial):
            params = {k: v for k, v in mlp.keywords.items() if k not in ("mlp_tiles", "tile_tokens")}
            submodules = params.pop("submodules", None)
        else:
            params, submodules = {}, None
        if hasattr(MLP, "as_mlp_submodule"):
            sub.mlp = functools.partial(TiledMegatronMLP.as_tiled_mlp_submodule, submodules=submodules, **params,
                                        mlp_tiles=tiles, tile_tokens=int(tile_tokens))
        else:
            params.update(mlp_tiles=tiles, tile_tokens=int(tile_tokens))
            sub.mlp = ModuleSpec(module=TiledMegatronMLP, params=params, submodules=submodules)
    return new


def mlp_modules(spec: Any) -> List[Any]:
    """The MLP module class of every layer in a layer or block spec (for checks and dry runs)."""
    return [_mlp_class(layer.submodules.mlp) for layer in layer_specs_of(spec)]


class TiledMLPLayerSpec:
    """Callable layer spec ``spec(config, vp_stage=None)``: the ``base`` spec (a ModuleSpec, block spec or a callable
    of the model config) with every dense MLP tiled. What a front end puts into its model config's
    ``transformer_layer_spec`` (NeMo 2's GPT config, Megatron-Bridge's provider)."""

    def __init__(self, base: Any, mlp_tiles: Any = "auto", tile_tokens: int = DEFAULT_MLP_TILE_TOKENS) -> None:
        self.base = base
        self.mlp_tiles = mlp_tiles
        self.tile_tokens = int(tile_tokens)

    def base_spec(self, config: Any, vp_stage: Optional[int] = None) -> Any:
        return resolve_layer_spec(self.base, config, vp_stage)

    def __call__(self, config: Any, vp_stage: Optional[int] = None) -> Any:
        return tiled_mlp_layer_spec(self.base_spec(config, vp_stage), self.mlp_tiles, self.tile_tokens)

    def __repr__(self) -> str:
        return f"TiledMLPLayerSpec(base={self.base!r}, mlp_tiles={self.mlp_tiles!r})"

    def to_cfg_dict(self) -> dict:
        """How a saved run config holds it (``spec.LongContextSpec.to_cfg_dict``): this class and its arguments."""
        base = self.base.to_cfg_dict() if hasattr(self.base, "to_cfg_dict") else self.base
        return {"_target_": f"{type(self).__module__}.{type(self).__qualname__}", "base": base,
                "mlp_tiles": self.mlp_tiles, "tile_tokens": self.tile_tokens}


def with_tiled_mlp(spec: Any, mlp_tiles: Any, tile_tokens: int = DEFAULT_MLP_TILE_TOKENS) -> Any:
    """``spec`` with every dense MLP tiled (``mlp_tiles`` off: ``spec`` itself); idempotent on a TiledMLPLayerSpec."""
    if isinstance(spec, TiledMLPLayerSpec):
        spec = spec.base
    return spec if mlp_tiles == "off" else TiledMLPLayerSpec(spec, mlp_tiles, tile_tokens)


def untiled_mlp_problem(model: Any, mlp_tiles: Any) -> Optional[str]:
    """After the build: None when every dense MLP of ``model`` (a module or a list of chunks) is tiled, else why."""
    if mlp_tiles == "off":
        return None
    roots = list(model) if isinstance(model, (list, tuple)) else [model]
    mlps = [m for r in roots for m in r.modules() if isinstance(m, MLP)]
    if mlps and all(isinstance(m, TiledMegatronMLP) for m in mlps):
        return None
    return (f"tiling.mlp_tiles={mlp_tiles!r}: the model's MLPs were not built tiled "
            f"({sorted({type(m).__name__ for m in mlps})}); was the layer spec replaced after the options were set?")
