"""``process_exit.exit_process`` ends a process that holds an idle thread pool made at import and never shut down
(torch's ``torch.utils._functools`` prefetch executor, whose worker a ``torch.compile``'d function starts: GPT-OSS's
activation): it runs the threading-atexit callbacks, where the pool tells its workers to end, before it waits for
non-daemon threads, as the interpreter's own exit does (waiting without them never returned: a Bridge GPT-OSS rank
hung after its last step)."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]

SCRIPT = """
import concurrent.futures, sys, time, types
sys.modules.setdefault("megatron.core", types.ModuleType("megatron.core"))  # the os._exit path, without Megatron
from nemo_longctx.shared.process_exit import exit_process
pool = concurrent.futures.ThreadPoolExecutor(max_workers=2)  # made once, never shut down
pool.submit(time.sleep, 0.05).result()  # its worker thread now waits for work
print("last line", flush=True)
exit_process(3)
"""


def test_exit_process_ends_with_an_idle_import_time_thread_pool():
    p = subprocess.run([sys.executable, "-c", SCRIPT], capture_output=True, text=True, timeout=60, cwd=ROOT,
                       env={"PYTHONPATH": str(ROOT), "PATH": "/usr/bin:/bin"})
    assert p.returncode == 3 and p.stdout == "last line\n", (p.returncode, p.stdout, p.stderr[-2000:])
