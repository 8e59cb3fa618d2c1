"""MLA through the Megatron integration on 2 and 4 gloo ranks (one spawn each, assertions in the parent):

- LongContextCoreAttention built with Megatron MLA's ModuleSpec params (``k_channels``/``v_channels``, its own
  softmax scale) under ring, Ulysses and hybrid CP vs an fp64 full-sequence reference, forward and backward;
  output ``[sq, b, hq*dv]``; K and V travel at their own sizes;
- a tiny DeepSeek-V2-Lite-like GPTModel (MLASelfAttention from Megatron's local spec, no TransformerEngine) with our
  core attention: the CP=P loss (summed over the CP group) and CP-reduced gradients equal cp=1's, for every algorithm.
"""

from __future__ import annotations

import pytest
import torch

from distributed import run_distributed
from reference import reference_forward_backward, rel_err

# the Megatron-core-only version-matrix set (scripts/matrix_smoke.sh on stacks whose NeMo cannot import)
pytestmark = pytest.mark.matrix_mcore

DK, DV = 24, 16  # MLA: q/k head dim = qk_head_dim + qk_pos_emb_head_dim (16 + 8), v_head_dim 16


def _algorithms(world):
    # (name, cp_algorithm, cp_algorithm_kwargs)
    chunks = 2 if world == 2 else 1  # 4 heads: one per rank under Ulysses over 4
    return [("ring", "ring", {}), ("ulysses", "ulysses", {"head_chunks": chunks}),
            ("hybrid", "hybrid", {"ulysses_size": 2, "head_chunks": chunks})]


def _mla_config(cp, dtype):
    from megatron.core.transformer.transformer_config import MLATransformerConfig

    return MLATransformerConfig(
        num_layers=2, hidden_size=64, num_attention_heads=4, context_parallel_size=cp, q_lora_rank=None,
        kv_lora_rank=32, qk_head_dim=16, qk_pos_emb_head_dim=8, v_head_dim=DV, attention_dropout=0.0,
        hidden_dropout=0.0, masked_softmax_fusion=False, add_bias_linear=False, rope_type="rope", rotary_base=10000,
        normalization="RMSNorm", params_dtype=dtype, bf16=False, init_method_std=0.2,
    )


def _core_attention_cases(rank, world, ps):
    import torch.distributed as dist
    from megatron.core.transformer.enums import AttnMaskType
    from megatron.core.transformer.transformer_config import TransformerConfig

    from nemo_longctx.attention import count_bytes_sent, zigzag_shard
    from nemo_longctx.integrations.megatron.core_attention import LongContextCoreAttention

    cfg = TransformerConfig(num_layers=1, hidden_size=64, num_attention_heads=4, context_parallel_size=world,
                            attention_dropout=0.0, hidden_dropout=0.0, params_dtype=torch.float64)
    cpr = ps.get_context_parallel_rank()
    out = []
    for name, algo, kwargs in _algorithms(world):
        for heads, groups, scale, causal, b in ((4, 4, 0.17, True, 1), (8, 2, None, True, 2), (4, 1, None, False, 1)):
            g = torch.Generator().manual_seed(heads * 7 + groups + b)
            s = 2 * world * 3
            q, k, v, dout = (torch.randn(b, s, h, e, generator=g, dtype=torch.float64)
                             for h, e in ((heads, DK), (groups, DK), (groups, DV), (heads, DV)))
            ref = reference_forward_backward(q, k, v, dout, causal, DK ** -0.5 if scale is None else scale)
            mod = LongContextCoreAttention(
                cfg, 1, AttnMaskType.causal if causal else AttnMaskType.no_mask, "self", softmax_scale=scale,
                k_channels=DK, v_channels=DV, cp_algorithm=algo, cp_algorithm_kwargs=dict(kwargs))
            # Megatron's layout: [s, b, h, e], sequence zigzag-sharded over the CP group
            sh = lambda t: zigzag_shard(t, 1, world, cpr).transpose(0, 1).contiguous()  # noqa: E731
            ql, kl, vl = (sh(t).requires_grad_() for t in (q, k, v))
            with count_bytes_sent() as sent:
                o = mod(ql, kl, vl, None)
            o.backward(sh(dout).reshape(s // world, b, heads * DV))
            got = [o.reshape(s // world, b, heads, DV), ql.grad, kl.grad, vl.grad]
            out.append(dict(case=(name, heads, groups, scale, causal, b), shape=tuple(o.shape),
                            want_shape=(s // world, b, heads * DV), scale=mod.softmax_scale,
                            want_scale=DK ** -0.5 if scale is None else scale, bytes=sent.bytes_sent,
                            errs=[rel_err(a, sh(w)) for a, w in zip(got, ref)]))
            dist.barrier()
    return out


def _errors(world):
    from megatron.core.transformer.enums import AttnMaskType
    from megatron.core.transformer.transformer_config import TransformerConfig

    from nemo_longctx.integrations.megatron.core_attention import LongContextCoreAttention

    cfg = TransformerConfig(num_layers=1, hidden_size=64, num_attention_heads=4, context_parallel_size=world,
                            attention_dropout=0.0, hidden_dropout=0.0)
    errors = {}

    def expect(name, fn):
        try:
            fn()
            errors[name] = None
        except ValueError as e:
            errors[name] = str(e)

    expect("unknown", lambda: LongContextCoreAttention(cfg, 1, AttnMaskType.causal, "self", k_channels=DK, foo=1))
    expect("bad_channels", lambda: LongContextCoreAttention(cfg, 1, AttnMaskType.causal, "self", v_channels=0))
    mod = LongContextCoreAttention(cfg, 1, AttnMaskType.causal, "self", k_channels=DK, v_channels=DV)
    x = torch.randn(4, 1, 4, DK)
    expect("dims", lambda: mod(x, x, x, None))  # v at DK, module built for DV
    return errors


def _gpt_parity(rank, world, ps):
    """cp=1 vs cp=world losses/grads of a tiny MLA GPTModel (fp64), per algorithm."""
    import torch.distributed as dist
    from megatron.core import tensor_parallel
    from megatron.core.models.gpt import GPTModel
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec

    from nemo_longctx.integrations.megatron.batch import shard_batch_for_cp
    from nemo_longctx.integrations.megatron.spec import long_context_layer_spec

    base = get_gpt_layer_local_spec(multi_latent_attention=True, normalization="RMSNorm")
    S = 2 * world * 4
    g = torch.Generator().manual_seed(5)
    batch = {"tokens": torch.randint(0, 64, (1, S), generator=g), "labels": torch.randint(0, 64, (1, S), generator=g),
             "position_ids": torch.arange(S)[None]}

    def build(cp, algo, kwargs):
        tensor_parallel.model_parallel_cuda_manual_seed(7)
        torch.manual_seed(7)
        spec = long_context_layer_spec(base, algo, **kwargs)
        return GPTModel(_mla_config(cp, torch.float64), spec, vocab_size=64, max_sequence_length=S,
                        position_embedding_type="none")

    def run(model, b):
        loss = model(b["tokens"], b["position_ids"], None, labels=b["labels"]).sum()
        loss.backward()
        return loss.detach(), {n: p.grad.detach().clone() for n, p in model.named_parameters()}

    ps.destroy_model_parallel()
    ps.initialize_model_parallel(context_parallel_size=1)
    ref_model = build(1, "ring", {})
    state = {k: v.clone() if isinstance(v, torch.Tensor) else v for k, v in ref_model.state_dict().items()}
    ref_loss, ref_grads = run(ref_model, batch)
    ps.destroy_model_parallel()

    ps.initialize_model_parallel(context_parallel_size=world)
    cp_group, cpr = ps.get_context_parallel_group(), ps.get_context_parallel_rank()
    local = shard_batch_for_cp(batch, world, cpr)
    res = {}
    for name, algo, kwargs in _algorithms(world):
        model = build(world, algo, kwargs)
        model.load_state_dict(state)
        attn = [l.self_attention.core_attention for l in model.decoder.layers]
        loss, grads = run(model, local)
        dist.all_reduce(loss, group=cp_group)
        for t in grads.values():
            dist.all_reduce(t, group=cp_group)
        broken = None
        if name == "ring":  # anchor: the same model attending only within each rank's shard must differ
            for a in attn:
                a.cp_size = 1
            model.zero_grad()
            broken = model(local["tokens"], local["position_ids"], None, labels=local["labels"]).sum().detach()
            dist.all_reduce(broken, group=cp_group)
            broken = broken.item()
            for a in attn:
                a.cp_size = world
        res[name] = dict(
            loss=(loss.item(), ref_loss.item()), broken=broken,
            grad_err=max(rel_err(grads[n], ref_grads[n]) for n in ref_grads if ref_grads[n].abs().max() > 0),
            n_grads=len(grads), n_ref=len(ref_grads),
            modules=[(type(a).__name__, type(l.self_attention).__name__, a.cp_size, a.k_channels, a.v_channels)
                     for a, l in zip(attn, model.decoder.layers)])
    return res


def _worker(rank, world):
    from nemo_longctx.integrations.megatron import cpu_compat

    cpu_compat.apply()
    from megatron.core import parallel_state as ps
    from megatron.core import tensor_parallel

    ps.initialize_model_parallel(context_parallel_size=world)
    tensor_parallel.model_parallel_cuda_manual_seed(123)
    res = {"attention": _core_attention_cases(rank, world, ps), "errors": _errors(world)}
    res["gpt"] = _gpt_parity(rank, world, ps)
    ps.destroy_model_parallel()
    return res


@pytest.fixture(scope="module", params=[2, 4])
def results(request):
    return request.param, run_distributed(_worker, request.param, timeout=400)


def test_core_attention_mla_params_vs_fp64(results):
    world, per_rank = results
    for r in per_rank:
        assert len(r["attention"]) == 9
        for c in r["attention"]:
            assert max(c["errs"]) < 1e-10, c
            assert c["shape"] == c["want_shape"], c
            assert c["scale"] == pytest.approx(c["want_scale"], rel=1e-15), c
            name, heads, groups, _, _, b = c["case"]
            s_local = 2 * 3
            if name == "ring":  # K at DK and V at DV columns, P-1 hops, float64
                assert c["bytes"] == (world - 1) * b * s_local * groups * (DK + DV) * 8, c


def test_mla_errors(results):
    _, per_rank = results
    e = per_rank[0]["errors"]
    assert "unknown ModuleSpec params ['foo']" in e["unknown"]
    assert "v_channels=0" in e["bad_channels"]
    assert "do not match k_channels=24, v_channels=16" in e["dims"]


def test_mla_gpt_model_cp_matches_cp1(results):
    world, per_rank = results
    for r in per_rank:
        assert set(r["gpt"]) == {"ring", "ulysses", "hybrid"}
        for name, g in r["gpt"].items():
            loss, ref = g["loss"]
            # fp64 model; Megatron computes RoPE and the cross entropy in float32, so the summed loss and the
            # gradients agree to float32 rounding (a CP error shows as >= 1e-3, see the anchor)
            assert loss == pytest.approx(ref, rel=2e-6, abs=0), (name, g)
            assert g["grad_err"] < 1e-5, (name, g)
            if g["broken"] is not None:
                assert abs(g["broken"] - ref) > 1e-3 * abs(ref), (name, g)  # >= 500x the tolerance
            assert g["n_grads"] == g["n_ref"] > 0
            assert g["modules"] == [("LongContextCoreAttention", "MLASelfAttention", world, DK, DV)] * 2, g
