"""``recompute.sequence_chunks`` on real Megatron GPT models: losses and every parameter gradient equal full recompute.

One process (CP size 1; Megatron's model-parallel state over gloo), two with ring CP=2, and float64 runs under Ulysses
CP=2 and hybrid 2x2: a 3-layer Llama-like GPTModel (local spec, our
core attention, GQA) built for each setting with the parameters of one initial model, 3 SGD steps on fixed data, in
float64 and float32. Compared with ``recompute=full`` (Megatron's own checkpoint of each layer): per-step loss and
every gradient, fp64 <= 1e-10, fp32 <= 1e-6 relative. Settings: 2, 3 (uneven) and 4 chunks, with layer-input offload,
with the block method, two layers per checkpoint, a sliding window (Mistral's ``window_size``), and the tracker's
activation peak (chunked below full). Model-level refusals name the field.
"""

from __future__ import annotations

import pytest

from distributed import run_distributed

SEQ, VOCAB, STEPS = 192, 96, 3

SETTINGS = {  # name: (MemoryOptions kwargs, reference name)
    "full": (dict(recompute="full"), None),
    "chunks2": (dict(recompute="full", sequence_chunks=2), "full"),
    "chunks3": (dict(recompute="full", sequence_chunks=3), "full"),
    "chunks4": (dict(recompute="full", sequence_chunks=4), "full"),
    "chunks3+layer_input": (dict(recompute="full", sequence_chunks=3, offload="layer_input", min_bytes=0), "full"),
    "block2": (dict(recompute="full", recompute_method="block", recompute_num_layers=2), None),
    "block2+chunks4": (dict(recompute="full", recompute_method="block", recompute_num_layers=2, sequence_chunks=4),
                       "block2"),
    # two layers per checkpoint (uniform): only every other layer input saved (offloaded); the checkpoint's recompute
    # keeps the inner layer's input, each layer differentiated chunk by chunk
    "uniform2+chunks3+layer_input": (dict(recompute="full", recompute_num_layers=2, sequence_chunks=3,
                                          offload="layer_input", min_bytes=0), "full"),
}


def _rel(a, b):  # relative in the 2-norm, as test_memory_integration compares recompute modes
    return ((a.double() - b.double()).norm() / b.double().norm().clamp_min(1e-30)).item()


CP_SETTINGS = ("full", "chunks2", "chunks3", "chunks3+layer_input", "block2", "block2+chunks4",
               "uniform2+chunks3+layer_input")


def _worker(rank: int, world: int, dtypes=("float64", "float32"), algorithm="ring", cp_kwargs=None, settings=None):
    import torch

    from nemo_longctx.integrations.megatron import cpu_compat

    cpu_compat.apply()
    from megatron.core import parallel_state as ps
    from megatron.core import tensor_parallel

    from nemo_longctx.integrations.megatron.memory_options import MemoryOptions, validate_memory_options
    from nemo_longctx.integrations.megatron.memory_probe import (
        build_probe_model, full_batches, run_probe_steps, tiny_gpt_config)

    ps.initialize_model_parallel(context_parallel_size=world)  # world > 1: CP over every rank
    tensor_parallel.model_parallel_cuda_manual_seed(11)
    out = {"parity": {}, "peaks": {}, "errors": {}}
    batches = full_batches(STEPS, SEQ, VOCAB, seed=3)
    for dtype in (getattr(torch, d) for d in dtypes):
        for window in (None, (40, 0)):
            cfg = tiny_gpt_config(num_layers=3, dtype=dtype, cp=world)
            cfg.window_size = window
            init, _ = build_probe_model(cfg, MemoryOptions(), vocab_size=VOCAB, seq_length=SEQ)
            results = {}
            for name, (kw, ref) in SETTINGS.items():
                if (window is not None and name not in ("full", "chunks3")) or (world > 1 and name not in CP_SETTINGS):
                    continue
                if settings is not None and name not in settings:
                    continue
                model, rt = build_probe_model(cfg, MemoryOptions(**kw), vocab_size=VOCAB, seq_length=SEQ,
                                              params_from=init, cp_algorithm=algorithm, cp_kwargs=cp_kwargs)
                results[name] = r = run_probe_steps(model, rt, batches, lr=0.05, count_peak=True)
                if ref is not None:
                    r0 = results[ref]
                    loss = max(abs(a - b) / abs(b) for a, b in zip(r.losses, r0.losses))
                    # worst relative error per gradient dtype (Megatron's torch norms keep float32 weights even
                    # in a float64 model: their gradients are float32 sums)
                    grad = {}
                    for g, g0 in zip(r.grads, r0.grads):
                        for n in g0:
                            d = str(g0[n].dtype)
                            grad[d] = max(grad.get(d, (0.0, "")), (_rel(g[n], g0[n]), n))
                    keys = all(g.keys() == g0.keys() for g, g0 in zip(r.grads, r0.grads))
                    out["parity"][(str(dtype), window, name)] = (loss, grad, keys, len(r.grads[0]))
                if dtype == torch.float32 and window is None:
                    out["peaks"][name] = r.stats[-1].peak_bytes

    errors = out["errors"]
    chunks = MemoryOptions(recompute="full", sequence_chunks=4)

    def expect(key, cfg):
        try:
            validate_memory_options(chunks, "ring", cfg)
            errors[key] = None
        except ValueError as e:
            errors[key] = str(e)

    expect("dropout", tiny_gpt_config(num_layers=3, hidden_dropout=0.1))
    moe = tiny_gpt_config(num_layers=3)
    moe.num_moe_experts = 4
    expect("moe", moe)
    mla = tiny_gpt_config(num_layers=3)
    mla.multi_latent_attention, mla.apply_rope_fusion = True, True
    expect("mla", mla)
    ps.destroy_model_parallel()
    return out


@pytest.fixture(scope="module")
def results():
    return run_distributed(_worker, 1, timeout=400)[0]


def check_parity(parity, n_dtypes=2, n_settings=6):
    assert len(parity) == n_dtypes * (n_settings + 1)
    tol = {"torch.float64": 1e-10, "torch.float32": 1e-6}
    for (dtype, window, name), (loss, grads, keys, n) in parity.items():
        assert keys and n > 20, (dtype, window, name)
        assert loss <= tol[dtype], (dtype, window, name, loss)
        assert dtype in grads, grads  # the model's own dtype is among the gradients compared
        for gdtype, (err, worst) in grads.items():
            assert err <= tol[gdtype], (dtype, window, name, gdtype, err, worst)


def test_chunked_layers_match_full_recompute(results):
    check_parity(results["parity"])


def test_chunked_layers_under_ring_cp_match_full_recompute():
    """The same on 2 gloo ranks with ring CP=2 (each rank's zigzag shard chunked, K/V passed around the ring per
    chunk; uneven chunks straddle the shard's two halves), against full recompute under the same ring CP: per-step
    losses and each rank's gradients, fp64 <= 1e-10, fp32 <= 1e-6."""
    for res in run_distributed(_worker, 2, timeout=600):
        check_parity(res["parity"], n_settings=len(CP_SETTINGS) - 2)


@pytest.mark.parametrize("algorithm,world,cp_kwargs", [
    ("ulysses", 2, None),
    # 4 Megatron processes on CI's 2 cores: ~4 min; the toy layer covers hybrid 2x2 in CI (test_sequence_chunks_cp)
    pytest.param("hybrid", 4, {"ulysses_size": 2}, marks=pytest.mark.slow)], ids=["ulysses2", "hybrid2x2"])
def test_chunked_layers_under_ulysses_and_hybrid_cp_match_full_recompute(algorithm, world, cp_kwargs):
    """The same under Ulysses CP=2 and hybrid 2x2 (Ulysses pairs, a ring of 2 across them; each chunk's heads
    travel by all-to-all), float64, against full recompute under the same CP: chunks 3 (uneven, straddling the
    zigzag halves), with layer-input offload and two layers per checkpoint; the sliding window with chunks 3."""
    settings = ("full", "chunks3", "chunks3+layer_input", "uniform2+chunks3+layer_input")
    for res in run_distributed(_worker, world, ("float64",), algorithm, cp_kwargs, settings, timeout=600):
        check_parity(res["parity"], n_dtypes=1, n_settings=len(settings) - 1)


def test_chunked_layers_lower_the_activation_peak(results):
    peaks = results["peaks"]
    assert peaks["chunks4"] < peaks["full"], peaks
    assert peaks["chunks4"] < peaks["chunks2"], peaks


def test_model_level_refusals_name_the_field(results):
    e = results["errors"]
    assert "model.hidden_dropout=0" in e["dropout"]
    assert "model.num_moe_experts=4" in e["moe"]
    assert "multi-latent attention needs model.apply_rope_fusion=false" in e["mla"]


# ------------------------------------------------------------------------------------------------ MLA
def _mla_config(cp, rope_type):
    from megatron.core.transformer.transformer_config import MLATransformerConfig

    return MLATransformerConfig(
        num_layers=2, hidden_size=64, num_attention_heads=4, context_parallel_size=cp, q_lora_rank=None,
        kv_lora_rank=32, qk_head_dim=16, qk_pos_emb_head_dim=8, v_head_dim=16, attention_dropout=0.0,
        hidden_dropout=0.0, masked_softmax_fusion=False, add_bias_linear=False, rope_type=rope_type,
        rotary_base=10000, normalization="RMSNorm", params_dtype=torch_dtype("float64"), bf16=False,
        init_method_std=0.2, apply_rope_fusion=False,
    )


def torch_dtype(name):
    import torch

    return getattr(torch, name)


def _packed_params(world):
    """Four packed documents (real lengths 50, 7, 70, 31; each padded to a multiple of 2*CP): Megatron's
    PackedSeqParams (THD) and the positions of this layout's tokens."""
    import torch
    from megatron.core.packed_seq_params import PackedSeqParams

    real = [50, 7, 70, 31]
    padded = [-(-n // (2 * world)) * 2 * world for n in real]
    cu = torch.tensor([0] + real, dtype=torch.int32).cumsum(0, dtype=torch.int32)
    cu_padded = torch.tensor([0] + padded, dtype=torch.int32).cumsum(0, dtype=torch.int32)
    params = PackedSeqParams(qkv_format="thd", cu_seqlens_q=cu, cu_seqlens_kv=cu, cu_seqlens_q_padded=cu_padded,
                             cu_seqlens_kv_padded=cu_padded, max_seqlen_q=max(padded), max_seqlen_kv=max(padded))
    return params, int(cu_padded[-1])


def _mla_worker(rank, world, algorithm):
    """A 2-layer MLA GPTModel (Megatron's MLASelfAttention, local spec, our core attention), float64: 3 chunks (+ the
    layer-input offload) against full recompute, RoPE and YaRN, on one sequence and on packed documents (THD)."""
    import torch

    from nemo_longctx.integrations.megatron import cpu_compat

    cpu_compat.apply()
    from megatron.core import parallel_state as ps
    from megatron.core import tensor_parallel

    from nemo_longctx.attention.layouts import thd_zigzag_indices, zigzag_indices
    from nemo_longctx.integrations.megatron.memory_options import MemoryOptions
    from nemo_longctx.integrations.megatron.memory_probe import build_probe_model

    ps.initialize_model_parallel(context_parallel_size=world)
    tensor_parallel.model_parallel_cuda_manual_seed(11)
    g = torch.Generator().manual_seed(4)
    out = {}
    for rope_type in ("rope", "yarn"):
        cfg = _mla_config(world, rope_type)
        init, _ = build_probe_model(cfg, MemoryOptions(), vocab_size=VOCAB, seq_length=SEQ)
        for packed in (False, True):
            params, total = _packed_params(world) if packed else (None, SEQ)
            tokens = torch.randint(0, VOCAB, (1, total + 1), generator=g)
            idx = thd_zigzag_indices(params.cu_seqlens_q_padded, world, rank) if packed else \
                zigzag_indices(total, world, rank)
            results = {}
            for name, kw in (("full", dict(recompute="full")), ("chunks3", dict(recompute="full", sequence_chunks=3)),
                             ("chunks3+layer_input", dict(recompute="full", sequence_chunks=3, offload="layer_input",
                                                          min_bytes=0))):
                model, rt = build_probe_model(cfg, MemoryOptions(**kw), vocab_size=VOCAB, seq_length=total,
                                              params_from=init, cp_algorithm=algorithm)
                loss = model(tokens[:, :-1][:, idx], torch.arange(total)[None, idx] if not packed else None, None,
                             labels=tokens[:, 1:][:, idx], packed_seq_params=params).sum()
                loss.backward()
                rt.after_step()
                results[name] = (loss.item(), {n: p.grad.clone() for n, p in model.named_parameters()})
            ref_loss, ref_grads = results.pop("full")
            for name, (loss, grads) in results.items():
                worst = {}  # per gradient dtype (Megatron's norms keep float32 weights in a float64 model)
                for n in ref_grads:
                    d = str(ref_grads[n].dtype)
                    worst[d] = max(worst.get(d, 0.0), _rel(grads[n], ref_grads[n]))
                out[(rope_type, packed, name)] = (abs(loss - ref_loss) / abs(ref_loss), worst, len(grads))
    ps.destroy_model_parallel()
    return out


@pytest.mark.parametrize("algorithm,world", [("ring", 1), ("ring", 2), ("ulysses", 2)],
                         ids=["cp1", "ring2", "ulysses2"])
def test_chunked_mla_layers_match_full_recompute(algorithm, world):
    """Megatron's MLA makes its RoPE table inside the layer from the length it is given; the chunked layer's rotary
    hook hands each chunk its rows of the whole sequence's table (RoPE and YaRN; on packed documents, Megatron's THD
    positions). Loss and every gradient equal full recompute's (float64 <= 1e-10; the float32 norm weights' gradients
    <= 1e-6): 2 x 2 x 2 cases per rank."""
    tol = {"torch.float64": 1e-10, "torch.float32": 1e-6}
    for res in run_distributed(_mla_worker, world, algorithm, timeout=600):
        assert len(res) == 8, res
        for key, (loss, grads, n) in res.items():
            assert n > 10 and loss <= 1e-10 and "torch.float64" in grads, (key, loss, grads)
            assert all(err <= tol[d] for d, err in grads.items()), (key, grads)


# ------------------------------------------------------------------------------------------------ the app
def _app_losses(tmp_path, name, extra):
    import json
    import sys
    from pathlib import Path

    from app_runner import run_app

    out_dir = tmp_path / name
    code, out = run_app([str(Path(sys.executable).parent / "nemo-longctx"), "train", f"output_dir={out_dir}",
                         "cp.size=2", "recompute=full", "offload=layer_input", "tiling.loss_chunks=2",
                         "memory.track_peak=true",
                         "trainer.max_steps=3", "model.seq_length=2048", "run.timeout_s=240", *extra], 300)
    assert code == 0, out[-4000:]
    rows = [json.loads(line) for line in (out_dir / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in rows] == [1, 2, 3]
    return [r["loss"] for r in rows], max(r["peak_bytes"] for r in rows)


def test_app_losses_with_sequence_chunks_equal_full_recompute(tmp_path):
    """`nemo-longctx train cp=ulysses recompute.sequence_chunks=4` takes the same three steps as `cp=ring
    recompute=full` (both with layer-input offload and the chunked loss; CP over 2 ranks): per-step losses within
    1e-6, and the tracked activation peak is lower (the chunked layers really ran)."""
    ref, ref_peak = _app_losses(tmp_path, "full", ["cp=ring"])
    got, peak = _app_losses(tmp_path, "chunks", ["cp=ulysses", "recompute.sequence_chunks=4"])
    for a, b in zip(got, ref):
        assert abs(a - b) <= 1e-6 * abs(b), (got, ref)
    assert peak < ref_peak, (peak, ref_peak)


def test_app_refuses_sequence_chunks_with_head_chunks_before_spawning():
    import sys
    from pathlib import Path

    from app_runner import run_app

    code, out = run_app([str(Path(sys.executable).parent / "nemo-longctx"), "train", "cp=ulysses", "cp.size=2",
                         "cp.head_chunks=2", "recompute=full", "recompute.sequence_chunks=4"], 120)
    assert code == 2 and "recompute.sequence_chunks=4 with cp.head_chunks=2" in out, out[-3000:]
    assert "spawning" not in out
