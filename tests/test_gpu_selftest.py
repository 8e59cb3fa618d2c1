"""``python -m nemo_longctx.selftest`` end to end: the table, the exit status, CUDA rows skipped without CUDA,
and a deliberately wrong kernel making it fail."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]


def _run(args, tmp_path, env_extra=None, timeout=600):
    env = dict(os.environ, PYTHONPATH=str(ROOT), OMP_NUM_THREADS="1")
    env.pop("NEMO_LONGCTX_SELFTEST_INJECT", None)
    env.pop("NEMO_LONGCTX_ATTN_KERNEL", None)
    env.update(env_extra or {})
    out = tmp_path / "rows.json"
    proc = subprocess.run([sys.executable, "-m", "nemo_longctx.selftest", "--json", str(out), *args], cwd=ROOT,
                          env=env, capture_output=True, text=True, timeout=timeout)
    rows = json.loads(out.read_text())["rows"] if out.exists() else []
    return proc, rows


def test_selftest_runs_every_section_and_passes(tmp_path):
    proc, rows = _run(["--quick"], tmp_path)
    assert proc.returncode == 0, proc.stdout[-4000:] + proc.stderr[-4000:]
    assert "| section | check | device | dtype | result | detail |" in proc.stdout
    assert "-> OK" in proc.stdout
    assert {r["section"] for r in rows} == {"env", "kernels", "cp", "offload", "tiling"}
    assert not [r for r in rows if r["status"] == "FAIL"]
    passed = {(r["section"], r["check"], r["device"]) for r in rows if r["status"] == "PASS"}
    for want in (("kernels", "cpu_flash", "cpu"), ("kernels", "math", "cpu"),
                 ("kernels", "start-up self_test_kernel", "cpu"), ("cp", "ring P=4", "cpu"),
                 ("cp", "ulysses P=4", "cpu"), ("cp", "hybrid P=4", "cpu"),
                 ("offload", "layer_input exact", "cpu"), ("offload", "modules exact", "cpu"),
                 ("tiling", "tiled MLP", "cpu"), ("tiling", "chunked loss", "cpu")):
        assert want in passed, want
    cuda_rows = [r for r in rows if r["device"] == "cuda"]
    assert cuda_rows
    if not torch.cuda.is_available():
        assert all(r["status"] == "SKIP" and r["detail"] == "skipped: no CUDA" for r in cuda_rows)
        assert {r["section"] for r in cuda_rows} >= {"kernels", "cp", "offload", "tiling"}


def test_selftest_fails_on_a_wrong_kernel(tmp_path):
    proc, rows = _run(["--sections", "kernels", "--no-cuda"], tmp_path,
                      {"NEMO_LONGCTX_SELFTEST_INJECT": "wrong_kernel"})
    assert proc.returncode == 1, proc.stdout[-4000:]
    assert "-> FAILED" in proc.stdout and "FAILED: kernels / injected_wrong / cpu" in proc.stdout
    bad = [r for r in rows if r["status"] == "FAIL"]
    assert bad and all(r["check"] == "injected_wrong" for r in bad)
    assert "WRONG:" in bad[0]["detail"] and "causal" in bad[0]["detail"]
    # the real kernels still pass in the same run
    assert {r["check"] for r in rows if r["status"] == "PASS"} >= {"cpu_flash", "math"}


def test_selftest_rejects_unknown_sections(tmp_path):
    proc, _ = _run(["--sections", "kernels,nope"], tmp_path)
    assert proc.returncode == 2 and "unknown sections" in proc.stderr


_FAKE_BRIDGE_PY = """#!/bin/sh
# stands in for .venv-bridge/bin/python: no CUDA; the app writes LOSSES_<cp> (cp=none|ring) to its metrics.jsonl
case "$1" in
  -c) echo 0 ;;
  -m)
    for a in "$@"; do case "$a" in output_dir=*) out=${a#output_dir=} ;; cp=*) cp=${a#cp=} ;; esac; done
    mkdir -p "$out"
    eval "losses=\\$LOSSES_$cp"
    for l in $losses; do echo "{\\"loss\\": $l}" >>"$out/metrics.jsonl"; done
    echo "nemo-longctx bridge: core attention: 2 layers run LongContextCoreAttention" ;;
  *) exec "$REAL_PYTHON" "$@" ;;
esac
"""


def _gpu_check_bridge(tmp_path, ring_losses):
    tmp_path.mkdir(parents=True)
    fake = tmp_path / "bridge_python"
    fake.write_text(_FAKE_BRIDGE_PY)
    fake.chmod(0o755)
    env = dict(os.environ, PYTHON=sys.executable, REAL_PYTHON=sys.executable, BRIDGE_PYTHON=str(fake),
               GPU_CHECK_PYTEST="0", GPU_CHECK_OUT=str(tmp_path / "out"), LOSSES_none="6.95 6.94 6.89",
               LOSSES_ring=ring_losses)
    return subprocess.run(["bash", str(ROOT / "scripts" / "gpu_check.sh"), "--sections", "env"], cwd=ROOT, env=env,
                          capture_output=True, text=True, timeout=120)


def test_gpu_check_covers_the_bridge_stack_and_fails_on_a_mismatch(tmp_path):
    """scripts/gpu_check.sh with a Bridge venv (a stub here): the Bridge demo at ring CP=2 and on one rank, compared;
    a wrong CP loss makes the one command exit non-zero. The script parses (bash -n) and passes shellcheck."""
    script = ROOT / "scripts" / "gpu_check.sh"
    assert subprocess.run(["bash", "-n", str(script)]).returncode == 0
    if shutil.which("shellcheck"):
        sc = subprocess.run(["shellcheck", str(script)], capture_output=True, text=True)
        assert sc.returncode == 0, sc.stdout
    ok = _gpu_check_bridge(tmp_path / "ok", "6.95 6.94 6.89")
    assert ok.returncode == 0, ok.stdout + ok.stderr
    assert "Megatron-Bridge smoke" in ok.stdout and "ring CP=2 matches one rank" in ok.stdout, ok.stdout
    bad = _gpu_check_bridge(tmp_path / "bad", "6.95 7.5 6.89")
    assert bad.returncode != 0 and "differ beyond 1e-06" in bad.stdout + bad.stderr, bad.stdout + bad.stderr
