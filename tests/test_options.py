"""The option model (nemo_longctx/options.py) and the app's own keys: every bad value of every key is refused before
any rank starts, with a message naming the key. The cases are generated from the option declarations
(``LongContextOptions.options()`` and the NeMo app's ``APP_OPTIONS``), not written by hand; a second test checks
that those declarations cover every key of the composed ``conf/`` tree (``model.*`` and ``data.*`` aside: model
fields are NVIDIA's config classes, checked by Megatron and at build time; data keys are checked per data kind)."""

from __future__ import annotations

import math
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
BIN = Path(sys.executable).parent


def _compose(overrides):
    from nemo_longctx.shared.overrides import compose

    cfg, problems = compose("train", list(overrides))  # as the app composes it (the demo model: the demo's recipe)
    assert not problems, problems
    return cfg


def _declared():
    from nemo_longctx.options import LongContextOptions
    from nemo_longctx.shared.app_keys import APP_OPTIONS

    return LongContextOptions.options() + APP_OPTIONS


def _cases():
    out = []
    for opt in _declared():
        for bad in opt.bad_values():
            out.append(pytest.param(opt, bad, id=f"{opt.key}={bad!r}"))
    return out


@pytest.fixture(scope="module")
def composed():
    """One composed config per set of overrides a key needs (``Option.requires``)."""
    cache = {}

    def get(requires):
        if requires not in cache:  # on as many ranks as the key's CP size needs (cp=hybrid: 4)
            cache[requires] = _compose(requires + (("trainer.devices=4",) if "cp=hybrid" in requires else ()))
        return cache[requires].copy()

    return get


def _set(cfg, key, value):
    from omegaconf import OmegaConf

    OmegaConf.set_struct(cfg, False)
    if key.endswith(".name") and key.split(".")[0] in ("recompute", "offload"):
        group = key.split(".")[0]
        if cfg.get(group) is None:
            OmegaConf.update(cfg, group, {}, force_add=True)
    OmegaConf.update(cfg, key, value, force_add=True, merge=False)
    return cfg


@pytest.mark.parametrize("opt, bad", _cases())
def test_every_bad_value_of_every_key_is_refused_naming_it(opt, bad, composed):
    from nemo_longctx.integrations.nemo.app import config_problems
    from nemo_longctx.shared.run_spec import read_run_spec

    cfg = composed(tuple(opt.requires))
    assert config_problems(read_run_spec(cfg)) == [], f"the base config for {opt.key} ({opt.requires}) must be valid"
    problems = config_problems(read_run_spec(_set(cfg, opt.key, bad)))
    named = [p for p in problems if opt.key in p]
    assert named, f"{opt.key}={bad!r} was accepted or not named: {problems}"


def test_the_declarations_cover_every_key_of_conf():
    """Every leaf key of conf/ (each group choice composed once) is declared as an Option with the yaml's default."""
    from omegaconf import OmegaConf

    declared = {o.key: o for o in _declared()}
    choices = [[], ["cp=ulysses"], ["cp=hybrid"], ["cp=none"], ["recompute=selective"], ["recompute=full"],
               ["recompute=full_keep_attn"], ["offload=layer_input", "recompute=full"], ["offload=modules"],
               ["tiling=auto"], ["optim=fsdp"], ["optim=cpu_offload"], ["optim=precision_aware"],
               ["optim=distributed"]]
    seen, undeclared = set(), []
    for overrides in choices:
        # (composed with a model that is not the demo's, so that recipe keeps its YAML default, auto)
        tree = OmegaConf.to_container(_compose(["model=llama3_8b", *overrides]), resolve=True)

        def walk(node, prefix):
            for k, v in node.items():
                key = f"{prefix}{k}"
                if key in ("model", "data", "hydra") or (key == "cp.kwargs"):
                    seen.add(key)
                    continue
                if isinstance(v, dict):
                    walk(v, key + ".")
                    continue
                seen.add(key)
                # group choices: the group's name, and cp (its default choice cp=ring sets size 2; the option model's
                # default is no context parallelism)
                group_choice = (key.endswith(".name") and key.split(".")[0] in ("recompute", "offload")
                                or key.startswith("cp."))
                if key not in declared:
                    undeclared.append(key)
                elif not overrides and not group_choice and declared[key].default != (
                        tuple(v) if isinstance(v, list) else v):
                    undeclared.append(f"{key}: conf default {v!r} != declared {declared[key].default!r}")

        walk(tree, "")
    assert not undeclared, undeclared
    unused = sorted(set(declared) - seen)
    assert not unused, f"declared keys that conf/ does not have: {unused}"


@pytest.mark.parametrize("override, message", [
    ("cp.size=2.5", "cp.size=2.5 must be a positive int"),
    ("cp.size=true", "cp.size=True must be a positive int"),
    ("cp.size=abc", "cp.size='abc' must be a positive int"),
    ("+cp.sise=4", "cp: unknown key(s) ['sise']"),
    ("+trainer.max_step=5", "trainer: unknown key(s) ['max_step']"),
    ("+memory.trak=false", "memory: unknown key(s) ['trak']"),
    ("+run.dryrun=true", "run: unknown key(s) ['dryrun']"),
    ("+cp.kwargs.head_chunks=2", "cp.kwargs.head_chunks: set cp.head_chunks instead"),
    ("trainer.max_steps=-5", "trainer.max_steps=-5 must be a positive int"),
    ("trainer.precision=fp8", "trainer.precision='fp8' must be one of"),
    ("recompute.num_layers=-1", None),
])
def test_strict_types_name_the_key(override, message):
    from nemo_longctx.integrations.nemo.app import config_problems
    from nemo_longctx.shared.run_spec import read_run_spec

    extra = ["recompute=full"] if override.startswith("recompute.") else []
    problems = "\n".join(config_problems(read_run_spec(_compose([*extra, override]))))
    assert (message or "recompute.num_layers=-1 must be a positive int") in problems, problems


def test_one_pass_reports_every_problem_and_valid_values_pass():
    from nemo_longctx.options import ConfigError, Context, LongContextOptions

    opts = LongContextOptions.from_dict({
        "cp": {"size": 0, "algorithm": "ring", "kwargs": {}},
        "recompute": {"name": "full", "method": "sometimes", "num_layers": 1},
        "tiling": {"mlp_tiles": "many", "loss_chunks": 4},
        "optim": {"lr": -1.0, "use_distributed_optimizer": "yes"},
        "memory": {"track": 1},
    })
    problems = opts.problems(Context(seq_length=4096))
    for key in ("cp.size", "recompute.method", "tiling.mlp_tiles", "optim.lr", "optim.use_distributed_optimizer",
                "memory.track"):
        assert any(key in p for p in problems), (key, problems)
    with pytest.raises(ConfigError) as e:
        opts.check()
    assert e.value.problems == opts.problems() and str(e.value).startswith("invalid configuration:")
    assert LongContextOptions.from_dict({}).problems(Context(seq_length=4096)) == []
    # frozen: an option object is read, never changed in place
    with pytest.raises(Exception):
        opts.cp.size = 2


def test_to_overrides_round_trips_through_the_app_config():
    """What the planner prints (``to_overrides``) selects exactly the same options in the app's conf/ tree."""
    from nemo_longctx.apps.plan import option_model
    from nemo_longctx.integrations.nemo.app import config_problems
    from nemo_longctx.planner.search import ModelState
    from nemo_longctx.shared.run_spec import read_run_spec

    cases = [
        option_model("ring", "full_keep_attn", "layer_input", ModelState("distributed", 0.5, True), 4, 1, 8, 16),
        option_model("hybrid", "selective_mlp", "none", ModelState("fsdp"), 8, 2),
        option_model("ulysses", "selective_attn", "none", ModelState("ddp"), 2, 2, 1, 4),
        option_model("none", "full", "layer_input", ModelState("distributed", 1.0)),
    ]
    for opts in cases:
        cfg = _compose(["trainer.precision=bf16-mixed", "model.seq_length=65536", f"trainer.devices={opts.cp.size}",
                        *opts.to_overrides()])
        spec = read_run_spec(cfg)
        back = spec.options
        assert (back.cp.size, back.cp.algorithm, back.cp.attention_kwargs) == (
            opts.cp.size, opts.cp.algorithm, opts.cp.attention_kwargs), opts.to_overrides()
        assert back.memory == opts.memory and back.optim.state == opts.optim.state
        assert (back.tiling.mlp_tiles, back.tiling.loss_chunks) == (opts.tiling.mlp_tiles, opts.tiling.loss_chunks)
        assert [p for p in config_problems(spec) if "TransformerEngine" not in p and "CPU only" not in p] == []


def test_auto_has_one_meaning():
    """The config's ``auto``, the layers' ``resolve_tiles`` and the planner's counts are the same formula."""
    from nemo_longctx.memory.tile_policy import resolve_tiles
    from nemo_longctx.options import TilingOptions, auto_tiles
    from nemo_longctx.planner.search import PLAN_MLP_TILE_TOKENS, planned_mlp_tiles

    for tokens in (1, 7, 512, 2048, 2049, 100_000):
        assert resolve_tiles("auto", tokens, 2048) == auto_tiles(tokens, 2048) == min(tokens, math.ceil(tokens / 2048))
        assert TilingOptions(mlp_tiles="auto").counts(tokens, 1)[0] == auto_tiles(tokens, 2048)
        assert planned_mlp_tiles(tokens, 1) == auto_tiles(tokens, PLAN_MLP_TILE_TOKENS)


def test_the_manual_documents_the_option_model():
    """docs/reference/options.md holds ``options_table()`` and ``options_table(APP_OPTIONS)`` as generated by
    ``scripts/gen_reference.py`` (``<`` and ``>`` outside code spans written as entities, so they render)."""
    from doc_examples import gen_reference
    from nemo_longctx.options import options_table
    from nemo_longctx.shared.app_keys import APP_OPTIONS

    gen = gen_reference()
    page = (ROOT / "docs" / "reference" / "options.md").read_text()
    stale = "docs/reference/options.md is stale: run python scripts/gen_reference.py"
    assert gen.markdown_text(options_table()) in page, stale + " (options_table())"
    assert gen.markdown_text(options_table(APP_OPTIONS)) in page, stale + " (options_table(APP_OPTIONS))"


def test_the_app_refuses_a_bad_value_before_any_rank_starts():
    """``cp.size=2.5`` trained at 2 with exit 0 before the option model; now the launching process refuses it."""
    p = subprocess.run([str(BIN / "nemo-longctx"), "train", "cp.size=2.5"], capture_output=True, text=True,
                       timeout=300, cwd=ROOT)
    out = p.stdout + p.stderr
    assert p.returncode != 0 and "cp.size=2.5 must be a positive int" in out, out[-3000:]
    assert "spawning" not in out


@pytest.mark.parametrize("model, gpus, seq", [("llama3_8b", 8, 131072), ("llama3_70b", 32, 131072),
                                              ("qwen3_32b", 8, 262144)])
def test_plan_frontend_bridge_prints_what_the_bridge_app_accepts(model, gpus, seq):
    """``plan.frontend=bridge``: the chosen row as ``nemo-longctx bridge`` arguments; our part composes with
    conf/bridge.yaml into exactly the candidate's options and nothing in it is refused by the Bridge app."""
    from hydra import compose, initialize_config_module
    from hydra.core.global_hydra import GlobalHydra

    from nemo_longctx.apps import bridge as bridge_app
    from nemo_longctx.apps.plan import frontend_overrides, inputs_from_config
    from nemo_longctx.shared.run_spec import read_plan_spec
    from nemo_longctx.planner.search import candidate_options, plan

    GlobalHydra.instance().clear()
    with initialize_config_module(config_module="nemo_longctx.conf", version_base=None):
        cfg = compose("plan", overrides=[f"model={model}", f"plan.seq_length={seq}", f"plan.gpus={gpus}",
                                         "plan.frontend=bridge"])
    shape, seq_, hw, precision, coef, cost, search = inputs_from_config(read_plan_spec(cfg))
    p = plan(shape, seq_, hw, precision, coef, cost, **search)
    assert p.chosen is not None
    command, args = frontend_overrides(read_plan_spec(cfg), p, p.chosen, model)
    assert command == "nemo-longctx bridge" and args[0].startswith("recipe=")
    ours, theirs = bridge_app.split_args(args)
    assert any(a.startswith("model.seq_length=") for a in theirs) and all(not a.startswith("cp") for a in theirs)
    bspec = bridge_app.compose(ours)
    options = bspec.options
    assert options.problems() == [] and bridge_app.app_problems(ours, bspec) == []
    want = candidate_options(p.chosen.candidate)
    assert (options.cp.size, options.cp.algorithm, options.memory, options.optim.state, options.tiling) == (
        want.cp.size, want.cp.algorithm, want.memory, want.optim.state, want.tiling)


def test_sequence_chunks_run_under_every_cp_algorithm_and_megatron_fsdp_and_refuse_redundant_head_chunks():
    from nemo_longctx.options import Context, LongContextOptions

    def problems(**groups):
        base = {"recompute": {"name": "full", "sequence_chunks": 4}}
        return LongContextOptions.from_dict({**base, **groups}).problems(Context(seq_length=8192, world_size=4))

    assert problems(cp={"algorithm": "ring", "size": 4}) == []
    assert problems(cp={"algorithm": "ring", "size": 1}) == []
    for cp in ({"algorithm": "ulysses", "size": 4}, {"algorithm": "hybrid", "size": 4, "ulysses_size": 2}):
        assert problems(cp=cp) == [], cp
        got = problems(cp={**cp, "head_chunks": 2, "kwargs": {"regather_in_backward": True}})
        assert any("recompute.sequence_chunks=4 with cp.head_chunks=2 and cp.kwargs.regather_in_backward=true" in p
                   and "drop cp.head_chunks and cp.kwargs.regather_in_backward" in p for p in got), got
    assert problems(optim={"use_distributed_optimizer": True, "megatron_fsdp": True}) == []
