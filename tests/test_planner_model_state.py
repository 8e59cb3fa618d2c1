"""The planner's model-state bytes (pure python) and the frontier report's consistency."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

from nemo_longctx.planner.model_shapes import KNOWN_SHAPES
from nemo_longctx.planner.search import Candidate, ModelState, Precision, model_state_bytes, structural_accept

L8B = KNOWN_SHAPES["llama3_8b"]
P = L8B.parameters()


def _bytes(ms, tp=1, cp=1, dp=1):
    return model_state_bytes(L8B, Candidate("ring" if cp > 1 else "none", cp, 1, tp, model_state=ms), dp, Precision())


def test_ddp_distributed_fsdp_bytes_per_parameter():
    d = _bytes(ModelState("ddp"), cp=8)
    assert d["weights"] == 2 * P and d["grads"] == 4 * P and d["optimizer"] == 12 * P and d["host"] == 0
    d = _bytes(ModelState("distributed"), cp=4, dp=2)  # ZeRO-1 over dp x cp = 8
    assert d["weights"] == 2 * P and d["grads"] == 4 * P and d["optimizer"] == pytest.approx(12 * P / 8)
    d = _bytes(ModelState("fsdp"), tp=2, cp=4)  # ZeRO-3 over 4, TP 2
    unit = 2 * L8B.layer_parameters() + (P - L8B.num_layers * L8B.layer_parameters())
    assert d["weights"] == pytest.approx(2 * (P / 4 + unit) / 2)
    assert d["grads"] == pytest.approx(4 * (P / 4 + unit) / 2)
    assert d["optimizer"] == pytest.approx(12 * P / 2 / 4)


def test_optimizer_offload_and_precision_aware_bytes():
    # full offload: the host holds fp32 master + grad copy + moments (16 B); the device keeps the fp32 master shard
    d = _bytes(ModelState("distributed", 1.0), cp=8)
    assert d["optimizer"] == pytest.approx(4 * P / 8) and d["host"] == pytest.approx(16 * P / 8)
    # precision-aware + full offload: the master lives only on the host, grads are bf16
    d = _bytes(ModelState("distributed", 1.0, True))
    assert d["optimizer"] == 0 and d["grads"] == 2 * P and d["host"] == pytest.approx(16 * P)
    # half offload: at least half the Adam states on the host (the device part counted at 0.5); Megatron moves whole
    # shard pieces, so the host part is counted with one more largest tensor (the embedding, V x h)
    d = _bytes(ModelState("distributed", 0.5), cp=2)
    assert d["optimizer"] == pytest.approx((0.5 * 12 + 0.5 * 4) * P / 2)
    assert d["host"] == pytest.approx(16 * (0.5 * P / 2 + L8B.vocab_size * L8B.hidden_size))
    # precision-aware on the device (TE FusedAdam >= 2.1): the fp32 master as its 16-bit remainder + bf16 moments
    d = _bytes(ModelState("distributed", 0.0, True), cp=8)
    assert d["optimizer"] == pytest.approx(6 * P / 8) and d["grads"] == 2 * P
    # precision-aware + half offload: HybridDeviceOptimizer's device part steps fp32 copies (4 B) with fp32 moments
    # (8 B) and an fp32 copy of each bf16 grad (4 B)
    d = _bytes(ModelState("distributed", 0.5, True), cp=2)
    assert d["optimizer"] == pytest.approx(0.5 * 16 * P / 2) and d["grads"] == 2 * P


def test_structural_filter_matches_the_known_refusals():
    assert not structural_accept("ulysses", "full_keep_attn", "none", ModelState())
    assert not structural_accept("hybrid", "full_keep_attn", "layer_input", ModelState())
    assert structural_accept("ring", "full_keep_attn", "layer_input", ModelState())
    assert not structural_accept("ring", "selective_mlp", "layer_input", ModelState())
    assert not structural_accept("ring", "full", "none", ModelState("fsdp", 1.0))
    assert not structural_accept("ring", "full", "none", ModelState("ddp", 0.0, True))
    with pytest.raises(ValueError, match="sharding"):
        ModelState("zero9")


def test_structural_filter_agrees_with_the_apps_checks():
    """The library's fallback filter and the plan app's filter (the train app's own checks) accept the same
    combinations of the planner's vocabulary."""
    import itertools

    from nemo_longctx.apps.plan import app_problems
    from nemo_longctx.planner.search import MODEL_STATES, RECOMPUTE

    for algo, rc, off, ms in itertools.product(("none", "ring", "ulysses", "hybrid"), RECOMPUTE,
                                               ("none", "layer_input"), MODEL_STATES):
        assert structural_accept(algo, rc, off, ms) == (not app_problems(algo, rc, off, ms)), (algo, rc, off, ms)


def test_frontier_is_the_longest_fitting_length_and_the_app_accepts_it():
    sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "bench"))
    import frontier

    from nemo_longctx.apps.plan import app_problems
    from nemo_longctx.planner.search import plan

    seq, p, ctx = frontier.frontier("llama3_8b", "h100", 1)
    shape, hw, precision, coef, cost, search, tol = ctx
    assert seq >= 256 * 1024 and p.chosen is not None
    c = p.chosen.candidate
    assert app_problems(c.cp_algorithm, c.recompute, c.offload, c.model_state) == ()
    assert plan(shape, seq + frontier.STEP, hw, precision, coef, cost, tol, **search).chosen is None
