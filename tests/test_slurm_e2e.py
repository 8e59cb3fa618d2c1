"""End to end on a real single-node Slurm (scripts/slurm_local.sh: munge, slurmctld, slurmd on localhost):
submit examples/slurm/cpu_demo.sbatch, wait for it, check its metrics.jsonl.

Needs root (or sudo) and apt-get to install Debian's slurm packages when they are missing; skipped with the reason
otherwise. With NEMO_LONGCTX_REQUIRE_SLURM=1 (set by .ci/run) a failed bring-up is a failure, not a skip.
"""

import json
import math
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest

from slurm_cluster import slurm as _slurm
from slurm_cluster import slurm_cluster  # noqa: F401  (the fixture)

# one file uses the single-node Slurm (--dist loadfile keeps its jobs on one worker, one after the other); its waits
# are bounded by the job, not by the machine's load, so it runs in the parallel part

ROOT = Path(__file__).resolve().parents[1]
DEMO = ROOT / "examples" / "slurm" / "cpu_demo.sbatch"
MAX_STEPS = 16  # the CPU demo's jobs (uninterrupted, and preempted + requeued)
PLAN_STEPS = 3


def _submit(script, tmp_path, env, wait_s=420):
    """sbatch ``script`` from ``tmp_path`` and wait for it: (job id, the wait's result, the job's output text)."""
    sub = subprocess.run(["sbatch", "--parsable", f"--chdir={tmp_path}", str(script)], env=env,
                         capture_output=True, text=True, timeout=60)
    assert sub.returncode == 0, sub.stderr
    job = sub.stdout.strip().split(";")[0]
    waited = _slurm("wait", job, str(wait_s), timeout=wait_s + 60)
    log = next(tmp_path.glob(f"*-{job}.out"), None)
    return job, waited, log.read_text() if log else "(no job output file)"


def _demo_env(out_dir, steps, overrides="model.seq_length=1024"):
    nemo_longctx = Path(sys.executable).with_name("nemo-longctx")
    assert nemo_longctx.exists(), f"console script missing next to {sys.executable}"
    return dict(os.environ, NEMO_LONGCTX=str(nemo_longctx), OUTPUT_DIR=str(out_dir), MAX_STEPS=str(steps),
                EXTRA_OVERRIDES=overrides, MEM_LIMIT_KB=str(8 * 1024 * 1024), SAVE_EVERY="100")


def _rows(out_dir):
    return [json.loads(line) for line in (out_dir / "metrics.jsonl").read_text().splitlines() if line.strip()]


@pytest.fixture(scope="module")
def demo_job(slurm_cluster, tmp_path_factory):
    """The CPU demo sbatch, uninterrupted: (job id, wait result, output text, metrics rows)."""
    tmp_path = tmp_path_factory.mktemp("demo")
    job, waited, log_text = _submit(DEMO, tmp_path, _demo_env(tmp_path / "out", MAX_STEPS))
    assert waited.returncode == 0, f"job {job} failed: {waited.stderr}\n--- job output (tail):\n{log_text[-5000:]}"
    return job, waited, log_text, _rows(tmp_path / "out")


def test_cpu_demo_sbatch_trains_under_srun(demo_job):
    job, waited, log_text, rows = demo_job

    # the ranks were the two srun tasks: the app did not fall back to spawning its own processes
    assert "spawning" not in log_text, log_text[-3000:]
    assert "2 tasks" in log_text
    assert [r["step"] for r in rows] == list(range(1, MAX_STEPS + 1))
    for r in rows:
        assert math.isfinite(r["loss"]) and 0 < r["loss"] < 20
        assert r["tokens_per_s"] > 0
        assert r.get("world_size", 2) == 2 and r.get("cp_size", 2) == 2


def test_a_failing_rank_fails_the_slurm_job(slurm_cluster, tmp_path):
    """A rank raising at step 2 under srun: the job ends FAILED with a non-zero exit code (not COMPLETED)."""
    job, waited, log_text = _submit(DEMO, tmp_path, _demo_env(tmp_path / "out", 4,
                                                              "model.seq_length=1024 run.fault=raise@2:1"))
    assert waited.returncode not in (0, 124), f"job {job}: {waited.stderr}\n{log_text[-3000:]}"
    assert "FAILED" in waited.stderr or "FAILED" in waited.stdout, waited.stderr
    assert "injected failure (run.fault) on rank 1 at step 2" in log_text, log_text[-3000:]


def test_planner_written_sbatch_installs_the_plugin_and_trains(slurm_cluster, tmp_path):
    """The sbatch `nemo-longctx plan` writes, in its CPU form (plan.target=cpu: no GPUs, no container, gloo), on the
    local Slurm: the job installs nemo_longctx from this checkout with `pip install --no-deps` into its run directory
    and trains with that install's `nemo-longctx train` (the GPU form runs the same lines inside the NGC image)."""
    out_dir, sb = tmp_path / "out", tmp_path / "plan.sbatch"
    nemo_longctx = Path(sys.executable).with_name("nemo-longctx")
    r = subprocess.run([str(nemo_longctx), "plan", "model=tiny_llama", "plan.seq_length=2048", "plan.gpus=2",
                        "plan.gpu_memory_gb=4", "plan.reserve_gb=0.5", "plan.target=cpu", f"plan.write_sbatch={sb}"],
                       cwd=tmp_path, capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stdout + r.stderr
    text = sb.read_text()
    assert "pip install --no-deps" in text and "--gpus-per-node" not in text and "IMAGE=${IMAGE-}" in text
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    env.update(PYTHON=sys.executable, OUTPUT_DIR=str(out_dir), EXTRA_OVERRIDES=f"trainer.max_steps={PLAN_STEPS}")
    job, waited, log_text = _submit(sb, tmp_path, env, wait_s=480)
    assert waited.returncode == 0, f"job {job} failed: {waited.stderr}\n--- job output (tail):\n{log_text[-5000:]}"
    site = out_dir / ".nemo_longctx_site"
    assert (site / "nemo_longctx" / "__init__.py").exists() and (site / "bin" / "nemo-longctx").exists()
    assert f"from {site}/nemo_longctx/__init__.py" in log_text, log_text[-3000:]  # the job imported its install
    assert "spawning" not in log_text
    rows = [json.loads(line) for line in (out_dir / "metrics.jsonl").read_text().splitlines() if line.strip()]
    assert [row["step"] for row in rows] == list(range(1, PLAN_STEPS + 1))
    assert all(math.isfinite(row["loss"]) and row["world_size"] == 2 for row in rows)


def _job_field(job, name):
    info = subprocess.run(["scontrol", "-o", "show", "job", job], capture_output=True, text=True, timeout=30).stdout
    return next((f.split("=", 1)[1] for f in info.split() if f.startswith(name + "=")), "")


def test_a_preempted_demo_job_saves_requeues_and_resumes(demo_job, tmp_path):
    """`scancel --signal=USR1 --batch` mid-run (what Slurm's --signal=B:USR1@30 does before the time limit): the
    batch script passes USR1 to srun, the ranks save the step they are in and exit 75, the script requeues the job,
    and the requeued job resumes from that checkpoint and finishes. Its metrics read as one run equal to the
    uninterrupted job's (<= 1e-6). Slurm holds a requeued batch job ~2 min before it may start again; the test
    releases it after 3 s (scontrol update StartTime=now+3): slurmd refuses a batch launch whose credential was made in
    the same second as the revocation of the killed run's ("Killing non-startable batch job: Job credential revoked",
    the job then ends FAILED instead of running again) -- the reason Slurm holds it at all."""
    out_dir = tmp_path / "out"
    env = _demo_env(out_dir, MAX_STEPS, "model.seq_length=1024 memory.track=false")
    # SAVE_EVERY=100 (_demo_env): checkpointing on, no periodic save: the only checkpoint is the preemption's
    sub = subprocess.run(["sbatch", "--parsable", f"--chdir={tmp_path}", str(DEMO)], env=env, capture_output=True,
                         text=True, timeout=60)
    assert sub.returncode == 0, sub.stderr
    job = sub.stdout.strip().split(";")[0]
    deadline = time.monotonic() + 300
    while time.monotonic() < deadline:
        if (out_dir / "metrics.jsonl").exists() and len(_rows(out_dir)) >= 2:
            break
        time.sleep(0.2)
    signalled = subprocess.run(["scancel", "--signal=USR1", "--batch", job], capture_output=True, text=True, timeout=30)
    assert signalled.returncode == 0, signalled.stderr
    while time.monotonic() < deadline + 300:
        if _job_field(job, "Restarts") not in ("", "0") and _job_field(job, "JobState") == "PENDING":
            subprocess.run(["scontrol", "update", f"JobId={job}", "StartTime=now+3"], timeout=30)
            break
        if _job_field(job, "JobState") not in ("RUNNING", "COMPLETING", "PENDING", "REQUEUED", "CONFIGURING"):
            break  # ended without a requeue: the assertions below say why
        time.sleep(0.5)
    waited = _slurm("wait", job, "420", timeout=480)
    log_text = next(tmp_path.glob(f"*-{job}.out")).read_text()
    assert waited.returncode == 0, f"job {job}: {waited.stderr}\n{log_text[-5000:]}"
    assert _job_field(job, "Restarts") == "1", log_text[-3000:]
    line = next((ln for ln in log_text.splitlines() if ln.startswith("nemo-longctx: preempted at step")), None)
    assert line is not None, log_text[-5000:]
    step = int(line.split("preempted at step ")[1].split(",")[0])
    assert 1 <= step < MAX_STEPS, line
    assert f"job {job}: preempted, checkpoint saved: requeueing it to resume" in log_text
    assert f"job {job} (restart 1):" in log_text and f"nemo-longctx: resumed at step {step} from " in log_text
    rows = _rows(out_dir)
    assert [r["step"] for r in rows] == list(range(1, MAX_STEPS + 1))  # one run
    ref = {r["step"]: r["loss"] for r in demo_job[3]}
    for r in rows:
        assert abs(r["loss"] - ref[r["step"]]) <= 1e-6 * abs(ref[r["step"]]), (r["step"], r["loss"], ref[r["step"]])


def test_a_nemo_run_slurm_executor_sbatch_trains_the_recipe_with_the_plugin_like_the_app(slurm_cluster, tmp_path):
    """NeMo's llama3_8b recipe (shrunk, tests/nemo_run_recipes.py) with LongContextPlugin under NeMo-Run's
    SlurmExecutor: the sbatch script of its dry run, submitted to the local Slurm as NeMo-Run would (sbatch), trains
    3 steps under srun + torchrun with the same per-step losses as ``nemo-longctx train``."""
    sys.path.insert(0, str(ROOT / "tests"))
    from nemo_run_recipes import APP_ARGS

    env = dict(os.environ, NEMORUN_HOME=str(tmp_path / "nemorun_home"),
               PATH=str(Path(sys.executable).parent) + os.pathsep + os.environ["PATH"])
    out, sbatch = tmp_path / "out", tmp_path / "job.sbatch"
    made = subprocess.run([sys.executable, str(ROOT / "tests" / "nemo_run_recipes.py"), "--slurm-sbatch", str(out),
                           str(sbatch)], env=env, capture_output=True, text=True, timeout=300)
    assert made.returncode == 0, made.stdout[-2000:] + made.stderr[-3000:]
    script = sbatch.read_text()
    assert "#SBATCH --partition=local" in script and "torchrun" in script and "--nproc-per-node 2" in script
    sub = subprocess.run(["sbatch", "--parsable", f"--chdir={tmp_path}", str(sbatch)], env=env, capture_output=True,
                         text=True, timeout=60)
    assert sub.returncode == 0, sub.stderr
    job = sub.stdout.strip().split(";")[0]
    waited = _slurm("wait", job, "420", timeout=480)
    logs = "\n".join(p.read_text(errors="replace")[-3000:] for p in (tmp_path / "nemorun_home").rglob("*.out"))
    assert waited.returncode == 0, f"job {job} failed: {waited.stderr}\n{logs}"
    losses = [r["loss"] for r in _rows(out / "nemo_longctx")]
    app = tmp_path / "app"
    ran = subprocess.run([sys.executable, "-m", "nemo_longctx", "train", *APP_ARGS, "cp=ring", "cp.size=2",
                          "recompute=full", "offload=layer_input", f"output_dir={app}"], cwd=ROOT,
                         capture_output=True, text=True, timeout=400)
    assert ran.returncode == 0, ran.stdout[-3000:] + ran.stderr[-3000:]
    assert len(losses) == 3 and losses == pytest.approx([r["loss"] for r in _rows(app)], rel=1e-6, abs=0)
