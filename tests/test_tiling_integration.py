"""Tiling integrated into Megatron/NeMo (real objects, 2 gloo ranks, one spawn, assertions in the parent):

- ``TiledMegatronMLP`` (built from Megatron's local layer spec) vs Megatron's ``MLP`` with the same state dict:
  forward + backward (input and every weight), fp64, SwiGLU with and without linear biases, ragged / auto / fixed
  tiles, and the RNG tracker state left as the untiled MLP leaves it;
- a tiny Megatron ``GPTModel`` (our ring core attention) built plainly vs built with ``TiledMLPLayerSpec`` +
  ``use_chunked_loss`` (mlp_tiles=auto with ragged tiles, loss_chunks=8), same state dict, 3 SGD steps through
  ``LossMaskForwardStep`` and NeMo's ``MaskedTokenLossReduction`` with a loss mask that has zeros: per-step loss,
  gradients and parameters equal (fp32, 1e-6 relative) at CP=1 (tied embeddings), CP=2 (ring), TP=2 (vocab-
  parallel loss) untied and tied, and CP=2 under Megatron's full and selective (mlp) recompute; the per-token
  loss seen by the reduction is unchanged. (Sequence parallelism cannot be built on CPU: Megatron's local-spec
  norms refuse it without Apex/TE.)
- bad settings (tiles <= 0, chunks > tokens per rank, unknown words, MoE layers) raise ValueErrors naming the
  field, and the Hydra ``tiling`` group composes with the planner's overrides;
- the Hydra app: bad tiling refused before spawning; a 3-step run of the default job (cp=ring x 2) with
  ``tiling.mlp_tiles=3 tiling.loss_chunks=8`` vs without: same losses and SGD parameters.
"""

from __future__ import annotations

import pytest
import torch

from distributed import run_distributed

ATOL_REL = 1e-6


def _rel(a, b):
    a, b = a.double(), b.double()
    return ((a - b).norm() / b.norm().clamp_min(1e-30)).item()


# ------------------------------------------------------------------------------------------------ MLP unit cases
def _mlp_cases():
    import torch.nn.functional as F
    from megatron.core import tensor_parallel
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec
    from megatron.core.transformer.mlp import MLP
    from megatron.core.transformer.spec_utils import build_module
    from megatron.core.transformer.transformer_config import TransformerConfig

    from nemo_longctx.integrations.megatron.tiled_mlp_layer import TiledMegatronMLP, mlp_modules, tiled_mlp_layer_spec

    out = []
    for bias, tiles, tile_tokens, s in ((False, 3, 2048, 11), (True, "auto", 4, 13), (True, 13, 2048, 13),
                                        (False, "auto", 2048, 9)):
        cfg = TransformerConfig(
            num_layers=1, hidden_size=16, ffn_hidden_size=24, num_attention_heads=2, gated_linear_unit=True,
            activation_func=F.silu, add_bias_linear=bias, bias_activation_fusion=False, params_dtype=torch.float64,
            hidden_dropout=0.0, attention_dropout=0.0,
        )
        base_spec = get_gpt_layer_local_spec()
        tiled_spec = tiled_mlp_layer_spec(base_spec, tiles, tile_tokens)
        assert mlp_modules(base_spec) == [MLP] and mlp_modules(tiled_spec) == [TiledMegatronMLP]
        torch.manual_seed(s)
        ref = build_module(base_spec.submodules.mlp, config=cfg)
        tiled = build_module(tiled_spec.submodules.mlp, config=cfg)
        missing = tiled.load_state_dict(ref.state_dict(), strict=True)
        x = torch.randn(s, 2, 16, dtype=torch.float64)
        w = torch.randn(s, 2, 16, dtype=torch.float64)
        results = []
        rng_after = []
        for mod in (ref, tiled):
            xi = x.clone().requires_grad_()
            o, b = mod(xi)
            loss = (o * w).sum() + (b.sum() * 0.5 if b is not None else 0)
            params = [p for p in mod.parameters()]
            grads = torch.autograd.grad(loss, [xi] + params)
            results.append((o.detach(), None if b is None else b.detach(), grads))
            rng_after.append(tensor_parallel.get_cuda_rng_tracker().get_states()["model-parallel-rng"].clone())
        (o1, b1, g1), (o2, b2, g2) = results
        out.append({
            "case": (bias, tiles, tile_tokens, s),
            "keys_ok": not missing.missing_keys and not missing.unexpected_keys,
            "out": _rel(o2, o1), "bias": None if b1 is None else _rel(b2, b1), "bias_none": (b1 is None, b2 is None),
            "grads": [_rel(a, b) for a, b in zip(g2, g1)], "n_grads": len(g1),
            "rng_same": torch.equal(rng_after[0], rng_after[1]),
        })
    return out


# ------------------------------------------------------------------------------------------------ model cases
def _gpt_config(tp: int, cp: int, sp: bool, tied: bool, recompute: dict):
    import torch.nn.functional as F
    from megatron.core.transformer.transformer_config import TransformerConfig

    return TransformerConfig(**recompute,
        num_layers=2, hidden_size=32, ffn_hidden_size=48, num_attention_heads=4, num_query_groups=2,
        gated_linear_unit=True, activation_func=F.silu, add_bias_linear=False, normalization="RMSNorm",
        tensor_model_parallel_size=tp, context_parallel_size=cp, sequence_parallel=sp,
        hidden_dropout=0.0, attention_dropout=0.0, params_dtype=torch.float32, init_method_std=0.05,
        masked_softmax_fusion=False, bias_activation_fusion=False, persist_layer_norm=False,
        bias_dropout_fusion=False, apply_rope_fusion=False, gradient_accumulation_fusion=False,
        cross_entropy_loss_fusion=False,
    ), tied


def _build_gpt(config, tied, vocab, seq, tiled: bool, mlp_tile_tokens: int, loss_chunks):
    from megatron.core.models.gpt import GPTModel
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec

    from nemo_longctx.integrations.megatron.gpt_chunked_loss import ChunkedLossGPTModel, use_chunked_loss
    from nemo_longctx.integrations.nemo.model import LongContextLayerSpec
    from nemo_longctx.integrations.nemo.sequence_tiling import TiledMLPLayerSpec

    spec = LongContextLayerSpec(get_gpt_layer_local_spec(normalization="RMSNorm"), "ring")
    if tiled:
        spec = TiledMLPLayerSpec(spec, "auto", mlp_tile_tokens)
    model = (ChunkedLossGPTModel if tiled else GPTModel)(  # built with the chunked loss, Megatron's otherwise
        config, spec(config), vocab_size=vocab, max_sequence_length=seq, position_embedding_type="rope",
        share_embeddings_and_output_weights=tied)
    n = use_chunked_loss(model, loss_chunks) if tiled else 0
    return model, n


def _train_compare(tp, cp, sp, tied, recompute=None, steps=3, seq=44, vocab=64, b=2, loss_chunks=8, mlp_tile_tokens=6):
    import torch.distributed as dist
    from megatron.core import parallel_state as ps
    from megatron.core import tensor_parallel
    from nemo.lightning.megatron_parallel import MaskedTokenLossReduction

    from nemo_longctx.integrations.megatron.batch import shard_batch_for_cp
    from nemo_longctx.integrations.megatron.tiled_mlp_layer import TiledMegatronMLP
    from nemo_longctx.integrations.nemo.sequence_tiling import LossMaskForwardStep

    ps.destroy_model_parallel()
    ps.initialize_model_parallel(tensor_model_parallel_size=tp, context_parallel_size=cp)
    tensor_parallel.model_parallel_cuda_manual_seed(1234)
    config, tied = _gpt_config(tp, cp, sp, tied, recompute or {})
    torch.manual_seed(7)
    plain, _ = _build_gpt(config, tied, vocab, seq, False, mlp_tile_tokens, loss_chunks)
    tiled, n_chunked = _build_gpt(config, tied, vocab, seq, True, mlp_tile_tokens, loss_chunks)
    load = tiled.load_state_dict(plain.state_dict(), strict=True)
    n_tiled_mlps = sum(isinstance(m, TiledMegatronMLP) for m in tiled.modules())

    def forward_step(model, batch):  # like long_context_forward_step, on the Megatron model itself
        return model(input_ids=batch["tokens"], position_ids=batch["position_ids"], attention_mask=None,
                     labels=batch["labels"])

    reduction = MaskedTokenLossReduction()
    cp_group = ps.get_context_parallel_group()
    dp_cp = ps.get_data_parallel_group(with_context_parallel=True)
    per_step = []
    for step in range(steps):
        g = torch.Generator().manual_seed(100 + step)
        tokens = torch.randint(0, vocab, (b, seq + 1), generator=g)
        mask = (torch.rand(b, seq, generator=g) > 0.2).float()
        full = {"tokens": tokens[:, :-1], "labels": tokens[:, 1:], "loss_mask": mask,
                "position_ids": torch.arange(seq).repeat(b, 1)}
        batch = shard_batch_for_cp(full, cp, ps.get_context_parallel_rank())
        rec = {}
        tiled_step = LossMaskForwardStep(forward_step)
        for name, model, step_fn in (("plain", plain, forward_step), ("tiled", tiled, tiled_step)):
            model.zero_grad(set_to_none=True)
            out = step_fn(model, batch)
            loss_sum, num_tokens, _ = reduction.forward(dict(batch), out)
            total = num_tokens.clone().float()
            dist.all_reduce(total, group=dp_cp)
            (loss_sum / total).backward()
            stats = torch.stack([loss_sum.detach(), num_tokens.float()])
            dist.all_reduce(stats, group=dp_cp)
            grads = {}
            for pname, p in model.named_parameters():
                grad = p.grad if p.grad is not None else torch.zeros_like(p)
                if cp > 1:
                    dist.all_reduce(grad, group=cp_group)
                grads[pname] = grad.clone()
            with torch.no_grad():
                for pname, p in model.named_parameters():
                    p.sub_(0.5 * grads[pname])
            rec[name] = {"loss": (stats[0] / stats[1]).item(), "grads": grads,
                         "token_loss": (out.detach() * batch["loss_mask"]), "shape": tuple(out.shape)}
        p_plain, p_tiled = dict(plain.named_parameters()), dict(tiled.named_parameters())
        per_step.append({
            "loss": (rec["plain"]["loss"], rec["tiled"]["loss"]),
            "token_loss": _rel(rec["tiled"]["token_loss"], rec["plain"]["token_loss"]),
            "shapes": (rec["plain"]["shape"], rec["tiled"]["shape"]),
            "grads": {k: _rel(rec["tiled"]["grads"][k], v) for k, v in rec["plain"]["grads"].items()},
            "grad_norms": {k: v.norm().item() for k, v in rec["plain"]["grads"].items()},
            "params": max(_rel(p_tiled[k], p_plain[k]) for k in p_plain),
        })
    return {
        "setting": (tp, cp, sp, tied, recompute), "keys_ok": not load.missing_keys and not load.unexpected_keys,
        "n_chunked": n_chunked, "n_tiled_mlps": n_tiled_mlps, "steps": per_step,
        "model_class": type(tiled).__name__,
    }


# ------------------------------------------------------------------------------------------------ error cases
def _error_cases():
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec

    from nemo_longctx.integrations.megatron.tiled_mlp_layer import tiled_mlp_layer_spec
    from nemo_longctx.options import TilingOptions, raise_problems

    def tiling_problems(mlp_tiles, loss_chunks, **context):
        return TilingOptions.from_dict({"mlp_tiles": mlp_tiles, "loss_chunks": loss_chunks}).problems(**context)

    def SequenceTiling(**kw):  # the option checks the app runs before it builds the tiling callback
        context = {k: kw.pop(k) for k in ("seq_length", "cp_size", "tp", "sequence_parallel") if k in kw}
        raise_problems(TilingOptions.from_dict(kw).problems(**context))

    errors = {}

    def expect(name, fn):
        try:
            fn()
            errors[name] = None
        except ValueError as e:
            errors[name] = str(e)

    expect("tiles_zero", lambda: SequenceTiling(mlp_tiles=0, seq_length=4096, cp_size=2))
    expect("chunks_negative", lambda: SequenceTiling(loss_chunks=-2, seq_length=4096, cp_size=2))
    expect("chunks_too_many", lambda: SequenceTiling(loss_chunks=4096, seq_length=4096, cp_size=2))
    expect("tiles_too_many_sp", lambda: SequenceTiling(mlp_tiles=1500, seq_length=4096, cp_size=2, tp=2,
                                                       sequence_parallel=True))
    expect("word", lambda: SequenceTiling(mlp_tiles="many"))
    expect("tile_tokens", lambda: SequenceTiling(mlp_tiles="auto", mlp_tile_tokens=0))
    expect("moe", lambda: tiled_mlp_layer_spec(get_gpt_layer_local_spec(num_experts=4), "auto"))
    ok = {
        "yaml_off": tiling_problems(False, "off", seq_length=4096, cp_size=2),
        "at_limit": tiling_problems(2048, 2048, seq_length=4096, cp_size=2),
        "auto": tiling_problems("auto", "auto", seq_length=4096, cp_size=2),
    }
    return errors, ok


def _worker(rank: int, world: int):
    from nemo_longctx.integrations.nemo import compat

    compat.apply()
    from megatron.core import parallel_state as ps
    from megatron.core import tensor_parallel

    res = {}
    ps.initialize_model_parallel()
    tensor_parallel.model_parallel_cuda_manual_seed(99)
    res["mlp"] = _mlp_cases()
    res["models"] = [
        _train_compare(tp=1, cp=1, sp=False, tied=True),
        _train_compare(tp=1, cp=2, sp=False, tied=False),
        _train_compare(tp=2, cp=1, sp=False, tied=False),
        _train_compare(tp=2, cp=1, sp=False, tied=True),
        _train_compare(tp=1, cp=2, sp=False, tied=False, steps=2, recompute=dict(
            recompute_granularity="full", recompute_method="uniform", recompute_num_layers=1)),
        _train_compare(tp=1, cp=2, sp=False, tied=False, steps=2, recompute=dict(
            recompute_granularity="selective", recompute_modules=["mlp", "core_attn"])),
    ]
    ps.destroy_model_parallel()
    if rank == 0:
        res["errors"], res["ok"] = _error_cases()
    return res


@pytest.fixture(scope="module")
def results():
    return run_distributed(_worker, 2, timeout=400)


def test_tiled_megatron_mlp_matches_megatron_mlp(results):
    for res in results:
        for c in res["mlp"]:
            assert c["keys_ok"], c
            assert c["out"] < 1e-12 and max(c["grads"]) < 1e-12, c
            assert c["bias_none"][0] == c["bias_none"][1], c
            assert c["bias"] is None or c["bias"] < 1e-12, c
            assert c["rng_same"], c
        assert [c["n_grads"] for c in res["mlp"]] == [3, 5, 5, 3]  # x, fc1 w (+b), fc2 w (+b)


@pytest.mark.parametrize("index,setting", [(0, "cp1_tied"), (1, "cp2_ring"), (2, "tp2"), (3, "tp2_tied"),
                                                (4, "cp2_full_recompute"), (5, "cp2_selective_mlp_recompute")])
def test_tiled_model_matches_plain_model_over_steps(results, index, setting):
    for res in results:
        m = res["models"][index]
        assert m["keys_ok"] and m["model_class"] == "ChunkedLossGPTModel" and m["n_chunked"] == 1, m["setting"]
        assert m["n_tiled_mlps"] == 2, m["setting"]
        for i, s in enumerate(m["steps"]):
            lp, lt = s["loss"]
            assert abs(lt - lp) <= 1e-6 * abs(lp), (m["setting"], i, s["loss"])
            assert s["shapes"][0] == s["shapes"][1]
            assert s["token_loss"] < 1e-6, (m["setting"], i, s["token_loss"])
            bad = {k: v for k, v in s["grads"].items() if v > ATOL_REL}
            assert not bad, (m["setting"], i, bad)
            assert all(n > 0 for n in s["grad_norms"].values()), (m["setting"], s["grad_norms"])
            assert s["params"] < ATOL_REL, (m["setting"], i, s["params"])
    # the loss actually changes over the steps (the comparison is not of a frozen model)
    losses = [s["loss"][0] for s in results[0]["models"][index]["steps"]]
    assert len(set(round(v, 6) for v in losses)) == len(losses)


def test_cp2_ranks_hold_different_shards_and_agree_on_the_loss(results):
    a, b = (r["models"][1]["steps"] for r in results)
    assert [s["loss"] for s in a] == [s["loss"] for s in b]


def test_bad_tiling_settings_name_the_field(results):
    e, ok = results[0]["errors"], results[0]["ok"]
    assert "tiling.mlp_tiles" in e["tiles_zero"] and "positive" in e["tiles_zero"]
    assert "tiling.loss_chunks" in e["chunks_negative"]
    assert "tiling.loss_chunks=4096" in e["chunks_too_many"] and "2048 tokens per rank" in e["chunks_too_many"]
    assert "cp.size=2" in e["chunks_too_many"]
    assert "tiling.mlp_tiles=1500" in e["tiles_too_many_sp"] and "1024 tokens per rank" in e["tiles_too_many_sp"]
    assert "tiling.mlp_tiles" in e["word"] and "'many'" in e["word"]
    assert "tiling.mlp_tile_tokens" in e["tile_tokens"]
    assert "tiling.mlp_tiles" in e["moe"] and "MoELayer" in e["moe"]
    assert ok == {"yaml_off": [], "at_limit": [], "auto": []}


def test_tiling_group_composes_with_planner_overrides():
    from app_runner import train_config, train_spec

    default = train_config([])
    planned = train_spec(["tiling.mlp_tiles=16", "tiling.loss_chunks=off"])
    auto = train_spec(["tiling=auto", "tiling.loss_chunks=8"])
    assert (default.tiling.mlp_tiles, default.tiling.loss_chunks) == ("off", "off")
    cb = planned.options.tiling  # what the app builds its SequenceTiling callback from
    assert (cb.mlp_tiles, cb.loss_chunks, planned.model.seq_length, planned.options.cp.size) == (16, "off", 4096, 2)
    assert (auto.options.tiling.mlp_tiles, auto.options.tiling.loss_chunks) == ("auto", 8)


# ------------------------------------------------------------------------------------------------ the Hydra app
def _compose(overrides):
    from app_runner import train_config

    return train_config(overrides)


def test_app_refuses_bad_tiling_before_spawning():
    from nemo_longctx.apps.train import config_problems, raise_problems, read_run_spec, run

    def tiling_of(cfg):  # the app's check, then the line the dry run prints
        spec = read_run_spec(cfg)
        raise_problems(config_problems(spec))
        return spec.options.tiling.describe(spec.model.seq_length, spec.options.cp.size)

    with pytest.raises(ValueError, match=r"tiling\.loss_chunks=4096 exceeds the 2048 tokens per rank"):
        run(_compose(["tiling.loss_chunks=4096"]))  # raises in the parent: nothing spawned, nothing built
    with pytest.raises(ValueError, match=r"tiling\.mlp_tiles must be a positive number"):
        tiling_of(_compose(["tiling.mlp_tiles=-1"]))
    line = tiling_of(_compose(["tiling=auto", "tiling.loss_chunks=8", "model.seq_length=8192"]))
    assert line == ("mlp_tiles=auto: 2 tile(s) of <= 2048 tokens per rank; "
                    "loss_chunks=8: 8 chunk(s) of <= 512 tokens per rank")


APP = ["trainer.max_steps=3", "model.seq_length=1024", "optim.optimizer=sgd", "optim.lr=0.5", "optim.min_lr=0.05",
       "run.save_final_params=true", "run.timeout_s=240"]


def _app(out_dir, extra):
    import sys

    from app_runner import run_app

    code, out = run_app([sys.executable, "-m", "nemo_longctx.apps.train", f"output_dir={out_dir}", *APP, *extra], 300)
    assert code == 0, out[-4000:]
    return out


def test_app_tiled_run_matches_the_default_run(tmp_path):
    """The default job (cp=ring x 2) with tiling.mlp_tiles=3 (ragged: 512 tokens per rank) tiling.loss_chunks=8 vs
    without: same loss per step and same SGD parameters (the callback wiring under NeMo's DDP/Float16Module)."""
    import json

    tiled_out = _app(tmp_path / "tiled", ["tiling.mlp_tiles=3", "tiling.loss_chunks=8"])
    _app(tmp_path / "plain", [])
    assert ("nemo-longctx tiling: mlp_tiles=3: 3 tile(s) of <= 171 tokens per rank; loss_chunks=8: 8 chunk(s) of "
            "<= 64 tokens per rank (1 chunked GPT model(s) on this rank)") in tiled_out
    runs = {}
    for name in ("tiled", "plain"):
        metrics = [json.loads(line) for line in (tmp_path / name / "metrics.jsonl").read_text().splitlines()]
        runs[name] = ([m["loss"] for m in metrics], torch.load(tmp_path / name / "final_params.pt"))
    (lt, pt), (lp, pp) = runs["tiled"], runs["plain"]
    assert len(lt) == len(lp) == 3
    assert all(abs(a - b) <= 1e-6 * abs(b) for a, b in zip(lt, lp)), (lt, lp)
    assert sorted(pt["final"]) == sorted(pp["final"])
    for k, final in pp["final"].items():
        update = final.double() - pp["initial"][k].double()
        assert update.norm() > 0, k
        # the updates are read back from the stored fp32 weights, so one rounding flip of a stored weight moves an
        # update by an ulp of that weight: ~1e-5 of a norm weight's update (weights ~1, updates ~1e-3 per element);
        # measured on a CPU without AVX-512: <= 1 ulp on two norm weights, every other difference < 1.1e-6 relative
        diff = (pt["final"][k].double() - pt["initial"][k].double() - update).abs()
        ulp = torch.finfo(torch.float32).eps * final.double().abs()
        assert ((diff - ulp).clamp_min(0).norm() / update.norm()).item() < 2e-6, (k, (diff / ulp).max().item())
