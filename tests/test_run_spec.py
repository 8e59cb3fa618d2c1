"""The run spec (``nemo_longctx/shared/run_spec.py``): one typed, frozen form of a run, read once from the composed
Hydra config. The reader round-trips the default config and overrides, every declared key's bad values are named
with their key, the spec is frozen, and the recipe fills a new spec (in-process, no NeMo import; seconds)."""

from __future__ import annotations

import dataclasses
import hashlib

import pytest

from nemo_longctx.options import Context, LongContextOptions
from nemo_longctx.shared.app_keys import APP_OPTIONS, BRIDGE_OPTIONS, DEMO_SETTINGS, NEMO_KEYS
from nemo_longctx.shared.run_spec import (
    CheckpointSpec,
    DataSpec,
    Layout,
    RunSpec,
    TrainerSpec,
    read_run_spec,
    spec_from_dict,
)


def _compose(config, overrides=(), hydra_config=False):
    from nemo_longctx.shared.overrides import compose

    cfg, problems = compose(config, list(overrides), hydra_config=hydra_config)
    assert cfg is not None and not problems, problems
    return cfg


def _yaml(config, overrides=()):
    from omegaconf import OmegaConf

    return OmegaConf.to_container(_compose(config, overrides), resolve=True)


# ---------------------------------------------------------------------------------------------------- the reader
def test_the_default_train_config_reads_into_every_group():
    cfg = _compose("train")
    spec = read_run_spec(cfg)
    raw = _yaml("train")
    t, s = raw["trainer"], raw["trainer"]["strategy"]
    assert spec.trainer == TrainerSpec(**{k: t[k] for k in TrainerSpec.KEYS},
                                       layout=Layout(s["tensor_model_parallel_size"],
                                                     s["pipeline_model_parallel_size"], s["sequence_parallel"]))
    assert spec.checkpoint == CheckpointSpec(**raw["checkpoint"])
    assert {f: getattr(spec.launcher, f) for f in raw["launcher"]} == raw["launcher"]
    run = {k: v for k, v in raw["run"].items() if k != "print_every"}  # run.print_every: the option model's
    assert {f: (list(v) if isinstance(v, tuple) else v) for f in run for v in [getattr(spec.run, f)]} == run
    assert spec.options == LongContextOptions.from_dict(raw)
    assert (spec.log.level, spec.log.tensorboard) == (raw["log"]["level"], raw["log"]["tensorboard"])
    assert spec.data == DataSpec.from_dict(raw["data"]) and spec.data.kind == "auto"  # (the recipe: synthetic)
    assert (spec.recipe, spec.output_dir, spec.seed, spec.init_from.path) == ("demo", "outputs/train", 1234, None)
    assert dict(spec.model.fields) == raw["model"] and spec.model.seq_length == 4096
    assert spec.model.node is cfg.model  # the model's node travels unread, for Hydra's instantiate
    # the plain form reads back into the same spec (the reader is to_container once, then plain values)
    assert spec_from_dict(raw, spec.model) == spec
    assert spec.key_problems() == [] and spec.problems() == []


def test_overrides_reach_their_groups():
    spec = read_run_spec(_compose("train", [
        "trainer.devices=4", "trainer.strategy.tensor_model_parallel_size=2", "trainer.strategy.sequence_parallel=true",
        "checkpoint.every_n_steps=5", "launcher.backend=gloo", "run.signals=[SIGTERM]", "cp=ulysses",
        "recompute=full", "log.level=debug", "data.packing=documents", "model.seq_length=8192", "seed=7"]))
    assert (spec.trainer.devices, spec.trainer.layout) == (4, Layout(tp=2, pp=1, sequence_parallel=True))
    assert spec.checkpoint.saves and spec.checkpoint.save_on_signal and spec.checkpoint.interval() == "every 5 steps"
    assert (spec.launcher.backend, spec.run.signals) == ("gloo", ("SIGTERM",))
    assert (spec.options.cp.algorithm, spec.options.memory.recompute, spec.log.level) == ("ulysses", "full", "debug")
    assert spec.data.packed and (spec.model.seq_length, spec.seed) == (8192, 7)
    assert spec.parallel_sizes() == {"cp": 2, "tp": 2, "pp": 1} and spec.world_size() == 4
    assert spec.checkpoint_dir.endswith("outputs/train/checkpoints")


def test_the_group_choices_and_the_command_line_come_from_hydras_node():
    cfg = _compose("train", ["cp=none", "cp.size=2"], hydra_config=True)
    spec = read_run_spec(cfg)
    assert spec.choices["cp"] == "none" and spec.choices["model"] == "tiny_llama"
    assert spec.choice_problems() == [
        "cp=none with cp.size=2: cp=none means no context parallelism (one rank holds the whole sequence); for 2 "
        "context-parallel ranks choose the algorithm: cp=ring|ulysses|hybrid cp.size=2"]
    assert "hydra" not in spec.source


def test_init_from_takes_the_command_lines_model_overrides(tmp_path):
    cfg = _compose("train", [f"init_from={tmp_path}", "model.seq_length=8192"], hydra_config=True)
    spec = read_run_spec(cfg)
    assert (spec.init_from.path, dict(spec.init_from.overrides), spec.init_from.problems) == (
        str(tmp_path), {"seq_length": 8192}, ())
    assert spec.seq_length() == 8192 and spec.context().seq_length == 8192
    bad = read_run_spec(cfg, task=["model=llama3_8b", "~model.rotary_base"])
    assert bad.init_from.problems == (
        "model=llama3_8b: init_from takes the model from the checkpoint; a model group cannot be chosen with it "
        "(override single fields: model.seq_length=...)",
        "~model.rotary_base: with init_from only plain model.<field>=<value> overrides apply")
    assert read_run_spec(cfg, task=[]).seq_length() is None  # the checkpoint's: known once its config is read


def test_mandatory_data_values_are_known_as_missing():
    spec = read_run_spec(_compose("train", ["data=indexed"]))
    assert spec.data.missing == ("paths",) and spec.data.paths is None and spec.data.absent("paths")
    assert spec.data.absent("tokenizer") and not spec.data.absent("split")
    assert DataSpec.from_dict({"paths": "/a"}).path_list == ["/a"]


def test_the_context_is_built_once_from_the_spec():
    spec = read_run_spec(_compose("train", ["trainer.strategy.tensor_model_parallel_size=2",
                                            "trainer.precision=bf16-mixed", "checkpoint.every_minutes=5"]))
    assert spec.context(8, cuda=False) == Context(seq_length=4096, tp=2, pp=1, world_size=8, precision="bf16-mixed",
                                                 checkpointing=True, keys=NEMO_KEYS, fsdp_checkpoints=True,
                                                 cuda=False, packed_data=False)
    packed = read_run_spec(_compose("train", ["data.packing=documents"]))
    assert packed.context().packed_data is True  # the option checks see packed documents (cp.split_min_tokens)


# ---------------------------------------------------------------------------------------------------- problems
def _cases(table, app):
    out = []
    for opt in table:
        for bad in opt.bad_values():
            out.append(pytest.param(app, opt, bad, id=f"{app}:{opt.key}={bad!r}"))
    return out


@pytest.mark.parametrize("app, opt, bad", _cases(APP_OPTIONS, "train") + _cases(BRIDGE_OPTIONS, "bridge"))
def test_every_bad_value_of_every_app_key_is_named_with_its_key(app, opt, bad):
    base = _yaml(app)
    assert spec_from_dict(base, app=app).key_problems() == []
    node, *parents = base, *opt.key.split(".")[:-1]
    for part in parents:
        node = node.setdefault(part, {})
    node[opt.name] = bad
    problems = spec_from_dict(base, app=app).key_problems()
    assert any(p.startswith(opt.key) for p in problems), (opt.key, bad, problems)


@pytest.mark.parametrize("app, group, key", [("train", "trainer", "max_step"), ("train", "trainer.strategy", "tp"),
                                             ("train", "checkpoint", "kep"), ("train", "launcher", "backnd"),
                                             ("train", "run", "dryrun"), ("bridge", "run", "print_every"),
                                             ("bridge", "launcher", "backend"), ("bridge", "checkpoint", "save")])
def test_a_misspelt_key_in_an_apps_group_is_named(app, group, key):
    base = _yaml(app)
    node = base
    for part in group.split("."):
        node = node.setdefault(part, {})
    node[key] = 1
    (problem,) = spec_from_dict(base, app=app).key_problems()
    assert problem.startswith(f"{group}: unknown key(s) ['{key}']"), problem


def test_every_problem_at_once_each_naming_its_key():
    base = _yaml("train")
    base["trainer"]["devices"], base["checkpoint"]["on_signal"], base["run"]["fault"] = 0, True, "boom"
    base["cp"]["size"] = 2.5
    spec = spec_from_dict(base)
    p = spec.problems()
    assert [m.split("=")[0].split(" ")[0] for m in p] == [
        "trainer.devices", "run.fault", "checkpoint.on_signal", "cp.size"], p


# ---------------------------------------------------------------------------------------------------- frozen
def test_the_spec_and_its_groups_are_frozen():
    spec = read_run_spec(_compose("train"))
    for obj, name in ((spec, "recipe"), (spec.trainer, "devices"), (spec.trainer.layout, "tp"),
                      (spec.checkpoint, "dir"), (spec.launcher, "backend"), (spec.run, "dry_run"),
                      (spec.data, "kind"), (spec.init_from, "path"), (spec.model, "fields"), (spec.options.cp, "size")):
        with pytest.raises(dataclasses.FrozenInstanceError):
            setattr(obj, name, None)
    assert isinstance(spec.run.signals, tuple)  # lists are read as tuples


# ---------------------------------------------------------------------------------------------------- the recipe
def test_the_recipe_fills_a_new_spec_and_the_config_hash_is_the_resolved_configs():
    from omegaconf import OmegaConf

    from nemo_longctx.integrations.nemo.training_recipe import resolve

    cfg = _compose("train", ["optim.lr=0.01"])
    spec = read_run_spec(cfg)
    assert spec.recipe_pending(list(DEMO_SETTINGS))
    filled = resolve(spec, "tiny_llama")
    assert spec.trainer.precision is None and spec.options.optim.min_lr is None  # the spec read is unchanged
    want = {**DEMO_SETTINGS, "optim.lr": 0.01}
    assert {k: filled.setting(k) for k in DEMO_SETTINGS} == want
    assert filled.recipe == "demo" and filled.data.kind == "synthetic" and filled.options.optim.lr == 0.01
    # the hash: the composed config with the recipe's values set, as the app hashed it before the spec existed
    with_values = cfg.copy()
    for key, value in {**want, "data.kind": "synthetic"}.items():
        if value is not None:
            OmegaConf.update(with_values, key, value, merge=False)
    text = OmegaConf.to_yaml(with_values, resolve=True, sort_keys=True)
    assert filled.config_hash() == hashlib.sha256(text.encode()).hexdigest() != spec.config_hash()


def test_with_recipe_sets_dotted_keys():
    spec = RunSpec()
    new = spec.with_recipe({"trainer.max_steps": 5, "checkpoint.every_n_steps": 2, "optim.lr": 0.1, "recipe": "x"})
    assert (new.trainer.max_steps, new.checkpoint.saves, new.options.optim.lr, new.recipe) == (5, True, 0.1, "x")
    assert (spec.trainer.max_steps, spec.recipe) == (None, "auto")


def test_global_batch_size_names_its_keys():
    spec = read_run_spec(_compose("train", ["trainer.global_batch_size=3", "trainer.devices=4"]))
    with pytest.raises(ValueError, match=r"trainer.global_batch_size=3 must be a multiple of "
                                         r"trainer.micro_batch_size=1 x data-parallel size 2"):
        spec.global_batch_size(4)
    assert read_run_spec(_compose("train")).global_batch_size(2) == 1


# ---------------------------------------------------------------------------------------------------- dialects
def _option_cases():
    out = []
    for opt in LongContextOptions.options():
        for bad in opt.bad_values():
            out.append(pytest.param(opt, bad, id=f"{opt.key}={bad!r}"))
    return out


def _options_with(opt, bad):
    group, name = opt.key.split(".", 1)
    if group in ("recompute", "offload") and name != "name":  # the choice that takes the key
        node = {"name": {"recompute.sequence_chunks": "full", "recompute.modules": "selective",
                         "offload.modules": "modules"}.get(opt.key, "full" if group == "recompute" else "layer_input")}
        extra = {"recompute": {"name": "full"}} if opt.key.startswith("offload.") and node["name"] != "modules" else {}
        return LongContextOptions.from_dict({group: {**node, name: bad}, **extra})
    if opt.key.startswith("cp.") and name in ("ulysses_size", "head_chunks"):
        return LongContextOptions.from_dict({"cp": {"size": 4, "algorithm": "hybrid", "ulysses_size": 2, name: bad}})
    return LongContextOptions.from_dict({group: {name: bad}})


@pytest.mark.parametrize("opt, bad", _option_cases())
def test_every_bad_option_value_is_named_in_each_dialect(opt, bad):
    """The same problem, written in each front end's dialect where it is made: the config's key (train, bridge) and
    the NeMo-Run recipe's argument (``RECIPE_KEYS``: ``cp.size`` -> ``cp_size``)."""
    from nemo_longctx.shared.app_keys import RECIPE_KEYS, argument_name

    options = _options_with(opt, bad)
    config = options.problems(Context(keys=NEMO_KEYS))
    recipe = options.problems(Context(keys=RECIPE_KEYS))
    assert any(opt.key in p for p in config), (opt.key, bad, config)
    assert any(argument_name(opt.key) in p for p in recipe), (opt.key, bad, recipe)
    assert not any(f"{opt.key}=" in p or f"{opt.key}:" in p for p in recipe), recipe
    assert len(config) == len(recipe)


def test_the_model_checks_speak_the_callers_dialect():
    from types import SimpleNamespace

    from nemo_longctx.integrations.megatron.validation import model_problems
    from nemo_longctx.shared.app_keys import RECIPE_KEYS

    options = LongContextOptions.from_dict({"cp": {"size": 4, "algorithm": "ulysses"},
                                            "recompute": {"name": "full", "num_layers": 9}})
    config = SimpleNamespace(num_attention_heads=6, num_query_groups=3, seq_length=4096, num_layers=4)
    ours = model_problems(config, options, 4, 1, 1, Context(keys=NEMO_KEYS))
    theirs = model_problems(config, options, 4, 1, 1, Context(keys=RECIPE_KEYS))
    assert any(p.startswith("cp.size=4: cp=ulysses") for p in ours), ours
    assert any(p.startswith("cp_size=4: cp=ulysses") for p in theirs), theirs
    assert any(p.startswith("recompute.num_layers=9 exceeds the 4 layers per pipeline stage (model.num_layers / "
                            "trainer.strategy.pipeline_model_parallel_size)") for p in ours), ours
    assert any(p.startswith("recompute_num_layers=9 exceeds the 4 layers per pipeline stage (model.config.num_layers"
                            " / trainer.strategy.pipeline_model_parallel_size)") for p in theirs), theirs


def test_the_plan_keys_speak_the_callers_dialect():
    from nemo_longctx.shared.plan_keys import plan_key_problems

    plan = {"seq_length": 1, "host_memory_gb": -1}
    assert plan_key_problems(plan) == ["plan.seq_length=1 must be an int >= 2",
                                       "plan.host_memory_gb=-1 must be a number >= 0"]
    names = Context(keys={"plan.seq_length": "seq_length", "plan.host_memory_gb": "host_memory_gb"})
    assert plan_key_problems(plan, names) == ["seq_length=1 must be an int >= 2",
                                              "host_memory_gb=-1 must be a number >= 0"]
    assert plan_key_problems({"seq_length": 3}, names) == [
        "seq_length=3 must be divisible by 2*cp.size = 2 (zigzag layout: 2 chunks per CP rank): use 2 or 4"]
