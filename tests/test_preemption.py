"""Preemption: a signal saves the step, the same command resumes it, nothing is left behind (real processes, gloo).

The default job (tiny GQA Llama, 2 ranks, fp32, seq 1024), 6 steps. ``run.fault=SIGTERM@K:R`` / ``SIGUSR1@K:R``: rank R
sends that signal to its launcher (its parent process) at the start of step K, as ``scancel``/``kill`` would, and
trains on; the launcher (ours, or torchrun's agent) passes it to every rank. Runs:
  * ``full``: uninterrupted (the default job's shared run, tests/default_job.py: with checkpoints and validation every
    2 steps, which leave the training losses bit-equal);
  * ``usr1``: cp=ulysses, local launcher, SIGUSR1 at step 4 -> checkpoint of step 4, exit 75; ``usr1_resumed``: the
    same command again;
  * ``torchrun``: ring under ``torchrun --standalone``, SIGTERM to torchrun at step 2 (its agent sends SIGTERM to the
    ranks) -> checkpoint of step 2; ``torchrun_resumed``: the same arguments through our local launcher;
  * ``second``: ring, checkpoints every 2 steps, SIGTERM at step 3 and a second SIGTERM a second later, before the step
    can end (``run.fault=SIGTERM_TWICE``: no race against the ranks' save) -> exit 143 at once, no complete checkpoint
    of step 3; an ``-unfinished`` checkpoint of step 4 is planted; ``second_resumed``: skips it, naming it, and
    resumes from step 2.
Every resumed run's per-step losses equal ``full``'s (<= 1e-6 relative).
"""

from __future__ import annotations

import os
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from app_runner import ROOT, leftover_processes, metrics_rows, run_app
from default_job import uninterrupted

# signal tests: every bound is measured from the signal, so they hold beside the rest of the suite (parallel part)

BIN = Path(sys.executable).parent
APP = [str(BIN / "nemo-longctx"), "train"]
STEPS = 6
COMMON = ["model.seq_length=1024", f"trainer.max_steps={STEPS}", "memory.track=false", "log.tensorboard=false"]
SAVING = [*COMMON, "checkpoint.every_n_steps=100"]  # checkpointing on (so save-on-signal is), no periodic save
PREEMPTED_EXIT = 75


def _losses(out_dir: Path) -> dict:
    return {r["step"]: r["loss"] for r in metrics_rows(out_dir) if "loss" in r}


def _complete(out_dir: Path) -> list:
    d = out_dir / "checkpoints"
    return sorted(p.name for p in d.iterdir() if p.is_dir() and not Path(f"{p}-unfinished").exists())


def _second_signal_run(cmd: list, timeout: float = 420) -> tuple:
    """Run ``cmd`` (its drill sends the launcher two SIGTERMs a second apart); return the exit code, the output and
    the seconds from the launcher's line about the first signal to the end of the run."""
    p = subprocess.Popen(cmd, cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                         env={**os.environ, "PYTHONUNBUFFERED": "1"})
    lines, seen, deadline = [], None, time.monotonic() + timeout
    for line in p.stdout:  # type: ignore[union-attr]
        lines.append(line)
        if seen is None and line.startswith("nemo-longctx: SIGTERM: 2 rank(s) save"):
            seen = time.monotonic()
        if time.monotonic() > deadline:
            p.kill()
            break
    code = p.wait(timeout=60)
    return code, "".join(lines), (time.monotonic() - seen) if seen else None


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    base = tmp_path_factory.mktemp("preempt")
    d = {n: base / n for n in ("usr1", "torchrun", "second")}
    d["full"] = uninterrupted(tmp_path_factory)  # shared with tests/test_checkpoint_resume.py (tests/default_job.py)
    out = {}
    usr1 = APP + [f"output_dir={d['usr1']}", *SAVING, "cp=ulysses"]
    code, out["usr1"] = run_app(usr1 + ["run.fault=SIGUSR1@4:1"])
    out["usr1_code"], out["usr1_ckpts"], out["usr1_rows"] = code, _complete(d["usr1"]), _losses(d["usr1"])
    code, out["usr1_resumed"] = run_app(usr1)
    assert code == 0, out["usr1_resumed"][-3000:]

    args = [f"output_dir={d['torchrun']}", *SAVING]
    code, out["torchrun"] = run_app([str(BIN / "torchrun"), "--standalone", "--nproc-per-node=2", "-m",
                                     "nemo_longctx.apps.train", *args, "run.fault=SIGTERM@2:0"])
    out["torchrun_code"], out["torchrun_ckpts"] = code, _complete(d["torchrun"])
    code, out["torchrun_resumed"] = run_app(APP + args)
    assert code == 0, out["torchrun_resumed"][-3000:]

    second = APP + [f"output_dir={d['second']}", *COMMON, "checkpoint.every_n_steps=2"]
    out["second_code"], out["second"], out["second_stop_s"] = _second_signal_run(
        second + ["run.fault=SIGTERM_TWICE@3:0"])
    out["second_left"] = leftover_processes()
    out["second_ckpts"] = _complete(d["second"])
    planted = d["second"] / "checkpoints" / "step=3-consumed_samples=4.0"  # NeMo's name after 4 steps
    shutil.copytree(d["second"] / "checkpoints" / out["second_ckpts"][0], planted)
    Path(f"{planted}-unfinished").touch()
    code, out["second_resumed"] = run_app(second)
    assert code == 0, out["second_resumed"][-3000:]
    return {"dirs": d, "out": out}


def _assert_resumed_equal(runs, name: str, at: int) -> None:
    out = runs["out"][f"{name}_resumed"]
    assert f"nemo-longctx: resumed at step {at} from " in out, out[-3000:]
    full, resumed = _losses(runs["dirs"]["full"]), _losses(runs["dirs"][name])
    assert sorted(resumed) == list(range(1, STEPS + 1))  # metrics.jsonl reads as one run
    for step in range(1, STEPS + 1):
        assert abs(full[step] - resumed[step]) <= 1e-6 * abs(full[step]), (name, step, full[step], resumed[step])
    assert len({round(v, 5) for v in full.values()}) == STEPS  # not vacuous: the loss moves every step


def test_sigusr1_saves_the_step_and_the_same_command_resumes_it(runs):
    o = runs["out"]
    assert o["usr1_code"] == PREEMPTED_EXIT, o["usr1"][-4000:]
    line = next(ln for ln in o["usr1"].splitlines() if ln.startswith("nemo-longctx: preempted at step"))
    assert line.startswith("nemo-longctx: preempted at step 4, checkpoint ") and "step=3-" in line, line
    assert line.endswith(" s") and " saved in " in line, line
    assert "nemo-longctx: SIGUSR1: 2 rank(s) save this step's checkpoint and stop" in o["usr1"]
    assert "nemo-longctx: preempted, checkpoint saved (exit 75" in o["usr1"]  # the summary says so, not FAILED
    assert sorted(o["usr1_rows"]) == [1, 2, 3, 4]
    assert o["usr1_ckpts"] == ["step=3-consumed_samples=4.0-last"], o["usr1_ckpts"]  # complete, no marker left
    _assert_resumed_equal(runs, "usr1", 4)


def test_sigterm_to_torchrun_saves_the_step(runs):
    """torchrun's agent answers SIGTERM by sending SIGTERM to its workers (and waits for them): they save and exit
    75; torchrun itself then exits non-zero (its own SignalException), with the checkpoint complete on disk."""
    o = runs["out"]
    assert o["torchrun_code"] != 0, o["torchrun"][-3000:]
    assert "nemo-longctx: preempted at step 2, checkpoint " in o["torchrun"], o["torchrun"][-4000:]
    assert o["torchrun_ckpts"] == ["step=1-consumed_samples=2.0-last"], o["torchrun_ckpts"]
    _assert_resumed_equal(runs, "torchrun", 2)


def test_a_second_signal_stops_at_once_and_resume_skips_unfinished_checkpoints(runs):
    o = runs["out"]
    assert o["second_code"] == 128 + signal.SIGTERM, o["second"][-4000:]
    assert "nemo-longctx: stopped by SIGTERM (a second signal after SIGTERM: no checkpoint waited for)" in o["second"]
    assert "preempted at step" not in o["second"]
    assert o["second_stop_s"] is not None and o["second_stop_s"] < 30, o["second_stop_s"]
    assert o["second_left"] == [], o["second_left"]
    assert not any(n.startswith("step=2-") for n in o["second_ckpts"]), o["second_ckpts"]  # step 3 was not saved
    assert o["second_ckpts"][-1].startswith("step=1-"), o["second_ckpts"]  # the periodic save after step 2
    assert ("nemo-longctx: auto-resume skips step=3-consumed_samples=4.0: unfinished (its save was cut off)"
            in o["second_resumed"]), o["second_resumed"][-3000:]
    _assert_resumed_equal(runs, "second", 2)


def test_sigkill_of_the_launcher_leaves_no_process(tmp_path):
    """With a checkpoint saved every step (each rank starts Megatron's checkpoint writer processes), SIGKILL the
    launcher at step 3: 10 s later no process of the run is alive (the launcher's reaper)."""
    out_dir = tmp_path / "killed"
    p = subprocess.Popen(APP + [f"output_dir={out_dir}", *COMMON, "trainer.max_steps=30", "checkpoint.every_n_steps=1"],
                         cwd=ROOT, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    deadline = time.monotonic() + 300
    while time.monotonic() < deadline and p.poll() is None:
        metrics = out_dir / "metrics.jsonl"
        if metrics.exists() and len(metrics.read_text().splitlines()) >= 3:
            break
        time.sleep(0.5)
    assert p.poll() is None, "the run ended before it could be killed"
    alive = leftover_processes()
    assert len(alive) >= 2, alive  # the ranks at least
    p.kill()
    p.wait()
    time.sleep(10)
    assert leftover_processes() == [], f"alive 10 s after the launcher's SIGKILL (before: {alive})"


def test_bad_signal_settings_are_refused_before_launch(tmp_path):
    code, out = run_app(APP + [f"output_dir={tmp_path}", "checkpoint.on_signal=true", "run.signals=[SIGTERM,SIGKILL]",
                               "run.signal_grace_s=0"], 120)
    assert code == 2 and "spawning" not in out, out[-3000:]
    assert "checkpoint.on_signal=true needs checkpoint.every_n_steps or checkpoint.every_minutes" in out, out[-3000:]
    assert "run.signals: unknown value(s) ['SIGKILL']" in out and "run.signal_grace_s=0 must be a number > 0" in out

