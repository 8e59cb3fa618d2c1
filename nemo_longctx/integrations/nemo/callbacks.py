"""Lightning callbacks of the Hydra app.

``StepMetrics``: after every optimizer step, on the one rank that owns the reduced loss (last pipeline stage, TP
rank 0, data+context-parallel rank 0), prints ``step N/M | loss L | tokens/s T | step S s | elapsed E s | eta 3h12m
| mfu 38.5%`` and appends one JSON object per step to ``<output_dir>/metrics.jsonl``: step, loss (NeMo's
MaskedTokenLossReduction: token-weighted mean over the global batch, all-reduced over the data- and context-parallel
ranks), tokens_per_s (global tokens of the step / step wall time), step_time_s, elapsed_s, tokens (global tokens of
the step), cp_size, world_size, eta_s (remaining steps x the median wall time between the last ``ETA_WINDOW`` step
ends of this process: from its second step on), balance (max / mean predicted attention cost over the data- and
context-parallel ranks for the step's micro-batches: 1.0 is perfect; ``step_balance_over_ranks``), mfu (model FLOPs
per token x tokens/s / the dense peak of every device, ``planner.flops``: only on a named GPU at bf16/fp16 and for a
dense model the formula describes), plus what ``extra.metrics()`` returns (the app passes
``ActivationMemoryMetrics``: activation_bytes_device, activation_bytes_host, peak_bytes of this rank), with
``extra.summary()`` appended to the printed line. The same scalars go to the trainer's loggers as ``train/<key>``
(TensorBoard). After each validation run a row ``{"step", "val_loss"}`` is appended (NeMo's ``val_loss``, reduced
over CP like the training loss). A resumed run keeps the rows up to the restored step; a fresh run first moves the
previous run's file to ``<output_dir>/runs/run_<N>/metrics.jsonl`` (``console.archive_metrics``)."""

from __future__ import annotations

import json
import os
import time
from collections import deque
from typing import Any, Optional

import lightning.pytorch as pl

from nemo_longctx.integrations.megatron.batch import (  # noqa: F401  (step_balance_over_ranks: re-exported)
    LAST_SHARD, STEP_COSTS, reset_step_costs, step_balance_over_ranks)
from nemo_longctx.integrations.megatron.run_guards import (StepBytes, core_attentions, cp_problems, loss_problems,
                                                           mfu_problems, raise_if, tokens_problems)
from nemo_longctx.planner.flops import mfu, model_flops_per_token, peak_flops
from nemo_longctx.shared.app_keys import FAULT_KINDS, parse_fault
from nemo_longctx.shared.console import archive_metrics, eta_seconds, step_line
from nemo_longctx.shared.launch import inject_fault
import torch


def _is_metrics_rank() -> bool:
    from megatron.core import parallel_state as ps

    return (
        ps.is_pipeline_last_stage()
        and ps.get_tensor_model_parallel_rank() == 0
        and ps.get_data_parallel_rank(with_context_parallel=True) == 0
    )


def device_peak_flops(trainer: Any) -> Optional[float]:
    """The dense peak FLOP/s of this rank's device at the trainer's precision (``planner.flops.peak_flops``); None on
    a CPU, an unknown GPU or an fp32 run."""
    device = getattr(trainer.strategy, "root_device", None)
    if device is None or device.type != "cuda":
        return None
    return peak_flops(torch.cuda.get_device_name(device), str(trainer.precision))


class StepMetrics(pl.Callback):
    ETA_WINDOW = 20  # step-end intervals the ETA's median is taken over

    def __init__(self, output_dir: str, tokens_per_step: int, print_every: int = 1, extra: Any = None,
                 balance: bool = True) -> None:
        self.output_dir = output_dir
        # whether each step's ``balance`` is computed (a collective over the data-parallel ranks): a run whose data are
        # dense has no document costs to compare (the app passes whether its data are packed documents; a recipe's
        # data module is not read, so there it stays on)
        self.balance = bool(balance)
        self.extra = extra  # object with metrics() -> dict (merged into each record) and summary() -> str (printed)
        self.tokens_per_step = int(tokens_per_step)
        self.print_every = max(1, int(print_every))
        self.path = os.path.join(output_dir, "metrics.jsonl")
        self._t0: Optional[float] = None
        self._step_start = 0.0
        self._active = False
        self._last_end: Optional[float] = None  # the previous step's end (this process): the ETA's intervals
        self._intervals: deque = deque(maxlen=self.ETA_WINDOW)
        self._flops_per_token: Optional[float] = None
        self._peak: Optional[float] = None

    def on_train_start(self, trainer: pl.Trainer, pl_module: Any) -> None:
        self._active = _is_metrics_rank()
        if self._active:
            os.makedirs(self.output_dir, exist_ok=True)
            step = int(trainer.global_step)
            if step == 0:  # a fresh run: the previous run's metrics move to runs/run_<N>/ (this is the only process
                moved = archive_metrics(self.output_dir)  # that writes the file, under every launcher)
                if moved:
                    print(f"nemo-longctx: the previous run's metrics.jsonl moved to {moved}", flush=True)
            else:
                source = getattr(trainer, "ckpt_path", None)
                print(f"nemo-longctx: resumed at step {step}" + (f" from {source}" if source else "")
                      + f": {self.path} keeps the rows up to step {step}", flush=True)
            self._keep_rows_up_to(step)
            self._flops_per_token = model_flops_per_token(getattr(pl_module, "config", None))
            self._peak = device_peak_flops(trainer)
        self._t0 = time.perf_counter()

    def _keep_rows_up_to(self, step: int) -> None:
        """A fresh run starts an empty file (the previous one was moved to ``runs/run_<N>/`` by ``on_train_start``);
        a resumed one (restored at ``step``) keeps the rows of steps <= step, so the file reads as one run."""
        rows = []
        if step > 0 and os.path.exists(self.path):
            with open(self.path) as f:
                rows = [ln for ln in f if ln.strip() and json.loads(ln).get("step", 0) <= step]
        with open(self.path, "w") as f:
            f.writelines(rows)

    def _log(self, trainer: pl.Trainer, metrics: dict, step: int) -> None:
        """Scalars to the trainer's loggers (TensorBoard through NeMoLogger) as well."""
        scalars = {k: float(v) for k, v in metrics.items() if isinstance(v, (int, float)) and v is not None}
        for logger in trainer.loggers:
            logger.log_metrics(scalars, step=step)

    def on_validation_end(self, trainer: pl.Trainer, pl_module: Any) -> None:
        if not self._active or trainer.sanity_checking or "val_loss" not in trainer.callback_metrics:
            return
        rec = {"step": int(trainer.global_step), "val_loss": float(trainer.callback_metrics["val_loss"])}
        with open(self.path, "a") as f:
            f.write(json.dumps(rec) + "\n")
        print(f"validation at step {rec['step']} | val_loss {rec['val_loss']:.5f}", flush=True)

    def on_train_batch_start(self, trainer: pl.Trainer, pl_module: Any, batch: Any, batch_idx: int) -> None:
        self._step_start = time.perf_counter()
        reset_step_costs()

    def on_train_batch_end(self, trainer: pl.Trainer, pl_module: Any, outputs: Any, batch: Any, batch_idx: int) -> None:
        # (a collective: every rank, before the metrics rank alone goes on)
        balance = step_balance_over_ranks() if self.balance else None
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
        if self._last_end is not None:  # the first step of this process (start-up, warm-up) is left out
            self._intervals.append(now - self._last_end)
        self._last_end = now
        eta = eta_seconds(self._intervals, int(trainer.max_steps) - rec["step"])
        if eta is not None:
            rec["eta_s"] = eta
        utilisation = mfu(self._flops_per_token, rec["tokens_per_s"], self._peak, rec["world_size"])
        if utilisation is not None:
            rec["mfu"] = utilisation
        if balance is not None:
            rec["balance"] = balance
        # finite loss; MFU <= 100 % (from the second step: the first one's time includes start-up)
        raise_if(loss_problems(loss, rec["step"]) + mfu_problems(utilisation if len(self._intervals) else None,
                                                                 rec["step"]))
        if self.extra is not None:
            rec.update(self.extra.metrics())
        with open(self.path, "a") as f:
            f.write(json.dumps(rec) + "\n")
        self._log(trainer, {f"train/{k}": v for k, v in rec.items() if k not in ("step", "cp_size", "world_size")},
                  rec["step"])
        if rec["step"] % self.print_every == 0 or rec["step"] == trainer.max_steps:
            print(step_line(rec, int(trainer.max_steps), self.extra.summary() if self.extra is not None else None),
                  flush=True)


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


class RunGuards(pl.Callback):
    """The run guards every rank checks (``integrations.megatron.run_guards``) at step 0 and every ``every``-th step:
    context parallelism really active (the attention over the run's CP group, covering the whole sequence, bytes
    sent) and the tokens the step trained against the layout. ``StepMetrics`` checks the loss and the MFU."""

    def __init__(self, cp_size: int, tokens_per_step: int, every: int = 1) -> None:
        self.cp_size, self.tokens_per_step, self.every = int(cp_size), int(tokens_per_step), max(1, int(every))
        self._bytes = StepBytes()
        self._attentions: list = []

    def on_train_start(self, trainer: pl.Trainer, pl_module: Any) -> None:
        self._attentions = core_attentions(pl_module)

    def on_train_batch_start(self, trainer: pl.Trainer, pl_module: Any, batch: Any, batch_idx: int) -> None:
        step = int(trainer.global_step)
        if step == 0 or step % self.every == 0:
            LAST_SHARD.update(sequence_tokens=None, local_tokens=None)
            self._bytes.start()

    def on_train_batch_end(self, trainer: pl.Trainer, pl_module: Any, outputs: Any, batch: Any, batch_idx: int) -> None:
        sent = self._bytes.stop()
        if sent is None:  # not a checked step
            return
        from megatron.core import parallel_state as ps
        from megatron.core.num_microbatches_calculator import get_num_microbatches

        step = int(trainer.global_step) - 1  # (Lightning has counted the step already)
        dp_cp = ps.get_data_parallel_world_size(with_context_parallel=True)
        traffic = STEP_COSTS["split"] if STEP_COSTS["costs"] is not None else True
        raise_if(cp_problems(self._attentions, self.cp_size, LAST_SHARD["sequence_tokens"], sent, step, traffic)
                 + tokens_problems(LAST_SHARD["local_tokens"], get_num_microbatches(), dp_cp, self.tokens_per_step,
                                   step))


class DocumentPlacementPolicy(pl.Callback):
    """Document-aware CP (``cp.split_min_tokens``) for runs whose data step is ours but whose build is not the app's
    (NeMo-Run recipes): at setup, on every rank, the data step's placement policy with the cost model of the model's
    config (``batch.set_document_placement``)."""

    def __init__(self, split_min_tokens: Any) -> None:
        self.split_min_tokens = split_min_tokens

    def setup(self, trainer: pl.Trainer, pl_module: Any, stage: str) -> None:
        from nemo_longctx.integrations.megatron.batch import cost_model_of, set_document_placement

        config = getattr(pl_module, "config", None)
        set_document_placement(self.split_min_tokens, cost_model_of(config) if config is not None else None)


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


class ConfigConsensus(pl.Callback):
    """Every rank must train the configuration the launcher validated, and all ranks the same one.

    At ``setup`` (the process group exists, nothing is built yet) each rank compares the hash of its resolved config
    with ``expected`` (what the local launcher computed, when it started the ranks) and with every other rank's (one
    ``all_gather_object``). Any difference raises on every rank, naming the ranks that differ."""

    def __init__(self, config_hash: str, expected: Optional[str] = None) -> None:
        self.config_hash, self.expected = str(config_hash), expected

    def setup(self, trainer: pl.Trainer, pl_module: Any, stage: str) -> None:
        if self.expected and self.expected != self.config_hash:
            raise RuntimeError(
                f"rank {trainer.global_rank} resolved a different config (hash {self.config_hash[:12]}) than the "
                f"launcher validated ({self.expected[:12]}): refusing to train"
            )
        if not torch.distributed.is_initialized() or torch.distributed.get_world_size() == 1:
            return
        hashes: list = [None] * torch.distributed.get_world_size()
        torch.distributed.all_gather_object(hashes, self.config_hash)
        if len(set(hashes)) > 1:
            groups: dict = {}
            for rank, h in enumerate(hashes):
                groups.setdefault(h[:12], []).append(rank)
            raise RuntimeError(f"the ranks resolved different configs (config hash -> ranks: {groups}): refusing to "
                               "train; pass the same config files and overrides to every rank")


class FaultInjection(pl.Callback):
    """Failure drills (``run.fault=KIND@STEP:RANK``): at the start of training step STEP (1-based) global rank RANK
    raises (``raise``), kills itself with SIGKILL (``kill``) or hangs (``hang``). Used by the tests of the launcher,
    the collective timeout and resume after a failure."""

    KINDS = FAULT_KINDS

    def __init__(self, kind: str, step: int, rank: int) -> None:
        self.kind, self.step, self.rank = kind, int(step), int(rank)

    @classmethod
    def parse(cls, spec: str) -> "FaultInjection":
        """From ``run.fault`` (checked with the config: ``app_keys.parse_fault``)."""
        return cls(*parse_fault(spec))

    def on_train_batch_start(self, trainer: pl.Trainer, pl_module: Any, batch: Any, batch_idx: int) -> None:
        if trainer.global_step + 1 != self.step or trainer.global_rank != self.rank:
            return
        inject_fault(self.kind, self.step, self.rank)
