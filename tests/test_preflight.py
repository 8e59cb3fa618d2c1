"""Wrong configs stop before launch (issue 22): every mistake a newcomer met, and one bad value of every declared key
(generated from the option model and the app's declarations; every bad value of every key: tests/test_options.py),
typed on the command line of ``nemo-longctx train``, ends in the launching process -- before any rank starts and
before NeMo is imported -- with exit 2, no traceback and one block naming the key; and every plan the planner prints
is one ``train`` accepts.

The generated command lines go through ``app.preflight`` in this process (the function ``train``'s ``main`` runs
first: Hydra's compose API + every config-level rule); the newcomer's mistakes run through ``train.main`` (what the
``nemo-longctx train`` console script calls) in one separate process under ``python -X importtime``, which lists the
frameworks they imported: none."""

from __future__ import annotations

import json
import math
import os
import random
import subprocess
import sys
from pathlib import Path

import pytest

from app_runner import importtime_split, run_importtime

BIN = Path(sys.executable).parent
NL = str(BIN / "nemo-longctx")


def _hydra_value(v):
    """A Python value as a Hydra command-line value."""
    if v is None:
        return "null"
    if isinstance(v, bool):
        return str(v).lower()
    if isinstance(v, float) and math.isnan(v):
        return "nan"
    if isinstance(v, str):
        return "'" + v + "'" if v else "''"
    if isinstance(v, (list, tuple)):
        return "[" + ",".join(_hydra_value(x) for x in v) + "]"
    if isinstance(v, dict):
        return "{" + ",".join(f"{k}:{_hydra_value(x)}" for k, x in v.items()) + "}"
    return str(v)


def _cases():
    from nemo_longctx.options import LongContextOptions
    from nemo_longctx.shared.app_keys import APP_OPTIONS

    out = []
    for opt in LongContextOptions.options() + APP_OPTIONS:  # one bad value per key here (tests/test_options.py
        bad = opt.bad_values()[-1]  # checks every bad value of every key against config_problems, in-process)
        out.append(pytest.param(opt, bad, id=f"{opt.key}={bad!r}"))
    return out


def _command_line(opt, bad):
    return _base(opt) + [f"++{opt.key}={_hydra_value(bad)}"]  # ++: set, or add where the yaml lacks it


def _base(opt):
    """The command line a key needs (``Option.requires``), on as many ranks as its CP size needs."""
    return list(opt.requires) + (["trainer.devices=4"] if "cp=hybrid" in opt.requires else [])


@pytest.mark.parametrize("opt, bad", _cases())
def test_every_bad_value_typed_on_the_command_line_is_refused_naming_it(opt, bad):
    from nemo_longctx.integrations.nemo.app import preflight

    base = _base(opt)
    assert preflight(base) == [], f"the base command line {base} must be accepted"
    problems = preflight(_command_line(opt, bad))
    assert any(opt.key in p for p in problems), f"{opt.key}={bad!r} was accepted or not named: {problems}"


# ------------------------------------------------------------------------------------------- the newcomer's list
MISTAKES = {
    # name: (command line, words the one message must hold)
    "seq_not_divisible": (["model.seq_length=4097"], ["model.seq_length=4097", "2*cp.size = 4", "use 4096"]),
    "world_size": (["cp.size=4"], ["cp.size=4", "does not divide the world size 2"]),
    "packing_vs_micro_batch": (["data=packed_sft", "trainer.micro_batch_size=2"],
                               ["trainer.micro_batch_size=1 (got 2)", "data.packed_train"]),
    "negative_steps": (["trainer.max_steps=-5"], ["trainer.max_steps=-5"]),
    "plus_typo": (["+cp.sise=4"], ["cp.sise", "did you mean cp.size"]),
    "typo": (["cp.sise=4"], ["cp.sise", "did you mean cp.size"]),
    "group_typo": (["cp=rign"], ["cp=rign", "did you mean cp=ring"]),
    "cp_none_with_size": (["cp=none", "cp.size=2"], ["cp=none with cp.size=2"]),
    "fp8": (["trainer.precision=fp8"], ["trainer.precision='fp8'"]),
    "size_abc": (["cp.size=abc"], ["cp.size='abc'"]),
    "indexed_without_paths": (["data=indexed"], ["data.paths", "data.tokenizer=null"]),
    "resume_path_with_equals": (["checkpoint.resume=/no/such/step=3-consumed_samples=6.0"],
                                ["checkpoint.resume='/no/such/step=3-consumed_samples=6.0'"]),
    "hub_tokenizer_not_cached": (["data=indexed", "data.paths=[/no/such/prefix]", "data.tokenizer=org/not-cached"],
                                 ["data.tokenizer=org/not-cached", "not in the Hugging Face cache",
                                  "/no/such/prefix.bin"]),
}


ENV = {**os.environ, "HF_HUB_OFFLINE": "1"}


def _run(args, cwd, timeout=60):
    p = subprocess.run(args, cwd=cwd, env=ENV, capture_output=True, text=True, timeout=timeout)
    return p.returncode, p.stdout + p.stderr


# every mistake through ``nemo-longctx train``'s own ``main`` (what the console script calls), one after the other in
# ONE process under ``python -X importtime`` (one interpreter start instead of one per mistake): each one's exit code
# and output, and the frameworks the whole process imported -- none, so no mistake waited for NeMo or the ranks
MISTAKES_DRIVER = r"""
import json, os, sys, tempfile
from nemo_longctx.apps import train
results = {}
for name, args in json.loads(sys.argv[1]).items():
    sys.stdout.flush(); sys.stderr.flush()
    saved = os.dup(1), os.dup(2)
    with tempfile.TemporaryFile(mode="w+") as f:
        os.dup2(f.fileno(), 1); os.dup2(f.fileno(), 2)  # this mistake's stdout and stderr (file descriptors: the
        code = 0                                        # app's faulthandler needs one)
        try:
            train.main(args)
        except SystemExit as e:
            code = e.code
        except BaseException:
            import traceback
            traceback.print_exc()
            code = "raised"
        finally:
            sys.stdout.flush(); sys.stderr.flush()
            os.dup2(saved[0], 1); os.dup2(saved[1], 2)
        f.seek(0)
        results[name] = [code, f.read()]
print("@@RESULTS " + json.dumps(results), flush=True)
"""


@pytest.fixture(scope="module")
def mistakes(tmp_path_factory):
    base = tmp_path_factory.mktemp("mistakes")
    lines = {name: [f"output_dir={base / name}", *args] for name, (args, _) in MISTAKES.items()}
    code, out, err, heavy, seconds = run_importtime(["-c", MISTAKES_DRIVER, json.dumps(lines)], base, timeout=120,
                                                    env=ENV)
    marker = next((ln for ln in out.splitlines() if ln.startswith("@@RESULTS ")), None)
    assert code == 0 and marker is not None, (out + err)[-3000:]
    results = {}
    for name, (code, text) in json.loads(marker[len("@@RESULTS "):]).items():
        text, imported = importtime_split(text)  # (what a mistake imported went to its own stderr)
        results[name] = (code, text)
        heavy = sorted(set(heavy) | set(imported))
    return {"base": base, "heavy": heavy, "seconds": seconds, "results": results}


def test_no_mistake_waits_for_nemo(mistakes):
    assert mistakes["heavy"] == [], f"imported {mistakes['heavy']}: the checks must not wait for NeMo or the ranks"
    assert mistakes["seconds"] < 60, mistakes["seconds"]  # a hang guard (the import check is the speed contract)


@pytest.mark.parametrize("name", sorted(MISTAKES))
def test_newcomer_mistake_stops_before_launch(mistakes, name):
    code, out = mistakes["results"][name]
    assert code == 2, out[-3000:]
    assert "Traceback" not in out and "spawning" not in out, out[-3000:]
    assert not (mistakes["base"] / name / "rank_logs").exists()  # no rank was started
    for w in MISTAKES[name][1]:
        assert w in out, f"{w!r} not in:\n{out}"
    assert out.count("invalid configuration") == 1, out


def test_plan_refuses_a_length_train_would_refuse(tmp_path):
    code, out, err, heavy, seconds = run_importtime([NL, "plan", "plan.seq_length=1000001"], tmp_path, env=ENV)
    out += err
    assert code == 2 and "Traceback" not in out and "plan.seq_length=1000001" in out, out[-3000:]
    assert "1000000" in out and heavy == [] and seconds < 30, (heavy, seconds)


def test_model_level_problems_are_found_once_before_training(tmp_path):
    """A problem only the model config shows (query groups vs heads) is found by the ranks as they build it, before
    any collective or step: one message (the launcher prints the ConfigError a rank recorded; the ranks print
    nothing), exit 2, no traceback, no table of failed ranks, no summary; the launching process imports no NeMo."""
    out_dir = tmp_path / "out"
    code, out = _run([NL, "train", f"output_dir={out_dir}", "model.num_query_groups=3"], tmp_path, timeout=300)
    assert code == 2 and "Traceback" not in out and "spawning" in out, out[-3000:]
    assert "model.num_query_groups=3" in out and out.count("invalid configuration") == 1, out[-3000:]
    assert "Root Cause" not in out and "FAILED" not in out and "step 1" not in out, out[-3000:]
    assert not (out_dir / "metrics.jsonl").exists()


def test_path_values_holding_equals_are_passed_on_quoted():
    from nemo_longctx.shared.overrides import quote_path_values

    assert quote_path_values(["checkpoint.resume=/c/step=3-consumed_samples=6.0-last", "cp.size=2"]) == [
        "checkpoint.resume='/c/step=3-consumed_samples=6.0-last'", "cp.size=2"]
    assert quote_path_values(["init_from='/a=b'"]) == ["init_from='/a=b'"]  # already quoted: unchanged


# ------------------------------------------------------------------------------------ one contract: plan -> train
def _plan(model, overrides):
    from hydra import compose, initialize_config_module
    from hydra.core.global_hydra import GlobalHydra

    from nemo_longctx.apps import plan
    from nemo_longctx.shared.run_spec import read_plan_spec

    GlobalHydra.instance().clear()
    with initialize_config_module(config_module="nemo_longctx.conf", version_base=None):
        cfg = compose("plan", overrides=[f"model={model}", *overrides])
    GlobalHydra.instance().clear()
    shape, seq, hw, precision, coef, cost, search = plan.inputs_from_config(read_plan_spec(cfg))
    p = plan.make_plan(shape, seq, hw, precision, coef, cost, 0.01, **search)
    if p.chosen is None:
        return None
    return plan.train_overrides(p, p.chosen, model)


def _draws(n=40, seed=22):
    rng = random.Random(seed)
    models = ["llama3_8b", "llama3_70b", "qwen3_32b"]  # the model groups the planner knows the shape of
    out = []
    for _ in range(n):
        seq = rng.choice([rng.randrange(4096, 600_000), 2 ** rng.randrange(13, 22), 1000 * rng.randrange(8, 1000),
                          1024 * rng.randrange(8, 2048)])
        out.append((rng.choice(models), seq, rng.choice([1, 2, 4, 8, 16, 64]), rng.choice([80, 141]),
                    rng.choice(["gpu", "cpu"])))
    return out


def test_every_plan_the_planner_prints_is_one_train_accepts(monkeypatch):
    """Drawn models, lengths (round and odd), GPU counts and targets: every chosen plan's train command passes
    train's own checks (for a GPU target, as a GPU build with TransformerEngine would run them), saving checkpoints
    as a real model does by default."""
    from nemo_longctx.integrations.nemo.app import preflight
    from nemo_longctx.shared import path_checks

    monkeypatch.setattr(path_checks, "free_bytes", lambda path: 1 << 50)  # the cluster's disk, not this machine's

    planned = 0
    for model, seq, gpus, mem, target in _draws():
        args = _plan(model, [f"plan.seq_length={seq}", f"plan.gpus={gpus}",
                      f"plan.gpu_memory_gb={mem}", f"plan.target={target}"])
        if args is None:
            continue
        planned += 1
        problems = preflight(args + ["data=synthetic"], target_cuda=target == "gpu")  # (the command + the data)
        assert problems == [], f"{model} seq {seq} on {gpus} x {mem} GB ({target}): train refuses {args}: {problems}"
    assert planned >= 10, f"only {planned} draws produced a plan: widen the draws"


# ------------------------------------------------------------- checkpoint saving is a planner constraint
LLAMA_8X80 = ["plan=h100", "plan.gpus=8"]  # Llama-3-8B on 8 x 80 GB: Megatron-FSDP is the cheapest layout there


def test_the_default_plan_saves_checkpoints_and_train_accepts_it_saving(tmp_path, monkeypatch):
    """plan.checkpoints=true (the default): Llama-3-8B at 512K and 1M on 8 x 80 GB (bf16-mixed) is planned with
    Megatron-FSDP searched (train saves its checkpoints at bf16-mixed), nothing is left out of the search, and the
    chosen command with checkpoint.every_n_steps=100 passes train's checks for the planner's GPU target (CUDA +
    TransformerEngine: the NGC image; on this CPU machine the precision-aware optimizer would be refused for the
    machine). For the Bridge front end the planner still refuses Megatron-FSDP rows with saving."""
    from io import StringIO

    from hydra import compose, initialize_config_module
    from hydra.core.global_hydra import GlobalHydra

    from nemo_longctx.apps import plan
    from nemo_longctx.shared.run_spec import read_plan_spec
    from nemo_longctx.integrations.nemo.app import preflight
    from nemo_longctx.shared import path_checks

    monkeypatch.setattr(path_checks, "free_bytes", lambda path: 1 << 50)  # the cluster's disk, not this machine's
    for seq in (524288, 1048576):
        planned = [*LLAMA_8X80, f"plan.seq_length={seq}"]
        GlobalHydra.instance().clear()
        with initialize_config_module(config_module="nemo_longctx.conf", version_base=None):
            cfg = compose("plan", overrides=["model=llama3_8b", *planned])
        GlobalHydra.instance().clear()
        out = StringIO()
        assert plan.run(read_plan_spec(cfg), out=out) == 0
        text = " ".join(out.getvalue().split())
        assert "not searched" not in text, text
        assert "saves no checkpoints:" not in text and "checkpoint.every_n_steps=0" not in text
        args = _plan("llama3_8b", planned)
        # (a Megatron-FSDP row is eligible with saving; which row wins depends on the loss chunks, which Megatron-FSDP
        # refuses: the plan must simply not turn saving off)
        assert not any(a.startswith("checkpoint.") for a in args), args
        saving = args + [f"output_dir={tmp_path}", "checkpoint.every_n_steps=100", "data=synthetic"]
        assert preflight(saving, target_cuda=True) == [], f"train refuses {saving}"
    from nemo_longctx.planner.search import ModelState

    row = ("ring", "full", "layer_input", ModelState("fsdp"), "bf16-mixed", "gpu", True)
    assert plan.app_problems(*row, "nemo") == ()
    assert "are saved by nemo-longctx train only" in plan.app_problems(*row, "bridge")[0]


def test_plan_checkpoints_false_may_choose_megatron_fsdp_and_turns_saving_off(tmp_path, monkeypatch):
    """plan.checkpoints=false with fp32 weights (where train refuses Megatron-FSDP with saving): Megatron-FSDP is
    searched again and chosen for Llama-3-8B at 512K on 8 x 80 GB; the row says it saves no checkpoints, and the
    printed command, plan.write_command's and the sbatch's turn saving off (checkpoint.every_n_steps=0): train
    accepts that command, and refuses it with saving on."""
    import shlex

    from app_runner import printed_command
    from nemo_longctx.integrations.nemo.app import preflight
    from nemo_longctx.shared import path_checks

    monkeypatch.setattr(path_checks, "free_bytes", lambda path: 1 << 50)  # the cluster's disk, not this machine's

    line, sb = tmp_path / "cmd.txt", tmp_path / "job.sbatch"
    r = subprocess.run([sys.executable, "-m", "nemo_longctx.apps.plan", "model=llama3_8b", *LLAMA_8X80,
                        "plan.seq_length=524288", "plan.precision.activation_bytes=4", "plan.precision.param_bytes=4",
                        "plan.checkpoints=false", f"plan.write_command={line}",
                        f"plan.write_sbatch={sb}"], cwd=Path(__file__).resolve().parents[1], capture_output=True,
                       text=True, timeout=120)
    assert r.returncode == 0, r.stdout + r.stderr
    text = " ".join(r.stdout.split())
    assert "state=fsdp" in text.split("chosen: ")[1].split(" ")[6] and "not searched" not in text, r.stdout
    assert ("saves no checkpoints: Megatron-FSDP saves checkpoints at bf16-mixed only; a requeued job starts over "
            "(the command sets checkpoint.every_n_steps=0)") in text, r.stdout
    args = shlex.split(line.read_text())[2:]
    assert shlex.split(printed_command(r.stdout))[2:] == args
    assert "optim.megatron_fsdp=true" in args and args[-1] == "checkpoint.every_n_steps=0", args
    assert "checkpoint.every_n_steps=0" in sb.read_text() and "saves no checkpoints" in sb.read_text()
    assert preflight(args + [f"output_dir={tmp_path}", "data=synthetic"], target_cuda=True) == []
    # (the plan's command leaves trainer.precision to the model's recipe; the plan was for fp32 weights)
    saving = preflight(args[:-1] + [f"output_dir={tmp_path}", "checkpoint.every_n_steps=100", "data=synthetic",
                                    "trainer.precision=32"], target_cuda=True)
    assert any(p.startswith("optim.megatron_fsdp=true with checkpoint.every_n_steps > 0") for p in saving), saving


def test_a_tokenizer_larger_than_the_models_vocabulary_is_refused_naming_both(tmp_path):
    """``vocabulary_problems`` (run by ``build`` once the model config exists): a data tokenizer whose ids reach past
    the embedding table is refused with both sizes; one that fits, and synthetic data, pass."""
    from types import SimpleNamespace

    from hf_models import make_tokenizer
    from nemo_longctx.integrations.nemo.app import vocabulary_problems
    from nemo_longctx.shared.run_spec import spec_from_dict

    tok, tokenizer = tmp_path / "tok", make_tokenizer(300)
    tokenizer.save_pretrained(str(tok))
    size = len(tokenizer)
    cfg = spec_from_dict({"data": {"kind": "indexed", "tokenizer": str(tok)}, "init_from": None})
    (problem,) = vocabulary_problems(cfg, SimpleNamespace(vocab_size=size - 1))
    assert f"data.tokenizer ({tok}) has {size} tokens but the model's vocabulary (model.vocab_size) is {size - 1}" \
        in problem, problem
    assert vocabulary_problems(cfg, SimpleNamespace(vocab_size=size)) == []
    synthetic = spec_from_dict({"data": {"kind": "synthetic", "tokenizer": str(tok)}, "init_from": None})
    assert vocabulary_problems(synthetic, SimpleNamespace(vocab_size=10)) == []
