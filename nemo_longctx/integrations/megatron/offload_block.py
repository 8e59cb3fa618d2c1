"""``LongContextTransformerBlock``: Megatron's TransformerBlock with its full-recompute loop re-written so that each
checkpoint *call* can run inside the activation offloader's scope (``offload=layer_input``) and inside a tracker
``memory_scope`` (per-layer attribution).

Megatron's ``TransformerBlock._checkpointed_forward`` has no hook around its ``tensor_parallel.checkpoint`` calls, so
the decoder block is built as this subclass (its model config marked by ``mark_decoder_block`` with the recompute
fields; GPTModel builds it through the Megatron-core patch ledger's row R2), whose own method runs the full recompute
(Megatron-core >= 0.19 calls a function instead of the method: row R1 routes our blocks to the method). Semantics
match Megatron's for ``recompute_method``:
  uniform  layers [0, n) in chunks of ``recompute_num_layers``, each chunk one checkpoint (the last chunk is clamped
           to the layers of this pipeline stage);
  block    the first ``recompute_num_layers`` layers checkpointed one by one, the others run normally.
With an offloader (``longctx_offloader``), the tensors the checkpoint saves for backward -- the chunk's input hidden
states (and the shared rotary embedding, when above ``min_bytes``) -- go to host memory; when layers are skipped
(block), the first non-recomputed layer's output carries a prefetch trigger so the last checkpointed input comes back
while the skipped layers run backward. Recompute in backward (reentrant) restores the CPU/CUDA RNG states, so
dropout masks are replayed exactly. fp8/fp4 (te_checkpoint) is refused.
"""

from __future__ import annotations

import contextlib
import functools
from typing import Any, List, Optional, Tuple

import torch
from megatron.core import tensor_parallel
from megatron.core.transformer.enums import AttnMaskType
from megatron.core.transformer.transformer_block import TransformerBlock

from nemo_longctx.attention.comm import group_size_and_rank
from nemo_longctx.memory.sequence_chunks import auto_sequence_chunks, sequence_chunked_checkpoint
from nemo_longctx.memory.tracker import memory_scope

from .chunked_layer import LongContextTransformerLayer
from .core_attention import packed_seq_layout
from .mcore_versions import thd_freqs_on_this_cp_rank, uses_fp8_or_fp4


def thd_rope_per_row(freqs, cu_seqlens_padded, cp_size: int, cp_rank: int):
    """The RoPE frequencies Megatron applies to each row of this rank's packed (THD) sequence, as a per-row tensor
    [s_local, 1, 1, d] that its ordinary (sbhd) RoPE path takes row by row -- so a chunk of the rows can run through
    the layer without packed-sequence parameters. Megatron's ``rope_utils._apply_rotary_pos_emb_thd`` picks them per
    document with ``_get_thd_freqs_on_this_cp_rank`` (each row's position in its document and CP zigzag chunk; the
    whole packed sequence's positions when ``freqs`` covers exactly ``cu_seqlens_padded[-1]`` rows); the same helper,
    with the same two cases, is used here (``mcore_versions.thd_freqs_on_this_cp_rank``)."""
    cu = [int(v) for v in (cu_seqlens_padded.tolist() if hasattr(cu_seqlens_padded, "tolist") else cu_seqlens_padded)]
    exact = freqs.dim() >= 1 and freqs.size(0) == cu[-1]
    parts = []
    for start, end in zip(cu, cu[1:]):
        rows = freqs.new_empty(((end - start) // cp_size, 0))  # (the helper reads only the row count)
        parts.append(thd_freqs_on_this_cp_rank(cp_rank, cp_size, rows, freqs, start if exact else 0))
    return torch.cat(parts)


_ROTARY_ROWS: List["_MLARotaryRows"] = []  # while a chunk of a multi-latent attention layer runs: its rotary rows


def chunk_rotary_pre_hook(module, args, kwargs):
    """Forward pre-hook on a multi-latent attention's rotary embedding module (``attach_memory_options`` installs
    it, with ``chunk_rotary_hook``, when layers run in sequence chunks). Megatron's MLA builds its RoPE table inside the
    layer for the length of the rows it is given (``get_rotary_seq_len``), which for a chunk would mean positions 0..
    of the chunk: while a chunk runs, the module is asked for the table the unchunked layer asks for instead, and
    ``chunk_rotary_hook`` cuts the chunk's rows out of it. Outside a chunk: unchanged."""
    if not _ROTARY_ROWS:
        return None
    length, packed = _ROTARY_ROWS[-1].request(module)
    return (length,), {**kwargs, "packed_seq": packed}


def chunk_rotary_hook(module, args, kwargs, output):
    return _ROTARY_ROWS[-1].rows(output) if _ROTARY_ROWS else output


class _MLARotaryRows:
    """Rows [a, b) of a chunked MLA layer's RoPE table: the unchunked layer's request (``local_rows`` x CP positions,
    sliced to this rank's zigzag rows by the module; packed documents: Megatron's THD length and, row by row, its
    THD positions, ``thd_rope_per_row``), cut to the chunk's rows."""

    def __init__(self, layer, local_rows: int, packed_seq_params, cp: Tuple[int, int], a: int, b: int) -> None:
        self.layer, self.local_rows, self.packed, self.cp = layer, local_rows, packed_seq_params, cp
        self.a, self.b = a, b

    def request(self, module) -> Tuple[int, bool]:
        if self.packed is None:
            return self.local_rows * self.cp[0], False
        return module.get_rotary_seq_len(None, None, None, self.layer.config, self.packed), True

    def rows(self, output):
        emb, rest = (output[0], tuple(output[1:])) if isinstance(output, tuple) else (output, ())
        if self.packed is not None:
            emb = thd_rope_per_row(emb, packed_seq_layout(self.packed)[1], *self.cp)
        return (emb[self.a:self.b], *rest) if isinstance(output, tuple) else emb[self.a:self.b]


@contextlib.contextmanager
def _rotary_rows(rows: Optional[_MLARotaryRows]):
    if rows is None:
        yield
        return
    _ROTARY_ROWS.append(rows)
    try:
        yield
    finally:
        _ROTARY_ROWS.pop()


def is_multi_latent_attention(attention) -> bool:
    return bool(getattr(getattr(attention, "config", None), "multi_latent_attention", False)) and hasattr(
        attention, "rotary_pos_emb")


class LongContextTransformerBlock(TransformerBlock):
    longctx_offloader: Any = None  # memory.offload.ActivationOffloader or None
    longctx_sequence_chunks: Any = None  # recompute.sequence_chunks: None (off), "auto" or an int

    def _checkpointed_forward(self, hidden_states, attention_mask, context, context_mask, rotary_pos_emb,
                              attention_bias=None, packed_seq_params=None, use_inner_quantization_context=False,
                              padding_mask=None, extract_layer_indices=None, **unused):
        cfg = self.config
        if uses_fp8_or_fp4(cfg):
            raise ValueError("nemo_longctx full recompute with offload/kept attention does not support fp8/fp4")
        if extract_layer_indices:
            raise ValueError("nemo_longctx full recompute does not return intermediate layers' hidden states "
                             f"(extract_layer_indices={sorted(extract_layer_indices)})")
        if isinstance(rotary_pos_emb, (tuple, list)):
            raise ValueError("nemo_longctx full recompute does not support dual (local/global) rotary embeddings")
        extra = {} if padding_mask is None else {"padding_mask": padding_mask}  # megatron-core >= 0.17 layers
        engine = self.longctx_offloader
        n_layers = self.num_layers_per_pipeline_rank
        k = int(cfg.recompute_num_layers)
        if cfg.recompute_method == "uniform":
            chunks = [(s, min(s + k, n_layers), True) for s in range(0, n_layers, k)]
        elif cfg.recompute_method == "block":
            chunks = [(i, i + 1, i < k) for i in range(n_layers)]
        else:
            raise ValueError(f"recompute_method={cfg.recompute_method!r} must be 'uniform' or 'block'")

        def run_layers(start: int, end: int):
            def forward(hidden_states, attention_mask, context, context_mask, rotary_pos_emb):
                for index in range(start, end):
                    hidden_states, context = self._get_layer(index)(
                        hidden_states=hidden_states, attention_mask=attention_mask, context=context,
                        context_mask=context_mask, rotary_pos_emb=rotary_pos_emb, attention_bias=attention_bias,
                        inference_context=None, packed_seq_params=packed_seq_params, **extra,
                    )
                return hidden_states, context

            return forward

        # packed documents under sequence chunks: Megatron's RoPE row by row, one table for every layer of this forward
        # (each layer's chunk closure is kept for its backward: a table per layer would be held once per layer)
        thd_rope = {}  # filled by the first chunked layer

        def run_one_layer_chunked(index, hidden_states, attention_mask, context, context_mask, rotary_pos_emb):
            layer = self._get_layer(index)
            if not isinstance(layer, LongContextTransformerLayer):
                raise ValueError(f"recompute.sequence_chunks: layer {layer.layer_number} is a {type(layer).__name__}, "
                                 "not built from a layer spec of nemo_longctx (LongContextTransformerLayer)")
            core = layer.self_attention.core_attention
            cp = group_size_and_rank(core.cp_group)
            documents, rope = None, rotary_pos_emb
            if packed_seq_params is not None:  # packed documents: the chunked attention keeps them apart; the
                documents = packed_seq_layout(packed_seq_params)  # layer runs without packed-sequence params, its
                if rope is not None:  # RoPE with each row's position in its document (Megatron's own)
                    if "rows" not in thd_rope:
                        thd_rope["rows"] = thd_rope_per_row(rope, documents[1], *cp)
                    rope = thd_rope["rows"]
            mla = is_multi_latent_attention(layer.self_attention)  # MLA makes its own RoPE table (chunk_rotary_hook)
            n = self.longctx_sequence_chunks
            n = auto_sequence_chunks(hidden_states.shape[0]) if n == "auto" else int(n)
            kv_first = getattr(core, "attn_mask_type", None) != AttnMaskType.causal
            ring_group, ulysses_group = core.sequence_chunk_groups()  # CP: the rank's zigzag shard

            def chunked(layer, kwargs):  # inside the layer's one call (chunked_layer.py): its hooks fire once
                hidden = kwargs.pop("hidden_states")  # (run_chunk is kept for backward: it must not hold the input,
                rows_total = hidden.shape[0]  # which the offload scope moves to the host)

                def run_chunk(x, a, b):
                    rows = _MLARotaryRows(layer, rows_total, packed_seq_params, cp, a, b) if mla else None
                    with _rotary_rows(rows):
                        out, _ = layer.layer_forward(**{
                            **kwargs, "hidden_states": x, "rotary_pos_emb": None if rope is None else rope[a:b],
                            "packed_seq_params": None if documents is not None else packed_seq_params})
                    return out

                params = [p for p in layer.parameters() if p.requires_grad]
                out = sequence_chunked_checkpoint(run_chunk, hidden, n, seq_dim=0, kv_first=kv_first, params=params,
                                                  group=ring_group, ulysses_group=ulysses_group, documents=documents)
                return out, kwargs.get("context")

            return layer(hidden_states=hidden_states, attention_mask=attention_mask, context=context,
                         context_mask=context_mask, rotary_pos_emb=rotary_pos_emb, attention_bias=attention_bias,
                         inference_context=None, packed_seq_params=packed_seq_params, longctx_chunking=chunked,
                         **extra)

        def run_layers_chunked(start: int, end: int):
            def forward(hidden_states, attention_mask, context, context_mask, rotary_pos_emb):
                for index in range(start, end):
                    hidden_states, context = run_one_layer_chunked(index, hidden_states, attention_mask, context,
                                                                   context_mask, rotary_pos_emb)
                return hidden_states, context

            return forward

        previous_recomputed = False
        for start, end, recompute in chunks:
            args = (hidden_states, attention_mask, context, context_mask, rotary_pos_emb)
            layer_number = self._get_layer(start).layer_number  # global: unique across pipeline/virtual stages
            with memory_scope(f"layer{layer_number}"):
                if not recompute:
                    hidden_states, context = run_layers(start, end)(*args)
                    if engine is not None and previous_recomputed:
                        engine.prefetch_trigger(hidden_states)
                elif self.longctx_sequence_chunks is not None:
                    # one layer: its own chunked checkpoint; k layers (uniform, recompute.num_layers=k): Megatron's
                    # checkpoint of the k chunked layers, so only its input is saved (offloaded); its recompute in
                    # backward keeps the k-1 inner layers' inputs, each layer differentiated chunk by chunk
                    fn = (functools.partial(run_one_layer_chunked, start) if end - start == 1 else
                          functools.partial(tensor_parallel.checkpoint, run_layers_chunked(start, end),
                                            cfg.distribute_saved_activations))
                    if engine is None:
                        hidden_states, context = fn(*args)
                    else:
                        hidden_states, context = engine.run_in_scope(layer_number, fn, *args)
                elif engine is None:
                    hidden_states, context = tensor_parallel.checkpoint(
                        run_layers(start, end), cfg.distribute_saved_activations, *args)
                else:
                    hidden_states, context = engine.run_in_scope(
                        layer_number, tensor_parallel.checkpoint, run_layers(start, end),
                        cfg.distribute_saved_activations, *args)
            previous_recomputed = recompute
        return hidden_states


def _dispatch_checkpointed_forward(original: Any) -> Any:
    def checkpointed_forward(block: Any, *args: Any, **kwargs: Any) -> Any:
        if isinstance(block, LongContextTransformerBlock):
            return block._checkpointed_forward(*args, **kwargs)
        return original(block, *args, **kwargs)

    checkpointed_forward._nemo_longctx_original = original
    return checkpointed_forward


def route_block_recompute() -> bool:
    """Megatron-core >= 0.19 runs a block's full recompute in ``megatron.core.recompute.checkpointed_forward``,
    which ``TransformerBlock.forward`` calls by the name it imported into ``transformer_block`` -- no longer through
    the ``_checkpointed_forward`` method this subclass overrides (<= 0.17). This rebinds that one name to a
    dispatcher that sends ``LongContextTransformerBlock`` instances to their method and every other block to
    Megatron's function unchanged: row R1 of the Megatron-core patch ledger (``patches.py``), applied at an app's
    entry on any device; nothing is rebound on versions without the function. Returns True when the dispatcher is
    in place."""
    from megatron.core.transformer import transformer_block

    current = getattr(transformer_block, "checkpointed_forward", None)
    if current is None:
        return False
    if not hasattr(current, "_nemo_longctx_original"):
        transformer_block.checkpointed_forward = _dispatch_checkpointed_forward(current)
    return True


BLOCK_MARK = "_nemo_longctx_block"  # on a model config: its GPT decoder is built as LongContextTransformerBlock


def mark_decoder_block(model_config: Any, full_recompute: bool) -> None:
    """Mark ``model_config`` (before the model is built) so that its GPT decoder block is built as
    ``LongContextTransformerBlock`` (``full_recompute``) or as Megatron's ``TransformerBlock``."""
    setattr(model_config, BLOCK_MARK, bool(full_recompute))


def decoder_block(config: Any = None, *args: Any, **kwargs: Any) -> Any:
    """What ``GPTModel.__init__`` calls to build its decoder (ledger row R2): ``LongContextTransformerBlock`` for a
    config marked by ``mark_decoder_block``, else Megatron's ``TransformerBlock`` -- with the same arguments."""
    cls = LongContextTransformerBlock if getattr(config, BLOCK_MARK, False) else TransformerBlock
    return cls(config, *args, **kwargs)


decoder_block._nemo_longctx = True  # type: ignore[attr-defined]


def build_decoder_blocks_by_config() -> bool:
    """Megatron's ``GPTModel.__init__`` builds its decoder with the name ``TransformerBlock`` of its module and offers
    no spec or argument for the block's class (a layer spec chooses only the layers). That name is bound to
    ``decoder_block``: a GPT model whose config is marked (``mark_decoder_block``, set with the recompute fields)
    gets the block subclass of this module from the start, every other model Megatron's block, built exactly as
    before. Row R2 of the Megatron-core patch ledger (``patches.py``), applied at an app's entry on any device."""
    from megatron.core.models.gpt import gpt_model

    if gpt_model.TransformerBlock is not TransformerBlock and not getattr(gpt_model.TransformerBlock, "_nemo_longctx",
                                                                          False):
        raise RuntimeError("megatron.core.models.gpt.gpt_model.TransformerBlock is not Megatron's TransformerBlock "
                           f"({gpt_model.TransformerBlock!r}): something else rebinds it")
    gpt_model.TransformerBlock = decoder_block
    return True


def decoder_blocks_built_by_config() -> bool:
    """Whether ledger row R2 is in place (GPT models build the block class their config is marked with)."""
    from megatron.core.models.gpt import gpt_model

    return gpt_model.TransformerBlock is decoder_block


def block_recompute_routed() -> bool:
    """Whether a ``LongContextTransformerBlock`` runs its own ``_checkpointed_forward`` under full recompute: always
    on Megatron-core versions that call the method, after ledger row R1 on those that call
    ``megatron.core.recompute.checkpointed_forward``."""
    from megatron.core.transformer import transformer_block

    current = getattr(transformer_block, "checkpointed_forward", None)
    return current is None or hasattr(current, "_nemo_longctx_original")
