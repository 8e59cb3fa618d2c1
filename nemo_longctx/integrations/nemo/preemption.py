"""Save on signal for the NeMo 2 app: NeMo's own ``PreemptionCallback``, extended where it does not fit.

NeMo's callback listens for one signal on global rank 0 only, broadcasts the flag on ``torch.cuda.current_device()``
(a CPU/gloo run cannot) and ends with ``sys.exit(0)`` from inside a Lightning hook. ``SaveOnSignal`` keeps its
structure (handler context from ``on_train_start``, one collective in ``interrupted`` at every step end, the save in
``on_train_batch_end`` through the ``ModelCheckpoint`` of the run) and changes:
  * every rank latches the signals of ``run.signals`` (``signals.SignalLatch``): under srun or the local launcher
    every rank receives the signal, and a second one stops the rank at once;
  * the flag is all-reduced (MAX) on the process group's device (CPU for gloo);
  * the checkpoint of that step is written and finished before anyone leaves (an asynchronous save is finalised
    with ``blocking=True``, then a barrier), timed, and reported with ``signals.preempted_line``;
  * the trainer stops normally (``should_stop``); the app then exits with ``signals.PREEMPTED_EXIT``.
"""

from __future__ import annotations

import contextlib
import time
from typing import Any, Optional, Sequence, Tuple

import torch
from nemo.lightning.pytorch.callbacks import PreemptionCallback

from nemo_longctx.shared.signals import SignalLatch, preempted_line, slow_save_warning


class SaveOnSignal(PreemptionCallback):
    def __init__(self, signals: Sequence[int], grace_s: float) -> None:
        super().__init__(sig=signals[0])
        self.latch = SignalLatch(signals)
        self.grace_s = float(grace_s)
        self.preempted: Optional[Tuple[int, str, float]] = None  # (step, checkpoint path, seconds to save)

    @contextlib.contextmanager
    def _preemption_handler(self):
        self.latch.install()
        try:
            yield
        finally:
            self.latch.uninstall()

    @property
    def interrupted(self) -> bool:
        """Whether any rank received a signal (one all-reduce of an int per step)."""
        mine = self.latch.received is not None
        if not self.preemption_supported:
            return mine
        dist = torch.distributed
        device = torch.device("cuda", torch.cuda.current_device()) if dist.get_backend() == "nccl" else "cpu"
        flag = torch.tensor([int(mine)], dtype=torch.int32, device=device)
        dist.all_reduce(flag, op=dist.ReduceOp.MAX)
        return bool(flag.item())

    def on_train_batch_end(self, trainer: Any, pl_module: Any, outputs: Any, batch: Any, batch_idx: int) -> None:
        if self.preempted is not None or not self.interrupted:
            return
        from nemo.lightning.ckpt_utils import ckpt_to_dir
        from nemo.utils.callbacks.dist_ckpt_io import AsyncFinalizableCheckpointIO

        ckpt = trainer.checkpoint_callback
        step = int(trainer.global_step)
        start = time.perf_counter()
        ckpt._save_last_checkpoint(trainer, ckpt._monitor_candidates(trainer))  # marks it unfinished until done
        io = trainer.strategy.checkpoint_io
        if isinstance(io, AsyncFinalizableCheckpointIO):
            io.maybe_finalize_save_checkpoint(blocking=True)  # nothing asynchronous is left unfinished
        if torch.distributed.is_initialized():
            torch.distributed.barrier()
        seconds = time.perf_counter() - start
        self.latch.mark_saved()
        path = str(ckpt_to_dir(ckpt.last_model_path))
        self.preempted = (step, path, seconds)
        trainer.should_stop = True  # the periodic save of this step is skipped: _last_global_step_saved == step
        if trainer.global_rank == 0:
            print(preempted_line(step, path, seconds), flush=True)
            warning = slow_save_warning(seconds, self.grace_s, "the preemption save")
            if warning:
                print(warning, flush=True)
