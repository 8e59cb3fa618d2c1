"""The run spec (``nemo_longctx/shared/run_spec.py``): one typed, frozen form of a run, read once from the composed
Hydra config. The reader round-trips the default config and overrides, every declared key's bad values are named
with their key, the spec is frozen, and the recipe fills a new spec (in-process, no NeMo import; seconds). The
NeMo-Run front end's adapters (a recipe's spec, the strategy's) are checked at the end against real recipes (those
import NeMo); the Bridge container's in tests_bridge/test_bridge_app.py."""

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
    ModelSpec,
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


# ---------------------------------------------------------------------------------------------------- the adapters
def test_a_spec_speaks_its_front_ends_dialect():
    """``RunSpec.dialect`` names the messages' keys (and whether the front end saves Megatron-FSDP checkpoints);
    ``data=None``: the front end does not know the data; ``CheckpointSpec.saving``: it says outright whether it
    saves."""
    from nemo_longctx.shared.app_keys import BRIDGE_KEYS, RECIPE_KEYS

    spec = RunSpec(trainer=TrainerSpec(devices=4, num_nodes=2, precision="bf16-mixed", layout=Layout(tp=2)),
                   checkpoint=CheckpointSpec(saving=True), data=None, model=ModelSpec(fields={"seq_length": 4096}),
                   dialect="recipe")
    assert spec.trainer.world_size == 8 and TrainerSpec(devices=None).world_size is None
    assert spec.keys is RECIPE_KEYS
    assert spec.context(8) == Context(seq_length=4096, tp=2, world_size=8, checkpointing=True, keys=RECIPE_KEYS)
    bridge = dataclasses.replace(spec, dialect="bridge", data=DataSpec(packing="documents"))
    assert bridge.context() == Context(seq_length=4096, tp=2, checkpointing=True, keys=BRIDGE_KEYS, packed_data=True)
    assert not CheckpointSpec(every_n_steps=5, saving=False).saves and CheckpointSpec(every_n_steps=5).saves
    fsdp = LongContextOptions.from_dict({"optim": {"megatron_fsdp": True, "use_distributed_optimizer": True}})
    assert [p.split(":")[0] for p in fsdp.problems(spec.context(8))] == ["optim_megatron_fsdp=true with log.ckpt > 0"]
    assert fsdp.problems(dataclasses.replace(spec, dialect="train").context(8)) == []  # the app saves them


def _llama3_8b(nodes=1, gpus=8):
    pytest.importorskip("nemo")
    from nemo.collections.llm.recipes import llama3_8b

    return llama3_8b.pretrain_recipe(name="x", num_nodes=nodes, num_gpus_per_node=gpus)


def test_a_nemo_run_recipe_is_read_into_a_spec_in_the_recipes_dialect(tmp_path):
    """``spec_of_recipe``: the trainer, the strategy's layout, ``log.ckpt``, the model config's fields of a real
    recipe; its ``context`` is what ``recipe_context`` built by hand before (the recipe's dialect, no data, no
    Megatron-FSDP checkpoints)."""
    recipe = _llama3_8b(nodes=2)
    from nemo_run_recipes import SEQ, STEPS, tiny_llama3_recipe

    from nemo_longctx.integrations.nemo.recipes import spec_of_recipe
    from nemo_longctx.shared.app_keys import RECIPE_KEYS

    spec = spec_of_recipe(recipe)
    t = spec.trainer
    assert (t.devices, t.num_nodes, t.world_size, t.precision, t.micro_batch_size, t.global_batch_size) == (
        8, 2, 16, "bf16-mixed", 1, 512)
    assert (t.layout, spec.checkpoint.saves, spec.data, spec.dialect) == (Layout(), True, None, "recipe")
    assert (spec.model.seq_length, spec.model.get("num_layers"), spec.model.get("num_query_groups")) == (8192, 32, 8)
    assert spec.context(t.world_size) == Context(seq_length=8192, world_size=16, checkpointing=True, keys=RECIPE_KEYS)
    recipe.log.ckpt = None
    recipe.trainer.strategy.tensor_model_parallel_size, recipe.trainer.strategy.sequence_parallel = 2, True
    spec = spec_of_recipe(recipe)
    assert (spec.trainer.layout, spec.checkpoint.saves) == (Layout(tp=2, sequence_parallel=True), False)
    tiny = spec_of_recipe(tiny_llama3_recipe(str(tmp_path)))
    assert (tiny.trainer.max_steps, tiny.trainer.precision, tiny.trainer.world_size) == (STEPS, "32", 2)
    assert tiny.context(4) == Context(seq_length=SEQ, world_size=4, precision="32", keys=RECIPE_KEYS)


def test_a_bad_option_through_the_recipes_spec_is_named_as_before():
    """The recipe's checks take their Context from its spec: the messages are the recipe's, byte for byte."""
    recipe = _llama3_8b()
    from nemo_longctx.integrations.nemo.recipes import options_from_arguments, recipe_problems

    options, _, problems = options_from_arguments({"cp_size": 3}, recipe)
    assert problems == []
    layout = ("cp_size=3 x trainer.strategy.tensor_model_parallel_size=1 x "
              "trainer.strategy.pipeline_model_parallel_size=1 = 3 does not divide the world size {} "
              "(trainer.devices x trainer.num_nodes)")
    seq = ("model.config.seq_length=8192 must be divisible by 2*cp_size = 6 (zigzag layout: 2 chunks per CP rank): "
           "use 8190 or 8196")
    assert recipe_problems(recipe, options) == [seq, layout.format(8)]
    assert recipe_problems(recipe, options, world_size=4) == [seq, layout.format(4)]
    fsdp, _, _ = options_from_arguments({"optim_megatron_fsdp": True}, recipe)
    assert recipe_problems(recipe, fsdp) == [
        "optim_megatron_fsdp=true with log.ckpt > 0: Megatron-FSDP checkpoints (the fsdp_dtensor format) are saved "
        "by nemo-longctx train only, which gives every rank the optimizer state of every parameter that format needs "
        "(set log.ckpt=0, or train with nemo-longctx train)"]
    placed, _, _ = options_from_arguments({"cp_size": 8, "cp_split_min_tokens": 256}, recipe)
    assert recipe_problems(recipe, placed) == []  # the recipe's data are its own: not refused as dense


def test_the_strategys_spec_is_its_final_layout_in_the_dialect_it_was_given():
    """``LongContextStrategy.run_spec``: the layout a later override left, the model config's sequence length; a bad
    layout is named in the recipe's dialect (``cp_size``) or the app's (``cp.size``) as before."""
    import fiddle as fdl

    from nemo_longctx.integrations.nemo.recipes import long_context_recipe, recipe_model_config
    from nemo_longctx.shared.app_keys import NEMO_KEYS, RECIPE_KEYS

    recipe = long_context_recipe(_llama3_8b(), cp_size=8)
    recipe.trainer.strategy.tensor_model_parallel_size = 2  # a later override
    config = recipe_model_config(recipe)
    strategy = fdl.build(recipe.trainer.strategy)
    spec = strategy.run_spec(config)
    assert (spec.trainer.layout, spec.model.seq_length, spec.data, spec.checkpoint.saves) == (
        Layout(tp=2), 8192, None, False)
    # no trainer yet: no precision plugin (NeMo's MegatronStrategy reads it from the trainer)
    assert spec.context(8) == Context(seq_length=8192, tp=2, world_size=8, precision="32", keys=RECIPE_KEYS)
    message = ("{}=8 x trainer.strategy.tensor_model_parallel_size=2 x trainer.strategy.pipeline_model_parallel_size=1 "
               "= 16 does not divide the world size 8 (trainer.devices x trainer.num_nodes)")
    assert strategy.option_problems(config, 8) == [message.format("cp_size")]
    strategy.option_keys = "hydra"
    assert strategy.run_spec(config).keys is NEMO_KEYS
    assert strategy.option_problems(config, 8) == [message.format("cp.size")]
