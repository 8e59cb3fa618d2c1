"""A real single-node Slurm for the tests (scripts/slurm_local.sh: munge, slurmctld, slurmd on localhost), shared by
tests/test_slurm_e2e.py (NeMo stack) and tests_bridge/test_bridge_slurm.py (Bridge stack; it puts tests/ on its path).

``slurm_cluster``: a module-scoped pytest fixture that brings Slurm up (and down again if it started it); skipped
with the reason when Slurm is missing and cannot be installed (root or sudo, and apt-get), a failure instead with
NEMO_LONGCTX_REQUIRE_SLURM=1 (set by .ci/run). ``slurm(*args)`` runs the script (``up``, ``status``, ``wait JOB S``)."""

import os
import shutil
import subprocess
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
SCRIPT = ROOT / "scripts" / "slurm_local.sh"
REQUIRED = os.environ.get("NEMO_LONGCTX_REQUIRE_SLURM") == "1"


def why_not_installable():
    if shutil.which("sbatch") and shutil.which("slurmctld") and shutil.which("slurmd"):
        return None
    if os.geteuid() != 0 and not shutil.which("sudo"):
        return "slurm is not installed and this user is not root (no sudo) to install it"
    if not shutil.which("apt-get"):
        return "slurm is not installed and apt-get is not available to install it"
    return None


def slurm(*args, timeout=600):
    return subprocess.run(["bash", str(SCRIPT), *args], capture_output=True, text=True, timeout=timeout)


@pytest.fixture(scope="module")
def slurm_cluster():
    reason = why_not_installable()
    if reason:
        if REQUIRED:
            pytest.fail(f"NEMO_LONGCTX_REQUIRE_SLURM=1 but {reason}")
        pytest.skip(reason)
    was_up = slurm("status", timeout=30).returncode == 0
    r = slurm("up")
    if r.returncode != 0:
        msg = f"single-node slurm bring-up failed (rc={r.returncode}):\n{r.stdout}\n{r.stderr[-3000:]}"
        if REQUIRED:
            pytest.fail(msg)
        pytest.skip(msg)
    yield
    if not was_up:  # leave no daemons behind that this test started
        slurm("down", timeout=120)
