"""NeMo data step and forward step for GPT models running nemo_longctx core attention.

``long_context_data_step(dataloader_iter)``: takes the next batch (dict of ``[b, S]`` tensors from the data module,
the full sequence), checks that it needs nothing but the causal mask, keeps the keys this pipeline stage needs,
moves them to the current device (CUDA if available, else CPU -- no ``.cuda()``), and zigzag-shards them over the
CP group (``shard_batch_for_cp``). Packed batches (``cu_seqlens``, NeMo's packed format -- ``GPTSFTPackedDataset``
or our ``data.packing=documents``) are laid out per document for the CP group and sharded per document
(``shard_packed_batch_for_cp``); the batch then carries Megatron's ``PackedSeqParams``. Otherwise the core
attention applies the causal mask itself, so a batch that carries an ``attention_mask`` (other than the plain
causal one) or per-document ``position_ids`` (reset at document boundaries) without ``cu_seqlens`` is refused with
a ValueError saying what to use instead -- never dropped silently.

``long_context_forward_step(model, batch)``: calls the GPT model with ``attention_mask=None`` (and the batch's
``packed_seq_params``, if any).
"""

from __future__ import annotations

from typing import Any, Dict

import torch

from nemo_longctx.integrations.megatron.batch import (
    PACKED_KEYS, TOKEN_KEYS, shard_batch_for_cp, shard_packed_batch_for_cp)


def current_device() -> torch.device:
    return torch.device("cuda", torch.cuda.current_device()) if torch.cuda.is_available() else torch.device("cpu")


PACKING_HINT = ("for packed documents with per-document attention use data.packing=documents (pretraining data: "
                "documents found from the reset position ids, attention within each document) or NeMo's packed "
                "fine-tuning data (data=packed_sft, PackedSequenceSpecs), which pass cu_seqlens")


def is_packed(batch: Dict[str, Any]) -> bool:
    return batch.get("cu_seqlens") is not None


def check_batch(batch: Dict[str, Any]) -> None:
    """Refuse what the core attention cannot honour. Packed batches (``cu_seqlens``, NeMo's format) are taken: the
    documents travel as ``PackedSeqParams`` (their ``attention_mask`` is NeMo's placeholder and is dropped). Otherwise
    the core attention attends causally over the whole (zigzag-sharded) sequence, so a document or padding
    ``attention_mask`` or per-document ``position_ids`` without ``cu_seqlens`` would be silently wrong: refused."""
    if is_packed(batch):
        if batch["cu_seqlens"].dim() == 2 and batch["cu_seqlens"].shape[0] != 1:
            raise ValueError("packed sequences (cu_seqlens in the batch) need trainer.micro_batch_size=1, got "
                             f"{batch['cu_seqlens'].shape[0]} packed rows")
        return
    mask = batch.get("attention_mask")
    if mask is not None:
        s = mask.shape[-1]
        # Megatron's convention: True = masked out. A causal-only mask is the upper triangle, the same for every row.
        causal = torch.triu(torch.ones(s, s, dtype=torch.bool, device=mask.device), diagonal=1)
        if mask.dtype != torch.bool or mask.shape[-2] != s or not bool((mask == causal).all()):
            raise ValueError(
                "the batch carries an attention_mask other than the causal one (document or padding masking) and no "
                "cu_seqlens: nemo_longctx core attention does not take explicit masks; set the data module's "
                "reset_attention_mask=False, or " + PACKING_HINT
            )
    pos = batch.get("position_ids")
    if pos is not None:
        expected = torch.arange(pos.shape[-1], dtype=pos.dtype, device=pos.device)
        if not bool((pos == expected).all()):
            raise ValueError(
                "the batch carries per-document position_ids (reset at document boundaries) but no cu_seqlens: the "
                "documents would attend to each other with these positions; set the data module's "
                "reset_position_ids=False, or " + PACKING_HINT
            )


def long_context_data_step(dataloader_iter) -> Dict[str, Any]:
    from megatron.core import parallel_state

    batch = next(dataloader_iter)
    if isinstance(batch, tuple) and len(batch) == 3:
        batch = batch[0]
    check_batch(batch)
    keys = set()
    if parallel_state.is_pipeline_first_stage():
        keys.update(("tokens", "position_ids"))
    if parallel_state.is_pipeline_last_stage():
        keys.update(("labels", "loss_mask"))
    device = current_device()
    cp_size, cp_rank = parallel_state.get_context_parallel_world_size(), parallel_state.get_context_parallel_rank()
    if is_packed(batch):
        # tokens/labels/... on the device; the cu_seqlens keys stay on the host (the layout is computed there)
        picked = {k: (batch[k].to(device, non_blocking=True) if k in keys else None) for k in TOKEN_KEYS if k in batch}
        picked.update({k: batch[k] for k in PACKED_KEYS if k in batch})
        return shard_packed_batch_for_cp(picked, cp_size, cp_rank)
    picked = {k: (v.to(device, non_blocking=True) if k in keys else None) for k, v in batch.items()
              if k != "attention_mask"}  # a plain causal mask (checked above): the core attention applies it
    return shard_batch_for_cp(picked, cp_size, cp_rank)


def long_context_forward_step(model, batch: Dict[str, Any]) -> torch.Tensor:
    return model(
        input_ids=batch["tokens"],
        position_ids=batch["position_ids"],
        attention_mask=None,
        labels=batch["labels"],
        packed_seq_params=batch.get("packed_seq_params"),
    )
