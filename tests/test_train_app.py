"""The Hydra app end to end (real NeMo 2 / Megatron-core objects, gloo on CPU).

Two training runs, reused by several tests (each bounded by `timeout` and `ulimit -v`):
  * ring: ``nemo-longctx train`` (console script, the app spawns its 2 processes) = the default config
    (tiny GQA Llama, cp=ring cp.size=2) with 6 steps at seq 2048 and SGD;
  * none: ``python -m nemo_longctx.apps.train cp=none trainer.devices=1`` (1 process), same seed and data.
SGD (not Adam) so that a wrong gradient scale (e.g. the loss scaled by cp_size) would show in the parameters.
Plus one process that dry-runs the llama3_8b/70b container configurations and a NeMo recipe's model config, and
checks that bad configurations fail (before any step) with messages naming the config field.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest
import torch

from app_runner import run_app
from distributed import run_distributed

ROOT = Path(__file__).resolve().parents[1]
BIN = Path(sys.executable).parent
STEPS = 6
COMMON = [f"trainer.max_steps={STEPS}", "model.seq_length=2048", "optim.optimizer=sgd", "optim.lr=0.5",
          "optim.min_lr=0.05", "run.save_final_params=true", "run.timeout_s=300"]


def _run(cmd, timeout=400):
    return run_app(cmd, timeout)


def _metrics(out_dir: Path):
    return [json.loads(line) for line in (out_dir / "metrics.jsonl").read_text().splitlines()]


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    base = tmp_path_factory.mktemp("train")
    ring, none = base / "ring", base / "none"
    code_r, out_r = _run([str(BIN / "nemo-longctx"), "train", f"output_dir={ring}", *COMMON])
    assert code_r == 0, out_r[-4000:]
    code_n, out_n = _run([sys.executable, "-m", "nemo_longctx.apps.train", f"output_dir={none}", "cp=none",
                          "trainer.devices=1", *COMMON])
    assert code_n == 0, out_n[-4000:]
    return {"ring": (ring, out_r), "none": (none, out_n)}


def test_app_default_writes_metrics_and_prints_steps(runs):
    out_dir, out = runs["ring"]
    m = _metrics(out_dir)
    assert [r["step"] for r in m] == list(range(1, STEPS + 1))
    for r in m:
        assert r["cp_size"] == 2 and r["world_size"] == 2
        assert r["tokens"] == 2048 and r["tokens_per_s"] > 0 and r["loss"] > 0
    assert "spawning 2 local processes" in out
    assert f"step {STEPS}/{STEPS} | loss" in out and "tokens/s" in out and "elapsed" in out


@pytest.mark.matrix  # the version-matrix smoke set (scripts/matrix_smoke.sh)
def test_loss_parity_cp_none_vs_ring(runs):
    ring, none = _metrics(runs["ring"][0]), _metrics(runs["none"][0])
    assert len(ring) == len(none) == STEPS >= 5
    assert none[0]["cp_size"] == 1 and none[0]["world_size"] == 1
    for a, b in zip(none, ring):
        assert abs(a["loss"] - b["loss"]) <= 1e-5 * abs(a["loss"]), (a, b)


def test_parameter_and_gradient_parity_cp_none_vs_ring(runs):
    a = torch.load(runs["none"][0] / "final_params.pt")
    b = torch.load(runs["ring"][0] / "final_params.pt")
    assert a["final"].keys() == b["final"].keys() and len(a["final"]) > 10
    for name in a["final"]:
        assert torch.equal(a["initial"][name], b["initial"][name]), name  # same init on 1 and 2 processes
        da = a["final"][name] - a["initial"][name]
        db = b["final"][name] - b["initial"][name]
        assert da.norm() > 0, name  # every parameter was trained
        # the SGD updates (sums of the per-step gradients) agree: a gradient scaled by cp_size would be off by 2x
        assert (da - db).norm() <= 1e-4 * da.norm(), (name, ((da - db).norm() / da.norm()).item())


# ------------------------------------------------------------------------------------------------ dry run / errors
def _compose(overrides):
    from app_runner import train_config

    return train_config(overrides)


def _spec(overrides):
    from app_runner import train_spec

    return train_spec(overrides)


def _config_cases(rank: int, world: int):
    from nemo_longctx.apps.train import build, dry_run

    res = {}
    res["llama3_8b"] = dry_run(_spec(["model=llama3_8b", "cp=ring", "cp.size=8", "trainer.devices=8",
                                         "model.seq_length=131072", "run.dry_run=true", "data=synthetic"]))
    res["llama3_70b"] = dry_run(_spec(["model=llama3_70b", "cp=ring", "cp.size=4", "data=synthetic",
                                          "trainer.strategy.tensor_model_parallel_size=2", "model.seq_length=65536",
                                          "trainer.strategy.pipeline_model_parallel_size=2", "trainer.devices=16",
                                          "run.dry_run=true"]))

    # a config taken from NeMo's own recipe
    import fiddle as fdl
    from megatron.core.transformer.transformer_block import _get_block_submodules
    from nemo.collections import llm

    from nemo_longctx.integrations.megatron.spec import core_attention_modules
    from nemo_longctx.integrations.nemo.model import enable_long_context

    recipe = llm.llama3_8b.pretrain_recipe(name="x", dir="/tmp/unused", num_nodes=1, num_gpus_per_node=8)
    recipe.model.config.apply_rope_fusion = False  # Megatron refuses it without TransformerEngine (CPU here)
    cfg = fdl.build(recipe.model.config)
    enable_long_context(cfg, "ring")
    block = _get_block_submodules(cfg, cfg.transformer_layer_spec(cfg), pp_rank=0)
    res["recipe"] = (type(cfg).__name__, [m.__name__ for m in core_attention_modules(block)], cfg.num_layers)

    errors = {}
    bad = {
        "seq": ["model.seq_length=4098"],
        "heads": ["model.num_query_groups=3"],
        "world": ["trainer.devices=3"],
        "tp_world": ["trainer.strategy.tensor_model_parallel_size=2"],
        "dropout": ["model.attention_dropout=0.1"],
        "algorithm": ["cp.algorithm=bogus"],
    }
    for name, overrides in bad.items():
        try:
            build(_spec(overrides))
            errors[name] = None
        except ValueError as e:
            errors[name] = str(e)
    res["errors"] = errors
    try:
        _compose(["cp=bogus"])
        res["unknown_option"] = None
    except Exception as e:  # noqa: BLE001 - Hydra's MissingConfigException
        res["unknown_option"] = f"{type(e).__name__}: {e}"
    return res


@pytest.fixture(scope="module")
def config_cases():
    return run_distributed(_config_cases, 1, timeout=300)[0]


def test_dry_run_llama3_8b_container_config_uses_our_attention_everywhere(config_cases):
    s = config_cases["llama3_8b"]
    assert s["model"] == "Llama3Config8B" and s["num_layers"] == 32 and s["seq_length"] == 131072
    assert s["core_attention"] == "32/32 layers LongContextCoreAttention"
    assert s["context_parallel_size_on_config"] == 8 and s["world_size"] == 8 and s["dp"] == 1
    assert s["tokens_per_cp_rank"] == 16384 and s["strategy"] == "LongContextStrategy"
    s = config_cases["llama3_70b"]
    assert s["core_attention"] == "80/80 layers LongContextCoreAttention" and s["tp"] == s["pp"] == 2 and s["dp"] == 1


def test_recipe_model_config_is_extended(config_cases):
    name, modules, layers = config_cases["recipe"]
    assert (name == "Llama3Config8B"
            and modules == ["LongContextCoreAttention"] * layers == ["LongContextCoreAttention"] * 32)


def test_bad_configs_fail_before_step_zero_naming_the_field(config_cases):
    e = config_cases["errors"]
    assert "model.seq_length=4098" in e["seq"] and "2*cp.size = 4" in e["seq"]
    assert "model.num_attention_heads=8" in e["heads"] and "model.num_query_groups=3" in e["heads"]
    assert "cp.size=2" in e["world"] and "does not divide the world size 3" in e["world"]
    assert "tensor_model_parallel_size=2" in e["tp_world"] and "world size 2" in e["tp_world"]
    assert "model.attention_dropout=0.1" in e["dropout"]
    assert "cp.algorithm='bogus'" in e["algorithm"]
    u = config_cases["unknown_option"]
    assert u is not None and "cp=bogus: no such choice of the cp group" in u and "ring" in u and "none" in u


def test_cli_unknown_group_option_is_a_clear_error():
    code, out = _run([str(BIN / "nemo-longctx"), "train", "cp=bogus"], timeout=120)
    assert code == 2 and "cp=bogus: no such choice of the cp group" in out and "ring" in out and "Traceback" not in out
    code, out = _run([str(BIN / "nemo-longctx"), "frobnicate"], timeout=60)
    assert code == 2 and "unknown command" in out
