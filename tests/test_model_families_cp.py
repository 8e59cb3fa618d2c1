"""NeMo's model families train under ring, Ulysses and hybrid CP with cp=none's per-step losses (fp32, CPU, gloo).

Each family is its ``conf/model/tiny_*.yaml`` entry -- the NeMo config class (``Qwen2Config``, ``MixtralConfig``,
``DeepSeekV2LiteConfig``, ...) at tiny sizes, the model built by NeMo's own ``configure_model`` (Megatron's local
spec: no TransformerEngine) with our core attention (``enable_long_context``). One spawn of 2 gloo ranks runs every
family: cp=none (our core attention at CP size 1, the whole sequence on each rank) and CP=2 with ring, Ulysses and
hybrid (ulysses_size=2 over the 2 ranks) train 3 SGD steps on the same data; the per-step losses (summed over the CP
group) must agree to fp32 rounding. Anchors: a model whose attention does not communicate (each rank attends only
its own shard) gives clearly different losses; Mistral's sliding window also runs against Megatron's own
``DotProductAttention`` (the unmodified local spec honours ``window_size``) at cp=1.

Also: Gemma 2's attention logit soft-capping is refused at build time, naming the field.
"""

from __future__ import annotations

import os
from pathlib import Path

import pytest
import torch

from distributed import run_distributed

ROOT = Path(__file__).resolve().parents[1]
FAMILIES = ["tiny_llama", "tiny_qwen2", "tiny_qwen3", "tiny_qwen3_moe", "tiny_mistral", "tiny_mixtral",
            "tiny_deepseek_v2_lite", "tiny_nemotron", "tiny_phi3", "tiny_starcoder2"]
ALGOS = [("ring", "ring", {}), ("ulysses", "ulysses", {"head_chunks": 1}), ("hybrid", "hybrid", {"ulysses_size": 2})]
S, STEPS, LR = 128, 3, 0.5


def _model_config(name, cp, algo, kwargs, long_context=True):
    import hydra
    from omegaconf import OmegaConf

    from nemo_longctx.integrations.nemo.model import enable_long_context

    node = OmegaConf.load(ROOT / "conf" / "model" / f"{name}.yaml")
    node.seq_length = S
    config = hydra.utils.instantiate(node, _convert_="all")
    config.params_dtype, config.bf16, config.fp16, config.pipeline_dtype = torch.float32, False, False, None
    config.context_parallel_size = cp
    if config.window_size is not None:
        config.window_size = tuple(config.window_size)  # Megatron's mask cache needs a hashable window
    if long_context:
        enable_long_context(config, algo, **kwargs)
    return config


def _batches(vocab):
    """The same batch every step (the loss must fall: the model memorizes it)."""
    g = torch.Generator().manual_seed(11)
    seq = torch.randint(0, vocab, (1, S + 1), generator=g)
    return [{"tokens": seq[:, :-1], "labels": seq[:, 1:], "loss_mask": torch.ones(1, S),
             "position_ids": torch.arange(S)[None]}] * STEPS


def _train(config, batches, cp_group, state=None, local_only=False):
    """STEPS SGD steps; returns (per-step global mean loss, initial state dict)."""
    import torch.distributed as dist
    from megatron.core import tensor_parallel

    from nemo_longctx.integrations.megatron.batch import shard_batch_for_cp

    torch.manual_seed(3)
    tensor_parallel.model_parallel_cuda_manual_seed(3)
    model = config.configure_model(None)
    if state is not None:
        model.load_state_dict(state)
    init = {k: v.clone() for k, v in model.state_dict().items() if isinstance(v, torch.Tensor)}
    if local_only:
        for layer in model.decoder.layers:
            layer.self_attention.core_attention.cp_size = 1
    cp = cp_group.size() if cp_group is not None else 1
    rank = cp_group.rank() if cp_group is not None else 0
    losses = []
    params = [p for p in model.parameters() if p.requires_grad]
    for batch in batches:
        b = shard_batch_for_cp(batch, cp, rank)
        per_token = model(b["tokens"], b["position_ids"], None, labels=b["labels"])
        loss_sum = (per_token * b["loss_mask"]).sum()
        total = batch["loss_mask"].sum()
        # as Megatron with NeMo's loss reduction: each rank's own token mean, gradients averaged over the CP group
        # (DDP over dp x cp); MoE auxiliary losses get their CP factor from our layer spec (integrations.megatron.moe)
        (loss_sum / b["loss_mask"].sum()).backward()
        with torch.no_grad():
            report = loss_sum.detach().clone()
            if cp > 1:
                dist.all_reduce(report, group=cp_group)
                for p in params:
                    if p.grad is not None:
                        dist.all_reduce(p.grad, group=cp_group)
                        p.grad /= cp
            for p in params:
                if p.grad is not None:
                    p.add_(p.grad, alpha=-LR)
                    p.grad = None
        losses.append((report / total).item())
    return losses, init


def _family(name, ps):
    import torch.distributed as dist

    world = dist.get_world_size()
    ps.destroy_model_parallel()
    ps.initialize_model_parallel(context_parallel_size=1)
    ref_cfg = _model_config(name, 1, "ring", {})
    batches = _batches(ref_cfg.vocab_size)
    ref, state = _train(ref_cfg, batches, None)
    res = {"none": ref}
    if name == "tiny_mistral":  # Megatron's own DotProductAttention with the window (the unmodified local spec)
        meg = _model_config(name, 1, "ring", {}, long_context=False)
        res["megatron_local"] = _train(meg, batches, None, state)[0]
        alt = _model_config(name, 1, "ring", {}, long_context=False)  # windowed / full layers alternating
        alt.window_attn_skip_freq = 2
        res["alt_megatron_local"] = _train(alt, batches, None, state)[0]
    ps.destroy_model_parallel()
    ps.initialize_model_parallel(context_parallel_size=world)
    group = ps.get_context_parallel_group()
    for key, algo, kwargs in ALGOS:
        res[key] = _train(_model_config(name, world, algo, kwargs), batches, group, state)[0]
    res["local_only"] = _train(_model_config(name, world, "ring", {}), batches, group, state, local_only=True)[0]
    if name == "tiny_mistral":
        for key, algo, kwargs in ALGOS[:2]:
            alt = _model_config(name, world, algo, kwargs)
            alt.window_attn_skip_freq = 2
            res["alt_" + key] = _train(alt, batches, group, state)[0]
            layers = alt.configure_model(None).decoder.layers
            res["alt_window"] = [l.self_attention.core_attention.window_size for l in layers]
    cfg = _model_config(name, world, "ring", {})
    res["window"] = [getattr(l.self_attention.core_attention, "window_size", None)
                     for l in cfg.configure_model(None).decoder.layers]
    return res


def _refusals():
    from nemo_longctx.integrations.megatron.validation import long_context_problems
    from nemo.collections.llm.gpt.model.gemma2 import Gemma2Config2B

    return {"gemma2": long_context_problems(Gemma2Config2B(), 2, "ring")}


REAL = {  # conf/model entries of real families: dry run (build + validate the real NeMo objects, every layer ours)
    "qwen2_5_7b": ["cp=ring", "cp.size=8", "trainer.devices=8"],
    "mistral_7b": ["cp=ulysses", "cp.size=8", "trainer.devices=8"],
    "mixtral_8x7b": ["cp=hybrid", "cp.size=8", "cp.ulysses_size=4", "trainer.devices=8"],
    "deepseek_v2_lite": ["cp=ring", "cp.size=4", "trainer.devices=4"],
}


def _dry_runs():
    from app_runner import train_spec

    from nemo_longctx.apps.train import dry_run

    out = {}
    for name, overrides in REAL.items():
        spec = train_spec([f"model={name}", "run.dry_run=true", "data=synthetic", *overrides])
        summary = dry_run(spec)
        out[name] = {k: summary[k] for k in ("model", "num_layers", "cp", "core_attention", "seq_length")}
    return out


def _worker(rank, world, families):
    from nemo_longctx.integrations.nemo import compat

    compat.apply()
    from megatron.core import parallel_state as ps

    ps.initialize_model_parallel(context_parallel_size=world)
    out = {}
    for name in families:
        try:
            out[name] = _family(name, ps)
        except Exception as e:  # noqa: BLE001 - reported per family in the parent
            import traceback

            out[name] = {"error": f"{type(e).__name__}: {e}\n{traceback.format_exc()[-3000:]}"}
            raise
    out["refusals"] = _refusals()
    if rank == 0 and os.environ.get("FAMILIES") is None:
        out["dry_runs"] = _dry_runs()
    ps.destroy_model_parallel()
    return out


@pytest.fixture(scope="module")
def results():
    families = os.environ.get("FAMILIES", ",".join(FAMILIES)).split(",")
    return run_distributed(_worker, 2, families, timeout=900)[0]


@pytest.mark.parametrize("family", FAMILIES)
def test_family_trains_with_cp_losses_equal_to_cp_none(results, family):
    r = results[family]
    ref = r["none"]
    assert ref[0] > ref[-1], r  # it trains
    for key, _, _ in ALGOS:
        errs = [abs(a - b) / abs(b) for a, b in zip(r[key], ref)]
        assert max(errs) < 5e-6, (family, key, r)
    anchor = max(abs(a - b) / abs(b) for a, b in zip(r["local_only"], ref))
    assert anchor > 1e-4, (family, r)  # >= 20x the tolerance: the test can tell CP attention from none


def test_mistral_window_per_layer_and_vs_megatron(results):
    r = results["tiny_mistral"]
    assert r["window"] == [(24, 0), (24, 0)], r  # window 24 < the CP chunk (S / 4 = 32): a halo, not a ring
    errs = [abs(a - b) / abs(b) for a, b in zip(r["megatron_local"], r["none"])]
    assert max(errs) < 5e-6, r
    # window_attn_skip_freq=2: layer 1 windowed, layer 2 full (Megatron's is_layer_window_attention)
    assert r["alt_window"] == [(24, 0), None], r
    for key in ("alt_ring", "alt_ulysses"):
        errs = [abs(a - b) / abs(b) for a, b in zip(r[key], r["alt_megatron_local"])]
        assert max(errs) < 5e-6, (key, r)
    assert max(abs(a - b) / abs(b) for a, b in zip(r["alt_megatron_local"], r["megatron_local"])) > 1e-4, r


def test_real_family_configs_dry_run_with_our_attention(results):
    d = results["dry_runs"]
    assert d["qwen2_5_7b"]["model"] == "Qwen25Config7B" and d["qwen2_5_7b"]["core_attention"].startswith("28/28")
    assert d["mistral_7b"]["cp"] == "ulysses x 8" and d["mistral_7b"]["core_attention"].startswith("32/32")
    assert d["mixtral_8x7b"]["cp"] == "hybrid x 8" and d["mixtral_8x7b"]["core_attention"].startswith("32/32")
    assert d["deepseek_v2_lite"]["model"] == "DeepSeekV2LiteConfig"
    assert d["deepseek_v2_lite"]["core_attention"].startswith("27/27")
    assert all(v["seq_length"] == 32768 for v in d.values()), d


def test_gemma2_logit_softcapping_refused(results):
    problems = results["refusals"]["gemma2"]
    assert any("model.attn_logit_softcapping=50.0" in p and "soft-capping" in p for p in problems), problems
