"""cp=ulysses / cp=hybrid combined with recompute, activation offload and tiling, on real Megatron GPT models.

The 3-layer Llama-like GPT of ``memory_probe`` (4 query / 2 KV heads, fp32) is built for every setting below with
the same initial parameters and trained STEPS SGD steps (lr 0.05, each CP rank applies its own partial gradient,
as ``run_probe_steps`` does) on fixed data, zigzag-sharded over Megatron's CP group. Per step, the loss
(all-reduced over CP) and every parameter gradient of this rank must equal those of the plain ring run
(``recompute=none``, no offload, no tiling) with the same hidden_dropout, within 1e-6 relative; and those of the
same algorithm without recompute / offload / tiling within 1e-7 (bit-exact on CPU; 1e-6 with tiling, which changes
the summation order). With dropout 0.1 the masks are drawn from the same seeds, so a recompute that does not
replay the RNG would fail.

* 2 gloo ranks (one spawn): ulysses head_chunks 1 and 2 x {none, selective[core_attn], selective[mlp],
  full(uniform,1), full + layer_input offload, modules[mlp] offload, modules[core_attn] offload}; hybrid 1x2
  (ring only) and 2x1 (Ulysses only) x {none, full + layer_input, selective[core_attn]}; ulysses + tiled MLP
  (``tiled_mlp_layer_spec``, 3 ragged tiles) + chunked loss (``use_chunked_loss``, 5 ragged chunks), alone and
  under full recompute + layer_input; several of them with hidden_dropout 0.1. Anchors: the summed (over CP)
  step-0 gradients of a ulysses run equal a cp=1 run's; dropout 0.1 changes the loss; a run whose one weight
  element is perturbed by 1e-3 fails the comparison (the check can fail).
* 4 gloo ranks (one spawn): hybrid 2x2 and ulysses (KV heads replicated) x {full + layer_input,
  selective[core_attn], modules[mlp]} vs ring at cp=4.
"""

from __future__ import annotations

import pytest

from distributed import run_distributed

SEQ, VOCAB, STEPS, LAYERS, LR, TOL, SAME_TOL = 256, 128, 3, 3, 0.05, 1e-6, 1e-7
MLP_TILES, LOSS_CHUNKS = 3, 5

MEMORY = {
    "none": {},
    "selective[core_attn]": dict(recompute="selective", recompute_modules=("core_attn",)),
    "selective[mlp]": dict(recompute="selective", recompute_modules=("mlp",)),
    "full(uniform,1)": dict(recompute="full"),
    "full+layer_input": dict(recompute="full", offload="layer_input", min_bytes=0),
    "modules[mlp]": dict(offload="modules", offload_modules=("mlp",), min_bytes=0),
    "modules[core_attn]": dict(offload="modules", offload_modules=("core_attn",), min_bytes=0),
}


def _settings_2():
    """(name, algorithm, cp kwargs, memory options, hidden_dropout, tiled)."""
    out = []
    for hc in (1, 2):
        for mem in MEMORY:
            out.append((f"ulysses hc{hc} {mem}", "ulysses", {"head_chunks": hc}, mem, 0.0, False))
    for mem in ("selective[core_attn]", "full(uniform,1)", "full+layer_input", "modules[core_attn]"):
        out.append((f"ulysses hc2 {mem} dropout", "ulysses", {"head_chunks": 2}, mem, 0.1, False))
    for label, u in (("1x2", 1), ("2x1", 2)):
        for mem in ("none", "full+layer_input", "selective[core_attn]"):
            out.append((f"hybrid {label} {mem}", "hybrid", {"ulysses_size": u}, mem, 0.0, False))
        out.append((f"hybrid {label} full+layer_input dropout", "hybrid", {"ulysses_size": u}, "full+layer_input",
                    0.1, False))
    out.append(("ulysses tiled", "ulysses", {"head_chunks": 1}, "none", 0.0, True))
    out.append(("ulysses hc2 tiled full+layer_input dropout", "ulysses", {"head_chunks": 2}, "full+layer_input",
                0.1, True))
    return out


def _settings_4():
    out = []
    for mem in ("full+layer_input", "selective[core_attn]", "modules[mlp]"):
        out.append((f"hybrid 2x2 {mem}", "hybrid", {"ulysses_size": 2}, mem, 0.0, False))
        out.append((f"ulysses {mem}", "ulysses", {"head_chunks": 1}, mem, 0.0, False))
    out.append(("hybrid 2x2 hc2 full+layer_input dropout", "hybrid", {"ulysses_size": 2, "head_chunks": 2},
                "full+layer_input", 0.1, False))
    return out


def _rel(a, b):
    return ((a.double() - b.double()).norm() / b.double().norm().clamp_min(1e-30)).item()


def _build(cfg, algorithm, kwargs, mem, init, tiled):
    """A probe model (``memory_probe.build_probe_model``), or with ``tiled`` the same model built from the tiled
    MLP spec and switched to the chunked loss (the tiling integration's pieces)."""
    import copy

    import torch

    from nemo_longctx.integrations.megatron.memory_options import (
        MemoryOptions, apply_recompute_fields, attach_memory_options, validate_memory_options)
    from nemo_longctx.integrations.megatron.memory_probe import build_probe_model

    opts = MemoryOptions(**MEMORY[mem])
    validate_memory_options(opts, algorithm, cfg)
    if not tiled:
        return build_probe_model(cfg, opts, vocab_size=VOCAB, seq_length=SEQ, cp_algorithm=algorithm,
                                 cp_kwargs=kwargs, params_from=init)
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec

    from nemo_longctx.integrations.megatron.gpt_chunked_loss import ChunkedLossGPTModel, use_chunked_loss
    from nemo_longctx.integrations.megatron.spec import long_context_layer_spec
    from nemo_longctx.integrations.megatron.tiled_mlp_layer import tiled_mlp_layer_spec

    config = apply_recompute_fields(copy.copy(cfg), opts)
    spec = long_context_layer_spec(get_gpt_layer_local_spec(normalization="RMSNorm"), algorithm, **kwargs)
    spec = tiled_mlp_layer_spec(spec, MLP_TILES)
    model = ChunkedLossGPTModel(config, spec, vocab_size=VOCAB, max_sequence_length=SEQ,
                                position_embedding_type="rope", share_embeddings_and_output_weights=False)
    load = model.load_state_dict(init.state_dict(), strict=True)
    assert not load.missing_keys and not load.unexpected_keys
    with torch.no_grad():
        for (n, p), (n0, p0) in zip(model.named_parameters(), init.named_parameters()):
            assert n == n0 and torch.equal(p, p0), n
    assert use_chunked_loss(model, LOSS_CHUNKS) == 1
    return model, attach_memory_options(model, opts)


def _structure(model):
    """What the built model really runs: core-attention algorithms, MLP classes, block / model classes."""
    from nemo_longctx.integrations.megatron.core_attention import LongContextCoreAttention

    layers = [m for m in model.modules() if type(m).__name__ in ("TransformerLayer", "LongContextTransformerLayer")]
    return {
        "algorithms": sorted({m.algorithm.name for m in model.modules() if isinstance(m, LongContextCoreAttention)}),
        "mlp": sorted({type(layer.mlp).__name__ for layer in layers}),
        "block": type(model.decoder).__name__,
        "model": type(model).__name__,
        "recompute": model.config.recompute_granularity,
    }


def _compare(r, ref):
    loss_err = max(abs(a - b) / abs(b) for a, b in zip(r.losses, ref.losses))
    grad_err, worst = max((_rel(g[n], g0[n]), (i, n)) for i, (g, g0) in enumerate(zip(r.grads, ref.grads))
                          for n in g0)
    same_keys = all(g.keys() == g0.keys() for g, g0 in zip(r.grads, ref.grads))
    return {"loss_err": loss_err, "grad_err": grad_err, "worst": worst, "same_keys": same_keys,
            "n_grads": len(r.grads[0]), "losses": r.losses}


def _worker(rank: int, world: int, settings, anchors: bool):
    import torch
    import torch.distributed as dist

    from nemo_longctx.integrations.megatron import cpu_compat

    cpu_compat.apply()
    from megatron.core import parallel_state as ps
    from megatron.core import tensor_parallel

    from nemo_longctx.integrations.megatron.memory_options import MemoryOptions
    from nemo_longctx.integrations.megatron.memory_probe import (
        build_probe_model, full_batches, run_probe_steps, tiny_gpt_config)

    out = {"cases": {}, "anchors": {}}
    batches = full_batches(STEPS, SEQ, VOCAB, seed=3)
    ps.initialize_model_parallel(context_parallel_size=world)
    tensor_parallel.model_parallel_cuda_manual_seed(5)
    cfgs = {d: tiny_gpt_config(num_layers=LAYERS, cp=world, hidden_dropout=d) for d in (0.0, 0.1)}
    init, _ = build_probe_model(cfgs[0.0], MemoryOptions(), vocab_size=VOCAB, seq_length=SEQ)
    refs = {}
    for d, cfg in cfgs.items():
        model, rt = build_probe_model(cfg, MemoryOptions(), vocab_size=VOCAB, seq_length=SEQ, params_from=init)
        refs[d] = run_probe_steps(model, rt, batches, lr=LR, track=False)
        out["anchors"][f"ring structure {d}"] = _structure(model)
    bases = {}  # (algorithm, options, dropout) -> its run without recompute / offload / tiling

    def base(algorithm, kwargs, dropout):
        key = (algorithm, tuple(sorted(kwargs.items())), dropout)
        if key not in bases:
            model, rt = _build(cfgs[dropout], algorithm, kwargs, "none", init, False)
            bases[key] = run_probe_steps(model, rt, batches, lr=LR, track=False)
        return bases[key]

    first_ulysses = None
    for name, algorithm, kwargs, mem, dropout, tiled in settings:
        model, rt = _build(cfgs[dropout], algorithm, kwargs, mem, init, tiled)
        structure = _structure(model)
        r = run_probe_steps(model, rt, batches, lr=LR, track=False)
        same_algorithm = _compare(r, base(algorithm, kwargs, dropout))
        out["cases"][name] = {**_compare(r, refs[dropout]), **structure, "setting": (algorithm, kwargs, mem, dropout),
                              "vs_base": (same_algorithm["loss_err"], same_algorithm["grad_err"])}
        if first_ulysses is None and algorithm == "ulysses" and dropout == 0.0:
            first_ulysses = (name, r.grads[0])

    if anchors:
        # the check can fail: one weight element perturbed by 1e-3 (a ulysses run), and dropout changes the loss
        bad_init, _ = build_probe_model(cfgs[0.0], MemoryOptions(), vocab_size=VOCAB, seq_length=SEQ,
                                        params_from=init)
        with torch.no_grad():
            dict(bad_init.named_parameters())["decoder.layers.0.self_attention.linear_qkv.weight"][0, 0] += 1e-3
        model, rt = _build(cfgs[0.0], "ulysses", {"head_chunks": 1}, "full+layer_input", bad_init, False)
        out["anchors"]["perturbed"] = _compare(run_probe_steps(model, rt, batches, lr=LR, track=False), refs[0.0])
        out["anchors"]["dropout"] = (refs[0.0].losses, refs[0.1].losses)
        # summed over the CP group, the step-0 gradients of a ulysses run equal a cp=1 run's
        name, grads = first_ulysses
        summed = {}
        for n, g in grads.items():
            g = g.clone()
            dist.all_reduce(g, group=ps.get_context_parallel_group())
            summed[n] = g
        ps.destroy_model_parallel()
        ps.initialize_model_parallel(context_parallel_size=1)
        cfg1 = tiny_gpt_config(num_layers=LAYERS, cp=1)
        model, rt = build_probe_model(cfg1, MemoryOptions(), vocab_size=VOCAB, seq_length=SEQ, params_from=init)
        r1 = run_probe_steps(model, rt, batches[:1], track=False)
        out["anchors"]["cp1"] = {
            "name": name, "loss": (r1.losses[0], refs[0.0].losses[0]),
            "grad_err": max(_rel(summed[n], g) for n, g in r1.grads[0].items()),
            "same_keys": summed.keys() == r1.grads[0].keys(),
        }
    ps.destroy_model_parallel()
    return out


@pytest.fixture(scope="module")
def results_2():
    return run_distributed(_worker, 2, _settings_2(), True, timeout=300)


@pytest.fixture(scope="module")
def results_4():
    return run_distributed(_worker, 4, _settings_4(), False, timeout=300)


def _check_cases(results, settings):
    worst = {"loss": 0.0, "grad": 0.0}
    for rank, res in enumerate(results):
        assert sorted(res["cases"]) == sorted(s[0] for s in settings)
        for name, algorithm, kwargs, mem, dropout, tiled in settings:
            c = res["cases"][name]
            where = f"rank {rank} {name}"
            assert c["algorithms"] == [algorithm], (where, c["algorithms"])
            assert c["mlp"] == (["TiledMegatronMLP"] if tiled else ["MLP"]), (where, c["mlp"])
            assert c["model"] == ("ChunkedLossGPTModel" if tiled else "GPTModel"), where
            full = MEMORY[mem].get("recompute") == "full"
            assert (c["block"] == "LongContextTransformerBlock") == full, (where, c["block"])
            assert c["recompute"] == {"full": "full", "selective": "selective"}.get(MEMORY[mem].get("recompute")), where
            assert c["same_keys"] and c["n_grads"] >= 3 * LAYERS + 3, where
            assert 3.0 < c["losses"][0] < 6.0, (where, c["losses"])  # ~log(128): a real loss
            assert c["loss_err"] <= TOL, (where, c["loss_err"])
            assert c["grad_err"] <= TOL, (where, c["grad_err"], c["worst"])
            # vs the same algorithm without recompute / offload / tiling: recompute and offload replay the same
            # ops on the same data (bit-exact on CPU); tiling changes the summation order
            assert max(c["vs_base"]) <= (TOL if tiled else SAME_TOL), (where, c["vs_base"])
            worst["loss"] = max(worst["loss"], c["loss_err"])
            worst["grad"] = max(worst["grad"], c["grad_err"])
    at = max((r["cases"][n]["grad_err"], r["cases"][n]["worst"]) for r in results for n in r["cases"])
    print(f"worst relative errors over {len(settings)} settings x {len(results)} ranks: {worst}, worst gradient "
          f"(error, (step, parameter)): {at}")
    for name in sorted(results[0]["cases"]):
        print(f"  {name:48s} loss {max(r['cases'][name]['loss_err'] for r in results):.1e}"
              f" grad {max(r['cases'][name]['grad_err'] for r in results):.1e}"
              f" vs same algorithm {max(r['cases'][name]['vs_base'] for r in results)}")


@pytest.mark.matrix_mcore  # the Megatron-core-only version-matrix set (scripts/matrix_smoke.sh)
def test_ulysses_and_hybrid_with_recompute_offload_tiling_match_ring_2_ranks(results_2):
    _check_cases(results_2, _settings_2())


def test_hybrid_2x2_and_ulysses_with_recompute_offload_match_ring_4_ranks(results_4):
    _check_cases(results_4, _settings_4())


@pytest.mark.matrix_mcore  # the Megatron-core-only version-matrix set (scripts/matrix_smoke.sh)
def test_the_comparison_can_fail_and_anchors_hold(results_2):
    for res in results_2:
        a = res["anchors"]
        assert a["ring structure 0.0"]["algorithms"] == ["ring"]
        # a 1e-3 change of one weight element (std 0.02) is well above the tolerance
        assert a["perturbed"]["grad_err"] > 10 * TOL, a["perturbed"]
        # dropout 0.1 really draws masks (the recompute has something to replay)
        no_drop, drop = a["dropout"]
        assert all(abs(x - y) > 1e-4 * abs(y) for x, y in zip(drop, no_drop)), a["dropout"]
        # ulysses at cp=2 == cp=1: step-0 loss and CP-summed gradients
        cp1 = a["cp1"]
        assert cp1["same_keys"], cp1
        assert abs(cp1["loss"][0] - cp1["loss"][1]) <= TOL * abs(cp1["loss"][0]), cp1
        assert cp1["grad_err"] <= TOL, cp1
