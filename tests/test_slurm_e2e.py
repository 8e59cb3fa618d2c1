"""End to end on a real single-node Slurm (scripts/slurm_local.sh: munge, slurmctld, slurmd on localhost):
submit examples/slurm/cpu_demo.sbatch, wait for it, check its metrics.jsonl; the GPU jobs (examples/slurm/*.sbatch and
the one `plan.write_sbatch` writes) in their documented variable forms, without a container (IMAGE=), on 2 CPU tasks
with a shrunk model and a tiny indexed dataset + tokenizer made here; the planner's job preempted, requeued and
resumed.

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
PLAN_STEPS = 6  # the planner's preempted job (its plan trains in bf16: slower steps on CPUs)
# the GPU jobs' sbatch options on the local Slurm's one CPU node: 2 tasks of 1 CPU, no GPUs
ON_CPUS = ("--ntasks-per-node=2", "--cpus-per-task=1", "--gpus-per-node=0")
# the CPU form of a GPU job's overrides (2 gloo ranks, fp32)
CPU = ("trainer.accelerator=cpu launcher.backend=gloo trainer.precision=32 cp.size=2 data.num_workers=0 "
       "memory.track=false")


def _submit(script, tmp_path, env, wait_s=420, sbatch_args=()):
    """sbatch ``script`` from ``tmp_path`` and wait for it: (job id, the wait's result, the job's output text)."""
    sub = subprocess.run(["sbatch", "--parsable", f"--chdir={tmp_path}", *sbatch_args, str(script)], env=env,
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


def _job_field(job, name):
    info = subprocess.run(["scontrol", "-o", "show", "job", job], capture_output=True, text=True, timeout=30).stdout
    return next((f.split("=", 1)[1] for f in info.split() if f.startswith(name + "=")), "")


def _preempted(script, tmp_path, env, out_dir):
    """Submit ``script``, signal its batch shell (`scancel --signal=USR1 --batch`, what Slurm's --signal=B:USR1@N does
    before the time limit) once it has logged 2 steps, release the requeued job and wait for it: (job id, the wait's
    result, the output text). Slurm holds a requeued batch job ~2 min before it may start again; this releases it
    after 3 s (scontrol update StartTime=now+3): slurmd refuses a batch launch whose credential was made in the same
    second as the revocation of the killed run's ("Killing non-startable batch job: Job credential revoked", the job
    then ends FAILED instead of running again) -- the reason Slurm holds it at all."""
    sub = subprocess.run(["sbatch", "--parsable", f"--chdir={tmp_path}", str(script)], env=env, capture_output=True,
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
    return job, waited, log_text


def _resumed_step(job, log_text, steps):
    """The step the preempted run saved, after checking the output says it saved, requeued and resumed there."""
    line = next((ln for ln in log_text.splitlines() if ln.startswith("nemo-longctx: preempted at step")), None)
    assert line is not None, log_text[-5000:]
    step = int(line.split("preempted at step ")[1].split(",")[0])
    assert 1 <= step < steps, line
    assert f"job {job}: preempted, checkpoint saved: requeueing it to resume" in log_text
    assert f"job {job} (restart 1)" in log_text and f"nemo-longctx: resumed at step {step} from " in log_text
    return step


def test_a_preempted_demo_job_saves_requeues_and_resumes(demo_job, tmp_path):
    """`scancel --signal=USR1 --batch` mid-run: the batch script passes USR1 to srun, the ranks save the step they
    are in and exit 75, the script requeues the job, and the requeued job resumes from that checkpoint and finishes.
    Its metrics read as one run equal to the uninterrupted job's (<= 1e-6)."""
    out_dir = tmp_path / "out"
    env = _demo_env(out_dir, MAX_STEPS, "model.seq_length=1024 memory.track=false")
    # SAVE_EVERY=100 (_demo_env): checkpointing on, no periodic save: the only checkpoint is the preemption's
    job, _, log_text = _preempted(DEMO, tmp_path, env, out_dir)
    _resumed_step(job, log_text, MAX_STEPS)
    rows = _rows(out_dir)
    assert [r["step"] for r in rows] == list(range(1, MAX_STEPS + 1))  # one run
    ref = {r["step"]: r["loss"] for r in demo_job[3]}
    for r in rows:
        assert abs(r["loss"] - ref[r["step"]]) <= 1e-6 * abs(ref[r["step"]]), (r["step"], r["loss"], ref[r["step"]])


# ------------------------------------------------------------------------------------------- the GPU jobs, on CPUs
@pytest.fixture(scope="module")
def corpus(tmp_path_factory):
    """A tiny corpus in the forms the jobs read: a local Hugging Face tokenizer (BPE, 300 tokens), a Megatron indexed
    dataset of 200 documents made with it (Megatron's IndexedDatasetBuilder, EOD after each), the same documents as
    JSONL and a 2-layer Llama saved with the tokenizer: {tokenizer, prefix, docs, hf_model}."""
    import torch
    from megatron.core.datasets.indexed_dataset import DType, IndexedDatasetBuilder

    sys.path.insert(0, str(ROOT / "tests"))
    from hf_models import corpus as texts
    from hf_models import make_hf_model, make_tokenizer

    d = tmp_path_factory.mktemp("corpus")
    tok = make_tokenizer(300)
    tok.save_pretrained(d / "tokenizer")
    prefix = d / "data" / "corpus_text_document"
    prefix.parent.mkdir()
    builder = IndexedDatasetBuilder(f"{prefix}.bin", dtype=DType.optimal_dtype(len(tok)))
    with open(d / "docs.jsonl", "w") as docs:
        for text in texts(200):
            ids = tok(text)["input_ids"] + [tok.eos_token_id]
            builder.add_document(torch.tensor(ids, dtype=torch.int64), [len(ids)])
            docs.write(json.dumps({"text": text}) + "\n")
    builder.finalize(f"{prefix}.idx")
    make_hf_model(d / "hf_llama", "llama", tok)
    return {"tokenizer": d / "tokenizer", "prefix": prefix, "docs": d / "docs.jsonl", "hf_model": d / "hf_llama"}


def _job_env(**env):
    """The environment of a GPU job run here: no container, this checkout and its python."""
    return dict(os.environ, IMAGE="", PYTHON=sys.executable, REPO=str(ROOT), **env)


def _hydra_config(out_dir):
    import yaml

    return yaml.safe_load((out_dir / ".hydra" / "config.yaml").read_text())


def test_llama3_8b_1m_job_trains_on_an_indexed_dataset_with_its_tokenizer(slurm_cluster, corpus, tmp_path):
    """examples/slurm/llama3_8b_1m.sbatch in its DATA_PREFIX + TOKENIZER form, with CHECKPOINT_DIR and
    EXTRA_OVERRIDES (Llama-3-8B shrunk to 2 layers of 64 at 256 tokens; ring CP=2 on 2 gloo ranks): it trains 2 steps
    on the indexed dataset, with its tokenizer, and saves its checkpoint to CHECKPOINT_DIR."""
    out_dir, ckpt = tmp_path / "out", tmp_path / "checkpoints"
    shrink = ("model.seq_length=256 ++model.num_layers=2 ++model.hidden_size=64 ++model.ffn_hidden_size=128 "
              "++model.num_attention_heads=4 ++model.num_query_groups=2 model.vocab_size=512 "
              "trainer.strategy.tensor_model_parallel_size=1 trainer.strategy.sequence_parallel=false "
              "tiling.loss_chunks=2 optim.use_distributed_optimizer=false")
    # (the shrunk model keeps the NeMo recipe of the model it stands for; its batch and steps are the test's)
    steps = "recipe=llama3_8b trainer.max_steps=2 trainer.global_batch_size=1 checkpoint.every_n_steps=2"
    env = _job_env(OUTPUT_DIR=str(out_dir), CHECKPOINT_DIR=str(ckpt), DATA_PREFIX=str(corpus["prefix"]),
                   TOKENIZER=str(corpus["tokenizer"]), EXTRA_OVERRIDES=f"{shrink} {CPU} {steps}")
    job, waited, log_text = _submit(ROOT / "examples/slurm/llama3_8b_1m.sbatch", tmp_path, env, sbatch_args=ON_CPUS)
    assert waited.returncode == 0, f"job {job} failed: {waited.stderr}\n--- job output (tail):\n{log_text[-5000:]}"
    assert "spawning" not in log_text and "image none" in log_text
    rows = _rows(out_dir)
    assert [r["step"] for r in rows] == [1, 2] and all(r["world_size"] == 2 and r["cp_size"] == 2 for r in rows)
    assert all(math.isfinite(r["loss"]) for r in rows)
    cfg = _hydra_config(out_dir)
    assert cfg["data"]["kind"] == "indexed" and cfg["data"]["paths"] == [str(corpus["prefix"])]
    assert cfg["data"]["tokenizer"] == str(corpus["tokenizer"]) and cfg["model"]["num_layers"] == 2
    assert cfg["checkpoint"]["dir"] == str(ckpt) and cfg["checkpoint"]["resume"] == "auto"
    assert [p.name for p in ckpt.iterdir() if p.name.startswith("step=")], list(ckpt.iterdir())


def test_the_planners_job_installs_the_plugin_trains_is_preempted_requeued_and_resumes(slurm_cluster, corpus,
                                                                                       tmp_path):
    """The sbatch `nemo-longctx plan ... plan.write_sbatch` writes, in its CPU form (plan.target=cpu: no GPUs, no
    container, gloo), for a tiny plan, on its indexed dataset + tokenizer: the job installs nemo_longctx from this
    checkout with `pip install --no-deps` into its run directory and trains with that install; `scancel --signal=USR1
    --batch` mid-run: the ranks save their step into the default checkpoint directory and exit 75, the job requeues
    itself, and the requeued job reinstalls, resumes from that step (checkpoint.resume=auto) and finishes."""
    out_dir, sb = tmp_path / "out", tmp_path / "plan.sbatch"
    nemo_longctx = Path(sys.executable).with_name("nemo-longctx")
    r = subprocess.run([str(nemo_longctx), "plan", "model=tiny_llama", "plan.seq_length=1024", "plan.gpus=2",
                        "plan.gpu_memory_gb=4", "plan.reserve_gb=0.5", "plan.target=cpu", f"plan.write_sbatch={sb}"],
                       cwd=tmp_path, capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stdout + r.stderr
    text = sb.read_text()
    assert "pip install --no-deps" in text and "--gpus-per-node" not in text and "IMAGE=${IMAGE-}" in text
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    # a tiny_* demo model saves checkpoints only when told: checkpointing on, no periodic save (the only checkpoint is
    # the preemption's)
    env.update(PYTHON=sys.executable, OUTPUT_DIR=str(out_dir), DATA_PREFIX=str(corpus["prefix"]),
               TOKENIZER=str(corpus["tokenizer"]),
               EXTRA_OVERRIDES=f"trainer.max_steps={PLAN_STEPS} checkpoint.every_n_steps=100 memory.track=false "
                               "data.num_workers=0")
    job, _, log_text = _preempted(sb, tmp_path, env, out_dir)
    site = out_dir / ".nemo_longctx_site"
    assert (site / "nemo_longctx" / "__init__.py").exists() and (site / "bin" / "nemo-longctx").exists()
    assert log_text.count(f"from {site}/nemo_longctx/__init__.py") == 2, log_text[-3000:]  # both runs: the install
    assert "spawning" not in log_text
    step = _resumed_step(job, log_text, PLAN_STEPS)
    assert f"nemo-longctx: resumed at step {step} from {out_dir}/checkpoints/" in log_text, log_text[-3000:]
    rows = _rows(out_dir)
    assert [row["step"] for row in rows] == list(range(1, PLAN_STEPS + 1))  # one run
    assert all(math.isfinite(row["loss"]) and row["world_size"] == 2 for row in rows)
    cfg = _hydra_config(out_dir)
    assert cfg["data"]["kind"] == "indexed" and cfg["data"]["tokenizer"] == str(corpus["tokenizer"])


def test_llama31_extension_job_imports_trains_and_exports(slurm_cluster, corpus, tmp_path):
    """examples/slurm/llama31_8b_extend_512k.sbatch with HF_MODEL (a 2-layer Llama), DOCS (JSONL), ROPE_BASE,
    MAX_STEPS and EXTRA_OVERRIDES (256 tokens, ring CP=2 on 2 gloo ranks, fp32): it imports the model, trains 2 steps
    on the documents tokenized with the model's tokenizer at the new RoPE base, saves, and exports to Hugging Face."""
    out_dir = tmp_path / "out"
    optim = ("optim.use_distributed_optimizer=false optim.use_precision_aware_optimizer=false "
             "optim.main_grads_dtype=fp32 optim.exp_avg_dtype=fp32 optim.exp_avg_sq_dtype=fp32")
    env = _job_env(OUTPUT_DIR=str(out_dir), HF_MODEL=str(corpus["hf_model"]), DOCS=str(corpus["docs"]),
                   ROPE_BASE="20000", MAX_STEPS="2",
                   # (a 2-layer Llama has no NeMo recipe of its own: the 8B's, with one sequence per step)
                   EXTRA_OVERRIDES=f"model.seq_length=256 tiling.loss_chunks=2 {optim} {CPU} recipe=llama31_8b "
                                   "trainer.global_batch_size=1")
    job, waited, log_text = _submit(ROOT / "examples/slurm/llama31_8b_extend_512k.sbatch", tmp_path, env,
                                    wait_s=480, sbatch_args=ON_CPUS)
    assert waited.returncode == 0, f"job {job} failed: {waited.stderr}\n--- job output (tail):\n{log_text[-5000:]}"
    assert (out_dir / "pretrained" / "context" / "io.json").exists()
    rows = _rows(out_dir)
    assert [r["step"] for r in rows] == [1, 2] and all(r["world_size"] == 2 and r["cp_size"] == 2 for r in rows)
    assert "data=documents: 200 documents" in log_text, log_text[-3000:]
    exported = json.loads((out_dir / "hf-512k" / "config.json").read_text())
    assert exported["rope_theta"] == 20000 and exported["num_hidden_layers"] == 2


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
