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
    code1, out1 = run_app(APP + ["trainer.max_steps=5", f"output_dir={out_dir}"])
    rows1 = metrics_rows(out_dir) if (out_dir / "metrics.jsonl").exists() else []
    code2, out2 = run_app(APP + ["--verbose", "trainer.max_steps=2", f"output_dir={out_dir}"])
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
