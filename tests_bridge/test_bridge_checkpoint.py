"""Megatron-Bridge's own checkpointing through ``nemo-longctx bridge`` on the CPU (gloo): a run with the schedule of a
6-step run (``train.train_iters=6``) saves a Bridge checkpoint at step 3 and stops there (Bridge's
``checkpoint.save``/``checkpoint.save_interval`` and ``train.exit_interval``); resumed with ``checkpoint.load`` at the
same ring CP=2, at Ulysses CP=2 and at CP=1 (one rank: another world size, the checkpoint is resharded), steps 4..6
are numbered 4..6 and equal the uninterrupted run's (which saves at 3 and 6 without stopping). Controls: a run that
does not resume repeats steps 1..3 (which differ from 4..6), and a resume that loads the weights but not the
optimizer (``checkpoint.load_optim=false``) matches at step 4 only. Saves leave no process behind; a resume from a
missing directory fails before any rank starts, naming the key (as do the other ``checkpoint_problems``)."""

from __future__ import annotations

import subprocess
import uuid
from types import SimpleNamespace

import pytest
from runner import processes_with_env, run_bridge

pytest.importorskip("megatron.bridge", reason="the Megatron-Bridge stack (scripts/install_bridge.sh)")

TAG = "NEMO_LONGCTX_TEST_RUN"
SAME = 1e-6  # relative, same CP algorithm and size
ACROSS = 1e-5  # relative, another CP algorithm or size
SCHEDULE = ["train.train_iters=6"]  # every run has the 6-step schedule (the LR decays over 6 steps)


def _tagged_run(tmp, name, *args):
    """A run whose processes (launcher, ranks, their children) carry a unique environment tag; returns (code, log,
    rows, the tagged processes still alive after it ended)."""
    tag = uuid.uuid4().hex
    code, log, rows = run_bridge(tmp, name, *args, env={TAG: tag})
    return code, log, rows, processes_with_env(TAG, tag, wait_s=30)


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("bridge_ckpt")
    ckpt = tmp / "ckpt"
    load = [*SCHEDULE, f"checkpoint.load={ckpt}"]
    plan = {
        # saves at 3 and at 6 without stopping: Bridge's normal end with a checkpoint (orphan check)
        "full": ["cp=ring", "cp.size=2", *SCHEDULE, f"checkpoint.save={tmp / 'ckpt_full'}",
                 "checkpoint.save_interval=3"],
        "first": ["cp=ring", "cp.size=2", *SCHEDULE, f"checkpoint.save={ckpt}", "checkpoint.save_interval=3",
                  "train.exit_interval=3"],
        "ring": ["cp=ring", "cp.size=2", *load],
        "ulysses": ["cp=ulysses", "cp.size=2", *load],
        "one_rank": ["cp=none", *load],
        "no_optim": ["cp=none", *load, "checkpoint.load_optim=false"],
    }
    out = {name: _tagged_run(tmp, name, *args) for name, args in plan.items()}
    out["ckpt"], out["ckpt_full"] = ckpt, tmp / "ckpt_full"
    return out


def _close(a, b, rel):
    return abs(a - b) <= rel * abs(a)


def test_checkpoint_at_step_3_then_stop(runs):
    code, log, rows, _ = runs["first"]
    assert code == 0, log[-4000:]
    assert [r["step"] for r in rows] == [1, 2, 3], rows
    assert "exiting program at iteration 3" in log, log[-3000:]
    assert "Pretrain failed" not in log, log[-3000:]  # Bridge's planned exit is not reported as a failure
    ckpt = runs["ckpt"]
    assert (ckpt / "latest_train_state.pt").is_file() and (ckpt / "iter_0000003" / ".metadata").is_file()
    assert sorted(p.name for p in ckpt.glob("iter_*")) == ["iter_0000003"]
    # the same schedule as the uninterrupted run: its first 3 steps are the same
    full = runs["full"][2]
    assert runs["full"][0] == 0 and [r["step"] for r in full] == [1, 2, 3, 4, 5, 6], runs["full"][1][-4000:]
    assert sorted(p.name for p in runs["ckpt_full"].glob("iter_*")) == ["iter_0000003", "iter_0000006"]
    for a, b in zip(full, rows):
        assert a["loss"] == b["loss"], (a, b)


@pytest.mark.parametrize("name, rel, cp_size", [("ring", SAME, 2), ("ulysses", ACROSS, 2), ("one_rank", ACROSS, 1)])
def test_resume_equals_the_uninterrupted_run(runs, name, rel, cp_size):
    code, log, rows, _ = runs[name]
    assert code == 0, log[-4000:]
    assert f"successfully loaded checkpoint from {runs['ckpt']}" in log and "at iteration 3" in log, log[-3000:]
    assert [r["step"] for r in rows] == [4, 5, 6], rows
    assert all(r["cp_size"] == cp_size and r["world_size"] == cp_size for r in rows), rows
    full = runs["full"][2][3:]
    for a, b in zip(full, rows):
        assert _close(a["loss"], b["loss"], rel), (name, a, b)


def test_controls_differ(runs):
    full = runs["full"][2]
    # a run that does not load the checkpoint starts again at step 1 (the first run's rows): far from steps 4..6
    for a, b in zip(full[:3], full[3:]):
        assert abs(a["loss"] - b["loss"]) > 1e-2, (a, b)
    # weights restored but not the optimizer and its schedule: step 4 agrees, steps 5 and 6 do not
    code, log, rows, _ = runs["no_optim"]
    assert code == 0, log[-4000:]
    assert [r["step"] for r in rows] == [4, 5, 6], rows
    assert _close(full[3]["loss"], rows[0]["loss"], ACROSS), (full[3], rows[0])
    for a, b in zip(full[4:], rows[1:]):
        assert abs(a["loss"] - b["loss"]) > 1e-3, (a, b)


def test_no_process_is_left_behind(runs):
    for name in ("full", "first", "ring", "ulysses", "one_rank", "no_optim"):
        assert runs[name][3] == [], (name, runs[name][3])
    # the scan does find a live process carrying a tag
    tag = uuid.uuid4().hex
    p = subprocess.Popen(["sleep", "30"], env={TAG: tag})
    try:
        assert [s.split(":")[0] for s in processes_with_env(TAG, tag)] == [str(p.pid)]
    finally:
        p.kill()
        p.wait()


@pytest.mark.smoke
def test_resume_from_a_missing_directory_fails_before_any_rank(tmp_path):
    missing = tmp_path / "no_ckpt"
    code, log, _ = run_bridge(tmp_path, "missing", "cp=none", f"checkpoint.load={missing}", timeout=300)
    assert code == 2 and f"checkpoint.load={missing}: no such directory" in log, log[-3000:]
    assert "core attention:" not in log and "world 1" not in log  # no rank started


@pytest.mark.smoke
def test_checkpoint_problems_name_their_key(tmp_path):
    from nemo_longctx.integrations.bridge.checkpoint import checkpoint_problems

    def problems(overrides, **checkpoint):
        fields = {"load": None, "save": None, "ckpt_step": None, "pretrained_checkpoint": None, "async_save": False,
                  **checkpoint}
        return checkpoint_problems(SimpleNamespace(checkpoint=SimpleNamespace(**fields)), overrides, cuda=False)

    empty = tmp_path / "empty"
    empty.mkdir()
    assert "a directory without a Bridge checkpoint" in problems([f"checkpoint.load={empty}"], load=str(empty))[0]
    # a recipe's own default load directory is Bridge's resume-if-present: not checked
    assert problems([], load=str(tmp_path / "nope")) == []
    # load = save: resume when a checkpoint exists there
    assert problems([f"checkpoint.load={empty}", f"checkpoint.save={empty}"], load=str(empty), save=str(empty)) == []
    pre = tmp_path / "pre"
    assert problems([f"checkpoint.pretrained_checkpoint={pre}"], pretrained_checkpoint=str(pre)) == [
        f"checkpoint.pretrained_checkpoint={pre}: no such file or directory"]
    # the async save's worker process dies without CUDA and the rank waits for it (measured: a hang)
    assert problems([], save=str(empty), async_save=True)[0].startswith("checkpoint.async_save=true: ")
