"""CP must never be disabled silently: the fit-start check of the *built* model (real Megatron GPTModels, 2 gloo
ranks with CP=2) accepts our attention with the configured size/algorithm and names every other layer."""

from __future__ import annotations

import pytest

from distributed import run_distributed

# the Megatron-core-only version-matrix set (scripts/matrix_smoke.sh on stacks whose NeMo cannot import)
pytestmark = pytest.mark.matrix_mcore


def _worker(rank, world_size):
    from megatron.core import parallel_state as ps
    from megatron.core.models.gpt import GPTModel
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec

    from nemo_longctx.integrations.megatron.memory_probe import tiny_gpt_config
    from nemo_longctx.integrations.megatron.spec import long_context_layer_spec
    from nemo_longctx.integrations.megatron.validation import built_attention_problems
    from nemo_longctx.integrations.nemo import compat
    from nemo_longctx.integrations.nemo.callbacks import VerifyLongContextAttention

    compat.apply()
    ps.initialize_model_parallel(context_parallel_size=2)
    from megatron.core import tensor_parallel

    tensor_parallel.model_parallel_cuda_manual_seed(1234)

    def gpt(spec, cp):
        return GPTModel(tiny_gpt_config(num_layers=2, cp=cp), spec, vocab_size=64, max_sequence_length=32,
                        position_embedding_type="rope")

    ours = gpt(long_context_layer_spec(get_gpt_layer_local_spec(normalization="RMSNorm"), "ring"), cp=2)
    megatrons = gpt(get_gpt_layer_local_spec(normalization="RMSNorm"), cp=1)  # DotProductAttention, no CP
    out = {
        "ours": built_attention_problems(ours, 2, "ring"),
        "size": built_attention_problems(ours, 4, "ring"),
        "algo": built_attention_problems(ours, 2, "ulysses"),
        "megatron": built_attention_problems(megatrons, 2, "ring"),
        "empty": built_attention_problems(ours.embedding, 2, "ring"),
    }
    VerifyLongContextAttention(2, "ring").on_fit_start(None, ours)  # passes
    try:
        VerifyLongContextAttention(2, "ring").on_fit_start(None, megatrons)
    except RuntimeError as e:
        out["callback"] = str(e)
    ps.destroy_model_parallel()
    return out


@pytest.fixture(scope="module")
def results():
    return run_distributed(_worker, 2, timeout=300)


def test_our_attention_passes_and_mismatches_are_named(results):
    for r in results:
        assert r["ours"] == []
        assert len(r["size"]) == 2 and all("over 2 rank(s)" in p and "cp.size=4" in p for p in r["size"])
        assert len(r["algo"]) == 2 and all("cp.algorithm='ulysses'" in p for p in r["algo"])
        assert "no Megatron attention layer" in r["empty"][0]


def test_megatron_attention_is_refused_layer_by_layer(results):
    for r in results:
        assert len(r["megatron"]) == 2
        assert all("DotProductAttention, not nemo_longctx's LongContextCoreAttention" in p for p in r["megatron"])
        assert "decoder.layers.0.self_attention.core_attention" in r["megatron"][0]
        assert r["callback"].startswith("the built model does not use nemo_longctx attention")
