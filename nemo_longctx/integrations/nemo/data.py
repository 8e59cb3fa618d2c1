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
"""

from __future__ import annotations

from typing import Any, Dict, Optional

import lightning.pytorch as pl
import torch
from torch.utils.data import DataLoader, Dataset


class RepeatedBlockDataset(Dataset):
    def __init__(self, num_samples: int, seq_length: int, vocab_size: int, period: int, seed: int,
                 skew: float = 3.0, offset: int = 0) -> None:
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
        return {
            "tokens": seq[:-1].clone(),
            "labels": seq[1:].clone(),
            "loss_mask": torch.ones(self.seq_length, dtype=torch.float),
            "position_ids": torch.arange(self.seq_length, dtype=torch.long),
        }


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
        reset_attention_mask: bool = False,
    ) -> None:
        super().__init__()
        from nemo.lightning.pytorch.plugins import MegatronDataSampler

        if reset_attention_mask:
            raise ValueError("data.reset_attention_mask=true is not supported by nemo_longctx core attention")
        self.seq_length, self.vocab_size = seq_length, vocab_size
        self.micro_batch_size, self.global_batch_size = micro_batch_size, global_batch_size
        self.num_train_samples, self.period, self.skew, self.seed = num_train_samples, period, skew, seed
        self.num_val_samples = num_val_samples
        self.reset_attention_mask = reset_attention_mask
        self.data_sampler = MegatronDataSampler(
            seq_len=seq_length, micro_batch_size=micro_batch_size, global_batch_size=global_batch_size
        )
        self._train_ds: Optional[Dataset] = None
        self._val_ds: Optional[Dataset] = None

    def setup(self, stage: str = "") -> None:
        self._train_ds = RepeatedBlockDataset(
            self.num_train_samples, self.seq_length, self.vocab_size, self.period, self.seed, self.skew
        )
        self._val_ds = RepeatedBlockDataset(
            self.num_val_samples, self.seq_length, self.vocab_size, self.period, self.seed, self.skew,
            offset=self.num_train_samples,
        )

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
