"""Lightning callbacks of the Hydra app.

``StepMetrics``: after every optimizer step, on the one rank that owns the reduced loss (last pipeline stage, TP
rank 0, data+context-parallel rank 0), prints ``step N/M | loss L | tokens/s T | elapsed E s`` and appends one JSON
object per step to ``<output_dir>/metrics.jsonl``: step, loss (NeMo's MaskedTokenLossReduction: token-weighted
mean over the global batch, all-reduced over the data- and context-parallel ranks), tokens_per_s (global tokens of
the step / step wall time), step_time_s, elapsed_s, tokens (global tokens of the step), cp_size, world_size, plus
what ``extra.metrics()`` returns (the app passes ``ActivationMemoryMetrics``: activation_bytes_device,
activation_bytes_host, peak_bytes of this rank), with ``extra.summary()`` appended to the printed line.
"""

from __future__ import annotations

import json
import os
import time
from typing import Any, Optional

import lightning.pytorch as pl
import torch


def _is_metrics_rank() -> bool:
    from megatron.core import parallel_state as ps

    return (
        ps.is_pipeline_last_stage()
        and ps.get_tensor_model_parallel_rank() == 0
        and ps.get_data_parallel_rank(with_context_parallel=True) == 0
    )


class StepMetrics(pl.Callback):
    def __init__(self, output_dir: str, tokens_per_step: int, print_every: int = 1, extra: Any = None) -> None:
        self.output_dir = output_dir
        self.extra = extra  # object with metrics() -> dict (merged into each record) and summary() -> str (printed)
        self.tokens_per_step = int(tokens_per_step)
        self.print_every = max(1, int(print_every))
        self.path = os.path.join(output_dir, "metrics.jsonl")
        self._t0: Optional[float] = None
        self._step_start = 0.0
        self._active = False

    def on_train_start(self, trainer: pl.Trainer, pl_module: Any) -> None:
        self._active = _is_metrics_rank()
        if self._active:
            os.makedirs(self.output_dir, exist_ok=True)
            open(self.path, "w").close()
        self._t0 = time.perf_counter()

    def on_train_batch_start(self, trainer: pl.Trainer, pl_module: Any, batch: Any, batch_idx: int) -> None:
        self._step_start = time.perf_counter()

    def on_train_batch_end(self, trainer: pl.Trainer, pl_module: Any, outputs: Any, batch: Any, batch_idx: int) -> None:
        if not self._active:
            return
        now = time.perf_counter()
        loss = outputs["loss"] if isinstance(outputs, dict) else outputs
        loss = float(loss.detach().float().item()) if isinstance(loss, torch.Tensor) else float(loss)
        dt = now - self._step_start
        from megatron.core import parallel_state as ps

        rec = {
            "step": int(trainer.global_step),
            "loss": loss,
            "tokens_per_s": self.tokens_per_step / dt if dt > 0 else float("inf"),
            "step_time_s": dt,
            "elapsed_s": now - (self._t0 or now),
            "tokens": self.tokens_per_step,
            "cp_size": ps.get_context_parallel_world_size(),
            "world_size": torch.distributed.get_world_size() if torch.distributed.is_initialized() else 1,
        }
        if self.extra is not None:
            rec.update(self.extra.metrics())
        with open(self.path, "a") as f:
            f.write(json.dumps(rec) + "\n")
        if rec["step"] % self.print_every == 0 or rec["step"] == trainer.max_steps:
            print(
                f"step {rec['step']}/{trainer.max_steps} | loss {loss:.5f} | tokens/s {rec['tokens_per_s']:.0f} | "
                f"step {dt:.2f} s | elapsed {rec['elapsed_s']:.1f} s"
                + (f" | {self.extra.summary()}" if self.extra is not None else ""),
                flush=True,
            )


def _unwrapped_named_parameters(pl_module: Any) -> dict:
    module = pl_module.module if hasattr(pl_module, "module") else pl_module
    while hasattr(module, "module"):
        module = module.module
    return {n: p.detach().float().cpu().clone() for n, p in module.named_parameters()}


class SaveFinalParameters(pl.Callback):
    """The metrics rank saves ``{"initial": {name: tensor}, "final": {name: tensor}}`` of the (unwrapped) Megatron
    model -- at the start and at the end of training -- to ``path`` (used by the parity tests; TP=PP=1 only, where
    every rank holds all parameters)."""

    def __init__(self, path: str) -> None:
        self.path = path
        self._initial: Optional[dict] = None

    def on_train_start(self, trainer: pl.Trainer, pl_module: Any) -> None:
        if _is_metrics_rank():
            self._initial = _unwrapped_named_parameters(pl_module)

    def on_train_end(self, trainer: pl.Trainer, pl_module: Any) -> None:
        if not _is_metrics_rank():
            return
        os.makedirs(os.path.dirname(self.path) or ".", exist_ok=True)
        torch.save({"initial": self._initial, "final": _unwrapped_named_parameters(pl_module)}, self.path)


class VerifyLongContextAttention(pl.Callback):
    """At fit start, fail if any built attention layer does not run nemo_longctx attention with the configured CP
    size and algorithm (``validation.built_attention_problems``): CP must never be disabled silently."""

    def __init__(self, cp_size: int, cp_algorithm: str, pp: int = 1) -> None:
        self.cp_size, self.cp_algorithm, self.pp = int(cp_size), str(cp_algorithm), int(pp)

    def on_fit_start(self, trainer: pl.Trainer, pl_module: Any) -> None:
        from nemo_longctx.integrations.megatron.validation import built_attention_problems

        problems = built_attention_problems(pl_module, self.cp_size, self.cp_algorithm, self.pp)
        if problems:
            raise RuntimeError("the built model does not use nemo_longctx attention as configured:\n  - "
                               + "\n  - ".join(problems))
