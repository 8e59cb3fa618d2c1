"""Recompute and activation-offload options on a Megatron GPT model (the ``recompute`` / ``offload`` groups).

The options themselves (``MemoryOptions``: choices, keys, their config-level problems) are defined once in
``nemo_longctx.options``. This module maps them onto Megatron:
``memory_model_problems(opts, model_config, pp)``  the problems that need the model config (checked once, at build);
``apply_recompute_fields(model_config, opts)``      Megatron's own fields (``recompute_granularity``,
                                                    ``recompute_method``, ``recompute_num_layers``,
                                                    ``recompute_modules``); before the model is built;
``attach_memory_options(model, opts)``              wires a built model (see ``MemoryRuntime``).

Decoder blocks of fully recomputed models are built as ``LongContextTransformerBlock`` (a TransformerBlock subclass):
``apply_recompute_fields`` marks the model config, and GPTModel builds the block class the mark names (the Megatron-core
patch ledger's row R2).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Dict, List, Optional

from nemo_longctx.options import (  # noqa: F401  (re-exported: the names the Megatron mapping is written in)
    KEEP_ATTN_ALGORITHMS,
    OFFLOAD_MODULE_PATHS,
    Context,
    MemoryOptions,
    raise_problems,
)

from .mcore_versions import uses_fp8_or_fp4


def _cuda_available() -> bool:
    import torch

    return torch.cuda.is_available()


def memory_model_problems(opts: MemoryOptions, model_config: Any, pp: int = 1,
                          keys: Optional[Context] = None) -> List[str]:
    """The problems of ``opts`` that need the model config (valid options assumed: ``opts.problems()`` first), each
    naming its key in the dialect of ``keys`` (a ``Context``)."""
    ctx = keys or Context()
    kn = ctx.key
    p: List[str] = []
    r, o = opts.recompute, opts.offload
    layers = int(model_config.num_layers) // max(1, pp)
    if opts.full and opts.recompute_num_layers > layers:
        p.append(f"{kn('recompute.num_layers')}={opts.recompute_num_layers} exceeds the {layers} layers per pipeline "
                 f"stage ({ctx.key('num_layers')} / {ctx.key('pp')})")
    if (r == "selective" and "mlp" in opts.recompute_modules and getattr(model_config, "add_bias_linear", False)
            and not _cuda_available()):
        p.append(f"{kn('recompute.modules')}=[mlp] with model.add_bias_linear=true recurses without end in Megatron's "
                 "CheckpointFunction backward on CPU: set model.add_bias_linear=false or recompute another module")
    if opts.full and uses_fp8_or_fp4(model_config):
        p.append(f"recompute={r} in nemo_longctx runs Megatron's tensor_parallel.checkpoint: fp8/fp4 "
                 "(te_checkpoint) is not supported")
    softmax = getattr(model_config, "softmax_type", "vanilla")
    if softmax != "vanilla":  # these two paths compute attention without the sink term: refused, never dropped
        chunks = f"{kn('recompute.sequence_chunks')}={opts.sequence_chunks}"
        for option, on in (("recompute=full_keep_attn", r == "full_keep_attn"),
                           (chunks, opts.sequence_chunks != "off")):
            if on:
                p.append(f"{option} does not take attention sinks (model.softmax_type={softmax!r}): its attention "
                         "path has no sink term; use recompute=full (without sequence_chunks) or selective")
    if r == "full_keep_attn" and getattr(model_config, "window_size", None) is not None:
        # the kept-attention path (memory/keep_attention.py) has no window: refused before any rank builds a layer
        # (raised in the first forward, one rank's error left the others waiting in the ring)
        p.append(f"recompute=full_keep_attn does not take sliding windows (model.window_size="
                 f"{model_config.window_size}): use recompute=full or selective")
    if opts.sequence_chunks != "off":
        key = f"{kn('recompute.sequence_chunks')}={opts.sequence_chunks}"
        if getattr(model_config, "multi_latent_attention", False) and getattr(model_config, "apply_rope_fusion",
                                                                               False):
            p.append(f"{key} with multi-latent attention needs model.apply_rope_fusion=false: MLA's fused RoPE reads "
                     "its cos/sin tables for the chunk's own length (the unfused path gets the whole sequence's rows)")
        if getattr(model_config, "num_moe_experts", None):
            p.append(f"{key}: MoE layers (model.num_moe_experts={model_config.num_moe_experts}) route and balance "
                     "over the tokens of one call; chunking would change routing: not supported")
        if getattr(model_config, "hidden_dropout", 0) or 0:  # (attention dropout: refused for every run, validation)
            p.append(f"{key} does not replay random numbers per chunk: set model.hidden_dropout=0 (got "
                     f"{model_config.hidden_dropout})")
        if getattr(model_config, "distribute_saved_activations", False):
            p.append(f"{key} keeps each layer's input whole: model.distribute_saved_activations must be false")
    if getattr(model_config, "cpu_offloading", False) and o != "none":
        p.append(f"offload={o} cannot be combined with model.cpu_offloading=true (Megatron's own TE offload)")
    return p


def validate_memory_options(opts: MemoryOptions, cp_algorithm: str = "ring", model_config: Any = None,
                            pp: int = 1) -> None:
    """Raise ``ConfigError`` with every problem of ``opts`` (and, given a model config, those against it)."""
    problems = opts.problems(cp_algorithm)
    if not problems and model_config is not None:
        problems = memory_model_problems(opts, model_config, pp)
    raise_problems(problems)


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
    """Set Megatron's recompute fields on ``model_config`` (before the model is built), and mark it so that a full
    recompute builds the GPT decoder as ``LongContextTransformerBlock`` (``offload_block.mark_decoder_block``); returns
    it."""
    from .offload_block import mark_decoder_block

    for k, v in recompute_fields(opts).items():
        setattr(model_config, k, v)
    mark_decoder_block(model_config, opts.full)
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
        from .core_attention import LongContextCoreAttention

        for b in self.blocks:
            for m in b.modules():
                if isinstance(m, LongContextCoreAttention):
                    m.kept_attention_cache = None
            b.longctx_offloader = None
            b.longctx_sequence_chunks = None


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
    full / full_keep_attn: the decoder blocks, built as ``LongContextTransformerBlock`` (``apply_recompute_fields``
    marks the config), get the offloader / sequence chunks their ``_checkpointed_forward`` runs with.
    full_keep_attn: every ``LongContextCoreAttention`` gets the model's ``KeptAttentionCache``.
    layer_input / modules: one ``ActivationOffloader`` for the model.
    """
    from nemo_longctx.memory.keep_attention import KeptAttentionCache
    from nemo_longctx.memory.offload import ActivationOffloader
    from nemo_longctx.memory.tracker import scope_modules

    from .core_attention import LongContextCoreAttention
    from .norm_recompute_layer import install_norm_recompute
    from .offload_block import (LongContextTransformerBlock, block_recompute_routed, chunk_rotary_hook,
                                chunk_rotary_pre_hook, decoder_blocks_built_by_config, is_multi_latent_attention)

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
    if opts.full and not block_recompute_routed():
        raise RuntimeError(f"recompute={opts.recompute}: this Megatron-core runs a block's full recompute through "
                           "megatron.core.recompute.checkpointed_forward, and the Megatron-core patch ledger (row R1) "
                           "that routes our blocks to their own method was not applied: apply the ledger at the "
                           "app's entry (nemo_longctx.integrations.megatron.cpu_compat.apply())")
    for b in blocks:
        if opts.full:
            if not isinstance(b, LongContextTransformerBlock):
                how = ("its config was not marked before the build (apply_recompute_fields)"
                       if decoder_blocks_built_by_config() else
                       "the Megatron-core patch ledger (row R2) was not applied at the app's entry "
                       "(nemo_longctx.integrations.megatron.cpu_compat.apply())")
                raise ValueError(f"recompute={opts.recompute}: the decoder block was built as {type(b).__name__}, "
                                 f"not LongContextTransformerBlock: {how}")
            b.longctx_offloader = rt.offloader if opts.offload == "layer_input" else None
            b.longctx_sequence_chunks = None if opts.sequence_chunks == "off" else opts.sequence_chunks
            if opts.sequence_chunks != "off":  # MLA's rotary table, made inside the layer, gets the chunk's rows
                for layer in b.layers:
                    attention = getattr(layer, "self_attention", None)
                    if is_multi_latent_attention(attention):
                        rotary = attention.rotary_pos_emb
                        rt._handles += [rotary.register_forward_pre_hook(chunk_rotary_pre_hook, with_kwargs=True),
                                        rotary.register_forward_hook(chunk_rotary_hook, with_kwargs=True)]
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
                if rt.kept_cache is not None:
                    m._refuse_sinks("recompute=full_keep_attn")
                if opts.sequence_chunks != "off":
                    m._refuse_sinks(f"recompute.sequence_chunks={opts.sequence_chunks}")
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
