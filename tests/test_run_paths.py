"""Where a run writes and what it resumes from, checked before launch: ``output_dir`` and ``checkpoint.dir`` probed
for a real write, room for the checkpoints kept, ``checkpoint.resume`` naming a checkpoint (not the folder of them), a
model field of the wrong kind and the ``==`` typo -- each refused in the launching process with exit 2, one line naming
the key, and no traceback (``nemo_longctx/shared/path_checks.py``, ``app.run_path_problems``,
``app.model_field_problems``, ``overrides.quote_path_values``)."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from nemo_longctx.integrations.nemo.app import preflight
from nemo_longctx.shared.overrides import quote_path_values
from nemo_longctx.shared.path_checks import checkpoint_folder_hint, free_space_problem, writable_dir_problem

NL = str(Path(sys.executable).parent / "nemo-longctx")


def _one(problems, *needles):
    hits = [p for p in problems if all(n in p for n in needles)]
    assert len(hits) == 1, problems
    return hits[0]


def test_output_dir_that_is_a_file_or_cannot_be_created(tmp_path):
    f = tmp_path / "a_file"
    f.write_text("x")
    _one(preflight([f"output_dir={f}"]), f"output_dir={f}", "is a file")
    _one(preflight([f"output_dir={f}/sub"]), f"output_dir={f}/sub", "cannot be created", "is a file")
    _one(preflight(["output_dir=/proc/nemo_longctx_test/out"]), "output_dir=/proc/nemo_longctx_test/out",
         "cannot be created in /proc")
    assert preflight([f"output_dir={tmp_path / 'new' / 'deeper'}"]) == []
    assert not (tmp_path / "new").exists()  # the probe leaves nothing behind
    assert sorted(p.name for p in tmp_path.iterdir()) == ["a_file"]


def test_checkpoint_dir_probed_only_when_the_run_saves(tmp_path):
    bad = "/proc/nemo_longctx_test/ckpt"
    _one(preflight([f"output_dir={tmp_path}", "checkpoint.every_n_steps=1", f"checkpoint.dir={bad}"]),
         f"checkpoint.dir={bad}", "cannot be created")
    assert preflight([f"output_dir={tmp_path}", f"checkpoint.dir={bad}"]) == []  # saves nothing: not written


@pytest.mark.skipif(os.geteuid() == 0, reason="root writes through permission bits")
def test_unwritable_directory_is_named(tmp_path):
    ro = tmp_path / "ro"
    ro.mkdir()
    ro.chmod(0o500)
    try:
        msg = writable_dir_problem("checkpoint.dir", str(ro))
        assert msg is not None and "is not writable" in msg and "Permission denied" in msg
    finally:
        ro.chmod(0o700)


def test_room_for_the_checkpoints_kept(tmp_path):
    # the tiny demo's checkpoint (weights + fp32 master + Adam moments, planner estimate) x a keep no disk holds
    msg = _one(preflight([f"output_dir={tmp_path}", "checkpoint.every_n_steps=1", "checkpoint.keep=100000000"]),
               f"output_dir={tmp_path}", "free on its filesystem", "checkpoint.keep=100000000")
    assert "lower checkpoint.keep" in msg
    assert preflight([f"output_dir={tmp_path}", "checkpoint.every_n_steps=1"]) == []
    assert free_space_problem("checkpoint.dir", str(tmp_path), 1.0, "x") is None


def test_resume_must_name_a_checkpoint(tmp_path):
    folder = tmp_path / "checkpoints"
    for name in ("step=1-consumed_samples=2.0", "step=3-consumed_samples=6.0", "step=3-consumed_samples=6.0-last"):
        (folder / name / "weights").mkdir(parents=True)
    (folder / "step=4-consumed_samples=8.0").mkdir()  # no weights: not a checkpoint
    msg = _one(preflight([f"checkpoint.resume={folder}"]), f"checkpoint.resume={folder}", "holds checkpoints")
    assert str(folder / "step=3-consumed_samples=6.0-last") in msg and "checkpoint.resume=auto" in msg
    _one(preflight([f"checkpoint.resume={tmp_path / 'nothing'}"]), "is neither auto/never nor an existing")
    assert "not a checkpoint" in checkpoint_folder_hint(str(tmp_path / "checkpoints" / "step=4-consumed_samples=8.0"))
    one = quote_path_values([f"checkpoint.resume={folder}/step=3-consumed_samples=6.0-last"])
    # a checkpoint's own directory (its name holds '=': quoted as a path) is not a folder of them; these stand-ins
    # have no metadata, so the integrity check (checkpoint_integrity) is the one left to refuse it
    _one(preflight(one), "step=3-consumed_samples=6.0-last: this checkpoint is damaged")


def test_model_fields_of_the_wrong_kind_and_the_double_equals_typo():
    _one(preflight(["model.seq_length=4k"]), "model.seq_length='4k'", "must be an integer")
    _one(preflight(["model.init_method_std=fast"]), "model.init_method_std='fast'", "must be a number")
    _one(preflight(["model.add_bias_linear=3"]), "model.add_bias_linear=3", "true or false")
    assert preflight(["model.init_method_std=1"]) == []  # an int where a number goes
    # '==' is a typo, not a path: it stays unquoted and Hydra's grammar names it
    assert quote_path_values(["model.seq_length==4096"]) == ["model.seq_length==4096"]
    _one(preflight(quote_path_values(["model.seq_length==4096"])), "'model.seq_length==4096' is not a valid override")


def test_the_cli_exits_2_with_one_line_and_no_traceback(tmp_path):
    f = tmp_path / "a_file"
    f.write_text("x")
    r = subprocess.run([NL, "train", f"output_dir={f}", "model.seq_length=4k"], capture_output=True, text=True,
                       timeout=120)
    assert r.returncode == 2, r.stderr[-2000:]
    assert f"output_dir={f}: is a file" in r.stderr and "model.seq_length='4k': must be an integer" in r.stderr
    assert "Traceback" not in r.stderr + r.stdout
    assert f.read_text() == "x"
