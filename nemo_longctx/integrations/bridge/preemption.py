"""Save on signal for the Megatron-Bridge front end: Bridge's own exit-signal handling, with what it lacks added.

Bridge already has the mechanism (``train.exit_signal_handler``): ``GlobalState`` installs a
``DistributedSignalHandler`` for one signal (``train.exit_signal``), ``checkpoint_and_decide_exit`` all-gathers its
flag after every step (one collective; CPU tensors under gloo), saves with ``save_checkpoint_and_time`` when
``checkpoint.save`` is set, and leaves the loop; ``train`` then finishes every asynchronous save (``blocking=True``)
and ends with ``sys.exit(0)``. The same keys as the NeMo 2 app map onto it:

``checkpoint.on_signal``  -> ``train.exit_signal_handler`` (null: true whenever ``checkpoint.save`` is set; Bridge's
    own key, given as a Bridge override, is honoured the same way; the two may not disagree).
``run.signals``          -> every one of them is latched (``signals.SignalLatch``) and relayed to Bridge's handler, so
    that SIGTERM and SIGUSR1 both work although Bridge listens for one (``train.exit_signal``: the first of
    ``run.signals`` unless given); the latch also makes a second signal stop the rank at once (Bridge's handler would
    swallow it) and a signal that came before training starts count at the first step.
``run.signal_grace_s``   -> the local launcher's grace, as on the NeMo 2 app.

What is added after Bridge's save: the save is timed (from the end of the step to Bridge's ``on_checkpoint_save``,
which fires on every rank after the tracker file is written and every rank passed a barrier; there one more
all-gather of Bridge's flag, per save, tells every rank alike that this was the signal's save), the rank ignores
further signals from then on, rank 0 prints ``signals.preempted_line`` and the rank exits with
``signals.PREEMPTED_EXIT`` instead of Bridge's 0 -- unless the signal's save was the last step's (the run is
finished: exit 0).
"""

from __future__ import annotations

import signal
import time
from typing import Any, List, Optional, Sequence, Tuple

from nemo_longctx.shared.signals import SignalLatch, preempted_line, signals_of, slow_save_warning


def _user_handler(container: Any, keys: Sequence[str]) -> Optional[bool]:
    """Bridge's own ``train.exit_signal_handler`` when the user's overrides set it, else None."""
    return bool(container.train.exit_signal_handler) if "train.exit_signal_handler" in keys else None


def on_signal_problems(container: Any, on_signal: Optional[bool], keys: Sequence[str]) -> List[str]:
    """The save-on-signal settings that cannot work, each naming its key (``keys``: those the Bridge overrides set)."""
    user = _user_handler(container, keys)
    if on_signal is not None and user is not None and on_signal != user:
        return [f"checkpoint.on_signal={str(on_signal).lower()} and Bridge's train.exit_signal_handler="
                f"{str(user).lower()} disagree: give one of them (checkpoint.on_signal is mapped onto "
                "train.exit_signal_handler)"]
    asked = on_signal if on_signal is not None else user
    if asked and container.checkpoint.save is None:
        key = "checkpoint.on_signal" if on_signal is not None else "train.exit_signal_handler"
        return [f"{key}=true needs checkpoint.save=<dir>: the run saves no checkpoints, so a signal would stop it "
                "with nothing saved"]
    return []


def apply_on_signal(container: Any, on_signal: Optional[bool], run_signals: Sequence[str],
                    keys: Sequence[str]) -> None:
    """Set Bridge's exit-signal keys on ``container`` from ours: ``train.exit_signal_handler`` from
    ``checkpoint.on_signal`` (null: Bridge's own key when the overrides set it, else whether ``checkpoint.save`` is
    set) and ``train.exit_signal`` to the first of ``run.signals`` unless the overrides give it."""
    user = _user_handler(container, keys)
    on = on_signal if on_signal is not None else (user if user is not None else container.checkpoint.save is not None)
    container.train.exit_signal_handler = bool(on)
    if on and "train.exit_signal" not in keys:
        container.train.exit_signal = signals_of(run_signals)[0]


def latched_signals(container: Any, run_signals: Sequence[str]) -> Tuple[signal.Signals, ...]:
    """The signals the ranks latch and the local launcher forwards: ``run.signals`` and Bridge's
    ``train.exit_signal`` (empty: no save on signal)."""
    if not container.train.exit_signal_handler:
        return ()
    ours, bridge = signals_of(run_signals), signal.Signals(container.train.exit_signal)
    return ours + ((bridge,) if bridge not in ours else ())


def save_time_warning(container: Any, grace_s: float) -> Optional[str]:
    """The start-up warning when the planner's estimate of one save of the container's model exceeds the grace."""
    from nemo_longctx.planner.search import save_time_warning as estimated

    m = container.model
    fields = {k: v for k, v in vars(m).items() if v is None or isinstance(v, (bool, int, float, str))}
    return estimated(fields, 2 if (getattr(m, "bf16", False) or getattr(m, "fp16", False)) else 4, grace_s)


class SaveOnSignal:
    """The rank's side (``install`` before Bridge's ``pretrain``; ``callback()`` in its callbacks; ``outcome``
    after it)."""

    def __init__(self, signals: Sequence[int], exit_signal: int, grace_s: float, save_dir: str) -> None:
        self.exit_signal, self.grace_s, self.save_dir = signal.Signals(exit_signal), float(grace_s), save_dir
        self.latch = SignalLatch(signals, on_first=self._relay)
        self.bridge_handler: Any = None
        self.step_end = time.perf_counter()
        self.saved: Optional[Tuple[int, float]] = None  # (step, seconds) of the save after the signal

    def install(self) -> "SaveOnSignal":
        self.latch.install()
        return self

    def _relay(self, sig: signal.Signals, frame: Any) -> None:
        if callable(self.bridge_handler):
            self.bridge_handler(int(sig), frame)

    def callback(self) -> Any:
        from megatron.bridge.training.callbacks import Callback

        outer = self

        class _SaveOnSignal(Callback):
            def on_train_start(self, context: Any) -> None:
                # Bridge's handler replaced the latch's for train.exit_signal when the config was set: take the
                # signal back and relay to Bridge's handler (also a signal that came before training started)
                outer.bridge_handler = outer.latch.retake(outer.exit_signal)
                if outer.latch.received is not None:
                    outer._relay(outer.latch.received, None)

            def on_train_step_end(self, context: Any) -> None:
                outer.step_end = time.perf_counter()  # Bridge's checkpoint_and_decide_exit comes next

            def on_checkpoint_save(self, context: Any) -> None:
                # fired on every rank once the save is complete (tracker written, barrier passed): Bridge's own
                # all-gather of its handler's flag says whether this is the signal's save, the same on every rank
                # (also for a rank that got no signal itself, or got Bridge's signal before training started)
                if any(context.state.signal_handler.signals_received()):
                    outer.saved = (int(context.state.train_state.step), time.perf_counter() - outer.step_end)
                    outer.latch.mark_saved()  # a launcher's stop signal cannot turn the exit into a death now

        return _SaveOnSignal()

    def outcome(self, train_iters: int, rank: int) -> int:
        """After Bridge's ``pretrain`` stopped (its ``sys.exit(0)`` after a signal): ``PREEMPTED_EXIT`` when a signal's
        checkpoint was saved before the last step (rank 0 prints ``preempted_line``), else 0."""
        from nemo_longctx.shared.signals import PREEMPTED_EXIT

        if self.saved is None or self.saved[0] >= int(train_iters):
            self.latch.uninstall()
            return 0
        self.latch.keep_ignoring()  # Bridge's teardown put back the handlers it found
        step, seconds = self.saved
        if rank == 0:
            from megatron.bridge.training.utils.checkpoint_utils import get_checkpoint_name

            print(preempted_line(step, get_checkpoint_name(self.save_dir, step), seconds), flush=True)
            warning = slow_save_warning(seconds, self.grace_s, "the preemption save")
            if warning:
                print(warning, flush=True)
        return PREEMPTED_EXIT
