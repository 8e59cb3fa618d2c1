"""``nemo-longctx bridge`` verifies the checkpoint a run would load before any rank starts
(``integrations/bridge/checkpoint.damaged_checkpoint_problems``, ``nemo_longctx.shared.checkpoint_integrity``).

One real Bridge run (CPU demo, one rank, gloo) saves a checkpoint at steps 1 and 2 (``iter_0000001``, ``iter_0000002``,
Bridge's ``latest_train_state.pt`` and Megatron-LM's ``latest_checkpointed_iteration.txt`` naming 2). A copy whose
``iter_0000002`` has one storage file cut short: ``checkpoint.load=<copy>`` is refused with exit 2 before any rank
starts, naming the key, the iteration, the file and the newest intact iteration with the ``checkpoint.ckpt_step`` that
resumes from it; that hint, followed, resumes at step 2 with the uninterrupted run's step-2 loss. Units on copies: the
iteration directory itself as ``checkpoint.load``, ``checkpoint.ckpt_step``, ``checkpoint.pretrained_checkpoint``, an
unreadable tracker, the Megatron-LM tracker alone.
"""

from __future__ import annotations

import os
import shutil
from types import SimpleNamespace

import pytest
from runner import run_bridge

pytest.importorskip("megatron.bridge", reason="the Megatron-Bridge stack (scripts/install_bridge.sh)")

RUN = ["cp=none", "train.train_iters=2"]
CUT = 1000


@pytest.fixture(scope="module")
def saved(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("bridge_integrity")
    ckpt = tmp / "ckpt"
    code, log, rows = run_bridge(tmp, "save", *RUN, f"checkpoint.save={ckpt}", "checkpoint.save_interval=1")
    assert code == 0, log[-4000:]
    assert sorted(p.name for p in ckpt.glob("iter_*")) == ["iter_0000001", "iter_0000002"], log[-3000:]
    assert (ckpt / "latest_train_state.pt").is_file() and (ckpt / "latest_checkpointed_iteration.txt").is_file()
    return ckpt, rows


def _damaged_copy(ckpt, dest):
    """A copy of ``ckpt`` whose iter_0000002 has its first storage file cut to CUT bytes: (copy, file, its size)."""
    shutil.copytree(ckpt, dest)
    shard = sorted((dest / "iter_0000002").glob("*.distcp"))[0]
    size = shard.stat().st_size
    os.truncate(shard, CUT)
    return dest, shard.name, size


def test_a_damaged_latest_checkpoint_is_refused_before_any_rank_and_the_hint_resumes(saved, tmp_path):
    ckpt, full_rows = saved
    d, shard, size = _damaged_copy(ckpt, tmp_path / "damaged")
    code, log, rows = run_bridge(tmp_path, "refused", *RUN, f"checkpoint.load={d}", timeout=300)
    assert code == 2, log[-3000:]
    assert (f"checkpoint.load={d}: iter_0000002 (named by latest_train_state.pt), the checkpoint it would load, is "
            f"damaged: iter_0000002/{shard} is {CUT} bytes, its metadata needs {size}; the newest intact one is "
            "iter_0000001: add checkpoint.ckpt_step=1 to resume from it") in log, log[-3000:]
    assert "Traceback" not in log and "core attention:" not in log and "world 1" not in log  # no rank started
    assert rows == []
    code, log, rows = run_bridge(tmp_path, "hinted", *RUN, f"checkpoint.load={d}", "checkpoint.ckpt_step=1")
    assert code == 0, log[-4000:]
    assert [r["step"] for r in rows] == [2], rows
    assert abs(rows[0]["loss"] - full_rows[1]["loss"]) <= 1e-6 * abs(full_rows[1]["loss"]), (rows, full_rows)


def test_damaged_checkpoint_problems_follow_bridges_choice_of_iteration(saved, tmp_path):
    from nemo_longctx.integrations.bridge.checkpoint import damaged_checkpoint_problems

    def problems(**checkpoint):
        fields = {"load": None, "save": None, "ckpt_step": None, "pretrained_checkpoint": None, **checkpoint}
        return damaged_checkpoint_problems(SimpleNamespace(checkpoint=SimpleNamespace(**fields)))

    ckpt, _ = saved
    assert problems(load=str(ckpt)) == [] and problems(load=str(ckpt / "iter_0000002")) == []
    d, shard, size = _damaged_copy(ckpt, tmp_path / "damaged")
    why = f"{shard} is {CUT} bytes, its metadata needs {size}"
    assert problems(load=str(d), ckpt_step=1) == []  # Bridge loads iter_0000001 then: intact
    assert problems(load=str(d), ckpt_step=2) == [
        f"checkpoint.load={d}: iter_0000002 (checkpoint.ckpt_step=2), the checkpoint it would load, is damaged: "
        f"iter_0000002/{why}; the newest intact one is iter_0000001: add checkpoint.ckpt_step=1 to resume from it"]
    assert problems(load=str(d / "iter_0000002")) == [
        f"checkpoint.load={d / 'iter_0000002'}: this checkpoint is damaged: {why}; the newest intact checkpoint beside "
        f"it: {d / 'iter_0000001'}"]
    assert problems(load=str(tmp_path / "none"), pretrained_checkpoint=str(d)) == [
        f"checkpoint.pretrained_checkpoint={d}: iter_0000002 (named by latest_train_state.pt), the checkpoint it would "
        f"load, is damaged: iter_0000002/{why}; the newest intact checkpoint beside it: {d / 'iter_0000001'}"]
    # Megatron-LM's tracker alone (no latest_train_state.pt)
    (d / "latest_train_state.pt").unlink()
    assert problems(load=str(d))[0].startswith(
        f"checkpoint.load={d}: iter_0000002 (named by latest_checkpointed_iteration.txt), the checkpoint it would "
        "load, is damaged: ")
    # Bridge's tracker cut short (a fresh copy: Bridge's read_train_state is an lru_cache keyed by file name)
    d2 = tmp_path / "tracker_cut"
    shutil.copytree(ckpt, d2)
    os.truncate(d2 / "latest_train_state.pt", 100)
    got = problems(load=str(d2))
    assert len(got) == 1 and got[0].startswith(f"checkpoint.load={d2}: latest_train_state.pt cannot be read ("), got
