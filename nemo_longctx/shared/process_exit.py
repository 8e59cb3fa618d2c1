"""Ending a process that imported NeMo, Megatron or Megatron-Bridge without the interpreter's module teardown.

After ``import nemo.collections.llm`` a process holds ~800K objects; the interpreter's finalization (clearing every
module, running destructors) then takes 3.5-4 s on one CPU core -- measured here: the atexit handlers take 0.8 s of
the 4.3 s between the last statement and the process's end. Every rank of every run pays it at the end, and the
launcher waits for the slowest. ``exit_process(code)`` does what a normal exit does that can matter to the run --
runs the threading-atexit callbacks and waits for non-daemon threads (an async checkpoint writer, say), runs the
atexit handlers (logging's flush and close, Lightning's and NeMo's own), flushes stdout/stderr -- then ends the
process with ``os._exit(code)``, skipping only the teardown of module globals. Used by the apps' ranks (and their
single-process runs) after their work is done. In a rank the local launcher runs in a forked or spawned process
(``launch.run_rank``), the last step is ``SystemExit(code)`` instead: ``run_rank`` and multiprocessing then end the
process, likewise without the teardown (multiprocessing's children end with ``os._exit``).
"""

from __future__ import annotations

import atexit
import os
import sys
import threading

# libraries whose import makes the teardown slow; a process that imported none of them exits the normal way
_HEAVY = ("nemo.collections.llm", "megatron.core", "megatron.bridge")


def exit_process(code: int) -> None:
    """End this process with exit status ``code`` (never returns). Without NeMo/Megatron imported: ``sys.exit``."""
    if not any(name in sys.modules for name in _HEAVY):
        sys.exit(code)
    # what the interpreter's threading._shutdown does first: the threading-atexit callbacks -- concurrent.futures'
    # executors tell their idle workers to end there (a pool made at import, e.g. torch.utils._functools' prefetch
    # executor that torch.compile'd functions start; waiting for its workers without that waits forever) --
    for callback in reversed(list(getattr(threading, "_threading_atexits", ()))):
        callback()
    main = threading.main_thread()
    for thread in threading.enumerate():  # then it waits for non-daemon threads
        if thread is not main and not thread.daemon:
            thread.join()
    try:
        atexit._run_exitfuncs()  # noqa: SLF001 - the handlers a normal exit would run; they do not run again
    finally:
        for stream in (sys.stdout, sys.stderr):
            try:
                stream.flush()
            except (OSError, ValueError):  # a closed or broken stream: nothing left to flush
                pass
        if os.environ.get("NEMO_LONGCTX_FORKED_RANK") == "1":  # launch.FORKED_RANK_VAR (standard library only here)
            raise SystemExit(int(code))
        os._exit(int(code))
