"""Ctrl-C (SIGINT), both forms, on the default job (tiny GQA Llama, 2 ranks, gloo): a terminal's Ctrl-C reaches the
launcher's process group (the ranks run in their own sessions), which ``run.fault=SIGINT@K:R`` reproduces (rank R sends
SIGINT to its launcher at the start of step K). With checkpoints on, SIGINT is one of the default ``run.signals``:
the ranks save the step and stop (exit 75), the checkpoint complete; with nothing to save every rank ends by the
signal's default action: exit 130, the launcher's one line, no traceback. Not timing-bound: runs in the parallel part
(the preemption signals' own tests, which bound times, are tests/test_preemption.py)."""

from __future__ import annotations

import signal
import sys
from pathlib import Path

from app_runner import metrics_rows, run_app

APP = [str(Path(sys.executable).parent / "nemo-longctx"), "train"]
COMMON = ["model.seq_length=1024", "memory.track=false", "log.tensorboard=false"]
PREEMPTED_EXIT = 75


def test_ctrl_c_saves_the_step_like_the_preemption_signals(tmp_path):
    code, out = run_app(APP + [f"output_dir={tmp_path}", *COMMON, "trainer.max_steps=6", "checkpoint.every_n_steps=100",
                               "run.fault=SIGINT@3:0"])
    assert code == PREEMPTED_EXIT, out[-4000:]
    assert "nemo-longctx: SIGINT: 2 rank(s) save this step's checkpoint and stop" in out
    assert "nemo-longctx: preempted, checkpoint saved (exit 75" in out and "Traceback" not in out, out[-4000:]
    ckpts = tmp_path / "checkpoints"
    assert sorted(p.name for p in ckpts.iterdir()) == ["step=2-consumed_samples=3.0-last"]  # complete: no marker
    assert sorted(r["step"] for r in metrics_rows(tmp_path) if "loss" in r) == [1, 2, 3]


def test_ctrl_c_without_checkpoints_ends_quietly(tmp_path):
    code, out = run_app(APP + [f"output_dir={tmp_path}", *COMMON, "trainer.max_steps=200", "run.fault=SIGINT@3:0"])
    assert code == 128 + signal.SIGINT, out[-4000:]
    assert "nemo-longctx: stopped by SIGINT; all ranks were stopped" in out, out[-4000:]
    assert "Traceback" not in out and "KeyboardInterrupt" not in out, out[-4000:]
