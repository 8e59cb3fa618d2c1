"""Save on signal through ``nemo-longctx bridge`` (Bridge's own ``train.exit_signal_handler`` driven by our keys): a
signal sent to the local launcher at step 2 of the 3-step CPU demo (``run.fault=SIGUSR1@2:1``: rank 1 signals the
launcher, as ``kill``/``scancel`` would; the launcher forwards it to both ranks) saves Bridge's checkpoint of step 2
on every rank, prints the preempted line and exits 75 with no process left; the same command then resumes at step 3
and the three steps equal the uninterrupted demo's (ring CP=2, <= 1e-6). Not in the smoke set: SIGTERM with Ulysses,
preempted at step 1. (The distributed optimizer cannot resume on a CPU: ``cpu_problems`` refuses it with
``checkpoint.save``, see the last test.) The settings that cannot work are refused naming the key."""

from __future__ import annotations

import uuid

import pytest
from runner import processes_with_env, run_bridge, shared_run

pytest.importorskip("megatron.bridge", reason="the Megatron-Bridge stack (scripts/install_bridge.sh)")

TAG = "NEMO_LONGCTX_TEST_RUN"
SAME = 1e-6  # relative, same CP algorithm and size


def _preempt_and_resume(tmp, args, fault):
    """(preempted run, resumed run, processes of the preempted run still alive 10 s after it ended, the checkpoint
    directory, what it held after the preempted run): the same command twice (resume-if-present: checkpoint.load =
    checkpoint.save), the first with the fault drill."""
    ckpt = tmp / "ckpt"
    same = [*args, f"checkpoint.save={ckpt}", f"checkpoint.load={ckpt}"]
    tag = uuid.uuid4().hex
    first = run_bridge(tmp, "preempted", *same, f"run.fault={fault}", env={TAG: tag})
    left = processes_with_env(TAG, tag, wait_s=10)
    tracker = ckpt / "latest_checkpointed_iteration.txt"
    held = (tracker.read_text().strip() if tracker.exists() else None, sorted(p.name for p in ckpt.glob("iter_*")))
    return first, run_bridge(tmp, "resumed", *same), left, ckpt, held


def _check(pair, baseline, step, rel):
    (code, log, rows), (code2, log2, rows2), left, ckpt, held = pair
    assert code == 75, log[-4000:]
    assert f"nemo-longctx: preempted at step {step}, checkpoint {ckpt}/iter_{step:07d} saved in" in log, log[-3000:]
    assert "preempted, checkpoint saved (exit 75" in log, log[-2000:]
    assert [r["step"] for r in rows] == list(range(1, step + 1)), rows
    assert held == (str(step), [f"iter_{step:07d}"]), held  # Bridge's tracker names the signal's checkpoint
    assert left == [], left
    assert code2 == 0, log2[-4000:]
    assert f"successfully loaded checkpoint from {ckpt}" in log2, log2[-3000:]
    assert [r["step"] for r in rows2] == list(range(step + 1, 4)), rows2
    b_code, b_log, ref = baseline
    assert b_code == 0 and [r["step"] for r in ref] == [1, 2, 3], b_log[-3000:]
    for a, b in zip(ref, rows + rows2):
        assert abs(a["loss"] - b["loss"]) <= rel * abs(a["loss"]), (a, b)


@pytest.mark.smoke
def test_sigusr1_saves_the_step_exits_75_and_the_same_command_resumes(tmp_path):
    args = ["cp=ring", "cp.size=2"]
    _check(_preempt_and_resume(tmp_path, args, "SIGUSR1@2:1"), shared_run(*args), 2, SAME)


def test_sigterm_with_ulysses(tmp_path):
    args = ["cp=ulysses", "cp.size=2"]
    _check(_preempt_and_resume(tmp_path, args, "SIGTERM@1:0"), shared_run(*args), 1, SAME)


@pytest.mark.smoke
def test_settings_that_cannot_save_on_a_signal_are_refused(tmp_path):
    from nemo_longctx.apps.bridge import demo_config
    from nemo_longctx.integrations.bridge.preemption import (apply_on_signal, latched_signals, on_signal_problems,
                                                             save_time_warning)

    c = demo_config()
    c.checkpoint.save = None  # as the app builds the demo (it saves only when asked)
    assert "checkpoint.on_signal=true needs checkpoint.save=<dir>" in on_signal_problems(c, True, [])[0]
    c.train.exit_signal_handler = True
    assert "train.exit_signal_handler=true needs checkpoint.save" in on_signal_problems(
        c, None, ["train.exit_signal_handler"])[0]
    c.checkpoint.save = str(tmp_path)
    c.train.exit_signal_handler = False
    assert "disagree" in on_signal_problems(c, True, ["train.exit_signal_handler"])[0]
    assert on_signal_problems(c, None, ["train.exit_signal_handler"]) == []
    # the mapping: null follows checkpoint.save (or Bridge's own key), the first of run.signals is Bridge's signal
    apply_on_signal(c, None, ["SIGUSR1", "SIGTERM"], ["train.exit_signal_handler"])
    assert c.train.exit_signal_handler is False and latched_signals(c, ["SIGUSR1"]) == ()
    apply_on_signal(c, None, ["SIGUSR1", "SIGTERM"], [])
    assert c.train.exit_signal_handler is True and c.train.exit_signal.name == "SIGUSR1"
    assert [s.name for s in latched_signals(c, ["SIGUSR1", "SIGTERM"])] == ["SIGUSR1", "SIGTERM"]
    # the start-up warning: the planner's estimate of one save of the container's model against the grace
    assert save_time_warning(c, 120) is None
    assert "MORE than the preemption grace run.signal_grace_s=1e-09" in save_time_warning(c, 1e-9)
    # the launching process refuses before any rank starts, naming the key
    code, log, rows = run_bridge(tmp_path, "refused", "checkpoint.on_signal=true", timeout=300)
    assert code == 2 and "checkpoint.on_signal=true needs checkpoint.save=<dir>" in log and rows == [], log[-2000:]
    assert "Traceback" not in log
    # on a CPU the distributed optimizer's checkpoint cannot be resumed (torch AdamW's per-parameter step): refused
    code, log, rows = run_bridge(tmp_path, "dist_opt", "optim.use_distributed_optimizer=true",
                                 f"checkpoint.save={tmp_path / 'ck'}", timeout=300)
    assert code == 2 and "optim.use_distributed_optimizer=true with checkpoint.save=<dir>" in log, log[-2000:]
