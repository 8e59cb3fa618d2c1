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
    assert re.search(r"IMAGE=\$\{IMAGE:-nvcr\.io#nvidia/nemo:\d\d\.\d\d\}", text)
    assert "torchrun" not in _code(text) and "python -m nemo_longctx train" in text


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
    """The script run by bash with srun recorded: (its single srun call's argv, the `nemo-longctx bridge` args)."""
    from fake_srun import run_with_fake_srun

    env = {"REPO": str(tmp_path / "repo"), "OUTPUT_DIR": str(tmp_path / "out"), **env}
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
    image = re.search(r"IMAGE=\$\{IMAGE:-nvcr\.io#nvidia/nemo:(\d\d)\.(\d\d)\}", text)
    assert image and (int(image[1]), int(image[2])) >= (26, 6), "Megatron-Bridge is the LLM entry from 26.06 on"
    argv, args = _bridge_job(tmp_path, DATA_PREFIX="/data/llama/text_document", HF_HOME="/shared/hf")
    assert argv[0] == "--kill-on-bad-exit=1" and f"--container-image=nvcr.io#nvidia/nemo:{image[1]}.{image[2]}" in argv
    mounts = next(a for a in argv if a.startswith("--container-mounts=")).split("=", 1)[1].split(",")
    want = {f"{tmp_path}/repo:/workspace/nemo-longctx", "/data/llama:/data/llama", "/shared/hf:/shared/hf"}
    assert want <= set(mounts), mounts
    run = argv[argv.index("-c") + 1]
    assert "exec python -m nemo_longctx bridge \"$@\"" in run and "PYTHONPATH=/workspace/nemo-longctx" in run
    assert "dataset.data_path=/data/llama/text_document" in args and f"output_dir={tmp_path}/out" in args
    assert f"checkpoint.load={tmp_path}/out/checkpoints" in args


def test_bridge_script_runs_the_planners_bridge_choice(tmp_path):
    """The layout and options are the planner's plan.frontend=bridge row for Llama-3-8B at 128K on 8 x 80 GB with
    checkpoint saving (plan.checkpoints=true, the default: a distributed-optimizer row; launcher.devices aside: under
    srun the tasks are the ranks)."""
    from hydra import compose, initialize_config_module
    from hydra.core.global_hydra import GlobalHydra

    from nemo_longctx.apps.plan import frontend_overrides, inputs_from_config
    from nemo_longctx.planner.search import plan

    GlobalHydra.instance().clear()
    with initialize_config_module(config_module="nemo_longctx.conf", version_base=None):
        cfg = compose("plan", overrides=["model=llama3_8b", "plan.seq_length=131072", "plan.gpus=8",
                                         "plan.gpu_memory_gb=80", "plan.frontend=bridge"])
    shape, seq, hw, precision, coef, cost, search = inputs_from_config(cfg)
    p = plan(shape, seq, hw, precision, coef, cost, **search)
    command, planned = frontend_overrides(cfg, p, p.chosen, "llama3_8b")
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
    options = bridge_app.options_of(bridge_app.compose(ours))
    assert options.problems() == [] and bridge_app.app_problems(ours, options) == []
    assert (options.cp.algorithm, options.cp.size) == ("ring", 8) and not options.optim.state.megatron_fsdp
    assert {"recipe=llama3_8b_pretrain_config", f"output_dir={tmp_path}/out"} <= set(ours)
    assert {"model.seq_length=131072", "train.train_iters=100", "train.eval_iters=0"} <= set(theirs)
