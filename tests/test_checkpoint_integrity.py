"""A checkpoint is verified before it is loaded (``nemo_longctx.shared.checkpoint_integrity``; the NeMo 2 app's
auto-resume and ``checkpoint.resume=<path>``).

Units: ``checkpoint_problem`` on a real checkpoint written by ``torch.distributed.checkpoint`` (intact; one storage
file cut short; one missing; ``.metadata`` missing or cut short), and on the NeMo 2 app's own checkpoints
(Megatron-core's ``common.pt`` and ``metadata.json`` too).

App (real processes, gloo): ``full`` is the default job's shared uninterrupted run (tests/default_job.py: 6 steps, a
checkpoint every 2 steps). ``damaged``: an output directory holding ``full``'s checkpoints of steps 2 and 4 -- a run of
the same schedule that trained 4 steps -- whose newest checkpoint (and its ``-last`` copy, as NeMo writes one at the
end of a run) has one shard cut short. The same command and the default ``checkpoint.resume=auto`` names the damaged
checkpoints it skips, resumes from step 2's, trains steps 3..6 and exits 0; their losses equal ``full``'s bit for bit
(fp32). ``checkpoint.resume=<the damaged checkpoint>`` is refused in the
launching process (exit 2, the key, the path and the reason in one line, no traceback, no rank started).
"""

from __future__ import annotations

import os
import shutil
import sys
from pathlib import Path

import pytest
import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.api import CheckpointException

from app_runner import leftover_processes, metrics_rows, run_app
from default_job import COMMON, STEPS, uninterrupted
from nemo_longctx.shared.checkpoint_integrity import checkpoint_problem
from nemo_longctx.shared.resume_checks import newest_intact

BIN = Path(sys.executable).parent
APP = [str(BIN / "nemo-longctx"), "train"]
SAVED = (2, 4)  # the default job's checkpoints that ``_plant_damaged`` copies (it saves every 2 steps)


# ------------------------------------------------------------------------------------------- torch DCP units
@pytest.fixture
def dcp_checkpoint(tmp_path):
    """A real torch distributed checkpoint (one process: torch DCP's no-process-group path)."""
    d = tmp_path / "dcp"
    g = torch.Generator().manual_seed(0)
    state = {"w": torch.randn(256, 64, generator=g), "b": torch.randn(64, generator=g), "step": torch.tensor(3)}
    dcp.save(state, storage_writer=dcp.FileSystemWriter(str(d)), no_dist=True)
    return d


def _shards(d: Path) -> list:
    return sorted(p for p in d.iterdir() if p.suffix == ".distcp")


def test_intact_torch_checkpoint_has_no_problem(dcp_checkpoint):
    assert _shards(dcp_checkpoint) and (dcp_checkpoint / ".metadata").is_file()
    assert checkpoint_problem(str(dcp_checkpoint)) is None
    loaded = {"w": torch.zeros(256, 64), "b": torch.zeros(64), "step": torch.tensor(0)}
    dcp.load(loaded, storage_reader=dcp.FileSystemReader(str(dcp_checkpoint)), no_dist=True)  # it does load
    assert int(loaded["step"]) == 3


def test_nemo_fsdp_dtensor_layout_needs_its_common_state(dcp_checkpoint):
    """NeMo 2's Megatron-FSDP checkpoint (fsdp_dtensor): the DCP files in the step directory itself beside
    context/, no metadata.json, then NeMo's common.pt (written after the DCP save): whole = intact; missing or cut
    off = damaged; without .metadata the DCP save did not finish."""
    (dcp_checkpoint / "context").mkdir()
    torch.save({"global_step": 4}, dcp_checkpoint / "common.pt")
    assert checkpoint_problem(str(dcp_checkpoint)) is None
    full = (dcp_checkpoint / "common.pt").stat().st_size
    os.truncate(dcp_checkpoint / "common.pt", full - 10)
    assert checkpoint_problem(str(dcp_checkpoint)).startswith("common.pt is cut off")
    (dcp_checkpoint / "common.pt").unlink()
    assert checkpoint_problem(str(dcp_checkpoint)).startswith("common.pt is missing (NeMo writes it after")
    torch.save({"global_step": 4}, dcp_checkpoint / "common.pt")
    (dcp_checkpoint / ".metadata").unlink()
    assert checkpoint_problem(str(dcp_checkpoint)) == ".metadata is missing"


def test_a_truncated_shard_is_named_with_its_size_and_the_size_its_metadata_needs(dcp_checkpoint):
    shard = _shards(dcp_checkpoint)[0]
    full = shard.stat().st_size
    os.truncate(shard, full - 1)
    assert checkpoint_problem(str(dcp_checkpoint)) == f"{shard.name} is {full - 1} bytes, its metadata needs {full}"
    loaded = {"w": torch.zeros(256, 64), "b": torch.zeros(64), "step": torch.tensor(0)}
    with pytest.raises(CheckpointException):  # what the check saves a run from: the load itself fails
        dcp.load(loaded, storage_reader=dcp.FileSystemReader(str(dcp_checkpoint)), no_dist=True)


def test_a_missing_shard_is_named(dcp_checkpoint):
    shard = _shards(dcp_checkpoint)[0]
    size = shard.stat().st_size
    shard.unlink()
    assert checkpoint_problem(str(dcp_checkpoint)) == f"{shard.name} is missing (its metadata lists {size} bytes)"


def test_missing_or_truncated_metadata_is_named(dcp_checkpoint):
    meta = dcp_checkpoint / ".metadata"
    data = meta.read_bytes()
    meta.write_bytes(data[: len(data) // 2])
    why = checkpoint_problem(str(dcp_checkpoint))
    assert why is not None and why.startswith(".metadata cannot be read ("), why
    meta.unlink()
    assert checkpoint_problem(str(dcp_checkpoint)) == ".metadata is missing"
    assert checkpoint_problem(str(dcp_checkpoint / "nothing")) == "no such directory"


# ------------------------------------------------------------------------------------------- the NeMo 2 app
def _ckpt(out_dir: Path, steps: int, last: bool = False) -> Path:
    """The checkpoint saved after ``steps`` steps (NeMo names it by its 0-based step), or its ``-last`` copy."""
    found = [p for p in (out_dir / "checkpoints").glob(f"step={steps - 1}-*") if p.name.endswith("-last") == last]
    assert len(found) == 1, sorted(p.name for p in (out_dir / "checkpoints").iterdir())
    return found[0]


def _losses(out_dir: Path) -> dict:
    return {r["step"]: r["loss"] for r in metrics_rows(out_dir) if "loss" in r}


def _plant_damaged(full: Path, out_dir: Path) -> dict:
    """``out_dir``/checkpoints as a run of ``full``'s schedule leaves it after 4 steps (``full``'s checkpoints of steps
    2 and 4, the newest also as NeMo's -last copy), then one shard of the newest and of its -last copy cut to 1000
    bytes. Returns the newest, its -last copy and {name: (shard, its size before)}."""
    (out_dir / "checkpoints").mkdir(parents=True)
    for steps in SAVED:
        shutil.copytree(_ckpt(full, steps), out_dir / "checkpoints" / _ckpt(full, steps).name)
    newest = out_dir / "checkpoints" / _ckpt(full, SAVED[-1]).name
    newest_last = newest.with_name(newest.name + "-last")
    shutil.copytree(newest, newest_last)
    cut = {}
    for d in (newest, newest_last):
        shard = sorted((d / "weights").glob("*.distcp"))[1]
        cut[d.name] = (shard.relative_to(d), shard.stat().st_size)
        os.truncate(shard, 1000)
    return {"newest": newest, "newest_last": newest_last, "cut": cut}


def _damaged(planted: dict, d: Path) -> str:
    shard, size = planted["cut"][d.name]
    return f"damaged ({shard} is 1000 bytes, its metadata needs {size})"


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    full, damaged = uninterrupted(tmp_path_factory), tmp_path_factory.mktemp("integrity") / "damaged"
    planted = _plant_damaged(full, damaged)
    code, resumed_out = run_app(APP + [f"output_dir={damaged}", *COMMON], 420)
    return {"full": full, "damaged": damaged, "planted": planted, "resumed": (code, resumed_out),
            "leftovers": leftover_processes()}


def test_auto_resume_skips_a_damaged_checkpoint_naming_it_and_continues_the_same_run(runs):
    code, out = runs["resumed"]
    assert code == 0, out[-4000:]
    assert runs["leftovers"] == []
    planted = runs["planted"]
    lines = out.splitlines()
    skips = [ln for ln in lines if ln.startswith("nemo-longctx: auto-resume skips ")]
    # newest first: the -last copy, then its twin
    assert skips == [f"nemo-longctx: auto-resume skips {d.name}: {_damaged(planted, d)}"
                     for d in (planted["newest_last"], planted["newest"])], out[-4000:]
    resumed_line = next(ln for ln in lines if ln.startswith("nemo-longctx: resumed at"))
    # after step 2, from its checkpoint (NeMo names it by its 0-based step)
    assert resumed_line.startswith("nemo-longctx: resumed at step 2 from ") and "/step=1-" in resumed_line, resumed_line
    full, resumed = _losses(runs["full"]), _losses(runs["damaged"])
    assert sorted(full) == list(range(1, STEPS + 1)) and sorted(resumed) == [3, 4, 5, 6], (full, resumed)
    for step in (3, 4, 5, 6):
        assert resumed[step] == full[step], (step, resumed[step], full[step])  # fp32: bit-equal
    assert len({full[s] for s in (3, 4, 5, 6)}) == 4  # not vacuous: the loss moves step to step


def test_explicit_resume_of_a_damaged_checkpoint_is_refused_before_any_rank(runs, tmp_path):
    planted = _plant_damaged(runs["full"], tmp_path / "planted")
    damaged, out_dir = planted["newest"], tmp_path / "explicit"
    code, out = run_app(APP + [f"output_dir={out_dir}", *COMMON, f"checkpoint.resume={damaged}"], 180)
    assert code == 2, out[-3000:]
    lines = [ln for ln in out.splitlines() if "checkpoint.resume=" in ln]
    assert len(lines) == 1, out[-3000:]
    shard, size = planted["cut"][damaged.name]
    assert (f"checkpoint.resume={damaged}: this checkpoint is damaged: {shard} is 1000 bytes, its metadata needs "
            f"{size}; the newest intact checkpoint beside it: {_ckpt(tmp_path / 'planted', 2)}") in lines[0], lines[0]
    assert "Traceback" not in out and "spawning" not in out, out[-3000:]
    assert not (out_dir / "rank_logs").exists()


def test_checkpoint_problem_on_the_apps_checkpoints(runs, tmp_path):
    """NeMo 2's layout (``weights/`` beside ``context/``) and Megatron-core's own files in it; the choice among the
    checkpoints of a directory, unfinished and damaged ones skipped with their reasons."""
    src = _ckpt(runs["full"], STEPS)
    assert checkpoint_problem(str(src)) is None and checkpoint_problem(str(src / "weights")) is None
    assert checkpoint_problem(str(_ckpt(runs["full"], STEPS, last=True))) is None
    d = tmp_path / src.name
    shutil.copytree(src, d)
    common = d / "weights" / "common.pt"
    os.truncate(common, common.stat().st_size // 2)
    assert checkpoint_problem(str(d)) == (f"weights/common.pt is cut off ({common.stat().st_size} bytes, no zip end "
                                          "record)")
    (d / "weights" / "metadata.json").unlink()
    assert checkpoint_problem(str(d)).startswith("weights/metadata.json is missing")
    shutil.rmtree(d / "weights")
    assert checkpoint_problem(str(d)) == "weights is missing"
    # a newer unfinished checkpoint (NeMo's marker file beside it), the damaged newest and its -last copy: skipped,
    # each with its reason; step 2's chosen
    planted = _plant_damaged(runs["full"], tmp_path / "planted")
    ckpts = tmp_path / "planted" / "checkpoints"
    unfinished = ckpts / _ckpt(runs["full"], STEPS).name  # newer than every planted one
    shutil.copytree(_ckpt(runs["full"], STEPS), unfinished)
    Path(f"{unfinished}-unfinished").touch()
    assert newest_intact(str(ckpts)) == (_ckpt(tmp_path / "planted", 2), [
        (unfinished.name, "unfinished (its save was cut off)"),
        *[(p.name, _damaged(planted, p)) for p in (planted["newest_last"], planted["newest"])]])
