"""Process launching for the Hydra app: reuse torchrun's or srun's processes, or spawn local ones.

Every training process ends up with torchrun-style variables (RANK, LOCAL_RANK, WORLD_SIZE, LOCAL_WORLD_SIZE,
GROUP_RANK, MASTER_ADDR, MASTER_PORT) and Lightning's ``TorchElasticEnvironment``:
  * under torchrun they are already set;
  * under srun (a job step: SLURM_STEP_ID set; SLURM_PROCID, SLURM_STEP_NUM_TASKS or SLURM_NTASKS > 1,
    SLURM_LOCALID, SLURM_NODEID, SLURM_STEP_NODELIST / SLURM_JOB_NODELIST) they are derived from the Slurm
    variables (no torchrun needed);
  * otherwise the app starts ``trainer.devices`` local processes with PyTorch's elastic agent (``launch_local``,
    what ``torchrun --standalone`` runs), each running the app's module (``nemo_longctx.apps.train``) with the same
    command line, as ``python -m`` would.
"""

from __future__ import annotations

import logging
import os
import re
import shutil
import signal
import sys
import tempfile
import threading
import uuid
from dataclasses import dataclass
from typing import Any, Callable, Dict, Optional, Sequence, Tuple

from nemo_longctx.shared import rank_server
from nemo_longctx.shared.reaper import RUN_TOKEN_VAR
from nemo_longctx.shared.signals import PREEMPTED_EXIT


@dataclass(frozen=True)
class Launch:
    kind: str  # "torchrun" | "slurm" | "local"
    rank: int
    local_rank: int
    world_size: int
    local_world_size: int

    @property
    def num_nodes(self) -> int:
        return max(1, self.world_size // self.local_world_size)


def _first_host(nodelist: str) -> str:
    """First hostname of a Slurm nodelist such as 'node[03-05,07],gpu1' -> 'node03'."""
    m = re.match(r"([^,\[]+)(\[([^\]]+)\])?", nodelist.strip())
    if not m:
        return "127.0.0.1"
    prefix, _, ranges = m.groups()
    if not ranges:
        return prefix
    return prefix + ranges.split(",")[0].split("-")[0]


def _slurm(*names: str, default: str = "") -> str:
    for n in names:
        if os.environ.get(n):
            return os.environ[n]
    return default


def _slurm_local_world_size(ntasks: int) -> int:
    per_node = _slurm("SLURM_STEP_TASKS_PER_NODE", "SLURM_NTASKS_PER_NODE", "SLURM_TASKS_PER_NODE")
    m = re.match(r"(\d+)", per_node)
    if m:
        return int(m.group(1))
    nnodes = int(_slurm("SLURM_STEP_NUM_NODES", "SLURM_NNODES", default="1"))
    return max(1, ntasks // max(1, nnodes))


def detect_external_launch() -> Optional[Launch]:
    """The launch this process belongs to if torchrun or srun started it (with more than one task), else None.

    Under srun, fills in the torchrun-style variables from the Slurm ones.
    """
    env = os.environ
    if all(k in env for k in ("RANK", "LOCAL_RANK", "WORLD_SIZE", "LOCAL_WORLD_SIZE")):
        return Launch("torchrun", int(env["RANK"]), int(env["LOCAL_RANK"]), int(env["WORLD_SIZE"]),
                      int(env["LOCAL_WORLD_SIZE"]))
    # srun tasks carry step variables; a batch script's own shell (not started by srun) does not.
    in_step = "SLURM_STEP_ID" in env or "SLURM_STEPID" in env
    ntasks = int(_slurm("SLURM_STEP_NUM_TASKS", "SLURM_NTASKS", "SLURM_NPROCS", default="1"))
    if in_step and "SLURM_PROCID" in env and ntasks > 1:
        rank, local_rank = int(env["SLURM_PROCID"]), int(env.get("SLURM_LOCALID", "0"))
        local_ws = _slurm_local_world_size(ntasks)
        job = int(re.sub(r"\D", "", env.get("SLURM_JOB_ID", "0")) or 0)
        env.update(
            RANK=str(rank), LOCAL_RANK=str(local_rank), WORLD_SIZE=str(ntasks), LOCAL_WORLD_SIZE=str(local_ws),
            GROUP_RANK=env.get("SLURM_NODEID", "0"),
        )
        env.setdefault("MASTER_ADDR", _first_host(_slurm("SLURM_STEP_NODELIST", "SLURM_JOB_NODELIST", "SLURM_NODELIST",
                                                         default="127.0.0.1")))
        env.setdefault("MASTER_PORT", str(15000 + job % 20000))
        return Launch("slurm", rank, local_rank, ntasks, local_ws)
    return None


def launch_local(nproc: int, argv: Sequence[str], threads_per_process: int, *, wall_timeout_s: Optional[float] = None,
                 shutdown_timeout_s: int = 30, env: Optional[Dict[str, str]] = None,
                 log_dir: Optional[str] = None, module: str = "nemo_longctx.apps.train",
                 forward_signals: Sequence[int] = (), signal_grace_s: float = 120.0,
                 preload: Sequence[str] = (), start_method: str = "auto") -> int:
    """Run ``module`` (default: ``nemo_longctx.apps.train``) as ``python -m <module> *argv`` would, on ``nproc`` local
    ranks started by PyTorch's elastic agent (the code ``torchrun --standalone`` runs: a c10d rendezvous on a port the
    OS picks, no restarts), and wait for them.

    How the ranks start (``start_method``, ``launcher.start_method``; ``auto``: ``start_method_for``): ``forkserver``
    -- one server process imports ``preload`` (the frameworks every rank needs: NeMo, Megatron-core, Lightning) once
    and forks each rank from there, so the ranks skip those ~20 s of imports each -- or ``spawn``, a fresh interpreter
    per rank. ``auto`` is ``forkserver`` on a machine without CUDA and ``spawn`` with CUDA: a framework may initialise
    CUDA as it is imported, and CUDA does not survive a fork.

    Returns 0 when every rank succeeded. When a rank fails (raises, exits non-zero or is killed) the agent stops the
    others (SIGTERM, SIGKILL after ``shutdown_timeout_s``); the failed rank, its exit code and its error (the
    traceback the rank recorded) are printed, and the exit code is returned (128 + signal for a killed rank).
    SIGTERM/SIGINT/SIGHUP to this process stop every rank (the agent's own signal handling) and return 128 + signal;
    ``wall_timeout_s`` stops the run the same way and returns 124. The signals of ``forward_signals`` (the run saves
    on them: ``signals``) are not the agent's: the first one is forwarded to every rank, which saves its step and
    exits with ``PREEMPTED_EXIT`` (returned); a second one, or ``signal_grace_s`` seconds without the ranks gone,
    stops every rank as above.

    Each rank runs in its own session (process group) and writes its pid to the run's rank-pid folder (the launcher
    forwards signals to exactly those processes). No process of the run outlives it: a small reaper process
    (``_Reaper``) SIGKILLs whatever still carries the run's token in its environment (ranks, their fork server and
    what they started, e.g. a checkpoint worker) once this process is gone, however it went (a SIGKILL included: the
    reaper reads a pipe that only this process holds open).

    Each rank's stderr goes to ``<log_dir>/<run id>_*/attempt_0/<local rank>/stderr.log`` (torch's own
    ``DefaultLogsSpecs`` layout; a temporary directory when ``log_dir`` is None) and is copied to this process's stderr
    as it is written, unprefixed (``_rank_stderr_logs``). A rank killed by a signal is reported with the last lines it
    wrote to stderr before it died: a C++ ``std::terminate``/gloo/c10 message, a glibc abort, faulthandler's traceback.
    """
    from torch.distributed.elastic.multiprocessing.api import SignalException
    from torch.distributed.elastic.multiprocessing.errors import ChildFailedError
    from torch.distributed.launcher.api import LaunchConfig, elastic_launch

    from nemo_longctx.shared import collector, console

    collector.resume()  # the app paused it at its entry: on again for the (long) wait on the ranks

    for k in [k for k in os.environ if k.startswith("SLURM_")]:
        os.environ.pop(k)  # a single-task Slurm allocation: the ranks are our processes, not Slurm's
    pid_dir = tempfile.mkdtemp(prefix="nemo-longctx-ranks-")
    os.environ.update(OMP_NUM_THREADS=str(threads_per_process), NEMO_LONGCTX_SPAWNED="1", **{
        LAUNCHER_PID_VAR: str(os.getpid()), RANK_PIDS_VAR: pid_dir, console.LOG_LEVEL_VAR: console.level()},
        **(env or {}))
    try:
        start_method = rank_start_method(preload, start_method)
    except RankServerError as e:
        shutil.rmtree(pid_dir, ignore_errors=True)
        print(f"nemo-longctx: {e}", file=sys.stderr, flush=True)
        return CONFIG_ERROR_EXIT
    forward = tuple(signal.Signals(s) for s in forward_signals)
    # the agent handles the signals it knows, except those forwarded (its handler would stop the ranks at once)
    agent_signals = ",".join(n for n in ("SIGTERM", "SIGINT", "SIGHUP", "SIGQUIT") if signal.Signals[n] not in forward)
    reaper = _Reaper(pid_dir)
    config = LaunchConfig(
        min_nodes=1, max_nodes=1, nproc_per_node=nproc, run_id=f"nemo-longctx-{uuid.uuid4().hex[:12]}",
        rdzv_backend="c10d", rdzv_endpoint="localhost:0", max_restarts=0, monitor_interval=0.5,
        start_method=start_method, shutdown_timeout=int(shutdown_timeout_s), logs_specs=_rank_stderr_logs(log_dir),
        signals_to_handle=agent_signals,
    )
    timed_out = threading.Event()
    timer = None
    if wall_timeout_s:
        def _expire() -> None:
            timed_out.set()
            os.kill(os.getpid(), signal.SIGINT)  # the agent's handler stops every rank

        timer = threading.Timer(float(wall_timeout_s), _expire)
        timer.daemon = True
        timer.start()
    forwarding = _SignalForwarding(forward, float(signal_grace_s), pid_dir=pid_dir, timed_out=timed_out)
    processes = _RankProcesses(pid_dir, nproc)
    agent_log = logging.getLogger("torch.distributed.elastic.multiprocessing.api")
    try:
        agent_log.addFilter(_agent_failure_record)
        forwarding.install()
        processes.start()
        elastic_launch(config, entrypoint=run_rank)(module, list(argv), _FromLauncher())
        return 0
    except ChildFailedError as e:
        failures = processes.failures(e.failures, config.logs_specs.error_files)  # type: ignore[union-attr]
        ranked = sorted(failures.items(), key=lambda kv: _root_cause_key(*kv))
        rank, failure = ranked[0]
        config.logs_specs.stop()  # type: ignore[union-attr]  # every rank's stderr is on the console and on disk
        if _preempted(failures.values()):
            return PREEMPTED_EXIT  # every rank saved and stopped (rank 0 printed where the checkpoint is)
        refused = config_error_of(failure)
        if refused is not None:  # the ranks refused the configuration: its one message, no table of tracebacks
            print(f"nemo-longctx: {refused}", file=sys.stderr, flush=True)
            _kill_process_groups(f.pid for f in failures.values())
            return CONFIG_ERROR_EXIT
        print(ChildFailedError(e.name, failures).format_msg(), file=sys.stderr, flush=True)  # torch's table, all ranks
        print(f"nemo-longctx: FAILED: rank {rank} {_describe(failure)}", file=sys.stderr, flush=True)
        for other, f in ranked[1:]:
            then = "then, as a consequence," if _consequence(f) else "then"
            print(f"nemo-longctx:   {then} rank {other} {_describe(f)}", file=sys.stderr, flush=True)
        for r, f in ranked:  # a dead rank's own last words (the surviving ranks' tracebacks are consequences)
            if _killed(f):
                tail = config.logs_specs.last_lines(f.local_rank)  # type: ignore[union-attr]
                path = config.logs_specs.stderr_path(f.local_rank)  # type: ignore[union-attr]
                print(f"nemo-longctx: rank {r} ({f.signal_name()}) last wrote to stderr ({path}):", file=sys.stderr)
                print("".join(f"nemo-longctx:   | {ln}\n" for ln in tail) or "nemo-longctx:   | (nothing)",
                      file=sys.stderr, end="", flush=True)
        code = failure.exitcode
        _kill_process_groups(f.pid for f in failures.values())
        return 128 - code if code < 0 else (code or 1)
    except SignalException as e:
        if timed_out.is_set():
            print(f"nemo-longctx: FAILED: run.timeout_s={wall_timeout_s} exceeded; all ranks were stopped",
                  file=sys.stderr, flush=True)
            return 124
        why = forwarding.why_stopped()
        print(f"nemo-longctx: stopped by {signal.Signals(e.sigval).name}{why}; all ranks were stopped",
              file=sys.stderr, flush=True)
        return 128 + int(e.sigval)
    finally:
        agent_log.removeFilter(_agent_failure_record)
        processes.stop()
        forwarding.uninstall()
        if timer is not None:
            timer.cancel()
        config.logs_specs.stop()  # type: ignore[union-attr]
        reaper.release()
        shutil.rmtree(pid_dir, ignore_errors=True)


LAUNCHER_PID_VAR = "NEMO_LONGCTX_LAUNCHER_PID"  # in a rank of the local launcher: the launcher's pid
RANK_PIDS_VAR = "NEMO_LONGCTX_RANK_PIDS"  # in a rank of the local launcher: the folder each rank writes its pid to
FORKED_RANK_VAR = "NEMO_LONGCTX_FORKED_RANK"  # set in a rank while ``run_rank`` runs it (``process_exit`` reads it)


START_METHODS = ("auto", "forkserver", "spawn")


def start_method_for(preload: Sequence[str], requested: str = "auto") -> str:
    """The start method of ``requested`` (one of ``START_METHODS``): ``auto`` is ``forkserver`` on a machine without
    CUDA, else ``spawn``; ``forkserver`` gets ``preload`` imported once in the server."""
    import multiprocessing

    if requested not in START_METHODS:
        raise ValueError(f"launcher.start_method={requested!r}: expected one of {', '.join(START_METHODS)}")
    if requested == "auto":
        import torch

        requested = "spawn" if torch.cuda.is_available() else "forkserver"
    if requested == "spawn":
        return "spawn"
    # the server imports these once; every rank forks from it (a module that fails to import is left to the rank,
    # which then reports the error itself)
    multiprocessing.get_context("forkserver").set_forkserver_preload(
        [*rank_server.BASE_PRELOAD, *preload])
    return "forkserver"


class RankServerError(ValueError):
    """The shared rank server named by ``rank_server.VAR`` cannot serve this launch (the message says why)."""


def rank_start_method(preload: Sequence[str], requested: str = "auto") -> str:
    """``start_method_for``, and with ``forkserver`` under ``rank_server.VAR`` that shared server attached (once per
    process: a second call finds it attached); ``RankServerError`` when it cannot serve ``preload``."""
    method = start_method_for(preload, requested)
    if method == "forkserver" and os.environ.get(rank_server.VAR):
        try:  # the ranks fork from a server started for many runs
            rank_server.attach(os.environ[rank_server.VAR], preload)
        except ValueError as e:
            raise RankServerError(str(e)) from None
    return method


class _FromLauncher:
    """One of each rank's arguments: the launcher's environment and standard output (``with_stderr``: and its
    standard error), taken as the rank is started (when its arguments are pickled) and handed to it (``adopt``). A
    rank forked from a fork server starts with the server's: the same as the launcher's when the launcher started the
    server, not when the server serves many runs (``rank_server``). A rank's stderr is the elastic agent's (its log
    file)."""

    def __init__(self, env: Optional[Dict[str, str]] = None, stdout: object = None, stderr: object = None,
                 *, with_stderr: bool = False) -> None:
        self.env, self.stdout, self.stderr, self.with_stderr = env, stdout, stderr, with_stderr

    def __reduce__(self):
        from multiprocessing import context, reduction

        # the launcher's stdout (and stderr) travel as file descriptors (multiprocessing passes them with the start)
        starting = context.get_spawning_popen() is not None
        stdout = reduction.DupFd(1) if starting else None
        stderr = reduction.DupFd(2) if starting and self.with_stderr else None
        return (_FromLauncher, (dict(os.environ), stdout, stderr))

    def adopt(self) -> None:
        """In the rank: the launcher's environment (plus what the elastic agent set for this rank: RANK & co.) and
        its stdout (and stderr). A spawned rank (a fresh interpreter started with them) keeps its own."""
        base = rank_server.SERVER_ENV  # the server's environment as it started (None in a spawned rank)
        if base is None:  # spawned: its own stdout is the launcher's, passed on as fd 1 itself
            return
        if self.env is not None:
            agent = {k: v for k, v in os.environ.items() if base.get(k) != v}
            os.environ.clear()
            os.environ.update(self.env)
            os.environ.update(agent)
        for stream, target in ((self.stdout, sys.stdout), (self.stderr, sys.stderr)):
            fd = stream.detach() if stream is not None else None  # type: ignore[attr-defined]
            if fd is not None and fd != target.fileno():  # forked: a copy of the launcher's, received at the start
                target.flush()
                os.dup2(fd, target.fileno())
                os.close(fd)


def call_with_rank_imports(fn: Callable[..., Any], args: Sequence[Any] = (), *, preload: Sequence[str] = (),
                           start_method: str = "auto", expected: Tuple[type, ...] = ()) -> Any:
    """``fn(*args)`` where the ranks' frameworks are imported already: in a process forked from the fork server the
    ranks of this launch will fork from (``start_method``, as ``launch_local`` takes it: the launcher's own server,
    started now with ``preload``, or a shared one, ``rank_server``), so this process imports none of ``preload`` --
    or, with ``spawn``, in this process. That process has this one's environment, working directory, standard output
    and error; it ends when this process ends. Returns what ``fn`` returns (picklable); an exception of ``expected``
    is raised here as it was raised there; any other one is printed there, as an uncaught exception is, and
    ``SystemExit(1)`` is raised here. ``RankServerError``: the shared server cannot serve ``preload``."""
    import multiprocessing

    from nemo_longctx.shared import console

    if rank_start_method(preload, start_method) != "forkserver":
        return fn(*args)
    os.environ[console.LOG_LEVEL_VAR] = console.level()  # the server's console (rank_preamble), as launch_local sets
    ctx = multiprocessing.get_context("forkserver")
    receive, send = ctx.Pipe(duplex=False)
    child = ctx.Process(target=_call_child, args=(send, _FromLauncher(with_stderr=True), os.getpid(), fn, tuple(args),
                                                  tuple(expected)), name="nemo-longctx-check")
    sys.stdout.flush()
    sys.stderr.flush()
    child.start()
    send.close()
    try:
        kind, value = receive.recv()
    except EOFError:  # it died before it answered (a signal, os._exit)
        child.join()
        raise RuntimeError(f"the process checking the run (forked from the ranks' fork server) ended with exit code "
                           f"{child.exitcode} before it answered") from None
    except BaseException:  # Ctrl-C or a signal here: the child goes too
        child.kill()
        child.join()
        raise
    finally:
        receive.close()
    child.join()
    if kind == "raised":
        raise value
    if kind == "failed":
        raise SystemExit(1)
    return value


def _call_child(send: Any, launcher: _FromLauncher, launcher_pid_: int, fn: Callable[..., Any], args: tuple,
                expected: tuple) -> None:
    """``call_with_rank_imports``' process: the launcher's environment and streams, killed when it ends."""
    import traceback

    launcher.adopt()
    _watch_launcher(launcher_pid_)
    try:
        answer: tuple = ("value", fn(*args))
    except expected as e:
        answer = ("raised", e)
    except BaseException:  # as Python prints an uncaught exception
        traceback.print_exc()
        answer = ("failed", None)
    sys.stdout.flush()
    sys.stderr.flush()
    send.send(answer)
    send.close()


def run_rank(module: str, argv: Sequence[str], launcher: Optional[_FromLauncher] = None) -> None:
    """A rank of ``launch_local``: ``python -m <module> *argv`` in this (forked or spawned) process, with the
    launcher's environment and stdout (``launcher``, ``_FromLauncher``).

    The rank leads its own session, as a rank ``torchrun`` starts does (so the launcher can stop what it started, and
    a Ctrl-C on the terminal reaches the launcher, not each rank), and writes its pid where the launcher reads it. An
    exit with status 0 (``sys.exit(0)``, ``process_exit.exit_process(0)``) returns, as the elastic agent expects of a
    rank that succeeded; any other status ends the process with it."""
    import runpy

    if launcher is not None:
        launcher.adopt()
    os.setsid()
    pid_dir = os.environ.get(RANK_PIDS_VAR)
    if pid_dir:
        with open(os.path.join(pid_dir, f"{os.environ['LOCAL_RANK']}.pid"), "w") as f:  # the agent sets LOCAL_RANK
            f.write(str(os.getpid()))
    os.environ[FORKED_RANK_VAR] = "1"
    sys.argv = [module, *argv]
    try:
        runpy.run_module(module, run_name="__main__", alter_sys=True)
    except SystemExit as e:
        if e.code not in (0, None):
            raise


def launcher_pid() -> int:
    """The process that started this rank: the local launcher (``LAUNCHER_PID_VAR``), else the parent (torchrun's
    agent, or srun's step daemon)."""
    return int(os.environ.get(LAUNCHER_PID_VAR) or os.getppid())


def _preempted(failures) -> bool:
    """Every rank either exited with ``PREEMPTED_EXIT`` or was stopped by the agent once another one had (the
    agent stops the others with SIGTERM when the first rank exits non-zero), and at least one saved."""
    codes = [getattr(f, "exitcode", 1) for f in failures]
    return PREEMPTED_EXIT in codes and all(c in (PREEMPTED_EXIT, -int(signal.SIGTERM)) for c in codes)


class _SignalForwarding:
    """The launcher's side of save-on-signal: the first of ``signals`` goes to every rank (the pids the ranks wrote to
    ``pid_dir``); a second signal, or ``grace_s`` seconds later, the agent's stop (SignalException)."""

    def __init__(self, signals: Sequence[signal.Signals], grace_s: float, pid_dir: str,
                 timed_out: threading.Event) -> None:
        self.signals, self.grace_s, self.pid_dir, self.timed_out = tuple(signals), grace_s, pid_dir, timed_out
        self.received: Optional[signal.Signals] = None
        self.grace_over = threading.Event()
        self._previous: Dict[signal.Signals, object] = {}
        self._timer: Optional[threading.Timer] = None

    def install(self) -> None:
        for s in self.signals:
            self._previous[s] = signal.signal(s, self._handle)

    def uninstall(self) -> None:
        if self._timer is not None:
            self._timer.cancel()
        for s, previous in self._previous.items():
            signal.signal(s, previous)  # type: ignore[arg-type]
        self._previous.clear()

    def why_stopped(self) -> str:
        if self.grace_over.is_set():
            return (f": the ranks had not saved and stopped run.signal_grace_s={self.grace_s:g} s after "
                    f"{self.received.name if self.received else 'the signal'}")
        if self.received is not None:
            return f" (a second signal after {self.received.name}: no checkpoint waited for)"
        return ""

    def _handle(self, signum: int, frame: object) -> None:
        from torch.distributed.elastic.multiprocessing.api import SignalException

        sig = signal.Signals(signum)
        if self.received is not None or self.timed_out.is_set():
            raise SignalException(f"Process {os.getpid()} got signal: {sig}", sigval=sig)
        self.received = sig
        ranks = list(_rank_pids(self.pid_dir))
        for pid in ranks:
            try:
                os.kill(pid, sig)
            except ProcessLookupError:
                pass
        print(f"nemo-longctx: {sig.name}: {len(ranks)} rank(s) save this step's checkpoint and stop (a second signal "
              f"stops them at once; run.signal_grace_s={self.grace_s:g} s)", file=sys.stderr, flush=True)

        def _expire() -> None:
            self.grace_over.set()
            os.kill(os.getpid(), sig)  # as a second signal: the agent's stop

        self._timer = threading.Timer(self.grace_s, _expire)
        self._timer.daemon = True
        self._timer.start()


def _rank_pids(pid_dir: str) -> Dict[int, int]:
    """{pid: local rank} of the ranks of this launch (the files ``run_rank`` wrote to ``pid_dir``)."""
    pids = {}
    for name in sorted(os.listdir(pid_dir)) if os.path.isdir(pid_dir) else ():
        try:
            with open(os.path.join(pid_dir, name)) as f:
                pids[int(f.read().strip())] = int(name.split(".")[0])
        except (OSError, ValueError):  # a rank writing its pid right now: it has not yet installed its handlers
            pass
    return pids


def _agent_failure_record(record: logging.LogRecord) -> bool:
    """Drops the agent's own line about a failed rank (with a traceback of its own process bookkeeping): the launcher
    reports every failed rank itself, with its error (kept under ``log.level=debug``)."""
    from nemo_longctx.shared import console

    return console.level() == "debug" or not str(record.msg).startswith("failed (exitcode")


class _RankProcesses:
    """Every rank's exit status, for the failure report. The elastic agent reports the first rank it finds failed
    when it starts ranks as processes of a function (``run_rank``), then stops the others; a rank that failed at the
    same moment, or that had to be killed (a hung one: SIGKILL after the shutdown timeout), would go unnamed. This
    keeps the ranks' ``multiprocessing`` process objects and, after a failure, adds each other rank that ended with a
    non-zero status, as the agent's report of command-line ranks does.

    The objects are taken once, as soon as every rank has written its pid (``multiprocessing.active_children()``,
    which also asks each child whether it ended: asked again while the agent waits on the same children, two threads
    could read one child's exit status and one of them would get a wrong one)."""

    def __init__(self, pid_dir: str, nproc: int, interval_s: float = 0.05) -> None:
        self.pid_dir, self.nproc, self.interval_s = pid_dir, nproc, interval_s
        self._seen: Dict[int, object] = {}
        self._done = threading.Event()
        self._thread = threading.Thread(target=self._watch, name="nemo-longctx-rank-processes", daemon=True)

    def start(self) -> None:
        self._thread.start()

    def stop(self) -> None:
        self._done.set()

    def _watch(self) -> None:
        import multiprocessing

        while not self._done.wait(self.interval_s):
            if len(_rank_pids(self.pid_dir)) >= self.nproc:
                self._seen = {p.pid: p for p in multiprocessing.active_children()}
                return

    def failures(self, reported: Dict[int, object], error_files: Dict[int, str]) -> Dict[int, object]:
        """``reported`` (rank -> ``ProcessFailure``) and every other rank that ended with a non-zero status."""
        from torch.distributed.elastic.multiprocessing.api import ProcessFailure

        failures = dict(reported)
        for pid, local_rank in _rank_pids(self.pid_dir).items():
            process = self._seen.get(pid)
            code = getattr(process, "exitcode", None)
            if local_rank not in failures and code not in (None, 0):
                failures[local_rank] = ProcessFailure(local_rank=local_rank, pid=pid, exitcode=int(code),
                                                      error_file=error_files.get(local_rank, ""))
        return failures


class _Reaper:
    """``python -m nemo_longctx.shared.reaper``: a process that outlives the launcher by a moment to SIGKILL every
    process still carrying this run's token (``RUN_TOKEN_VAR``, set in this process's environment, so every process
    a rank starts inherits it) and every process in a rank's session (the ranks write their pids to ``pid_dir``: a
    rank forked from a fork server was not started with this environment). It waits for EOF on a pipe whose write
    end only the launcher holds: the kernel closes it however the launcher ends. ``release()`` (the launcher's normal
    end) closes it now and waits for the sweep."""

    def __init__(self, pid_dir: str) -> None:
        import subprocess

        token = uuid.uuid4().hex
        env = {k: v for k, v in os.environ.items() if k != RUN_TOKEN_VAR}
        self._proc = subprocess.Popen([sys.executable, "-m", "nemo_longctx.shared.reaper", token, pid_dir],
                                      stdin=subprocess.PIPE, env=env, start_new_session=True, close_fds=True)
        os.environ[RUN_TOKEN_VAR] = token
        self.pid = self._proc.pid

    def release(self) -> None:
        import subprocess

        os.environ.pop(RUN_TOKEN_VAR, None)
        try:
            self._proc.stdin.close()  # type: ignore[union-attr]
            self._proc.wait(timeout=30)
        except (OSError, subprocess.TimeoutExpired):
            pass


def _rank_stderr_logs(log_dir: Optional[str]):
    """torch's ``DefaultLogsSpecs`` with every rank's stderr redirected to its file, copied to the console unprefixed
    by torch's own ``TailLog`` (torchrun's ``--tee`` would prefix each line with ``[default<N>]:``), so that a rank
    that dies by a signal can be reported with what it wrote last."""
    from torch.distributed.elastic.multiprocessing.api import DefaultLogsSpecs, Std
    from torch.distributed.elastic.multiprocessing.tail_log import TailLog

    class RankStderr(DefaultLogsSpecs):
        def __init__(self) -> None:
            super().__init__(log_dir=log_dir, redirects=Std.ERR)
            self._paths: Dict[int, str] = {}
            self.error_files: Dict[int, str] = {}
            self._tail: Optional[TailLog] = None

        def reify(self, envs):  # called by the agent before it starts the ranks
            dest = super().reify(envs)
            self._paths = {r: p for r, p in dest.stderrs.items() if p}
            self.error_files = dict(dest.error_files)
            self.stop()
            self._tail = TailLog("rank", self._paths, sys.stderr, {r: "" for r in self._paths}).start()
            return dest

        def stop(self) -> None:
            """Copy what is left of every rank's stderr to the console and stop following the files."""
            if self._tail is not None:
                self._tail.stop()
                self._tail = None

        def stderr_path(self, local_rank: int) -> str:
            return self._paths.get(local_rank, "(not redirected)")

        def last_lines(self, local_rank: int, n: int = 12) -> list:
            try:
                with open(self._paths[local_rank], "rb") as f:
                    f.seek(0, os.SEEK_END)
                    f.seek(max(0, f.tell() - 64 * 1024))
                    text = f.read().decode(errors="replace")
            except (KeyError, OSError):
                return []
            lines = [ln.rstrip() for ln in text.splitlines() if ln.strip()]
            fatal = [i for i, ln in enumerate(lines) if ln.startswith("Fatal Python error:")]
            if fatal:  # faulthandler's dump follows the C++/glibc message: quote both, not only the stack
                return lines[max(0, fatal[-1] - n // 2):fatal[-1] + 2 * n]
            return lines[-n:]

    return RankStderr()


CONFIG_ERROR_EXIT = 2  # a rank (or the launching process) refused the configuration: ConfigError


def config_error_of(failure: object) -> Optional[str]:
    """The message of a rank that exited refusing the configuration (exit 2 with a ``ConfigError`` recorded by
    ``record_error``), else None. Spawned ranks leave printing it to the launcher: one message, whichever rank found it
    first."""
    if getattr(failure, "exitcode", None) != CONFIG_ERROR_EXIT:
        return None
    message, prefix = _recorded(getattr(failure, "message", "")), "ConfigError: "
    return message[len(prefix):] if message.startswith(prefix) else None


def _killed(failure: object) -> bool:
    """Died by a signal other than the agent's own SIGTERM (which stops the surviving ranks)."""
    code = getattr(failure, "exitcode", 1)
    return code < 0 and -code != int(signal.SIGTERM)


def _kill_process_groups(pids) -> None:
    """SIGKILL what is left in the process groups of ranks that failed. Each rank leads its own group (the agent
    starts it in a new session) and the agent signals only the groups of ranks still alive, so the children of a rank
    that died (e.g. Megatron's asynchronous checkpoint worker) would otherwise outlive the run."""
    for pid in pids:
        try:
            os.killpg(pid, signal.SIGKILL)
        except (ProcessLookupError, PermissionError):
            pass


_PEER_ERRORS = ("connection closed by peer", "connection reset", "broken pipe", "socket closed", "timed out",
                "timeout", "nccl communicator was aborted")


def _consequence(failure: object) -> bool:
    """A failure that follows from another rank's: a lost or hung peer, a collective checkpoint error that lists no
    rank of its own, or the agent's SIGTERM to the surviving ranks -- unless its message names an OS error (errno),
    which is a cause wherever it appears (a full disk can surface in a rank the agent then stopped)."""
    code = getattr(failure, "exitcode", 1)
    message = _first_line(getattr(failure, "message", "")).lower()
    if "[errno" in message:
        return False
    return (any(p in message for p in _PEER_ERRORS) or "ranks:dict_keys([])" in message
            or (code < 0 and -code == int(signal.SIGTERM)))


def _root_cause_key(rank: int, failure: object) -> tuple:
    """Order failures so the root cause comes first: a rank killed by a signal other than the agent's own SIGTERM,
    then a rank whose error is not a consequence of another's (``_consequence``), then the earliest."""
    return (not _killed(failure), _consequence(failure), getattr(failure, "timestamp", 0), rank)


def _describe(failure: object) -> str:
    code = getattr(failure, "exitcode", 1)
    what = f"killed by {failure.signal_name()}" if code < 0 else f"exit code {code}"  # type: ignore[attr-defined]
    return f"{what}: {_first_line(getattr(failure, 'message', ''))}"


def _recorded(message: object) -> str:
    """The text of a failure's ``message``: the exception a rank recorded (the error file's ``{"message": ...}``
    written by ``record_error``), or a plain message."""
    if isinstance(message, dict):
        message = message.get("message", message)
    return str(message or "")


_EXCEPTION_LINE = re.compile(r"^[A-Za-z_][\w.]*(Error|Exception|Interrupt|Exit|Failure|Warning)\b[^:]*:")


def _first_line(message: object) -> str:
    """The exception a rank recorded: its first line (``Type: message``; the lines after it, such as a library's
    footer of links, are not the reason), or in a plain traceback its last exception line, else the last line."""
    lines = [ln.strip() for ln in _recorded(message).strip().splitlines() if ln.strip()]
    if not lines:
        return "(no error recorded)"
    if _EXCEPTION_LINE.match(lines[0]):
        return lines[0]
    raised = [ln for ln in lines if _EXCEPTION_LINE.match(ln)]
    return raised[-1] if raised else lines[-1]


def record_error(exc: BaseException) -> None:
    """Write ``exc`` to the error file the elastic agent (local launch or torchrun) reads, so the launcher names it."""
    if os.environ.get("TORCHELASTIC_ERROR_FILE"):
        from torch.distributed.elastic.multiprocessing.errors import ErrorHandler

        ErrorHandler().record_exception(exc)


def die_with_parent() -> None:
    """In a rank the local launcher started: SIGKILL this process when the launcher dies, however it dies (a SIGKILL
    or a ``subprocess`` timeout cannot be handled by the launcher), so no rank is ever orphaned. The kernel does it
    (``PR_SET_PDEATHSIG``) for a rank whose parent ends with the launcher (a spawned rank, or one forked from the
    launcher's own fork server); a rank forked from a shared server (``rank_server``) watches the launcher itself."""
    if os.environ.get("NEMO_LONGCTX_SPAWNED") != "1" or not sys.platform.startswith("linux"):
        return
    if os.environ.get(rank_server.VAR) and os.environ.get(FORKED_RANK_VAR):
        _watch_launcher(launcher_pid())
        return
    import ctypes

    pr_set_pdeathsig = 1
    ctypes.CDLL("libc.so.6", use_errno=True).prctl(pr_set_pdeathsig, int(signal.SIGKILL), 0, 0, 0)
    if os.getppid() == 1:  # the launcher was already gone before the request took effect
        os._exit(128 + int(signal.SIGKILL))


def _watch_launcher(pid: int) -> None:
    """SIGKILL this process once process ``pid`` has ended (a thread waiting on its pidfd)."""
    import select

    try:
        fd = os.pidfd_open(pid)
    except ProcessLookupError:
        os._exit(128 + int(signal.SIGKILL))

    def wait() -> None:
        select.select([fd], [], [])
        os.kill(os.getpid(), signal.SIGKILL)

    threading.Thread(target=wait, name="nemo-longctx-launcher-watch", daemon=True).start()


def inject_fault(kind: str, step: int, rank: int) -> None:
    """A failure drill (``run.fault=KIND@STEP:RANK``, parsed by ``app_keys.parse_fault``) on this rank now, at the
    start of training step STEP (both apps call it from their step-start hook): ``raise`` a RuntimeError, ``kill``
    itself with SIGKILL, ``abort`` like a C++ fatal error (a marker on stderr, then SIGABRT), ``hang`` (the peers
    block in their next collective until the collective timeout or the launcher stops the run), or ``SIGTERM`` /
    ``SIGUSR1``: send that signal to its launcher (the local launcher, or torchrun's agent: ``launcher_pid``), as
    a scheduler would, and train on (a preemption drill); ``SIGTERM_TWICE``: SIGTERM to the launcher, and a second
    one a second later, before this step can end (the launcher's stop-at-once path, without a race against the
    ranks' save)."""
    import time

    print(f"run.fault: rank {rank} injects '{kind}' at step {step} (unix time {time.time():.2f})", flush=True)
    if kind == "raise":
        raise RuntimeError(f"injected failure (run.fault) on rank {rank} at step {step}")
    if kind == "kill":
        os.kill(os.getpid(), signal.SIGKILL)
    if kind == "abort":
        print(f"run.fault: rank {rank} aborts now (C++-style fatal error marker)", file=sys.stderr, flush=True)
        os.abort()
    if kind == "SIGTERM_TWICE":
        os.kill(launcher_pid(), signal.SIGTERM)
        time.sleep(1.0)  # forwarded to every rank (each now saves at the end of this step) ...
        os.kill(launcher_pid(), signal.SIGTERM)  # ... which the second signal prevents: the ranks are stopped
        time.sleep(1.0)
        return
    if kind.startswith("SIG"):  # a preemption drill: the signal comes to the launcher from outside, as from
        os.kill(launcher_pid(), signal.Signals[kind])  # scancel/kill; the launcher forwards it, and
        time.sleep(1.0)  # it reaches every rank before this step ends
        return
    while True:
        time.sleep(1)
