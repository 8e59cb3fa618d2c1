"""shared/collector.py: the collector paused at an app's entry, then one collection, the survivors frozen, on again."""

from __future__ import annotations

import subprocess
import sys

from app_runner import ROOT

PROBE = r"""
import gc, weakref
from nemo_longctx.shared import collector

class Node:
    pass

collector.resume()  # never paused: nothing happens
assert gc.isenabled() and gc.get_freeze_count() == 0
collector.pause()
assert not gc.isenabled()
a, b = Node(), Node()
a.other, b.other = b, a  # a reference cycle: only the collector frees it
dead = weakref.ref(a)
kept = [Node() for _ in range(1000)]
del a, b
assert dead() is not None  # paused: the cycle is still there
collector.resume()
assert gc.isenabled()
assert dead() is None, "the cycle made while paused was not freed"
assert gc.get_freeze_count() >= 1000, gc.get_freeze_count()  # the survivors (kept) are frozen
collector.resume()  # a second resume does nothing
assert gc.isenabled()
print("ok")
"""


def test_pause_then_resume_frees_the_garbage_made_meanwhile_and_freezes_the_rest():
    p = subprocess.run([sys.executable, "-c", PROBE], cwd=ROOT, capture_output=True, text=True, timeout=60)
    assert p.returncode == 0 and p.stdout.strip() == "ok", p.stdout + p.stderr
