"""The Megatron-Bridge front end launched by Slurm (run with ``.venv-bridge/bin/python -m pytest tests_bridge``):

* a real single-node Slurm (``scripts/slurm_local.sh``): an sbatch of 2 tasks whose srun starts
  ``python -m nemo_longctx.apps.bridge`` twice, no local launcher: each task is a rank, its RANK / WORLD_SIZE /
  LOCAL_RANK / MASTER_ADDR / MASTER_PORT come from the SLURM_* variables through the NeMo app's own helper
  (``detect_external_launch``), and the CPU demo's losses equal a local launch's;
* under an srun-like environment a bad value fails every rank before any process group, with the shared message;
* the arguments of ``examples/slurm/bridge_llama3_8b_128k.sbatch`` go through Bridge's own override parser on NVIDIA's
  real recipe (its config.json from Hugging Face's offline cache: no hub, no weights).

The Slurm case needs slurm installed (or root + apt-get to install it); skipped with the reason otherwise, a failure
with NEMO_LONGCTX_REQUIRE_SLURM=1 (set by .ci/run), as in tests/test_slurm_e2e.py."""

from __future__ import annotations

import json
import os
import re
import shlex
import subprocess
import sys
import time
from pathlib import Path

import pytest
from hub_configs import LLAMA3_8B, offline_cache

ROOT = Path(__file__).resolve().parents[1]
DEMO = ["cp=ring", "cp.size=2", "train.train_iters=2"]
pytest.importorskip("megatron.bridge", reason="the Megatron-Bridge stack (scripts/install_bridge.sh)")
sys.path.insert(0, str(ROOT / "tests"))  # the Slurm fixture shared with the NeMo suite (tests/slurm_cluster.py)
from slurm_cluster import slurm as _slurm  # noqa: E402
from slurm_cluster import slurm_cluster  # noqa: E402,F401  (the fixture)


def _no_slurm_env():
    return {k: v for k, v in os.environ.items() if not k.startswith("SLURM_")}


def _rows(out):
    f = out / "metrics.jsonl"
    return [json.loads(line) for line in f.read_text().splitlines() if line.strip()] if f.exists() else []


def test_bridge_demo_under_srun_trains_like_the_local_launch(slurm_cluster, tmp_path):
    """2 srun tasks = 2 ranks (no local launcher): losses equal the local launch's (the ranks, the rendezvous and the
    CP group came out right), every attention layer ours."""
    out = tmp_path / "srun"
    argv = [sys.executable, "-m", "nemo_longctx.apps.bridge", *DEMO, f"output_dir={out}"]
    (tmp_path / "job.sbatch").write_text(f"""#!/bin/bash
#SBATCH --job-name=nemo-longctx-bridge-srun
#SBATCH --nodes=1
#SBATCH --ntasks=2
#SBATCH --cpus-per-task=1
#SBATCH --output=%x-%j.out
set -euo pipefail
export OMP_NUM_THREADS=1
echo "job $SLURM_JOB_ID: $SLURM_NTASKS tasks"
srun --ntasks=2 --kill-on-bad-exit=1 {shlex.join(argv)}
""")
    t0 = time.perf_counter()
    sub = subprocess.run(["sbatch", "--parsable", f"--chdir={tmp_path}", str(tmp_path / "job.sbatch")],
                         env=_no_slurm_env(), capture_output=True, text=True, timeout=60)
    assert sub.returncode == 0, sub.stderr
    jid = sub.stdout.strip().split(";")[0]
    # slurm_local.sh wait polls every 0.25 s (sbatch --wait backs off to tens of seconds) and cancels on timeout
    waited = _slurm("wait", jid, "300", timeout=360)
    srun_s = time.perf_counter() - t0
    log_file = next(tmp_path.glob(f"*-{jid}.out"), None)
    log = log_file.read_text() if log_file else "(no job output file)"
    assert waited.returncode == 0, f"job {jid} failed (rc {waited.returncode}): {waited.stderr}\n{log[-5000:]}"
    # each task read its own rank from Slurm (launch.py's SLURM_* mapping); the local launcher never ran
    for rank in (0, 1):
        assert re.search(rf"nemo-longctx bridge: rank {rank} of 2 \(local rank {rank} of 2\) from slurm, "
                         r"rendezvous \S+:\d+", log), log[-3000:]
    assert "world 2" not in log and "rank_logs" not in log, log[-3000:]
    assert "core attention: 2 layers run LongContextCoreAttention (ring x 2)" in log, log[-3000:]

    t0 = time.perf_counter()
    local = subprocess.run([sys.executable, "-m", "nemo_longctx.apps.bridge", *DEMO,
                            f"output_dir={tmp_path / 'local'}"], env=_no_slurm_env(), capture_output=True, text=True,
                           timeout=300, cwd=ROOT)
    local_s = time.perf_counter() - t0
    assert local.returncode == 0 and "world 2" in local.stdout, (local.stdout + local.stderr)[-4000:]
    ref, got = _rows(tmp_path / "local"), _rows(out)
    print(f"srun job {srun_s:.1f} s, local launch {local_s:.1f} s")
    assert [r["step"] for r in got] == [1, 2] and [r["step"] for r in ref] == [1, 2], (got, ref)
    assert all(r["world_size"] == 2 and r["cp_size"] == 2 for r in got)
    for a, b in zip(ref, got):
        assert abs(a["loss"] - b["loss"]) <= 1e-6, (a, b)


def test_a_bad_value_under_srun_fails_every_rank_before_training(tmp_path):
    """Under srun no launching process checks the container: each rank does, before any process group (here one
    process with the variables srun gives rank 1 of 2; it would wait forever for rank 0 if it got further)."""
    env = {**_no_slurm_env(), "SLURM_JOB_ID": "77", "SLURM_STEP_ID": "0", "SLURM_PROCID": "1", "SLURM_LOCALID": "1",
           "SLURM_NTASKS": "2", "SLURM_STEP_NUM_TASKS": "2", "SLURM_STEP_TASKS_PER_NODE": "2", "SLURM_NODEID": "0",
           "SLURM_STEP_NODELIST": "localhost"}
    p = subprocess.run([sys.executable, "-m", "nemo_longctx.apps.bridge", "cp=ring", "cp.size=2",
                        "model.seq_length=250", f"output_dir={tmp_path / 'bad'}"],
                       env=env, capture_output=True, text=True, timeout=300, cwd=ROOT)
    log = p.stdout + p.stderr
    assert p.returncode == 2, log[-3000:]
    assert "rank 1: " in log and "model.seq_length=250 must be divisible by 2*cp.size = 4" in log, log[-3000:]
    assert "from slurm" not in log and "core attention:" not in log


def _example_args(tmp_path, **data):
    """The `nemo-longctx bridge` arguments examples/slurm/bridge_llama3_8b_128k.sbatch starts (bash runs the script,
    a stub records srun's arguments); ``data``: its data variables (DATA_PREFIX + TOKENIZER, or DATA=synthetic)."""
    stub = tmp_path / "bin" / "srun"
    stub.parent.mkdir()
    stub.write_text('#!/bin/bash\nprintf "%s\\0" "$@" >"$SRUN_ARGS"\n')
    stub.chmod(0o755)
    env = {**_no_slurm_env(), "PATH": f"{stub.parent}:{os.environ['PATH']}", "SRUN_ARGS": str(tmp_path / "argv"),
           "REPO": str(tmp_path), "OUTPUT_DIR": str(tmp_path / "out"), **data}
    r = subprocess.run(["bash", str(ROOT / "examples/slurm/bridge_llama3_8b_128k.sbatch")], env=env,
                       capture_output=True, text=True, timeout=60)
    assert r.returncode == 0, r.stdout + r.stderr
    argv = (tmp_path / "argv").read_text().split("\0")[:-1]
    return argv[argv.index("nemo-longctx") + 1:]


@pytest.mark.smoke
def test_example_sbatch_arguments_build_the_real_bridge_recipe(tmp_path):
    """Every argument of the example job in its DATA_PREFIX + TOKENIZER form is taken: ours by the option model,
    Bridge's by Bridge's own parser on ``llama3_8b_pretrain_config`` (its config.json from the offline cache); the
    built container has the planned layout, the data and tokenizer, and no problem for 8 ranks."""
    offline_cache(tmp_path / "hf", {"meta-llama/Meta-Llama-3-8B": LLAMA3_8B})
    prefix, tok = tmp_path / "data" / "llama3_text_document", tmp_path / "tokenizer"
    tok.mkdir()
    args = _example_args(tmp_path, DATA_PREFIX=str(prefix), TOKENIZER=str(tok))
    script = """
import json, os, sys
from nemo_longctx.apps import bridge as bridge_app
from nemo_longctx.integrations.bridge.config import model_problems_of
args = json.loads(sys.argv[1])
ours, theirs = bridge_app.split_args(args)
spec = bridge_app.compose(ours)
options = spec.options
c = bridge_app.build(spec, theirs, os.path.abspath(str(spec.output_dir)))
m = c.model
print(json.dumps({"problems": options.problems() + bridge_app.app_problems(ours)
                  + model_problems_of(c, options, 8), "cp": m.context_parallel_size, "tp": m.tensor_model_parallel_size,
                  "seq": m.seq_length, "dataset_seq": c.dataset.seq_length, "iters": c.train.train_iters,
                  "save": c.checkpoint.save, "fsdp": bool(c.ddp.use_megatron_fsdp), "layers": m.num_layers,
                  "data": c.dataset.data_path, "tokenizer": [c.tokenizer.tokenizer_type, c.tokenizer.tokenizer_model]}))
"""
    env = {**_no_slurm_env(), "HF_HOME": str(tmp_path / "hf"), "HF_HUB_OFFLINE": "1"}
    p = subprocess.run([sys.executable, "-c", script, json.dumps(args)], env=env, capture_output=True, text=True,
                       timeout=300, cwd=tmp_path)
    assert p.returncode == 0, (p.stdout + p.stderr)[-4000:]
    got = json.loads(p.stdout.strip().splitlines()[-1])
    assert got["problems"] == [], got
    assert (got["cp"], got["tp"], got["seq"], got["dataset_seq"]) == (8, 1, 131072, 131072), got
    assert (got["iters"], got["save"], got["fsdp"], got["layers"]) == (100, f"{tmp_path}/out/checkpoints", False, 32)
    assert got["data"] == str(prefix) and got["tokenizer"] == ["HuggingFaceTokenizer", str(tok)], got
