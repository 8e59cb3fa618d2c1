"""Static checks of the Slurm scripts: bash -n, shellcheck (when installed), srun-not-torchrun, and that the
Llama-3-8B 1M-token script runs exactly what the planner chooses for 8 x 80 GB and composes with the train app; the
Megatron-Bridge script (run by bash with a recording stub for srun) starts `nemo-longctx bridge` in a Bridge-era
container with the planner's plan.frontend=bridge choice, every argument accepted by the Bridge app."""

import re
import shlex
import shutil
import subprocess
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
SCRIPTS = sorted((ROOT / "examples" / "slurm").glob("*.sbatch")) + [ROOT / "scripts" / "slurm_local.sh"]


def test_scripts_exist():
    names = {p.name for p in SCRIPTS}
    assert {"cpu_demo.sbatch", "llama3_8b_1m.sbatch", "bridge_llama3_8b_128k.sbatch", "slurm_local.sh"} <= names


@pytest.mark.parametrize("path", SCRIPTS, ids=lambda p: p.name)
def test_bash_syntax(path):
    r = subprocess.run(["bash", "-n", str(path)], capture_output=True, text=True)
    assert r.returncode == 0, r.stderr


@pytest.mark.parametrize("path", SCRIPTS, ids=lambda p: p.name)
def test_shellcheck(path):
    if not shutil.which("shellcheck"):
        pytest.skip("shellcheck is not installed (apt-get install shellcheck; .ci/run installs it)")
    r = subprocess.run(["shellcheck", "-x", str(path)], capture_output=True, text=True)
    assert r.returncode == 0, r.stdout


def _code(text):
    """The script without comment lines."""
    return "\n".join(line for line in text.splitlines() if not line.lstrip().startswith("#"))


def _sbatch_options(text):
    return dict(re.findall(r"^#SBATCH --([\w-]+)=?(\S*)", text, re.M))


def test_cpu_demo_is_two_srun_tasks_without_torchrun():
    text = (ROOT / "examples/slurm/cpu_demo.sbatch").read_text()
    opts = _sbatch_options(text)
    assert opts["nodes"] == "1" and opts["ntasks"] == "2"
    assert "torchrun" not in _code(text) and "srun --ntasks=2" in text
    assert "cp.size=2" in text and "launcher.backend=gloo" in text and "trainer.devices=2" in text


def _llama_overrides():
    text = (ROOT / "examples/slurm/llama3_8b_1m.sbatch").read_text()
    body = re.search(r"^overrides=\((.*?)^\)", text, re.M | re.S).group(1)
    return [o for o in shlex.split(body) if "$" not in o and not o.startswith('"${')], text


def test_llama_script_uses_pyxis_and_no_torchrun():
    overrides, text = _llama_overrides()
    opts = _sbatch_options(text)
    assert opts["ntasks-per-node"] == "8" and opts["gpus-per-node"] == "8"
    assert "srun --kill-on-bad-exit=1" in text and '--container-image="$IMAGE"' in text
    assert re.search(r"IMAGE=\$\{IMAGE-nvcr\.io#nvidia/nemo:\d\d\.\d\d\}", text)
    assert "torchrun" not in _code(text) and '"$PYTHON" -m nemo_longctx train' in text


def test_llama_script_runs_the_planners_choice():
    from nemo_longctx.apps.plan import train_overrides
    from nemo_longctx.planner.model_shapes import KNOWN_SHAPES
    from nemo_longctx.planner.search import Hardware, plan_or_raise

    p = plan_or_raise(KNOWN_SHAPES["llama3_8b"], 1 << 20, Hardware(gpus=8, gpu_memory_gb=80))
    planned = set(train_overrides(p, p.chosen, "llama3_8b")) - {"trainer.num_nodes=1"}
    overrides, _ = _llama_overrides()
    assert planned <= set(overrides), sorted(planned - set(overrides))


def test_llama_overrides_compose_with_the_train_config():
    """Every key/group the script sets exists in the train app's Hydra tree (compose only; nothing is built)."""
    from hydra import compose, initialize_config_dir
    from hydra.core.global_hydra import GlobalHydra

    from nemo_longctx.apps.plan import conf_dir

    overrides, _ = _llama_overrides()
    overrides += ["trainer.num_nodes=2", "trainer.max_steps=10", "output_dir=/tmp/x"]
    GlobalHydra.instance().clear()
    with initialize_config_dir(config_dir=conf_dir(), version_base=None):
        cfg = compose(config_name="train", overrides=overrides)
    assert cfg.cp.size == 4 and cfg.model.seq_length == 1048576
    assert cfg.trainer.strategy.tensor_model_parallel_size == 2


# ------------------------------------------------------------------------------------- the Megatron-Bridge script
BRIDGE = ROOT / "examples/slurm/bridge_llama3_8b_128k.sbatch"


def _bridge_job(tmp_path, **env):
    """The script run by bash with srun recorded: (its single srun call's argv, the `nemo-longctx bridge` args);
    Bridge's mock data unless ``env`` names the data."""
    from fake_srun import run_with_fake_srun

    data = {} if "DATA_PREFIX" in env or "DATA" in env else {"DATA": "synthetic"}
    env = {"REPO": str(tmp_path / "repo"), "OUTPUT_DIR": str(tmp_path / "out"), **data, **env}
    r, calls = run_with_fake_srun(BRIDGE, tmp_path, env)
    assert r.returncode == 0, r.stdout + r.stderr
    assert len(calls) == 1, calls
    argv = calls[0]
    return argv, argv[argv.index("nemo-longctx") + 1:]


def test_bridge_script_is_one_srun_task_per_gpu_in_a_bridge_container(tmp_path):
    text = BRIDGE.read_text()
    opts = _sbatch_options(text)
    assert opts["ntasks-per-node"] == "8" and opts["gpus-per-node"] == "8"
    assert "torchrun" not in _code(text)
    image = re.search(r"IMAGE=\$\{IMAGE-nvcr\.io#nvidia/nemo:(\d\d)\.(\d\d)\}", text)
    assert image and (int(image[1]), int(image[2])) >= (26, 6), "Megatron-Bridge is the LLM entry from 26.06 on"
    argv, args = _bridge_job(tmp_path, DATA_PREFIX="/data/llama/text_document", TOKENIZER="/models/llama3",
                             HF_HOME="/shared/hf")
    assert argv[0] == "--kill-on-bad-exit=1" and f"--container-image=nvcr.io#nvidia/nemo:{image[1]}.{image[2]}" in argv
    mounts = next(a for a in argv if a.startswith("--container-mounts=")).split("=", 1)[1].split(",")
    want = {f"{tmp_path}/repo:{tmp_path}/repo", "/data/llama:/data/llama", "/shared/hf:/shared/hf"}
    assert want <= set(mounts), mounts
    run = argv[argv.index("-c") + 1]
    assert 'exec "$PYTHON" -m nemo_longctx bridge "$@"' in run and "PYTHONPATH=$REPO" in run
    assert "dataset.data_path=/data/llama/text_document" in args and f"output_dir={tmp_path}/out" in args
    assert {"tokenizer.tokenizer_type=HuggingFaceTokenizer", "tokenizer.tokenizer_model=/models/llama3"} <= set(args)
    assert f"checkpoint.load={tmp_path}/out/checkpoints" in args


def test_bridge_script_runs_the_planners_bridge_choice(tmp_path):
    """The layout and options are the planner's plan.frontend=bridge row for Llama-3-8B at 128K on 8 x 80 GB with
    checkpoint saving (plan.checkpoints=true, the default: a distributed-optimizer row; launcher.devices aside: under
    srun the tasks are the ranks)."""
    from hydra import compose, initialize_config_module
    from hydra.core.global_hydra import GlobalHydra

    from nemo_longctx.apps.plan import frontend_overrides, inputs_from_config
    from nemo_longctx.shared.run_spec import read_plan_spec
    from nemo_longctx.planner.search import plan

    GlobalHydra.instance().clear()
    with initialize_config_module(config_module="nemo_longctx.conf", version_base=None):
        cfg = compose("plan", overrides=["model=llama3_8b", "plan.seq_length=131072", "plan.gpus=8",
                                         "plan.gpu_memory_gb=80", "plan.frontend=bridge"])
    shape, seq, hw, precision, coef, cost, search = inputs_from_config(read_plan_spec(cfg))
    p = plan(shape, seq, hw, precision, coef, cost, **search)
    command, planned = frontend_overrides(read_plan_spec(cfg), p, p.chosen, "llama3_8b")
    assert command == "nemo-longctx bridge"
    _, args = _bridge_job(tmp_path)
    missing = {a for a in planned if not a.startswith("launcher.devices=")} - set(args)
    assert not missing, sorted(missing)


def test_bridge_script_arguments_are_accepted_by_the_bridge_app(tmp_path):
    """Our part composes with conf/bridge.yaml with no problem; the rest are Bridge's keys (its own parser: the
    Bridge venv's tests_bridge/test_bridge_slurm.py applies them to the real recipe)."""
    from nemo_longctx.apps import bridge as bridge_app

    _, args = _bridge_job(tmp_path, EXTRA_ARGS="train.eval_iters=0")
    ours, theirs = bridge_app.split_args(args)
    options = bridge_app.compose(ours).options
    assert options.problems() == [] and bridge_app.app_problems(ours) == []
    assert (options.cp.algorithm, options.cp.size) == ("ring", 8) and not options.optim.state.megatron_fsdp
    assert {"recipe=llama3_8b_pretrain_config", f"output_dir={tmp_path}/out"} <= set(ours)
    assert {"model.seq_length=131072", "train.train_iters=100", "train.eval_iters=0"} <= set(theirs)


# ----------------------------------------------------------- the jobs' data, checkpoint, container and extra variables
# Each GPU job's documented variable forms, run by bash with srun recorded (no Slurm, no pyxis, no GPU): the container
# itself cannot run here, so its flags and mounts are checked as the job hands them to srun. tests/test_slurm_e2e.py
# runs the same scripts on a local Slurm without a container (IMAGE=), with a shrunk model.
LLAMA_1M = ROOT / "examples/slurm/llama3_8b_1m.sbatch"
EXTEND = ROOT / "examples/slurm/llama31_8b_extend_512k.sbatch"
GPU_JOBS = ("llama3_8b_1m", "bridge_llama3_8b_128k", "generated", "generated_bridge")


@pytest.fixture(scope="module")
def generated(tmp_path_factory):
    """`plan.write_sbatch` for Llama-3-8B at 1M tokens on 8 x 80 GB with the app's search space, both front ends:
    ({"generated": path, "generated_bridge": path}, the plan)."""
    from hydra import compose, initialize_config_module
    from hydra.core.global_hydra import GlobalHydra

    from nemo_longctx.apps.plan import inputs_from_config, write_sbatch
    from nemo_longctx.shared.run_spec import read_plan_spec
    from nemo_longctx.planner.search import plan

    GlobalHydra.instance().clear()
    with initialize_config_module(config_module="nemo_longctx.conf", version_base=None):
        cfg = compose("plan", overrides=["model=llama3_8b", "plan.seq_length=1048576", "plan.gpus=8",
                                         "plan.gpu_memory_gb=80"])
    shape, seq, hw, precision, coef, cost, search = inputs_from_config(read_plan_spec(cfg))
    p = plan(shape, seq, hw, precision, coef, cost, **search)
    d = tmp_path_factory.mktemp("generated")
    out = {"generated": d / "job.sbatch", "generated_bridge": d / "bridge.sbatch"}
    write_sbatch(str(out["generated"]), p, p.chosen, "llama3_8b", "nvcr.io#nvidia/nemo:26.04", source=str(ROOT))
    write_sbatch(str(out["generated_bridge"]), p, p.chosen, "llama3_8b", "nvcr.io#nvidia/nemo:26.08",
                 source=str(ROOT), frontend="bridge")
    return out, p


def _script(job, generated):
    return generated[0][job] if job.startswith("generated") else ROOT / "examples" / "slurm" / f"{job}.sbatch"


def _extra_var(job):
    return "EXTRA_ARGS" if job == "bridge_llama3_8b_128k" else "EXTRA_OVERRIDES"


def _run_job(script, tmp_path, **env):
    """bash runs ``script`` with srun recorded: (bash's result, the training srun's argv or None, the arguments after
    `nemo-longctx` [train|bridge])."""
    from fake_srun import run_with_fake_srun

    tmp_path.mkdir(parents=True, exist_ok=True)
    env = {"REPO": str(ROOT), "NEMO_LONGCTX_SRC": str(ROOT), "OUTPUT_DIR": str(tmp_path / "out"), **env}
    r, calls = run_with_fake_srun(script, tmp_path, env)
    if r.returncode != 0 or not calls:
        return r, None, None
    argv = calls[-1]
    i = next(k for k, a in enumerate(argv) if a == "nemo-longctx" or a.endswith("/bin/nemo-longctx"))
    args = argv[i + 1:]
    return r, argv, args[1:] if args[:1] in (["train"], ["bridge"]) else args


def _mounts(argv):
    flag = next((a for a in argv if a.startswith("--container-mounts=")), None)
    return flag.split("=", 1)[1].split(",") if flag else []


@pytest.mark.parametrize("job", GPU_JOBS)
def test_a_gpu_job_without_a_data_choice_exits_naming_the_variables(job, generated, tmp_path):
    """Neither DATA_PREFIX + TOKENIZER nor DATA=synthetic (or a mix of them): exit 2 before any srun, the message
    naming both variables and the synthetic form."""
    forms = [{}, {"DATA_PREFIX": "/data/corpus_text_document"}, {"TOKENIZER": "/models/tok"}, {"DATA": "indexed"},
             {"DATA": "synthetic", "DATA_PREFIX": "/data/corpus_text_document", "TOKENIZER": "/models/tok"}]
    for n, env in enumerate(forms):
        r, argv, _ = _run_job(_script(job, generated), tmp_path / str(n), **env)
        assert r.returncode == 2 and argv is None, (env, r.stdout, r.stderr)
        assert "DATA_PREFIX" in r.stderr and "TOKENIZER" in r.stderr and "DATA=synthetic" in r.stderr, r.stderr


@pytest.mark.parametrize("job", GPU_JOBS)
def test_a_gpu_job_trains_on_the_named_data_with_mounts_checkpoints_and_extra_overrides(job, generated, tmp_path):
    """DATA_PREFIX + TOKENIZER: the front end's indexed-data arguments, the data and tokenizer directories mounted into
    the container next to the repository/plugin, output and checkpoint directories; checkpoints saved to and resumed
    from CHECKPOINT_DIR (the examples: their run directory); the extra overrides last, word-split."""
    bridge = "bridge" in job
    prefix, tok, ckpt = tmp_path / "data" / "corpus_text_document", tmp_path / "tok", tmp_path / "ckpt"
    tok.mkdir()
    extra = ["train.eval_iters=0", "logger.log_interval=5"] if bridge else ["trainer.max_steps=7", "seed=3"]
    env = {"DATA_PREFIX": str(prefix), "TOKENIZER": str(tok), "CHECKPOINT_DIR": str(ckpt),
           _extra_var(job): " ".join(extra)}
    r, argv, args = _run_job(_script(job, generated), tmp_path / "job", **env)
    assert r.returncode == 0, r.stdout + r.stderr
    assert args[-2:] == extra, args
    out = tmp_path / "job" / "out"
    if bridge:
        data = [f"dataset.data_path={prefix}", "tokenizer.tokenizer_type=HuggingFaceTokenizer",
                f"tokenizer.tokenizer_model={tok}"]
        ckpt = ckpt if job == "generated_bridge" else out / "checkpoints"
        checkpoints = [f"checkpoint.save={ckpt}", f"checkpoint.load={ckpt}"]
    else:
        data = ["data=indexed", f"data.paths=[{prefix}]", f"data.tokenizer={tok}"]
        checkpoints = [f"checkpoint.dir={ckpt}", "checkpoint.resume=auto"]
    assert set(data + checkpoints + [f"output_dir={out}"]) <= set(args), args
    assert not [a for a in args if a.startswith(("checkpoint.every_n_steps", "trainer.max_steps=", "optim.lr"))
                and a not in extra], args  # steps, schedule and checkpoint interval: the recipe's
    mounts = {m.split(":")[0] for m in _mounts(argv)}
    for d in (prefix.parent, tok, ROOT, out, ckpt):  # mounted itself or inside a mounted directory
        assert any(str(d) == m or str(d).startswith(m + "/") for m in mounts), (d, mounts)
    assert all(m.split(":")[0] == m.split(":")[1] for m in _mounts(argv))  # the same paths inside

    r, argv, args = _run_job(_script(job, generated), tmp_path / "synthetic", DATA="synthetic", IMAGE="")
    assert r.returncode == 0, r.stdout + r.stderr
    assert not [a for a in argv if a.startswith("--container")], argv  # IMAGE= : no container
    if bridge:
        assert not [a for a in args if a.startswith(("dataset.", "tokenizer."))], args  # the recipe's mock data
    else:
        assert "data=synthetic" in args and not [a for a in args if a.startswith("data.")], args


@pytest.mark.parametrize("job", GPU_JOBS + ("llama31_8b_extend_512k", "cpu_demo"))
def test_every_job_requeues_itself_after_a_preemption_save(job, generated):
    text = _script(job, generated).read_text()
    opts = _sbatch_options(text)
    assert "requeue" in opts and opts["open-mode"] == "append" and re.fullmatch(r"B:USR1@\d+", opts["signal"])
    code = _code(text)
    assert "trap 'forward USR1' USR1" in code and "trap 'forward TERM' TERM" in code
    assert '"$rc" -eq 75' in code and 'scontrol requeue "$SLURM_JOB_ID"' in code


def test_the_generated_job_runs_the_chosen_plan_which_can_save_checkpoints(generated, tmp_path):
    """The planner plans for a job that saves checkpoints (plan.checkpoints=true, the default): for Llama-3-8B at 1M
    on 8 x 80 GB its choice is one the app accepts with saving, and the job runs exactly that row."""
    from nemo_longctx.apps.plan import app_problems, train_overrides

    paths, p = generated
    c = p.chosen.candidate
    assert c.model_state.sharding != "fsdp"
    assert app_problems(c.cp_algorithm, c.recompute, c.offload, c.model_state, "bf16-mixed", "gpu", True) == ()
    text = paths["generated"].read_text()
    assert f"Chosen: {c.label()}" in _comment_text(text) and "saves no checkpoints" not in _comment_text(text)
    r, _, args = _run_job(paths["generated"], tmp_path, DATA="synthetic")
    want = train_overrides(p, p.chosen, "llama3_8b")
    assert args[:len(want)] == want, args


def _comment_text(text):
    """The comment lines joined into one (the header is wrapped at 120 columns)."""
    return " ".join(line[2:] for line in text.splitlines() if line.startswith("# "))


def test_the_extension_job_mounts_the_model_and_documents_and_appends_extra_overrides(tmp_path):
    """HF_MODEL and DOCS are mounted (their own paths); EXTRA_OVERRIDES go to the training step only; IMAGE= runs the
    three steps (import, train, export) without a container."""
    model, docs = tmp_path / "models" / "llama31", tmp_path / "docs" / "long.jsonl"
    env = {"HF_MODEL": str(model), "DOCS": str(docs), "EXTRA_OVERRIDES": "optim.lr=1e-5 seed=7"}
    from fake_srun import run_with_fake_srun

    r, calls = run_with_fake_srun(EXTEND, tmp_path, {"REPO": str(ROOT), "OUTPUT_DIR": str(tmp_path / "out"), **env})
    assert r.returncode == 0 and len(calls) == 3, r.stdout + r.stderr
    imp, train, exp = calls
    assert set(_mounts(train)) >= {f"{model}:{model}", f"{docs}:{docs}", f"{ROOT}:{ROOT}"}, _mounts(train)
    assert train[-2:] == ["optim.lr=1e-5", "seed=7"] and "seed=7" not in imp + exp
    assert "init_from=" + str(tmp_path / "out" / "pretrained") in train and "data=documents" in train
    r, calls = run_with_fake_srun(EXTEND, tmp_path / "bare", {"REPO": str(ROOT), "OUTPUT_DIR": str(tmp_path / "o2"),
                                                              "IMAGE": "", **env})
    assert r.returncode == 0 and len(calls) == 3 and not [a for c in calls for a in c if a.startswith("--container")]
