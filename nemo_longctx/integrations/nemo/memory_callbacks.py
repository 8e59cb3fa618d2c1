"""Lightning callbacks of the ``recompute`` / ``offload`` config groups and the per-step activation-memory metrics.

``MemoryOptionsCallback(options)`` (options checked when the run was built):
  setup()        writes Megatron's recompute fields onto the model config (runs after the strategy attached our
                 core attention, before the model is built);
  on_fit_start   wires the built model (``attach_memory_options``: full-recompute block subclass, kept attention
                 cache, offload engine);
  on_train_batch_end  checks that nothing kept or offloaded outlived the step's backward.

``ActivationMemoryMetrics(count_peak)``: an ``ActivationTracker`` around every training step (entered in
on_train_batch_start, before any offload scope opens; Megatron's schedule runs forward and backward inside
training_step). ``metrics()`` gives activation_bytes_device / activation_bytes_host / peak_bytes of the last step
(this rank; peak_bytes None when not counted: CPU with ``count_peak=False``), ``summary()`` a one-line log.
Register it *before* StepMetrics so its on_train_batch_end runs first.
"""

from __future__ import annotations

from typing import Any, Dict

import lightning.pytorch as pl

from nemo_longctx.integrations.megatron.memory_options import apply_recompute_fields, attach_memory_options
from nemo_longctx.options import MemoryOptions


class MemoryOptionsCallback(pl.Callback):
    def __init__(self, options: MemoryOptions) -> None:
        self.options = options
        self.runtime = None

    def setup(self, trainer: pl.Trainer, pl_module: Any, stage: str) -> None:
        apply_recompute_fields(pl_module.config, self.options)

    def on_fit_start(self, trainer: pl.Trainer, pl_module: Any) -> None:
        if self.runtime is None:
            self.runtime = attach_memory_options(pl_module, self.options)

    def on_train_batch_end(self, trainer: pl.Trainer, pl_module: Any, outputs: Any, batch: Any, batch_idx: int) -> None:
        if self.runtime is not None:
            self.runtime.after_step(f"after step {trainer.global_step}")

    def teardown(self, trainer: pl.Trainer, pl_module: Any, stage: str) -> None:
        if self.runtime is not None:
            self.runtime.detach()
            self.runtime = None


class ActivationMemoryMetrics(pl.Callback):
    """``memory.tracker.StepActivationMeter`` on Lightning's batch hooks."""

    def __init__(self, count_peak: bool = False, track_activations: bool = True) -> None:
        from nemo_longctx.memory.tracker import StepActivationMeter

        self.meter = StepActivationMeter(count_peak=count_peak, track=track_activations)

    def on_train_batch_start(self, trainer: pl.Trainer, pl_module: Any, batch: Any, batch_idx: int) -> None:
        self.meter.start(pl_module.parameters())

    def on_train_batch_end(self, trainer: pl.Trainer, pl_module: Any, outputs: Any, batch: Any, batch_idx: int) -> None:
        self.meter.stop()

    def on_exception(self, trainer: pl.Trainer, pl_module: Any, exception: BaseException) -> None:
        self.meter.stop()

    def metrics(self) -> Dict[str, Any]:
        return self.meter.metrics()

    def summary(self) -> str:
        return self.meter.summary()
