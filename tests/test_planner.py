"""Planner (nemo_longctx.planner.search) and the `plan` Hydra app: monotonicity, CP choice, refusals, outputs."""

import json
import re
import shlex
import shutil
import subprocess
import sys
from dataclasses import replace
from pathlib import Path

import pytest

from app_runner import printed_command
from nemo_longctx.planner.model_shapes import KNOWN_SHAPES, ModelShape, shape_from_config
from nemo_longctx.planner.search import (
    loss_fixed_bytes,
    GIB,
    Candidate,
    Hardware,
    PlanError,
    candidate_configs,
    kv_replication,
    memory_breakdown,
    predicted_activation_bytes,
    plan,
    plan_or_raise,
)

ROOT = Path(__file__).resolve().parents[1]
L8B, L70B = KNOWN_SHAPES["llama3_8b"], KNOWN_SHAPES["llama3_70b"]
H100x8 = Hardware(gpus=8, gpu_memory_gb=80, host_memory_gb=1024)


def test_parameter_counts_match_the_published_sizes():
    assert L8B.parameters() == pytest.approx(8.03e9, rel=0.005)
    assert L70B.parameters() == pytest.approx(70.55e9, rel=0.005)
    m = memory_breakdown(L8B, 8192, Hardware(gpus=8), Candidate(tp=2, cp_algorithm="ring", cp_size=4))
    assert m.weights == 2 * L8B.parameters() / 2  # bf16, split over tp=2
    assert m.grads == 4 * L8B.parameters() / 2
    assert m.optimizer == pytest.approx(12 * L8B.parameters() / 8)  # sharded over dp x cp x tp = 8


@pytest.mark.parametrize("cand", [
    Candidate(),
    Candidate("ring", 8, 1, 1, "full", "layer_input", 8, 16),
    Candidate("ulysses", 4, 4, 2, "selective_mlp", "none", 1, 1),
    Candidate("hybrid", 8, 2, 1, "full_keep_attn", "none", 4, 8),
])
def test_memory_is_monotonic_in_seq_length(cand):
    hw = Hardware(gpus=8)
    totals, acts = [], []
    for s in [2 ** k for k in range(12, 22)]:
        m = memory_breakdown(L8B, s, hw, cand)
        totals.append(m.total)
        acts.append(m.activations + m.host_offload)
    assert all(a < b for a, b in zip(totals, totals[1:]))
    assert all(a < b for a, b in zip(acts, acts[1:]))
    # saved activations are linear in tokens (flash-style attention: no s^2 term), apart from the chunked loss's
    # fp32 weight gradient [V/tp, h] held from forward to backward (per GPU, independent of the length)
    m1, m2 = memory_breakdown(L8B, 1 << 16, hw, cand), memory_breakdown(L8B, 1 << 17, hw, cand)
    fixed = loss_fixed_bytes(L8B, cand)
    assert (fixed > 0) == (cand.loss_chunks > 1)
    assert (m2.activations + m2.host_offload - fixed) == pytest.approx(2 * (m1.activations + m1.host_offload - fixed))


def test_gpus_needed_is_monotonic_in_seq_length():
    def gpus_needed(seq):
        n = 1
        while plan(L8B, seq, Hardware(gpus=n)).chosen is None:
            n *= 2
            assert n <= 4096
        return n

    needed = [gpus_needed(s) for s in (1 << 15, 1 << 17, 1 << 19, 1 << 21, 1 << 23)]
    assert needed == sorted(needed) and needed[-1] > needed[0], needed


def test_picks_cp_when_one_gpu_cannot_hold_the_sequence():
    seq = 1 << 18
    hw = Hardware(gpus=8)
    # premise: without context parallelism (tp only up to 1 here) nothing fits -- unless the layers run in sequence
    # chunks, which hold 256K tokens on one GPU
    no_cp = plan(L8B, seq, hw, max_tp=1, algorithms=("ring",), sequence_chunks=False)
    assert all(e.candidate.cp_size >= 2 for e in no_cp.evaluations if e.fits)
    assert any(e.candidate.cp_size == 1 for e in no_cp.evaluations)
    assert no_cp.chosen is not None and no_cp.chosen.candidate.cp_size >= 2
    chunked = plan(L8B, seq, hw, max_tp=1, algorithms=("ring",))
    assert any(e.fits and e.candidate.cp_size == 1 and e.candidate.sequence_chunks > 1 for e in chunked.evaluations)
    # and with everything allowed, the target request chooses CP >= 2 with a fitting breakdown
    p = plan_or_raise(L8B, 1 << 20, H100x8)
    assert p.chosen.candidate.cp_size >= 2
    assert p.chosen.memory.total <= 80 * GIB
    assert p.chosen.memory.host_per_node <= 1024 * GIB


def test_chosen_is_cheapest_within_tolerance_and_fits():
    p = plan(L8B, 1 << 20, H100x8)
    fitting = [e for e in p.evaluations if e.fits]
    assert fitting and p.chosen is fitting[0]
    assert p.chosen.cost <= min(e.cost for e in fitting) * 1.01
    assert all(not e.fits for e in p.evaluations[len(fitting):])


def test_refuses_impossible_requests_saying_what_is_missing():
    with pytest.raises(PlanError) as err:
        plan_or_raise(L70B, 1 << 20, H100x8)
    msg = str(err.value)
    m = re.search(r"needs >= (\d+) GPUs of 80 GB", msg)
    assert m, msg
    n = int(m.group(1))
    assert plan(L70B, 1 << 20, replace(H100x8, gpus=n)).chosen is not None  # the suggestion is right
    assert plan(L70B, 1 << 20, replace(H100x8, gpus=n // 2)).chosen is None  # and minimal (powers of 2)
    # host memory too small for the offload plans that fit on the device: the message names the host size
    with pytest.raises(PlanError) as err:
        plan_or_raise(L8B, 1 << 21, replace(H100x8, host_memory_gb=64))
    m = re.search(r"host memory >= (\d+) GB per node for offload", str(err.value))
    assert m, str(err.value)
    assert plan(L8B, 1 << 21, replace(H100x8, host_memory_gb=int(m.group(1)))).chosen is not None


def test_offload_moves_activations_to_host_and_layouts_are_valid():
    c = Candidate("ring", 8, 1, 1, "full", "none", 1, 16)
    on_dev = memory_breakdown(L8B, 1 << 20, H100x8, c)
    off = memory_breakdown(L8B, 1 << 20, H100x8, replace(c, offload="layer_input"))
    # at the peak: 2 of 32 layer inputs in flight (+ the head's saved bytes when the peak is in its backward)
    assert off.activations < 0.2 * on_dev.activations
    # saved at the end of forward: the layers' saved bytes all on the host, the head's on the device; every offloaded
    # layer also offloads its own copy of the RoPE table (a checkpoint argument; fp32 [s, d])
    saved_on = predicted_activation_bytes(L8B, 1 << 20, c)
    saved_off = predicted_activation_bytes(L8B, 1 << 20, replace(c, offload="layer_input"))
    rope_copies = (1 << 20) / 8 * 4 * L8B.head_dim * (L8B.num_layers - 1)
    assert saved_off["host"] + saved_off["device"] == pytest.approx(saved_on["device"] + rope_copies)
    assert off.host_offload == pytest.approx(saved_off["host"] * (L8B.num_layers - 2) / L8B.num_layers)
    for cand in candidate_configs(L8B, 1 << 20, H100x8):
        assert cand.tp * cand.cp_size <= 8 and 8 % (cand.tp * cand.cp_size) == 0
        assert (1 << 20) % (2 * cand.cp_size) == 0
        assert (L8B.num_attention_heads // cand.tp) % cand.ulysses_size == 0
        assert cand.offload == "none" or cand.recompute in ("full", "full_keep_attn")
        assert cand.recompute != "full_keep_attn" or cand.cp_algorithm in ("ring", "none")
    assert kv_replication(L8B, 1, 8) == 1 and kv_replication(L8B, 2, 8) == 2  # 8 kv heads / tp 2 = 4 < 8


def test_bad_inputs_name_the_field():
    with pytest.raises(ValueError, match="plan.gpus"):
        Hardware(gpus=0)
    with pytest.raises(ValueError, match="plan.seq_length"):
        plan(L8B, 1, H100x8)
    with pytest.raises(ValueError, match="num_query_groups"):
        ModelShape("x", 2, 64, 128, 4, 3, 100)
    with pytest.raises(ValueError, match="model.vocab_size"):
        shape_from_config({"num_layers": 2, "hidden_size": 64, "ffn_hidden_size": 128, "num_attention_heads": 4})


def test_shape_from_config_reads_fields_and_known_names():
    assert shape_from_config({"_target_": "nemo.collections.llm.Llama3Config70B"}).num_layers == 80
    s = shape_from_config({"config": {"num_layers": 2, "hidden_size": 64, "ffn_hidden_size": 128,
                                      "num_attention_heads": 4, "num_query_groups": 2}, "vocab_size": 256},
                          name="tiny")
    assert (s.num_layers, s.num_query_groups, s.vocab_size, s.name) == (2, 2, 256, "tiny")
    s = shape_from_config({"seq_length": 4096}, name="llama3_8b")
    assert s == replace(L8B, name="llama3_8b")


# ------------------------------------------------------------------------------------------------ the app
def _plan_cli(*overrides, check=True):
    cmd = [sys.executable, "-m", "nemo_longctx.apps.plan", *overrides]
    r = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=120)
    if check:
        assert r.returncode == 0, r.stdout + r.stderr
    return r


def test_target_command_prints_a_fitting_plan_with_overrides(tmp_path):
    png, sb = tmp_path / "mem.png", tmp_path / "run.sbatch"
    r = _plan_cli("model=llama3_8b", "plan.seq_length=1048576", "plan.gpus=8", "plan.gpu_memory_gb=80",
                  f"plan.plot={png}", f"plan.write_sbatch={sb}")
    out = r.stdout
    assert "chosen: " in out and re.search(r"\b[1-9]\d* of \d+ candidates fit", out), out
    line = printed_command(out)  # the default view wraps it for a shell to paste
    assert "model=llama3_8b" in line and "model.seq_length=1048576" in line
    assert re.search(r"cp=(ring|ulysses|hybrid) cp\.size=\d+", line), line
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" and png.stat().st_size > 10000
    text = sb.read_text()
    assert ("--container-image=\"$IMAGE\"" in text and "/bin/nemo-longctx\" train" in text
            and "#SBATCH --nodes=1" in text)
    assert "pip install --no-deps" in text and "#SBATCH --gpus-per-node=8" in text  # the plugin installed at job start
    assert subprocess.run(["bash", "-n", str(sb)]).returncode == 0
    if shutil.which("shellcheck"):
        sc = subprocess.run(["shellcheck", str(sb)], capture_output=True, text=True)
        assert sc.returncode == 0, sc.stdout


def test_bridge_frontend_writes_an_sbatch_that_runs_the_bridge_entry_with_the_chosen_row(tmp_path):
    """plan.frontend=bridge plan.write_sbatch=...: the job (run by bash, srun recorded) installs the plugin with
    --no-deps in a Bridge-era image and starts `nemo-longctx bridge` with the Bridge arguments of the cheapest fitting
    row that can save checkpoints (the printed one when it can), its checkpoint directory and the extra arguments;
    they compose back into that candidate's options (the Bridge app refusing none)."""
    from fake_srun import run_with_fake_srun
    from hydra import compose, initialize_config_module
    from hydra.core.global_hydra import GlobalHydra

    from nemo_longctx.apps import bridge as bridge_app
    from nemo_longctx.apps.plan import bridge_overrides, inputs_from_config
    from nemo_longctx.shared.run_spec import read_plan_spec
    from nemo_longctx.planner.search import candidate_options

    sb = tmp_path / "bridge.sbatch"
    planned = ["model=llama3_8b", "plan.seq_length=131072", "plan.gpus=16", "plan.gpu_memory_gb=80"]
    r = _plan_cli(*planned, "plan.frontend=bridge", f"plan.write_sbatch={sb}")
    printed = shlex.split(printed_command(r.stdout, "nemo-longctx bridge "))[2:]
    assert subprocess.run(["bash", "-n", str(sb)]).returncode == 0
    if shutil.which("shellcheck"):
        sc = subprocess.run(["shellcheck", str(sb)], capture_output=True, text=True)
        assert sc.returncode == 0, sc.stdout
    text = sb.read_text()
    code = [line for line in text.splitlines() if not line.startswith("#")]
    assert "#SBATCH --nodes=2" in text and "#SBATCH --ntasks-per-node=8" in text
    assert not [line for line in code if "torchrun" in line]

    GlobalHydra.instance().clear()
    with initialize_config_module(config_module="nemo_longctx.conf", version_base=None):
        cfg = compose("plan", overrides=planned + ["plan.frontend=bridge"])
    shape, seq, hw, precision, coef, cost, search = inputs_from_config(read_plan_spec(cfg))
    p = plan(shape, seq, hw, precision, coef, cost, **search)
    job = p.chosen  # (plan.checkpoints=true: a row that saves)
    assert bridge_overrides(p, p.chosen, "llama3_8b") == printed

    out = tmp_path / "out"
    env = {"NEMO_LONGCTX_SRC": str(ROOT), "OUTPUT_DIR": str(out), "EXTRA_OVERRIDES": "train.train_iters=5",
           "DATA": "synthetic"}
    res, calls = run_with_fake_srun(sb, tmp_path, env)
    assert res.returncode == 0 and len(calls) == 3, (res.stdout + res.stderr, calls)
    install, _, ran = calls
    assert "pip" in install and "--no-deps" in install and str(ROOT) in install
    assert "--container-image=nvcr.io#nvidia/nemo:26.08" in ran and "--kill-on-bad-exit=1" in ran
    site_bin = f"{out}/.nemo_longctx_site/bin/nemo-longctx"
    args = ran[ran.index(site_bin) + 1:]
    ckpt = f"{out}/checkpoints"
    job_args = bridge_overrides(p, job, "llama3_8b")
    assert args[0] == "bridge" and args[1:] == job_args + [f"checkpoint.save={ckpt}", f"checkpoint.load={ckpt}",
                                                           f"output_dir={out}", "train.train_iters=5"], args

    want = candidate_options(job.candidate)
    ours, theirs = bridge_app.split_args(job_args)
    options = bridge_app.compose(ours).options
    assert options.problems() == [] and bridge_app.app_problems(ours) == []
    assert (options.cp, options.memory, options.optim.state) == (want.cp, want.memory, want.optim.state)
    assert "recipe=llama3_8b_pretrain_config" in ours and "model.seq_length=131072" in theirs


def test_json_output_parses_and_agrees_with_the_library():
    r = _plan_cli("model=llama3_8b", "plan.seq_length=524288", "plan.gpus=16", "plan.json=true")
    d = json.loads(r.stdout)
    assert d["chosen"]["fits"] and d["overrides"][0] == "model=llama3_8b"
    from hydra import compose, initialize_config_dir

    from nemo_longctx.apps.plan import conf_dir, inputs_from_config
    from nemo_longctx.shared.run_spec import read_plan_spec

    with initialize_config_dir(config_dir=conf_dir(), version_base=None):
        cfg = compose("plan", overrides=["model=llama3_8b", "plan.seq_length=524288", "plan.gpus=16"])
    shape, seq, hw, precision, coef, cost, search = inputs_from_config(read_plan_spec(cfg))  # the app's search space
    p = plan(shape, seq, hw, precision, coef, cost, **search)
    assert d["chosen"]["label"] == p.chosen.candidate.label()
    assert d["chosen"]["memory_gib"]["total"] == pytest.approx(p.chosen.memory.total / GIB)
    assert d["hardware"]["nodes"] if "nodes" in d["hardware"] else d["hardware"]["gpus"] == 16


def test_app_refuses_with_exit_2_and_the_missing_resources():
    r = _plan_cli("model=llama3_70b", "plan.seq_length=1048576", "plan.gpus=8", check=False)
    assert r.returncode == 2, r.stdout + r.stderr
    assert re.search(r"needs >= \d+ GPUs of 80 GB", " ".join((r.stdout + r.stderr).split()))  # across wrapped lines
    r = _plan_cli("model=llama3_8b", "plan.seq_length=1", check=False)
    assert r.returncode == 2 and "seq_length" in (r.stdout + r.stderr)


def test_candidate_of_inverts_option_model_for_every_searched_candidate():
    """``candidate_of(options)`` (what the train app's dry run sizes) is the inverse of ``candidate_options(c)`` for
    every candidate the planner searches, and None for options it does not model."""
    from nemo_longctx.options import LongContextOptions
    from nemo_longctx.planner.model_shapes import KNOWN_SHAPES
    from nemo_longctx.planner.search import Hardware, candidate_configs, candidate_of, candidate_options

    shape, seq = KNOWN_SHAPES["llama3_8b"], 1 << 20
    cands = list(candidate_configs(shape, seq, Hardware(gpus=8)))
    assert len(cands) > 100
    for c in cands:
        assert candidate_of(candidate_options(c), seq, c.tp, c.tp > 1) == c, c
    modules = LongContextOptions.from_dict({"recompute": {"name": "none"}, "offload": {"name": "modules",
                                                                                      "modules": ["mlp"]}})
    assert candidate_of(modules, seq) is None
