"""A rank server shared by many local launches (``shared/rank_server.py``, ``NEMO_LONGCTX_RANK_SERVER``): its ranks run
as ranks of a launcher's own server do -- the launcher's environment (not the server's), working directory, argv and
stdout -- and no rank outlives a launcher that is SIGKILLed; a server that cannot serve a launch is refused by name.

Real processes throughout: ``launch_local`` in a launcher process, a probe module as the ranks' program (no framework
imported: the checks here are the process plumbing; the train app's runs through a shared server are the rest of the
suite's, ``app_runner.run_app``).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest

from nemo_longctx.shared import rank_server

PROBE = """\
import json, os, sys, time
print(json.dumps({"rank": os.environ["RANK"], "cwd": os.getcwd(), "argv": sys.argv[1:], "pid": os.getpid(),
                  "ppid": os.getppid(), "mark": os.environ.get("PROBE_MARK"),
                  "server_only": os.environ.get("PROBE_SERVER_ONLY"),
                  "token": bool(os.environ.get("NEMO_LONGCTX_RUN_TOKEN"))}), flush=True)
if "sleep" in sys.argv:
    time.sleep(120)
"""
LAUNCHER = """\
import os, sys
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
if __name__ == "__main__":
    from nemo_longctx.shared.launch import launch_local
    preload, args = sys.argv[1].split(","), sys.argv[2:]
    sys.exit(launch_local(2, args, 1, module="probe_rank", preload=preload))
"""


@pytest.fixture
def probe(tmp_path):
    (tmp_path / "probe_rank.py").write_text(PROBE)
    (tmp_path / "launcher.py").write_text(LAUNCHER)
    (tmp_path / "work").mkdir()
    return tmp_path


@pytest.fixture
def server(monkeypatch):
    monkeypatch.setenv("PROBE_SERVER_ONLY", "1")  # in the server's environment, not in the launchers'
    srv = rank_server.start(["json"])
    monkeypatch.delenv("PROBE_SERVER_ONLY")
    yield srv
    srv.close()


def _launch(probe: Path, args, server=None, preload="json", **popen):
    env = {k: v for k, v in os.environ.items() if k != rank_server.VAR}
    env.update(PROBE_MARK="launcher", PYTHONUNBUFFERED="1", **({rank_server.VAR: server} if server else {}))
    popen = {"stdout": subprocess.PIPE, "stderr": subprocess.PIPE, **popen}
    return subprocess.Popen([sys.executable, str(probe / "launcher.py"), preload, *args], cwd=probe / "work", env=env,
                            text=True, **popen)


def _ranks(stdout: str) -> dict:
    rows = [json.loads(ln) for ln in stdout.splitlines() if ln.startswith("{")]
    return {r["rank"]: r for r in rows}


def test_a_rank_of_a_shared_server_runs_with_the_launchers_environment_cwd_and_stdout(probe, server):
    results = {}
    for how, value in (("shared", server.env()), ("own", None)):
        p = _launch(probe, ["a", "b c"], value)
        out, err = p.communicate(timeout=120)
        assert p.returncode == 0, err[-3000:]
        results[how] = _ranks(out)  # the ranks' prints reached the launcher's stdout
    for how, ranks in results.items():
        assert sorted(ranks) == ["0", "1"], (how, ranks)
        for r in ranks.values():
            assert r["cwd"] == str(probe / "work") and r["argv"] == ["a", "b c"], (how, r)
            assert r["mark"] == "launcher" and r["token"], (how, r)  # the launcher's environment ...
            assert r["server_only"] is None, (how, r)  # ... not the server's
    assert {r["ppid"] for r in results["shared"].values()} == {server.pid}  # forked by the shared server
    assert server.pid not in {r["ppid"] for r in results["own"].values()}
    assert server.children() == []


def test_a_killed_launcher_leaves_no_rank_of_a_shared_server(probe, server, tmp_path):
    out_file = tmp_path / "out.txt"
    with open(out_file, "w") as f:
        p = _launch(probe, ["sleep"], server.env(), stdout=f)
    try:
        deadline = time.time() + 120
        while len(_ranks(out_file.read_text())) < 2:
            assert p.poll() is None and time.time() < deadline, p.stderr.read()[-3000:]  # type: ignore[union-attr]
            time.sleep(0.2)
        pids = [r["pid"] for r in _ranks(out_file.read_text()).values()]
        assert sorted(server.children()) == sorted(pids)
        p.kill()  # SIGKILL: no handler of the launcher runs
        p.wait(timeout=30)
        deadline = time.time() + 20
        while server.children() and time.time() < deadline:
            time.sleep(0.1)
        assert server.children() == [], "ranks of a SIGKILLed launcher are still alive"
    finally:
        if p.poll() is None:
            p.kill()


def test_a_server_that_cannot_serve_the_launch_is_refused(probe, server):
    other = rank_server.start(["json"])
    other.close()
    cases = {
        "missing import": (server.env(), "json,csv", "the rank server does not import csv"),
        "ended": (other.env(), "json", f"the rank server (pid {other.pid}) is not running"),
        "not an address": ("/tmp/socket", "json", "is not a rank server's address"),
    }
    for name, (value, preload, message) in cases.items():
        p = _launch(probe, [], value, preload=preload)
        out, err = p.communicate(timeout=120)
        assert p.returncode == 2 and f"nemo-longctx: {rank_server.VAR}" in err and message in err, (name, err[-2000:])
        assert not _ranks(out), name
    assert server.children() == []
