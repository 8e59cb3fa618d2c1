"""Regression tests, one per finding of ``nemo-longctx fuzz`` (docs/how-to/fuzz.md, "What it found"): each is now
refused by name before a run starts, and each refusal is also what the fuzzer reports for its reproducer."""

from __future__ import annotations

import pytest

from nemo_longctx.integrations.megatron.fuzz_cases import parse_case
from nemo_longctx.options import LongContextOptions, MemoryOptions


def test_loss_chunks_with_megatron_fsdp_is_refused():
    # reproducer: model=mha dp=2 cp=ulysses cp.size=2 tiling.loss_chunks=2 state=fsdp (asserted at the first step)
    opts = LongContextOptions.from_dict({"tiling": {"loss_chunks": 2}, "optim": {"use_distributed_optimizer": True,
                                                                                  "megatron_fsdp": True}})
    assert any("tiling.loss_chunks=2 with optim.megatron_fsdp=true" in p for p in opts.problems())
    case = parse_case("model=mha dp=2 cp=ulysses cp.size=2 tiling.loss_chunks=2 state=fsdp")
    assert any("megatron_fsdp" in p for p in case.refused)
    assert not LongContextOptions.from_dict({"tiling": {"loss_chunks": 2}}).problems()  # DDP keeps loss chunks


def test_kept_attention_with_packed_documents_is_refused_by_the_data_checks():
    assert MemoryOptions(recompute="full_keep_attn").packed_problems("data.packing=documents")
    assert MemoryOptions(recompute="full").packed_problems("data.packing=documents") == []
    case = parse_case("model=mha tp=2 dp=2 cp=ring cp.size=2 recompute=full_keep_attn data=packed documents=16,16,32")
    assert any("does not take packed documents" in p for p in case.refused)
    from nemo_longctx.integrations.nemo.data_checks import data_problems
    from nemo_longctx.shared.run_spec import spec_from_dict

    spec = spec_from_dict({"data": {"kind": "synthetic", "packing": "documents"},
                           "recompute": {"name": "full_keep_attn"}, "trainer": {"micro_batch_size": 1}})
    assert any("recompute=full_keep_attn does not take packed documents (data.packing=documents)" in p
               for p in data_problems(spec))


@pytest.fixture(scope="module")
def megatron_configs():
    from nemo_longctx.integrations.megatron.patches import LEDGER

    LEDGER.apply()
    from megatron.core.transformer.transformer_config import MLATransformerConfig, TransformerConfig

    common = dict(num_layers=2, hidden_size=64, num_attention_heads=8, ffn_hidden_size=128)
    window = TransformerConfig(**common, window_size=(8, 0))
    mla = MLATransformerConfig(**common, q_lora_rank=None, kv_lora_rank=16, qk_head_dim=8, qk_pos_emb_head_dim=8,
                               v_head_dim=8, rope_type="rope")
    return window, mla


def test_kept_attention_with_a_sliding_window_is_refused(megatron_configs):
    from nemo_longctx.integrations.megatron.memory_options import memory_model_problems

    window, _ = megatron_configs
    assert any("does not take sliding windows" in p
               for p in memory_model_problems(MemoryOptions(recompute="full_keep_attn"), window))
    assert memory_model_problems(MemoryOptions(recompute="full"), window) == []


def test_mla_under_tensor_parallelism_is_refused_where_megatrons_gradient_is_wrong(megatron_configs):
    # reproducer: model=mla tp=2 cp=none state=ddp micro_batches=2 (params 3.6e-3 off after 3 SGD steps)
    from nemo_longctx.integrations.megatron.validation import mla_tensor_parallel_problems

    window, mla = megatron_configs
    p = mla_tensor_parallel_problems(mla, 2)
    assert p and "only this TP rank's heads' gradient" in p[0]  # this CPU machine: no TransformerEngine
    assert mla_tensor_parallel_problems(mla, 1) == []
    assert mla_tensor_parallel_problems(window, 2) == []  # not MLA
