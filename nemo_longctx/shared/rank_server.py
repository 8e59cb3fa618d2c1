"""A warm rank server shared by many local launches: the frameworks imported once, every rank of every run forked from
there (standard library only).

A local launch without CUDA forks its ranks from a fork server that imports the frameworks every rank needs (NeMo,
Megatron-core, Lightning: ~10 s of one core) -- one server per run. A process that starts many short runs one after
the other (a test suite, a notebook, a sweep of tiny runs) can start one server itself (``start``) and hand its
address to the runs it launches in the environment variable ``NEMO_LONGCTX_RANK_SERVER`` (``RankServer.env``); a
launch that finds it forks its ranks from that server (``attach``) instead of starting one of its own. What a rank
sees is the same either way: the launcher's environment, working directory, ``sys.path`` and standard output are
handed to each rank (``launch.run_rank``); the ranks lead their own sessions, and the launcher's reaper stops those
sessions however the launcher ends (``reaper``), as it stops the ranks of a server of its own.

The server is Python's own (``multiprocessing.forkserver``: ``main`` serves fork requests on a Unix socket); it ends
when the process that started it closes it (``RankServer.close``) or exits. It serves the Python it was started with
and imports what it was started with: a launch refuses a server of another Python, or one that lacks a module the
launch preloads (its ranks would import it themselves, each, silently slow). What the interpreter or a library reads
from the environment once, as it starts or is imported, is the server's in every rank: a launch whose
``PYTHONPATH``, ``PYTHONHASHSEED``, ``PYTHONUNBUFFERED`` or Hugging Face settings (``HF_HOME``, ``HF_HUB_OFFLINE``,
...: ``import_time_settings``) differ from the server's is refused, naming them.
"""

from __future__ import annotations

import json
import os
import signal
import sys
from dataclasses import dataclass
from typing import Dict, List, Mapping, Optional, Sequence, Tuple

from nemo_longctx.shared.reaper import proc_stat

VAR = "NEMO_LONGCTX_RANK_SERVER"  # in a launcher's environment: the server its ranks fork from (``RankServer.env``)
SERVER_ENV: Optional[dict] = None  # in the server (and the ranks it forks): its environment as it started
# what every server imports first (the console of a rank; the launcher's own module, which runs each rank)
BASE_PRELOAD = ("nemo_longctx.shared.rank_preamble", "nemo_longctx.shared.launch")
# environment variables read once, as the interpreter starts or the frameworks are imported: a forked rank has the
# server's values -- the interpreter's path (and a sitecustomize on it), hash seed and stdout buffering, and Hugging
# Face's hub settings (module constants of huggingface_hub and transformers: HF_HOME, HF_HUB_OFFLINE, ...). (Warning
# filters are set again in each rank by the console, ``console.setup``.)
IMPORT_TIME_VARS = ("PYTHONPATH", "PYTHONHASHSEED", "PYTHONUNBUFFERED")
IMPORT_TIME_PREFIXES = ("HF_", "HUGGINGFACE_", "TRANSFORMERS_")


def import_time_settings(env: Mapping[str, str]) -> Dict[str, str]:
    """The variables of ``env`` a rank forked from a server gets from the server's environment, not the launcher's
    (``IMPORT_TIME_VARS``, ``IMPORT_TIME_PREFIXES``)."""
    return {k: v for k, v in sorted(env.items()) if k in IMPORT_TIME_VARS or k.startswith(IMPORT_TIME_PREFIXES)}


@dataclass(frozen=True)
class ServerAddress:
    """What a launch needs of a running server: its socket, its pid, the Python it runs, what it imported, and the
    settings it imported them with (``import_time_settings`` of its environment)."""

    address: str
    pid: int
    executable: str
    preload: Tuple[str, ...]
    settings: Tuple[Tuple[str, str], ...] = ()

    def env(self) -> str:
        return json.dumps({"address": self.address, "pid": self.pid, "executable": self.executable,
                           "preload": list(self.preload), "settings": dict(self.settings)})

    def differences(self, env: Mapping[str, str]) -> List[str]:
        """The ``import_time_settings`` of ``env`` (a launch's environment) that differ from this server's, each as
        ``NAME (this launch: ..., the server: ...)``; empty when a rank forked from it would see the launch's."""
        ours, its = import_time_settings(env), dict(self.settings)
        return [f"{k} (this launch: {ours.get(k, 'unset')}, the server: {its.get(k, 'unset')})"
                for k in sorted(set(ours) | set(its)) if ours.get(k) != its.get(k)]

    @classmethod
    def parse(cls, value: str) -> "ServerAddress":
        try:
            d = json.loads(value)
            return cls(str(d["address"]), int(d["pid"]), str(d["executable"]), tuple(map(str, d["preload"])),
                       tuple((str(k), str(v)) for k, v in dict(d["settings"]).items()))
        except (ValueError, KeyError, TypeError) as e:
            raise ValueError(f"{VAR}={value!r} is not a rank server's address (start one with "
                             f"nemo_longctx.shared.rank_server.start): {e}") from None


class RankServer:
    """A fork server started by this process (``start``); ``env()`` is the value of ``VAR`` for the launches that
    use it; ``close()`` ends it (so does this process's exit)."""

    def __init__(self, preload: Sequence[str]) -> None:
        from multiprocessing import forkserver

        self._server = forkserver.ForkServer()  # a server of its own, not this process's default one
        self.preload = tuple(dict.fromkeys([*BASE_PRELOAD, *preload]))
        self._server.set_forkserver_preload(list(self.preload))
        self._server.ensure_running()  # (the server inherits this process's environment, as it is now)
        self.address = ServerAddress(str(self._server._forkserver_address), int(self._server._forkserver_pid),
                                     sys.executable, self.preload, tuple(import_time_settings(os.environ).items()))
        self.pid = self.address.pid

    def env(self) -> str:
        return self.address.env()

    def serves(self, env: Mapping[str, str]) -> bool:
        """Whether a launch with environment ``env`` can fork its ranks from this server (``attach`` would refuse
        one whose start-up settings differ: ``ServerAddress.differences``)."""
        return not self.address.differences(env)

    def children(self) -> list:
        """Pids of the live processes this server forked that are still running (its ranks; none between runs)."""
        return children_of(self.pid)

    def close(self, timeout_s: float = 30.0) -> None:
        """End the server: EOF on its "alive" pipe (it exits once it has no request in flight), then reap it."""
        import time

        fd, self._server._forkserver_alive_fd = self._server._forkserver_alive_fd, None
        if fd is None:
            return
        os.close(fd)
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            if os.waitpid(self.pid, os.WNOHANG)[0]:
                return
            time.sleep(0.05)
        os.kill(self.pid, signal.SIGKILL)
        os.waitpid(self.pid, 0)


def children_of(pid: int, zombies: bool = False) -> list:
    """Pids of the children of process ``pid`` that are running (with ``zombies``: and those ended, not yet
    waited for)."""
    found = []
    for entry in os.listdir("/proc"):
        stat = proc_stat(int(entry)) if entry.isdigit() else None
        if stat is not None and int(stat[1]) == pid and (zombies or stat[0] != "Z"):
            found.append(int(entry))
    return found


def start(preload: Sequence[str]) -> RankServer:
    """Start a rank server that imports ``preload`` (the module names a launch passes as its ``preload``: for the
    train app, ``nemo_longctx.apps.train.RANK_PRELOAD``) once; returns when it is listening (its imports may still be
    running: the first rank waits for them)."""
    return RankServer(preload)


def attach(value: str, preload: Sequence[str]) -> ServerAddress:
    """Make this process's ``forkserver`` start method fork from the server of ``value`` (``VAR``'s value) rather
    than start a server of its own; ``preload``: what this launch's ranks need imported. Raises ``ValueError`` naming
    the problem when that server cannot serve them: another Python, a module missing from its imports, or gone."""
    from multiprocessing import forkserver

    server = ServerAddress.parse(value)
    if os.path.realpath(server.executable) != os.path.realpath(sys.executable):
        raise ValueError(f"{VAR}: the rank server runs {server.executable}, this launch {sys.executable}: a rank "
                         "must run the launcher's Python")
    missing = [m for m in [*BASE_PRELOAD, *preload] if m not in server.preload]
    if missing:
        raise ValueError(f"{VAR}: the rank server does not import {', '.join(missing)} (it imports "
                         f"{', '.join(server.preload)}): start it with this launch's preload")
    differ = server.differences(os.environ)
    if differ:
        raise ValueError(f"{VAR}: {', '.join(differ)}: read as the interpreter starts or the frameworks are "
                         "imported, so a rank forked from the server would have the server's: start the server with "
                         "this launch's environment")
    try:
        os.kill(server.pid, 0)
    except ProcessLookupError:
        raise ValueError(f"{VAR}: the rank server (pid {server.pid}) is not running") from None
    if not os.path.exists(server.address):
        raise ValueError(f"{VAR}: the rank server's socket {server.address} is gone")
    default = forkserver._forkserver
    known = ("_lock", "_forkserver_address", "_forkserver_alive_fd", "_forkserver_pid")
    if not all(hasattr(default, a) for a in known) or hasattr(default, "_forkserver_authkey"):
        # written against the fork server of CPython 3.11-3.13 (a later one authenticates its clients)
        raise ValueError(f"{VAR}: this Python's fork server ({sys.version.split()[0]}) is not one a launch can share")
    with default._lock:
        if isinstance(default.ensure_running, _EnsureAlive) and default.ensure_running.server == server:
            return server  # attached already (a launch that ran a check in it first: launch.call_with_rank_imports)
        if default._forkserver_pid is not None:
            raise ValueError(f"{VAR}: this process already started a fork server of its own")
        read_end, alive = os.pipe()  # the "alive" fd each rank is handed: this launcher's, held while it lives
        os.close(read_end)
        default._forkserver_address = server.address
        default._forkserver_alive_fd = alive
        # the default ``ensure_running`` would start a server of this process's own (it knows only servers it
        # started: it waits on their pid); a server someone else started is checked to be alive instead
        default.ensure_running = _EnsureAlive(server)  # type: ignore[method-assign]
    return server


class _EnsureAlive:
    """``ForkServer.ensure_running`` for a server this process did not start: its resource tracker running (as the
    default one ensures), the server alive, else a clear error (not a new server)."""

    def __init__(self, server: ServerAddress) -> None:
        self.server = server

    def __call__(self) -> None:
        from multiprocessing import resource_tracker

        resource_tracker.ensure_running()  # (it locks itself)
        try:
            os.kill(self.server.pid, 0)
        except ProcessLookupError:
            raise RuntimeError(f"{VAR}: the rank server (pid {self.server.pid}) has ended") from None


def remember_environment() -> None:
    """In the server as it starts (``rank_preamble``): its environment, which every rank it forks starts with
    (``launch.run_rank`` swaps it for the launcher's)."""
    global SERVER_ENV
    SERVER_ENV = dict(os.environ)
