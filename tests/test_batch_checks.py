"""The data step refuses batches that need more than the causal mask unless they are packed (``cu_seqlens``: the
documents then travel as PackedSeqParams); never drops them silently.

Batches are made by Megatron's own GPTDataset helper (``_get_ltor_masks_and_position_ids``, what
``PreTrainingDataModule`` yields per sample), with and without document resets, then collated like a DataLoader."""

from __future__ import annotations

import pytest
import torch

pytest.importorskip("megatron.core")

from megatron.core.datasets.gpt_dataset import _get_ltor_masks_and_position_ids  # noqa: E402

from nemo_longctx.integrations.nemo.steps import check_batch  # noqa: E402

EOD = 0


def _batch(reset_position_ids: bool, reset_attention_mask: bool, create_attention_mask: bool, b: int = 2):
    g = torch.Generator().manual_seed(0)
    samples = []
    for _ in range(b):
        tokens = torch.randint(1, 50, (64,), generator=g)
        tokens[[9, 30, 47]] = EOD  # three document boundaries
        mask, loss_mask, pos = _get_ltor_masks_and_position_ids(
            tokens, EOD, reset_position_ids, reset_attention_mask, False, create_attention_mask)
        sample = {"tokens": tokens, "labels": tokens.roll(-1), "loss_mask": loss_mask, "position_ids": pos}
        if mask is not None:
            sample["attention_mask"] = mask
        samples.append(sample)
    return torch.utils.data.default_collate(samples)


@pytest.mark.parametrize("create_mask", [False, True])
def test_plain_causal_batches_pass(create_mask):
    batch = _batch(False, False, create_mask)
    assert ("attention_mask" in batch) == create_mask
    check_batch(batch)  # no exception: the causal mask is what the core attention applies


def test_document_attention_mask_is_refused():
    batch = _batch(False, True, True)
    with pytest.raises(ValueError, match="attention_mask other than the causal one.*reset_attention_mask=False"):
        check_batch(batch)


@pytest.mark.parametrize("create_mask", [False, True])
def test_per_document_position_ids_are_refused(create_mask):
    batch = _batch(True, False, create_mask)
    with pytest.raises(ValueError, match="per-document position_ids.*reset_position_ids=False"):
        check_batch(batch)


def test_refusals_point_to_per_document_packing():
    for batch in (_batch(False, True, True), _batch(True, False, False)):
        with pytest.raises(ValueError, match="data.packing=documents"):
            check_batch(batch)


def test_packed_batches_pass_and_need_micro_batch_size_one():
    batch = _batch(True, True, True, b=1)  # a document mask and reset positions: with cu_seqlens the documents
    batch["cu_seqlens"] = torch.tensor([[0, 10, 31, 48, 64, -1]], dtype=torch.int32)  # travel as PackedSeqParams
    check_batch(batch)
    batch2 = _batch(False, False, False)
    batch2["cu_seqlens"] = torch.tensor([[0, 10, 64], [0, 31, 64]], dtype=torch.int32)
    with pytest.raises(ValueError, match="trainer.micro_batch_size=1"):
        check_batch(batch2)
