"""GPT-OSS through NVIDIA's own recipe (``gpt_oss_20b_pretrain_config``, ``megatron.bridge.recipes.gpt_oss``),
unmodified, shrunk by Bridge's overrides, trained by ``nemo-longctx bridge`` on the CPU over gloo with our core
attention: cp=none and ring, Ulysses and hybrid CP=2 give the same per-step losses (fp32, 1e-5 relative), with the
recipe's attention sinks (``softmax_type="learnable"``) and alternating sliding windows (``window_size=(127, 0)``,
``window_attn_skip_freq=2``: layer 1 windowed, layer 2 full) in the built layers, its YaRN RoPE and its MoE (biased
experts, top-k softmax routing). The recipe has no load-balancing loss (``moe_router_load_balancing_type="none"``);
with Megatron's ``aux_loss`` switched on (the recipe's coefficient 0.9) ring CP=2 again gives cp=none's losses, and
they differ from the runs without it (the auxiliary gradient is in them).

The hub is replaced by Hugging Face's offline cache holding GPT-OSS-20B's config.json (no weights are read).
What the CPU stack cannot build, and how each is handled (docs/how-to/models.md, "GPT-OSS"):
- TransformerEngine layers (``transformer_impl="transformer_engine"``, grouped-GEMM experts, fused permutation and
  bias activation): the CPU settings (``integrations/bridge/cpu_compat.cpu_settings``) build Megatron's local block
  spec with the fusions off, and ``model.moe_grouped_gemm=false`` is given explicitly (the local spec's experts are
  Megatron's ``SequentialMLP`` either way);
- TE's router GEMM: Megatron's own torch product (stand-in B10);
- biased experts at expert-parallel size 1 and the ``alltoall`` dispatcher at expert-parallel size > 1 are refused by
  name (``validation.moe_cpu_problems``): these runs use ``model.expert_model_parallel_size=2`` and the ``allgather``
  dispatcher (cp=none then runs 2 data-parallel ranks, the CP runs 2 CP ranks; global batch 2 in both).
Control: the ring run with our attention called without the sinks (``tests_bridge/no_sinks``) misses cp=none's losses.

Not smoke: 7 app runs of 2 ranks (measured in docs/benchmarks.md)."""

from __future__ import annotations


import pytest
from hub_configs import offline_cache
from runner import ROOT, run_bridge

pytest.importorskip("megatron.bridge", reason="the Megatron-Bridge stack (scripts/install_bridge.sh)")

TOL = 1e-5  # fp32, relative (the CP runs differ from cp=none by at most 1.3e-7)
# what the auxiliary loss and the sinks change in 3 steps of the recipe's initialisation (sinks ~ N(0, 0.02): about
# one more term in each softmax denominator): 5.8e-4 and 4.4e-4 relative measured, thousands of times the CP runs'
# differences; the bar is 20 tolerances
EFFECT = 20 * TOL
GPT_OSS_20B_CONFIG = {  # openai/gpt-oss-20b's config.json (its public values): all the recipe reads from the hub
    "architectures": ["GptOssForCausalLM"], "attention_bias": True, "attention_dropout": 0.0, "eos_token_id": 200002,
    "experts_per_token": 4, "head_dim": 64, "hidden_act": "silu", "hidden_size": 2880, "initial_context_length": 4096,
    "initializer_range": 0.02, "intermediate_size": 2880, "layer_types": ["sliding_attention", "full_attention"] * 12,
    "max_position_embeddings": 131072, "model_type": "gpt_oss", "num_attention_heads": 64,
    "num_experts_per_tok": 4, "num_hidden_layers": 24, "num_key_value_heads": 8, "num_local_experts": 32,
    "output_router_logits": False, "pad_token_id": 199999, "rms_norm_eps": 1e-05,
    "rope_scaling": {"beta_fast": 32.0, "beta_slow": 1.0, "factor": 32.0, "original_max_position_embeddings": 4096,
                     "rope_type": "yarn", "truncate": False},
    "rope_theta": 150000, "router_aux_loss_coef": 0.9, "sliding_window": 128, "swiglu_limit": 7.0,
    "tie_word_embeddings": False, "torch_dtype": "bfloat16", "transformers_version": "4.55.0.dev0",
    "use_cache": True, "vocab_size": 201088}
RECIPE = "recipe=gpt_oss_20b_pretrain_config"
# the model at CPU size (2 layers: one windowed, one full; 4 experts, top-2); everything else as the recipe sets it
SHRINK = ["model.num_layers=2", "model.hidden_size=128", "model.num_attention_heads=4", "model.num_query_groups=2",
          "model.kv_channels=32", "model.ffn_hidden_size=128", "model.moe_ffn_hidden_size=128",
          "model.num_moe_experts=4", "model.moe_router_topk=2", "model.vocab_size=1024", "tokenizer.vocab_size=1024",
          "model.seq_length=256", "train.train_iters=3", "train.global_batch_size=2", "train.micro_batch_size=1",
          "dataset.num_workers=0", "validation.eval_iters=0", "checkpoint.save=null", "scheduler.lr_warmup_iters=1",
          "model.tensor_model_parallel_size=1", "model.pipeline_model_parallel_size=1",
          "model.sequence_parallel=false"]
# what the CPU stack builds of it (module docstring)
CPU_LAYOUT = ["model.moe_grouped_gemm=false", "model.expert_model_parallel_size=2",
              "model.moe_token_dispatcher_type=allgather"]
AUX = ["model.moe_router_load_balancing_type=aux_loss"]
RUNS = {
    "none": ["cp=none", "launcher.devices=2"],
    "ring": ["cp=ring", "cp.size=2"],
    "ulysses": ["cp=ulysses", "cp.size=2"],
    "hybrid": ["cp=hybrid", "cp.size=2", "cp.ulysses_size=2", "cp.head_chunks=2"],
    "aux_none": ["cp=none", "launcher.devices=2", *AUX],
    "aux_ring": ["cp=ring", "cp.size=2", *AUX],
}
LAYERS_LINE = ("core attention: 2 layers run LongContextCoreAttention ({cp}); attention sinks (learnable) in 2 "
               "layers; sliding window (127, 0) in layers [1]")


@pytest.fixture(scope="module")
def hf_cache(tmp_path_factory):
    root = offline_cache(tmp_path_factory.mktemp("hf"), {"openai/gpt-oss-20b": GPT_OSS_20B_CONFIG})
    return {"HF_HOME": str(root), "HF_HUB_OFFLINE": "1"}


@pytest.fixture(scope="module")
def runs(hf_cache, tmp_path_factory):
    tmp = tmp_path_factory.mktemp("gpt_oss")
    out = {name: run_bridge(tmp, name, RECIPE, *SHRINK, *CPU_LAYOUT, *args, timeout=900, env=hf_cache)
           for name, args in RUNS.items()}
    inject = ROOT / "tests_bridge" / "no_sinks"
    out["no_sinks"] = run_bridge(tmp, "no_sinks", RECIPE, *SHRINK, *CPU_LAYOUT, *RUNS["ring"], timeout=900,
                                 env={**hf_cache, "PYTHONPATH": f"{inject}:{ROOT}"})
    return out


def _rel(a, b):
    return abs(a - b) / abs(b)


def test_gpt_oss_recipe_trains_with_cp_none_losses_under_ring_ulysses_hybrid(runs):
    cps = {"none": "none (ring attention on 1 rank: no context parallelism)", "ring": "ring x 2",
           "ulysses": "ulysses x 2", "hybrid": "hybrid x 2"}
    for name, (code, log, rows) in runs.items():
        assert code == 0 and "recipe gpt_oss_20b_pretrain_config" in log, (name, log[-4000:])
        assert [r["step"] for r in rows] == [1, 2, 3], (name, rows)
        cp = cps.get(name.replace("aux_", ""), "ring x 2")
        assert LAYERS_LINE.format(cp=cp) in log, (name, log[-3000:])
    ref = [r["loss"] for r in runs["none"][2]]
    assert [r["world_size"] for r in runs["none"][2]] == [2, 2, 2] and ref[0] != ref[-1]  # training happens
    for name in ("ring", "ulysses", "hybrid"):
        rows = runs[name][2]
        assert [r["cp_size"] for r in rows] == [2, 2, 2]
        assert max(_rel(r["loss"], a) for r, a in zip(rows, ref)) <= TOL, (name, rows, ref)


def test_moe_auxiliary_loss_is_exact_under_cp(runs):
    ref, rows = [r["loss"] for r in runs["aux_none"][2]], [r["loss"] for r in runs["aux_ring"][2]]
    assert max(_rel(a, b) for a, b in zip(rows, ref)) <= TOL, (rows, ref)
    plain = [r["loss"] for r in runs["none"][2]]
    # the auxiliary gradient changes the router, hence the later steps (step 1 is before any update)
    assert _rel(ref[0], plain[0]) <= TOL and max(_rel(a, b) for a, b in zip(ref[1:], plain[1:])) > EFFECT, (
        ref, plain)


def test_control_ring_without_the_sinks_misses_cp_none(runs):
    code, log, rows = runs["no_sinks"]
    assert code == 0 and len(rows) == 3, log[-3000:]
    ref = [r["loss"] for r in runs["none"][2]]
    assert max(_rel(r["loss"], a) for r, a in zip(rows, ref)) > EFFECT, (rows, ref)


def test_what_the_cpu_stack_cannot_run_is_refused_by_name(tmp_path, hf_cache):
    """Biased experts at expert-parallel size 1 (the recipe's CP=2 layout without model.expert_model_parallel_size):
    exit 2 before any rank, naming the fields."""
    code, log, _ = run_bridge(tmp_path, "ep1", RECIPE, *SHRINK, "cp=ring", "cp.size=2",
                              "model.expert_model_parallel_size=1", timeout=600, env=hf_cache)
    assert code == 2 and "model.add_bias_linear=true with MoE experts (model.num_moe_experts=4) at " \
        "model.expert_model_parallel_size=1 and model.expert_tensor_parallel_size=1" in log, log[-3000:]
    assert "core attention:" not in log  # no rank started


def test_moe_cpu_problems_name_each_setting():
    from types import SimpleNamespace

    from nemo_longctx.integrations.megatron.validation import moe_cpu_problems

    base = dict(num_moe_experts=4, add_bias_linear=True, expert_model_parallel_size=2,
                expert_tensor_parallel_size=1, tensor_model_parallel_size=1, moe_token_dispatcher_type="allgather")
    assert moe_cpu_problems(SimpleNamespace(**base), force=True) == []
    assert moe_cpu_problems(SimpleNamespace(**{**base, "num_moe_experts": None}), force=True) == []
    (bias,) = moe_cpu_problems(SimpleNamespace(**{**base, "expert_model_parallel_size": 1}), force=True)
    assert "model.add_bias_linear=true" in bias and "set model.expert_model_parallel_size" in bias
    assert moe_cpu_problems(SimpleNamespace(**{**base, "expert_model_parallel_size": 1,
                                                "expert_tensor_parallel_size": 2}), force=True) == []
    (a2a,) = moe_cpu_problems(SimpleNamespace(**{**base, "moe_token_dispatcher_type": "alltoall"}), force=True)
    assert "model.moe_token_dispatcher_type='alltoall' with model.expert_model_parallel_size=2" in a2a
    (flex,) = moe_cpu_problems(SimpleNamespace(**{**base, "moe_token_dispatcher_type": "flex"}), force=True)
    assert "model.moe_token_dispatcher_type='flex'" in flex
