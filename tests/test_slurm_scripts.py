"""Static checks of the Slurm scripts: bash -n, shellcheck (when installed), srun-not-torchrun, and that the
Llama-3-8B 1M-token script runs exactly what the planner chooses for 8 x 80 GB and composes with the train app."""

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
    assert {"cpu_demo.sbatch", "llama3_8b_1m.sbatch", "slurm_local.sh"} <= names


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
    from nemo_longctx.memory.model_shapes import KNOWN_SHAPES
    from nemo_longctx.memory.planner import Hardware, plan_or_raise
    from nemo_longctx.plan import train_overrides

    p = plan_or_raise(KNOWN_SHAPES["llama3_8b"], 1 << 20, Hardware(gpus=8, gpu_memory_gb=80))
    planned = set(train_overrides(p, p.chosen, "llama3_8b")) - {"trainer.num_nodes=1"}
    overrides, _ = _llama_overrides()
    assert planned <= set(overrides), sorted(planned - set(overrides))


def test_llama_overrides_compose_with_the_train_config():
    """Every key/group the script sets exists in the train app's Hydra tree (compose only; nothing is built)."""
    from hydra import compose, initialize_config_dir
    from hydra.core.global_hydra import GlobalHydra

    from nemo_longctx.plan import conf_dir

    overrides, _ = _llama_overrides()
    overrides += ["trainer.num_nodes=2", "trainer.max_steps=10", "output_dir=/tmp/x"]
    GlobalHydra.instance().clear()
    with initialize_config_dir(config_dir=conf_dir(), version_base=None):
        cfg = compose(config_name="train", overrides=overrides)
    assert cfg.cp.size == 4 and cfg.model.seq_length == 1048576
    assert cfg.trainer.strategy.tensor_model_parallel_size == 2
