"""Drop-in Megatron-core ``core_attention`` module running nemo_longctx context-parallel attention.

Built by Megatron's ``Attention`` from the layer spec as
``LongContextCoreAttention(config, layer_number, attn_mask_type, attention_type, attention_dropout=None,
softmax_scale=None, cp_comm_type=None, pg_collection=None, cp_algorithm="ring", cp_algorithm_kwargs=None,
k_channels=None, v_channels=None)`` and called as ``forward(query [sq, b, hq, dk], key [sk, b, hkv, dk], value
[sk, b, hkv, dv], attention_mask, attn_mask_type=None, attention_bias=None, packed_seq_params=None) ->
[sq, b, hq*dv]`` (heads are per tensor-parallel partition, GQA heads not expanded, RoPE applied, the sequence
zigzag-sharded over the CP group). ``k_channels``/``v_channels`` are the query/key and value head dims that
Megatron's MLA (``MultiLatentAttention``: q_head_dim = qk_head_dim + qk_pos_emb_head_dim, v_head_dim) passes;
both default to ``config.kv_channels``. K and V then travel between CP ranks at their own sizes. Layout conversion to
the attention layer's ``[b, s, h, d]`` is a transpose view (no copy when b == 1).

Packed documents (THD): Megatron's ``PackedSeqParams`` (qkv_format 'thd'; ``cu_seqlens_q`` = cumulative real
document lengths, ``cu_seqlens_q_padded`` = the layout, every document padded to a multiple of 2*cp and
zigzag-sharded per document, as ``batch.shard_packed_batch_for_cp`` lays it out and Megatron's RoPE slices it) go to
the algorithm's THD path: attention only within each document, padding never a key. Document-aware placement
(``cp.split_min_tokens``: ``batch.DocumentPackedSeqParams`` carrying this rank's ``documents``) runs the split
documents through the algorithm and the documents kept on this rank locally (``attention.documents``).
Sliding windows: the layer's window comes from ``config.window_size`` / ``window_attn_skip_freq`` exactly as Megatron's
DotProductAttention decides it (``is_layer_window_attention``) and is passed as ``window_size=(left, right)``; with THD
the window applies within each document.

Attention sinks (GPT-OSS): ``config.softmax_type`` "off-by-one" or "learnable" (Megatron-core's field) exactly as
Megatron's ``DotProductAttention`` (0.19) holds them: ``softmax_offset``, [attention heads per TP partition] in
``config.params_dtype`` on ``torch.cuda.current_device()`` (the CPU without CUDA) -- for "learnable" a parameter,
initialised with ``config.init_method`` when ``config.perform_initialization`` (the only random numbers this module
draws, where Megatron's module draws them), in the sharded state dict under ``<prefix>softmax_offset`` sharded over
TP on dim 0 (the key and layout of Megatron's and TransformerEngine's attention); for "off-by-one" a plain tensor of
zeros (no state). They go to the algorithm as ``sinks`` / ``softmax_type`` (``attention.sinks``: the extra
denominator term, once per row, under every CP algorithm, dense, packed and windowed); each CP rank's sink gradient
is its rows' share, summed over the CP group by the data-parallel gradient reduction (DDP reduces over DP x CP). The
paths that do not run through those functions refuse sinks by name (``recompute=full_keep_attn``,
``recompute.sequence_chunks``, a registered CP algorithm without ``takes_sinks``). A config without the field
(Megatron-core 0.14) is vanilla softmax, as before.

The algorithm is looked up by name in ``cp_algorithms.CP_ALGORITHMS`` (ring, ulysses, hybrid); its
``setup`` (hybrid: the Ulysses/ring sub-groups) runs once here at construction. At CP size 1 the same
algorithm runs with ``group=None`` (local attention). Unsupported combinations raise ValueError at build time
(or, for per-call inputs such as packed sequences, at the first call) instead of computing something else.
"""

from __future__ import annotations

import math
from typing import Any, Dict, Optional, Tuple

import torch
from megatron.core.transformer.enums import AttnMaskType
from megatron.core.transformer.module import MegatronModule
from megatron.core.transformer.transformer_config import TransformerConfig

from nemo_longctx.attention.kernels import select_kernel
from nemo_longctx.attention.sinks import SOFTMAX_TYPES  # Megatron-core's names (TransformerConfig.softmax_type)
from nemo_longctx.memory.keep_attention import kept_ring_attention
from nemo_longctx.memory.sequence_chunks import active_sequence_chunking, chunk_core_attention
from nemo_longctx.options import SEQUENCE_CHUNK_ALGORITHMS

from .cp_algorithms import check_cp_options, get_cp_algorithm, is_checked, mark_checked
from .mcore_versions import is_layer_window_attention, process_groups, sharded_tensors_for_checkpoint

Tensor = torch.Tensor

SUPPORTED_MASK_TYPES = (AttnMaskType.causal, AttnMaskType.no_mask)


def _window_of(window_size: Any) -> Tuple[int, int]:
    try:
        left, right = (int(x) for x in window_size)
    except (TypeError, ValueError):
        raise ValueError(f"model.window_size={window_size!r} must be a pair (left, right) of ints (-1 = unbounded)"
                         ) from None
    return left, right


def packed_seq_layout(packed_seq_params: Any) -> Tuple[Tensor, Tensor]:
    """(cu_seqlens, cu_seqlens_padded) of Megatron's ``PackedSeqParams`` for self-attention in the THD format:
    ``cu_seqlens_q`` = cumulative real document lengths, ``cu_seqlens_q_padded`` (or ``cu_seqlens_q`` when absent) =
    the layout (each document padded to a multiple of 2*cp, per-document zigzag; Megatron's RoPE slices by it)."""
    fmt = getattr(packed_seq_params, "qkv_format", None)
    if fmt != "thd":
        raise ValueError(f"packed_seq_params.qkv_format={fmt!r}: nemo_longctx core attention takes packed sequences "
                         "in the 'thd' format only")
    cu_q, cu_kv = packed_seq_params.cu_seqlens_q, packed_seq_params.cu_seqlens_kv
    pad_q = packed_seq_params.cu_seqlens_q_padded
    pad_kv = packed_seq_params.cu_seqlens_kv_padded
    if cu_q is None:
        raise ValueError("packed_seq_params.cu_seqlens_q is required (cumulative document lengths, int32)")
    same = lambda a, b: a is b or (a is not None and b is not None and torch.equal(a, b))  # noqa: E731
    if not same(cu_q, cu_kv if cu_kv is not None else cu_q) or not same(pad_q, pad_kv):
        raise ValueError("packed_seq_params: cu_seqlens_q/kv (and their _padded forms) must be equal: "
                         "nemo_longctx core attention is self-attention")
    return cu_q, cu_q if pad_q is None else pad_q


def _process_group(pg_collection: Any, name: str, global_group: str):
    """``pg_collection.<name>`` if given, else Megatron's global group ``parallel_state.<global_group>()`` (None when
    model parallelism is not initialised)."""
    group = getattr(pg_collection, name, None) if pg_collection is not None else None
    if group is not None:
        return group
    from megatron.core import parallel_state

    if parallel_state.model_parallel_is_initialized():
        return getattr(parallel_state, global_group)()
    return None


def _cp_group(pg_collection: Any):
    """The context-parallel process group (``pg_collection.cp`` or Megatron's global CP group)."""
    return _process_group(pg_collection, "cp", "get_context_parallel_group")


def _tp_group(pg_collection: Any):
    """The tensor-parallel process group (``pg_collection.tp`` or Megatron's global TP group)."""
    return _process_group(pg_collection, "tp", "get_tensor_model_parallel_group")


class LongContextCoreAttention(MegatronModule):
    """Exact causal (or unmasked) attention for Megatron layers via a nemo_longctx CP algorithm."""

    def __init__(
        self,
        config: TransformerConfig,
        layer_number: int,
        attn_mask_type: AttnMaskType,
        attention_type: str,
        attention_dropout: Optional[float] = None,
        softmax_scale: Optional[float] = None,
        cp_comm_type: Optional[str] = None,
        pg_collection: Any = None,
        cp_algorithm: str = "ring",
        cp_algorithm_kwargs: Optional[Dict[str, Any]] = None,
        k_channels: Optional[int] = None,
        v_channels: Optional[int] = None,
        model_comm_pgs: Any = None,  # Megatron-core 0.14's name of pg_collection (mcore_versions.process_groups)
        **params: Any,
    ) -> None:
        super().__init__(config=config)
        pg_collection = process_groups(pg_collection, model_comm_pgs)
        if params:
            raise ValueError(f"LongContextCoreAttention got unknown ModuleSpec params {sorted(params)}")
        self.layer_number = max(1, layer_number)
        self.attention_type = attention_type
        self.algorithm = get_cp_algorithm(cp_algorithm)
        self.algorithm_kwargs = dict(cp_algorithm_kwargs or {})

        if attention_type != "self":
            raise ValueError(
                f"nemo_longctx core attention supports self-attention only, got attention_type={attention_type!r}"
            )
        self.attn_mask_type = self._check_mask_type(attn_mask_type)
        dropout = config.attention_dropout if attention_dropout is None else attention_dropout
        if dropout and dropout > 0:
            raise ValueError(
                f"model.attention_dropout={dropout}: attention dropout is not implemented in nemo_longctx core "
                "attention; set it to 0"
            )
        # Sliding window per layer exactly as Megatron's DotProductAttention decides it (window_attn_skip_freq:
        # every n-th layer full, or a per-layer list); (left, right) in flash-attn's convention, as Megatron's
        self.window_size = None
        if is_layer_window_attention(config, layer_number):
            self.window_size = _window_of(config.window_size)
        self.softmax_type = getattr(config, "softmax_type", "vanilla")  # absent before Megatron-core 0.15
        if self.softmax_type not in SOFTMAX_TYPES:
            raise ValueError(f"model.softmax_type={self.softmax_type!r} must be one of {SOFTMAX_TYPES}")
        if self.softmax_type != "vanilla" and not self.algorithm.takes_sinks:
            raise ValueError(f"model.softmax_type={self.softmax_type!r} (attention sinks) is not supported by "
                             f"cp.algorithm={self.algorithm.name!r}: its attention function takes no sinks")
        if isinstance(cp_comm_type, list):
            raise ValueError("model.cp_comm_type as a per-layer list is not supported; use one string or null")
        if cp_comm_type not in self.algorithm.cp_comm_types:
            raise ValueError(
                f"model.cp_comm_type={cp_comm_type!r} does not match cp.algorithm={self.algorithm.name!r} "
                f"(accepts {sorted(map(str, self.algorithm.cp_comm_types))})"
            )

        self.cp_group = _cp_group(pg_collection)
        cp_size = self.cp_group.size() if self.cp_group is not None else 1
        if cp_size != config.context_parallel_size:
            raise ValueError(
                f"model.context_parallel_size={config.context_parallel_size} but the CP process group has "
                f"{cp_size} ranks"
            )
        if not is_checked(config, cp_size, self.algorithm.name, self.algorithm_kwargs):
            # built outside a checked run (Python API: a spec used directly): the same checks, once per config
            check_cp_options(self.algorithm.name, cp_size, self.algorithm_kwargs)
            if self.algorithm.validate is not None:
                self.algorithm.validate(config, cp_size, tp=config.tensor_model_parallel_size, **self.algorithm_kwargs)
            mark_checked(config, cp_size, self.algorithm.name, self.algorithm_kwargs)
        if self.algorithm.setup is not None:  # once per module, every CP rank in the same layer order
            self.algorithm_kwargs = self.algorithm.setup(self.cp_group if cp_size > 1 else None,
                                                         **self.algorithm_kwargs)
        self.cp_size = cp_size
        self.last_key_tokens: Optional[int] = None  # set by each forward (run_guards)
        # recompute=full_keep_attn (memory_options.attach_memory_options): the model's KeptAttentionCache; the ring
        # then keeps (out, lse) from the no-grad forward for the recompute in backward (memory/keep_attention.py)
        self.kept_attention_cache = None

        # Head dims: MLA passes k_channels (query/key) and v_channels (value); otherwise both are kv_channels.
        for name, val in (("k_channels", k_channels), ("v_channels", v_channels)):
            if val is not None and (isinstance(val, bool) or not isinstance(val, int) or val < 1):
                raise ValueError(f"LongContextCoreAttention: {name}={val!r} must be a positive int")
        self.k_channels = config.kv_channels if k_channels is None else k_channels
        self.v_channels = config.kv_channels if v_channels is None else v_channels
        # Same value as Megatron's DotProductAttention (and TE's with k_channels): 1/sqrt(query/key head dim)
        # unless given (MLA gives its mscale-corrected one). apply_query_key_layer_scaling divides by layer_number
        # and multiplies back in the softmax: the math is unchanged, so it is ignored here.
        head_dim = self.k_channels
        self.softmax_scale = 1.0 / math.sqrt(head_dim) if softmax_scale is None else float(softmax_scale)
        self._tp_group = _tp_group(pg_collection)
        self._init_softmax_offset(config)

    def _init_softmax_offset(self, config: TransformerConfig) -> None:
        """``softmax_offset`` as Megatron-core 0.19's ``DotProductAttention.__init__`` makes it (same name, shape,
        dtype, device, initialisation and random-number use), so a model built with this module from a seed has
        Megatron's weights and checkpoints of either load into the other."""
        if self.softmax_type == "vanilla":
            self.softmax_offset = None
            return
        tp = self._tp_group.size() if self._tp_group is not None else int(config.tensor_model_parallel_size or 1)
        if config.num_attention_heads % tp:
            raise ValueError(f"model.num_attention_heads={config.num_attention_heads} must be divisible by the "
                             f"tensor-parallel size {tp}")
        heads = config.num_attention_heads // tp
        device = torch.cuda.current_device() if torch.cuda.is_available() else torch.device("cpu")
        if self.softmax_type == "off-by-one":
            self.softmax_offset = torch.zeros(heads, device=device, dtype=config.params_dtype)
            return
        self.register_parameter("softmax_offset", torch.nn.Parameter(
            torch.empty(heads, device=device, dtype=config.params_dtype)))
        if config.perform_initialization:
            self.softmax_offset = config.init_method(self.softmax_offset)

    def sharded_state_dict(self, prefix: str = "", sharded_offsets: Tuple = (), metadata: Optional[dict] = None):
        """With learnable sinks: Megatron's ``DotProductAttention.sharded_state_dict`` (``<prefix>softmax_offset``,
        TP-sharded on dim 0, replicated over DP x CP). Otherwise Megatron's default (this module holds no state)."""
        if self.softmax_type != "learnable":
            return super().sharded_state_dict(prefix, sharded_offsets, metadata)
        tp_group = self._tp_group
        if tp_group is None:
            from megatron.core import parallel_state

            tp_group = parallel_state.get_tensor_model_parallel_group()
        return sharded_tensors_for_checkpoint(self.state_dict(prefix="", keep_vars=True), prefix,
                                              {"softmax_offset": 0}, sharded_offsets, tp_group, metadata)

    def _sink_kwargs(self) -> Dict[str, Any]:
        """The attention function's sink arguments: none for vanilla softmax (the call stays as it was)."""
        if self.softmax_type == "vanilla":
            return {}
        return {"sinks": self.softmax_offset if self.softmax_type == "learnable" else None,
                "softmax_type": self.softmax_type}

    def _refuse_sinks(self, option: str) -> None:
        if self.softmax_type != "vanilla":
            raise ValueError(f"{option} does not take attention sinks (model.softmax_type={self.softmax_type!r}): "
                             "its attention path has no sink term; use another recompute option "
                             "(recompute=full or selective without sequence_chunks)")

    def _check_mask_type(self, attn_mask_type: Any) -> AttnMaskType:
        if isinstance(attn_mask_type, torch.Tensor):  # Megatron's checkpointed path passes it as a tensor
            attn_mask_type = AttnMaskType(int(attn_mask_type.item()))
        if attn_mask_type not in SUPPORTED_MASK_TYPES:
            raise ValueError(
                f"attn_mask_type={attn_mask_type} is not supported by nemo_longctx core attention "
                f"(supported: causal, no_mask; padding/arbitrary masks are not: packed documents go through "
                "packed_seq_params)"
            )
        return attn_mask_type

    def sequence_chunk_groups(self) -> Tuple[Any, Any]:
        """(ring group, Ulysses group) a sequence-chunked layer (``recompute.sequence_chunks``) runs this attention's
        CP with: ring (the CP group, None), Ulysses (None, the CP group), hybrid (its ring and Ulysses groups);
        (None, None) without CP."""
        if self.cp_size == 1:
            return None, None
        name = self.algorithm.name
        if name not in SEQUENCE_CHUNK_ALGORITHMS:
            raise ValueError(f"recompute.sequence_chunks does not run under cp.algorithm={name} (CP size "
                             f"{self.cp_size}): choose one of {', '.join(SEQUENCE_CHUNK_ALGORITHMS)}")
        if name == "ring":
            return self.cp_group, None
        if name == "ulysses":
            return None, self.cp_group
        return self.algorithm_kwargs["ring_group"], self.algorithm_kwargs["ulysses_group"]

    def _document_attention(self, q: Tensor, k: Tensor, v: Tensor, documents: Any, causal: bool) -> Tensor:
        """Document-aware packed documents (``attention.documents``): the split documents through this layer's CP
        algorithm, the kept ones with the local kernel on this rank (all heads, no communication)."""
        from nemo_longctx.attention.documents import document_attention

        window = {"window_size": self.window_size} if self.window_size is not None else {}
        sinks = self._sink_kwargs()
        group = self.cp_group if self.cp_size > 1 else None

        def split(q_, k_, v_, **thd):
            return self.algorithm.attention(q_, k_, v_, group=group, causal=causal, softmax_scale=self.softmax_scale,
                                            **thd, **window, **sinks, **self.algorithm_kwargs)

        return document_attention(q, k, v, documents, split, causal=causal, softmax_scale=self.softmax_scale,
                                  kernel=self.algorithm_kwargs.get("kernel"), window_size=self.window_size,
                                  sinks=sinks.get("sinks"), softmax_type=sinks.get("softmax_type"),
                                  fn="nemo_longctx core attention")

    def forward(
        self,
        query: Tensor,
        key: Tensor,
        value: Tensor,
        attention_mask: Optional[Tensor],
        attn_mask_type: Optional[AttnMaskType] = None,
        attention_bias: Optional[Tensor] = None,
        packed_seq_params: Any = None,
    ) -> Tensor:
        """query [sq, b, hq, dk], key [sk, b, hkv, dk], value [sk, b, hkv, dv] -> [sq, b, hq*dv].

        Packed sequences (``packed_seq_params``, qkv_format 'thd'): Megatron passes query [t, hq, dk], key/value
        [t, hkv, d] (the batch dim squeezed; t = this rank's tokens, per-document zigzag); returns [t, hq*dv]."""
        if attention_bias is not None:
            raise ValueError("attention_bias is not supported by nemo_longctx core attention")
        mask_type = self.attn_mask_type if attn_mask_type is None else self._check_mask_type(attn_mask_type)
        if attention_mask is not None:
            raise ValueError(
                "nemo_longctx core attention got an explicit attention_mask: only the implicit causal (or no) mask "
                "is supported; packed documents go through packed_seq_params (THD: data.packing=documents or NeMo's "
                "packed fine-tuning data), with attention_mask=None"
            )
        thd = {}
        documents = getattr(packed_seq_params, "documents", None)  # document-aware placement (batch.py)
        if packed_seq_params is not None:
            if documents is None:
                cu, cu_padded = packed_seq_layout(packed_seq_params)
                thd = {"cu_seqlens": cu, "cu_seqlens_padded": cu_padded}
            if query.dim() == 3:  # [t, h, d] -> [t, 1, h, d] (views)
                query, key, value = query.unsqueeze(1), key.unsqueeze(1), value.unsqueeze(1)
            if query.shape[1] != 1:
                raise ValueError(f"packed sequences need micro batch size 1, got query "
                                 f"{tuple(query.shape)}")
        sq, b, hq, _ = query.shape
        if (query.shape[-1], key.shape[-1], value.shape[-1]) != (self.k_channels, self.k_channels, self.v_channels):
            raise ValueError(
                f"nemo_longctx core attention: head dims q={query.shape[-1]}, k={key.shape[-1]}, v={value.shape[-1]} "
                f"do not match k_channels={self.k_channels}, v_channels={self.v_channels}"
            )
        dv = value.shape[-1]
        q = query.transpose(0, 1)  # [b, s, h, d] view
        # K/V travel between ranks (gloo/NCCL need contiguous buffers): a no-op view when b == 1 and Megatron's
        # key/value are contiguous, one copy otherwise
        k, v = key.transpose(0, 1).contiguous(), value.transpose(0, 1).contiguous()
        if self.window_size is not None:
            thd["window_size"] = self.window_size
        # this rank's key tokens per call (run_guards: x cp_size, the sequence the attention covers); a
        # sequence-chunked call sees one chunk, so it records nothing
        self.last_key_tokens = None if active_sequence_chunking() is not None else int(k.shape[1])
        if documents is not None:
            if active_sequence_chunking() is not None or self.kept_attention_cache is not None:
                raise ValueError("cp.split_min_tokens (document-aware packed documents) runs neither with "
                                 "recompute.sequence_chunks nor with recompute=full_keep_attn; drop one of them")
            out = self._document_attention(q, k, v, documents, mask_type == AttnMaskType.causal)
            return out.transpose(0, 1).reshape(sq, b, hq * dv).squeeze(1)
        if active_sequence_chunking() is not None:  # recompute.sequence_chunks: this layer runs chunk by chunk
            self._refuse_sinks("recompute.sequence_chunks")
            if packed_seq_params is not None:
                raise ValueError("sequence-chunked layer: packed_seq_params reached the core attention (the chunked "
                                 "layer's block hands the documents to the chunk state and runs the layer without "
                                 "them: is this layer inside nemo_longctx's transformer block?)")
            ring_group, ulysses_group = self.sequence_chunk_groups()
            kernel = select_kernel(q.device, q.dtype, self.algorithm_kwargs.get("kernel"), head_dim=q.shape[-1],
                                   value_dim=dv)
            out = chunk_core_attention(q, k, v, causal=mask_type == AttnMaskType.causal, scale=self.softmax_scale,
                                       kernel=kernel, window_size=self.window_size, group=ring_group,
                                       ulysses_group=ulysses_group)
            return out.transpose(0, 1).reshape(sq, b, hq * dv)
        if self.kept_attention_cache is not None:
            self._refuse_sinks("recompute=full_keep_attn")
            if thd:
                raise ValueError("recompute=full_keep_attn supports neither packed sequences nor sliding windows "
                                 f"(model.window_size={self.config.window_size}); use recompute=full or selective")
            out = kept_ring_attention(
                q, k, v, self.cp_group if self.cp_size > 1 else None, mask_type == AttnMaskType.causal,
                self.softmax_scale, cache=self.kept_attention_cache, key=self.layer_number, training=self.training,
                **self.algorithm_kwargs,
            )
            return out.transpose(0, 1).reshape(sq, b, hq * dv)
        out = self.algorithm.attention(
            q, k, v,
            group=self.cp_group if self.cp_size > 1 else None,
            causal=mask_type == AttnMaskType.causal,
            softmax_scale=self.softmax_scale,
            **thd,
            **self._sink_kwargs(),
            **self.algorithm_kwargs,
        )
        out = out.transpose(0, 1).reshape(sq, b, hq * dv)
        return out.squeeze(1) if packed_seq_params is not None else out
