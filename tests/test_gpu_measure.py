"""scripts/gpu_measure.sh, rehearsed on CPU (--cpu-small): every section runs its small form and writes its table, so
the script a GPU window runs cannot rot between GPU sessions."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
SCRIPT = ROOT / "scripts" / "gpu_measure.sh"


def _run(args, out: Path, timeout: int = 900):
    env = dict(os.environ, GPU_MEASURE_OUT=str(out), PYTHON=sys.executable)
    return subprocess.run(["bash", str(SCRIPT), *args], cwd=ROOT, env=env, capture_output=True, text=True,
                          timeout=timeout)


def test_cpu_rehearsal_runs_every_section_and_writes_its_tables(tmp_path):
    r = _run(["--cpu-small"], tmp_path)
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    summary = (tmp_path / "summary.md").read_text()
    for section in ("ring", "claim", "ab", "app", "calib"):
        assert f"| {section} | passed |" in summary, summary
        assert (tmp_path / f"{section}.txt").stat().st_size > 0
    env = (tmp_path / "env.txt").read_text()
    assert "torch" in env and "megatron-core" in env
    assert "| 512 | 2 | cpu_flash |" in (tmp_path / "ring.txt").read_text()
    claim = json.loads((tmp_path / "claim.json").read_text())
    assert len(claim["rows"]) == 2 and all(row["fits"] for row in claim["rows"])
    for row in claim["rows"]:  # the tracker's step peak against the planner's (local_cpu, calibrated on CPU)
        assert 0.9 <= row["measured_over_predicted"] <= 1.1, row
    ab = json.loads((tmp_path / "ab.json").read_text())
    assert ab["agree"] and len(ab["losses"]["megatron"]) == len(ab["losses"]["nemo_longctx"]) == 6
    app = (tmp_path / "app.txt").read_text()
    assert "app: 0.002B parameters, seq 4096, 4 steps" in app and "tokens/s" in app
    assert len((tmp_path / "app_metrics.jsonl").read_text().splitlines()) == 4


def test_bad_arguments_exit_2_naming_them(tmp_path):
    r = _run(["--cpu-small", "everything"], tmp_path, timeout=60)
    assert r.returncode == 2 and "unknown argument 'everything'" in r.stderr
