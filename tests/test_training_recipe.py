"""A real model trains with NVIDIA's NeMo recipe for it; the tiny CPU demo keeps the demo's settings.

The values are checked against NeMo's own recipe objects read here independently (``pretrain_recipe()`` of
``nemo.collections.llm.recipes``), not against numbers written into the test; the dry run of a Llama-3-8B command
prints them; a real model without a data choice is refused naming ``data`` before anything is read from NeMo."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


def _resolved(args):
    """The run spec of ``args`` after the app's recipe step (``preflight`` does the same before its checks)."""
    from nemo_longctx.integrations.nemo.app import resolve_recipe
    from nemo_longctx.shared.overrides import compose
    from nemo_longctx.shared.run_spec import read_run_spec

    cfg, problems = compose("train", list(args))  # (the demo models' recipe=demo is decided here, by the choice)
    assert not problems, problems
    return resolve_recipe(read_run_spec(cfg, choices={}))


def test_the_demo_models_keep_the_demos_settings():
    from nemo_longctx.shared.app_keys import DEMO_SETTINGS

    spec = _resolved(["model=tiny_llama"])
    assert spec.recipe == "demo" and spec.data.kind == "synthetic"
    got = {k: spec.setting(k) for k in DEMO_SETTINGS}
    assert got == DEMO_SETTINGS, got


def _nemo_recipe(name):
    import importlib

    return importlib.import_module(f"nemo.collections.llm.recipes.{name}").pretrain_recipe()


@pytest.mark.parametrize("model, seq, recipe", [("llama3_8b", 131072, "llama3_8b_128k"),
                                                ("llama3_8b", 8192, "llama3_8b"),
                                                ("llama3_70b", 65536, "llama3_70b_64k"),
                                                ("qwen3_32b", 32768, "qwen3_32b")])
def test_a_real_model_takes_nemos_recipe_for_it(model, seq, recipe):
    spec = _resolved([f"model={model}", f"model.seq_length={seq}", "data=synthetic", "trainer.devices=8",
                      "cp.size=8"])
    r = _nemo_recipe(recipe)
    ours = spec.options.optim
    assert spec.recipe == recipe
    assert spec.trainer.precision == r.trainer.plugins.precision == "bf16-mixed"
    assert spec.trainer.max_steps == r.trainer.max_steps
    o, sched = r.optim.config, r.optim.lr_scheduler
    assert (ours.lr, ours.weight_decay, ours.clip_grad) == (o.lr, o.weight_decay, o.clip_grad)
    assert (ours.adam_beta1, ours.adam_beta2, ours.adam_eps) == (o.adam_beta1, o.adam_beta2, o.adam_eps)
    assert (ours.warmup_steps, ours.min_lr) == (sched.warmup_steps, sched.min_lr)
    # tokens per step: the recipe's (its global batch x its sequence length), as sequences of this run's length
    assert spec.trainer.global_batch_size * seq == r.data.global_batch_size * r.data.seq_length
    # NeMo's recipes save by training time (ModelCheckpoint.train_time_interval), asynchronously on GPUs
    assert spec.checkpoint.every_minutes == r.log.ckpt.train_time_interval.minutes > 0
    assert spec.checkpoint.every_n_steps == 0 and spec.checkpoint.async_save is True
    assert spec.checkpoint.on_signal is None  # null: saves on a signal because it saves


def test_what_the_user_sets_stays_and_one_interval_measure_wins():
    spec = _resolved(["model=llama3_8b", "data=synthetic", "optim.lr=1e-4", "trainer.precision=16-mixed",
                      "checkpoint.every_n_steps=50", "trainer.global_batch_size=8", "trainer.max_steps=100"])
    assert spec.options.optim.lr == 1e-4 and spec.trainer.precision == "16-mixed" and spec.trainer.max_steps == 100
    assert spec.trainer.global_batch_size == 8
    assert spec.checkpoint.every_n_steps == 50 and spec.checkpoint.every_minutes == 0
    assert spec.options.optim.warmup_steps == _nemo_recipe("llama3_8b").optim.lr_scheduler.warmup_steps  # NeMo's
    demo = _resolved(["model=tiny_llama", "recipe=llama3_8b", "data=synthetic"])  # a recipe named for a tiny model
    assert demo.recipe == "llama3_8b" and demo.trainer.precision == "bf16-mixed" and demo.options.optim.lr == 3e-4


def test_the_recipes_tokens_per_step_as_sequences():
    from nemo_longctx.shared.app_keys import recipe_global_batch

    assert recipe_global_batch(512 * 8192, 1 << 20, 1, 1) == 4
    assert recipe_global_batch(512 * 8192, 1 << 20, 1, 8) == 8  # at least one sequence per data-parallel rank
    assert recipe_global_batch(512 * 131072, 1 << 20, 2, 4) == 64  # a multiple of micro batch x data-parallel size
    assert recipe_global_batch(1000, 300, 1, 2) == 2


def test_bad_recipe_choices_are_refused_naming_the_key(tmp_path):
    from nemo_longctx.integrations.nemo.app import preflight
    from nemo_longctx.integrations.nemo.training_recipe import choose_recipe

    p = preflight(["model=llama3_8b"])  # no data choice: refused before NeMo's recipes are read
    assert len(p) == 1 and p[0].startswith("data: a real model needs a data choice") and "data=synthetic" in p[0], p
    p = preflight(["model=tiny_llama", "recipe=no_such_recipe", "data=synthetic"])
    assert any(m.startswith("recipe='no_such_recipe' is not a NeMo pretraining recipe") for m in p), p
    # init_from: matched by the checkpoint's architecture (its config.json); a tiny model has no NeMo recipe
    for name, dims, want in (("tiny", (2, 64, 128, 4, 2), None), ("llama3_8b", (32, 4096, 14336, 32, 8), "llama3_8b")):
        hf = tmp_path / name
        hf.mkdir()
        keys = ("num_hidden_layers", "hidden_size", "intermediate_size", "num_attention_heads", "num_key_value_heads")
        (hf / "config.json").write_text(json.dumps({"architectures": ["LlamaForCausalLM"], **dict(zip(keys, dims))}))
        cfg = _resolved_raw([f"init_from={hf}", "data=synthetic"])
        if want is None:
            with pytest.raises(Exception) as e:
                choose_recipe(cfg, "tiny_llama")
            assert "recipe=auto: no NeMo pretraining recipe has this model's architecture" in str(e.value)
            assert "recipe=demo" in str(e.value)
        else:
            assert choose_recipe(cfg, "tiny_llama") == want


def _resolved_raw(args):
    from nemo_longctx.shared.overrides import compose
    from nemo_longctx.shared.run_spec import read_run_spec

    cfg, problems = compose("train", list(args))
    assert not problems, problems
    return read_run_spec(cfg)


def test_the_dry_run_prints_the_recipes_settings(tmp_path):
    """The documented check: Llama-3-8B at 128K on 8 ranks of ring CP, as a dry run; and the same without data."""
    base = [sys.executable, "-m", "nemo_longctx.apps.train", "model=llama3_8b", "cp=ring", "cp.size=8",
            "trainer.devices=8", "model.seq_length=131072", "run.dry_run=true", f"output_dir={tmp_path}"]
    out = subprocess.run(base + ["data=synthetic"], cwd=ROOT, capture_output=True, text=True, timeout=300)
    text = out.stdout + out.stderr
    assert out.returncode == 0, text[-3000:]
    r = _nemo_recipe("llama3_8b_128k")
    lines = {ln.split()[0]: ln for ln in out.stdout.splitlines() if ln.startswith("  ")}
    assert "llama3_8b_128k" in lines["recipe"]
    assert lines["precision"].split()[-1] == "bf16-mixed"
    assert f"lr {r.optim.config.lr:g}" in lines["optimizer"]
    assert f"warm-up {r.optim.lr_scheduler.warmup_steps} steps" in lines["optimizer"]
    assert f"every {r.log.ckpt.train_time_interval.minutes:g} minutes" in lines["checkpoint"], lines["checkpoint"]
    assert "synthetic" in lines["data"] and "GiB per GPU" in lines["predicted_memory"]
    out = subprocess.run(base, cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert out.returncode == 2 and "data: a real model needs a data choice" in out.stderr, out.stderr[-2000:]


def test_the_recipes_values_reach_nemos_objects(tmp_path):
    """Built in-process as the app builds a rank's objects: Megatron's OptimizerConfig, NeMo's cosine schedule, the
    precision plugin and NeMo's ModelCheckpoint carry the recipe's values (a tiny model with llama3_8b's recipe)."""
    from nemo_longctx.integrations.nemo.app import build, recipe_line

    spec = _resolved(["model=tiny_llama", "recipe=llama3_8b", "data=synthetic", "trainer.devices=1", "cp=none",
                      "trainer.global_batch_size=2", f"output_dir={tmp_path}"])
    r = _nemo_recipe("llama3_8b")
    built = build(spec)
    o, s = built.model.optim.config, built.model.optim.lr_scheduler
    want = r.optim.config
    assert (o.lr, o.weight_decay, o.adam_beta1, o.adam_beta2, o.adam_eps, o.clip_grad, o.bf16) == (
        want.lr, want.weight_decay, want.adam_beta1, want.adam_beta2, want.adam_eps, want.clip_grad, True)
    assert (s.warmup_steps, s.min_lr, s.max_steps) == (r.optim.lr_scheduler.warmup_steps, r.optim.lr_scheduler.min_lr,
                                                       r.trainer.max_steps)
    assert built.trainer.precision_plugin.precision == "bf16-mixed"
    assert built.log.ckpt._train_time_interval.total_seconds() == r.log.ckpt.train_time_interval.minutes * 60
    assert built.strategy.async_save is False  # NeMo's async save needs CUDA: synchronous here
    line = recipe_line(spec, built.global_batch_size, spec.model.seq_length)
    assert line.startswith("nemo-longctx train: recipe llama3_8b (NVIDIA NeMo): bf16-mixed, lr 0.0003 -> 3e-05")
    assert "checkpoints every 15 minutes" in line
