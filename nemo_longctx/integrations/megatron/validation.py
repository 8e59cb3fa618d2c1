"""The checks that need the model config, done once when a run is built (before the first step).

``model_problems(config, options, world_size, tp, pp, keys)`` every one of them for a ``LongContextOptions``: the
attention (``long_context_problems``), recompute/offload (``memory_options.memory_model_problems``) and tiling
against the model's sequence length. The option checks that need no model ran before (``options.problems``).
Messages name ``model.*`` (fields of the GPT/Llama config), ``cp.*`` and the front end's own keys for the
parallel layout (``options.Context.keys``; Megatron's field names by default)."""

from __future__ import annotations

from typing import Any, Dict, List, Optional

from nemo_longctx.attention.sinks import SOFTMAX_TYPES  # Megatron-core's names (TransformerConfig.softmax_type)
from nemo_longctx.options import Context, LongContextOptions, layout_problems

from .cp_algorithms import get_cp_algorithm, mark_checked


def long_context_problems(
    config: Any,
    cp_size: int,
    cp_algorithm: str,
    world_size: Optional[int] = None,
    tp: int = 1,
    pp: int = 1,
    cp_kwargs: Optional[Dict[str, Any]] = None,
    keys: Optional[Context] = None,
) -> List[str]:
    """All problems found (empty list = valid). ``config`` is a Megatron TransformerConfig / NeMo GPTConfig;
    ``cp_kwargs`` the algorithm's options (``CPOptions.attention_kwargs``: e.g. ulysses_size, head_chunks);
    ``keys``: the front end's key names (``Context``)."""
    k = keys or Context()
    problems = []
    algo = get_cp_algorithm(cp_algorithm)
    problems += layout_problems(getattr(config, "seq_length", None), cp_size, tp, pp, world_size,
                                bool(getattr(config, "sequence_parallel", False)), k)
    heads, groups = config.num_attention_heads, config.num_query_groups or config.num_attention_heads
    if heads % groups != 0:
        problems.append(f"model.num_attention_heads={heads} must be a multiple of model.num_query_groups={groups}")
    if heads % tp != 0 or groups % tp != 0:
        problems.append(
            f"model.num_attention_heads={heads} and model.num_query_groups={groups} must be divisible by "
            f"{k.key('tp')}={tp}"
        )
    if getattr(config, "attention_dropout", 0.0):
        problems.append(
            f"model.attention_dropout={config.attention_dropout}: attention dropout is not implemented in nemo_longctx "
            "core attention; set it to 0"
        )
    window = getattr(config, "window_size", None)
    if window:
        try:
            left, right = (int(x) for x in window)
            if left < -1 or right < -1:
                raise ValueError
        except (TypeError, ValueError):
            problems.append(f"model.window_size={window!r} must be a pair (left, right) of ints >= -1 (-1 = unbounded)")
    cap = getattr(config, "attn_logit_softcapping", None)
    if cap:
        problems.append(
            f"model.attn_logit_softcapping={cap}: attention logit soft-capping (Gemma 2: tanh on the scores before "
            "the softmax) is in none of nemo_longctx's attention kernels; it cannot be trained with this core "
            "attention (set it to null to train without soft-capping, which changes the model)"
        )
    if getattr(config, "interleaved_attn_pattern", None):
        problems.append(
            f"model.interleaved_attn_pattern={config.interleaved_attn_pattern}: Gemma 3's local/global layers (each "
            "with its own RoPE base, chosen by its own core attention) are not supported by nemo_longctx core "
            "attention; per-layer windows are supported through model.window_size + model.window_attn_skip_freq"
        )
    backend = getattr(config, "attention_backend", None)
    if backend is not None and getattr(backend, "name", str(backend)) == "local":
        problems.append(
            "model.attention_backend=local makes NeMo replace every layer's core_attention with Megatron's own "
            "(DotProductAttention, no CP): use auto"
        )
    softmax = getattr(config, "softmax_type", "vanilla")  # absent before Megatron-core 0.15
    if softmax not in SOFTMAX_TYPES:
        problems.append(f"model.softmax_type={softmax!r} must be one of {SOFTMAX_TYPES}")
    elif softmax != "vanilla" and not algo.takes_sinks:
        problems.append(f"model.softmax_type={softmax!r} (attention sinks) is not supported by "
                        f"cp.algorithm={cp_algorithm!r}: its attention function takes no sinks")
    if algo.validate is not None:
        try:
            algo.validate(config, cp_size, tp=tp, **dict(cp_kwargs or {}))
        except ValueError as e:
            problems.append(str(e))
    if not problems:
        mark_checked(config, cp_size, cp_algorithm, dict(cp_kwargs or {}))
    return problems


def model_problems(config: Any, options: LongContextOptions, world_size: Optional[int] = None, tp: int = 1,
                   pp: int = 1, keys: Optional[Context] = None) -> List[str]:
    """Every problem of ``options`` against the model config ``config`` (valid options assumed)."""
    from .memory_options import memory_model_problems

    k = keys or Context()
    cp = options.cp
    p = long_context_problems(config, cp.size, cp.algorithm, world_size, tp, pp, cp.attention_kwargs, k)
    p += memory_model_problems(options.memory, config, pp, k)
    if options.tiling.active:  # against the model's own sequence length (init_from: the checkpoint's config)
        p += options.tiling.problems(int(config.seq_length), cp.size, tp, bool(getattr(config, "sequence_parallel",
                                                                                        False)), k)
    return p


def built_attention_problems(model: Any, cp_size: int, cp_algorithm: str, pp: int = 1) -> List[str]:
    """Problems with the attention actually built into ``model`` (any module tree holding Megatron layers).

    The config checks above cannot see a layer spec replaced after them (a recipe's own spec, NeMo's
    ``attention_backend`` handling, a future NeMo change): a Megatron ``Attention`` whose ``core_attention`` is not
    ours would silently run without nemo_longctx context parallelism. Empty list = every layer runs our attention
    with the configured CP size and algorithm.
    """
    from megatron.core.transformer.attention import Attention

    from .core_attention import LongContextCoreAttention

    layers = [(name, m) for name, m in model.named_modules() if isinstance(m, Attention)]
    if not layers and pp == 1:
        return ["the built model has no Megatron attention layer, so nemo_longctx core attention is not in use"]
    problems = []
    for name, layer in layers:
        core = getattr(layer, "core_attention", None)
        if not isinstance(core, LongContextCoreAttention):
            problems.append(
                f"{name}.core_attention is {type(core).__name__}, not nemo_longctx's LongContextCoreAttention: this "
                "layer would run without our context parallelism (was the layer spec replaced after "
                "enable_long_context, or model.attention_backend set to local?)"
            )
        elif core.cp_size != cp_size or core.algorithm.name != cp_algorithm:
            problems.append(
                f"{name}.core_attention runs cp.algorithm={core.algorithm.name!r} over {core.cp_size} rank(s), but the "
                f"run is configured for cp.algorithm={cp_algorithm!r} with cp.size={cp_size}"
            )
    return problems
