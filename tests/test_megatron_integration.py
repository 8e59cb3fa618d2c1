"""Megatron-core integration on 2 gloo ranks (one spawn, many cases; assertions in the parent):

- zigzag batch sharding == megatron.core.utils.get_batch_on_this_cp_rank (tokens/labels/loss_mask/position_ids and
  a [b, 1, S, S] attention_mask);
- LongContextCoreAttention vs Megatron's own DotProductAttention: cp=1 forward + backward (fp64 and fp32, GQA and
  MHA, b=1 and b=2, default and explicit softmax_scale, apply_query_key_layer_scaling), and cp=2 (ring over the real
  Megatron CP group) against DotProductAttention on the full sequence, compared on this rank's zigzag shard;
- attention sinks (``softmax_type`` learnable / off-by-one) vs DotProductAttention at cp=1 and ring CP=2 (forward,
  q/k/v and sink gradients), the vanilla module unchanged;
- build-time errors for unsupported combinations; the spec helper on the local layer spec and a real MCore GPTModel
  whose every layer's core_attention is ours.
"""

from __future__ import annotations

import copy

import pytest
import torch

from distributed import run_distributed

# the Megatron-core-only version-matrix set (scripts/matrix_smoke.sh on stacks whose NeMo cannot import)
pytestmark = pytest.mark.matrix_mcore


def _config(cp: int, heads: int, groups: int, d: int, dtype=torch.float64, **kw):
    from megatron.core.transformer.transformer_config import TransformerConfig

    return TransformerConfig(
        num_layers=2, hidden_size=heads * d, num_attention_heads=heads, num_query_groups=groups,
        context_parallel_size=cp, attention_dropout=0.0, hidden_dropout=0.0, masked_softmax_fusion=False,
        params_dtype=dtype, **kw,
    )


def _megatron_attention(config, q, k, v, dout, softmax_scale=None):
    from megatron.core.transformer.dot_product_attention import DotProductAttention
    from megatron.core.transformer.enums import AttnMaskType

    mod = DotProductAttention(config, 1, AttnMaskType.causal, "self", softmax_scale=softmax_scale)
    q, k, v = (t.detach().clone().requires_grad_() for t in (q, k, v))
    out = mod(q, k, v, None, attn_mask_type=AttnMaskType.causal)
    out.backward(dout)
    return out.detach(), q.grad, k.grad, v.grad


def _ours(config, q, k, v, dout, softmax_scale=None, layer_number=1, pg_collection=None):
    from megatron.core.transformer.enums import AttnMaskType

    from nemo_longctx.integrations.megatron.core_attention import LongContextCoreAttention

    mod = LongContextCoreAttention(config, layer_number, AttnMaskType.causal, "self", softmax_scale=softmax_scale,
                                   pg_collection=pg_collection)
    q, k, v = (t.detach().clone().requires_grad_() for t in (q, k, v))
    out = mod(q, k, v, None)
    out.backward(dout)
    return out.detach(), q.grad, k.grad, v.grad


def _rel(a, b):
    return ((a.double() - b.double()).norm() / b.double().norm().clamp_min(1e-30)).item()


def _with_sinks(mod, q, k, v, dout, sinks):
    """(out, dq, dk, dv, dsinks) of a core-attention module whose learnable sink is set to ``sinks`` (fp64 here)."""
    if sinks is not None:
        with torch.no_grad():
            mod.softmax_offset.copy_(sinks)
        mod.softmax_offset.grad = None
    q, k, v = (t.detach().clone().requires_grad_() for t in (q, k, v))
    out = mod(q, k, v, None, attn_mask_type=mod.attn_mask_type)
    out.backward(dout)
    dsinks = mod.softmax_offset.grad.clone() if sinks is not None else None
    return out.detach(), q.grad, k.grad, v.grad, dsinks


def _sink_cases(pg_cp1):
    """Attention sinks (``softmax_type``; this Megatron-core has the field: 0.15 leaves the learnable sink of its
    DotProductAttention uninitialised, so both modules get the same values): ours at cp=1 and ring CP=2 vs Megatron's
    DotProductAttention, forward and q/k/v/sink gradients (the sink's summed over the CP group); the state dict key
    and the vanilla module's (none) as Megatron's."""
    import dataclasses

    import torch.distributed as dist
    from megatron.core import parallel_state as ps
    from megatron.core.transformer.dot_product_attention import DotProductAttention
    from megatron.core.transformer.enums import AttnMaskType
    from megatron.core.transformer.transformer_config import TransformerConfig

    from nemo_longctx.attention import zigzag_shard
    from nemo_longctx.integrations.megatron.core_attention import LongContextCoreAttention

    if "softmax_type" not in {f.name for f in dataclasses.fields(TransformerConfig)}:
        return None  # Megatron-core 0.14: no sinks
    dtype, heads, groups, d, s = torch.float64, 4, 2, 16, 32
    g = torch.Generator().manual_seed(11)
    q = torch.randn(s, 2, heads, d, generator=g, dtype=dtype)
    k, v = (torch.randn(s, 2, groups, d, generator=g, dtype=dtype) for _ in range(2))
    dout = torch.randn(s, 2, heads * d, generator=g, dtype=dtype)
    sinks = torch.linspace(-1.0, 3.0, heads, dtype=dtype)
    cpr = ps.get_context_parallel_rank()
    sh = lambda t: zigzag_shard(t, 0, 2, cpr)  # noqa: E731
    out = {}
    for softmax_type in ("learnable", "off-by-one"):
        learn = sinks if softmax_type == "learnable" else None
        cfg1 = _config(1, heads, groups, d, dtype, softmax_type=softmax_type)
        want = _with_sinks(DotProductAttention(cfg1, 1, AttnMaskType.causal, "self"), q, k, v, dout, learn)
        mod1 = LongContextCoreAttention(cfg1, 1, AttnMaskType.causal, "self", pg_collection=pg_cp1)
        got1 = _with_sinks(mod1, q, k, v, dout, learn)
        mod2 = LongContextCoreAttention(_config(2, heads, groups, d, dtype, softmax_type=softmax_type), 2,
                                        AttnMaskType.causal, "self")
        got2 = _with_sinks(mod2, sh(q), sh(k), sh(v), sh(dout), learn)
        if learn is not None:
            dist.all_reduce(got2[4], group=ps.get_context_parallel_group())
        n = 5 if learn is not None else 4
        out[softmax_type] = {
            "cp1": [_rel(a, w) for a, w in zip(got1[:n], want[:n])],
            "cp2": [_rel(a, sh(w) if i < 4 else w) for i, (a, w) in enumerate(zip(got2[:n], want[:n]))],
            "keys": (sorted(mod1.state_dict()), sorted(DotProductAttention(cfg1, 1, AttnMaskType.causal,
                                                                           "self").state_dict())),
            "param": (tuple(mod1.softmax_offset.shape), str(mod1.softmax_offset.dtype),
                      isinstance(mod1.softmax_offset, torch.nn.Parameter)),
        }
    vanilla = LongContextCoreAttention(_config(1, heads, groups, d, dtype), 1, AttnMaskType.causal, "self",
                                       pg_collection=pg_cp1)
    out["vanilla_state"] = (sorted(vanilla.state_dict()), vanilla.softmax_offset)
    out["control"] = _rel(_with_sinks(vanilla, q, k, v, dout, None)[0],
                          _with_sinks(DotProductAttention(_config(1, heads, groups, d, dtype, softmax_type="learnable"),
                                                          1, AttnMaskType.causal, "self"), q, k, v, dout, sinks)[0])
    return out


def _worker(rank: int, world: int):
    from nemo_longctx.integrations.megatron import cpu_compat

    cpu_compat.apply()
    from megatron.core import parallel_state as ps
    from megatron.core.transformer.enums import AttnMaskType
    from megatron.core.utils import get_batch_on_this_cp_rank

    from nemo_longctx.attention import zigzag_shard
    from nemo_longctx.integrations.megatron.batch import shard_batch_for_cp
    from nemo_longctx.integrations.megatron.core_attention import LongContextCoreAttention

    import torch.distributed as dist
    from megatron.core.process_groups_config import ProcessGroupCollection

    from megatron.core import tensor_parallel

    ps.initialize_model_parallel(context_parallel_size=2)
    tensor_parallel.model_parallel_cuda_manual_seed(123)  # Megatron's RNG tracker (on the CPU generator here)
    single = [dist.new_group([r]) for r in range(world)]  # collective: every rank creates both
    pg_cp1 = ProcessGroupCollection(cp=single[rank])  # a one-rank CP group, passed the way Megatron passes it
    res = {}

    # -- batch sharding vs Megatron
    g = torch.Generator().manual_seed(0)
    S, b = 24, 2
    batch = {
        "tokens": torch.randint(0, 100, (b, S), generator=g),
        "labels": torch.randint(0, 100, (b, S), generator=g),
        "loss_mask": torch.rand(b, S, generator=g),
        "position_ids": torch.arange(S).repeat(b, 1),
        "attention_mask": torch.rand(b, 1, S, S, generator=g) > 0.5,
    }
    ours = shard_batch_for_cp(batch, 2, ps.get_context_parallel_rank())
    theirs = get_batch_on_this_cp_rank(copy.deepcopy(batch))
    res["zigzag_equal"] = {k: torch.equal(ours[k], theirs[k]) for k in batch}
    res["zigzag_shapes"] = {k: tuple(ours[k].shape) for k in batch}

    # -- core attention vs DotProductAttention
    cases = []
    for dtype, tol in ((torch.float64, 1e-10), (torch.float32, 2e-5)):
        for (heads, groups, d, bsz, s, scale, qk_scaling) in (
            (8, 2, 16, 1, 32, None, False),
            (4, 4, 8, 2, 16, 0.3, False),
            (6, 3, 16, 2, 24, None, True),
        ):
            g = torch.Generator().manual_seed(heads * 100 + s)
            q = torch.randn(s, bsz, heads, d, generator=g, dtype=dtype)
            k = torch.randn(s, bsz, groups, d, generator=g, dtype=dtype)
            v = torch.randn(s, bsz, groups, d, generator=g, dtype=dtype)
            dout = torch.randn(s, bsz, heads * d, generator=g, dtype=dtype)
            extra = {"apply_query_key_layer_scaling": True, "fp16": False} if qk_scaling else {}
            want = _megatron_attention(_config(1, heads, groups, d, dtype, **extra), q, k, v, dout, scale)
            # cp=1: the full sequence, module built with a one-rank CP group (pg_collection.cp)
            got1 = _ours(_config(1, heads, groups, d, dtype, **extra), q, k, v, dout, scale, pg_collection=pg_cp1)
            # cp=2: this rank's zigzag shard through the ring over Megatron's CP group
            cpr = ps.get_context_parallel_rank()
            sh = lambda t: zigzag_shard(t, 0, 2, cpr)  # noqa: E731 - sequence is dim 0 in Megatron's layout
            got2 = _ours(_config(2, heads, groups, d, dtype, **extra), sh(q), sh(k), sh(v), sh(dout), scale,
                         layer_number=2)
            cases.append({
                "case": (str(dtype), heads, groups, d, bsz, s, scale, qk_scaling), "tol": tol,
                "cp1": [_rel(a, w) for a, w in zip(got1, want)],
                "cp2": [_rel(a, sh(w)) for a, w in zip(got2, want)],
                "shape": tuple(got1[0].shape),
            })
    res["attention"] = cases
    res["sinks"] = _sink_cases(pg_cp1)

    # -- build-time errors (messages checked in the parent)
    errors = {}

    def expect(name, fn):
        try:
            fn()
            errors[name] = None
        except ValueError as e:
            errors[name] = str(e)

    cfg = _config(2, 8, 2, 16)
    expect("dropout", lambda: LongContextCoreAttention(cfg, 1, AttnMaskType.causal, "self", attention_dropout=0.1))
    expect("window", lambda: LongContextCoreAttention(_config(2, 8, 2, 16, window_size=(64, 0, 1)), 1,
                                                      AttnMaskType.causal, "self"))
    expect("padding", lambda: LongContextCoreAttention(cfg, 1, AttnMaskType.padding, "self"))
    expect("arbitrary", lambda: LongContextCoreAttention(cfg, 1, AttnMaskType.arbitrary, "self"))
    expect("a2a", lambda: LongContextCoreAttention(cfg, 1, AttnMaskType.causal, "self", cp_comm_type="a2a"))
    expect("algo", lambda: LongContextCoreAttention(cfg, 1, AttnMaskType.causal, "self", cp_algorithm="nope"))
    expect("cp_mismatch", lambda: LongContextCoreAttention(_config(4, 8, 2, 16), 1, AttnMaskType.causal, "self"))
    mod = LongContextCoreAttention(cfg, 1, AttnMaskType.causal, "self")
    x = torch.randn(8, 1, 8, 16, dtype=torch.float64)
    kv = torch.randn(8, 1, 2, 16, dtype=torch.float64)
    expect("packed", lambda: mod(x, kv, kv, None, packed_seq_params=object()))
    expect("mask", lambda: mod(x, kv, kv, torch.ones(1, 1, 8, 16, dtype=torch.bool)))
    expect("bias", lambda: mod(x, kv, kv, None, attention_bias=torch.zeros(1)))
    res["errors"] = errors

    # -- spec helper + a real MCore GPT model built from it (cp=2)
    from megatron.core.models.gpt import GPTModel
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec

    from nemo_longctx.integrations.megatron.spec import core_attention_modules, long_context_layer_spec

    base = get_gpt_layer_local_spec()
    spec = long_context_layer_spec(base, "ring", kernel="math")
    res["spec_base_untouched"] = base.submodules.self_attention.submodules.core_attention.__name__
    res["spec_modules"] = [m.__name__ for m in core_attention_modules(spec)]
    res["spec_params"] = spec.submodules.self_attention.submodules.core_attention.params
    model = GPTModel(_config(2, 8, 2, 16, torch.float32), spec, vocab_size=64, max_sequence_length=64,
                     position_embedding_type="rope")
    res["model_layers"] = [type(l.self_attention.core_attention).__name__ for l in model.decoder.layers]
    res["model_cp_group_size"] = [l.self_attention.core_attention.cp_size for l in model.decoder.layers]
    ps.destroy_model_parallel()
    return res


@pytest.fixture(scope="module")
def results():
    return run_distributed(_worker, 2, timeout=300)


def test_zigzag_batch_matches_megatron(results):
    for r in results:
        assert all(r["zigzag_equal"].values()), r["zigzag_equal"]
        assert r["zigzag_shapes"]["tokens"] == (2, 12) and r["zigzag_shapes"]["attention_mask"] == (2, 1, 12, 24)


def test_core_attention_matches_megatron_dot_product_attention(results):
    for r in results:
        for c in r["attention"]:
            assert max(c["cp1"]) < c["tol"], c
            assert max(c["cp2"]) < c["tol"], c


def test_attention_sinks_match_megatron_dot_product_attention(results):
    if results[0]["sinks"] is None:
        pytest.skip("this Megatron-core's TransformerConfig has no softmax_type")
    for r in results:
        sk = r["sinks"]
        for name in ("learnable", "off-by-one"):
            c = sk[name]
            assert max(c["cp1"]) < 1e-10 and max(c["cp2"]) < 1e-10, (name, c)
            assert c["keys"][0] == c["keys"][1], c["keys"]
        assert sk["learnable"]["keys"][0] == ["softmax_offset"] and sk["off-by-one"]["keys"][0] == []
        assert sk["learnable"]["param"] == ((4,), "torch.float64", True)
        assert sk["off-by-one"]["param"] == ((4,), "torch.float64", False)
        assert sk["vanilla_state"] == ([], None)  # vanilla softmax: no sink, no state, as before
        assert sk["control"] > 1e-2  # our attention without the sink misses Megatron's with it


def test_unsupported_combinations_raise_clear_errors(results):
    e = results[0]["errors"]
    assert "attention_dropout" in e["dropout"] and "not implemented" in e["dropout"]
    assert "model.window_size=(64, 0, 1) must be a pair" in e["window"]
    assert "padding" in e["padding"] and "arbitrary" in e["arbitrary"]
    assert "cp_comm_type" in e["a2a"]
    assert "cp.algorithm" in e["algo"] and "ring" in e["algo"]
    assert "context_parallel_size=4" in e["cp_mismatch"]
    assert "packed_seq_params.qkv_format=None" in e["packed"] and "'thd'" in e["packed"]
    assert "attention_mask" in e["mask"]
    assert "attention_bias" in e["bias"]


def test_spec_helper_and_model_use_our_core_attention(results):
    r = results[0]
    assert r["spec_base_untouched"] == "DotProductAttention"
    assert r["spec_modules"] == ["LongContextCoreAttention"]
    assert r["spec_params"] == {"cp_algorithm": "ring", "cp_algorithm_kwargs": {"kernel": "math"}}
    assert r["model_layers"] == ["LongContextCoreAttention"] * 2
    assert r["model_cp_group_size"] == [2, 2]
