"""``integrations/megatron/mcore_versions.py``: the Megatron-core APIs that differ between the versions the NeMo 2
containers ship. On the installed Megatron-core each function must answer exactly as Megatron's own API; the
earlier version's branch is checked by hiding the newer API (the version matrix, scripts/matrix_smoke.sh, runs it
for real on Megatron-core 0.14)."""

from __future__ import annotations

import builtins
from types import SimpleNamespace

import pytest

from nemo_longctx.integrations.megatron import mcore_versions as mv

# the Megatron-core-only version-matrix set (scripts/matrix_smoke.sh on stacks whose NeMo cannot import)
pytestmark = pytest.mark.matrix_mcore


@pytest.mark.parametrize("window_size, skip", [(None, None), ((64, 0), None), ((64, 0), 2), ((64, 0), 3),
                                               ((64, 0), [1, 0, 1, 1]), ((32, 32), [0, 0, 1, 0])])
def test_window_rule_is_megatrons_on_the_installed_version(window_size, skip):
    from megatron.core.transformer.utils import is_layer_window_attention as megatron_rule

    config = SimpleNamespace(window_size=window_size, window_attn_skip_freq=skip)
    for layer in range(1, 5):
        assert mv.is_layer_window_attention(config, layer) == megatron_rule(window_size, skip, layer)


def test_window_rule_without_the_megatron_function_applies_the_window_to_every_layer(monkeypatch):
    real_import = builtins.__import__

    def no_rule(name, globals=None, locals=None, fromlist=(), level=0):
        if name == "megatron.core.transformer.utils" and "is_layer_window_attention" in (fromlist or ()):
            raise ImportError("cannot import name 'is_layer_window_attention' (Megatron-core 0.14)")
        return real_import(name, globals, locals, fromlist, level)

    monkeypatch.setattr(builtins, "__import__", no_rule)
    assert [mv.is_layer_window_attention(SimpleNamespace(window_size=(64, 0)), n) for n in (1, 2, 3)] == [True] * 3
    assert mv.is_layer_window_attention(SimpleNamespace(window_size=None), 1) is False


def test_process_groups_under_either_name():
    pgs = object()
    assert mv.process_groups(pgs, None) is pgs and mv.process_groups(None, pgs) is pgs
    assert mv.process_groups(pgs, pgs) is pgs and mv.process_groups(None, None) is None
    with pytest.raises(ValueError, match="both pg_collection and model_comm_pgs"):
        mv.process_groups(pgs, object())


@pytest.mark.parametrize("field", [None, "fp8", "fp4"])
def test_fp8_or_fp4_refusal_of_full_recompute_reads_either_field(field):
    from megatron.core.transformer.transformer_config import TransformerConfig

    from nemo_longctx.integrations.megatron.memory_options import memory_model_problems
    from nemo_longctx.options import MemoryOptions

    config = TransformerConfig(num_layers=2, hidden_size=64, num_attention_heads=4)
    if field is not None:
        setattr(config, field, "hybrid" if field == "fp8" else "nvfp4")
    assert mv.uses_fp8_or_fp4(config) is (field is not None)
    p = memory_model_problems(MemoryOptions(recompute="full"), config)
    assert any("fp8/fp4" in m for m in p) is (field is not None), p
    del config.fp4  # Megatron-core 0.14's config has no fp4 field
    assert mv.uses_fp8_or_fp4(config) is (field == "fp8")


def test_block_submodules_is_megatrons_and_the_0_14_branch_builds_the_same_block(monkeypatch):
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec
    from megatron.core.transformer import transformer_block
    from megatron.core.transformer.transformer_config import TransformerConfig

    config = TransformerConfig(num_layers=3, hidden_size=64, num_attention_heads=4)
    spec = get_gpt_layer_local_spec()
    new = mv.block_submodules(config, spec, 0)
    assert new.layer_specs == transformer_block._get_block_submodules(config, spec, vp_stage=None,
                                                                      pp_rank=0).layer_specs

    def without_pp_rank(config, spec, vp_stage=None):  # 0.14's signature; it reads the (absent) pipeline group
        raise AssertionError("pipeline_model parallel group is not initialized")

    monkeypatch.setattr(transformer_block, "_get_block_submodules", without_pp_rank)
    assert mv.block_submodules(config, spec, 0).layer_specs == new.layer_specs == [spec] * 3
    config.pipeline_model_parallel_size = 2
    with pytest.raises(ValueError, match="needs Megatron-core >= 0.15"):
        mv.block_submodules(config, spec, 1)


def test_thd_freqs_with_and_without_megatrons_offset_argument(monkeypatch):
    import torch
    from megatron.core.models.common.embeddings import rope_utils

    freqs = torch.arange(16.0).view(16, 1, 1, 1)
    rows = torch.empty(4, 0)
    for offset in (0, 8):
        assert torch.equal(mv.thd_freqs_on_this_cp_rank(1, 2, rows, freqs, offset),
                           rope_utils._get_thd_freqs_on_this_cp_rank(1, 2, rows, freqs, offset))
    calls = []
    monkeypatch.setattr(rope_utils, "_get_thd_freqs_on_this_cp_rank",
                        lambda cp_rank, cp_size, x, freqs: calls.append((cp_rank, cp_size)) or freqs[:2])
    assert torch.equal(mv.thd_freqs_on_this_cp_rank(1, 2, rows, freqs, 8), freqs[:2]) and calls == [(1, 2)]
