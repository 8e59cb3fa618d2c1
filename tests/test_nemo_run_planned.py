"""The planner-driven NeMo-Run plugin (``nemo_run_planned.py``): on NeMo's own ``llama3_8b`` recipe and an
8-GPU executor, ``PlannedLongContextPlugin`` rewrites the recipe to exactly what ``nemo-longctx plan ...
plan.json=true`` chooses (CP, TP, recompute, offload, tiling, model state); a length nothing fits, a missing or
unknown GPU type and a disagreeing executor fail in ``setup`` (before anything launches) naming what is wrong, also
through NeMo's CLI; the plugin factory resolves through NeMo-Run's CLI parsing and the plugin serializes. The
reference plans run as ``nemo-longctx plan`` subprocesses started first, alongside this process's NeMo import."""

from __future__ import annotations

import json
import logging
import os
import subprocess
import sys
from pathlib import Path

import pytest

from app_runner import ROOT

VENV_BIN = str(Path(sys.executable).parent)
PLAN_CLI = os.path.join(VENV_BIN, "nemo-longctx")
WORKSPACE = """
import nemo_run as run


@run.cli.factory
def local8() -> run.Config[run.LocalExecutor]:
    return run.Config(run.LocalExecutor, ntasks_per_node=8, launcher="torchrun")
"""
TP, SP = "trainer.strategy.tensor_model_parallel_size", "trainer.strategy.sequence_parallel"
OPTION_GROUPS = ("cp", "recompute", "offload", "tiling", "optim")
TOO_LONG = 67108864
# case: (gpu, seq_length, the recipe saves checkpoints, host_memory_gb, the reference's extra plan overrides); the
# reference is planned with plan.checkpoints = whether the recipe saves
CASES = {
    "h100_1m": ("h100", 1048576, False, None, []),
    "h200_1m": ("h200", 1048576, False, None, []),
    "h100_256k": ("h100", 262144, False, None, []),
    "h200_256k": ("h200", 262144, False, None, []),  # a different choice than h100's: the preset counts
    "h100_4m": ("h100", 4194304, False, None, []),  # ulysses, sequence chunks, layers per checkpoint, prefetch depth 0
    # NeMo's recipe as shipped saves checkpoints (log.ckpt): the option model refuses Megatron-FSDP with checkpoint
    # saving, so the plugin searches what the recipe accepts: the CLI's default plan (plan.checkpoints=true)
    "h100_1m_saving": ("h100", 1048576, True, None, []),
    "h100_1m_host256": ("h100", 1048576, False, 256, ["plan.host_memory_gb=256"]),  # host-bound at 1024 GiB
}


@pytest.fixture(scope="module")
def references(tmp_path_factory):
    """``nemo-longctx plan model=llama3_8b plan.gpus=8 ... plan.json=true`` for every case and for TOO_LONG, started
    together; ``get(name)`` -> (exit status, JSON or None, stderr). With them, ``get("nemo_cli")`` -> (exit status,
    NeMo-Run's home, output): NeMo's CLI on NeMo's recipe with ``run.plugins=long_context_planned`` at TOO_LONG and a
    local 8-process torchrun executor (from a NeMo-Run workspace file in its working directory)."""
    ws = tmp_path_factory.mktemp("workspace")
    (ws / "workspace.py").write_text(WORKSPACE)
    procs = {"nemo_cli": subprocess.Popen(
        ["nemo", "llm", "pretrain", "--factory", "llama3_8b", "run.executor=local8", "run.plugins=long_context_planned",
         "run.plugins.gpu=h100", f"run.plugins.seq_length={TOO_LONG}", "--yes"], cwd=ws, stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT, text=True,
        env={**os.environ, "NEMORUN_HOME": str(ws / "home"), "PATH": VENV_BIN + os.pathsep + os.environ["PATH"]})}
    for name, (gpu, seq, saving, _, extra) in [*CASES.items(), ("too_long", ("h100", TOO_LONG, False, None, []))]:
        procs[name] = subprocess.Popen(
            [PLAN_CLI, "plan", "model=llama3_8b", "plan.gpus=8", f"plan={gpu}", f"plan.seq_length={seq}",
             "plan.json=true", "plan.json_candidates=1", f"plan.checkpoints={str(saving).lower()}", *extra],
            cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    done = {}

    def get(name):
        if name not in done:
            out, err = procs[name].communicate(timeout=120)
            if name == "nemo_cli":
                done[name] = (procs[name].returncode, ws / "home", out)
            else:
                done[name] = (procs[name].returncode, json.loads(out) if out.strip() else None, err)
        return done[name]

    yield get
    for p in procs.values():
        if p.poll() is None:
            p.kill()


@pytest.fixture(scope="module")
def P(references):  # the references first: they run while NeMo imports
    from nemo_longctx.apps import nemo_run_planned

    return nemo_run_planned


def _recipe(saving: bool = False):
    from nemo.collections.llm.recipes import llama3_8b

    r = llama3_8b.pretrain_recipe(name="x", num_nodes=1, num_gpus_per_node=8)
    if not saving:
        r.log.ckpt = None
    return r


def _executor(n: int = 8, **kw):
    import nemo_run as run

    return run.LocalExecutor(ntasks_per_node=n, launcher="torchrun", **kw)


def _cli_plugin(args):
    """The plugin NeMo-Run's CLI builds from ``run.plugins=...`` arguments (RunContext's own parsing)."""
    from nemo_run.cli.api import RunContext, _parse_prefixed_args

    ctx = RunContext(name="planned")
    _, run_args, rest = _parse_prefixed_args(args, "run")
    assert rest == []
    ctx.parse_args(run_args)
    assert len(ctx.plugins) == 1
    return ctx.plugins[0]


@pytest.mark.parametrize("name", list(CASES))
def test_the_rewritten_recipe_runs_what_the_plan_cli_chooses(P, references, name):
    import fiddle as fdl

    from nemo_longctx.integrations.nemo.strategy import LongContextStrategy
    from nemo_longctx.options import LongContextOptions

    gpu, seq, saving, host, _ = CASES[name]
    code, ref, err = references(name)
    assert code == 0 and ref["chosen"], err[-2000:]
    chosen = ref["chosen"]["candidate"]
    ovs = dict(o.split("=", 1) for o in ref["overrides"])
    if host is None:
        plugin = P.PlannedLongContextPlugin(gpu=gpu, seq_length=seq)
    else:  # through NeMo-Run's CLI: run.plugins=long_context_planned run.plugins.FIELD=V
        plugin = _cli_plugin(["run.plugins=long_context_planned", f"run.plugins.gpu={gpu}",
                              f"run.plugins.seq_length={seq}", f"run.plugins.host_memory_gb={host}"])
        assert plugin == P.PlannedLongContextPlugin(gpu=gpu, seq_length=seq, host_memory_gb=float(host))
    recipe = _recipe(saving)
    nemo_log = logging.getLogger("nemo_logger")  # NeMo's logger (it does not propagate)
    records = []
    handler = logging.Handler()
    handler.emit = records.append
    nemo_log.addHandler(handler)
    try:
        plugin.setup(recipe, _executor())
    finally:
        nemo_log.removeHandler(handler)
    s = recipe.trainer.strategy
    assert fdl.get_callable(s) is LongContextStrategy
    assert (s.context_parallel_size, s.cp_algorithm) == (chosen["cp_size"], chosen["cp_algorithm"])
    assert s.tensor_model_parallel_size == chosen["tp"] == int(ovs.get(TP, 1))
    assert s.sequence_parallel is (ovs.get(SP) == "true")
    assert (recipe.trainer.devices, recipe.trainer.num_nodes) == (8, 1)
    assert recipe.model.config.seq_length == recipe.data.seq_length == seq
    # recompute / offload / tiling / model state: the options the strategy carries print the CLI's overrides
    got = LongContextOptions.from_dict(s.long_context_options).to_overrides()
    assert got == [o for o in ref["overrides"] if o.split("=")[0].split(".")[0] in OPTION_GROUPS]
    if saving:
        assert "optim.megatron_fsdp=false" in got
    lines = [r.getMessage() for r in records if "long_context_planned:" in r.getMessage()]
    assert len(lines) == 1 and ref["chosen"]["label"] in lines[0], lines
    assert ("Megatron-FSDP not searched (the recipe saves checkpoints: log.ckpt)" in lines[0]) is saving, lines[0]
    assert f"{ref['chosen']['memory_gib']['total']:.1f} of {80 if gpu == 'h100' else 141} GiB per GPU" in lines[0]


def test_nothing_fits_fails_in_setup_with_the_planners_sentence_and_leaves_the_recipe(P, references, tmp_path):
    import fiddle as fdl
    import nemo_run as run
    from nemo.lightning import MegatronStrategy

    from nemo_longctx.options import ConfigError

    code, _, err = references("too_long")
    assert code == 2
    sentence = next(ln for ln in err.splitlines() if ln.startswith("no fitting plan: "))
    recipe = _recipe()
    with pytest.raises(ConfigError) as e:
        P.PlannedLongContextPlugin(gpu="h100", seq_length=TOO_LONG).setup(recipe, _executor())
    assert e.value.problems == [sentence]
    assert "needs >= 128 GPUs of 80 GB" in sentence
    assert fdl.get_callable(recipe.trainer.strategy) is MegatronStrategy
    assert recipe.model.config.seq_length == 8192 and recipe.trainer.strategy.tensor_model_parallel_size == 1
    # inside NeMo-Run, Experiment.add runs the plugin's setup (a refusal there stops the job before it is launched:
    # test_nemo_cli_...); a plan that fits gives the task NeMo-Run launches, serializable
    with run.Experiment("planned", executor=_executor(), base_dir=str(tmp_path)) as exp:
        exp.add(_recipe(), name="fits", plugins=[P.PlannedLongContextPlugin(gpu="h200", seq_length=262144)])
        task = exp.jobs[0].task  # the rewritten recipe NeMo-Run would launch: serializable
        from nemo_run.core.serialization.zlib_json import ZlibJSONSerializer

        assert ZlibJSONSerializer().deserialize(ZlibJSONSerializer().serialize(task)) == task
        assert task.trainer.strategy.context_parallel_size == 8


def test_nemo_cli_with_the_plugin_fails_before_launching_when_nothing_fits(references):
    code, home, log = references("nemo_cli")
    assert code != 0 and "no fitting plan: llama3_8b at seq_length=67108864 does not fit on 8 GPUs of 80 GB" in log, (
        log[-3000:])
    assert "needs >= 128 GPUs of 80 GB" in log
    assert not (home / "experiments").exists(), "a job was launched"


def test_the_gpu_type_comes_from_the_plugin_or_the_executor_never_from_a_default(P, monkeypatch):
    import nemo_run as run
    import nemo_run.core.execution.skypilot as skypilot

    from nemo_longctx.options import ConfigError

    assert P.gpu_presets() == ["h100", "h200"]
    with pytest.raises(ConfigError, match=r"rewrites a NeMo recipe .*got Script"):
        P.PlannedLongContextPlugin(gpu="h100").setup(run.Script(inline="true"), _executor())
    with pytest.raises(ConfigError, match=r"gpu= is not set and the executor \(LocalExecutor\) names no GPU type: "
                                          r"give gpu=<preset>; known presets: h100, h200"):
        P.PlannedLongContextPlugin(seq_length=262144).setup(_recipe(), _executor())
    with pytest.raises(ConfigError, match=r"gpu='a100' is not a GPU preset; known presets: h100, h200"):
        P.PlannedLongContextPlugin(gpu="a100").setup(_recipe(), _executor())
    slurm = run.SlurmExecutor(account="", ntasks_per_node=8, gres="gpu:h200:8")
    assert P.executor_gpu_types(slurm) == ["h200"]
    with pytest.raises(ConfigError, match=r"gpu='h100' disagrees with the executor's GPU type \(SlurmExecutor "
                                          r"names 'h200'\)"):
        P.PlannedLongContextPlugin(gpu="h100").setup(_recipe(), slurm)
    recipe = _recipe()
    P.PlannedLongContextPlugin(seq_length=262144).setup(recipe, slurm)  # h200's choice (h100's keeps recompute)
    s = recipe.trainer.strategy
    assert s.long_context_options["recompute"]["name"] == "none" and s.context_parallel_size == 8
    monkeypatch.setattr(skypilot, "_SKYPILOT_AVAILABLE", True)  # constructible without skypilot installed
    sky = skypilot.SkypilotExecutor(gpus="H100:8", gpus_per_node=8)
    assert (P.executor_gpu_types(sky), P.choose_gpu(None, sky), sky.nproc_per_node()) == (["h100"], "h100", 8)
    with pytest.raises(ConfigError, match=r"executor's GPU type is not one preset \(SkypilotExecutor names 'a100'"):
        P.choose_gpu(None, skypilot.SkypilotExecutor(gpus="A100:8", gpus_per_node=8))
    lepton = run.LeptonExecutor(container_image="x", nemo_run_dir="/x", resource_shape="gpu.8xh100-80gb",
                                gpus_per_node=8, nprocs_per_node=8)
    assert P.choose_gpu(None, lepton) == "h100" and P.choose_gpu("h100", lepton) == "h100"


def test_shape_vocabulary_precision_and_batch_are_read_from_the_recipe_or_refused(P):
    import nemo_run as run
    from nemo.collections.common.tokenizers.null_tokenizer import NullTokenizer
    from nemo.collections.llm.gpt.model.llama import Llama3Config

    from nemo_longctx.options import ConfigError

    group, source = P.recipe_model_group(_recipe())
    assert (group["name"], group["num_layers"], group["num_query_groups"], group["kv_channels"]) == (
        "llama3_8b", 32, 8, 128)
    assert "vocab_size" not in group and source.startswith("the known shape of Llama3Config8B")
    recipe = _recipe()
    recipe.data.tokenizer = run.Config(NullTokenizer, vocab_size=50257)
    group, source = P.recipe_model_group(recipe)
    assert group["vocab_size"] == 50304 and source.startswith("data.tokenizer.vocab_size=50257 padded")
    recipe.model.config.vocab_size = 32000
    assert P.recipe_model_group(recipe)[0]["vocab_size"] == 32000
    recipe = _recipe()  # a config class the planner does not know, without a vocabulary size
    recipe.model.config = run.Config(Llama3Config, num_layers=4, hidden_size=256, ffn_hidden_size=512,
                                     num_attention_heads=4, num_query_groups=2)
    with pytest.raises(ConfigError, match=r"missing model.config.vocab_size .*set model.config.vocab_size"):
        P.PlannedLongContextPlugin(gpu="h100", seq_length=65536).setup(recipe, _executor())
    recipe = _recipe()
    recipe.trainer.plugins.precision = "32"  # fp32: 4-byte activations and weights
    p, _, _ = P.plan_for_recipe(recipe, 8, 8, "h100", 262144)
    assert (p.precision.activation_bytes, p.precision.param_bytes) == (4, 4)
    recipe = _recipe()
    recipe.data.micro_batch_size = 2
    with pytest.raises(ConfigError, match=r"data.micro_batch_size=2: the planner plans one sequence per micro batch"):
        P.PlannedLongContextPlugin(gpu="h100").setup(recipe, _executor())
    with pytest.raises(ConfigError, match=r"host_memory_gb=-1 must be"):
        P.PlannedLongContextPlugin(gpu="h100", host_memory_gb=-1).setup(_recipe(), _executor())


def test_the_plugin_serializes_and_the_cli_factory_resolves(P):
    import fiddle as fdl
    import nemo_run as run
    from nemo_run.core.serialization.zlib_json import ZlibJSONSerializer

    config = run.Config(P.PlannedLongContextPlugin, gpu="h200", seq_length=2097152, host_memory_gb=512.0)
    back = ZlibJSONSerializer().deserialize(ZlibJSONSerializer().serialize(config))
    assert back == config and fdl.build(back) == P.PlannedLongContextPlugin(gpu="h200", seq_length=2097152,
                                                                             host_memory_gb=512.0)
    plugin = _cli_plugin(["run.plugins=long_context_planned", "run.plugins.gpu=h200"])
    assert type(plugin) is P.PlannedLongContextPlugin and (plugin.gpu, plugin.seq_length) == ("h200", None)
    # NeMo-Run's nemo_run.cli entry point (llm) is the module that registers it next to long_context
    from importlib import metadata

    (ep,) = [e for e in metadata.entry_points().select(group="nemo_run.cli") if e.value.startswith("nemo_longctx")]
    cli = ep.load()
    assert ep.name == "llm" and cli.nemo_run_planned is P and hasattr(cli.recipes, "llama3_8b_long_context")


def test_the_layout_the_planner_assumes_replaces_the_recipes_and_the_log_says_so(P):
    """NeMo's llama3_70b recipe (TP 4, PP 4, VP 5) on 4 nodes x 8 H100 of a SlurmExecutor: the plugin sets the
    planner's layout (PP 1, its TP, the executor's nodes) and its log line names every value it changed."""
    import nemo_run as run
    from nemo.collections.llm.recipes import llama3_70b

    recipe = llama3_70b.pretrain_recipe(name="x", num_nodes=1, num_gpus_per_node=8)
    recipe.log.ckpt = None
    s = recipe.trainer.strategy
    assert (s.pipeline_model_parallel_size, s.virtual_pipeline_model_parallel_size) == (4, 5)
    nemo_log, records = logging.getLogger("nemo_logger"), []
    handler = logging.Handler()
    handler.emit = records.append
    nemo_log.addHandler(handler)
    try:
        P.PlannedLongContextPlugin(seq_length=131072).setup(
            recipe, run.SlurmExecutor(account="", nodes=4, ntasks_per_node=8, gres="gpu:h100:8"))
    finally:
        nemo_log.removeHandler(handler)
    assert (s.pipeline_model_parallel_size, s.virtual_pipeline_model_parallel_size) == (1, None)
    assert (recipe.trainer.num_nodes, recipe.trainer.devices) == (4, 8)
    line = next(r.getMessage() for r in records if "long_context_planned:" in r.getMessage())
    assert "trainer.strategy.pipeline_model_parallel_size 4 -> 1" in line, line
    assert "trainer.strategy.virtual_pipeline_model_parallel_size 5 -> None" in line, line
    assert "trainer.num_nodes 1 -> 4" in line, line
    assert ("trainer.strategy.tensor_model_parallel_size" in line) is (s.tensor_model_parallel_size != 4), line


def test_a_global_batch_the_chosen_layout_cannot_split_is_refused_before_the_recipe_changes(P):
    """Llama-3-8B at 8K tokens on 2 nodes x 8 H200: the plan leaves data-parallel ranks; a global batch that is no
    multiple of them is refused in setup, naming the key, the layout and the nearest values, and the recipe keeps its
    layout; a multiple of them is accepted."""
    import nemo_run as run

    from nemo_longctx.options import ConfigError

    p, missing, _ = P.plan_for_recipe(_recipe(), 16, 8, "h200", 8192)
    assert p.chosen is not None, missing
    c = p.chosen.candidate
    dp = 16 // (c.tp * c.cp_size)
    assert dp > 1, c.label()  # (else the case would not test the rule)

    def executor():
        return run.SlurmExecutor(account="", nodes=2, ntasks_per_node=8, gres="gpu:h200:8")

    recipe = _recipe()
    recipe.data.global_batch_size = 2 * dp + 1
    with pytest.raises(ConfigError) as e:
        P.PlannedLongContextPlugin(gpu="h200", seq_length=8192).setup(recipe, executor())
    assert e.value.problems == [
        f"data.global_batch_size={2 * dp + 1} does not split over the {dp} data-parallel ranks of the chosen layout "
        f"({c.label()} on 16 GPUs, one sequence per micro batch): use {2 * dp} or {3 * dp}"]
    assert recipe.trainer.num_nodes == 1 and recipe.model.config.seq_length == 8192  # unchanged
    ok = _recipe()
    ok.data.global_batch_size = 4 * dp
    P.PlannedLongContextPlugin(gpu="h200", seq_length=8192).setup(ok, executor())
    assert (ok.trainer.num_nodes, ok.data.global_batch_size) == (2, 4 * dp)
