"""The NeMo-Run front end (``integrations/nemo/recipes.py``): NeMo's own pretraining recipe trains with nemo_longctx
through ``run.run``/``run.Experiment`` + ``LongContextPlugin``, through the generated CLI factory and through
``run.plugins=long_context`` -- each per-step loss equal to ``nemo-longctx train`` with the same settings -- and bad
settings fail before any process starts, naming the argument."""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path

import pytest

from app_runner import ROOT, run_app

TESTS = ROOT / "tests"
VENV_BIN = str(Path(sys.executable).parent)
LONG_CONTEXT = "cp_size=2, recompute=full, offload=layer_input"
APP_LONG_CONTEXT = ["cp=ring", "cp.size=2", "recompute=full", "offload=layer_input"]


def _losses(out_dir: Path) -> list:
    rows = [json.loads(line) for line in (Path(out_dir) / "metrics.jsonl").read_text().splitlines() if line.strip()]
    return [r["loss"] for r in rows if "loss" in r and "val" not in str(r.get("kind", ""))]


def _env(tmp_path: Path) -> dict:
    return {"NEMORUN_HOME": str(tmp_path / "nemorun_home"), "PATH": VENV_BIN + os.pathsep + os.environ["PATH"]}


def _run(cmd, tmp_path: Path, cwd: Path, timeout: float = 400):
    """``cmd`` in ``cwd`` with NeMo-Run's home under tmp_path and the venv's torchrun on PATH."""
    env = " ".join(f"{k}={v!r}" for k, v in _env(tmp_path).items())
    return run_app(["bash", "-c", f"cd {str(cwd)!r} && env {env} " + " ".join(cmd)], timeout=timeout)


@pytest.fixture(scope="module")
def app_losses(tmp_path_factory):
    """``nemo-longctx train`` with the tiny recipe's settings (tests/nemo_run_recipes.APP_ARGS)."""
    sys.path.insert(0, str(TESTS))
    from nemo_run_recipes import APP_ARGS

    out = tmp_path_factory.mktemp("app")
    code, log = run_app([sys.executable, "-m", "nemo_longctx", "train", *APP_ARGS, *APP_LONG_CONTEXT,
                         f"output_dir={out}"])
    assert code == 0, log[-3000:]
    losses = _losses(out)
    assert len(losses) == 3, losses
    return losses


@pytest.fixture(scope="module")
def workspace(tmp_path_factory):
    """A NeMo-Run workspace file (found from the working directory, as NeMo-Run's CLI does): the tiny recipe as a
    factory for ``llm.pretrain``, a local 2-process torchrun executor, and the long-context variants of both."""
    d = tmp_path_factory.mktemp("workspace")
    (d / "workspace.py").write_text(f'''
import sys
sys.path.insert(0, {str(TESTS)!r})
import nemo_run as run
from nemo.collections import llm
from nemo_run_recipes import tiny_llama3_recipe


@run.cli.factory(target=llm.pretrain, name="tiny_llama3")
def tiny_llama3(dir: str = "out", name: str = "tiny", num_nodes: int = 1, num_gpus_per_node: int = 2) -> run.Partial:
    return tiny_llama3_recipe(dir, name)


@run.cli.factory
def local_cpu() -> run.Config[run.LocalExecutor]:
    return run.Config(run.LocalExecutor, ntasks_per_node=2, launcher="torchrun")


from nemo_longctx.integrations.nemo.recipes import register_recipe_factories

register_recipe_factories()  # tiny_llama3_long_context, as for NeMo's own recipes
''')
    return d


@pytest.mark.matrix  # the version-matrix smoke set (scripts/matrix_smoke.sh)
def test_plugin_through_run_experiment_equals_the_app_and_every_attention_is_ours(tmp_path, app_losses):
    out = tmp_path / "out"
    code, log = _run([sys.executable, str(TESTS / "nemo_run_recipes.py"), str(out)], tmp_path, tmp_path)
    assert code == 0 and "job states: ['SUCCEEDED']" in log, log[-4000:]
    losses = _losses(out / "nemo_longctx")
    assert losses == pytest.approx(app_losses, rel=1e-6, abs=0), (losses, app_losses)
    for rank in (0, 1):
        rows = [r.split("\t") for r in (out / f"attention.{rank}").read_text().splitlines()]
        assert len(rows) == 2 and all(cls == "LongContextCoreAttention" for _, cls in rows), rows


def test_cli_factory_and_cli_plugin_train_like_the_app(tmp_path, workspace, app_losses):
    for name in ("factory", "plugin"):
        out = tmp_path / name  # the recipe's dir: NeMoLogger's log_dir, our metrics in <dir>/nemo_longctx
        args = ([f"--factory 'tiny_llama3_long_context(dir={out}, {LONG_CONTEXT})'"] if name == "factory" else
                [f"--factory 'tiny_llama3(dir={out})'", "run.plugins=long_context", "run.plugins.cp_size=2",
                 "run.plugins.recompute=full", "run.plugins.offload=layer_input"])
        code, log = _run(["nemo", "llm", "pretrain", *args, "run.executor=local_cpu", "--yes"], tmp_path / name,
                         workspace)
        assert code == 0 and "SUCCEEDED" in log and "FAILED" not in log, (name, log[-4000:])
        assert _losses(out / "nemo_longctx") == pytest.approx(app_losses, rel=1e-6, abs=0), name


@pytest.mark.matrix  # the version-matrix smoke set (scripts/matrix_smoke.sh): the container's NeMo-Run CLI
def test_cli_factory_dryrun_shows_the_rewritten_recipe(tmp_path):
    code, log = _run(["nemo", "llm", "pretrain", "--factory", "'llama3_8b_long_context(cp_size=8)'",
                      "trainer.devices=8", "--dryrun", "--yes"], tmp_path, tmp_path)
    assert code == 0, log[-3000:]
    for text in ("LongContextStrategy(", "context_parallel_size=8", "cp_algorithm='ring'", "LongContextLayerSpec(",
                 "long_context_data_step", "VerifyLongContextAttention(cp_size=8", "StepMetrics("):
        assert text in log, (text, log[-3000:])
    assert not (tmp_path / "nemorun_home" / "experiments").exists()


BAD_SETTINGS = [  # (factory arguments, the message naming them)
    ({"cp_size": 3}, "cp_size=3 x trainer.strategy.tensor_model_parallel_size=1 x "
                     "trainer.strategy.pipeline_model_parallel_size=1 = 3 does not divide the world size 2 "
                     "(trainer.devices x trainer.num_nodes)"),
    ({"cp": "rung"}, "cp='rung' must be one of none, ring, ulysses, hybrid"),
    ({"recompute": "full", "recompute_sequence_chunks": "many"}, "recompute_sequence_chunks='many' must be"),
]


def test_cli_bad_settings_fail_before_any_process_naming_the_argument(tmp_path, workspace):
    """Through NeMo-Run's CLI once (each ``nemo`` process imports NeMo: ~30 s): the first bad setting ends the command
    before any job starts, with our message. Every bad setting's message is then checked on the same generated
    factory in this process (``register_recipe_factories``' ``<recipe>_long_context``, as the CLI calls it)."""
    arguments, message = BAD_SETTINGS[0]
    factory = "tiny_llama3_long_context(" + ", ".join(f"{k}={v}" for k, v in arguments.items()) + ")"
    code, log = _run(["nemo", "llm", "pretrain", "--factory", f"'{factory}'", "run.executor=local_cpu", "--yes"],
                     tmp_path, workspace)
    assert code != 0 and message in log, log[-3000:]
    assert not (tmp_path / "nemorun_home" / "experiments").exists(), "a job was launched"


def test_generated_factory_bad_settings_name_the_argument(tmp_path):
    sys.path.insert(0, str(TESTS))
    from nemo_run_recipes import tiny_llama3_recipe

    from nemo_longctx.integrations.nemo.recipes import _long_context_factory

    factory = _long_context_factory("tiny_llama3", lambda dir="out", name="tiny", num_nodes=1, num_gpus_per_node=2:
                                    tiny_llama3_recipe(dir, name))
    for arguments, message in BAD_SETTINGS:
        with pytest.raises(Exception) as raised:
            factory(dir=str(tmp_path), **arguments)
        assert message in str(raised.value), (arguments, str(raised.value))


# ------------------------------------------------------------------------------------------ in-process checks
@pytest.fixture(scope="module")
def R():
    from nemo_longctx.integrations.nemo import recipes

    return recipes


def _llama3_8b(gpus: int = 8):
    from nemo.collections.llm.recipes import llama3_8b

    r = llama3_8b.pretrain_recipe(name="x", num_nodes=1, num_gpus_per_node=gpus)
    r.model.config.seq_length = 131072
    return r


def test_arguments_mirror_the_hydra_groups_with_the_same_defaults(R):
    from nemo_longctx.options import LongContextOptions

    names = set(R.argument_defaults())
    for o in LongContextOptions.options():
        app_only = o.key.startswith(R.APP_ONLY)
        assert (R.argument_name(o.key) in names) != app_only, o.key
    assert {"cp", "cp_size", "cp_ulysses_size", "cp_head_chunks", "recompute", "recompute_sequence_chunks",
            "offload", "offload_prefetch_depth", "tiling_mlp_tiles", "tiling_loss_chunks", "optim_megatron_fsdp",
            "optim_use_distributed_optimizer", "memory_track"} <= names
    recipe = _llama3_8b()
    options, groups, problems = R.options_from_arguments({}, recipe)
    assert problems == []
    # cp=ring with the ring group's size (conf/cp/ring.yaml), recompute/offload none, the recipe's optimizer layout
    assert (options.cp.algorithm, options.cp.size) == ("ring", 2)
    assert (options.memory.recompute, options.memory.offload) == ("none", "none")
    assert options.optim.state.use_distributed_optimizer is True  # llama3_8b's distributed_fused_adam
    options, _, _ = R.options_from_arguments({"cp": "hybrid", "cp_size": 8, "recompute": "full",
                                              "recompute_sequence_chunks": "4"}, recipe)
    assert (options.cp.ulysses_size, options.memory.sequence_chunks) == (2, 4)  # hybrid.yaml; "4" from the CLI


def test_a_later_layout_override_is_caught_by_the_strategy_with_the_same_message(R):
    import fiddle as fdl

    recipe = R.long_context_recipe(_llama3_8b(), cp_size=8)
    before = _llama3_8b()
    before.trainer.strategy.tensor_model_parallel_size = 2
    with pytest.raises(Exception) as at_factory:
        R.long_context_recipe(before, cp_size=8)
    expected = [p for p in at_factory.value.problems if "does not divide the world size 8" in p]
    assert expected, at_factory.value.problems
    recipe.trainer.strategy.tensor_model_parallel_size = 2  # a later `trainer.strategy.tensor_model_parallel_size=2`
    strategy = fdl.build(recipe.trainer.strategy)
    config = R.recipe_model_config(recipe)
    assert expected[0] in strategy.option_problems(config, world_size=8)
    recipe.trainer.strategy.tensor_model_parallel_size = 1
    assert fdl.build(recipe.trainer.strategy).option_problems(config, world_size=8) == []


def test_plugin_checks_the_executor_world_size_serializes_and_refuses_a_script(R):
    import nemo_run as run
    from nemo_run.core.serialization.zlib_json import ZlibJSONSerializer

    from nemo_longctx.options import ConfigError

    plugin = R.LongContextPlugin(cp="ring", cp_size=4)
    with pytest.raises(ConfigError, match=r"cp_size=4 x .* does not divide the world size 2"):
        plugin.setup(_llama3_8b(), run.LocalExecutor(ntasks_per_node=2))
    with pytest.raises(ConfigError, match="run.Script"):
        plugin.setup(run.Script(inline="true"), run.LocalExecutor(ntasks_per_node=4))
    config = run.Config(R.LongContextPlugin, cp_size=4, recompute="full")
    assert fdl_equal(ZlibJSONSerializer().deserialize(ZlibJSONSerializer().serialize(config)), config)
    recipe = R.long_context_recipe(_llama3_8b(), cp_size=8, recompute="full",
                                   optim_use_precision_aware_optimizer=True, optim_main_grads_dtype="bf16")
    back = ZlibJSONSerializer().deserialize(ZlibJSONSerializer().serialize(recipe))
    import torch

    assert back.optim.config.main_grads_dtype == torch.bfloat16
    assert back.trainer.strategy.long_context_options == recipe.trainer.strategy.long_context_options


def fdl_equal(a, b) -> bool:
    import fiddle as fdl

    return fdl.get_callable(a) is fdl.get_callable(b) and fdl.ordered_arguments(a) == fdl.ordered_arguments(b)


def test_recipe_with_document_aware_cp_sets_the_placement_on_every_rank(R):
    """``cp_split_min_tokens`` on a recipe: the rewritten recipe carries the callback that sets each rank's document
    placement at setup (the recipe's build is NeMo's, not the app's), with the argument's value ("256" from the CLI
    as 256)."""
    import fiddle as fdl

    from nemo_longctx.integrations.nemo.callbacks import DocumentPlacementPolicy

    recipe = R.long_context_recipe(_llama3_8b(), cp_size=8, cp_split_min_tokens="256")
    placed = [c for c in recipe.trainer.callbacks if fdl.get_callable(c) is DocumentPlacementPolicy]
    assert len(placed) == 1 and placed[0].split_min_tokens == 256
    plain = R.long_context_recipe(_llama3_8b(), cp_size=8)
    assert not [c for c in plain.trainer.callbacks if fdl.get_callable(c) is DocumentPlacementPolicy]
