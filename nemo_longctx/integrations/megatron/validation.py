"""The checks that need the model config, done once when a run is built (before the first step).

``model_problems(config, options, world_size, tp, pp, keys)`` every one of them for a ``LongContextOptions``: the
attention (``long_context_problems``), recompute/offload (``memory_options.memory_model_problems``) and tiling
against the model's sequence length. The option checks that need no model ran before (``options.problems``).
Messages name ``model.*`` (fields of the GPT/Llama config), ``cp.*`` and the front end's own keys for the
parallel layout (``options.Context.keys``; Megatron's field names by default).

``model_state_cpu_problems(opts, ...)``: the model-state options a CPU-only build cannot run (the CPU stand-ins of
``cpu_compat`` do not cover them), refused before step 0 by both front ends and the planner's app checks."""

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
                        f"{k.key('cp.algorithm')}={cp_algorithm!r}: its attention function takes no sinks")
    if algo.validate is not None:
        try:
            algo.validate(config, cp_size, tp=tp, keys=k, **dict(cp_kwargs or {}))
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
    p += mla_tensor_parallel_problems(config, tp, k)
    if options.tiling.active:  # against the model's own sequence length (init_from: the checkpoint's config)
        p += options.tiling.problems(int(config.seq_length), cp.size, tp, bool(getattr(config, "sequence_parallel",
                                                                                        False)), k)
    return p


def mla_tensor_parallel_problems(config: Any, tp: int, keys: Optional[Context] = None) -> List[str]:
    """Multi-latent attention under TP > 1 where Megatron-core's gradient is wrong (found by ``nemo-longctx fuzz``,
    megatron-core 0.15.3 and 0.19.2, ``MLASelfAttention.get_query_key_value_tensors``): the RoPE part of the key
    (``k_pos_emb``, shared by all heads) is split off ``linear_kv_down_proj``'s output and used by each TP rank's own
    heads, and nothing sums its gradient over the TP group -- except ``gather_from_sequence_parallel_region`` on the
    path of a duplicated (TransformerEngine) down projection with sequence parallelism. Without TransformerEngine the
    down projection is a ``ColumnParallelLinear`` (that path, with or without sequence parallelism, keeps the partial
    gradient): the RoPE rows of ``linear_kv_down_proj`` learn from half the heads at TP=2."""
    if not getattr(config, "multi_latent_attention", False) or not isinstance(tp, int) or tp <= 1:
        return []
    k = keys or Context()
    from .cpu_compat import needed

    if needed():
        return [f"multi-latent attention with {k.key('tp')}={tp} without CUDA/TransformerEngine: Megatron-core's local "
                "MLA gives the RoPE part of linear_kv_down_proj only this TP rank's heads' gradient (a silently wrong "
                f"gradient): use {k.key('tp')}=1 (CP, DP and PP are exact)"]
    if not getattr(config, "sequence_parallel", False):
        return [f"multi-latent attention with {k.key('tp')}={tp} needs sequence parallelism: without it Megatron-core "
                "sums the gradient of the RoPE key part over no TP group (only this rank's heads' share); set "
                "sequence parallelism on"]
    return []


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


# model-state options that cannot run without CUDA (the CPU stand-ins of cpu_compat cannot carry them)
def model_state_cpu_problems(opts: Any, force: bool = False, checkpointing: bool = False,
                             checkpoint_key: str = "checkpoint interval", saving: Optional[str] = None,
                             no_saving: Optional[str] = None) -> list:
    """Problems (each naming its ``optim.*`` field) of model-state options that cannot run on a CPU-only build;
    empty when CUDA is available (unless ``force``). ``opts``: ``model_state.ModelStateOptions``; ``checkpointing``:
    the run saves checkpoints, by default said as "``checkpoint_key`` > 0" (the front end's name for its interval)
    and undone by "``checkpoint_key``=0"; ``saving`` / ``no_saving`` say both otherwise."""
    from .cpu_compat import needed

    if not (force or needed()):
        return []
    out = []
    if checkpointing and getattr(opts, "use_distributed_optimizer", False) is True and not getattr(
            opts, "megatron_fsdp", False):
        # without TE/Apex (HAVE_APEX_OR_TE False) the distributed optimizer steps torch AdamW, which keeps a scalar
        # per-parameter ``step``: dp_reshardable saving asserts on it ((torch.Size([]), 0, n)); the fully_reshardable
        # format saves it, but resuming asserts in DistributedOptimizer.state_dict (one ``step`` over the still
        # empty state, a branch taken before its HybridDeviceOptimizer case)
        out.append(f"optim.use_distributed_optimizer=true with {saving or checkpoint_key + ' > 0'}: without "
                   "TransformerEngine/Apex Megatron's distributed optimizer runs torch AdamW, whose per-parameter "
                   "'step' state its checkpoint formats do not handle (saving or resuming fails) (CPU only; set "
                   f"{no_saving or checkpoint_key + '=0'})")
    if getattr(opts, "use_precision_aware_optimizer", False) is True and not getattr(opts, "optimizer_cpu_offload",
                                                                                   False):
        # TE's FusedAdam (master_weight_dtype / exp_avg_dtype / use_decoupled_grad) is a CUDA kernel
        out.append("optim.use_precision_aware_optimizer=true runs TransformerEngine's FusedAdam, a CUDA kernel: "
                   "not available on CPU (CPU only; on GPUs it is allowed with TransformerEngine installed)")
    # Megatron-FSDP (optim.megatron_fsdp) runs on CPU over gloo with cpu_compat_fsdp's device/mesh fixes
    return out


def moe_cpu_problems(config: Any, force: bool = False) -> list:
    """Problems (each naming its ``model.*`` field) of a MoE model config that Megatron-core's local (non-TE) layers,
    the only ones without CUDA, cannot train; empty when CUDA is available (unless ``force``) or without experts.

    - Expert biases (``add_bias_linear``: GPT-OSS) at expert-parallel and expert-tensor-parallel size 1: the local
      experts (``SequentialMLP``) add the bias in place (``mlp.py``: ``output += output_bias * per_token_scale``) to
      the output of ``linear_fc2``, which at those sizes is what ``_ReduceFromModelParallelRegion`` returned
      unchanged -- autograd refuses the in-place change ("a view ... is being modified inplace"). With either size
      above 1 the expert linear skips that function (``explicit_expert_comm``).
    - The ``alltoall`` token dispatcher at expert-parallel size > 1: its split sizes become host lists only when they
      were CUDA tensors (``moe_utils.maybe_move_tensor_to_cpu``); CPU tensors reach ``all_to_all_single``, which
      rejects them. The ``allgather`` dispatcher exchanges no split sizes.
    - The ``flex`` dispatcher: DeepEP / HybridEP kernels (CUDA)."""
    from .cpu_compat import needed

    if not (force or needed()) or not getattr(config, "num_moe_experts", None):
        return []
    out = []
    ep = int(getattr(config, "expert_model_parallel_size", 1) or 1)
    etp = getattr(config, "expert_tensor_parallel_size", None)
    etp = int(config.tensor_model_parallel_size or 1) if etp is None else int(etp)
    if getattr(config, "add_bias_linear", False) and ep == 1 and etp == 1:
        out.append(f"model.add_bias_linear=true with MoE experts (model.num_moe_experts={config.num_moe_experts}) at "
                   "model.expert_model_parallel_size=1 and model.expert_tensor_parallel_size=1: Megatron-core's "
                   "local experts (SequentialMLP, the experts without TransformerEngine) add the expert bias in "
                   "place on a tensor autograd does not let them change (CPU only; set "
                   "model.expert_model_parallel_size or model.expert_tensor_parallel_size > 1)")
    dispatcher = getattr(config, "moe_token_dispatcher_type", None)
    if dispatcher == "alltoall" and ep > 1:
        out.append(f"model.moe_token_dispatcher_type='alltoall' with model.expert_model_parallel_size={ep}: its "
                   "split sizes stay torch tensors on the CPU, which gloo's all_to_all_single does not take (CPU "
                   "only; set model.moe_token_dispatcher_type=allgather)")
    if dispatcher == "flex":
        out.append("model.moe_token_dispatcher_type='flex' runs DeepEP/HybridEP CUDA kernels: not available on CPU "
                   "(set model.moe_token_dispatcher_type=allgather or alltoall)")
    return out
