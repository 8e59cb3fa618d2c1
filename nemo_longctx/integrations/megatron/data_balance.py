"""Data-parallel balance of packed documents: the rows of each global batch spread over the data-parallel ranks by
attention cost (``CostBalancedBatches``), for the front ends' data modules (document-aware CP,
``cp.split_min_tokens``). Plain torch datasets; Megatron's parallel state only to read the data-parallel size."""

from __future__ import annotations

from typing import Any, Dict

import torch
from torch.utils.data import Dataset


class CostBalancedBatches(Dataset):
    """Samples of packed documents (``PerDocumentPacking``'s format) reordered within each global batch so that every
    data-parallel rank gets about the same attention work (``planner.documents.schedule_global_batch``: the pairs of
    each sample's documents; a rank's total is at most the mean plus the costliest sample's). Only the assignment of
    one global batch's samples to (micro-batch, DP rank) slots changes -- the same samples make the same optimizer
    step, and with the per-token loss of packed data the same gradient. Index ``i`` is Megatron's sampler position at
    micro-batch size 1 (global batch ``i // global_batch_size``); every rank computes the same order."""

    def __init__(self, dataset: Dataset, global_batch_size: int, dp_size: int) -> None:
        if global_batch_size % dp_size:
            raise ValueError(f"global batch {global_batch_size} does not split over {dp_size} data-parallel ranks")
        self.dataset, self.global_batch_size, self.dp_size = dataset, int(global_batch_size), int(dp_size)
        self._orders: Dict[int, Any] = {}

    def __len__(self) -> int:
        return len(self.dataset)

    def _order(self, g: int) -> Any:
        if g not in self._orders:
            from nemo_longctx.planner.documents import schedule_global_batch, sequence_cost

            start = g * self.global_batch_size
            costs = []
            for i in range(start, start + self.global_batch_size):
                cu = self.dataset[i]["cu_seqlens"]
                n = int(self.dataset[i]["cu_seqlens_argmin"].reshape(-1)[0])
                bounds = [int(x) for x in cu[:n].tolist()]
                costs.append(sequence_cost([b - a for a, b in zip(bounds, bounds[1:])]))
            if len(self._orders) > 4:
                self._orders.clear()
            self._orders[g] = schedule_global_batch(costs, self.dp_size)
        return self._orders[g]

    def __getitem__(self, idx: int) -> Dict[str, torch.Tensor]:
        g, r = divmod(int(idx), self.global_batch_size)
        if (g + 1) * self.global_batch_size > len(self.dataset):  # an incomplete last global batch: as it is
            return self.dataset[idx]
        return self.dataset[g * self.global_batch_size + self._order(g)[r]]


def balance_over_data_parallel(dataset: Dataset, global_batch_size: int) -> Dataset:
    """``CostBalancedBatches`` over this run's data-parallel ranks (Megatron's parallel state), or ``dataset`` as it
    is with one data-parallel rank."""
    from megatron.core import parallel_state as ps

    dp = ps.get_data_parallel_world_size() if ps.model_parallel_is_initialized() else 1
    return dataset if dp == 1 else CostBalancedBatches(dataset, global_batch_size, dp)
