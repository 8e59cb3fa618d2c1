"""The Bridge front end's launcher semantics are the NeMo app's (the same elastic launcher, real processes, gloo):
a rank raising at step 2 fails the run naming the rank and its error; SIGTERM to the launcher (what ``scancel``
sends) while a rank hangs stops every rank with exit 143 and leaves no process of the run behind."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
import uuid

import pytest

pytest.importorskip("megatron.bridge", reason="the Megatron-Bridge stack (scripts/install_bridge.sh)")

from runner import ROOT, processes_with_env, run_bridge  # noqa: E402

MARK = "NEMO_LONGCTX_TEST_RUN"


@pytest.mark.smoke
def test_a_rank_raising_fails_the_run_and_names_the_rank(tmp_path):
    tag = uuid.uuid4().hex
    code, log, rows = run_bridge(tmp_path, "raise", "cp=ring", "cp.size=2", "run.fault=raise@2:1", timeout=300,
                                 env={MARK: tag})
    assert code == 1, (code, log[-3000:])
    assert "injected failure (run.fault) on rank 1 at step 2" in log, log[-3000:]
    assert "nemo-longctx: FAILED: rank 1 exit code 1" in log and "FAILED (exit 1)" in log, log[-3000:]
    assert [r["step"] for r in rows] == [1], rows  # step 1 trained, step 2 never finished
    assert processes_with_env(MARK, tag, wait_s=10) == []


def test_sigterm_to_the_launcher_stops_every_rank(tmp_path):
    tag = uuid.uuid4().hex
    out_file = tmp_path / "out.txt"
    cmd = [sys.executable, "-m", "nemo_longctx.apps.bridge", f"output_dir={tmp_path / 'run'}", "cp=ring", "cp.size=2",
           "run.fault=hang@2:0", "train.train_iters=100"]
    with open(out_file, "w") as f:
        proc = subprocess.Popen(cmd, cwd=ROOT, stdout=f, stderr=subprocess.STDOUT,
                                env={**os.environ, "PYTHONUNBUFFERED": "1", MARK: tag})
    try:
        deadline = time.time() + 240
        while "run.fault: rank 0 injects 'hang' at step 2" not in out_file.read_text():
            assert proc.poll() is None and time.time() < deadline, out_file.read_text()[-3000:]
            time.sleep(1)
        assert len(processes_with_env(MARK, tag)) >= 3  # the launcher and its two ranks
        proc.send_signal(signal.SIGTERM)
        code = proc.wait(timeout=90)
    finally:
        if proc.poll() is None:
            proc.kill()
    out = out_file.read_text()
    assert code == 128 + signal.SIGTERM, (code, out[-3000:])
    assert "stopped by SIGTERM; all ranks were stopped" in out, out[-3000:]
    assert processes_with_env(MARK, tag, wait_s=10) == []  # no rank (nor a child of one) left behind
