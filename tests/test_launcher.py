"""The launcher end to end (real processes, gloo on CPU): failures fail, every rank trains the same config.

Local launch (the app starts its ranks with torch's elastic agent) and torchrun:
  * a rank raising at step 2, a rank SIGKILLed at step 2, a rank hanging (collective timeout ``launcher.timeout_s``):
    the launcher exits non-zero within a bounded time, naming the failed rank and its error;
  * SIGTERM to the launcher (what ``scancel`` sends) stops every rank and leaves no process of the run behind;
  * a user config directory with its own config name (3 layers, seq 2048) is what every rank trains;
  * ranks that resolve different configs refuse to train; ``--multirun`` is refused.
Every command runs under ``timeout`` + ``ulimit -v`` (tests/app_runner.py). The ranks of ``run_app``'s launches fork
from the test process's warm rank server (``shared/rank_server.py``); the aborted-rank case and the SIGTERM case start
their own server, as a launch from a shell does.
"""

from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from app_runner import MEMORY_LIMIT_KB, ROOT, leftover_processes, live_processes, metrics_rows, run_app

BIN = Path(sys.executable).parent
APP = [str(BIN / "nemo-longctx"), "train"]
TORCHRUN = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node=2", "-m",
            "nemo_longctx.apps.train"]
SMALL = ["model.seq_length=1024", "trainer.max_steps=4", "memory.track=false"]


def _metrics(out_dir: Path):
    return metrics_rows(out_dir)


def _timed(cmd, timeout=300, shared_ranks=True):
    """(exit code, output, seconds from the injected fault -- or the start when none was injected -- to the end).
    The ranks fork from the test process's warm rank server (``run_app``), or (``shared_ranks=False``) from a server
    of the launcher's own, as from a shell."""
    t0 = time.time()
    code, out = run_app(cmd, timeout, shared_ranks=shared_ranks)
    m = re.search(r"run\.fault: .* \(unix time ([0-9.]+)\)", out)
    return code, out, time.time() - (float(m.group(1)) if m else t0)


@pytest.mark.parametrize("launcher", ["local", "torchrun"])
def test_a_rank_raising_fails_the_run_and_names_the_rank(tmp_path, launcher):
    cmd = (APP if launcher == "local" else TORCHRUN) + [f"output_dir={tmp_path}", *SMALL, "run.fault=raise@2:1"]
    code, out, _ = _timed(cmd)
    assert code != 0, out[-3000:]
    assert "injected failure (run.fault) on rank 1 at step 2" in out, out[-3000:]
    if launcher == "local":
        assert "nemo-longctx: FAILED: rank 1 exit code 1: RuntimeError: injected failure" in out, out[-3000:]
    rows = _metrics(tmp_path)
    assert [r["step"] for r in rows] == [1], rows  # step 1 trained, step 2 never finished


def test_a_killed_rank_stops_the_others_within_bounded_time(tmp_path):
    code, out, elapsed = _timed(APP + [f"output_dir={tmp_path}", *SMALL, "run.fault=kill@2:0"])
    assert code == 128 + signal.SIGKILL, (code, out[-3000:])
    assert "nemo-longctx: FAILED: rank 0 killed by SIGKILL" in out, out[-3000:]
    # the surviving rank was blocked in a collective with the dead one: the agent stopped it
    assert elapsed < 60, elapsed


def test_an_aborted_rank_is_reported_with_its_last_stderr_lines(tmp_path):
    """A rank that dies by SIGABRT (a C++ std::terminate, a gloo/c10 fatal error, glibc's heap checks) prints its reason
    to stderr just before it dies: the launcher names the signal and quotes those lines, after the other ranks'
    consequential errors, and each rank's stderr is kept under <output_dir>/rank_logs."""
    code, out, elapsed = _timed(APP + [f"output_dir={tmp_path}", *SMALL, "run.fault=abort@2:1"], shared_ranks=False)
    assert code == 128 + signal.SIGABRT, (code, out[-3000:])
    assert "nemo-longctx: FAILED: rank 1 killed by SIGABRT" in out, out[-3000:]
    report = out[out.index("nemo-longctx: rank 1 (SIGABRT) last wrote to stderr ("):]
    quoted = [ln for ln in report.splitlines()[1:] if ln.startswith("nemo-longctx:   | ")]
    marker = quoted.index("nemo-longctx:   | run.fault: rank 1 aborts now (C++-style fatal error marker)")
    # then faulthandler's dump (train.main enables it in every rank): the fatal error and the Python frame that died
    assert quoted[marker + 1] == "nemo-longctx:   | Fatal Python error: Aborted", report
    assert any("callbacks.py" in ln and "in on_train_batch_start" in ln for ln in quoted[marker:]), report
    assert "nemo-longctx: rank 0 (" not in out  # the survivor was stopped by the agent: no last words quoted for it
    path = Path(report.split("last wrote to stderr (", 1)[1].split("):", 1)[0])
    assert path.is_relative_to(tmp_path / "rank_logs") and "aborts now" in path.read_text()
    assert elapsed < 60, elapsed
    assert not _run_processes(str(tmp_path)), "processes of the aborted run are still alive"


def test_a_hung_rank_ends_the_job_through_the_collective_timeout(tmp_path):
    code, out, elapsed = _timed(APP + [f"output_dir={tmp_path}", *SMALL, "run.fault=hang@2:1",
                                       "launcher.timeout_s=15", "launcher.shutdown_timeout_s=10"])
    assert code != 0, out[-3000:]
    # rank 0's ring exchange with the hung rank 1 timed out after launcher.timeout_s; the agent then stopped rank 1
    # (it ignores SIGTERM while hung: SIGKILL after launcher.shutdown_timeout_s). Both are named.
    assert "nemo-longctx: FAILED: rank 1 killed by SIG" in out, out[-3000:]
    assert "then, as a consequence, rank 0 exit code 1: RuntimeError:" in out and "Timed out waiting 15000ms" in out, \
        out[-3000:]
    assert elapsed < 15 + 10 + 35, elapsed  # launcher.timeout_s + launcher.shutdown_timeout_s + teardown


def _run_processes(marker: str):
    """The live processes of a run: the launcher (its command line mentions ``marker``, the run's unique output dir)
    and what it started (the ranks and their fork server carry this test's name: ``leftover_processes``)."""
    return live_processes(lambda cmdline, _: marker in cmdline) + leftover_processes()


def test_sigterm_to_the_launcher_stops_every_rank(tmp_path):
    out_file = tmp_path / "out.txt"
    shell = f"ulimit -v {MEMORY_LIMIT_KB}; exec {' '.join(APP)} output_dir={tmp_path} model.seq_length=1024 " \
            f"trainer.max_steps=100000 memory.track=false"
    with open(out_file, "w") as f:
        proc = subprocess.Popen(["bash", "-c", shell], cwd=ROOT, stdout=f, stderr=subprocess.STDOUT,
                                env={**os.environ, "PYTHONUNBUFFERED": "1"})
    try:
        deadline = time.time() + 240
        while "step 2/" not in out_file.read_text():
            assert proc.poll() is None and time.time() < deadline, out_file.read_text()[-3000:]
            time.sleep(1)
        assert len(_run_processes(str(tmp_path))) >= 3  # the launcher and its two ranks
        proc.send_signal(signal.SIGTERM)
        code = proc.wait(timeout=90)
    finally:
        if proc.poll() is None:
            proc.kill()
    out = out_file.read_text()
    assert code == 128 + signal.SIGTERM, (code, out[-3000:])
    assert "stopped by SIGTERM; all ranks were stopped" in out, out[-3000:]
    time.sleep(1)
    assert _run_processes(str(tmp_path)) == []  # no rank left behind


def test_run_timeout_stops_all_ranks(tmp_path):
    # a run that never ends: rank 1 hangs at step 2 (rank 0 waits for it in a collective; neither burns the CPU
    # meanwhile), with a collective timeout far past run.timeout_s; neither rank heeds SIGTERM there (SIGKILL after
    # launcher.shutdown_timeout_s)
    code, out, _ = _timed(APP + [f"output_dir={tmp_path}", "model.seq_length=1024", "trainer.max_steps=100000",
                                 "run.fault=hang@2:1", "run.timeout_s=20", "launcher.shutdown_timeout_s=5",
                                 "memory.track=false"])
    assert code == 124, (code, out[-3000:])
    assert "run.timeout_s=20 exceeded; all ranks were stopped" in out
    assert "rank 1 injects 'hang' at step 2" in out, out[-3000:]  # the run was hung when the timeout came
    assert _run_processes(str(tmp_path)) == []


USER_CONFIG = """\
# a user's own config: the packaged train config with 3 layers at seq 2048
defaults:
  - train
  - _self_
model:
  num_layers: 3
  seq_length: 2048
trainer:
  max_steps: 2
memory:
  track: false
"""


@pytest.mark.parametrize("launcher", ["local", "torchrun"])
def test_a_user_config_dir_and_name_reach_every_rank(tmp_path, launcher):
    conf = tmp_path / "myconf"
    conf.mkdir()
    (conf / "long3.yaml").write_text(USER_CONFIG)
    flags = ["--config-dir", str(conf), "--config-name", "long3"] if launcher == "local" else \
        ["-cd", str(conf), "--config-name=long3"]
    cmd = (APP if launcher == "local" else TORCHRUN) + flags + [f"output_dir={tmp_path / 'out'}"]
    code, out, _ = _timed(cmd)
    assert code == 0, out[-4000:]
    assert "Llama3Config 3 layers, seq 2048" in out, out[-3000:]
    rows = _metrics(tmp_path / "out")
    assert [r["step"] for r in rows] == [1, 2] and all(r["tokens"] == 2048 for r in rows)
    # every rank built 3 layers: the model check at fit start counts the attention layers on each rank
    assert out.count("nemo-longctx train: Llama3Config 3 layers") == 1  # printed by rank 0 only


def test_ranks_resolving_different_configs_refuse_to_train(tmp_path):
    # an interpolation that resolves per process: the launcher sees RANK unset (0), the ranks see 0 and 1 (a declared
    # key: the app refuses undeclared ones such as +run.note before any rank starts)
    code, out, _ = _timed(APP + [f"output_dir={tmp_path}", *SMALL, "seed='${oc.decode:${oc.env:RANK,0}}'"])
    assert code != 0, out[-3000:]
    assert "resolved a different config" in out or "resolved different configs" in out, out[-3000:]
    assert not (tmp_path / "metrics.jsonl").exists()


def test_multirun_is_refused():
    code, out = run_app(APP + ["--multirun", "cp.size=1,2"], 60)
    assert code == 2 and "--multirun/-m is not supported" in out, out


def test_the_reason_is_the_first_failed_ranks_exception_and_consequences_are_labelled():
    """The one-line reason is the recorded exception's own line (not a library's footer after it, not a traceback's
    frames), and ranks stopped because another failed come after the cause, labelled as consequences; an OS error
    (errno) is a cause even in a rank the agent then stopped."""
    import signal as _signal
    from types import SimpleNamespace

    from nemo_longctx.shared.launch import _consequence, _first_line, _root_cause_key

    footer = ("RuntimeError: Error(s) in loading state_dict: missing shard __1_0.distcp\n"
              "(1) Set ckpt_load_strictness=False to ignore\n"
              "(2) For more details see https://docs.nvidia.com/nemo-framework/user-guide/latest/knownissues.html")
    assert (_first_line({"message": footer})
            == "RuntimeError: Error(s) in loading state_dict: missing shard __1_0.distcp")
    tb = "Traceback (most recent call last):\n  File \"x.py\", line 1, in f\nValueError: bad value\nsome log line"
    assert _first_line(tb) == "ValueError: bad value"
    assert _first_line("") == "(no error recorded)"

    def failure(code, message, t):
        return SimpleNamespace(exitcode=code, message={"message": message}, timestamp=t,
                               signal_name=lambda: _signal.Signals(-code).name if code < 0 else "")

    disk = failure(-int(_signal.SIGTERM), "OSError: [Errno 28] No space left on device: '/ckpt/x.distcp'", 5)
    collective = failure(1, "CheckpointException ranks:dict_keys([])", 1)
    peer = failure(1, "RuntimeError: Connection closed by peer [127.0.0.1]:29500", 2)
    stopped = failure(-int(_signal.SIGTERM), "Signal 15 (SIGTERM) received by PID 42", 3)
    ranked = sorted({0: collective, 1: disk, 2: peer, 3: stopped}.items(), key=lambda kv: _root_cause_key(*kv))
    assert [r for r, _ in ranked] == [1, 0, 2, 3]
    assert not _consequence(disk) and all(_consequence(f) for f in (collective, peer, stopped))


def test_ranks_started_as_fresh_interpreters_train_like_forked_ones(tmp_path, tmp_path_factory):
    """``launcher.start_method=spawn`` (what ``auto`` picks with CUDA: a fresh interpreter per rank) trains the default
    job with the losses of the shared run, whose ranks were forked from the fork server (``auto`` without CUDA), to
    the last bit; an unknown start method is refused by name before anything starts."""
    from default_job import COMMON, STEPS, uninterrupted

    from nemo_longctx.shared.launch import start_method_for

    assert start_method_for(()) == "forkserver"  # this machine has no CUDA: what the shared run used
    with pytest.raises(ValueError, match="launcher.start_method='fork'"):
        start_method_for((), "fork")
    forked = [r["loss"] for r in _metrics(uninterrupted(tmp_path_factory)) if "loss" in r]
    plain = [a for a in COMMON if not a.startswith(("checkpoint.", "trainer.val", "trainer.limit_val"))]
    code, out = run_app(APP + [f"output_dir={tmp_path}", *plain, "checkpoint.every_n_steps=0",
                               "launcher.start_method=spawn"], 300)
    assert code == 0, out[-3000:]
    spawned = [r["loss"] for r in _metrics(tmp_path) if "loss" in r]
    assert len(spawned) == STEPS and spawned == forked[:STEPS], (spawned, forked)
    code, out = run_app(APP + [f"output_dir={tmp_path / 'refused'}", "launcher.start_method=fork"], 60)
    assert code == 2 and "launcher.start_method" in out and "forkserver" in out, out[-2000:]
