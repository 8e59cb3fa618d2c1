"""Recompute and activation-offload options for Megatron GPT models (the ``recompute`` / ``offload`` config groups).

``MemoryOptions`` holds both groups. ``memory_option_problems(opts, cp_algorithm, model_config=None)`` lists every
invalid setting with the config field named as the Hydra app spells it (``recompute.modules``, ``offload=...``);
without a model config only the config-level checks run (cheap: used before processes are spawned).
``apply_recompute_fields(model_config, opts)`` writes Megatron's own fields (``recompute_granularity``,
``recompute_method``, ``recompute_num_layers``, ``recompute_modules``); it must run before the model is built.
``attach_memory_options(model, opts)`` wires a built model (see ``MemoryRuntime``):

recompute
  none            nothing recomputed
  selective       Megatron's selective recompute of ``modules`` (core_attn | mlp | layernorm); layernorm runs
                  nemo_longctx's norm recompute (``norm_recompute.py``: works under the tracker's and offload's
                  saved-tensor hooks) instead of Megatron's CheckpointWithoutOutput
  full            Megatron's full-layer recompute (``method`` uniform | block, ``num_layers``)
  full_keep_attn  full recompute whose core attention keeps (out, lse) from the forward: the recompute in backward
                  does not run attention forward again (with ring CP: one ring pass less per layer and step).
                  One ``KeptAttentionCache`` per model; ring attention only (cp.algorithm=ring, or cp=none).
offload
  none            nothing offloaded
  layer_input     under full / full_keep_attn recompute: each checkpointed layer's input goes to host memory after
                  its forward and comes back (prefetched ``prefetch_depth`` layers ahead) in backward
  modules         the tensors saved by the named submodules of every layer (above ``min_bytes``) go to host
                  memory; not with full recompute (nothing is saved inside a fully recomputed layer)

Decoder blocks of fully recomputed models become ``LongContextTransformerBlock`` (an instance-level class change
to a TransformerBlock subclass; Megatron itself is not patched).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Dict, List, Optional, Tuple

RECOMPUTE_MODES = ("none", "selective", "full", "full_keep_attn")
RECOMPUTE_METHODS = ("uniform", "block")
# recompute_modules of megatron-core 0.15.3 that apply to dense GPT layers (moe, moe_act, shared_experts and
# mla_up_proj need MoE / MLA layers, which nemo_longctx's core attention does not support)
SELECTIVE_MODULES = ("core_attn", "mlp", "layernorm")
OFFLOAD_MODES = ("none", "layer_input", "modules")
# offload.modules names -> submodule path inside a Megatron TransformerLayer
OFFLOAD_MODULE_PATHS = {
    "self_attention": "self_attention",
    "core_attn": "self_attention.core_attention",
    "linear_qkv": "self_attention.linear_qkv",
    "linear_proj": "self_attention.linear_proj",
    "mlp": "mlp",
    "linear_fc1": "mlp.linear_fc1",
    "linear_fc2": "mlp.linear_fc2",
    "input_layernorm": "input_layernorm",
    "pre_mlp_layernorm": "pre_mlp_layernorm",
}
# offloading these modules saves nothing when the selective recompute module re-runs them
_RECOMPUTED_BY = {
    "core_attn": {"core_attn"},
    "mlp": {"mlp", "linear_fc1", "linear_fc2"},
    "layernorm": {"input_layernorm", "pre_mlp_layernorm"},
}
KEEP_ATTN_ALGORITHMS = ("ring",)
# fields each option of the two config groups may set (besides `name`)
_GROUP_FIELDS = {
    "recompute": {"selective": ("modules",), "full": ("method", "num_layers"),
                  "full_keep_attn": ("method", "num_layers")},
    "offload": {"layer_input": ("prefetch_depth", "min_bytes"), "modules": ("modules", "prefetch_depth", "min_bytes")},
}


@dataclass(frozen=True)
class MemoryOptions:
    recompute: str = "none"
    recompute_modules: Tuple[str, ...] = ("core_attn",)
    recompute_method: str = "uniform"
    recompute_num_layers: int = 1
    offload: str = "none"
    offload_modules: Tuple[str, ...] = ()
    prefetch_depth: int = 1
    min_bytes: int = 2**20

    @property
    def full(self) -> bool:
        return self.recompute in ("full", "full_keep_attn")

    @property
    def trivial(self) -> bool:
        return self.recompute == "none" and self.offload == "none"

    def describe(self) -> str:
        r = self.recompute
        if r == "selective":
            r += f"[{','.join(self.recompute_modules)}]"
        elif self.full:
            r += f"({self.recompute_method},{self.recompute_num_layers})"
        o = self.offload + (f"[{','.join(self.offload_modules)}]" if self.offload == "modules" else "")
        return f"recompute={r} offload={o}"


def memory_options(recompute: Optional[Dict[str, Any]] = None,
                   offload: Optional[Dict[str, Any]] = None) -> MemoryOptions:
    """MemoryOptions from the two config groups as plain dicts (``name`` + the group's fields); None = none."""
    r, o = dict(recompute or {}), dict(offload or {})
    r.pop("callbacks", None), r.pop("model_overrides", None), o.pop("callbacks", None), o.pop("model_overrides", None)
    kw: Dict[str, Any] = {"recompute": str(r.pop("name", "none")), "offload": str(o.pop("name", "none"))}
    for src, group, names in ((r, "recompute", {"modules": "recompute_modules", "method": "recompute_method",
                                                "num_layers": "recompute_num_layers"}),
                              (o, "offload", {"modules": "offload_modules", "prefetch_depth": "prefetch_depth",
                                              "min_bytes": "min_bytes"})):
        allowed = _GROUP_FIELDS[group].get(kw[group], ())
        unknown = sorted(f for f in src if f not in allowed)
        if unknown:
            raise ValueError(f"{group}: unknown field(s) {unknown} for {group}={kw[group]} "
                             f"(its fields: {list(allowed) or 'none'})")
        for f, v in src.items():
            kw[names[f]] = tuple(v) if f == "modules" and isinstance(v, (list, tuple)) else v
    return MemoryOptions(**kw)


def _cuda_available() -> bool:
    import torch

    return torch.cuda.is_available()


def memory_option_problems(opts: MemoryOptions, cp_algorithm: str = "ring", model_config: Any = None,
                           pp: int = 1) -> List[str]:
    """Every problem with ``opts`` (empty list = valid); model-dependent checks only with ``model_config``."""
    p: List[str] = []
    r, o = opts.recompute, opts.offload
    if r not in RECOMPUTE_MODES:
        p.append(f"recompute={r!r} is not known (choose one of {', '.join(RECOMPUTE_MODES)})")
    if o not in OFFLOAD_MODES:
        p.append(f"offload={o!r} is not known (choose one of {', '.join(OFFLOAD_MODES)})")
    if r == "selective":
        mods = opts.recompute_modules
        if isinstance(mods, str) or not isinstance(mods, (list, tuple)) or not mods:
            p.append(f"recompute.modules={mods!r} must be a non-empty list of {list(SELECTIVE_MODULES)}")
        else:
            bad = [m for m in mods if m not in SELECTIVE_MODULES]
            if bad:
                p.append(f"recompute.modules: unknown module(s) {bad} (megatron-core supports "
                         f"{list(SELECTIVE_MODULES)} for dense GPT layers)")
    if opts.full:
        if opts.recompute_method not in RECOMPUTE_METHODS:
            p.append(f"recompute.method={opts.recompute_method!r} must be one of {list(RECOMPUTE_METHODS)}")
        n = opts.recompute_num_layers
        if not isinstance(n, int) or isinstance(n, bool) or n < 1:
            p.append(f"recompute.num_layers={n!r} must be an int >= 1")
    if r == "full_keep_attn" and cp_algorithm not in KEEP_ATTN_ALGORITHMS:
        p.append(f"recompute=full_keep_attn keeps ring attention's output and LSE: it needs cp.algorithm=ring (cp=ring "
                 f"or cp=none), got cp.algorithm={cp_algorithm!r}")
    if o == "layer_input" and not opts.full:
        p.append(f"offload=layer_input requires recompute=full or full_keep_attn (got recompute={r})")
    if o == "modules":
        mods = opts.offload_modules
        if isinstance(mods, str) or not isinstance(mods, (list, tuple)) or not mods:
            p.append(f"offload.modules={mods!r} must be a non-empty list of {sorted(OFFLOAD_MODULE_PATHS)}")
        else:
            bad = [m for m in mods if m not in OFFLOAD_MODULE_PATHS]
            if bad:
                p.append(f"offload.modules: unknown module(s) {bad} (choose from {sorted(OFFLOAD_MODULE_PATHS)})")
            if opts.full:
                p.append(f"offload=modules cannot be combined with recompute={r}: a fully recomputed layer saves "
                         "nothing inside its modules; use offload=layer_input")
            if r == "selective":
                for rm in opts.recompute_modules or ():
                    clash = sorted(_RECOMPUTED_BY.get(rm, set()) & set(mods))
                    if clash:
                        p.append(f"offload.modules {clash} are recomputed by recompute.modules [{rm}] (they save "
                                 "nothing to offload): drop them from one of the two lists")
    if o in ("layer_input", "modules"):
        d = opts.prefetch_depth
        if not isinstance(d, int) or isinstance(d, bool) or d < 0:
            p.append(f"offload.prefetch_depth={d!r} must be an int >= 0")
        b = opts.min_bytes
        if not isinstance(b, int) or isinstance(b, bool) or b < 0:
            p.append(f"offload.min_bytes={b!r} must be an int >= 0")
    if model_config is None:
        return p
    layers = int(model_config.num_layers) // max(1, pp)
    if opts.full and isinstance(opts.recompute_num_layers, int) and opts.recompute_num_layers > layers:
        p.append(f"recompute.num_layers={opts.recompute_num_layers} exceeds the {layers} layers per pipeline stage "
                 "(model.num_layers / trainer.strategy.pipeline_model_parallel_size)")
    if (r == "selective" and "mlp" in (opts.recompute_modules or ()) and getattr(model_config, "add_bias_linear", False)
            and not _cuda_available()):
        p.append("recompute.modules=[mlp] with model.add_bias_linear=true recurses without end in Megatron's "
                 "CheckpointFunction backward on CPU: set model.add_bias_linear=false or recompute another module")
    if opts.full and (getattr(model_config, "fp8", None) or getattr(model_config, "fp4", None)):
        p.append(f"recompute={r} in nemo_longctx runs Megatron's tensor_parallel.checkpoint: fp8/fp4 "
                 "(te_checkpoint) is not supported")
    if getattr(model_config, "cpu_offloading", False) and o != "none":
        p.append(f"offload={o} cannot be combined with model.cpu_offloading=true (Megatron's own TE offload)")
    return p


def validate_memory_options(opts: MemoryOptions, cp_algorithm: str = "ring", model_config: Any = None,
                            pp: int = 1) -> None:
    problems = memory_option_problems(opts, cp_algorithm, model_config, pp)
    if problems:
        raise ValueError("invalid recompute/offload configuration:\n  - " + "\n  - ".join(problems))


def recompute_fields(opts: MemoryOptions) -> Dict[str, Any]:
    """Megatron TransformerConfig fields for ``opts.recompute``."""
    if opts.recompute == "selective":
        return {"recompute_granularity": "selective", "recompute_method": None, "recompute_num_layers": None,
                "recompute_modules": list(opts.recompute_modules)}
    if opts.full:
        return {"recompute_granularity": "full", "recompute_method": opts.recompute_method,
                "recompute_num_layers": int(opts.recompute_num_layers)}
    return {"recompute_granularity": None, "recompute_method": None, "recompute_num_layers": None}


def apply_recompute_fields(model_config: Any, opts: MemoryOptions) -> Any:
    """Set Megatron's recompute fields on ``model_config`` (before the model is built); returns it."""
    for k, v in recompute_fields(opts).items():
        setattr(model_config, k, v)
    return model_config


# ---------------------------------------------------------------------------------------------- attach
@dataclass
class MemoryRuntime:
    """What ``attach_memory_options`` installed on a model."""

    options: MemoryOptions
    offloader: Any = None  # memory.offload.ActivationOffloader (offload != none)
    kept_cache: Any = None  # memory.keep_attention.KeptAttentionCache (full_keep_attn)
    blocks: List[Any] = field(default_factory=list)
    _handles: List[Any] = field(default_factory=list)
    _classes: List[Tuple[Any, type]] = field(default_factory=list)

    def after_step(self, where: str = "") -> None:
        """Call after each step's backward: nothing kept or offloaded may be left over."""
        if self.kept_cache is not None:
            self.kept_cache.check_empty(where)
        if self.offloader is not None:
            live = self.offloader.live_groups()
            if live:
                raise RuntimeError(f"activation offload{' ' + where if where else ''}: {len(live)} offloaded groups "
                                   f"were never brought back by a backward: {live[:4]}")

    def detach(self) -> None:
        for h in self._handles:
            h.remove()
        self._handles = []
        for obj, cls in self._classes:
            obj.__class__ = cls
        self._classes = []
        from .core_attention import LongContextCoreAttention

        for b in self.blocks:
            for m in b.modules():
                if isinstance(m, LongContextCoreAttention):
                    m.kept_attention_cache = None
            b.longctx_offloader = None


def transformer_blocks(model: Any) -> List[Any]:
    """Every Megatron TransformerBlock in ``model`` (a module, or a list of modules / pipeline chunks)."""
    from megatron.core.transformer.transformer_block import TransformerBlock

    roots = list(model) if isinstance(model, (list, tuple)) else [model]
    seen, out = set(), []
    for root in roots:
        for m in root.modules():
            if isinstance(m, TransformerBlock) and id(m) not in seen:
                seen.add(id(m))
                out.append(m)
    return out


def attach_memory_options(model: Any, opts: MemoryOptions, *, record_events: bool = False) -> MemoryRuntime:
    """Wire ``opts`` into a built model (after ``apply_recompute_fields`` on its config, before the first step).

    Always: every layer's forward is a tracker ``memory_scope(f"layer{layer_number}")`` (per-layer attribution).
    full / full_keep_attn: the decoder blocks run ``LongContextTransformerBlock._checkpointed_forward``.
    full_keep_attn: every ``LongContextCoreAttention`` gets the model's ``KeptAttentionCache``.
    layer_input / modules: one ``ActivationOffloader`` for the model.
    """
    from nemo_longctx.memory.keep_attention import KeptAttentionCache
    from nemo_longctx.memory.offload import ActivationOffloader
    from nemo_longctx.memory.tracker import scope_modules

    from .core_attention import LongContextCoreAttention
    from .norm_recompute_layer import install_norm_recompute
    from .offload_block import LongContextTransformerBlock

    validate_memory_options(opts)
    blocks = transformer_blocks(model)
    if not blocks:
        raise ValueError("attach_memory_options: the model has no Megatron TransformerBlock")
    rt = MemoryRuntime(options=opts, blocks=blocks)
    for b in blocks:
        cfg = b.config
        if opts.full and cfg.recompute_granularity != "full":
            raise ValueError(f"recompute={opts.recompute} but the model was built with "
                             f"recompute_granularity={cfg.recompute_granularity!r}: apply_recompute_fields first")
        if opts.recompute == "selective" and cfg.recompute_granularity != "selective":
            raise ValueError("recompute=selective but the model was built without selective recompute: "
                             "apply_recompute_fields first")
    if opts.offload != "none":
        rt.offloader = ActivationOffloader(prefetch_depth=int(opts.prefetch_depth), min_bytes=int(opts.min_bytes),
                                           record_events=record_events)
    if opts.recompute == "full_keep_attn":
        rt.kept_cache = KeptAttentionCache()
    for b in blocks:
        if opts.full:
            if not isinstance(b, LongContextTransformerBlock):
                rt._classes.append((b, type(b)))
                b.__class__ = LongContextTransformerBlock
            b.longctx_offloader = rt.offloader if opts.offload == "layer_input" else None
        else:
            rt._handles.append(scope_modules({f"layer{layer.layer_number}": layer for layer in b.layers}))
        if opts.recompute == "selective" and "layernorm" in (opts.recompute_modules or ()):
            for layer in b.layers:
                rt._handles.append(install_norm_recompute(layer))
        for m in b.modules():
            if isinstance(m, LongContextCoreAttention):
                if rt.kept_cache is not None and m.algorithm.name not in KEEP_ATTN_ALGORITHMS:
                    raise ValueError(f"recompute=full_keep_attn needs cp.algorithm=ring, the model's core attention "
                                     f"runs {m.algorithm.name!r}")
                m.kept_attention_cache = rt.kept_cache
        if rt.kept_cache is not None and not any(isinstance(m, LongContextCoreAttention) for m in b.modules()):
            raise ValueError("recompute=full_keep_attn needs nemo_longctx core attention in the layers "
                             "(LongContextCoreAttention)")
        if opts.offload == "modules":
            targets = {}
            for layer in b.layers:
                for name in opts.offload_modules:
                    path = OFFLOAD_MODULE_PATHS[name]
                    try:
                        sub = layer.get_submodule(path)
                    except AttributeError:
                        sub = None
                    if sub is None or type(sub).__name__ == "IdentityOp":
                        raise ValueError(f"offload.modules: {name!r} ({path}) does not exist in layer "
                                         f"{layer.layer_number} ({type(sub).__name__ if sub is not None else 'missing'}"
                                         "; e.g. TransformerEngine specs fuse the layernorms into the linears)")
                    targets[f"layer{layer.layer_number}.{name}"] = sub
            rt._handles.append(rt.offloader.offload_modules(targets))
    return rt
