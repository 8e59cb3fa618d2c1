"""The memory options on the Megatron-Bridge front end (CPU demo, ring CP=2 on 2 gloo ranks, Bridge's own pretrain):
full_keep_attn (our full-recompute block loop + the kept attention) with layer-input offload, the tiled MLP and the
chunked loss; the selective layernorm recompute with module offload -- each gives the plain run's per-step losses,
and the tracker's bytes in metrics.jsonl are exactly what the options move to the host (computed from the demo's
shapes, as the NeMo 2 app's test does)."""

from __future__ import annotations

import pytest

pytest.importorskip("megatron.bridge", reason="the Megatron-Bridge stack (scripts/install_bridge.sh)")

from runner import run_bridge, shared_run  # noqa: E402

# the CPU demo: seq 256 over CP=2 -> 128 tokens per rank, hidden 128, 4 heads x 32 (2 KV heads), 2 layers, fp32
TOKENS, HIDDEN, FFN, HEADS, HEAD_DIM, LAYERS, SEQ = 128, 128, 256, 4, 32, 2, 256
LAYER_INPUT = TOKENS * HIDDEN * 4  # bytes of one layer's input [s_local, b=1, h]
ROPE = SEQ * HEAD_DIM * 4  # the rotary table [s, 1, 1, d], shared by the layers: one storage
KEPT = TOKENS * HEADS * HEAD_DIM * 4 + HEADS * TOKENS * 4  # full_keep_attn: a layer's attention output + its LSE
RING = ["cp=ring", "cp.size=2", "offload.min_bytes=0"]
PLAIN = ("cp=ring", "cp.size=2")  # the reference, shared with test_bridge_app.py
CASES = {
    "keep_attn_offload_tiling": RING + ["recompute=full_keep_attn", "offload=layer_input", "tiling=auto",
                                        "tiling.mlp_tiles=2", "tiling.loss_chunks=2"],
    "selective_modules": RING + ["recompute=selective", "recompute.modules=[core_attn,layernorm]", "offload=modules",
                                 "offload.modules=[linear_fc2]"],
}


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("bridge_memory")
    out = {"plain": shared_run(*PLAIN)}
    out.update({name: run_bridge(tmp, name, *args) for name, args in CASES.items()})
    for name, (code, log, rows) in out.items():
        assert code == 0, (name, log[-4000:])
        assert [r["step"] for r in rows] == [1, 2, 3], (name, rows)
    return {name: (log, rows) for name, (code, log, rows) in out.items()}


def _close(a, b, rel):
    return abs(a - b) <= rel * abs(a)


@pytest.mark.parametrize("name", list(CASES))
def test_memory_options_keep_the_losses(runs, name):
    ref = [r["loss"] for r in runs["plain"][1]]
    got = [r["loss"] for r in runs[name][1]]
    assert all(_close(a, b, 2e-6) for a, b in zip(ref, got)), (name, ref, got)
    assert ref[0] != ref[-1]  # training moves the loss


def test_tracker_bytes_are_what_the_options_offload(runs):
    plain = runs["plain"][1]
    assert all(r["activation_bytes_host"] == 0 and r["activation_bytes_device"] > 0 for r in plain)
    device_plain = plain[0]["activation_bytes_device"]
    # full_keep_attn + layer-input offload (min_bytes=0): every layer's input, the shared RoPE table and the kept
    # attention outputs with their LSEs on the host
    keep = runs["keep_attn_offload_tiling"][1]
    assert all(r["activation_bytes_host"] == LAYERS * (LAYER_INPUT + KEPT) + ROPE for r in keep), keep
    assert all(0 < r["activation_bytes_device"] < device_plain / 2 for r in keep), (keep, device_plain)
    # module offload of linear_fc2: what fc2 saves per layer (its input, the activation [s, 1, ffn])
    sel = runs["selective_modules"][1]
    assert all(r["activation_bytes_host"] == LAYERS * TOKENS * FFN * 4 for r in sel), sel


def test_the_run_says_what_it_wired(runs):
    log = runs["keep_attn_offload_tiling"][0]
    assert "recompute=full_keep_attn(uniform,1) offload=layer_input; mlp_tiles=2: 2 tile(s)" in log, log[-3000:]
    assert "loss_chunks=2" in log and "(1 chunked GPT model(s) on this rank)" in log, log[-3000:]
    assert "step 3/3 | loss" in log and "host 0.3 MiB" in log, log[-3000:]
