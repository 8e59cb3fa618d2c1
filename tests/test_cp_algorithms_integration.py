"""cp=ulysses and cp=hybrid in the Megatron core-attention module and the Hydra app (real Megatron/NeMo objects, gloo).

* Parity: a 2-layer Llama-like Megatron GPTModel (local spec, GQA 8q/2kv, fp32) with our core attention is trained
  STEPS SGD steps on fixed data at cp=1 (the cp=none path: local attention) and, from the same initial parameters,
  with every CP setting below over Megatron's CP group; the batch is zigzag-sharded like the app's data step and the
  gradients are summed over the CP group before the update (what Megatron's DDP does over dp x cp). Per step: loss
  (all-reduced) and every parameter gradient equal cp=1's; after the steps every parameter equals cp=1's.
  2 ranks: ring (control), ulysses (head_chunks 1/2/4, regather_in_backward), hybrid 2x1 / 1x2 (with and without
  head chunks). 4 ranks: ulysses (KV heads replicated: 2 KV heads over 4 ranks), hybrid 2x2 (head_chunks 1, 2).
* The hybrid sub-groups are built once (at construction) and shared by all layers.
* The main job (Hydra app, NeMo trainer): ``nemo-longctx train cp=hybrid cp.size=2 cp.ulysses_size=2
  cp.head_chunks=2`` (the app spawns 2 processes; sub-groups built inside NeMo's model construction) vs
  ``python -m nemo_longctx.apps.train cp=none trainer.devices=1``: per-step loss and the SGD parameter updates agree.
* Errors naming the field, before any step or communication: core attention construction (heads vs
  cp.ulysses_size / cp.head_chunks) and app builds from Hydra overrides (cp.ulysses_size not dividing cp.size,
  hq % ulysses_size, head_chunks); dry runs of llama3_8b with cp=hybrid / cp=ulysses resolve our attention in every
  layer and carry the options.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest

from app_runner import run_app
from distributed import run_distributed

SEQ, VOCAB, STEPS, LAYERS, HEADS, GROUPS, LR = 256, 128, 4, 2, 8, 2, 0.5

SETTINGS_2 = {
    "ring": ("ring", {}),
    "ulysses": ("ulysses", {"head_chunks": 1}),
    "ulysses hc2": ("ulysses", {"head_chunks": 2}),
    "ulysses hc4": ("ulysses", {"head_chunks": 4}),
    "ulysses regather": ("ulysses", {"head_chunks": 2, "regather_in_backward": True}),
    "hybrid 2x1": ("hybrid", {"ulysses_size": 2, "head_chunks": 1}),
    "hybrid 2x1 hc2": ("hybrid", {"ulysses_size": 2, "head_chunks": 2}),
    "hybrid 1x2": ("hybrid", {"ulysses_size": 1, "head_chunks": 1}),
    "hybrid 1x2 hc2": ("hybrid", {"ulysses_size": 1, "head_chunks": 2}),
}
SETTINGS_4 = {
    "ulysses": ("ulysses", {"head_chunks": 1}),  # 2 KV heads over 4 ranks: each replicated twice
    "hybrid 2x2": ("hybrid", {"ulysses_size": 2, "head_chunks": 1}),
    "hybrid 2x2 hc2": ("hybrid", {"ulysses_size": 2, "head_chunks": 2}),
}


def _rel(a, b):
    return ((a.double() - b.double()).norm() / b.double().norm().clamp_min(1e-30)).item()


def _build(config, algorithm, kwargs, init=None):
    import torch
    from megatron.core.models.gpt import GPTModel
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec

    from nemo_longctx.integrations.megatron.spec import long_context_layer_spec

    spec = long_context_layer_spec(get_gpt_layer_local_spec(normalization="RMSNorm"), algorithm, **kwargs)
    model = GPTModel(config, spec, vocab_size=VOCAB, max_sequence_length=SEQ, position_embedding_type="rope",
                     share_embeddings_and_output_weights=False)
    if init is not None:
        with torch.no_grad():
            for name, p in model.named_parameters():
                p.copy_(init[name])
    return model


def _train(model, batches, group):
    """SGD steps; returns per-step losses (summed over CP), per-step full gradients, final parameters."""
    import torch
    import torch.distributed as dist
    from megatron.core import parallel_state as ps

    from nemo_longctx.integrations.megatron.batch import shard_batch_for_cp

    cp, cpr = ps.get_context_parallel_world_size(), ps.get_context_parallel_rank()
    model.train()
    losses, grads = [], []
    for full in batches:
        b = shard_batch_for_cp(dict(full), cp, cpr)
        token_loss = model(input_ids=b["tokens"], position_ids=b["position_ids"], attention_mask=None,
                           labels=b["labels"])
        loss = (token_loss.float() * b["loss_mask"]).sum() / full["loss_mask"].sum()
        loss.backward()
        total = loss.detach().clone()
        step_grads = {}
        for name, p in model.named_parameters():
            step_grads[name] = p.grad.detach().clone()
        if group is not None:
            dist.all_reduce(total, group=group)
            for g in step_grads.values():
                dist.all_reduce(g, group=group)
        losses.append(float(total))
        grads.append(step_grads)
        with torch.no_grad():
            for name, p in model.named_parameters():
                p.sub_(LR * step_grads[name])
                p.grad = None
    return losses, grads, {n: p.detach().clone() for n, p in model.named_parameters()}


def _compare(ref, got, init):
    (l0, g0, p0), (l1, g1, p1) = ref, got
    return {
        "losses": l1,
        "loss_err": max(abs(a - b) / abs(b) for a, b in zip(l1, l0)),
        "grad_err": max(_rel(g[n], h[n]) for g, h in zip(g1, g0) for n in h),
        "param_err": max(_rel(p1[n], p0[n]) for n in p0),  # parameters after the steps
        # the total update of each tensor (fp32 rounding of p - lr*g is ~1e-7 of |p|: larger relative to small updates)
        "update_err": max(_rel(p1[n] - init[n], p0[n] - init[n]) for n in p0),
        "n_params": len(p1),
    }


def _parity(rank, world, settings):
    import torch.distributed as dist

    from nemo_longctx.integrations.megatron import cpu_compat

    cpu_compat.apply()
    from megatron.core import parallel_state as ps
    from megatron.core import tensor_parallel

    from nemo_longctx.integrations.megatron.memory_probe import full_batches, tiny_gpt_config

    two = full_batches(2, SEQ, VOCAB, seed=7)
    batches = [two[i % 2] for i in range(STEPS)]  # alternating: the loss on a batch seen before must have fallen
    ps.initialize_model_parallel(context_parallel_size=1)
    tensor_parallel.model_parallel_cuda_manual_seed(11)
    cfg1 = tiny_gpt_config(num_layers=LAYERS, hidden_size=128, heads=HEADS, groups=GROUPS, cp=1)
    model = _build(cfg1, "ring", {})
    init = {n: p.detach().clone() for n, p in model.named_parameters()}
    ref = _train(model, batches, None)
    ps.destroy_model_parallel()

    out = {"cp1_losses": ref[0], "parity": {}}
    ps.initialize_model_parallel(context_parallel_size=world)
    group = ps.get_context_parallel_group()
    cfg = tiny_gpt_config(num_layers=LAYERS, hidden_size=128, heads=HEADS, groups=GROUPS, cp=world)
    for name, (algorithm, kwargs) in settings.items():
        model = _build(cfg, algorithm, kwargs, init)
        cores = [layer.self_attention.core_attention for layer in model.decoder.layers]
        out["parity"][name] = _compare(ref, _train(model, batches, group), init)
        out["parity"][name]["algorithms"] = sorted({c.algorithm.name for c in cores})
        if algorithm == "hybrid":  # sub-groups built once, shared by all layers, of the requested sizes
            ug, rg = cores[0].algorithm_kwargs["ulysses_group"], cores[0].algorithm_kwargs["ring_group"]
            out["parity"][name]["groups_shared"] = all(
                c.algorithm_kwargs["ulysses_group"] is ug and c.algorithm_kwargs["ring_group"] is rg for c in cores)
            out["parity"][name]["group_sizes"] = (ug.size(), rg.size())
            out["parity"][name]["group_ranks"] = (ps.get_context_parallel_rank(), dist.get_process_group_ranks(ug),
                                                  dist.get_process_group_ranks(rg))
    out["errors"] = _module_errors(world)
    ps.destroy_model_parallel()
    if rank == 0 and world == 2:
        out["app"] = _app_cases()
    return out


def _module_errors(world):
    """Core-attention construction with bad head/option combinations: ValueError before any communication."""
    from megatron.core.transformer.enums import AttnMaskType

    from nemo_longctx.integrations.megatron.core_attention import LongContextCoreAttention
    from nemo_longctx.integrations.megatron.memory_probe import tiny_gpt_config

    errors = {}
    cases = {
        "hybrid_hq": (dict(heads=3, groups=1), "hybrid", {"ulysses_size": 2, "head_chunks": 1}, "a2a+p2p"),
        "hybrid_size": (dict(heads=8, groups=2), "hybrid", {"ulysses_size": 3, "head_chunks": 1}, None),
        "ulysses_hq": (dict(heads=3, groups=1), "ulysses", {"head_chunks": 1}, "a2a"),
        "ulysses_chunks": (dict(heads=8, groups=2), "ulysses", {"head_chunks": 3}, None),
        "ulysses_option": (dict(heads=8, groups=2), "ulysses", {"head_chunks": 1, "ulysses_size": 2}, None),
        "ulysses_comm": (dict(heads=8, groups=2), "ulysses", {"head_chunks": 1}, "p2p"),
    }
    for key, (shape, algorithm, kwargs, comm) in cases.items():
        hidden = 96 if shape["heads"] == 3 else 128
        cfg = tiny_gpt_config(num_layers=LAYERS, hidden_size=hidden, cp=world, **shape)
        try:
            LongContextCoreAttention(cfg, 1, AttnMaskType.causal, "self", cp_comm_type=comm, cp_algorithm=algorithm,
                                     cp_algorithm_kwargs=kwargs)
            errors[key] = None
        except ValueError as e:
            errors[key] = str(e)
    return errors


def _compose(overrides):
    from app_runner import train_spec

    return train_spec(overrides)


def _app_cases():
    """Dry runs of llama3_8b with cp=hybrid / cp=ulysses, and app builds of bad configurations (one process)."""
    from nemo_longctx.apps.train import build, dry_run

    res = {}
    common = ["model=llama3_8b", "trainer.devices=8", "model.seq_length=131072", "run.dry_run=true", "data=synthetic"]
    for key, extra in {
        "hybrid": ["cp=hybrid", "cp.size=8", "cp.ulysses_size=4"],
        "hybrid_chunks": ["cp=hybrid", "cp.size=8", "cp.ulysses_size=2", "cp.head_chunks=4"],
        "ulysses": ["cp=ulysses", "cp.size=8", "cp.head_chunks=2"],
    }.items():
        cfg = _compose(common + extra)
        summary = dry_run(cfg)
        spec = build(cfg).model_config.transformer_layer_spec
        res[key] = (summary, spec.cp_algorithm, spec.algorithm_kwargs)

    bad = {
        "ulysses_size_divides": ["cp=hybrid", "cp.size=4", "cp.ulysses_size=3", "trainer.devices=4"],
        "hybrid_hq": ["cp=hybrid", "cp.size=2", "cp.ulysses_size=2", "model.num_attention_heads=3",
                      "model.num_query_groups=1", "model.hidden_size=192"],
        "ulysses_hq": ["cp=ulysses", "cp.size=4", "trainer.devices=4", "model.num_attention_heads=6",
                       "model.num_query_groups=2", "model.hidden_size=192"],
        "head_chunks": ["cp=ulysses", "cp.head_chunks=3"],
        "head_chunks_kv_group": ["cp=hybrid", "cp.size=2", "cp.ulysses_size=1", "model.num_attention_heads=12",
                                 "model.num_query_groups=2", "model.hidden_size=192", "cp.head_chunks=3"],
        "ulysses_tp": ["cp=ulysses", "cp.size=4", "trainer.devices=8", "trainer.strategy.tensor_model_parallel_size=2",
                       "model.num_attention_heads=8", "model.num_query_groups=2"],
    }
    errors = {}
    for key, overrides in bad.items():
        try:
            build(_compose(overrides))
            errors[key] = None
        except ValueError as e:
            errors[key] = str(e)
    res["errors"] = errors
    return res


@pytest.fixture(scope="module")
def results2():
    return run_distributed(_parity, 2, SETTINGS_2, timeout=400)


@pytest.fixture(scope="module")
def results4():
    return run_distributed(_parity, 4, SETTINGS_4, timeout=400)


def _show(results, cp):  # the parity numbers, shown with -s
    for name, r in results[0]["parity"].items():
        print(f"cp={cp} {name:18s} loss {r['loss_err']:.1e} grad {r['grad_err']:.1e} param {r['param_err']:.1e} "
              f"update {r['update_err']:.1e}")


def _check_parity(results, settings):
    for rank, res in enumerate(results):
        assert set(res["parity"]) == set(settings)
        l0 = res["cp1_losses"]
        assert 4.0 < l0[0] < 6.0 and l0[2] < l0[0] - 0.01 and l0[3] < l0[1] - 0.01, l0  # ~log(128), then learns
        for name, r in res["parity"].items():
            where = f"rank {rank} {name}"
            assert r["algorithms"] == [settings[name][0]], where
            assert len(r["losses"]) == STEPS and r["n_params"] >= 3 * LAYERS + 3, where
            assert r["loss_err"] <= 1e-5, (where, r["loss_err"], r["losses"], res["cp1_losses"])
            assert r["grad_err"] <= 1e-5, (where, r["grad_err"])
            assert r["param_err"] <= 1e-5, (where, r["param_err"])
            assert r["update_err"] <= 2e-4, (where, r["update_err"])  # a wrong gradient scale would give ~1


@pytest.mark.matrix  # the version-matrix smoke set (scripts/matrix_smoke.sh)
def test_ulysses_and_hybrid_match_cp1_on_2_ranks(results2):
    _show(results2, 2)
    _check_parity(results2, SETTINGS_2)


def test_ulysses_and_hybrid_match_cp1_on_4_ranks(results4):
    _show(results4, 4)
    _check_parity(results4, SETTINGS_4)


def test_hybrid_groups_built_once_with_the_requested_layout(results2, results4):
    for res in results2:
        assert res["parity"]["hybrid 2x1"]["group_sizes"] == (2, 1)
        assert res["parity"]["hybrid 1x2"]["group_sizes"] == (1, 2)
    for rank, res in enumerate(results4):
        for name in ("hybrid 2x2", "hybrid 2x2 hc2"):
            r = res["parity"][name]
            assert r["groups_shared"] and r["group_sizes"] == (2, 2)
            cp_rank, ulysses_ranks, ring_ranks = r["group_ranks"]
            # Ulysses over consecutive CP ranks, ring across them (the CP group is all 4 ranks here)
            assert ulysses_ranks == [cp_rank // 2 * 2, cp_rank // 2 * 2 + 1]
            assert ring_ranks == [cp_rank % 2, cp_rank % 2 + 2]
    assert all(r["parity"][n]["groups_shared"] for r in results2 for n in SETTINGS_2 if n.startswith("hybrid"))


def test_core_attention_construction_errors_name_the_field(results2, results4):
    for res in results2 + results4:
        e = res["errors"]
        assert e["hybrid_hq"].startswith("cp.ulysses_size=") and "hq % ulysses_size != 0" in e["hybrid_hq"]
        assert "model.num_attention_heads=3" in e["hybrid_hq"]
        assert "cp.ulysses_size=3 must be a positive divisor of cp.size=" in e["hybrid_size"]
        assert e["ulysses_hq"].startswith("cp.size=") and "hq % ulysses_size != 0" in e["ulysses_hq"]
        assert e["ulysses_chunks"].startswith("cp.head_chunks=3")
        assert "must divide the query heads" in e["ulysses_chunks"]
        assert "unknown options ['ulysses_size']" in e["ulysses_option"]
        assert "cp_comm_type='p2p'" in e["ulysses_comm"] and "cp.algorithm='ulysses'" in e["ulysses_comm"]


def test_dry_run_llama3_8b_hybrid_and_ulysses_use_our_attention_everywhere(results2):
    app = results2[0]["app"]
    for key, (algo, kwargs) in {"hybrid": ("hybrid", {"ulysses_size": 4, "head_chunks": 1}),
                                "hybrid_chunks": ("hybrid", {"ulysses_size": 2, "head_chunks": 4}),
                                "ulysses": ("ulysses", {"head_chunks": 2})}.items():
        summary, spec_algo, spec_kwargs = app[key]
        assert summary["core_attention"] == "32/32 layers LongContextCoreAttention", key
        assert summary["cp"] == f"{algo} x 8" and summary["context_parallel_size_on_config"] == 8, key
        assert summary["tokens_per_cp_rank"] == 16384, key
        assert (spec_algo, spec_kwargs) == (algo, kwargs), key


def test_bad_app_configs_fail_before_step_zero_naming_the_field(results2):
    e = results2[0]["app"]["errors"]
    print("\n".join(f"{k}: {v}" for k, v in e.items()))
    assert "cp.ulysses_size=3 must be a positive divisor of cp.size=4" in e["ulysses_size_divides"]
    assert "cp.ulysses_size=2: cp=hybrid: hq % ulysses_size != 0" in e["hybrid_hq"]
    assert "model.num_attention_heads=3" in e["hybrid_hq"]
    assert "cp.size=4: cp=ulysses: hq % ulysses_size != 0" in e["ulysses_hq"]
    assert "cp.head_chunks=3" in e["head_chunks"] and "must divide the query heads per rank" in e["head_chunks"]
    assert "cp.head_chunks=3" in e["head_chunks_kv_group"] and "KV group" in e["head_chunks_kv_group"]
    # heads per TP rank: 8 / tp 2 = 4 query heads over cp.size=4 is fine; 2 KV heads / tp 2 = 1 is replicated
    assert e["ulysses_tp"] is None


# ------------------------------------------------------------------------------------------------ main job
ROOT = Path(__file__).resolve().parents[1]
BIN = Path(sys.executable).parent
APP_STEPS = 4
APP_COMMON = [f"trainer.max_steps={APP_STEPS}", "model.seq_length=1024", "optim.optimizer=sgd", "optim.lr=0.5",
              "optim.min_lr=0.05", "run.save_final_params=true", "run.timeout_s=300"]


def _run_app(cmd, timeout=400):
    return run_app(cmd, timeout)


@pytest.fixture(scope="module")
def app_runs(tmp_path_factory):
    base = tmp_path_factory.mktemp("cp_app")
    hybrid, none = base / "hybrid", base / "none"
    code, out = _run_app([str(BIN / "nemo-longctx"), "train", f"output_dir={hybrid}", "cp=hybrid", "cp.size=2",
                          "cp.ulysses_size=2", "cp.head_chunks=2", *APP_COMMON])
    assert code == 0, out[-4000:]
    code_n, out_n = _run_app([sys.executable, "-m", "nemo_longctx.apps.train", f"output_dir={none}", "cp=none",
                              "trainer.devices=1", *APP_COMMON])
    assert code_n == 0, out_n[-4000:]
    return hybrid, none, out


def test_main_job_hybrid_matches_cp_none(app_runs):
    import torch

    hybrid, none, out = app_runs
    assert "cp=hybrid x 2, world 2" in out
    mh, mn = ([json.loads(line) for line in (d / "metrics.jsonl").read_text().splitlines()] for d in (hybrid, none))
    assert len(mh) == len(mn) == APP_STEPS and mh[0]["cp_size"] == 2 and mn[0]["cp_size"] == 1
    for a, b in zip(mn, mh):
        assert abs(a["loss"] - b["loss"]) <= 1e-5 * abs(a["loss"]), (a, b)
    a, b = (torch.load(d / "final_params.pt") for d in (none, hybrid))
    assert a["final"].keys() == b["final"].keys() and len(a["final"]) > 10
    for name in a["final"]:
        assert torch.equal(a["initial"][name], b["initial"][name]), name
        da, db = a["final"][name] - a["initial"][name], b["final"][name] - b["initial"][name]
        assert da.norm() > 0 and (da - db).norm() <= 1e-4 * da.norm(), (name, ((da - db).norm() / da.norm()).item())


def test_cp_options_fail_before_any_spawn():
    from nemo_longctx.integrations.megatron.cp_algorithms import check_cp_options

    def error(*args):
        try:
            check_cp_options(*args)
        except ValueError as e:
            return str(e)
        return None

    assert "cp.ulysses_size=3 must be a positive divisor of cp.size=4" in error("hybrid", 4, {"ulysses_size": 3})
    assert "cp.ulysses_size=None" in error("hybrid", 4, {"head_chunks": 1})
    assert "cp.head_chunks=0 must be a positive int" in error("ulysses", 2, {"head_chunks": 0})
    assert "unknown options ['ulysses_size']" in error("ulysses", 2, {"ulysses_size": 2})
    assert "cp.algorithm='bogus'" in error("bogus", 2, {})
    assert error("hybrid", 8, {"ulysses_size": 4, "head_chunks": 2, "regather_in_backward": True}) is None
    assert error("ulysses", 8, {"head_chunks": 4, "kernel": "math"}) is None
    # the app refuses before spawning its processes
    code, out = _run_app([str(BIN / "nemo-longctx"), "train", "cp=hybrid", "cp.ulysses_size=3"], timeout=120)
    assert code != 0 and "cp.ulysses_size=3 must be a positive divisor of cp.size=4" in out
    assert "spawning" not in out
