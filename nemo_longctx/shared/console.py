"""The console of a training run, for every front end (``apps/train.py``, ``apps/bridge.py``): standard library only.

``log.level=info`` (the default; the quiet console): our step lines, real warnings once on rank 0, errors from every
rank, and one summary at the end. ``log.level=debug`` (``--verbose``): everything the libraries print, as they print it.

* ``setup(level, rank)``: Python ``warnings`` shown once per message (known CPU-build noise silenced; other ranks:
  none), third-party loggers (nemo, megatron, lightning, nv_one_logger, numexpr, modelopt, torch.distributed, ...)
  raised to WARNING on rank 0 and ERROR on other ranks, NeMo's own console handlers filtered like Hydra's
  (``ConsoleFilter``).
* ``ConsoleFilter``: the filter of the console handler of Hydra's job logging (``conf/train.yaml``:
  ``hydra.job_logging``): under ``info``, INFO records (ours included) stay in ``<output_dir>/train.log`` only,
  warnings reach the console once, known noise never.
* ``take_verbose(argv)``: ``--verbose`` -> ``++log.level=debug`` (every rank re-runs the command line: it gets it too).
* ``summary_lines(...)``: the final summary, read from the run's ``metrics.jsonl`` (the launching process does not
  train): steps, final loss, mean tokens/s, peak memory, wall time from launch, where the outputs went.
* ``step_line(row, max_steps)``: a step's console line; ``eta_seconds(intervals, remaining)``,
  ``human_duration(s)``: its ``eta``.
* ``archive_metrics(output_dir)``: before a fresh run, the previous ``metrics.jsonl`` moves to
  ``<output_dir>/runs/run_<N>/metrics.jsonl`` (never deleted).
"""

from __future__ import annotations

import json
import logging
import math
import os
import re
import time
import warnings
from typing import Any, Dict, Iterable, List, Optional, Sequence, Tuple

LEVELS = ("info", "debug")
VERBOSE_FLAG = "--verbose"
LOG_LEVEL_VAR = "NEMO_LONGCTX_LOG_LEVEL"  # the local launcher's log.level, for its fork server (rank_preamble.py)

# third-party loggers whose level the quiet console raises (a parent's level covers its children)
THIRD_PARTY_LOGGERS = (
    "nemo", "NeMo", "megatron", "lightning", "lightning.pytorch", "lightning.fabric",
    "lightning_fabric", "pytorch_lightning", "nv_one_logger", "numexpr", "modelopt", "torch.distributed",
    "transformers", "datasets",
)

# Messages that are noise on a CPU build or for every user of this app: silenced under log.level=info (regexes,
# searched in the message; Python warnings and log records alike).
NOISE = (
    r"pynvml package is deprecated",
    r"Transformer Engine and Apex are not installed",
    r"Apex is not installed",
    r"transformer_engine not installed",
    r"Failed to create unified memory mempool",
    r"is incompatible with nvidia-modelopt",
    r"nvidia-modelopt",
    r"Cannot import zarr",
    r"The (deploy|evaluate) module could not be imported",
    r"fused_indices_to_multihot has reached end of life",
    r"OneLogger: Setting error_handling_strategy",
    r"No exporters were provided",
    r"Rerun State Machine",
    r"RerunStateMachine initialized",
    r"You called `self\.log\('\w+', \.\.\.\)` in your `training_step` but the value needs to be floating",
    r"There were no checkpoints found in checkpoint_dir",
    r"NeMoLogger is logging to .*, but it already exists",
    r"The Trainer already contains a ModelCheckpoint callback",
    r"Passing 'checkpoint_dir' as a Path object in load_common_state_dict",
    r"You're resuming from a checkpoint that ended before the epoch ended",
)
# the same, for the Python processes the ranks start themselves (Megatron's asynchronous checkpoint worker): through
# PYTHONWARNINGS (a literal start of the message; read when an interpreter starts)
CHILD_WARNINGS = ("ignore:The pynvml package is deprecated:FutureWarning",)
# Python warnings silenced only where they are attributed to the given module (message regex, module regex):
# torch.tensor(<tensor>) in a library, reported from the CPU build's TorchFunctionMode that forwards the call
NOISE_AT = (
    (r"To copy construct from a tensor", r"nemo_longctx\.integrations\.megatron\.cpu_compat"),
)
_NOISE_RE = re.compile("|".join(f"(?:{p})" for p in NOISE))

_STATE: Dict[str, Any] = {"level": "info", "rank": 0, "seen": set()}
_IMPORTED_AT = time.time()


# ---------------------------------------------------------------------------------------------------- command line
def take_verbose(argv: Sequence[str]) -> Tuple[List[str], str]:
    """(argv with ``--verbose`` replaced by the override ``log.level=debug``, the log level the command line asks for:
    the last ``log.level=`` override, ``info`` when none)."""
    args = ["++log.level=debug" if a == VERBOSE_FLAG else str(a) for a in argv]  # ++: also where log is absent
    level = "info"
    for a in args:
        key, eq, value = a.lstrip("+~").partition("=")
        if eq and key == "log.level" and value.strip("'\"") in LEVELS:
            level = value.strip("'\"")
    return args, level


def rank_from_env(env: Optional[Dict[str, str]] = None) -> int:
    """This process's global rank from torchrun's / the local launcher's ``RANK`` or srun's ``SLURM_PROCID`` (a srun
    job step); 0 for a process started by hand (the launcher of a local run, or the only process)."""
    env = os.environ if env is None else env
    for key in ("RANK", "SLURM_PROCID"):
        if key == "SLURM_PROCID" and not ("SLURM_STEP_ID" in env or "SLURM_STEPID" in env):
            continue
        try:
            return int(env[key])
        except (KeyError, ValueError):
            continue
    return 0


# ---------------------------------------------------------------------------------------------------- filtering
def is_noise(message: str) -> bool:
    """A known-noise message (``NOISE``)."""
    return bool(_NOISE_RE.search(str(message)))


def level() -> str:
    return str(_STATE["level"])


class NoiseFilter(logging.Filter):
    """Drops known noise (under ``info``) at the logger it is attached to: NeMo's ``nemo_logger``, which streams through
    its own handlers, created when NeMo is imported (a logger's filters outlive that; its log files lose only noise)."""

    def filter(self, record: logging.LogRecord) -> bool:
        if _STATE["level"] == "debug" or record.levelno >= logging.ERROR:
            return True
        try:
            return not is_noise(record.getMessage())
        except Exception:
            return True


class ConsoleFilter(logging.Filter):
    """The console handler's filter (Hydra's ``job_logging``): under ``log.level=info`` it passes WARNING and above on
    rank 0 (each message once, known noise never) and ERROR and above on other ranks; under ``debug``, everything."""

    def filter(self, record: logging.LogRecord) -> bool:
        if _STATE["level"] == "debug":
            return True
        if record.levelno >= logging.ERROR:
            return True
        if record.levelno < logging.WARNING or int(_STATE["rank"]) != 0:
            return False
        try:
            message = record.getMessage()
        except Exception:  # a broken record: let logging report it as it would
            return True
        if is_noise(message):
            return False
        key = (record.name, message)
        if key in _STATE["seen"]:
            return False
        _STATE["seen"].add(key)
        return True


def setup(log_level: str = "info", rank: int = 0) -> None:
    """Configure this process's console for ``log.level`` (``info`` | ``debug``) on global rank ``rank``. Idempotent:
    call it early (before the libraries are imported) and again once they are (they reset their loggers' levels on
    import: Lightning, NeMo)."""
    log_level = str(log_level or "info").lower()
    if log_level not in LEVELS:
        raise ValueError(f"log.level={log_level!r}: expected one of {', '.join(LEVELS)}")
    _STATE["level"], _STATE["rank"] = log_level, int(rank)
    if log_level == "debug":
        return
    _quiet_warnings(int(rank))
    third_party = logging.WARNING if int(rank) == 0 else logging.ERROR
    for name in THIRD_PARTY_LOGGERS:
        logging.getLogger(name).setLevel(third_party)
    nemo = logging.getLogger("nemo_logger")
    if not any(isinstance(f, NoiseFilter) for f in nemo.filters):
        nemo.addFilter(NoiseFilter())
    # NeMo's own logger streams through its own handlers (its log files under <output_dir>/logs keep everything);
    # the root's console handler gets the filter from Hydra's job logging, or here when it was set up otherwise
    for handler in logging.getLogger("nemo_logger").handlers + logging.getLogger().handlers:
        if isinstance(handler, logging.StreamHandler) and not isinstance(handler, logging.FileHandler) and \
                not any(isinstance(f, ConsoleFilter) for f in handler.filters):
            handler.addFilter(ConsoleFilter())


def _quiet_warnings(rank: int) -> None:
    """Known noise ignored; everything else once per message (after any filter already installed, so the default
    ignores of DeprecationWarning & co. and the user's ``-W`` still win); nothing at all on other ranks.

    The ignore filters use ``category=Warning``: NeMo's captured-warnings hook treats an ``ignore`` filter whose
    category *equals* a warning's category as ignoring that whole category (``_warning_is_ignored``)."""
    if getattr(warnings, "_nemo_longctx_quiet", None) == rank:
        return
    inherited = [w for w in os.environ.get("PYTHONWARNINGS", "").split(",") if w]
    os.environ["PYTHONWARNINGS"] = ",".join(inherited + [w for w in CHILD_WARNINGS if w not in inherited])
    for pattern in NOISE:
        warnings.filterwarnings("ignore", message=f".*(?:{pattern})", category=Warning)
    for pattern, module in NOISE_AT:
        warnings.filterwarnings("ignore", message=f".*(?:{pattern})", category=Warning, module=module)
    warnings.simplefilter("once", append=True)
    if rank != 0:
        warnings.simplefilter("ignore", append=False)
    warnings._nemo_longctx_quiet = rank  # type: ignore[attr-defined]


# ---------------------------------------------------------------------------------------------------- wall time
def since_launch() -> float:
    """Seconds since this process started: from ``/proc`` on Linux (the system's uptime minus the process's start
    after boot, 10 ms resolution), else since this module was imported."""
    since_import = time.time() - _IMPORTED_AT
    try:
        with open("/proc/self/stat") as f:
            start_ticks = int(f.read().rsplit(")", 1)[1].split()[19])
        with open("/proc/uptime") as f:
            uptime = float(f.read().split()[0])
        return max(uptime - start_ticks / os.sysconf("SC_CLK_TCK"), since_import)
    except (OSError, ValueError, IndexError, AttributeError):
        return since_import


def process_start_time() -> float:
    """This process's start (unix time)."""
    return time.time() - since_launch()


# ---------------------------------------------------------------------------------------------------- metrics files
def read_metrics(path: str, since: Optional[float] = None) -> List[dict]:
    """The rows of a ``metrics.jsonl`` (unreadable lines skipped); [] when the file is absent or, with ``since`` (unix
    time), was last written before it (a previous run's file: this run wrote none)."""
    try:
        if since is not None and os.path.getmtime(path) < since:
            return []
        with open(path) as f:
            lines = f.readlines()
    except OSError:
        return []
    rows = []
    for line in lines:
        try:
            row = json.loads(line)
        except ValueError:
            continue
        if isinstance(row, dict):
            rows.append(row)
    return rows


def _number(v: Any) -> Optional[float]:
    if isinstance(v, bool) or not isinstance(v, (int, float)) or not math.isfinite(float(v)):
        return None
    return float(v)


def summarize(rows: Iterable[dict]) -> Dict[str, Any]:
    """From metrics rows: ``steps`` (training rows), ``last_step``, ``final_loss`` (the last training row's loss),
    ``mean_tokens_per_s`` (over the training rows), ``peak_bytes`` (the largest recorded, None if none was),
    ``val_loss`` (the last validation row's, None if none)."""
    train = [r for r in rows if "loss" in r and "step" in r]
    val = [r for r in rows if "val_loss" in r]
    tps = [t for t in (_number(r.get("tokens_per_s")) for r in train) if t is not None]
    peaks = [p for p in (_number(r.get("peak_bytes")) for r in train) if p is not None]
    return {
        "steps": len(train),
        "last_step": int(train[-1]["step"]) if train else None,
        "final_loss": _number(train[-1]["loss"]) if train else None,
        "mean_tokens_per_s": sum(tps) / len(tps) if tps else None,
        "peak_bytes": max(peaks) if peaks else None,
        "val_loss": _number(val[-1]["val_loss"]) if val else None,
    }


def eta_seconds(intervals: Sequence[float], remaining_steps: int) -> Optional[float]:
    """Seconds left: ``remaining_steps`` x the median of the recent step ``intervals`` (a median: a validation run or
    a checkpoint save between two steps does not swing it); None without intervals."""
    times = sorted(float(t) for t in intervals if _number(t) is not None and t >= 0)
    if not times:
        return None
    mid = len(times) // 2
    median = times[mid] if len(times) % 2 else (times[mid - 1] + times[mid]) / 2
    return max(0, int(remaining_steps)) * median


def human_duration(seconds: float) -> str:
    """``42s``, ``3m05s``, ``3h12m``, ``2d04h`` (rounded down to the unit shown last)."""
    s = max(0, int(seconds))
    if s < 60:
        return f"{s}s"
    if s < 3600:
        return f"{s // 60}m{s % 60:02d}s"
    if s < 86400:
        return f"{s // 3600}h{s % 3600 // 60:02d}m"
    return f"{s // 86400}d{s % 86400 // 3600:02d}h"


def step_line(rec: dict, max_steps: int, extra: Optional[str] = None) -> str:
    """The console line of one step's metrics row: ``eta`` only while steps remain and it is known, ``mfu`` only
    when known."""
    line = (f"step {rec['step']}/{max_steps} | loss {rec['loss']:.5f} | tokens/s {rec['tokens_per_s']:.0f} | "
            f"step {rec['step_time_s']:.2f} s | elapsed {rec['elapsed_s']:.1f} s")
    if rec.get("eta_s") is not None and rec["step"] < max_steps:
        line += f" | eta {human_duration(rec['eta_s'])}"
    if rec.get("mfu") is not None:
        line += f" | mfu {100 * rec['mfu']:.1f}%"
    return line + (f" | {extra}" if extra else "")


def human_bytes(n: float) -> str:
    for unit in ("B", "KiB", "MiB", "GiB"):
        if abs(n) < 1024 or unit == "GiB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1024
    return f"{n:.1f} GiB"  # pragma: no cover


def summary_lines(code: int, rows: Sequence[dict], wall_s: float, *, max_steps: Optional[int] = None,
                  paths: Optional[Sequence[Tuple[str, Optional[str]]]] = None,
                  prefix: str = "nemo-longctx") -> List[str]:
    """The final summary: ``<prefix>: finished|preempted, ...|FAILED (exit N) in W s from launch | steps S/M |
    final loss L | mean tokens/s T | peak P`` and one line per output path given (``(label, path)``; None paths and
    paths that do not exist left out)."""
    from nemo_longctx.shared.signals import PREEMPTED_EXIT

    s = summarize(rows)
    state = {0: "finished", PREEMPTED_EXIT: f"preempted, checkpoint saved (exit {code}: run the same command to "
             "resume)"}.get(code, f"FAILED (exit {code})")
    parts = [f"{prefix}: {state} in {wall_s:.1f} s from launch"]
    last = s["last_step"] if s["last_step"] is not None else 0
    parts.append(f"steps {last}/{max_steps}" if max_steps else f"steps {last}")
    if s["final_loss"] is not None:
        parts.append(f"final loss {s['final_loss']:.5f}")
    if s["val_loss"] is not None:
        parts.append(f"val_loss {s['val_loss']:.5f}")
    if s["mean_tokens_per_s"] is not None:
        parts.append(f"mean tokens/s {s['mean_tokens_per_s']:.0f}")
    if s["peak_bytes"] is not None:
        parts.append(f"peak {human_bytes(s['peak_bytes'])}")
    lines = [" | ".join(parts)]
    for label, path in paths or ():
        if path and os.path.exists(path):  # never a path the run did not write
            lines.append(f"{prefix}:   {label + ':':<12} {path}")
    return lines


def next_run_dir(output_dir: str) -> str:
    """``<output_dir>/runs/run_<N>`` with N the next free number (1, 2, ...)."""
    runs = os.path.join(output_dir, "runs")
    taken = []
    if os.path.isdir(runs):
        for name in os.listdir(runs):
            m = re.fullmatch(r"run_(\d+)", name)
            if m:
                taken.append(int(m.group(1)))
    return os.path.join(runs, f"run_{max(taken, default=0) + 1}")


def archive_metrics(output_dir: str, name: str = "metrics.jsonl") -> Optional[str]:
    """Before a fresh run: move ``<output_dir>/<name>`` (a previous run's, not empty) to
    ``<output_dir>/runs/run_<N>/<name>`` and return the new path; None when there was nothing to keep. Call it on one
    process only (the one that writes the file)."""
    path = os.path.join(output_dir, name)
    try:
        with open(path) as f:
            if not f.read().strip():
                return None
    except OSError:
        return None
    for _ in range(100):  # another run archiving into the same output_dir at the same moment: take the next number
        target = next_run_dir(output_dir)
        try:
            os.makedirs(target)
        except FileExistsError:
            continue
        dest = os.path.join(target, name)
        os.replace(path, dest)
        return dest
    raise RuntimeError(f"could not find a free runs/run_<N> directory under {output_dir}")  # pragma: no cover
