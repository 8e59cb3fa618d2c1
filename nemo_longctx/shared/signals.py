"""Preemption signals, the same for every front end and launcher (standard library only).

A run that saves checkpoints treats the signals of ``run.signals`` (default SIGTERM and SIGUSR1: Slurm's
``--signal=B:USR1@<grace>`` and plain ``scancel``/``kill``) as "save and stop": each rank latches the first one
(``SignalLatch``), the ranks agree at the next step boundary (one small collective per step, done by the front
end), save a complete checkpoint of that step, print ``preempted_line`` and exit with ``PREEMPTED_EXIT``. A second
signal restores the default action and delivers itself again: the process stops at once. The local launcher
forwards the first signal to its ranks and gives them ``run.signal_grace_s`` seconds (``launch.launch_local``).
"""

from __future__ import annotations

import os
import signal
from typing import Callable, Dict, Iterable, Optional, Tuple

PREEMPTED_EXIT = 75  # EX_TEMPFAIL (sysexits.h): stopped by a signal after saving; run the same command again
SIGNAL_NAMES = ("SIGTERM", "SIGUSR1", "SIGUSR2", "SIGINT", "SIGHUP")
DEFAULT_SIGNALS = ("SIGTERM", "SIGUSR1", "SIGINT")  # SIGINT: Ctrl-C saves too, when the run saves
DEFAULT_GRACE_S = 120.0


def signals_of(names: Iterable[str]) -> Tuple[signal.Signals, ...]:
    """``["SIGTERM", "SIGUSR1"]`` -> the signals (names checked by the option model: ``run.signals``)."""
    return tuple(signal.Signals[str(n)] for n in names)


class SignalLatch:
    """Remembers the first of ``signals`` this process receives instead of dying of it; a second one (any of them)
    puts the default action back and delivers itself again, so the process stops at once -- until the checkpoint is
    saved (``mark_saved``). ``on_first(signal, frame)``, if given, runs in the handler of the first signal (a
    framework's own flag to set, e.g. Megatron-Bridge's exit-signal handler)."""

    def __init__(self, signals: Iterable[int],
                 on_first: Optional[Callable[[signal.Signals, object], None]] = None) -> None:
        self.signals = tuple(signal.Signals(s) for s in signals)
        self.received: Optional[signal.Signals] = None
        self.saved = False
        self.on_first = on_first
        self._previous: Dict[signal.Signals, object] = {}

    def mark_saved(self) -> None:
        """The checkpoint is complete and the process is on its way out with ``PREEMPTED_EXIT``: from now on the
        signals are ignored, so that a launcher stopping the other ranks (srun --kill-on-bad-exit, torch's agent)
        cannot turn this rank's exit code into a death by signal. SIGKILL still ends it."""
        self.saved = True
        self.keep_ignoring()

    def keep_ignoring(self) -> None:
        """Ignore the signals at the OS level (again: a framework's teardown may have restored its own earlier
        handlers, e.g. Lightning's signal connector at the end of ``fit``)."""
        for s in self.signals:
            signal.signal(s, signal.SIG_IGN)

    def install(self) -> "SignalLatch":
        for s in self.signals:
            if s not in self._previous:
                self._previous[s] = signal.signal(s, self._handle)
        return self

    def retake(self, sig: int) -> object:
        """Handle ``sig`` again after a framework installed its own handler over this latch's; returns that handler."""
        return signal.signal(signal.Signals(sig), self._handle)

    def uninstall(self) -> None:
        if self.saved:
            return  # keep ignoring until the process exits
        for s, previous in self._previous.items():
            signal.signal(s, previous)  # type: ignore[arg-type]
        self._previous.clear()

    def _handle(self, signum: int, frame: object) -> None:
        if self.saved:
            return
        if self.received is None:
            self.received = signal.Signals(signum)
            if self.on_first is not None:
                self.on_first(self.received, frame)
            return
        for s in self.signals:  # the second signal: stop now, as without the latch
            signal.signal(s, signal.SIG_DFL)
        self._previous.clear()
        os.kill(os.getpid(), signum)


def preempted_line(step: int, path: str, seconds: float) -> str:
    """The one line a preempted run prints (rank 0) once its checkpoint is complete on disk."""
    return f"nemo-longctx: preempted at step {step}, checkpoint {path} saved in {seconds:.1f} s"


def slow_save_warning(seconds: float, grace_s: float, what: str = "saving") -> Optional[str]:
    """A warning when ``seconds`` (measured or estimated) of ``what`` exceed the grace the launcher gives the
    ranks after a signal (``run.signal_grace_s``), else None."""
    if seconds <= grace_s:
        return None
    return (f"nemo-longctx: WARNING: {what} took {seconds:.0f} s, more than run.signal_grace_s={grace_s:g}: a "
            "preemption save may be cut off (raise run.signal_grace_s and the sbatch --signal=B:USR1@<grace>)")
