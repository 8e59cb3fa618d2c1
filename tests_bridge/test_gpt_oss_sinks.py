"""GPT-OSS's attention sinks (``softmax_type="learnable"``) in our Megatron core attention, on the Bridge stack's
Megatron-core 0.19 (whose local ``DotProductAttention`` holds the sink as ``softmax_offset``).

A small GPT (2 layers: a sliding-window layer and a full one, as GPT-OSS alternates them; GQA, biases, RMSNorm) is
built from one seed with Megatron's own local layer spec and with ours (``long_context_layer_spec``):

- the parameters are equal, ``softmax_offset`` included (same name, shape, dtype, initialisation and random-number
  order: with CPU initialisation every weight after the first sink would differ otherwise), and so is the
  ``sharded_state_dict`` entry of the sink (key, TP axis, shape);
- loss and every gradient (the sinks' too) equal Megatron's at cp=none and under ring, Ulysses and hybrid CP=2 on 2
  gloo ranks (each rank's gradients summed over the CP group, as DDP's reduction over DP x CP does): fp32, 1e-5
  relative;
- the same model with the sinks dropped from our attention (a control) misses Megatron's loss by far more;
- "off-by-one" (a fixed zero sink, no parameter) the same way at cp=none and ring CP=2;
- the paths that cannot take sinks refuse them by name (``recompute=full_keep_attn``, ``recompute.sequence_chunks``,
  a CP algorithm registered without sinks).
"""

from __future__ import annotations

import sys

import pytest
import torch

from runner import ROOT

pytest.importorskip("megatron.bridge", reason="the Megatron-Bridge stack (scripts/install_bridge.sh)")
sys.path.insert(0, str(ROOT / "tests"))  # the gloo process helper shared with the NeMo 2 suite
from distributed import run_distributed  # noqa: E402

TOL = 1e-5  # fp32, relative
CONTROL_FACTOR = 100  # the control must miss Megatron's loss by this many tolerances
SEED, VOCAB, SEQ, BATCH = 1234, 128, 64, 2
WINDOW = (11, 0)  # layer 1: causal sliding window shorter than a CP=2 chunk (16 tokens); layer 2: full
CP_RUNS = {"ring": ("ring", {}), "ulysses": ("ulysses", {}),
           "hybrid": ("hybrid", {"ulysses_size": 2, "head_chunks": 2})}


def _config(cp: int, softmax_type: str):
    from megatron.core.transformer.transformer_config import TransformerConfig

    return TransformerConfig(
        num_layers=2, hidden_size=64, num_attention_heads=4, num_query_groups=2, kv_channels=16, ffn_hidden_size=128,
        context_parallel_size=cp, attention_dropout=0.0, hidden_dropout=0.0, normalization="RMSNorm",
        add_bias_linear=True, gated_linear_unit=True, masked_softmax_fusion=False, bias_activation_fusion=False,
        apply_rope_fusion=False, gradient_accumulation_fusion=False, persist_layer_norm=False,
        use_cpu_initialization=True, params_dtype=torch.float32, softmax_type=softmax_type, window_size=WINDOW,
        window_attn_skip_freq=2, init_method_std=0.1)  # (0.02: attention moves the initial loss too little for the
    # control to show; 0.1 gives it a clear share)


def _batch():
    g = torch.Generator().manual_seed(7)
    tokens = torch.randint(0, VOCAB, (BATCH, SEQ + 1), generator=g)
    return {"tokens": tokens[:, :-1].contiguous(), "labels": tokens[:, 1:].contiguous(),
            "loss_mask": torch.ones(BATCH, SEQ), "position_ids": torch.arange(SEQ).repeat(BATCH, 1)}


def _build(spec, cp: int, softmax_type: str, sized_sinks: bool = True):
    """The model of ``spec`` from the seed. ``sized_sinks``: learnable sinks then set to logits of the size of a
    row's log-sum-exp (as trained ones are: the initialisation's N(0, 0.02) adds about 1 to a denominator of tens
    of keys), the same in every model, so the sink takes a sizable share of each row."""
    from megatron.core import tensor_parallel
    from megatron.core.models.gpt import GPTModel

    torch.manual_seed(SEED)
    tensor_parallel.model_parallel_cuda_manual_seed(SEED)
    model = GPTModel(_config(cp, softmax_type), spec, vocab_size=VOCAB, max_sequence_length=SEQ,
                     position_embedding_type="rope", share_embeddings_and_output_weights=False)
    if sized_sinks and softmax_type == "learnable":
        with torch.no_grad():
            for i, layer in enumerate(model.decoder.layers):
                layer.self_attention.core_attention.softmax_offset.copy_(torch.linspace(-1.0, 3.0, 4) + i)
    return model


def _step(model, cp: int):
    """(loss, {name: gradient}) of the mean token loss of ``_batch()``, this rank's shard under CP; the loss and
    every gradient summed over the CP group (every parameter is replicated over it)."""
    import torch.distributed as dist
    from megatron.core import parallel_state as ps

    from nemo_longctx.integrations.megatron.batch import shard_batch_for_cp

    full = _batch()
    b = shard_batch_for_cp(full, cp, ps.get_context_parallel_rank()) if cp > 1 else full
    per_token = model(b["tokens"], b["position_ids"], None, labels=b["labels"])
    loss = (per_token * b["loss_mask"]).sum() / full["loss_mask"].sum()
    model.zero_grad(set_to_none=True)
    loss.backward()
    loss = loss.detach()
    grads = {n: torch.zeros_like(p) if p.grad is None else p.grad.detach().clone()  # None: the control's sinks
             for n, p in model.named_parameters()}
    if cp > 1:
        group = ps.get_context_parallel_group()
        dist.all_reduce(loss, group=group)
        for g in grads.values():
            dist.all_reduce(g, group=group)
    return float(loss), grads


def _rel(a, b):
    return ((a.double() - b.double()).norm() / b.double().norm().clamp_min(1e-30)).item()


def _compare(ref, got):
    (ref_loss, ref_grads), (loss, grads) = ref, got
    assert grads.keys() == ref_grads.keys(), sorted(set(grads) ^ set(ref_grads))
    errs = {n: _rel(grads[n], ref_grads[n]) for n in ref_grads}
    sink = {n: e for n, e in errs.items() if n.endswith("softmax_offset")}
    return {"loss": loss, "ref_loss": ref_loss, "loss_err": abs(loss - ref_loss) / abs(ref_loss),
            "grad_err": max(errs.values()), "worst": max(errs, key=errs.get), "sink_grad_err": sink,
            "sink_grad_norm": [ref_grads[n].norm().item() for n in sink]}


def _refusals(res):
    from megatron.core.transformer.enums import AttnMaskType

    from nemo_longctx.integrations.megatron import cp_algorithms
    from nemo_longctx.integrations.megatron.core_attention import LongContextCoreAttention
    from nemo_longctx.integrations.megatron.memory_options import memory_model_problems
    from nemo_longctx.integrations.megatron.validation import long_context_problems
    from nemo_longctx.options import MemoryOptions

    cfg = _config(1, "learnable")  # (model parallelism is initialised at CP 1 here)
    res["memory_problems"] = {
        name: memory_model_problems(MemoryOptions.from_dict(recompute), cfg)
        for name, recompute in {"keep": {"name": "full_keep_attn"},
                                "chunks": {"name": "full", "sequence_chunks": 2}}.items()}
    plain = cp_algorithms.CPAlgorithm(name="plain_test", attention=cp_algorithms.CP_ALGORITHMS["ring"].attention)
    cp_algorithms.register_cp_algorithm(plain)  # registered without takes_sinks
    try:
        res["plain_problems"] = long_context_problems(cfg, 1, "plain_test")
        try:
            LongContextCoreAttention(cfg, 1, AttnMaskType.causal, "self", cp_algorithm="plain_test")
            res["plain_build"] = None
        except ValueError as e:
            res["plain_build"] = str(e)
    finally:
        del cp_algorithms.CP_ALGORITHMS["plain_test"]
    # at run time too (a model wired by hand): the kept-attention cache on a layer with sinks
    from nemo_longctx.memory.keep_attention import KeptAttentionCache

    mod = LongContextCoreAttention(cfg, 1, AttnMaskType.causal, "self")
    mod.kept_attention_cache = KeptAttentionCache()
    q, kv = torch.randn(16, 1, 4, 16), torch.randn(16, 1, 2, 16)
    try:
        mod(q, kv, kv, None)
        res["keep_forward"] = None
    except ValueError as e:
        res["keep_forward"] = str(e)


def _job(rank: int, world: int):
    from unittest import mock

    from nemo_longctx.integrations.megatron import cpu_compat

    cpu_compat.apply()
    from megatron.core import parallel_state as ps
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_decoder_block_spec

    from nemo_longctx.integrations.megatron.core_attention import LongContextCoreAttention
    from nemo_longctx.integrations.megatron.spec import long_context_layer_spec

    # Megatron's local block spec (its final norm too: a layer spec's would be TransformerEngine's), as the Bridge
    # front end builds on the CPU (integrations/bridge/cpu_compat.cpu_settings)
    res = {}
    ps.initialize_model_parallel(context_parallel_size=1)
    base = get_gpt_decoder_block_spec(_config(1, "learnable"), use_transformer_engine=False, normalization="RMSNorm")
    # as built from the seed: parameters, state dict and checkpoint layout
    mp = _build(base, 1, "learnable", sized_sinks=False)
    attn = mp.decoder.layers[0].self_attention.core_attention
    res["megatron_core_attention"] = type(attn).__name__
    res["windows"] = [layer.self_attention.core_attention.scale_mask_softmax.window_size
                      for layer in mp.decoder.layers]
    ours = _build(long_context_layer_spec(base, "ring"), 1, "learnable", sized_sinks=False)
    res["ours_windows"] = [layer.self_attention.core_attention.window_size for layer in ours.decoder.layers]
    mine, theirs = dict(ours.named_parameters()), dict(mp.named_parameters())
    res["param_names_equal"] = mine.keys() == theirs.keys()
    res["params_unequal"] = [n for n in theirs if not torch.equal(mine[n], theirs[n])]
    res["sinks"] = {n: (tuple(p.shape), str(p.dtype), str(p.device), p.requires_grad, p.abs().max().item())
                    for n, p in mine.items() if n.endswith("softmax_offset")}
    res["buffers_equal"] = [n for n, _ in ours.named_buffers()] == [n for n, _ in mp.named_buffers()]
    prefix = "decoder.layers.0.self_attention.core_attention."
    sd_ours = ours.decoder.layers[0].self_attention.core_attention.sharded_state_dict(prefix, (), None)
    sd_meg = attn.sharded_state_dict(prefix, (),
                                     {"dp_cp_group": ps.get_data_parallel_group(with_context_parallel=True)})
    res["sharded"] = [(k, type(v).__name__, v.key, tuple(v.global_shape), v.axis_fragmentations,
                       str(v.data.dtype), v.replica_id) for sd in (sd_ours, sd_meg) for k, v in sd.items()]
    res["state_dict_keys_equal"] = ours.state_dict().keys() == mp.state_dict().keys()
    # one step: loss and gradients
    megatron = {t: _build(base, 1, t) for t in ("learnable", "off-by-one")}
    ref = {t: _step(m, 1) for t, m in megatron.items()}
    ours = _build(long_context_layer_spec(base, "ring"), 1, "learnable")
    res["none"] = _compare(ref["learnable"], _step(ours, 1))
    with mock.patch.object(LongContextCoreAttention, "_sink_kwargs", lambda self: {}):  # sinks dropped
        res["control_none"] = _compare(ref["learnable"], _step(ours, 1))
    res["obo_none"] = _compare(ref["off-by-one"], _step(_build(long_context_layer_spec(base, "ring"), 1,
                                                               "off-by-one"), 1))
    res["obo_params"] = [n for n, _ in megatron["off-by-one"].named_parameters() if "softmax" in n]
    _refusals(res)
    ps.destroy_model_parallel()

    ps.initialize_model_parallel(context_parallel_size=2)
    for name, (algo, kw) in CP_RUNS.items():
        res[name] = _compare(ref["learnable"], _step(_build(long_context_layer_spec(base, algo, **kw), 2,
                                                            "learnable"), 2))
    model = _build(long_context_layer_spec(base, "ring"), 2, "learnable")
    with mock.patch.object(LongContextCoreAttention, "_sink_kwargs", lambda self: {}):
        res["control_ring"] = _compare(ref["learnable"], _step(model, 2))
    res["obo_ring"] = _compare(ref["off-by-one"], _step(_build(long_context_layer_spec(base, "ring"), 2,
                                                               "off-by-one"), 2))
    ps.destroy_model_parallel()
    return res


@pytest.fixture(scope="module")
def results():
    return run_distributed(_job, 2, timeout=600)


@pytest.mark.smoke
def test_parameters_and_checkpoint_layout_equal_megatrons(results):
    r = results[0]
    assert r["megatron_core_attention"] == "DotProductAttention"
    assert r["windows"] == [WINDOW, None] and r["ours_windows"] == [WINDOW, None]  # GPT-OSS's alternation
    assert r["param_names_equal"] and r["params_unequal"] == [] and r["buffers_equal"]
    assert r["state_dict_keys_equal"]
    assert sorted(r["sinks"]) == [f"decoder.layers.{i}.self_attention.core_attention.softmax_offset"
                                  for i in (0, 1)]
    for shape, dtype, device, grad, biggest in r["sinks"].values():
        assert (shape, dtype, device, grad) == ((4,), "torch.float32", "cpu", True) and biggest > 0  # initialised
    ours, megatron = r["sharded"][:1], r["sharded"][1:]
    assert len(megatron) == 1 and ours == megatron, r["sharded"]
    assert ours[0][2] == "decoder.layers.0.self_attention.core_attention.softmax_offset"
    assert r["obo_params"] == []  # off-by-one: no parameter (a fixed zero sink), in both


@pytest.mark.smoke
@pytest.mark.parametrize("run", ["none", "ring", "ulysses", "hybrid", "obo_none", "obo_ring"])
def test_loss_and_gradients_equal_megatrons(results, run):
    for r in results:
        c = r[run]
        assert c["loss_err"] <= TOL and c["grad_err"] <= TOL, (run, c)
        if not run.startswith("obo"):
            assert len(c["sink_grad_err"]) == 2 and min(c["sink_grad_norm"]) > 0, c


@pytest.mark.smoke
@pytest.mark.parametrize("run", ["control_none", "control_ring"])
def test_control_sinks_dropped_miss_megatrons_loss(results, run):
    c = results[0][run]
    assert c["loss_err"] > CONTROL_FACTOR * TOL, c


@pytest.mark.smoke
def test_paths_without_sinks_refuse_them_by_name(results):
    r = results[0]
    keep, chunks = r["memory_problems"]["keep"], r["memory_problems"]["chunks"]
    assert any("recompute=full_keep_attn does not take attention sinks (model.softmax_type='learnable')" in p
               for p in keep), keep
    assert any("recompute.sequence_chunks=2 does not take attention sinks (model.softmax_type='learnable')" in p
               for p in chunks), chunks
    want = "model.softmax_type='learnable' (attention sinks) is not supported by cp.algorithm='plain_test'"
    assert any(want in p for p in r["plain_problems"]), r["plain_problems"]
    assert want in (r["plain_build"] or ""), r["plain_build"]
    assert "recompute=full_keep_attn does not take attention sinks" in (r["keep_forward"] or ""), r["keep_forward"]
