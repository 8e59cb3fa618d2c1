"""``nemo-longctx bridge`` probes where it writes before launch, as the NeMo 2 app does
(``nemo_longctx.shared.path_checks``): ``output_dir`` that is a file, and a ``checkpoint.save`` that cannot be created
when the run saves, each exit 2 with one line naming the key, no traceback, no rank started."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest
from runner import ROOT, rank_server_env

pytest.importorskip("megatron.bridge", reason="the Megatron-Bridge stack (scripts/install_bridge.sh)")


@pytest.mark.smoke
def test_unwritable_output_dir_and_checkpoint_save_are_refused_before_launch(tmp_path):
    f = tmp_path / "a_file"
    f.write_text("x")
    bad = "/proc/nemo_longctx_test/save"
    for args, line in (([f"output_dir={f}"], f"output_dir={f}: is a file, not a directory"),
                       ([f"output_dir={tmp_path / 'out'}", f"checkpoint.save={bad}", "checkpoint.save_interval=1"],
                        f"checkpoint.save={bad}: cannot be created in /proc")):
        p = subprocess.run([sys.executable, "-m", "nemo_longctx.apps.bridge", *args], capture_output=True, text=True,
                           timeout=300, cwd=ROOT, env={**os.environ, **rank_server_env()})
        out = p.stdout + p.stderr
        assert p.returncode == 2 and line in out, out[-3000:]
        assert "Traceback" not in out and "step 1" not in out, out[-3000:]
    assert f.read_text() == "x" and not (tmp_path / "out" / "metrics.jsonl").exists()
