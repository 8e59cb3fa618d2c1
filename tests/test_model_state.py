"""Model-state options of the ``optim`` group, trained by the app on CPU (gloo) against plain DDP.

Marked ``slow`` (the full suite runs them, CI does not; ``model_state_runs.SLOW_RUNS``): the fraction-0.5 offload
variants and the fp32 distributed-optimizer pair. The runs of tests/model_state_runs.py (tiny GQA Llama with odd
widths, cp=ring cp.size=2 on two gloo processes, so the distributed optimizer shards over the data-parallel-with-CP
group of 2), 6 steps at seq 2048, Adam,
``trainer.precision=bf16-mixed`` unless noted (optimizer CPU offload needs 16-bit weights, see
``model_state_problems``). CPU offload and the precision-aware optimizer run once plain and once with
``recompute=full offload=layer_input``; the distributed optimizer and Megatron-FSDP with recompute/offload (their
plain paths: the fp32 run below, and the earlier measurements quoted); each is compared with the DDP run of the same
recompute/offload:

  option                                     tolerance on every step's loss (relative)
  optim=distributed                          1e-4: the same fp32 Adam math on shards, but the gradient norm for
                                             clipping is summed over the shards in another order (fp32), which can
                                             flip a bf16 rounding of a weight; measured 1.04e-5
  optim=cpu_offload (fraction 1.0 and 0.5)   1e-4: as above, plus torch's fused CPU AdamW on the host copies
                                             instead of the foreach AdamW (another fp32 rounding order); measured
                                             1.04e-5
  optim=precision_aware with                 1e-4: Megatron's precision-aware path (no device fp32 main params, grads
    optim.optimizer_cpu_offload=true         handed over as .decoupled_grad) in its HybridDeviceOptimizer: fp32 master
    optim.exp_avg_dtype=fp32                 copies and fp32 moments (with main_grads_dtype=fp32 the losses equal
    optim.exp_avg_sq_dtype=fp32              cpu_offload's bit for bit); main_grads_dtype=bf16: the DDP grad buffers
    optim.main_grads_dtype=bf16              and their reduction over the 2 ranks are bf16. Each rank accumulates one
    (fraction 1.0; 0.5 with recompute/       micro-batch per step, so the error is the bf16 sum of 2 partial
    offload)                                 gradients and the clip norm taken from bf16 grads; measured 1.46e-5 vs
                                             DDP (earlier shape: 1.0e-5, 9.6e-6 vs cpu_offload; fraction 0.5 with
                                             recompute/offload gives the same losses), 1.3e-5 with 4 micro-batches
                                             accumulated in bf16
                                             (trainer.global_batch_size=4, not in the test). Not vacuous: the losses
                                             differ from cpu_offload's (bf16 grads live), and the bound is 230x below
                                             the median step-to-step loss change (a lost or doubled update fails)

  optim=fsdp                                 1e-4: Megatron-FSDP (ZeRO-3, DTensor shards over the CP group of 2,
                                             gloo all-gather / reduce-scatter; cpu_compat_fsdp.py): the fp32 Adam
                                             math of the distributed optimizer on its shards, gradients reduce-
                                             scattered in fp32 (scaled by 1/2 before the sum), the gradient norm
                                             summed over shards: the same bf16 rounding flips as above; measured
                                             9.6e-6 (plain and with recompute/offload); at trainer.precision=32 its
                                             losses equal DDP's bit for bit (5 runs, not in the test)

  optim=distributed, trainer.precision=32    1e-5: fp32 weights, nothing rounds to bf16; measured 0

The precision-aware optimizer without optimizer offload (TE's FusedAdam, a CUDA kernel) cannot run on CPU: it is
refused there, with the field named, before any process starts (tested below); a GPU session must train it. With
optimizer offload it trains here (above) through Megatron's own HybridDeviceOptimizer; the only CPU patch it adds to
optim=cpu_offload's is cpu_compat fix 14 (OptimizerConfig's TE version check answered without TE).
"""

from __future__ import annotations

import pytest

import model_state_runs
from model_state_runs import PA, RUNS, SLOW_RUNS, STEPS


class _Runs(dict):
    """name -> (losses, log), trained on first use (tests/model_state_runs.py: shared with the bytes test)."""

    def __init__(self, tmp_path_factory):
        super().__init__()
        self._factory = tmp_path_factory

    def __missing__(self, name):
        run = model_state_runs.trained(name, self._factory)
        self[name] = (run["losses"], run["log"])
        return self[name]


@pytest.fixture(scope="module")
def trained(tmp_path_factory):
    return _Runs(tmp_path_factory)


@pytest.mark.parametrize("name", [pytest.param(n, marks=pytest.mark.slow) if n in SLOW_RUNS else n
                                  for n, v in RUNS.items() if v[1] is not None])
def test_option_trains_with_the_losses_of_plain_ddp(trained, name):
    _, baseline, rtol = RUNS[name]
    losses, log = trained[name]
    ref, _ = trained[baseline]
    assert len(losses) == len(ref) == STEPS
    rel = max(abs(a - b) / abs(b) for a, b in zip(losses, ref))
    print(f"{name} vs {baseline}: max relative loss error {rel:.2e} (tolerance {rtol:g})")
    assert rel <= rtol, (name, losses, ref)
    assert ref[-1] < ref[0]  # it trains


def test_the_built_optimizer_is_the_configured_one(trained):
    """ModelStateCheck's line: what Megatron actually built (not what was asked)."""
    assert "model state: ddp | optimizer Float16OptimizerWithFloat16Params" in trained["ddp"][1]
    assert "model state: distributed_optimizer | optimizer DistributedOptimizer" in trained["distributed_rc"][1]
    line = [x for x in trained["cpu_offload"][1].splitlines() if x.startswith("model state:")][0]
    assert "optimizer_cpu_offload(1)" in line and "host Adam for" in line
    host, total = [int(x) for x in line.split("host Adam for ")[1].split(" parameters")[0].split(" of ")]
    assert host == total > 0  # fraction 1.0: every parameter of the shard on the host


@pytest.mark.slow
def test_offload_fraction_half_puts_whole_tensors_on_the_host_until_half(trained):
    line = [x for x in trained["cpu_offload_half_rc"][1].splitlines() if x.startswith("model state:")][0]
    host, total = [int(x) for x in line.split("host Adam for ")[1].split(" parameters")[0].split(" of ")]
    assert 0.5 * total <= host < total  # whole tensors until the fraction is reached


def test_precision_aware_is_megatrons_path_with_bf16_main_grads(trained):
    """ModelStateCheck (model_state.check_optimizer_layout) checked on every rank before step 0 that Megatron's
    precision-aware flag is live (use_precision_aware_optimizer_no_fp8_or_ds_fp8: no fp32 main param shards on the
    device, grads as .decoupled_grad), that the DDP grad buffers are bf16 with grad_reduce_in_fp32 off, and that the
    HybridDeviceOptimizer steps fp32 master copies; its line says so."""
    _check_precision_aware_line(trained, "precision_aware", 1.0)
    # not vacuous: bf16 main grads change the losses (with fp32 main grads this path equals cpu_offload bit for bit),
    # and the tolerance is far below what one lost or repeated update moves the loss
    assert trained["precision_aware"][0] != trained["cpu_offload"][0]
    ref = trained["ddp"][0]
    steps = sorted(abs(b - a) / abs(a) for a, b in zip(ref, ref[1:]))
    assert steps[len(steps) // 2] > 10 * RUNS["precision_aware"][2]  # median step (one step may sit on a plateau)


def _check_precision_aware_line(trained, name, frac):
    line = [x for x in trained[name][1].splitlines() if x.startswith("model state:")][0]
    assert "precision_aware(grads=bf16,params=fp32,m=fp32,v=fp32)" in line, line
    assert "| optimizer DistributedOptimizer |" in line and "| main grads bf16 |" in line, line
    assert "precision-aware live: decoupled grads, no device main params, master fp32" in line, line
    host, total = [int(x) for x in line.split("host Adam for ")[1].split(" parameters")[0].split(" of ")]
    assert (host == total > 0) if frac == 1.0 else (0.5 * total <= host < total), line


@pytest.mark.slow
def test_precision_aware_with_half_offload_and_recompute_is_megatrons_path(trained):
    _check_precision_aware_line(trained, "precision_aware_half_rc", 0.5)


@pytest.mark.parametrize("name", ["fsdp_rc"])
def test_megatron_fsdp_really_shards_the_model(trained, name):
    """ModelStateCheck (model_state.check_fsdp_layout) ran on every rank before step 0: the model is wrapped in
    Megatron-FSDP's FullyShardedDataParallel, every parameter is a DTensor on a CPU (gloo) mesh, its weight, fp32
    master-weight and main-grad buffers are sharded, and each rank holds about half of the elements."""
    line = [x for x in trained[name][1].splitlines() if x.startswith("model state:")][0]
    assert line.startswith("model state: megatron_fsdp | optimizer DistributedOptimizer | Megatron-FSDP: "), line
    assert " DTensor params on a cpu mesh, " in line and " over 2 shards, all-gathers synchronous (gloo)" in line, line
    local, total = [int(x) for x in line.split("this rank holds ")[1].split(" elements")[0].split(" of ")]
    assert total > 1_000_000 and abs(2 * local - total) <= 0.01 * total, line  # half, up to bucket padding


def test_the_megatron_fsdp_check_fails_on_what_is_not_sharded():
    """check_fsdp_layout is not vacuous: a model not wrapped, plain (non-DTensor) parameters, a buffer held whole or
    a rank holding everything each fail; Megatron-FSDP without optim.megatron_fsdp fails too."""
    from nemo_longctx.integrations.megatron.model_state import ModelStateOptions, check_fsdp_layout

    fsdp = ModelStateOptions(use_distributed_optimizer=True, megatron_fsdp=True)
    good = {"fsdp": True, "fsdp_params": 15, "fsdp_dtensor_params": 15, "fsdp_total_numel": 1639680,
            "fsdp_local_numel": 820480, "fsdp_shards": 2, "fsdp_mesh": ["cpu"], "fsdp_unsharded_buffers": []}
    assert "this rank holds 820480 of 1639680 elements over 2 shards" in check_fsdp_layout(fsdp, good)
    for bad, msg in (({"fsdp": False}, "not wrapped in Megatron-FSDP"),
                     ({"fsdp_dtensor_params": 14}, "1 of 15 parameters are not DTensors"),
                     ({"fsdp_unsharded_buffers": ["group 0 main_grad_buffer"]}, "keeps whole"),
                     ({"fsdp_local_numel": 1639680}, "this rank holds 1639680 of 1639680"),
                     ({"fsdp_gather_sync_required": True, "fsdp_gather_sync": False}, "asynchronous parameter")):
        with pytest.raises(RuntimeError, match=msg):
            check_fsdp_layout(fsdp, {**good, **bad})
    with pytest.raises(RuntimeError, match="optim.megatron_fsdp=False but the model is wrapped"):
        check_fsdp_layout(ModelStateOptions(use_distributed_optimizer=True), good)
    assert check_fsdp_layout(ModelStateOptions(), {**good, "fsdp": False}) == ""


def _compose(overrides):
    from app_runner import train_config

    return train_config(overrides)


def _spec(overrides):
    from app_runner import train_spec

    return train_spec(overrides)


def test_refused_combinations_name_their_fields():
    """The app's one validation pass (config_problems) refuses them before any process starts."""
    from nemo_longctx.integrations.nemo.app import config_problems

    def problems(*o):
        return "\n".join(config_problems(_spec(list(o))))

    assert config_problems(_spec(["optim=distributed"])) == []
    p = problems("optim=default", "optim.megatron_fsdp=true")
    assert "optim.megatron_fsdp=true needs optim.use_distributed_optimizer=true" in p
    p = problems("optim=cpu_offload")  # default precision "32"
    assert "optim.optimizer_cpu_offload=true needs trainer.precision=bf16-mixed" in p
    p = problems("optim=cpu_offload", "trainer.precision=bf16-mixed", "optim.use_distributed_optimizer=false")
    assert "optim.optimizer_cpu_offload=true needs optim.use_distributed_optimizer=true" in p
    p = problems("optim=cpu_offload", "trainer.precision=bf16-mixed", "optim.optimizer_offload_fraction=1.5")
    assert "optim.optimizer_offload_fraction=1.5 must be a number in [0, 1]" in p
    p = problems("optim=default", "optim.exp_avg_dtype=bf16")
    assert "optim.exp_avg_dtype=bf16 needs optim.use_precision_aware_optimizer=true" in p
    # Megatron-FSDP saves at bf16-mixed (test_megatron_fsdp_resume_equals_the_uninterrupted_run), not with fp32 weights
    p = problems("optim=fsdp", "checkpoint.every_n_steps=5")  # default precision "32"
    assert "optim.megatron_fsdp=true with checkpoint.every_n_steps > 0 and trainer.precision=32" in p
    assert config_problems(_spec(["optim=fsdp", "checkpoint.every_n_steps=5", "trainer.precision=bf16-mixed"])) == []
    p = problems("optim=fsdp", "optim.optimizer_cpu_offload=true")
    assert "optim.megatron_fsdp=true with optim.optimizer_cpu_offload=true" in p
    p = problems("optim=default", "+optim.bogus=1")  # Hydra refuses it without the +
    assert "optim: unknown key(s) ['bogus']" in p


def test_cpu_only_refusals():
    """What cannot run without CUDA is refused on CPU only (validation.model_state_cpu_problems)."""
    import torch

    from nemo_longctx.integrations.megatron.model_state import model_state_options, model_state_problems
    from nemo_longctx.integrations.nemo.app import config_problems

    if torch.cuda.is_available():
        pytest.skip("CPU-only refusals")
    assert config_problems(_spec(["optim=fsdp"])) == []  # Megatron-FSDP trains on CPU (cpu_compat_fsdp.py)
    p = "\n".join(config_problems(_spec(["optim=precision_aware", "trainer.precision=bf16-mixed"])))
    assert "optim.use_precision_aware_optimizer=true runs TransformerEngine's FusedAdam, a CUDA kernel" in p
    # with optimizer offload it runs in Megatron's HybridDeviceOptimizer (trained above) ...
    assert config_problems(_spec([*PA, "trainer.precision=bf16-mixed"])) == []
    # ... which keeps fp32 master weights and fp32 moments: lower dtypes for them are refused on every target
    p = "\n".join(config_problems(_spec(["optim=precision_aware", "optim.optimizer_cpu_offload=true",
                                             "optim.main_params_dtype=fp16", "trainer.precision=bf16-mixed"])))
    for f in ("exp_avg_dtype=bf16", "exp_avg_sq_dtype=bf16", "main_params_dtype=fp16"):
        assert f"optim.{f} with optim.optimizer_cpu_offload=true: Megatron's HybridDeviceOptimizer keeps fp32" in p
    # without TE/Apex the distributed optimizer's torch AdamW keeps a per-parameter 'step' that Megatron's checkpoint
    # formats do not handle (saving asserts; resuming asserts on the empty state): refused with checkpointing
    for o in (["optim=distributed"], [*PA, "trainer.precision=bf16-mixed"]):
        p = "\n".join(config_problems(_spec([*o, "checkpoint.every_n_steps=2"])))
        assert "optim.use_distributed_optimizer=true with checkpoint.every_n_steps > 0: without TransformerEngine" in p
    # for a GPU node with TransformerEngine (the planner's target) the same options are valid
    for o in ("fsdp", "precision_aware"):
        opts = model_state_options(dict(_compose([f"optim={o}"]).optim))
        assert model_state_problems(opts, precision="bf16-mixed", te_available=True, target_cuda=True) == []


def test_megatron_fsdp_is_wired_the_way_nemo_recipes_do_it():
    """The strategy the app builds for optim=fsdp is NeMo's MegatronStrategy with fsdp="megatron" and Megatron-FSDP's
    DDP config (ZeRO-3 sharding), and the optimizer config shards too (trained above: fsdp, fsdp_rc)."""
    from nemo_longctx.integrations.megatron.model_state import model_state_options, optimizer_config
    from nemo_longctx.integrations.nemo.strategy import LongContextStrategy, strategy_kwargs

    opts = model_state_options(dict(_compose(["optim=fsdp"]).optim))
    s = LongContextStrategy(context_parallel_size=2, **strategy_kwargs(opts))
    assert s._fsdp == "megatron" and s.save_ckpt_format == "fsdp_dtensor"
    assert s.ddp_config.use_megatron_fsdp and s.ddp_config.data_parallel_sharding_strategy == "optim_grads_params"
    assert s.ddp_config.use_distributed_optimizer
    oc = optimizer_config(opts, lr=1e-3, weight_decay=0.0, clip_grad=1.0, adam_beta2=0.95, precision="bf16-mixed")
    assert oc.use_distributed_optimizer and oc.bf16 and not oc.optimizer_cpu_offload
    off = model_state_options(dict(_compose(["optim=cpu_offload", "optim.optimizer_offload_fraction=0.25"]).optim))
    oc = optimizer_config(off, lr=1e-3, weight_decay=0.0, clip_grad=1.0, adam_beta2=0.95, precision="bf16-mixed")
    assert oc.optimizer_cpu_offload and oc.optimizer_offload_fraction == 0.25
    # NeMo's default Megatron DDP; checkpoints in Megatron's fully_reshardable optimizer format (the default
    # dp_reshardable one asserts on the host AdamW's per-parameter 'step')
    assert strategy_kwargs(off) == {"ckpt_optim_fully_reshardable": True}
    assert strategy_kwargs(model_state_options(dict(_compose(["optim=distributed"]).optim))) == {}


# ------------------------------------------------------------------ Megatron-FSDP checkpoints (fsdp_dtensor)
FSDP_CKPT = ["optim=fsdp", "trainer.precision=bf16-mixed", "model.seq_length=1024", "trainer.max_steps=4",
             "checkpoint.every_n_steps=2", "memory.track=false", "run.timeout_s=300"]


def _dcp_contents(ckpt):
    """The model and optimizer tensors of an fsdp_dtensor checkpoint, gathered whole from every rank's shards (torch
    DCP's own conversion, no process group)."""
    import torch
    from torch.distributed.checkpoint.format_utils import dcp_to_torch_save

    out = ckpt.parent / (ckpt.name + ".whole.pt")
    dcp_to_torch_save(str(ckpt), str(out))
    sd = torch.load(out, weights_only=False)

    def flat(d, pre=""):
        for k, v in d.items():
            if isinstance(v, dict):
                yield from flat(v, f"{pre}{k}.")
            elif isinstance(v, torch.Tensor):
                yield pre + k, v

    return dict(flat({"model": sd["model"], "optimizer_states": sd["optimizer_states"]}))


def test_megatron_fsdp_resume_equals_the_uninterrupted_run(tmp_path):
    """optim=fsdp at bf16-mixed with checkpoints every 2 of 4 steps (NeMo's fsdp_dtensor format, two gloo ranks
    sharding the tiny Llama, whose SwiGLU linear_fc1 shards are empty on one rank): rank 1 SIGKILLed at step 3, the
    same command resumes from the step-2 checkpoint, and steps 3-4 equal the uninterrupted run's bit for bit; so does
    the step-4 checkpoint, every weight (fp32 main params), Adam moment and step gathered whole from both ranks."""
    import torch
    from app_runner import leftover_processes, metrics_rows, run_app

    app = [str(model_state_runs.BIN / "nemo-longctx"), "train"]
    full, cut = tmp_path / "full", tmp_path / "cut"
    code, log = run_app(app + [f"output_dir={full}", *FSDP_CKPT], 420)
    assert code == 0, log[-4000:]
    code, log = run_app(app + [f"output_dir={cut}", *FSDP_CKPT, "run.fault=kill@3:1"], 420)
    assert code != 0 and "rank 1 killed by SIGKILL" in log, log[-3000:]
    assert leftover_processes() == []
    code, log = run_app(app + [f"output_dir={cut}", *FSDP_CKPT], 420)
    assert code == 0, log[-4000:]
    assert "resumed at step 2 from" in log, log[-3000:]
    ref = [r["loss"] for r in metrics_rows(full)]
    got = [r["loss"] for r in metrics_rows(cut)]
    assert len(ref) == 4 and got == ref, (got, ref)
    a, b = (_dcp_contents(d / "checkpoints" / "step=3-consumed_samples=4.0") for d in (full, cut))
    assert sorted(a) == sorted(b) and any(k.endswith("linear_fc1.weight_w.exp_avg") for k in a), sorted(a)[:20]
    unequal = [k for k in a if not torch.equal(a[k], b[k])]
    assert unequal == [], unequal
