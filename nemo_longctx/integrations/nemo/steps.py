"""NeMo data step and forward step for GPT models running nemo_longctx core attention.

``long_context_data_step(dataloader_iter)``: takes the next batch (dict of ``[b, S]`` tensors from the data module,
the full sequence), checks that it needs nothing but the causal mask, keeps the keys this pipeline stage needs,
moves them to the current device (CUDA if available, else CPU -- no ``.cuda()``), and zigzag-shards them over the
CP group (``shard_batch_for_cp``). The core attention applies the causal mask itself, so a batch that carries an
``attention_mask`` (other than the plain causal one), per-document ``position_ids`` (reset at document
boundaries) or packed-sequence boundaries (``cu_seqlens``) is refused with a ValueError saying what to use
instead -- never dropped silently.

``long_context_forward_step(model, batch)``: calls the GPT model with ``attention_mask=None``.
"""

from __future__ import annotations

from typing import Any, Dict

import torch

from nemo_longctx.integrations.megatron.batch import shard_batch_for_cp


def current_device() -> torch.device:
    return torch.device("cuda", torch.cuda.current_device()) if torch.cuda.is_available() else torch.device("cpu")


def check_batch(batch: Dict[str, Any]) -> None:
    """Refuse what the core attention cannot honour: it attends causally over the whole (zigzag-sharded) sequence."""
    if "cu_seqlens" in batch:
        raise ValueError("packed sequences (cu_seqlens in the batch) are not supported by nemo_longctx core attention "
                         "yet: train on unpacked sequences (data.kind=synthetic or indexed without packing)")
    mask = batch.get("attention_mask")
    if mask is not None:
        s = mask.shape[-1]
        # Megatron's convention: True = masked out. A causal-only mask is the upper triangle, the same for every row.
        causal = torch.triu(torch.ones(s, s, dtype=torch.bool, device=mask.device), diagonal=1)
        if mask.dtype != torch.bool or mask.shape[-2] != s or not bool((mask == causal).all()):
            raise ValueError(
                "the batch carries an attention_mask other than the causal one (document or padding masking): "
                "nemo_longctx core attention applies only the causal mask; set the data module's "
                "create_attention_mask=False and reset_attention_mask=False (packed documents with per-document "
                "attention are not supported yet)"
            )
    pos = batch.get("position_ids")
    if pos is not None:
        expected = torch.arange(pos.shape[-1], dtype=pos.dtype, device=pos.device)
        if not bool((pos == expected).all()):
            raise ValueError(
                "the batch carries per-document position_ids (reset at document boundaries): nemo_longctx core "
                "attention does not mask across documents, so these positions would be silently wrong; set the data "
                "module's reset_position_ids=False (packed documents with per-document attention are not supported "
                "yet)"
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
    picked = {k: (v.to(device, non_blocking=True) if k in keys else None) for k, v in batch.items()
              if k != "attention_mask"}  # a plain causal mask (checked above): the core attention applies it
    return shard_batch_for_cp(
        picked, parallel_state.get_context_parallel_world_size(), parallel_state.get_context_parallel_rank()
    )


def long_context_forward_step(model, batch: Dict[str, Any]) -> torch.Tensor:
    return model(
        input_ids=batch["tokens"],
        position_ids=batch["position_ids"],
        attention_mask=None,
        labels=batch["labels"],
    )
