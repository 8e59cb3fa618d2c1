"""Synthetic pre-training data for the CPU demo and tests (no tokenizer, no files).

``SyntheticDataModule`` yields dicts of full-sequence ``[b, S]`` tensors -- ``tokens``, ``labels`` (= tokens shifted
by one), ``loss_mask`` (ones), ``position_ids`` (0..S-1) -- with no ``attention_mask``. Sample i is a function of
(seed, i) only, so any number of processes sees the same data. Each sample repeats a random block of
``period`` tokens drawn from a skewed distribution (token = floor(V * u**skew), u uniform): the skew is learnt in a
few steps (the loss visibly falls from ln V), copying from one period back later.
Validation samples are indices after the training ones (``num_val_samples`` of them), so they never overlap.
Batching over data-parallel ranks is NeMo's ``MegatronDataSampler`` (through NeMo's ``WrappedDataLoader``, as in
``PreTrainingDataModule``); ``state_dict``/``load_state_dict`` carry the consumed samples through checkpoints, so a
resumed run continues with the next unseen batch. CP sharding happens in the data step.

``packing="documents"`` (``data.packing=documents``): every sample is a row of documents of ``doc_length/2 ..
3*doc_length/2`` tokens with per-document attention (``PerDocumentPacking``: NeMo's packed format, ``cu_seqlens``);
``PerDocumentPacking`` also wraps Megatron's GPTDataset samples built with ``reset_position_ids`` (data=indexed).
"""

from __future__ import annotations

from typing import Any, Dict, Optional

import lightning.pytorch as pl
import torch
from torch.utils.data import DataLoader, Dataset

from nemo_longctx.integrations.megatron.data_balance import balance_over_data_parallel
from nemo_longctx.integrations.nemo.data_checks import PACKING_MODES, packing_problems  # noqa: F401  (re-exported)


class RepeatedBlockDataset(Dataset):
    def __init__(self, num_samples: int, seq_length: int, vocab_size: int, period: int, seed: int,
                 skew: float = 3.0, offset: int = 0, doc_length: Optional[int] = None) -> None:
        if doc_length is not None and (isinstance(doc_length, bool) or not isinstance(doc_length, int)
                                       or doc_length < 1):
            raise ValueError(f"data.doc_length={doc_length!r} must be a positive int")
        self.doc_length = doc_length
        if period < 1:
            raise ValueError(f"data.period={period} must be >= 1")
        if skew <= 0:
            raise ValueError(f"data.skew={skew} must be > 0")
        self.num_samples, self.seq_length, self.vocab_size = num_samples, seq_length, vocab_size
        self.period, self.seed, self.skew, self.offset = period, seed, skew, offset

    def __len__(self) -> int:
        return self.num_samples

    def __getitem__(self, idx: int) -> Dict[str, torch.Tensor]:
        g = torch.Generator().manual_seed(self.seed * 1_000_003 + self.offset + idx)
        u = torch.rand(self.period, generator=g, dtype=torch.float64)
        block = (self.vocab_size * u.pow(self.skew)).long().clamp_(max=self.vocab_size - 1)
        reps = (self.seq_length + 1 + self.period - 1) // self.period
        seq = block.repeat(reps)[: self.seq_length + 1]
        position_ids = torch.arange(self.seq_length, dtype=torch.long)
        if self.doc_length is not None:  # documents of doc_length/2 .. 3*doc_length/2 tokens, positions reset at each
            start = 0
            while start < self.seq_length:
                n = int(torch.randint(max(1, self.doc_length // 2), self.doc_length * 3 // 2 + 1, (1,), generator=g))
                position_ids[start:start + n] = torch.arange(min(n, self.seq_length - start))
                start += n
        return {
            "tokens": seq[:-1].clone(),
            "labels": seq[1:].clone(),
            "loss_mask": torch.ones(self.seq_length, dtype=torch.float),
            "position_ids": position_ids,
        }




def check_packing(packing: Any, micro_batch_size: int) -> str:
    problems = packing_problems(packing, micro_batch_size)
    if problems:
        raise ValueError(problems[0])
    return packing


class PerDocumentPacking(Dataset):
    """Pretraining samples with per-document attention: wraps a dataset whose samples carry per-document
    ``position_ids`` (restarting at 0 where a document starts -- Megatron's ``reset_position_ids``, a document ends
    after each EOD token) and yields them in NeMo's packed format: the same tokens/labels/loss_mask plus
    ``cu_seqlens`` (cumulative document lengths, int32, filled to a fixed length with -1 so samples collate),
    ``cu_seqlens_argmin`` and ``max_seqlen``; a document ``attention_mask`` is dropped (the documents are in
    ``cu_seqlens``). The data step then lays the documents out for the CP group (``shard_packed_batch_for_cp``)."""

    def __init__(self, dataset: Dataset) -> None:
        self.dataset = dataset

    def __len__(self) -> int:
        return len(self.dataset)

    def __getitem__(self, idx: int) -> Dict[str, torch.Tensor]:
        from nemo_longctx.integrations.megatron.batch import documents_from_position_ids

        sample = {k: v for k, v in self.dataset[idx].items() if k != "attention_mask"}
        lengths = documents_from_position_ids(sample["position_ids"])
        s = int(sample["position_ids"].numel())
        cu = torch.full((s + 2,), -1, dtype=torch.int32)
        cu[: len(lengths) + 1] = torch.tensor([0] + lengths, dtype=torch.int32).cumsum(0)
        sample.update(cu_seqlens=cu, cu_seqlens_argmin=torch.tensor([len(lengths) + 1]),
                      max_seqlen=torch.tensor([max(lengths)], dtype=torch.int32))
        return sample


class SyntheticDataModule(pl.LightningDataModule):
    def __init__(
        self,
        seq_length: int = 4096,
        vocab_size: int = 1024,
        micro_batch_size: int = 1,
        global_batch_size: int = 1,
        num_train_samples: int = 100_000,
        num_val_samples: int = 64,
        period: int = 256,
        skew: float = 3.0,
        seed: int = 1234,
        packing: str = "none",
        doc_length: int = 512,
        balance_data_parallel: bool = False,
    ) -> None:
        super().__init__()
        from nemo.lightning.pytorch.plugins import MegatronDataSampler

        self.packing = check_packing(packing, micro_batch_size)
        self.doc_length = doc_length if packing == "documents" else None
        self.balance_data_parallel = bool(balance_data_parallel) and packing == "documents"
        self.seq_length, self.vocab_size = seq_length, vocab_size
        self.micro_batch_size, self.global_batch_size = micro_batch_size, global_batch_size
        self.num_train_samples, self.period, self.skew, self.seed = num_train_samples, period, skew, seed
        self.num_val_samples = num_val_samples
        self.tokenizer = None  # token ids, no text: NeMo's llm.pretrain hands data.tokenizer to the model
        self.data_sampler = MegatronDataSampler(
            seq_len=seq_length, micro_batch_size=micro_batch_size, global_batch_size=global_batch_size
        )
        self._train_ds: Optional[Dataset] = None
        self._val_ds: Optional[Dataset] = None

    def setup(self, stage: str = "") -> None:
        self._train_ds = RepeatedBlockDataset(
            self.num_train_samples, self.seq_length, self.vocab_size, self.period, self.seed, self.skew,
            doc_length=self.doc_length,
        )
        self._val_ds = RepeatedBlockDataset(
            self.num_val_samples, self.seq_length, self.vocab_size, self.period, self.seed, self.skew,
            offset=self.num_train_samples, doc_length=self.doc_length,
        )
        if self.packing == "documents":
            self._train_ds, self._val_ds = PerDocumentPacking(self._train_ds), PerDocumentPacking(self._val_ds)
            if self.balance_data_parallel:
                self._train_ds = balance_over_data_parallel(self._train_ds, self.global_batch_size)

    def _loader(self, dataset: Dataset, mode: str) -> DataLoader:
        from nemo.lightning.data import WrappedDataLoader

        if self.trainer is not None:  # the sampler continues from the restored step (resume)
            self.data_sampler.init_global_step = self.trainer.global_step
        return WrappedDataLoader(mode=mode, dataset=dataset, num_workers=0, pin_memory=False)

    def train_dataloader(self) -> DataLoader:
        if self._train_ds is None:
            self.setup()
        return self._loader(self._train_ds, "train")

    def val_dataloader(self) -> DataLoader:
        if self._val_ds is None:
            self.setup()
        return self._loader(self._val_ds, "validation")

    def state_dict(self) -> Dict[str, Any]:
        """Saved in every checkpoint: the samples consumed so far (NeMo's PreTrainingDataModule convention)."""
        step = self.trainer.global_step - self.data_sampler.init_global_step
        return {"consumed_samples": self.data_sampler.compute_consumed_samples(step)}

    def load_state_dict(self, state_dict: Dict[str, Any]) -> None:
        from megatron.core.num_microbatches_calculator import update_num_microbatches

        consumed = int(state_dict["consumed_samples"])
        self.data_sampler.init_consumed_samples = consumed
        self.data_sampler.prev_consumed_samples = consumed
        update_num_microbatches(consumed_samples=consumed, consistency_check=False)
        self.data_sampler.if_first_step = 1


def pretraining_data_module(documents: bool, balance_data_parallel: bool = False, **kwargs: Any) -> Any:
    """NeMo's ``PreTrainingDataModule`` (Megatron indexed data); with ``documents`` its samples (built with
    ``reset_position_ids``/``reset_attention_mask``) go through ``PerDocumentPacking``: per-document attention; with
    ``balance_data_parallel`` the training samples of each global batch are spread over the data-parallel ranks by
    attention cost (``CostBalancedBatches``)."""
    from nemo.collections.llm.gpt.data.pre_training import PreTrainingDataModule

    if not documents:
        return PreTrainingDataModule(**kwargs)

    class DocumentPackedPreTrainingDataModule(PreTrainingDataModule):
        def _create_dataloader(self, dataset, mode, **kw):
            packed = PerDocumentPacking(dataset)
            if balance_data_parallel and mode == "train":
                packed = balance_over_data_parallel(packed, int(self.global_batch_size))
            return super()._create_dataloader(packed, mode, **kw)

    return DocumentPackedPreTrainingDataModule(**kwargs)


def packed_sft_data_module(data: Any, seq_length: int, micro_batch_size: int, global_batch_size: int) -> Any:
    """NeMo's fine-tuning data module reading packed ``.npy`` files (``PackedSequenceSpecs``; the files are what
    ``nemo.collections.llm.gpt.data.packed_sequence.prepare_packed_sequence_data`` writes). ``data``: the run spec's
    ``DataSpec``: ``dataset_root``, ``tokenizer`` (HF name/path; its eos id pads), ``packed_train``, ``packed_val``
    (``.npy``), ``packed_metadata`` (optional), ``num_workers``, ``seed``. Its batches carry ``cu_seqlens`` (the
    packed layout) and ``cu_seqlens_unpadded`` (real lengths): the data step lays the documents out for the CP
    group."""
    import os

    from nemo.collections.common.tokenizers.huggingface.auto_tokenizer import AutoTokenizer
    from nemo.collections.llm.gpt.data.fine_tuning import FineTuningDataModule
    from nemo.collections.llm.gpt.data.packed_sequence import PackedSequenceSpecs

    if micro_batch_size != 1:
        raise ValueError(f"data.kind=packed_sft needs trainer.micro_batch_size=1 (got {micro_batch_size})")
    for key in ("packed_train", "packed_val"):
        path = getattr(data, key)
        if not path or not str(path).endswith(".npy") or not os.path.isfile(str(path)):
            raise ValueError(f"data.{key}={path!r} must be an existing packed .npy file (NeMo's "
                             "prepare_packed_sequence_data output)")
    specs = PackedSequenceSpecs(
        packed_sequence_size=seq_length, packed_train_data_path=str(data.packed_train),
        packed_val_data_path=str(data.packed_val),
        packed_metadata_path=str(data.packed_metadata) if data.packed_metadata else None)
    tokenizer = data.tokenizer
    return FineTuningDataModule(
        dataset_root=str(data.dataset_root or os.path.dirname(str(data.packed_train))), seq_length=seq_length,
        tokenizer=AutoTokenizer(str(tokenizer)) if isinstance(tokenizer, str) else tokenizer,
        micro_batch_size=micro_batch_size, global_batch_size=global_batch_size, seed=int(data.seed),
        num_workers=int(data.num_workers), pin_memory=False, packed_sequence_specs=specs)
