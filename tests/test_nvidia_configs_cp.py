"""NVIDIA's own NeMo GPT configs train under ring, Ulysses and hybrid CP with cp=none's per-step losses: the CI-sized
part of the sweep (``bench/nvidia_configs_sweep.py`` runs all of them; how: ``tests/nvidia_configs.py``).

One spawn of 2 gloo ranks runs one config per family module of ``nemo.collections.llm.gpt.model`` (``SUBSET``: the
quickest whose shrunk config differs from the others), each shrunk to a tiny size by the generic ``shrink``, built by
NeMo (``enable_long_context`` + ``configure_model``) and trained 3 SGD steps through Megatron-core's DDP and
``get_forward_backward_func`` with NeMo's ``MaskedTokenLossReduction``. Every CP mode must match cp=none (5e-6
relative per step) or be refused with a message naming the field (``REFUSED``); the no-communication control must
differ from cp=none by more than 2x the tolerance and 20x the CP modes' own difference. The same job discovers every
config class: each family module must be found (and no new one may appear unnoticed), and every discovered class must
land in a sweep group, so the bench covers them all.

Known failures expected to be fixed go into ``KNOWN_FAILURES`` (``xfail(strict=True)``): delete the entry when the
fix lands (strict: an entry that passes fails the run).
"""

from __future__ import annotations

import pytest

import nvidia_configs as nc
from distributed import run_distributed

# One config per family module (``nc.FAMILY_MODULES``).
SUBSET = {
    "baichuan": "Baichuan2Config7B",
    "base": "GPTConfig126M",  # learned absolute positions, GELU, tied embeddings; NVIDIA's dropout 0.1 set to 0
    "chatglm": "ChatGLM2Config6B",  # GQA, rotary_percent 0.5, interleaved RoPE, QKV bias
    "deepseek": "DeepSeekV2LiteConfig",  # MLA, MoE (seq_aux_loss, shared experts, first layer dense), grouped GEMM
    "gemma": "GemmaConfig2B",  # MQA, head dim 256 (-> 32), zero-centred RMSNorm (cpu_compat fix 12)
    "gemma2": "Gemma2Config2B",  # attention logit soft-capping (refused)
    "gemma3": "Gemma3Config1B",  # local/global layers (5, 1)
    "gpt_oss": "GPTOSSConfig20B",
    "llama": "Llama32Config1B",  # GQA, Llama 3.1 RoPE scaling, tied embeddings
    "llama_embedding": "Llama32EmbeddingConfig1B",  # excluded: bidirectional (checked by the job)
    "llama_nemotron": "Llama33NemotronSuper49BConfig",  # heterogeneous blocks (no-op attention layers)
    "mistral": "MistralConfig7B",  # sliding window, NVIDIA's cp_comm_type='a2a'
    "mixtral": "MixtralConfig8x7B",  # MoE with NVIDIA's load-balancing aux loss 0.01
    "nemotron": "Nemotron3Config4B",  # squared ReLU, zero-centred LayerNorm, rotary_percent 0.5
    "phi3mini": "Phi3ConfigMini",
    "qwen2": "Qwen25Config500M",  # QKV bias, GQA 14/2
    "qwen3": "Qwen3Config600M",  # QK layernorm
    "reranker": "Llama32Reranker500MConfig",  # excluded: bidirectional (checked by the job)
    "starcoder": "StarcoderConfig15B",  # MQA, learned absolute positions; NVIDIA's dropout 0.2 set to 0
    "starcoder2": "Starcoder2Config3B",
}

# (config, mode) -> text the refusal must contain: the field that refuses it where the message names one. Modes not
# listed must match (cp=none: train).
_ALL, _CP = nc.MODES, nc.MODES[1:]
REFUSED = {
    # NeMo's Gemma 2/3 layer specs use TransformerEngine layers: without TE they are Mock placeholders, which our
    # spec refuses to copy, naming TE (Gemma 2's soft-capping refusal is not reached); NeMo refuses CP for Gemma 3
    **{("Gemma2Config2B", m): "cannot be trained without TransformerEngine" for m in _ALL},
    ("Gemma3Config1B", "none"): "cannot be trained without TransformerEngine",
    **{("Gemma3Config1B", m): "Context Parallel is not supported for Gemma3" for m in _CP},
    # NeMo 2.7.3 imports quick_gelu from megatron.core.activations, absent in Megatron-core 0.15.3
    **{("GPTOSSConfig20B", m): "bias_activation_fusion" for m in _ALL},
    # heterogeneous blocks with no-op attention
    **{("Llama33NemotronSuper49BConfig", m): "only standard (GQA/MHA) self-attention layers" for m in _ALL},
}

# (config, mode) -> reason: failing today, expected to be fixed. Empty: the MoE aux-loss gradient under CP, Mistral's
# cp_comm_type='a2a' and DeepSeek's grouped GEMM on CPU were fixed before this test was first run.
KNOWN_FAILURES: dict = {}


def _cases():
    for module, name in sorted(SUBSET.items()):
        for mode in nc.MODES:
            marks = []
            if (name, mode) in KNOWN_FAILURES:
                marks.append(pytest.mark.xfail(strict=True, reason=KNOWN_FAILURES[(name, mode)]))
            yield pytest.param(name, mode, marks=marks, id=f"{name}-{mode}")


@pytest.fixture(scope="module")
def sweep():
    groups = [{"paths": [f"{nc.PACKAGE}.{module}:{name}"], "names": [name], "modules": [module]}
              for module, name in sorted(SUBSET.items())]
    out = run_distributed(nc.sweep_job, 2, groups, True, True, timeout=900)
    out[0]["by_name"] = {r["names"][0]: r for r in out[0]["results"]}
    return out[0]


def test_subset_is_one_config_per_family_module():
    assert sorted(SUBSET) == sorted(nc.FAMILY_MODULES)


@pytest.mark.parametrize("name, mode", list(_cases()))
def test_config_trains_under_cp_as_under_none(sweep, name, mode):
    res = sweep["by_name"][name]
    if name in nc.EXCLUDED:
        assert "excluded" in res and "post_process=False" in res["check"]["built"], res
        assert "attn_mask_type" in res["check"]["ours"] and "not supported" in res["check"]["ours"], res
        return
    r = res[mode]
    if (name, mode) in REFUSED:
        assert r["status"] == "refused" and REFUSED[(name, mode)] in r["error"], (name, mode, r)
    elif mode == "none":
        assert r["status"] == "ok" and r["losses"][0] > r["losses"][-1], (name, r)  # it trains
    else:
        assert r["status"] == "match", (name, mode, r.get("worst"), r.get("error"), nc.format_table([res]))


def test_no_communication_control_differs(sweep):
    nc.check_control(sweep["control"])  # asserts the control differs (see its docstring)


def test_discovery_covers_every_family_and_every_class(sweep):
    found = sweep["discovered"]
    modules = {m for m, _ in found}
    assert modules >= set(nc.FAMILY_MODULES), f"family modules no longer found: {set(nc.FAMILY_MODULES) - modules}"
    assert modules <= set(nc.FAMILY_MODULES), (f"new family module(s) {modules - set(nc.FAMILY_MODULES)}: add them "
                                               "to nvidia_configs.FAMILY_MODULES and a config of each to SUBSET")
    assert len(found) >= 104, len(found)  # NeMo 2.7.3 ships 104 GPTConfig classes
    grouped = [n for names in sweep["plan"] for n in names]
    assert sorted(grouped) == sorted(c for _, c in found)  # every class is in exactly one sweep group
    for name in SUBSET.values():  # the subset's configs are distinct once shrunk
        group = next(g for g in sweep["plan"] if name in g)
        assert not set(group) & (set(SUBSET.values()) - {name}), group


def test_shrink_rules_without_nemo():
    """The generic size rules on plain field values (no NeMo import: quick)."""
    v3 = {"num_layers": 61, "hidden_size": 7168, "num_attention_heads": 128, "num_query_groups": 128,
          "multi_latent_attention": True, "kv_channels": 128, "v_head_dim": 128, "qk_head_dim": 128,
          "qk_pos_emb_head_dim": 64, "q_lora_rank": 1536, "kv_lora_rank": 512, "num_moe_experts": 256,
          "moe_router_topk": 8, "moe_router_num_groups": 8, "moe_router_group_topk": 4,
          "moe_layer_freq": [0] * 3 + [1] * 58}
    t = nc.tiny_sizes(v3)
    assert t["num_layers"] == 4 and t["moe_layer_freq"] == [0, 0, 0, 1]  # first-3-dense kept, one MoE layer
    assert t["num_moe_experts"] == 16 and 16 // 8 * 4 >= 8  # 8 groups of 2; 4 groups selected hold >= top-8
    assert (t["qk_head_dim"], t["qk_pos_emb_head_dim"], t["v_head_dim"]) == (16, 8, 16)
    assert (t["num_attention_heads"], t["num_query_groups"]) == (4, 4)
    llama4 = {"num_layers": 48, "hidden_size": 5120, "num_attention_heads": 40, "num_query_groups": 8,
              "kv_channels": 128, "moe_layer_freq": [0, 1] * 24, "nope_layer_interval": 4, "num_moe_experts": 128,
              "moe_router_topk": 1, "attention_chunk_size": 8192}
    t = nc.tiny_sizes(llama4)
    assert t["num_layers"] == 4 and t["moe_layer_freq"] == [0, 1, 0, 1] and t["attention_chunk_size"] == 32
    assert (t["num_attention_heads"], t["num_query_groups"], t["num_moe_experts"]) == (4, 2, 4)
    gemma3 = {"num_layers": 26, "hidden_size": 1152, "num_attention_heads": 4, "num_query_groups": 1,
              "kv_channels": 256, "window_size": 512, "interleaved_attn_pattern": (5, 1)}
    t = nc.tiny_sizes(gemma3)
    assert t["num_layers"] == 6 and t["window_size"] == 24 and t["num_query_groups"] == 1  # MQA kept
    mistral = {"num_layers": 32, "hidden_size": 4096, "num_attention_heads": 32, "num_query_groups": 8,
               "kv_channels": 128, "ffn_hidden_size": 14336, "window_size": [4096, 0], "window_attn_skip_freq": 2}
    t = nc.tiny_sizes(mistral)
    assert t["window_size"] == (24, 0) and t["num_layers"] == 2 and t["hidden_size"] == 64  # 24 < S/4: acts
    assert t["ffn_hidden_size"] == 224 and t["seq_length"] == 128 and t["vocab_size"] == 256  # ratio 3.5 kept
