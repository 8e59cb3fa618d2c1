"""Chunked output layer + cross entropy for Megatron's GPTModel: with labels, the full ``[s, b, vocab]`` logits
are never materialized.

``ChunkedLossGPTModel`` is a ``megatron.core.models.gpt.GPTModel`` subclass whose ``_postprocess`` (the output
layer + loss part of ``GPTModel.forward``), when labels are given, returns
``chunked_output_cross_entropy(hidden [s, b, h], output weight [v/tp, h], labels [b, s], chunks, ...)`` instead
of ``compute_language_model_loss(labels, output_layer(hidden))``: the same per-token loss ``[b, s]`` (fp32) that
NeMo's ``MaskedTokenLossReduction`` multiplies by the loss mask and sums. Without labels (logits wanted),
with multi-token prediction, in inference, or with ``loss_chunks="off"`` it runs Megatron's own path.

The model is built as this class from the start: by code that builds Megatron models itself (``ChunkedLossGPTModel(
config, spec, ...)``, the same arguments as ``GPTModel``), and by the two front ends, whose GPT configs / providers
build the class named ``MCoreGPTModel`` in their model module and offer no hook for another one: that name is bound to
this class by the NeMo 2 and Megatron-Bridge patch ledgers (row M1 of each), applied at the app's entry. Until a policy
is set it is Megatron's GPTModel exactly (``loss_chunks="off"``). ``use_chunked_loss(model, chunks, chunk_tokens)``
sets the policy on every last-stage instance inside ``model`` (any wrapper: NeMo's lightning module, DDP,
Float16Module).

Details:
- weight: ``output_layer.weight``, or the word embedding when ``share_embeddings_and_output_weights``; this TP
  rank's vocab rows start at ``tp_rank * v_local`` (Megatron's even vocab split); statistics are all-reduced
  over the output layer's TP group per chunk, and the hidden gradient all-reduced in backward (what
  ColumnParallelLinear's input copy does). Under sequence parallelism the hidden states go through Megatron's
  ``gather_from_sequence_parallel_region`` (backward: reduce-scatter) and the chunked loss does not all-reduce.
- loss mask: the batch's ``loss_mask`` (GPTModel.forward's ``loss_mask`` argument, or the one set with
  ``loss_mask_scope`` by the NeMo forward step) is passed as the 0/1 mask ``loss_mask != 0``: the per-token
  loss is unchanged on counted tokens and 0 on masked ones (which the reduction zeroes anyway), and the chunked
  loss can build its gradients during forward (its fast path needs to know which tokens carry a loss).
- labels were shifted by the data pipeline before CP sharding (NeMo's GPT datasets), so each CP rank's local
  labels are right at its chunk edges.
"""

from __future__ import annotations

from contextlib import contextmanager
from typing import Any, List, Optional

import torch
from megatron.core.models.gpt import GPTModel
from megatron.core.tensor_parallel import gather_from_sequence_parallel_region

from nemo_longctx.memory.tiling import DEFAULT_LOSS_CHUNK_TOKENS, check_tiling_policy, chunked_output_cross_entropy

_LOSS_MASKS: List[Optional[torch.Tensor]] = []


@contextmanager
def loss_mask_scope(loss_mask: Optional[torch.Tensor]):
    """Make ``loss_mask [b, s]`` (this rank's shard) visible to ``ChunkedLossGPTModel`` during one model call;
    NeMo's GPTModel.forward does not forward a loss_mask argument to the Megatron model."""
    _LOSS_MASKS.append(loss_mask)
    try:
        yield
    finally:
        _LOSS_MASKS.pop()


def _scoped_loss_mask() -> Optional[torch.Tensor]:
    return _LOSS_MASKS[-1] if _LOSS_MASKS else None


class ChunkedLossGPTModel(GPTModel):
    """GPTModel whose loss (with labels) comes from the chunked output layer + cross entropy (see module doc)."""

    loss_chunks: Any = "off"  # Megatron's own output layer + loss until use_chunked_loss sets a policy
    loss_chunk_tokens: int = DEFAULT_LOSS_CHUNK_TOKENS

    def _chunked_applies(self, labels, inference_context, mtp_in_postprocess) -> bool:
        in_inference = inference_context is not None and not self.training
        return (
            self.post_process
            and labels is not None
            and self.loss_chunks != "off"
            and not self.mtp_process
            and not mtp_in_postprocess
            and not in_inference
        )

    def output_weight(self) -> torch.Tensor:
        if self.share_embeddings_and_output_weights:
            return self.shared_embedding_or_output_weight()
        return self.output_layer.weight

    def _postprocess(self, hidden_states, *args: Any, **kwargs: Any):
        labels = kwargs.get("labels")
        if args or not self._chunked_applies(labels, kwargs.get("inference_context"),
                                             kwargs.get("mtp_in_postprocess")):
            return super()._postprocess(hidden_states, *args, **kwargs)
        loss_mask = kwargs.get("loss_mask")
        if loss_mask is None:
            loss_mask = _scoped_loss_mask()
        if loss_mask is not None and tuple(loss_mask.shape) != tuple(labels.shape):
            raise ValueError(
                f"tiling.loss_chunks: loss_mask shape {tuple(loss_mask.shape)} does not match labels "
                f"{tuple(labels.shape)}"
            )
        counted = None if loss_mask is None else (loss_mask != 0).to(torch.float32)
        weight = self.output_weight()
        layer = self.output_layer
        tp_group = getattr(layer, "tp_group", None)
        if tp_group is None:
            tp_group = self.pg_collection.tp
        reduce_grad_hidden = True
        if getattr(layer, "sequence_parallel", False) and tp_group.size() > 1:
            hidden_states = gather_from_sequence_parallel_region(
                hidden_states, tensor_parallel_output_grad=True, group=tp_group
            )
            reduce_grad_hidden = False
        if hidden_states.dtype != weight.dtype:
            hidden_states = hidden_states.to(weight.dtype)
        tp_size, tp_rank = tp_group.size(), tp_group.rank()
        return chunked_output_cross_entropy(
            hidden_states,
            weight,
            labels,
            self.loss_chunks,
            loss_mask=counted,
            tp_group=tp_group if tp_size > 1 else None,
            vocab_start_index=tp_rank * weight.shape[0],
            reduce_grad_hidden=reduce_grad_hidden,
            chunk_tokens=self.loss_chunk_tokens,
        )


def use_chunked_loss(model: Any, chunks: Any = "auto", chunk_tokens: int = DEFAULT_LOSS_CHUNK_TOKENS) -> int:
    """Set this policy on every last-stage ``ChunkedLossGPTModel`` inside ``model`` (built as one: see the module
    docstring); returns how many were set (0 on pipeline stages without the output layer)."""
    check_tiling_policy(chunks, "tiling.loss_chunks")
    if isinstance(chunk_tokens, bool) or not isinstance(chunk_tokens, int) or chunk_tokens <= 0:
        raise ValueError(f"tiling.loss_chunk_tokens must be a positive int, got {chunk_tokens!r}")
    count = 0
    for m in model.modules():
        if not isinstance(m, GPTModel) or not m.post_process:
            continue
        if type(m) is GPTModel:
            raise ValueError(
                f"tiling.loss_chunks={chunks!r}: the model was built as Megatron's GPTModel, not ChunkedLossGPTModel: "
                "build it as ChunkedLossGPTModel (the front ends do once their patch ledger is applied at the app's "
                "entry)"
            )
        if type(m) is not ChunkedLossGPTModel:
            raise ValueError(
                f"tiling.loss_chunks={chunks!r}: the model is a {type(m).__name__} (a GPTModel subclass); only "
                "Megatron's GPTModel is supported: set tiling.loss_chunks=off"
            )
        if m.mtp_process:
            raise ValueError(f"tiling.loss_chunks={chunks!r}: multi-token prediction (mtp_num_layers) is not supported")
        if getattr(m.config, "defer_embedding_wgrad_compute", False):
            raise ValueError(
                f"tiling.loss_chunks={chunks!r} cannot be combined with model.defer_embedding_wgrad_compute=true"
            )
        m.loss_chunks = chunks
        m.loss_chunk_tokens = int(chunk_tokens)
        count += 1
    return count
