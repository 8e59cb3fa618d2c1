"""The device benchmarks run on CPU in a reduced form: ring decomposition (per-rank block schedules assembled
back must equal the whole-sequence call) and offload overlap (bit-exact)."""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def _bench(script, *args):
    env = dict(os.environ, OMP_NUM_THREADS="1")
    return subprocess.run([sys.executable, str(ROOT / "bench" / script), *args], cwd=ROOT, env=env,
                          capture_output=True, text=True, timeout=600)


def test_ring_decomposition_reduced_form_is_exact():
    proc = _bench("ring_decomposition.py", "--cpu-small")
    assert proc.returncode == 0, proc.stdout + proc.stderr
    rows = re.findall(r"^\| (\d+) \| (\d+) \| (\w+) \|.*\| ([0-9.e+-]+) \|$", proc.stdout, re.M)
    assert [(s, p) for s, p, _, _ in rows] == [("512", "2"), ("512", "4")], proc.stdout
    for _, _, kernel, err in rows:
        assert kernel == "cpu_flash" and float(err) < 1e-5, proc.stdout


def test_ring_decomposition_schedule_sums_to_full_attention_in_process():
    sys.path.insert(0, str(ROOT / "bench"))
    try:
        import ring_decomposition as rd
    finally:
        sys.path.pop(0)
    import torch

    r = rd.measure(S=96, P=3, hq=4, hkv=1, d=16, dtype=torch.float64, dev=torch.device("cpu"), kernel="math",
                   repeats=1)
    assert r["err"] < 1e-12 and len(r["t_ranks"]) == 3


def test_offload_overlap_reduced_form_is_exact():
    proc = _bench("offload_overlap.py", "--cpu-small")
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert proc.stdout.count("bit-exact=True") == 2 and "step time: plain" in proc.stdout


def test_max_seqlen_cpu_tiny_form():
    """bench/max_seqlen.py --cpu-tiny: real forward + backward steps of a tiny Megatron GPTModel under an emulated
    activation cap (tracker peak); the nemo_longctx stack reaches a longer sequence than Megatron's defaults and the
    planner's prediction is beside it (within 25% of the measured length; its peak model is calibrated within 10%)."""
    proc = _bench("max_seqlen.py", "--cpu-tiny")
    assert proc.returncode == 0, proc.stdout + proc.stderr
    rows = dict((m.group(1), m.groups()[1:]) for m in re.finditer(
        r"^\| (megatron|longctx) \| (\d+) \| (\d+|n/a[^|]*) \| ([0-9.]+|n/a) \|", proc.stdout, re.M))
    assert set(rows) == {"megatron", "longctx"}, proc.stdout
    mega, ours = int(rows["megatron"][0]), int(rows["longctx"][0])
    assert 0 < mega and ours >= 4 * mega, proc.stdout
    predicted = int(rows["longctx"][1])
    assert 0.75 <= predicted / ours <= 1.25, proc.stdout
    # every step that "fit" stayed under the cap, every one that did not exceeded it
    for stack in ("megatron", "longctx"):
        trail = re.search(rf"^{stack} steps: (.*)$", proc.stdout, re.M).group(1)
        for ok, mib in re.findall(r"\d+:(ok|no)\(([0-9.]+)MiB\)", trail):
            assert (float(mib) <= 8.0) == (ok == "ok"), trail


def test_max_seqlen_failed_step_is_recovered():
    """A step that fails mid-forward (injected out-of-memory in the last layer: kept attention and offloaded layer
    inputs of the earlier layers are left behind) counts as not fitting, and the search goes on with a fresh model:
    the lengths after the failures still run."""
    proc = _bench("max_seqlen.py", "--cpu-tiny", "--stacks", "longctx", "--inject-oom-above", "700")
    assert proc.returncode == 0, proc.stdout + proc.stderr
    trail = re.search(r"^longctx steps: (.*)$", proc.stdout, re.M).group(1)
    steps = re.findall(r"(\d+):(ok|no)\(([^)]*)\)", trail)
    assert [(int(s), ok) for s, ok, _ in steps] == [(128, "ok"), (256, "ok"), (512, "ok"), (1024, "no"), (768, "no"),
                                                    (640, "ok"), (704, "no")], trail
    assert all(info == "OOM" for _, ok, info in steps if ok == "no"), trail
    assert re.search(r"^\| longctx \| 640 \|", proc.stdout, re.M), proc.stdout


def test_peak_breakdown_replays_the_allocator_trace():
    """bench/max_seqlen.py --peak-breakdown reads the CUDA allocator's trace; its replay (live_at_peak) is checked on
    a hand-written trace: the peak, the event reaching it, and the live set grouped by site (freed blocks excluded,
    a block counts until free_completed)."""
    sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "bench"))
    from max_seqlen import live_at_peak

    def fr(name, line):
        return [{"filename": "/x/torch/autograd/function.py", "line": 1, "name": "apply"},
                {"filename": f"/x/nemo_longctx/{name}.py", "line": line, "name": name}]

    ev = [dict(action="alloc", addr=1, size=100, frames=fr("a", 1)),
          dict(action="alloc", addr=2, size=50, frames=fr("b", 2)),
          dict(action="free_requested", addr=1, size=100, frames=[]),
          dict(action="alloc", addr=3, size=30, frames=fr("b", 2)),  # 180 live: 1 not yet free_completed
          dict(action="free_completed", addr=1, size=100, frames=[]),
          dict(action="alloc", addr=4, size=60, frames=fr("c", 3)),  # 140
          dict(action="free_completed", addr=2, size=50, frames=[])]
    peak, i, rows = live_at_peak(ev, base=10)
    assert (peak, i) == (180, 3)
    assert rows == [(100, 1, "a.py:1 a"), (80, 2, "b.py:2 b")]
