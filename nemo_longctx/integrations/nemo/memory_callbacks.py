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

from typing import Any, Dict, Optional

import lightning.pytorch as pl
import torch

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
    def __init__(self, count_peak: bool = False, track_activations: bool = True) -> None:
        self.count_peak = bool(count_peak)
        self.track_activations = bool(track_activations)
        self._tracker = None
        self._stats = None

    def on_train_batch_start(self, trainer: pl.Trainer, pl_module: Any, batch: Any, batch_idx: int) -> None:
        if not self.track_activations:
            return
        from nemo_longctx.memory.tracker import ActivationTracker

        self._tracker = ActivationTracker(count_peak=self.count_peak, params=pl_module.parameters())
        self._tracker.__enter__()

    def _close(self) -> None:
        if self._tracker is not None:
            self._tracker.__exit__(None, None, None)
            self._stats = self._tracker.stats()
            self._tracker = None

    def on_train_batch_end(self, trainer: pl.Trainer, pl_module: Any, outputs: Any, batch: Any, batch_idx: int) -> None:
        self._close()

    def on_exception(self, trainer: pl.Trainer, pl_module: Any, exception: BaseException) -> None:
        self._close()

    def metrics(self) -> Dict[str, Any]:
        s = self._stats
        if s is None:
            return {"activation_bytes_device": None, "activation_bytes_host": None, "peak_bytes": None}
        counted = s.device == "cuda" or self.count_peak
        return {"activation_bytes_device": int(s.activation_bytes_device),
                "activation_bytes_host": int(s.activation_bytes_host),
                "peak_bytes": int(s.peak_bytes) if counted else None}

    def summary(self) -> str:
        m = self.metrics()
        if m["activation_bytes_device"] is None:
            return "activations: not tracked"

        def mib(b: Optional[int]) -> str:
            return "-" if b is None else f"{b / 2**20:.1f} MiB"

        dev = "cuda" if torch.cuda.is_available() else "cpu"
        return (f"activations {dev} {mib(m['activation_bytes_device'])} host {mib(m['activation_bytes_host'])} "
                f"peak {mib(m['peak_bytes'])}")
