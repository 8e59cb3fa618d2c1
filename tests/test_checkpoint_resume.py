"""Checkpoints, resume, validation and TensorBoard through NeMo's own machinery (real processes, gloo on CPU).

Runs of the default job (tiny GQA Llama, ring CP=2, Adam + cosine LR, fp32, seq 1024), 6 steps, checkpoint every 2
steps, validation every 2 steps:
  * ``full``: uninterrupted (tests/default_job.py: trained once per session, shared with tests/test_preemption.py);
  * ``killed``: the same run with rank 1 SIGKILLed at step 5 (exit != 0; checkpoints of steps 2 and 4 on disk), then
    ``resumed`` with the same command (``checkpoint.resume=auto``): steps 5 and 6 equal ``full``'s (<= 1e-6 relative)
    -- model, optimizer, LR schedule and data position all come back;
  * ``cp.size`` 2 -> 4 -> 2: ``cp4`` resumes from ``full``'s step-2 checkpoint (``checkpoint.resume=<path>``) on 4
    ranks, ``back2`` resumes from ``cp4``'s step-4 checkpoint at cp.size=2 again; from ``full``'s step-4 checkpoint:
    ``cp.algorithm=ulysses`` and TP=2. Every resumed step's loss equals ``full``'s (<= 1e-5), and so does their
    step-6 validation loss;
  * ``none``: cp=none on one process, 6 steps with validation: validation losses equal the ring's (reduced over CP).
Marked ``slow`` (the full suite runs them, CI does not): ``back2``, ``tp2`` and the DP=2 resume (each run only when
its test is selected). Plus: the checkpoint's NeMo context (io.json) restores our layer spec; TensorBoard event files
hold the scalars; ``checkpoint.keep`` prunes; bad checkpoint settings fail before anything starts.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from app_runner import leftover_processes, metrics_rows, run_app
from default_job import COMMON, STEPS, uninterrupted

BIN = Path(sys.executable).parent
APP = [str(BIN / "nemo-longctx"), "train"]


def _metrics(out_dir: Path):
    rows = metrics_rows(out_dir)
    train = {r["step"]: r["loss"] for r in rows if "loss" in r}
    val = {r["step"]: r["val_loss"] for r in rows if "val_loss" in r}
    return train, val


def _ckpt(out_dir: Path, step: int) -> Path:
    """NeMo names a checkpoint by its 0-based step: the one saved after N steps is ``step=N-1-...``."""
    found = [p for p in (out_dir / "checkpoints").glob(f"step={step - 1}-*") if not p.name.endswith("-last")]
    assert len(found) == 1, sorted(p.name for p in (out_dir / "checkpoints").iterdir())
    return found[0]


def _ok(cmd, timeout=420):
    code, out = run_app(cmd, timeout)
    assert code == 0, out[-4000:]
    return out


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    base = tmp_path_factory.mktemp("ckpt")
    d = {name: base / name for name in ("killed", "cp4", "back2", "ulysses", "tp2", "dp2", "none")}
    d["full"] = uninterrupted(tmp_path_factory)  # shared with tests/test_preemption.py (tests/default_job.py)
    code, out = run_app(APP + [f"output_dir={d['killed']}", *COMMON, "run.fault=kill@5:1"], 420)
    assert code != 0 and "rank 1 killed by SIGKILL" in out, out[-3000:]
    assert leftover_processes() == []  # not even the killed rank's asynchronous checkpoint worker
    killed_rows = _metrics(d["killed"])
    killed_ckpts = sorted(p.name for p in (d["killed"] / "checkpoints").iterdir())
    resumed_out = _ok(APP + [f"output_dir={d['killed']}", *COMMON])  # the same command again: auto-resume
    # this one tracks memory too (the tracker's scalars reach TensorBoard)
    none_common = [o for o in COMMON if not o.startswith("memory.track=")] + ["memory.track=true"]
    none_out = _ok([sys.executable, "-m", "nemo_longctx.apps.train", f"output_dir={d['none']}", *none_common, "cp=none",
                    "trainer.devices=1", "run.kernel_self_test=true"])
    return {"dirs": d, "killed_rows": killed_rows, "killed_ckpts": killed_ckpts, "resumed_out": resumed_out,
            "none_out": none_out}


class _Layouts(dict):
    """name -> output dir of a run resumed from ``full``'s checkpoints at another layout, run on first use (the runs
    of tests marked ``slow`` are then skipped with them)."""

    def __init__(self, d):
        super().__init__()
        self.d = d

    def __missing__(self, name):
        d, step4 = self.d, _ckpt(self.d["full"], 4)
        if name == "cp4":
            _ok(APP + [f"output_dir={d['cp4']}", *COMMON, "cp.size=4", "trainer.devices=4",
                       f"checkpoint.resume='{_ckpt(d['full'], 2)}'"], timeout=600)
        elif name == "back2":
            _ok(APP + [f"output_dir={d['back2']}", *COMMON, f"checkpoint.resume='{_ckpt(self['cp4'], 4)}'"])
        elif name == "ulysses":
            _ok(APP + [f"output_dir={d['ulysses']}", *COMMON, "cp=ulysses", f"checkpoint.resume='{step4}'"])
        elif name == "tp2":
            _ok(APP + [f"output_dir={d['tp2']}", *COMMON, "cp=none", "trainer.strategy.tensor_model_parallel_size=2",
                       f"checkpoint.resume='{step4}'"])
        elif name == "dp2":  # DP=2 (global batch 2 instead of 1), and a run that saves nothing itself
            _ok(APP + [f"output_dir={d['dp2']}", "model.seq_length=1024", f"trainer.max_steps={STEPS}",
                       "memory.track=false", "cp=none", f"checkpoint.resume='{step4}'"])
        else:
            raise KeyError(name)
        self[name] = d[name]
        return d[name]


@pytest.fixture(scope="module")
def layouts(runs):
    """Runs resumed from ``full``'s checkpoints at other layouts, each run when a test first asks for it."""
    return _Layouts(runs["dirs"])


def _close(a: float, b: float, rel: float) -> bool:
    return abs(a - b) <= rel * abs(a)


def test_resume_after_a_killed_rank_continues_the_same_run(runs):
    full, full_val = _metrics(runs["dirs"]["full"])
    assert sorted(full) == list(range(1, STEPS + 1)) and sorted(full_val) == [2, 4, 6]
    train_before, _ = runs["killed_rows"]
    assert sorted(train_before) == [1, 2, 3, 4]  # killed at the start of step 5
    assert any(n.startswith("step=3-") for n in runs["killed_ckpts"]), runs["killed_ckpts"]
    resumed_line = next(ln for ln in runs["resumed_out"].splitlines() if ln.startswith("nemo-longctx: resumed at"))
    assert resumed_line.startswith("nemo-longctx: resumed at step 4 from ") and "step=3-" in resumed_line, resumed_line
    resumed, resumed_val = _metrics(runs["dirs"]["killed"])
    assert sorted(resumed) == list(range(1, STEPS + 1))  # metrics.jsonl reads as one run
    for step in range(1, STEPS + 1):
        assert _close(full[step], resumed[step], 1e-6), (step, full[step], resumed[step])
    assert _close(full_val[6], resumed_val[6], 1e-6)
    assert full[5] != full[4]  # the comparison is not vacuous: the loss moves step to step


@pytest.mark.parametrize("layout,first", [("cp4", 3), pytest.param("back2", 5, marks=pytest.mark.slow),
                                          ("ulysses", 5), pytest.param("tp2", 5, marks=pytest.mark.slow)])
def test_resume_at_another_cp_layout_continues_with_the_same_loss(runs, layouts, layout, first):
    full, full_val = _metrics(runs["dirs"]["full"])
    other, other_val = _metrics(layouts[layout])
    assert sorted(other) == list(range(first, STEPS + 1)), other  # resumed after step first-1
    for step in range(first, STEPS + 1):
        assert _close(full[step], other[step], 1e-5), (step, full[step], other[step])
    assert _close(full_val[6], other_val[6], 1e-5), (full_val[6], other_val[6])


@pytest.mark.slow
def test_resume_at_another_data_parallel_size(runs, layouts):
    """DP 1 -> 2 with micro batch 1 doubles the global batch: the run resumes at step 5 (weights, optimizer and LR
    schedule restored; the sampler continues after the 4 consumed samples) but trains on 2 samples per step, so its
    losses are not the DP=1 run's. It saves nothing itself (checkpoint.every_n_steps=0)."""
    full, _ = _metrics(runs["dirs"]["full"])
    dp2, _ = _metrics(layouts["dp2"])
    assert sorted(dp2) == [5, 6], dp2
    assert all(0 < v < full[4] + 0.5 for v in dp2.values()), (dp2, full)
    assert not (layouts["dp2"] / "checkpoints").exists()


def test_validation_loss_is_reduced_over_cp(runs):
    _, ring_val = _metrics(runs["dirs"]["full"])
    none, none_val = _metrics(runs["dirs"]["none"])
    assert sorted(none_val) == sorted(ring_val) == [2, 4, 6]
    for step in (2, 4, 6):
        assert _close(none_val[step], ring_val[step], 1e-5), (step, none_val[step], ring_val[step])
    assert len({round(v, 4) for v in ring_val.values()}) == 3  # validation follows training


def test_opt_in_kernel_self_test_runs_before_training(runs):
    out = runs["none_out"]
    assert "run.kernel_self_test: kernel cpu_flash on cpu/torch.float32 matches float64" in out, out[-2000:]
    assert out.index("run.kernel_self_test:") < out.index("step 1/")


def test_checkpoint_keep_prunes_old_checkpoints(runs):
    names = sorted(p.name for p in (runs["dirs"]["full"] / "checkpoints").iterdir())
    regular = [n for n in names if not n.endswith("-last")]
    assert regular == ["step=1-consumed_samples=2.0", "step=3-consumed_samples=4.0", "step=5-consumed_samples=6.0"]
    assert "step=5-consumed_samples=6.0-last" in names  # the end of training is saved too


def test_tensorboard_event_files_hold_the_scalars(runs):
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    tb = runs["dirs"]["full"] / "tensorboard"
    acc = EventAccumulator(str(tb))
    acc.Reload()
    tags = set(acc.Tags()["scalars"])
    for tag in ("reduced_train_loss", "val_loss", "train/loss", "train/tokens_per_s", "train/step_time_s"):
        assert tag in tags, sorted(tags)
    losses = [e.value for e in acc.Scalars("train/loss")]
    full, _ = _metrics(runs["dirs"]["full"])
    assert len(losses) == STEPS and abs(losses[-1] - full[STEPS]) <= 1e-6 * abs(full[STEPS])
    acc = EventAccumulator(str(runs["dirs"]["none"] / "tensorboard"))  # the run with memory.track=true
    acc.Reload()
    tracked = [e.value for e in acc.Scalars("train/activation_bytes_device")]
    assert len(tracked) == STEPS and min(tracked) > 0, tracked


CONTEXT_CHECK = """
import json, sys
from nemo.lightning import io
model = io.load_context(sys.argv[1], subpath="model")
spec = model.config.transformer_layer_spec
print(json.dumps({"spec": type(spec).__name__, "algorithm": spec.cp_algorithm,
                  "data_step": model.config.data_step_fn.__name__, "layers": model.config.num_layers}))
"""


def test_checkpoint_context_restores_our_layer_spec(layouts):
    ctx = _ckpt(layouts["ulysses"], 6) / "context"
    p = subprocess.run([sys.executable, "-c", CONTEXT_CHECK, str(ctx)], capture_output=True, text=True, timeout=300)
    assert p.returncode == 0, p.stderr[-3000:]
    got = json.loads(p.stdout.strip().splitlines()[-1])
    assert got == {"spec": "LongContextLayerSpec", "algorithm": "ulysses", "data_step": "long_context_data_step",
                   "layers": 2}, got


IO_ROUND_TRIP = """
import json, sys, tempfile
from pathlib import Path
import hydra, yaml
from omegaconf import OmegaConf
from nemo.collections import llm
from nemo.lightning import io
from nemo_longctx.integrations.nemo.model import enable_long_context
config = hydra.utils.instantiate(OmegaConf.create(yaml.safe_load(open(sys.argv[1]))), _convert_="all")
enable_long_context(config, "ulysses", head_chunks=2)
model = llm.GPTModel(config)
enable_long_context(model.config, "hybrid", ulysses_size=2)  # re-targeted later, as the strategy does at connect
out = Path(tempfile.mkdtemp())
model.io_dump(out, yaml_attrs=["config"])
spec = io.load(out / "io.json").config.transformer_layer_spec
print(json.dumps({"spec": type(spec).__name__, "algorithm": spec.cp_algorithm, "kwargs": spec.algorithm_kwargs,
                  "base": getattr(spec.base, "__name__", repr(spec.base))}))
"""


def test_layer_spec_and_its_options_survive_nemo_io(tmp_path):
    conf = Path(__file__).resolve().parents[1] / "conf" / "model" / "tiny_llama.yaml"
    p = subprocess.run([sys.executable, "-c", IO_ROUND_TRIP, str(conf)], capture_output=True, text=True, timeout=300)
    assert p.returncode == 0, p.stderr[-3000:]
    got = json.loads(p.stdout.strip().splitlines()[-1])
    assert got["spec"] == "LongContextLayerSpec" and got["algorithm"] == "hybrid", got
    assert got["kwargs"] == {"ulysses_size": 2} and "layer_spec" in got["base"], got


def test_bad_checkpoint_settings_fail_before_anything_starts(tmp_path):
    code, out = run_app(APP + [f"output_dir={tmp_path}", "checkpoint.every_n_steps=-1", "checkpoint.keep=0",
                               f"checkpoint.resume={tmp_path / 'missing'}"], 120)
    assert code != 0 and "spawning" not in out, out[-3000:]
    assert "checkpoint.every_n_steps=-1" in out and "checkpoint.keep=0" in out, out[-3000:]
    assert "is neither auto/never nor an existing checkpoint directory" in out, out[-3000:]
