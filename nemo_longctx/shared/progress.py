"""Progress of the long preparations that run before training (tokenizing ``data=documents``, Hugging Face import and
export), and of the ranks that wait for them.

Everything goes to stderr. On a terminal (stderr is a tty) a tqdm bar; in a batch log a plain line every
``every_s`` seconds (30) or each further tenth of the total, whichever comes first (none in the first 5 s):

    nemo-longctx: data=documents: tokenizing: 45% of 12.3 GiB, 120,400 documents, 310,112,000 tokens,
    52,310 tokens/s, eta 3m10s

``Progress(what, total, ...)``     ``update(n, **counts)`` as the work advances (``n``: in the total's unit),
                                   ``close()`` at the end;
``watch_directory(what, path)``    a context manager: the bytes written under ``path`` while the block runs (a
                                   conversion whose own progress is not visible: no total, no percentage);
``wait_for(ready, what, ...)``     a rank waiting for rank 0: one line when it starts waiting, a reminder every
                                   ``remind_s``, TimeoutError after ``timeout_s``.

tqdm (a dependency of transformers, Lightning and NeMo) is imported lazily; without it the plain lines are used.
"""

from __future__ import annotations

import contextlib
import sys
import threading
import time
from typing import Any, Callable, Dict, Iterator, Optional, TextIO

from nemo_longctx.shared.console import human_bytes, human_duration
from nemo_longctx.shared.path_checks import tree_bytes

PREFIX = "nemo-longctx: "
EVERY_S = 30.0          # a plain line at least this often ...
EVERY_FRACTION = 0.1    # ... or each time another tenth of the total is done
QUIET_S = 5.0           # no plain line in the first seconds (a small input is done before it would matter)
REMIND_S = 300.0        # a waiting rank's reminder


def is_tty(stream: Any) -> bool:
    try:
        return bool(stream.isatty())
    except (AttributeError, ValueError):
        return False


def _tqdm() -> Any:
    try:
        from tqdm import tqdm
    except ImportError:
        return None
    return tqdm


class Progress:
    """One preparation's progress (see the module docstring). ``unit``: "B" shows the amounts as bytes;
    ``rate_of``: the count whose rate the plain line shows (default: the total's unit); ``stream``: where it goes
    (default ``sys.stderr``); ``tty``: force the bar (True) or the plain lines (False); ``every_s``,
    ``every_fraction``, ``quiet_s``: the plain lines' spacing (defaults: the module's constants)."""

    def __init__(self, what: str, total: Optional[float] = None, unit: str = "", *, rate_of: Optional[str] = None,
                 stream: Optional[TextIO] = None, tty: Optional[bool] = None, every_s: Optional[float] = None,
                 every_fraction: Optional[float] = None, quiet_s: Optional[float] = None) -> None:
        self.what, self.total, self.unit, self.rate_of = what, total, unit, rate_of
        self.quiet_s = QUIET_S if quiet_s is None else float(quiet_s)
        self.stream = stream if stream is not None else sys.stderr
        self.every_s = EVERY_S if every_s is None else float(every_s)
        self.every_fraction = EVERY_FRACTION if every_fraction is None else float(every_fraction)
        self.done = 0.0
        self.counts: Dict[str, int] = {}
        self.lines = 0  # plain lines printed
        self._t0 = self._last_line = time.monotonic()
        self._last_tenth = 0
        self._last_postfix = 0.0
        tqdm = _tqdm() if (is_tty(self.stream) if tty is None else tty) else None
        self._bar = None
        if tqdm is not None:
            self._bar = tqdm(total=total, desc=what, unit=unit or "it", unit_scale=unit == "B",
                             unit_divisor=1024 if unit == "B" else 1000, file=self.stream, dynamic_ncols=True,
                             leave=True)

    # ------------------------------------------------------------------------------------------------------------
    def update(self, n: float = 0, **counts: int) -> None:
        self.done += n
        for k, v in counts.items():
            self.counts[k] = self.counts.get(k, 0) + int(v)
        now = time.monotonic()
        if self._bar is not None:
            self._bar.update(n)
            if self.counts and now - self._last_postfix >= 0.5:
                self._bar.set_postfix({k: f"{v:,}" for k, v in self.counts.items()}, refresh=False)
                self._last_postfix = now
            return
        if now - self._t0 >= self.quiet_s and (now - self._last_line >= self.every_s or
                                               self._tenth() > self._last_tenth):
            self._line(now)

    def _tenth(self) -> int:
        """How many ``every_fraction`` marks the work has passed (the last one, done, is not one)."""
        if not self.total or self.every_fraction <= 0:
            return 0
        if self.done >= self.total:
            return self._last_tenth
        return int(self.done / self.total / self.every_fraction + 1e-9)

    def set(self, done: float) -> None:
        """The amount done so far (instead of an increment)."""
        self.update(done - self.done)

    def _line(self, now: float) -> None:
        self._last_line, self._last_tenth = now, self._tenth()
        print(PREFIX + self.describe(now), file=self.stream, flush=True)
        self.lines += 1

    def describe(self, now: Optional[float] = None) -> str:
        """The plain line's text (without the prefix)."""
        elapsed = (time.monotonic() if now is None else now) - self._t0
        amount = (lambda v: human_bytes(v)) if self.unit == "B" else (lambda v: f"{v:,.0f}" +
                                                                      (f" {self.unit}" if self.unit else ""))
        parts = []
        if self.total:
            parts.append(f"{100 * self.done / self.total:.0f}% of {amount(self.total)}")
        else:
            parts.append(f"{amount(self.done)} after {human_duration(elapsed)}")
        parts += [f"{v:,} {k}" for k, v in self.counts.items()]
        if elapsed > 0:
            if self.rate_of in self.counts:
                parts.append(f"{self.counts[self.rate_of] / elapsed:,.0f} {self.rate_of}/s")
            elif self.unit == "B":
                parts.append(f"{human_bytes(self.done / elapsed)}/s")
        if self.total and self.done > 0 and elapsed > 0:
            parts.append(f"eta {human_duration((self.total - self.done) * elapsed / self.done)}")
        return f"{self.what}: " + ", ".join(parts)

    def close(self) -> None:
        if self._bar is not None:
            if self.counts:
                self._bar.set_postfix({k: f"{v:,}" for k, v in self.counts.items()}, refresh=False)
            self._bar.close()
            self._bar = None

    def __enter__(self) -> "Progress":
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()


@contextlib.contextmanager
def watch_directory(what: str, path: str, *, stream: Optional[TextIO] = None, tty: Optional[bool] = None,
                    every_s: Optional[float] = None) -> Iterator[Progress]:
    """While the block runs: the bytes written under ``path`` (polled by a daemon thread: every second for the bar,
    every ``every_s`` for the plain lines)."""
    progress = Progress(what, None, "B", stream=stream, tty=tty, every_s=every_s, quiet_s=every_s)
    stop = threading.Event()
    poll = 1.0 if progress._bar is not None else min(5.0, progress.every_s)

    def watch() -> None:
        while not stop.wait(poll):
            progress.set(tree_bytes(path))

    thread = threading.Thread(target=watch, name="nemo-longctx-progress", daemon=True)
    thread.start()
    try:
        yield progress
    finally:
        stop.set()
        thread.join(timeout=5)
        progress.close()


def speaks_for_node(rank: int, local_rank: Optional[int]) -> bool:
    """The waiting rank that prints for its node: local rank 0, or local rank 1 on rank 0's node (rank 0 does the
    work); every waiting rank when the local rank is not known."""
    return local_rank is None or local_rank == 0 or rank == local_rank == 1


def wait_for(ready: Callable[[], bool], what: str, *, rank: int, local_rank: Optional[int] = None,
             timeout_s: float = 3600, poll_s: float = 2.0, remind_s: Optional[float] = None,
             stream: Optional[TextIO] = None) -> None:
    """Wait until ``ready()`` (rank 0 is doing ``what``, e.g. "tokenize the documents into <dir>"), saying so:
    ``rank R: waiting for rank 0 to <what>`` once, ``rank R: still waiting ... (10m00s so far, up to 1h00m)`` every
    ``remind_s`` (one rank per node speaks: ``speaks_for_node``). TimeoutError after ``timeout_s``."""
    if ready():
        return
    stream = stream if stream is not None else sys.stderr
    remind_s = REMIND_S if remind_s is None else float(remind_s)
    loud = speaks_for_node(rank, local_rank)
    if loud:
        print(f"{PREFIX}rank {rank}: waiting for rank 0 to {what}", file=stream, flush=True)
    t0 = last = time.monotonic()
    while not ready():
        now = time.monotonic()
        if now - t0 > timeout_s:
            raise TimeoutError(f"rank {rank}: rank 0 did not {what} within {human_duration(timeout_s)}")
        if loud and now - last >= remind_s:
            print(f"{PREFIX}rank {rank}: still waiting for rank 0 to {what} ({human_duration(now - t0)} so far, up to "
                  f"{human_duration(timeout_s)})", file=stream, flush=True)
            last = now
        time.sleep(poll_s)
