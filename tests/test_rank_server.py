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
    monkeypatch.setenv("PYTHONUNBUFFERED", "1")  # as the launchers have it (``_launch``)
    monkeypatch.setenv("PROBE_SERVER_ONLY", "1")  # in the server's environment, not in the launchers'
    srv = rank_server.start(["json"])
    monkeypatch.delenv("PROBE_SERVER_ONLY")
    yield srv
    srv.close()


def _launch(probe: Path, args, server=None, preload="json", extra_env=None, **popen):
    env = {k: v for k, v in os.environ.items() if k != rank_server.VAR}
    env.update(PROBE_MARK="launcher", PYTHONUNBUFFERED="1", **({rank_server.VAR: server} if server else {}),
               **(extra_env or {}))
    popen = {"stdout": subprocess.PIPE, "stderr": subprocess.PIPE, **popen}
    return subprocess.Popen([sys.executable, str(probe / "launcher.py"), preload, *args], cwd=probe / "work", env=env,
                            text=True, **popen)


def _kill_and_wait_for_no_children(launcher: subprocess.Popen, server, message: str) -> None:
    """SIGKILL ``launcher`` (no handler of it runs), then assert the server has no live child within 20 s."""
    launcher.kill()
    launcher.wait(timeout=30)
    deadline = time.time() + 20
    while server.children() and time.time() < deadline:
        time.sleep(0.1)
    assert server.children() == [], message


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
        _kill_and_wait_for_no_children(p, server, "ranks of a SIGKILLed launcher are still alive")
    finally:
        if p.poll() is None:
            p.kill()


def test_a_server_that_cannot_serve_the_launch_is_refused(probe, server):
    other = rank_server.start(["json"])
    other.close()
    offline = {"HF_HUB_OFFLINE": "1"} if os.environ.get("HF_HUB_OFFLINE") != "1" else {"HF_HUB_OFFLINE": "0"}
    cases = {
        "missing import": (server.env(), "json,csv", {}, "the rank server does not import csv"),
        "ended": (other.env(), "json", {}, f"the rank server (pid {other.pid}) is not running"),
        "not an address": ("/tmp/socket", "json", {}, "is not a rank server's address"),
        # a setting the frameworks read as they are imported: the ranks would have the server's
        "other HF settings": (server.env(), "json", offline,
                              f"HF_HUB_OFFLINE (this launch: {offline['HF_HUB_OFFLINE']}, the server: "
                              f"{os.environ.get('HF_HUB_OFFLINE', 'unset')})"),
    }
    for name, (value, preload, extra, message) in cases.items():
        p = _launch(probe, [], value, preload=preload, extra_env=extra)
        out, err = p.communicate(timeout=120)
        assert p.returncode == 2 and f"nemo-longctx: {rank_server.VAR}" in err and message in err, (name, err[-2000:])
        assert not _ranks(out), name
    assert server.children() == []


CHECKER = """\
import json, os, sys, time
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from nemo_longctx.options import ConfigError


def check(what):
    print("the check's stdout", flush=True)
    print("the check's stderr", file=sys.stderr, flush=True)
    if what == "refuse":
        raise ConfigError(["a.b=1: not so", "c.d=2: nor this"])
    if what == "crash":
        raise RuntimeError("the check broke")
    if what == "sleep":
        print(json.dumps({"sleeping": os.getpid()}), flush=True)
        time.sleep(120)
    heavy = sys.modules.get("probe_heavy")
    return {"pid": os.getpid(), "ppid": os.getppid(), "cwd": os.getcwd(), "mark": os.environ.get("PROBE_MARK"),
            "server_only": os.environ.get("PROBE_SERVER_ONLY"), "heavy_from": heavy.IMPORTED_BY if heavy else None}


if __name__ == "__main__":
    from nemo_longctx.shared.launch import call_with_rank_imports

    try:
        got = call_with_rank_imports(check, (sys.argv[2],), preload=["probe_heavy"], start_method=sys.argv[1],
                                     expected=(ConfigError,))
    except ConfigError as e:
        print(json.dumps({"problems": e.problems}))
        sys.exit(2)
    print(json.dumps({"launcher": os.getpid(), "launcher_imported_heavy": "probe_heavy" in sys.modules, **got}))
"""


def test_the_launchers_check_runs_where_the_ranks_imports_are(tmp_path, monkeypatch):
    """``launch.call_with_rank_imports`` (the Bridge app's check of its run before any rank starts): in a process
    forked from the ranks' fork server -- the launcher's own, or a shared one -- with the launcher's environment,
    working directory, stdout and stderr; in the launcher itself with ``spawn``. Its value, its ``ConfigError`` (every
    problem) and any other failure (a traceback, exit 1) come back; a SIGKILLed launcher leaves no check running."""
    (tmp_path / "checker.py").write_text(CHECKER)
    (tmp_path / "probe_heavy.py").write_text("import os\nIMPORTED_BY = os.getpid()\n")
    (tmp_path / "work").mkdir()
    # a fork server's path is its environment's (Python 3.11's ignores the sys.path it is handed): PYTHONPATH
    path = os.pathsep.join([str(tmp_path), *filter(None, [os.environ.get("PYTHONPATH")])])
    monkeypatch.setenv("PYTHONPATH", path)
    monkeypatch.setenv("PROBE_SERVER_ONLY", "1")
    server = rank_server.start(["probe_heavy"])
    monkeypatch.delenv("PROBE_SERVER_ONLY")

    def run(method, what, shared=None, **popen):
        env = {k: v for k, v in os.environ.items() if k != rank_server.VAR}
        env.update(PROBE_MARK="launcher", **({rank_server.VAR: shared} if shared else {}))
        popen = {"stdout": subprocess.PIPE, "stderr": subprocess.PIPE, **popen}
        return subprocess.Popen([sys.executable, str(tmp_path / "checker.py"), method, what], cwd=tmp_path / "work",
                                env=env, text=True, **popen)

    try:
        for how, method, shared in (("own server", "forkserver", None), ("shared", "forkserver", server.env()),
                                    ("spawn", "spawn", None)):
            p = run(method, "ok", shared)
            out, err = p.communicate(timeout=120)
            assert p.returncode == 0, (how, err[-3000:])
            got = json.loads(out.splitlines()[-1])
            assert "the check's stdout" in out and "the check's stderr" in err, (how, out, err)  # its streams
            assert got["cwd"] == str(tmp_path / "work") and got["mark"] == "launcher", (how, got)
            assert got["server_only"] is None, (how, got)  # the launcher's environment, not the server's
            if method == "spawn":  # no fork server: the check runs in the launcher
                assert got["pid"] == got["launcher"], (how, got)
            else:  # forked from the server that imported the ranks' modules; the launcher imported none of them
                assert got["pid"] != got["launcher"] and got["heavy_from"] == got["ppid"], (how, got)
                assert not got["launcher_imported_heavy"], (how, got)
                assert (got["ppid"] == server.pid) == (how == "shared"), (how, got, server.pid)

        p = run("forkserver", "refuse", server.env())
        out, err = p.communicate(timeout=120)
        assert p.returncode == 2 and json.loads(out.splitlines()[-1]) == {"problems": ["a.b=1: not so",
                                                                                     "c.d=2: nor this"]}, (out, err)
        p = run("forkserver", "crash")
        out, err = p.communicate(timeout=120)
        assert p.returncode == 1 and "Traceback" in err and "RuntimeError: the check broke" in err, err[-3000:]
        assert err.count("Traceback") == 1, err[-3000:]  # printed once, by the check's process

        out_file = tmp_path / "sleep.txt"
        with open(out_file, "w") as f:
            p = run("forkserver", "sleep", server.env(), stdout=f)
        deadline = time.time() + 60
        while "sleeping" not in out_file.read_text():
            assert p.poll() is None and time.time() < deadline, p.stderr.read()[-3000:]  # type: ignore[union-attr]
            time.sleep(0.1)
        assert len(server.children()) == 1
        _kill_and_wait_for_no_children(p, server, "the check of a SIGKILLed launcher is still running")
    finally:
        server.close()
