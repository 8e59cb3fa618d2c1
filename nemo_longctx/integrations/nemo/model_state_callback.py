"""``ModelStateCheck``: after the optimizer is built (fit start), check that Megatron built the model-state layout
the ``optim`` group asked for (distributed optimizer, HybridDeviceOptimizer and its host fraction) and print it."""

from __future__ import annotations

from typing import Any

import lightning.pytorch as pl

from nemo_longctx.integrations.megatron.model_state import (
    ModelStateOptions,
    check_optimizer_layout,
    optimizer_layout,
)


class ModelStateCheck(pl.Callback):
    def __init__(self, options: ModelStateOptions) -> None:
        self.options = options
        self.summary = None

    def on_train_start(self, trainer: pl.Trainer, pl_module: Any) -> None:
        optimizers = trainer.strategy.optimizers
        if not optimizers:
            raise RuntimeError("ModelStateCheck: the strategy built no optimizer")
        mcore = getattr(optimizers[0], "mcore_optimizer", optimizers[0])
        self.summary = check_optimizer_layout(self.options, optimizer_layout(mcore))
        if trainer.global_rank == 0:
            print(self.summary, flush=True)
