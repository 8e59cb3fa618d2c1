"""The console of ``nemo-longctx train`` and the outputs of each run (issue 22 items 3 and 5).

Two real runs (the app spawns its 2 gloo processes), reused by the end-to-end tests below:
  * ``nemo-longctx train trainer.max_steps=5 output_dir=<d>``: the default, quiet console (``log.level=info``);
  * ``nemo-longctx train --verbose trainer.max_steps=2 output_dir=<d>`` (the same output_dir): everything the
    libraries print; and, being a fresh run, it moves the first run's metrics.jsonl to ``<d>/runs/run_1/``.
Plus unit tests of ``nemo_longctx/shared/console.py``'s functions (no process started).
"""

from __future__ import annotations

import json
import logging
import os
import re
import sys
import time
import warnings
from pathlib import Path

import pytest

from app_runner import metrics_rows, run_app

from nemo_longctx.shared import console

BIN = Path(sys.executable).parent
APP = [str(BIN / "nemo-longctx"), "train"]
STEP_LINE = re.compile(r"^step (\d+)/(\d+) \| loss ([0-9.]+) \| tokens/s ", re.M)
MAX_LINES = 40


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    out_dir = tmp_path_factory.mktemp("console")
    # the console as a launch from a shell prints it: the ranks' fork server of the run's own, which imports the
    # libraries under the run's log.level (a shared warm server imported them, and printed what they print, once)
    code1, out1 = run_app(APP + ["trainer.max_steps=5", f"output_dir={out_dir}"], shared_ranks=False)
    rows1 = metrics_rows(out_dir) if (out_dir / "metrics.jsonl").exists() else []
    code2, out2 = run_app(APP + ["--verbose", "trainer.max_steps=2", f"output_dir={out_dir}"], shared_ranks=False)
    return {"dir": out_dir, "first": (code1, out1, rows1), "second": (code2, out2)}


def _summary(out: str) -> str:
    return next(ln for ln in out.splitlines() if ln.startswith("nemo-longctx: finished"))


# ---------------------------------------------------------------------------------------------------- end to end
def test_the_default_console_is_short_and_ends_with_a_summary(runs):
    code, out, rows = runs["first"]
    assert code == 0, out[-3000:]
    lines = out.splitlines()
    assert len(lines) <= MAX_LINES, f"{len(lines)} lines:\n{out}"
    steps = STEP_LINE.findall(out)
    assert [int(s) for s, _, _ in steps] == [1, 2, 3, 4, 5] and {m for _, m, _ in steps} == {"5"}, out
    train = [r for r in rows if "loss" in r]
    assert [r["step"] for r in train] == [1, 2, 3, 4, 5], rows
    # an ETA from the second step on (the first step is left out of it), shown while steps remain; no MFU on a CPU
    etas = [bool(re.search(r" \| eta \d+s", ln)) for ln in out.splitlines() if STEP_LINE.match(ln)]
    assert etas == [False, True, True, True, False], out
    assert ["eta_s" in r for r in train] == [False, True, True, True, True] and train[-1]["eta_s"] == 0, rows
    assert "mfu" not in out and not any("mfu" in r for r in train), out
    # auto-resume found nothing: said in our words (NeMo's own message is filtered)
    assert f"nemo-longctx: no checkpoint in {runs['dir'] / 'checkpoints'}: starting at step 0" in out, out
    summary = _summary(out)
    assert f"final loss {train[-1]['loss']:.5f}" in summary, summary
    assert float(steps[-1][2]) == pytest.approx(train[-1]["loss"], abs=1e-5)
    assert "steps 5/5" in summary and "s from launch" in summary and "mean tokens/s" in summary, summary
    metrics = str(runs["dir"] / "metrics.jsonl")
    assert re.search(rf"^nemo-longctx:\s+metrics:\s+{re.escape(metrics)}$", out, re.M), out
    assert "rank_logs" in out.split(summary, 1)[1], out
    # third-party noise is gone (it is still in --verbose, below)
    for noise in ("Transformer Engine and Apex are not installed", "pynvml", "[NeMo I", "megatron_init",
                  "OneLogger", "NumExpr"):
        assert noise not in out, (noise, out)


def test_verbose_prints_what_the_libraries_print(runs):
    code, out = runs["second"]
    assert code == 0, out[-3000:]
    assert len(out.splitlines()) > len(runs["first"][1].splitlines()) + 20, out[-3000:]
    assert "[NeMo I" in out and "Transformer Engine and Apex are not installed" in out, out[-3000:]
    assert [int(s) for s, _, _ in STEP_LINE.findall(out)] == [1, 2], out[-3000:]
    assert "steps 2/2" in _summary(out)


def test_a_second_fresh_run_keeps_the_first_runs_metrics(runs):
    out_dir, (_, _, rows1), (code, out) = runs["dir"], runs["first"], runs["second"]
    assert code == 0, out[-3000:]
    moved = out_dir / "runs" / "run_1" / "metrics.jsonl"
    assert f"the previous run's metrics.jsonl moved to {moved}" in out, out[-3000:]
    assert [json.loads(ln) for ln in moved.read_text().splitlines()] == rows1  # the first run's rows, untouched
    assert [r["step"] for r in metrics_rows(out_dir) if "loss" in r] == [1, 2]  # the second run's own file
    assert not (out_dir / "runs" / "run_2").exists()


# ---------------------------------------------------------------------------------------------------- console.py
def test_take_verbose_turns_the_flag_into_an_override():
    assert console.take_verbose(["a=1", "--verbose", "b=2"]) == (["a=1", "++log.level=debug", "b=2"], "debug")
    assert console.take_verbose(["a=1"]) == (["a=1"], "info")
    assert console.take_verbose(["log.level=debug"])[1] == "debug"
    assert console.take_verbose(["--verbose", "log.level=info"])[1] == "info"  # the last one wins, as in Hydra
    assert console.take_verbose(["++log.level='debug'"])[1] == "debug"
    assert console.take_verbose(["log.level=loud"])[1] == "info"  # left to the option model to refuse


def test_rank_from_env():
    assert console.rank_from_env({}) == 0
    assert console.rank_from_env({"RANK": "3"}) == 3
    assert console.rank_from_env({"SLURM_PROCID": "2", "SLURM_STEP_ID": "0"}) == 2
    assert console.rank_from_env({"SLURM_PROCID": "2"}) == 0  # a batch script's shell, not a srun task


def test_noise_patterns():
    for msg in ("The pynvml package is deprecated. Please install nvidia-ml-py instead.",
                "Transformer Engine and Apex are not installed. Falling back to Torch optimizers.",
                "Failed to create unified memory mempool.",
                "transformers version 4.57.6 is incompatible with nvidia-modelopt and may cause issues.",
                "You called `self.log('global_step', ...)` in your `training_step` but the value needs to be floating"):
        assert console.is_noise(msg), msg
    assert not console.is_noise("the loss is NaN at step 3")


def test_eta_and_durations():
    assert console.eta_seconds([], 10) is None
    assert console.eta_seconds([2.0, 100.0, 3.0], 10) == 30.0  # the median: a checkpoint save does not swing it
    assert console.eta_seconds([2.0, 4.0], 5) == 15.0 and console.eta_seconds([2.0], 0) == 0.0
    assert [console.human_duration(s) for s in (0, 42.9, 185, 3600 * 3 + 12 * 60 + 59, 86400 * 2 + 3600 * 4 + 1)] == \
        ["0s", "42s", "3m05s", "3h12m", "2d04h"]


def test_model_flops_and_mfu_of_a_known_shape():
    from nemo_longctx.planner import flops
    from nemo_longctx.planner.model_shapes import KNOWN_SHAPES

    llama = KNOWN_SHAPES["llama3_8b"]
    assert llama.parameters() == 8_030_261_248  # Llama 3 8B
    fpt = 6 * 8_030_261_248 + 6 * 32 * 4096 * 8192  # + causal attention: 6 x layers x (heads x head dim) x seq
    assert flops.flops_per_token(llama, 8192) == fpt
    config = type("Config", (), dict(num_layers=32, hidden_size=4096, ffn_hidden_size=14336, num_attention_heads=32,
                                     num_query_groups=8, kv_channels=128, vocab_size=128256, gated_linear_unit=True,
                                     share_embeddings_and_output_weights=False, seq_length=8192))
    assert flops.model_flops_per_token(config) == fpt
    assert flops.model_flops_per_token(type("MoE", (config,), {"num_moe_experts": 8})) is None  # not this formula
    assert flops.model_flops_per_token(type("NoVocab", (config,), {"vocab_size": None})) is None
    # the dense bf16/fp16 peak of a named GPU; none on a CPU, an unknown GPU, or at fp32
    assert flops.peak_flops("NVIDIA H100 80GB HBM3", "bf16-mixed") == 989e12
    assert flops.peak_flops("NVIDIA H100 PCIe", "16-mixed") == 756e12
    assert flops.peak_flops("NVIDIA GH200 480GB", "bf16-mixed") == 989e12
    assert flops.peak_flops("NVIDIA A100-SXM4-80GB", "bf16-mixed") == 312e12
    for name, precision in ((None, "bf16-mixed"), ("NVIDIA GeForce RTX 4090", "bf16-mixed"),
                            ("NVIDIA H100 80GB HBM3", "32-true"), ("NVIDIA H100 80GB HBM3", "32")):
        assert flops.peak_flops(name, precision) is None, (name, precision)
    # 8 H100s training 80,000 tokens/s
    assert flops.mfu(fpt, 80_000, 989e12, 8) == pytest.approx(fpt * 80_000 / (8 * 989e12))
    assert flops.mfu(fpt, 80_000, 989e12, 8) == pytest.approx(0.5523, abs=1e-4)
    assert flops.mfu(fpt, 80_000, None, 8) is None and flops.mfu(None, 80_000, 989e12, 8) is None
    assert flops.mfu(fpt, float("inf"), 989e12, 8) is None


def test_step_line_shows_eta_and_mfu_when_known():
    row = {"step": 5, "loss": 12.097021, "tokens_per_s": 37287.4, "step_time_s": 0.2197, "elapsed_s": 1.93}
    assert console.step_line(row, 20) == \
        "step 5/20 | loss 12.09702 | tokens/s 37287 | step 0.22 s | elapsed 1.9 s"
    row.update(eta_s=11523.0, mfu=0.3851)
    assert console.step_line(row, 20, "activations 1.0 MiB") == ("step 5/20 | loss 12.09702 | tokens/s 37287 | step "
                                                                 "0.22 s | elapsed 1.9 s | eta 3h12m | mfu 38.5% | "
                                                                 "activations 1.0 MiB")
    assert " eta " not in console.step_line(dict(row, step=20, eta_s=0.0), 20)  # the last step: nothing left


def test_resume_lines():
    from types import SimpleNamespace

    from nemo_longctx.integrations.nemo.app import resume_line

    ckpt = "/out/checkpoints/step=3-consumed_samples=4.0-last/weights"  # NeMo names it by the step index logged
    assert resume_line(ckpt, "/out/checkpoints") == \
        f"resuming from {ckpt}: 4 steps done, training continues at step 5"
    assert resume_line("/ckpt/mine", None) == "resuming from /ckpt/mine"
    assert resume_line(None, "/out/checkpoints") == "no checkpoint in /out/checkpoints: starting at step 0"
    assert resume_line(None, "/out/checkpoints", skipped_damaged=True) == \
        "no intact checkpoint in /out/checkpoints: starting at step 0"
    assert resume_line(None, "/c", restore=SimpleNamespace(path="/out/pretrained")) == \
        "no checkpoint in /c: starting at step 0 from the weights of /out/pretrained"
    assert resume_line(None, None) is None  # checkpoint.resume=never: nothing was looked for


def _rows():
    return [
        {"step": 1, "loss": 7.0, "tokens_per_s": 1000.0, "peak_bytes": None},
        {"step": 2, "loss": 6.5, "tokens_per_s": 3000.0, "peak_bytes": 2 * 1024 ** 3},
        {"step": 2, "val_loss": 6.4},
    ]


def test_summarize_and_summary_lines(tmp_path):
    s = console.summarize(_rows())
    assert s == {"steps": 2, "last_step": 2, "final_loss": 6.5, "mean_tokens_per_s": 2000.0,
                 "peak_bytes": 2 * 1024 ** 3, "val_loss": 6.4}
    metrics, logs = tmp_path / "metrics.jsonl", tmp_path / "r"
    metrics.write_text("")
    logs.mkdir()
    lines = console.summary_lines(0, _rows(), 12.34, max_steps=4,
                                  paths=[("metrics", str(metrics)), ("checkpoints", None), ("rank logs", str(logs)),
                                         ("checkpoints", str(tmp_path / "never_written"))])
    assert lines[0] == ("nemo-longctx: finished in 12.3 s from launch | steps 2/4 | final loss 6.50000 | "
                        "val_loss 6.40000 | mean tokens/s 2000 | peak 2.0 GiB")
    # a path the run did not write is left out
    assert lines[1:] == [f"nemo-longctx:   metrics:     {metrics}", f"nemo-longctx:   rank logs:   {logs}"]
    failed = console.summary_lines(3, [], 1.0, max_steps=4)
    assert failed == ["nemo-longctx: FAILED (exit 3) in 1.0 s from launch | steps 0/4"]
    assert console.summarize([])["final_loss"] is None


def test_read_metrics_skips_bad_lines_and_old_files(tmp_path):
    path = tmp_path / "metrics.jsonl"
    assert console.read_metrics(str(path)) == []
    path.write_text('{"step": 1, "loss": 2.0}\nnot json\n\n[1]\n{"step": 2, "loss": 1.0}\n')
    assert [r["step"] for r in console.read_metrics(str(path))] == [1, 2]
    assert console.read_metrics(str(path), since=time.time() + 60) == []  # written before the run started


def test_archive_metrics_moves_to_the_next_free_run_dir(tmp_path):
    assert console.archive_metrics(str(tmp_path)) is None  # nothing to keep
    (tmp_path / "metrics.jsonl").write_text("")
    assert console.archive_metrics(str(tmp_path)) is None  # an empty file is not a run
    (tmp_path / "runs" / "run_1").mkdir(parents=True)
    (tmp_path / "runs" / "run_7").mkdir()
    (tmp_path / "runs" / "notes").mkdir()
    (tmp_path / "metrics.jsonl").write_text('{"step": 1}\n')
    dest = console.archive_metrics(str(tmp_path))
    assert dest == str(tmp_path / "runs" / "run_8" / "metrics.jsonl")
    assert Path(dest).read_text() == '{"step": 1}\n' and not (tmp_path / "metrics.jsonl").exists()
    assert console.next_run_dir(str(tmp_path)) == str(tmp_path / "runs" / "run_9")


@pytest.fixture
def restored_console(monkeypatch):
    """console.setup changes process-wide state: the warning filters, logger levels, the console level, the
    PYTHONWARNINGS its child processes inherit, and the filters of the root's stream handlers — pytest's own log
    capture handlers among them, which outlive the test: a ConsoleFilter left there hides every later test's INFO
    records from ``caplog``."""
    monkeypatch.setenv("PYTHONWARNINGS", "")
    names = console.THIRD_PARTY_LOGGERS + ("nemo_logger",)
    levels = {n: logging.getLogger(n).level for n in names}
    filters = list(logging.getLogger("nemo_logger").filters)

    def handlers():
        return logging.getLogger("nemo_logger").handlers + logging.getLogger().handlers

    handler_filters = {h: list(h.filters) for h in handlers()}
    state = dict(console._STATE, seen=set(console._STATE["seen"]))
    with warnings.catch_warnings():
        marker = getattr(warnings, "_nemo_longctx_quiet", None)
        yield
        if marker is None and hasattr(warnings, "_nemo_longctx_quiet"):
            del warnings._nemo_longctx_quiet
        else:
            warnings._nemo_longctx_quiet = marker
    for n, lv in levels.items():
        logging.getLogger(n).setLevel(lv)
    logging.getLogger("nemo_logger").filters[:] = filters
    for h in set(handlers()) | set(handler_filters):
        h.filters[:] = handler_filters.get(h, [f for f in h.filters if not isinstance(f, console.ConsoleFilter)])
    console._STATE.clear()
    console._STATE.update(state)


def _record(level: int, msg: str, name: str = "megatron.core.utils") -> logging.LogRecord:
    return logging.LogRecord(name, level, __file__, 1, msg, None, None)


def test_console_filter_levels_noise_and_duplicates(restored_console):
    f = console.ConsoleFilter()
    console.setup("info", rank=0)
    assert logging.getLogger("megatron").level == logging.WARNING
    assert not f.filter(_record(logging.INFO, "CPU patches applied"))
    assert not f.filter(_record(logging.WARNING, "fused_indices_to_multihot has reached end of life."))
    assert f.filter(_record(logging.WARNING, "something real"))
    assert not f.filter(_record(logging.WARNING, "something real"))  # once
    assert f.filter(_record(logging.ERROR, "an error")) and f.filter(_record(logging.ERROR, "an error"))
    console.setup("info", rank=1)
    assert logging.getLogger("megatron").level == logging.ERROR
    assert not f.filter(_record(logging.WARNING, "another real one")) and f.filter(_record(logging.ERROR, "e"))
    console.setup("debug", rank=1)
    assert f.filter(_record(logging.INFO, "CPU patches applied"))
    with pytest.raises(ValueError, match="log.level"):
        console.setup("loud")


def test_warning_filters_once_and_noise(restored_console, capsys):
    warnings.resetwarnings()
    console.setup("info", rank=0)
    # never an 'ignore' filter for a whole category: NeMo's captured-warnings hook would then drop every UserWarning
    assert not any(a == "ignore" and c is UserWarning for a, _, c, _, _ in warnings.filters)
    with warnings.catch_warnings(record=True) as seen:
        for _ in range(3):
            warnings.warn("Transformer Engine and Apex are not installed. Falling back", UserWarning)
            warnings.warn("a real warning", UserWarning)
    assert [str(w.message) for w in seen] == ["a real warning"]
    assert "ignore:The pynvml package is deprecated:FutureWarning" in os.environ["PYTHONWARNINGS"].split(",")


def test_since_launch_counts_from_the_process_start():
    t = console.since_launch()
    assert t >= time.time() - console._IMPORTED_AT and t < 24 * 3600
    assert abs(console.process_start_time() - (time.time() - console.since_launch())) < 1.0
