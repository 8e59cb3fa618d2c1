"""``ModelStateCheck``: after the optimizer is built (fit start), check that Megatron built the model-state layout
the ``optim`` group asked for (distributed optimizer, HybridDeviceOptimizer and its host fraction) and print it; after
the first optimizer step, measure the bytes of weights, grads and optimizer states each rank holds on the device and
on the host (``state_bytes.measured_model_state_bytes``), print rank 0's and write every rank's to
``<output_dir>/model_state_bytes.rank<R>.json``."""

from __future__ import annotations

import json
import os
from typing import Any, Optional

import lightning.pytorch as pl

from nemo_longctx.integrations.megatron.model_state import (
    ModelStateOptions,
    check_optimizer_layout,
    optimizer_layout,
)


class ModelStateCheck(pl.Callback):
    def __init__(self, options: ModelStateOptions, output_dir: Optional[str] = None) -> None:
        self.options = options
        self.output_dir = output_dir
        self.summary = None
        self.state_bytes = None

    @staticmethod
    def _mcore_optimizer(trainer: pl.Trainer) -> Any:
        """The Megatron optimizer NeMo's strategy built (inside its Lightning wrapper)."""
        optimizers = trainer.strategy.optimizers
        if not optimizers:
            raise RuntimeError("ModelStateCheck: the strategy built no optimizer")
        return getattr(optimizers[0], "mcore_optimizer", optimizers[0])

    def on_train_start(self, trainer: pl.Trainer, pl_module: Any) -> None:
        self.summary = check_optimizer_layout(self.options, optimizer_layout(self._mcore_optimizer(trainer)))
        if trainer.global_rank == 0:
            print(self.summary, flush=True)

    def on_train_batch_end(self, trainer: pl.Trainer, pl_module: Any, outputs: Any, batch: Any,
                           batch_idx: int) -> None:
        if self.state_bytes is not None:
            return
        from nemo_longctx.integrations.megatron.state_bytes import measured_model_state_bytes, summary_line

        try:
            self.state_bytes = measured_model_state_bytes(list(trainer.strategy.model),
                                                          self._mcore_optimizer(trainer))
        except Exception as e:  # a diagnostic: never stops training (the JSON says what failed)
            self.state_bytes = {"error": f"{type(e).__name__}: {e}"}
            print(f"[rank {trainer.global_rank}] model state bytes not measured: {self.state_bytes['error']}",
                  flush=True)
        self.state_bytes.update(options=self.options.describe(), rank=trainer.global_rank,
                                world_size=trainer.world_size)
        if self.output_dir:
            os.makedirs(self.output_dir, exist_ok=True)
            path = os.path.join(self.output_dir, f"model_state_bytes.rank{trainer.global_rank}.json")
            with open(path, "w") as f:
                json.dump(self.state_bytes, f, indent=1)
        if trainer.global_rank == 0 and "error" not in self.state_bytes:
            print(summary_line(self.state_bytes), flush=True)


class FsdpCheckpointState(pl.Callback):
    """Megatron-FSDP with checkpoints: from fit start (the optimizer exists, Lightning has not restored a checkpoint
    yet) every rank holds optimizer state for every parameter, in one order, after every optimizer step -- the
    training steps and the zero-gradient step Megatron takes before a load -- and again before every save
    (``fsdp_checkpoint``: the fsdp_dtensor format makes collective calls per parameter's state)."""

    @staticmethod
    def _optimizers(trainer: pl.Trainer) -> list:
        return [getattr(o, "mcore_optimizer", o) for o in trainer.strategy.optimizers]

    def on_fit_start(self, trainer: pl.Trainer, pl_module: Any) -> None:
        from nemo_longctx.integrations.megatron.fsdp_checkpoint import keep_fsdp_optimizer_state_complete

        for o in self._optimizers(trainer):
            keep_fsdp_optimizer_state_complete(o)

    def on_save_checkpoint(self, trainer: pl.Trainer, pl_module: Any, checkpoint: Any) -> None:
        from nemo_longctx.integrations.megatron.fsdp_checkpoint import complete_fsdp_optimizer_state

        for o in self._optimizers(trainer):
            complete_fsdp_optimizer_state(o)
