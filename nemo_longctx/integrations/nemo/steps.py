"""NeMo data step and forward step for GPT models running nemo_longctx core attention.

``long_context_data_step(dataloader_iter)``: takes the next batch (dict of ``[b, S]`` tensors from the data module,
the full sequence), keeps the keys this pipeline stage needs, moves them to the current device (CUDA if available,
else CPU -- no ``.cuda()``), and zigzag-shards them over the CP group (``shard_batch_for_cp``). Any dataset
``attention_mask`` is dropped: the core attention applies the causal mask itself; datasets that need a different
mask (document resets, padding) are refused by validation (``data.reset_attention_mask``), and packed sequences
(``cu_seqlens``) raise here.

``long_context_forward_step(model, batch)``: calls the GPT model with ``attention_mask=None``.
"""

from __future__ import annotations

from typing import Any, Dict

import torch

from nemo_longctx.integrations.megatron.batch import shard_batch_for_cp


def current_device() -> torch.device:
    return torch.device("cuda", torch.cuda.current_device()) if torch.cuda.is_available() else torch.device("cpu")


def long_context_data_step(dataloader_iter) -> Dict[str, Any]:
    from megatron.core import parallel_state

    batch = next(dataloader_iter)
    if isinstance(batch, tuple) and len(batch) == 3:
        batch = batch[0]
    if "cu_seqlens" in batch:
        raise ValueError("packed sequences (cu_seqlens in the batch) are not supported by nemo_longctx core attention")
    keys = set()
    if parallel_state.is_pipeline_first_stage():
        keys.update(("tokens", "position_ids"))
    if parallel_state.is_pipeline_last_stage():
        keys.update(("labels", "loss_mask"))
    device = current_device()
    picked = {k: (v.to(device, non_blocking=True) if k in keys else None) for k, v in batch.items() if k != "attention_mask"}
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
