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
from typing import Any, List

from megatron.core import tensor_parallel
from megatron.core.transformer.mlp import MLP
from megatron.core.transformer.spec_utils import ModuleSpec

from nemo_longctx.integrations.megatron.spec import layer_specs_of
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


def tiled_mlp_layer_spec(spec: Any, tiles: Any = "auto", tile_tokens: int = DEFAULT_MLP_TILE_TOKENS) -> Any:
    """Copy of ``spec`` (layer ModuleSpec or block spec) whose every dense MLP is ``TiledMegatronMLP``."""
    check_tiling_policy(tiles, "tiling.mlp_tiles")
    new = copy.deepcopy(spec)
    for i, layer in enumerate(layer_specs_of(new)):
        sub = getattr(layer, "submodules", None)
        mlp = getattr(sub, "mlp", None)
        module = mlp.module if isinstance(mlp, ModuleSpec) else mlp
        if module not in (MLP, TiledMegatronMLP):
            raise ValueError(
                f"tiling.mlp_tiles={tiles!r}: layer spec {i} has MLP module {getattr(module, '__name__', module)!r}; "
                "only Megatron's dense MLP can be tiled (not MoE layers or custom MLPs): set tiling.mlp_tiles=off"
            )
        params = dict(mlp.params) if isinstance(mlp, ModuleSpec) else {}
        params.update(mlp_tiles=tiles, tile_tokens=int(tile_tokens))
        submodules = mlp.submodules if isinstance(mlp, ModuleSpec) else None
        sub.mlp = ModuleSpec(module=TiledMegatronMLP, params=params, submodules=submodules)
    return new


def mlp_modules(spec: Any) -> List[Any]:
    """The MLP module class of every layer in a layer or block spec (for checks and dry runs)."""
    out = []
    for layer in layer_specs_of(spec):
        mlp = layer.submodules.mlp
        out.append(mlp.module if isinstance(mlp, ModuleSpec) else mlp)
    return out
