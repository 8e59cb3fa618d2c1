"""Recompute x offload options on real Megatron GPT models and in the train app.

* One spawn of 2 gloo ranks: a 3-layer Llama-like Megatron GPTModel (local spec + our core attention) is built for
  every recompute x offload setting (parameters copied from one initial model) and trained 3 SGD steps on fixed
  data, with CP=2 (ring over Megatron's CP group) and CP=1, hidden_dropout 0 and 0.1 (same seeds per step: the
  recompute must replay the dropout masks). Loss and every parameter gradient of every step are compared with the
  `none` run (fp32, <= 1e-6 relative). The activation tracker runs around every step (layernorm recompute included:
  nemo_longctx's norm recompute works under saved-tensor hooks, also with offload); its numbers are checked for the
  offload and layernorm settings.
* Config-level errors (Hydra compose, no model) name the field; model-level errors are checked in the spawn.
* One short app run (`nemo-longctx train recompute=full_keep_attn offload=layer_input memory.track_peak=true`)
  writes the memory keys to metrics.jsonl and prints the memory summary.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest

from app_runner import run_app
from distributed import run_distributed

ROOT = Path(__file__).resolve().parents[1]
BIN = Path(sys.executable).parent
SEQ, VOCAB, STEPS, LAYERS = 256, 128, 3, 3

COMBOS = {
    "none": {},
    "modules[mlp,core_attn]": dict(offload="modules", offload_modules=("mlp", "core_attn"), min_bytes=0),
    "selective[core_attn]": dict(recompute="selective", recompute_modules=("core_attn",)),
    "selective[mlp]": dict(recompute="selective", recompute_modules=("mlp",)),
    "selective[core_attn,mlp,layernorm]": dict(recompute="selective",
                                               recompute_modules=("core_attn", "mlp", "layernorm")),
    "selective[layernorm]": dict(recompute="selective", recompute_modules=("layernorm",)),
    # our norm recompute under an offload scope: linear_qkv's saved norm output is offloaded, then released
    "selective[layernorm,mlp]+modules[self_attention]": dict(recompute="selective",
                                                             recompute_modules=("layernorm", "mlp"),
                                                             offload="modules", offload_modules=("self_attention",),
                                                             min_bytes=0),
    "selective[core_attn]+modules[mlp]": dict(recompute="selective", recompute_modules=("core_attn",),
                                              offload="modules", offload_modules=("mlp",), min_bytes=0),
    "full": dict(recompute="full"),
    "full(uniform,2)": dict(recompute="full", recompute_num_layers=2),  # chunks [0,2) and the clamped [2,3)
    "full(block,2)": dict(recompute="full", recompute_method="block", recompute_num_layers=2),
    "full+layer_input": dict(recompute="full", offload="layer_input", min_bytes=0),
    "full(block,1)+layer_input(depth 2)": dict(recompute="full", recompute_method="block", recompute_num_layers=1,
                                               offload="layer_input", min_bytes=0, prefetch_depth=2),
    "full_keep_attn": dict(recompute="full_keep_attn"),
    "full_keep_attn+layer_input": dict(recompute="full_keep_attn", offload="layer_input", min_bytes=0),
    "full_keep_attn(block,2)+layer_input": dict(recompute="full_keep_attn", recompute_method="block",
                                                recompute_num_layers=2, offload="layer_input", min_bytes=0),
}


def _rel(a, b):
    return ((a.double() - b.double()).norm() / b.double().norm().clamp_min(1e-30)).item()


def _parity_worker(rank: int, world: int):

    from nemo_longctx.integrations.megatron import cpu_compat

    cpu_compat.apply()
    from megatron.core import parallel_state as ps
    from megatron.core import tensor_parallel

    from nemo_longctx.integrations.megatron.memory_options import MemoryOptions, validate_memory_options
    from nemo_longctx.integrations.megatron.memory_probe import (
        build_probe_model, full_batches, layer_device_bytes, layer_host_bytes, run_probe_steps, tiny_gpt_config)

    out = {"parity": {}, "stats": {}, "errors": {}}
    batches = full_batches(STEPS, SEQ, VOCAB, seed=7)
    for cp in (2, 1):
        ps.initialize_model_parallel(context_parallel_size=cp)
        tensor_parallel.model_parallel_cuda_manual_seed(11)
        for dropout in (0.0, 0.1):
            cfg = tiny_gpt_config(num_layers=LAYERS, cp=cp, hidden_dropout=dropout)
            init, _ = build_probe_model(cfg, MemoryOptions(), vocab_size=VOCAB, seq_length=SEQ)
            ref = None
            for name, kw in COMBOS.items():
                opts = MemoryOptions(**kw)
                model, rt = build_probe_model(cfg, opts, vocab_size=VOCAB, seq_length=SEQ, params_from=init)
                r = run_probe_steps(model, rt, batches, lr=0.05)
                if ref is None:
                    ref = r
                loss_err = max(abs(a - b) / abs(b) for a, b in zip(r.losses, ref.losses))
                grad_err = max(_rel(g[n], g0[n]) for g, g0 in zip(r.grads, ref.grads) for n in g0)
                same_keys = all(g.keys() == g0.keys() for g, g0 in zip(r.grads, ref.grads))
                out["parity"][(cp, dropout, name)] = (loss_err, grad_err, same_keys, len(r.grads[0]), r.losses)
                if r.stats:
                    s = r.stats[-1]
                    out["stats"][(cp, dropout, name)] = {
                        "device": s.activation_bytes_device, "host": s.activation_bytes_host,
                        "layer_device": layer_device_bytes(s), "layer_host": layer_host_bytes(s),
                        "kept": (rt.kept_cache.pushes, rt.kept_cache.pops) if rt.kept_cache is not None else None,
                        "offloaded": rt.offloader.tensors_offloaded if rt.offloader is not None else None,
                    }
        ps.destroy_model_parallel()

    # -- model-level errors, before any step (rank 0 checks; the parent asserts the messages)
    ps.initialize_model_parallel(context_parallel_size=1)
    errors = out["errors"]

    def expect(key, fn, exc=ValueError):
        try:
            fn()
            errors[key] = None
        except exc as e:
            errors[key] = str(e)

    cfg = tiny_gpt_config(num_layers=LAYERS)
    expect("num_layers", lambda: validate_memory_options(MemoryOptions(recompute="full", recompute_num_layers=4),
                                                         "ring", cfg))
    biased = tiny_gpt_config(num_layers=LAYERS)
    biased.add_bias_linear = True
    expect("bias_mlp", lambda: validate_memory_options(
        MemoryOptions(recompute="selective", recompute_modules=("mlp",)), "ring", biased))
    # attaching full recompute to a model whose config was not given the recompute fields
    from megatron.core.models.gpt import GPTModel
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec

    from nemo_longctx.integrations.megatron.memory_options import attach_memory_options
    from nemo_longctx.integrations.megatron.spec import long_context_layer_spec

    plain = GPTModel(cfg, long_context_layer_spec(get_gpt_layer_local_spec(normalization="RMSNorm")),
                     vocab_size=VOCAB, max_sequence_length=SEQ, position_embedding_type="rope")
    expect("attach_unapplied", lambda: attach_memory_options(plain, MemoryOptions(recompute="full")))
    # kept attention that no backward consumed is reported after the step
    model, rt = build_probe_model(cfg, MemoryOptions(recompute="full_keep_attn"), vocab_size=VOCAB, seq_length=SEQ)
    b = batches[0]
    model(input_ids=b["tokens"], position_ids=b["position_ids"], attention_mask=None, labels=b["labels"])
    expect("kept_left", lambda: rt.after_step("after step 0"), RuntimeError)
    rt.kept_cache.clear()
    ps.destroy_model_parallel()
    return out


@pytest.fixture(scope="module")
def results():
    return run_distributed(_parity_worker, 2, timeout=400)


@pytest.mark.matrix  # the version-matrix smoke set (scripts/matrix_smoke.sh)
def test_every_recompute_offload_combination_matches_none(results):
    for rank, res in enumerate(results):
        assert len(res["parity"]) == 2 * 2 * len(COMBOS)
        for (cp, dropout, name), (loss_err, grad_err, same_keys, n_grads, losses) in res["parity"].items():
            where = f"rank {rank} cp={cp} hidden_dropout={dropout} {name}"
            assert same_keys and n_grads >= 3 * LAYERS + 3, where
            assert loss_err <= 1e-6, (where, loss_err)
            assert grad_err <= 1e-6, (where, grad_err)
            assert 3.0 < losses[0] < 6.0, (where, losses)  # ~log(128): a real loss, not zeros


def test_dropout_is_active_and_ranks_differ(results):
    p = results[0]["parity"]
    assert p[(2, 0.1, "none")][4] != p[(2, 0.0, "none")][4]  # dropout changes the loss: masks are really drawn
    # step 0 (same parameters): CP=2 == CP=1; later steps differ (each CP rank updates with its partial gradient)
    assert p[(1, 0.0, "none")][4][0] == pytest.approx(p[(2, 0.0, "none")][4][0], rel=1e-6)


def test_offloaded_bytes_move_from_device_to_host(results):
    for res in results:
        for cp in (2, 1):
            st = {name: s for (c, d, name), s in res["stats"].items() if c == cp and d == 0.1}
            none, full, offl = st["none"], st["full"], st["full+layer_input"]
            assert none["host"] == 0 and none["layer_device"] > 0
            # full + layer_input: the layers' inputs live on the host; on the device only the shared rotary table
            assert offl["layer_host"] >= LAYERS * (SEQ // cp) * 64 * 4
            assert offl["layer_device"] <= 0.1 * full["layer_device"], (offl, full)
            assert offl["offloaded"] == LAYERS * STEPS * 2  # hidden states + rotary table per layer and step
            assert full["layer_device"] < 0.2 * none["layer_device"]
            mods = st["modules[mlp,core_attn]"]
            assert mods["layer_host"] > 0 and mods["layer_device"] < none["layer_device"]
            assert mods["layer_device"] + mods["layer_host"] >= none["layer_device"]
            keep, keep_off = st["full_keep_attn"], st["full_keep_attn+layer_input"]
            assert keep["kept"] == keep_off["kept"] == (LAYERS * STEPS, LAYERS * STEPS)
            # kept out + lse per layer on the device: more than full, less than none
            assert full["layer_device"] < keep["layer_device"] < none["layer_device"]
            # with layer_input offload the kept out [s, 4, 16] + lse [4, s] (fp32) go to the host with the layer
            # input: the device keeps what full + layer_input keeps
            kept = LAYERS * (SEQ // cp) * 4 * (16 + 1) * 4
            assert keep_off["layer_device"] == offl["layer_device"], (keep_off, offl)
            assert keep_off["layer_host"] == offl["layer_host"] + kept, (keep_off, offl)
            assert keep_off["layer_device"] <= 0.02 * none["layer_device"]
            assert st["full_keep_attn(block,2)+layer_input"]["kept"] == (2 * STEPS, 2 * STEPS)
            # layernorm recompute under the tracker: the two norm outputs (each [s, 64] fp32) are not kept; the norm
            # inputs are (saved by the recompute instead of the norm's own internals)
            ln = st["selective[layernorm]"]
            assert ln["layer_device"] <= none["layer_device"] - LAYERS * 2 * (SEQ // cp) * 64 * 4, (ln, none)
            assert st["selective[core_attn,mlp,layernorm]"]["layer_device"] < st["selective[mlp]"]["layer_device"]
            ln_off = st["selective[layernorm,mlp]+modules[self_attention]"]
            assert ln_off["layer_host"] > 0 and ln_off["layer_device"] < st["selective[mlp]"]["layer_device"]


def test_model_level_errors(results):
    e = results[0]["errors"]
    assert "recompute.num_layers=4 exceeds the 3 layers" in e["num_layers"]
    assert "recompute.modules=[mlp]" in e["bias_mlp"] and "model.add_bias_linear" in e["bias_mlp"]
    assert "apply_recompute_fields" in e["attach_unapplied"]
    assert "never recomputed" in e["kept_left"] and "after step 0" in e["kept_left"]


# ------------------------------------------------------------------------------------------------ config level
def _options(overrides):
    from app_runner import train_spec

    from nemo_longctx.integrations.megatron.memory_options import validate_memory_options

    options = train_spec(overrides).options
    opts = options.memory
    validate_memory_options(opts, options.cp.algorithm)
    return opts


@pytest.mark.parametrize("overrides, message", [
    (["offload=layer_input"], "offload=layer_input requires recompute=full or full_keep_attn (got recompute=none)"),
    (["offload=layer_input", "recompute=selective"], "(got recompute=selective)"),
    (["recompute=selective", "recompute.modules=[core_attn,foo]"], "recompute.modules: unknown module(s) ['foo']"),
    (["offload=modules", "offload.modules=[mlp,bogus]"], "offload.modules: unknown module(s) ['bogus']"),
    (["offload=modules", "recompute=full"], "offload=modules cannot be combined with recompute=full"),
    (["offload=modules", "recompute=selective", "recompute.modules=[mlp]"], "recomputed by recompute.modules [mlp]"),
    (["recompute=full_keep_attn", "cp.algorithm=ulysses"], "needs cp.algorithm=ring"),
    (["recompute=full", "recompute.method=every"], "recompute.method='every'"),
    (["recompute=full", "recompute.num_layers=0"], "recompute.num_layers=0"),
    (["recompute=full", "offload=layer_input", "offload.prefetch_depth=-1"], "offload.prefetch_depth=-1"),
    (["recompute=full", "+recompute.modules=[mlp]"], "recompute: unknown field(s) ['modules'] for recompute=full"),
    (["recompute=full", "recompute.sequence_chunks=0"],
     "recompute.sequence_chunks must be a positive number of chunks"),
    (["recompute=full_keep_attn", "+recompute.sequence_chunks=auto"],
     "recompute.sequence_chunks='auto' needs recompute=full"),
    (["recompute=selective", "+recompute.sequence_chunks=2"],
     "recompute: unknown field(s) ['sequence_chunks'] for recompute=selective"),
])
def test_invalid_combinations_name_the_field(overrides, message):
    with pytest.raises(ValueError) as e:
        _options(overrides)
    assert message in str(e.value)


def test_planner_overrides_compose_and_validate():
    assert _options(["recompute=full", "offload=layer_input"]).describe() == \
        "recompute=full(uniform,1) offload=layer_input"
    assert _options(["recompute=full", "recompute.sequence_chunks=auto"]).describe() == \
        "recompute=full(uniform,1)[sequence_chunks=auto] offload=none"
    assert _options(["recompute=full_keep_attn", "offload=layer_input", "recompute.method=block",
                     "recompute.num_layers=2"]).describe() == "recompute=full_keep_attn(block,2) offload=layer_input"
    assert _options(["recompute=selective", "recompute.modules=[mlp]"]).recompute_modules == ("mlp",)
    assert _options(["offload=modules", "offload.modules=[core_attn,linear_fc1]"]).offload_modules == (
        "core_attn", "linear_fc1")
    assert _options([]).trivial
    # layernorm recompute runs our own norm recompute: offload=modules and the tracker work with it (issue 13)
    assert _options(["offload=modules", "offload.modules=[core_attn]", "recompute=selective",
                     "recompute.modules=[layernorm]"]).offload_modules == ("core_attn",)


# ------------------------------------------------------------------------------------------------ the app
def _run(cmd, timeout=300):
    return run_app(cmd, timeout)


def test_cli_refuses_invalid_combination_before_spawning():
    code, out = _run([str(BIN / "nemo-longctx"), "train", "offload=layer_input"], timeout=120)
    assert code != 0 and "offload=layer_input requires recompute=full or full_keep_attn (got recompute=none)" in out
    assert "spawning" not in out


def test_app_logs_memory_metrics_with_kept_attention_and_layer_offload(tmp_path):
    out_dir = tmp_path / "app"
    code, out = _run([str(BIN / "nemo-longctx"), "train", f"output_dir={out_dir}", "recompute=full_keep_attn",
                      "offload=layer_input", "memory.track_peak=true", "trainer.max_steps=3",
                      "model.seq_length=2048", "run.timeout_s=240"])
    assert code == 0, out[-4000:]
    m = [json.loads(line) for line in (out_dir / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in m] == [1, 2, 3]
    for r in m:
        # per rank and layer (2 layers, 1024 tokens): the layer input (x 256 hidden x 4 B = 1 MiB) and the kept
        # attention output (8 heads x 32 x 4 B = 1 MiB) go to the host; the LSE (32 KiB) and the RoPE table (128 KiB)
        # are below offload.min_bytes (1 MiB) and stay
        assert r["activation_bytes_host"] == 2 * 2 * 1024 * 256 * 4, r
        assert 0 < r["activation_bytes_device"] < r["peak_bytes"], r
    assert "activations cpu" in out and "host 4.0 MiB" in out and "peak" in out
