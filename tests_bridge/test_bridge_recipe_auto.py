"""``nemo-longctx bridge init_from=<HF dir>`` without ``recipe=`` trains the HF model with the training settings of the
Megatron-Bridge recipe of its architecture (``integrations/bridge/training_recipe.py``).

HF directories holding only the config.json of real models (Llama-3-8B, Llama-3.1-8B, Qwen2.5-14B) are matched
against Bridge's own recipe functions, whose models read the same public config.json values from a Hugging Face
offline cache made here (no hub, no weights). Each chosen recipe's values are compared with those of Bridge's recipe
object built again independently (``megatron.bridge.recipes.<name>()``), not with numbers written into the test. One
subprocess (its own HF_HOME: the hub library reads it at import) does every case: importing Bridge is most of its
time."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest
from hub_configs import LLAMA3_8B, LLAMA31_8B, QWEN25_14B, hf_dir, offline_cache
from runner import ROOT

pytest.importorskip("megatron.bridge", reason="the Megatron-Bridge stack (scripts/install_bridge.sh)")

TINY = {**LLAMA3_8B, "num_hidden_layers": 2, "hidden_size": 128, "intermediate_size": 256, "num_attention_heads": 4,
        "num_key_value_heads": 2, "vocab_size": 1024}
# (case, HF dir, our overrides, Bridge's overrides)
CASES = [("llama3_8b", "llama3_8b", [], []),
         ("llama31_8b", "llama31_8b", [], []),
         ("qwen25_14b", "qwen25_14b", [], []),
         ("llama3_8b_at_128k", "llama3_8b", [], ["model.seq_length=131072"]),
         ("llama3_8b_at_32k_dp2", "llama3_8b", ["launcher.devices=8", "cp.size=4"], ["model.seq_length=32768"]),
         ("user_values", "llama3_8b", [], ["optimizer.lr=1e-4", "train.global_batch_size=8", "train.train_iters=100",
                                           "scheduler.lr_warmup_iters=10"]),
         ("demo", "llama3_8b", ["recipe=demo"], [])]
SCRIPT = r"""
import contextlib, io, json, os, sys
from megatron.bridge import recipes
from nemo_longctx.apps import bridge as app
from nemo_longctx.integrations.bridge import training_recipe
from nemo_longctx.options import ConfigError

def values(c):
    o, s, t = c.optimizer, c.scheduler, c.train
    return {"optimizer": o.optimizer, "lr": o.lr, "min_lr": o.min_lr, "weight_decay": o.weight_decay,
            "adam_beta1": o.adam_beta1, "adam_beta2": o.adam_beta2, "adam_eps": o.adam_eps, "clip_grad": o.clip_grad,
            "lr_warmup_iters": s.lr_warmup_iters, "lr_decay_iters": s.lr_decay_iters,
            "lr_decay_style": s.lr_decay_style, "start_weight_decay": s.start_weight_decay,
            "end_weight_decay": s.end_weight_decay, "train_iters": t.train_iters,
            "global_batch_size": t.global_batch_size, "micro_batch_size": t.micro_batch_size,
            "seq_length": c.model.seq_length, "dataset_seq_length": c.dataset.seq_length,
            "save_interval": c.checkpoint.save_interval, "save": c.checkpoint.save,
            "mixed_precision": training_recipe.precision_name(c.mixed_precision),
            "model": type(c.model).__name__, "num_layers": c.model.num_layers, "hf_model_id": c.model.hf_model_id}

dirs, cases = json.loads(sys.argv[1]), json.loads(sys.argv[2])
out = {}
for name, d, ours, theirs in cases:
    spec = app.compose([f"init_from={dirs[d]}", *ours])
    report = {}
    c = app.build(spec, theirs, "/tmp/unused", spec.launcher.devices, report)
    r = report["recipe"]
    out[name] = {"report": report, "run": values(c), "line": app.settings_line(c, spec, report) if r else None,
                 "kind": app.run_kind(spec), "recipe": values(getattr(recipes, r)()) if r else None,
                 "demo": values(app.demo_config())}
try:  # no recipe of a tiny model's architecture
    training_recipe.choose(dirs["tiny"], None)
    out["refused"] = None
except ConfigError as e:
    out["refused"] = str(e)
# a local rank takes the launching process's choice, checked against init_from's architecture
os.environ[training_recipe.CHOSEN_ENV] = "llama3_8b_pretrain_config"
out["rank"] = training_recipe.choose(dirs["llama3_8b"], None)
os.environ[training_recipe.CHOSEN_ENV] = "qwen25_14b_pretrain_config"
try:
    training_recipe.choose(dirs["llama3_8b"], None)
    out["rank_mismatch"] = None
except ConfigError as e:
    out["rank_mismatch"] = str(e)
del os.environ[training_recipe.CHOSEN_ENV]
# the app refuses before any rank starts (exit 2), naming recipe=
err = io.StringIO()
with contextlib.redirect_stderr(err):
    try:
        app.main([f"init_from={dirs['tiny_weights']}", "output_dir=/tmp/unused"])
        out["app"] = [None, err.getvalue()]
    except SystemExit as e:
        out["app"] = [e.code, err.getvalue()]
print("RESULT " + json.dumps(out))
"""


@pytest.fixture(scope="module")
def result(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("recipe_auto")
    offline_cache(tmp / "hf")
    dirs = {name: str(hf_dir(tmp / name, config)) for name, config in
            (("llama3_8b", LLAMA3_8B), ("llama31_8b", LLAMA31_8B), ("qwen25_14b", QWEN25_14B), ("tiny", TINY),
             ("tiny_weights", TINY))}
    (tmp / "tiny_weights" / "model.safetensors").write_bytes(b"")  # the directory check passes; nothing reads it
    env = {k: v for k, v in os.environ.items() if not k.startswith("NEMO_LONGCTX_")}
    env.update(HF_HOME=str(tmp / "hf"), HF_HUB_OFFLINE="1", PYTHONPATH=str(ROOT))
    p = subprocess.run([sys.executable, "-c", SCRIPT, json.dumps(dirs), json.dumps(CASES)], env=env, cwd=tmp,
                       capture_output=True, text=True, timeout=600)
    lines = [ln for ln in p.stdout.splitlines() if ln.startswith("RESULT ")]
    assert p.returncode == 0 and lines, (p.stdout + p.stderr)[-4000:]
    return json.loads(lines[-1][len("RESULT "):])


SETTINGS = ("optimizer", "lr", "min_lr", "weight_decay", "adam_beta1", "adam_beta2", "adam_eps", "clip_grad",
            "lr_warmup_iters", "lr_decay_iters", "lr_decay_style", "start_weight_decay", "end_weight_decay",
            "train_iters", "save_interval", "mixed_precision")


@pytest.mark.smoke
@pytest.mark.parametrize("case, recipe", [("llama3_8b", "llama3_8b_pretrain_config"),
                                          ("llama31_8b", "llama31_8b_pretrain_config"),  # same shape: RoPE decides
                                          ("qwen25_14b", "qwen25_14b_pretrain_config")])
def test_the_recipe_of_the_architecture_gives_the_training_settings(result, case, recipe):
    got = result[case]
    run, r = got["run"], got["recipe"]
    assert got["report"]["recipe"] == recipe, got["report"]
    assert {k: run[k] for k in SETTINGS if k != "mixed_precision"} == {k: r[k] for k in SETTINGS
                                                                       if k != "mixed_precision"}
    assert got["report"]["precision"] == r["mixed_precision"] == "bf16_mixed"  # (fp32 on this CPU: cpu_settings)
    # the recipe's sequence length and global batch; the model stays the HF model's (not the recipe's hub model)
    assert (run["seq_length"], run["dataset_seq_length"], run["global_batch_size"]) == (
        r["seq_length"], r["seq_length"], r["global_batch_size"])
    assert run["hf_model_id"] != r["hf_model_id"] and run["num_layers"] == r["num_layers"]
    assert run["save"] is None  # saves only when asked (checkpoint.save=), every save_interval steps
    assert got["kind"].startswith("init_from ") and "with the CPU demo" not in got["kind"]
    line = got["line"]
    assert line.startswith(f"nemo-longctx bridge: recipe {recipe} (Megatron-Bridge, by init_from's architecture")
    assert f"bf16_mixed (fp32 on this CPU), adam lr {r['lr']:g} -> {r['min_lr']:g}" in line, line
    assert f"after {r['lr_warmup_iters']} warm-up steps" in line and f"{r['global_batch_size']} sequences" in line


@pytest.mark.smoke
def test_the_long_context_variant_of_the_sequence_length_and_its_tokens_per_step(result):
    at_128k, at_32k = result["llama3_8b_at_128k"], result["llama3_8b_at_32k_dp2"]
    assert at_128k["report"]["recipe"] == "llama3_8b_128k_pretrain_config"
    assert at_128k["run"]["seq_length"] == at_128k["recipe"]["seq_length"] == 131072
    assert at_128k["run"]["global_batch_size"] == at_128k["recipe"]["global_batch_size"]
    # 32K: the longest variant not above it (16K); its tokens per step as 32K sequences, a multiple of the 2
    # data-parallel ranks (8 ranks / cp.size 4)
    r, run = at_32k["recipe"], at_32k["run"]
    assert at_32k["report"]["recipe"] == "llama3_8b_16k_pretrain_config" and r["seq_length"] == 16384
    assert run["seq_length"] == 32768 and run["global_batch_size"] * 32768 == r["global_batch_size"] * 16384
    assert run["global_batch_size"] % 2 == 0


@pytest.mark.smoke
def test_what_the_user_sets_stays_and_recipe_demo_keeps_the_demos_settings(result):
    got = result["user_values"]
    run, r = got["run"], got["recipe"]
    assert got["report"]["recipe"] == "llama3_8b_pretrain_config"
    assert (run["lr"], run["global_batch_size"], run["train_iters"], run["lr_warmup_iters"]) == (1e-4, 8, 100, 10)
    assert (run["min_lr"], run["weight_decay"], run["clip_grad"], run["save_interval"]) == (
        r["min_lr"], r["weight_decay"], r["clip_grad"], r["save_interval"])  # the rest: the recipe's
    demo = result["demo"]
    assert demo["report"]["recipe"] is None and demo["line"] is None
    assert demo["kind"].endswith("with the CPU demo's settings (recipe=demo)")
    keys = ("lr", "min_lr", "lr_warmup_iters", "train_iters", "global_batch_size", "seq_length")
    assert {k: demo["run"][k] for k in keys} == {k: demo["demo"][k] for k in keys}


@pytest.mark.smoke
def test_a_model_without_a_recipe_of_its_architecture_is_refused_naming_recipe(result):
    for message in (result["refused"], result["app"][1]):
        assert "recipe=auto: no Megatron-Bridge pretraining recipe has the architecture of init_from=" in message
        assert "LlamaForCausalLM: num_layers 2, hidden_size 128, ffn_hidden_size 256" in message, message
        assert "recipe=llama3_8b_pretrain_config" in message and "recipe=demo (the CPU demo's settings)" in message
        assert "not in the Hugging Face cache" in message  # the recipes it could not read, said
    assert result["app"][0] == 2 and "core attention:" not in result["app"][1]
    assert result["rank"] == "llama3_8b_pretrain_config"
    assert "qwen25_14b_pretrain_config: that recipe's model does not have the architecture" in result["rank_mismatch"]
