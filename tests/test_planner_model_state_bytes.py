"""The planner's model-state bytes (`planner.model_state_bytes`) against what Megatron actually holds.

Each row reads a run of tests/model_state_runs.py (shared with tests/test_model_state.py: two gloo ranks, cp=ring
cp.size=2, so the distributed optimizer shards over S = dp x cp = 2) of a tiny GQA Llama with odd widths (hidden 200,
4 query heads / 2 KV groups, ffn 520, vocab 1000: no parameter is a multiple of 64 elements, so the distributed
optimizer's buffer padding shows).
The app's ModelStateCheck writes each rank's bytes (`nemo_longctx.integrations.megatron.state_bytes`, every storage
counted once, after the first optimizer step) to ``model_state_bytes.rank<R>.json``; the prediction is
`model_state_bytes` for the app's own model shape (`shape_from_config` of the composed ``model`` group).

Compared, per row (all exact, in bytes):
  weights, grads     each rank == predicted + the padding Megatron's DDP buffers report; that padding is 0 under DDP
                     and, under the distributed optimizer, < 64 elements per parameter tensor + lcm(S, 128) per
                     bucket (each parameter starts on a multiple of 64 elements, each bucket ends on one of
                     lcm(S, 128)); the planner does not count it (a few hundred KB at most for Llama-3-8B)
  device optimizer   fp32 master + Adam moments: sum over ranks == S x predicted (the ranks' shards differ by the
                     padding between parameters); DDP: each rank == predicted
  host optimizer     HybridDeviceOptimizer's fp32 master copies + grad copies + moments: sum == S x predicted
  0 < f < 1          Megatron offloads whole shard pieces until at least f of the shard is on the host: exact against
                     the planner at the realized fraction (its model is linear in f between its f=0 and f=1 values);
                     against the planner at the asked f: device <= predicted, host <= predicted (the planner counts
                     the host at f + one largest parameter tensor)
  per rank           the rules behind the planner's constants: master = 4 B x shard elements (0 with fp32 weights:
                     they are the master), device moments = 8 B x device-optimizer elements, host = (4 + 4 + 8) B x
                     host-optimizer elements
Not modelled: Adam's ``step`` scalars (4 bytes per optimizer tensor, "other" in the JSON).

The precision-aware optimizer (with optimizer offload 1.0, as it runs without TE) keeps no fp32 master on the device
and bf16 main grads. A new option is one line in ROWS (the run, the planner's ModelState, its Precision). Not here:
the precision-aware optimizer at 0 < f < 1 (state_bytes does not yet count its device part's fp32 copies and their
fp32 grads).

Megatron-FSDP (its own test below): the sharded bf16 weights, fp32 master and fp32 grads (P/S elements each, plus the
flat buffers' padding) and the Adam moments of the shard (exact), and the gathered weight units (the planner's
2 layers + the non-layer parameters = the whole 2-layer model here: Megatron-FSDP has prefetched the next step's
all-gathers when the bytes are taken); the gathered gradient units are a backward transient, freed after their
reduce-scatter, so the measured grads are the planner's less that unit.
"""

from __future__ import annotations

import json
import math

import pytest

import model_state_runs
from model_state_runs import COMMON
from nemo_longctx.planner.model_shapes import shape_from_config
from nemo_longctx.planner.search import Candidate, ModelState, Precision, largest_parameter_tensor, model_state_bytes

BF16 = Precision()  # bf16 weights, fp32 main grads (grad_reduce_in_fp32), fp32 master + Adam moments
FP32 = Precision(activation_bytes=4, param_bytes=4)  # trainer.precision=32: the weights are the master
ROWS = {  # name: (run in model_state_runs.RUNS, planner ModelState, planner Precision)
    "ddp_bf16": ("ddp", ModelState("ddp"), BF16),
    "distributed_fp32": ("distributed_fp32", ModelState("distributed"), FP32),
    "offload_1.0_bf16": ("cpu_offload", ModelState("distributed", 1.0), BF16),
    "offload_0.5_bf16": ("cpu_offload_half_rc", ModelState("distributed", 0.5), BF16),
    "precision_aware_offload_1.0": ("precision_aware", ModelState("distributed", 1.0, True), BF16),
}


def _compose(overrides):
    from app_runner import train_config

    return train_config(overrides)


def _planned(run, ms, precision=BF16):
    """The planner's per-GPU bytes for a run's model shape and parallel layout with model state ``ms``:
    (bytes, shape, S = dp x cp)."""
    from omegaconf import OmegaConf

    cfg = _compose(COMMON + model_state_runs.RUNS[run][0])
    shape = shape_from_config(OmegaConf.to_container(cfg.model, resolve=True))
    tp, cp = int(cfg.trainer.strategy.tensor_model_parallel_size), int(cfg.cp.size)
    dp = int(cfg.trainer.devices) // (tp * cp)
    cand = Candidate(cp_algorithm=str(cfg.cp.algorithm), cp_size=cp, tp=tp, model_state=ms)
    return model_state_bytes(shape, cand, dp, precision), shape, dp * cp


def _predicted(name, f=None):
    """The planner's per-GPU bytes for the row (``f``: another offload fraction)."""
    run, ms, precision = ROWS[name]
    if f is not None:
        ms = ModelState(ms.sharding, f, ms.precision_aware)
    return _planned(run, ms, precision)


def _rank_bytes(run, tmp_path_factory):
    """Each rank's measured bytes (model_state_bytes.rank<R>.json) of a run, by rank."""
    out = model_state_runs.trained(run, tmp_path_factory)["dir"]
    files = sorted(out.glob("model_state_bytes.rank*.json"))
    ranks = [json.loads(p.read_text()) for p in files]
    assert len(ranks) == 2 and all("error" not in r for r in ranks), (files, ranks)
    return sorted(ranks, key=lambda r: r["rank"])


SLOW_ROWS = {"distributed_fp32", "offload_0.5_bf16"}  # runs that only the full suite trains (model_state_runs)


@pytest.mark.parametrize("name", [pytest.param(n, marks=pytest.mark.slow) if n in SLOW_ROWS else n for n in ROWS])
def test_model_state_bytes_match_megatron(name, tmp_path_factory):
    ranks = _rank_bytes(ROWS[name][0], tmp_path_factory)
    _, ms, precision = ROWS[name]
    pred, shape, S = _predicted(name)
    P = shape.parameters()
    sharded = ms.sharding != "ddp"
    assert len(ranks) == S and all(r["numel"]["params"] == P for r in ranks)  # the planner's parameter count

    # weights and grads: replicated, Megatron's buffers padded
    for r in ranks:
        d, pad = r["device"], r["padding"]
        assert d["weights"] - pad["weights"] == pred["weights"], (name, r)
        assert d["grads"] - pad["grads"] == pred["grads"], (name, r)
        pad_elems = pad["grads"] // (2 if ms.precision_aware else precision.grad_bytes)
        if sharded:
            bound = 63 * r["numel"]["param_tensors"] + (math.lcm(S, 128) - 1) * r["numel"]["buckets"]
            assert pad_elems <= bound and pad["weights"] == pad_elems * precision.param_bytes, (name, pad, bound)
        else:
            assert pad_elems == 0 and pad["weights"] == 0, (name, pad)

    # the optimizer's elements: every parameter exactly once over the shards (DDP: all of them on every rank)
    n_dev = [r["numel"]["optimizer_device"] for r in ranks]
    n_host = [r["numel"]["optimizer_host"] for r in ranks]
    shard = [a + b for a, b in zip(n_dev, n_host)]
    assert (sum(shard) == P) if sharded else all(n == P for n in shard), (name, shard)

    # per rank: the byte rules behind the planner's constants (precision-aware: the master lives on the host only)
    master = 4 if precision.param_bytes < 4 and not ms.precision_aware else 0
    for r, nd, nh, n in zip(ranks, n_dev, n_host, shard):
        d, h = r["device"], r["host"]
        assert d["main_params"] == master * n and d["moments"] == 8 * nd, (name, r)
        assert h["main_params"] == 4 * nh and h["grads"] == 4 * nh and h["moments"] == 8 * nh, (name, r)

    # device / host optimizer bytes against the planner
    dev = [r["device"]["main_params"] + r["device"]["moments"] for r in ranks]
    host = [r["host"]["main_params"] + r["host"]["grads"] + r["host"]["moments"] for r in ranks]
    f_real = sum(n_host) / sum(shard)
    f = float(ms.optimizer_offload)
    if f in (0.0, 1.0):
        assert f_real == f, (name, n_host, shard)
    else:  # whole shard pieces move until >= f: at least f, and less than one more largest tensor per rank
        assert f <= f_real < f + S * largest_parameter_tensor(shape) / P, (name, n_host, shard)
    p0, p1 = _predicted(name, 0.0)[0], _predicted(name, 1.0)[0]
    exact_dev = (1 - f_real) * p0["optimizer"] + f_real * p1["optimizer"]
    exact_host = f_real * p1["host"]
    if sharded:
        assert sum(dev) == pytest.approx(S * exact_dev, abs=0.5) and sum(host) == pytest.approx(S * exact_host,
                                                                                                abs=0.5), name
        assert sum(dev) <= S * pred["optimizer"] + 0.5 and sum(host) <= S * pred["host"] + 0.5, name
    else:
        assert all(x == pytest.approx(exact_dev, abs=0.5) for x in dev) and all(x == 0 for x in host), name
        assert exact_dev == pred["optimizer"]
    if f in (0.0, 1.0):
        assert exact_dev == pytest.approx(pred["optimizer"]) and exact_host == pytest.approx(pred["host"])

    mean = lambda xs: sum(xs) / len(xs)  # noqa: E731
    print(f"\n{name} (S={S}, f_real={f_real:.4f}) per rank, measured (mean over ranks) vs predicted:"
          f"\n  weights {mean([r['device']['weights'] for r in ranks]):.0f} vs {pred['weights']:.0f}"
          f"\n  grads {mean([r['device']['grads'] for r in ranks]):.0f} vs {pred['grads']:.0f}"
          f" (padding {mean([r['padding']['weights'] + r['padding']['grads'] for r in ranks]):.0f})"
          f"\n  device optimizer {mean(dev):.0f} vs {pred['optimizer']:.0f} (at f_real {exact_dev:.0f})"
          f"\n  host optimizer {mean(host):.0f} vs {pred['host']:.0f} (at f_real {exact_host:.0f})"
          f"\n  other (Adam step scalars) {mean([r['device']['other'] + r['host']['other'] for r in ranks]):.0f}")


def test_megatron_fsdp_state_bytes_match_the_planner(tmp_path_factory):
    ranks = _rank_bytes("fsdp_rc", tmp_path_factory)
    pred, shape, S = _planned("fsdp_rc", ModelState("fsdp"))
    P = shape.parameters()
    unit = 2 * shape.layer_parameters() + (P - shape.num_layers * shape.layer_parameters())
    assert unit == P and S == 2  # 2 layers: the gathered unit is the whole model
    pad = 0.01  # Megatron-FSDP's flat buffers: each shard padded (measured 0.7% here)
    rows = []
    for r in ranks:
        d, h = r["device"], r["host"]
        assert r["numel"]["params"] == P and sum(h.values()) == 0, r
        assert pred["weights"] <= d["weights"] <= pred["weights"] * (1 + pad), (d, pred)  # shard + gathered unit
        grads_shard = pred["grads"] - 4 * unit  # fp32 shard; the unit's fp32 grads are a backward transient
        assert grads_shard <= d["grads"] <= grads_shard * (1 + pad) and d["main_params"] == d["grads"], (d, pred)
        assert d["moments"] == 8 * r["numel"]["optimizer_device"], r  # fp32 exp_avg + exp_avg_sq of the shard
        rows.append((d["weights"], d["grads"], d["main_params"] + d["moments"]))
    assert sum(r["numel"]["optimizer_device"] for r in ranks) == P  # every parameter stepped once over the shards
    opt = sum(x[2] for x in rows)
    assert S * pred["optimizer"] <= opt <= S * pred["optimizer"] * (1 + pad), (opt, pred)
    print(f"\nfsdp per rank (S={S}): weights {[x[0] for x in rows]} vs {pred['weights']:.0f}; grads "
          f"{[x[1] for x in rows]} vs {pred['grads'] - 4 * unit:.0f} (+ a {4 * unit} B backward unit); optimizer "
          f"{[x[2] for x in rows]} (sum {opt}) vs {pred['optimizer']:.0f} per rank")

