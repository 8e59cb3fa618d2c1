"""``python -m nemo_longctx.selftest`` end to end: the table, the exit status, CUDA rows skipped without CUDA,
and a deliberately wrong kernel making it fail."""

from __future__ import annotations

import json
import os
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
