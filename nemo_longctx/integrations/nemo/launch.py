"""Process launching for the Hydra app: reuse torchrun's or srun's processes, or spawn local ones.

Every training process ends up with torchrun-style variables (RANK, LOCAL_RANK, WORLD_SIZE, LOCAL_WORLD_SIZE,
GROUP_RANK, MASTER_ADDR, MASTER_PORT) and Lightning's ``TorchElasticEnvironment``:
  * under torchrun they are already set;
  * under srun (a job step: SLURM_STEP_ID set; SLURM_PROCID, SLURM_STEP_NUM_TASKS or SLURM_NTASKS > 1,
    SLURM_LOCALID, SLURM_NODEID, SLURM_STEP_NODELIST / SLURM_JOB_NODELIST) they are derived from the Slurm
    variables (no torchrun needed);
  * otherwise the app spawns ``world_size`` local processes itself (``spawn_local``) running
    ``python -m nemo_longctx.train <same overrides>`` with those variables set, and waits for them.
"""

from __future__ import annotations

import os
import re
import signal
import socket
import subprocess
import sys
import time
from dataclasses import dataclass
from typing import List, Optional, Sequence


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
        env.setdefault("MASTER_ADDR", _first_host(_slurm("SLURM_STEP_NODELIST", "SLURM_JOB_NODELIST", "SLURM_NODELIST", default="127.0.0.1")))
        env.setdefault("MASTER_PORT", str(15000 + job % 20000))
        return Launch("slurm", rank, local_rank, ntasks, local_ws)
    return None


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def spawn_local(world_size: int, argv: Sequence[str], threads_per_process: int, timeout_s: Optional[float] = None) -> int:
    """Run ``python -m nemo_longctx.train *argv`` on ``world_size`` local processes; return the first non-zero exit
    code (0 if all succeeded). A failing rank stops the others."""
    port = free_port()
    procs: List[subprocess.Popen] = []
    for rank in range(world_size):
        env = dict(os.environ)
        for k in [k for k in env if k.startswith("SLURM_")]:
            env.pop(k)  # a single-task Slurm allocation: the children are our processes, not Slurm's
        env.update(
            RANK=str(rank), LOCAL_RANK=str(rank), WORLD_SIZE=str(world_size), LOCAL_WORLD_SIZE=str(world_size),
            GROUP_RANK="0", ROLE_RANK=str(rank), MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port),
            TORCHELASTIC_RUN_ID="nemo-longctx-local", OMP_NUM_THREADS=str(threads_per_process),
            NEMO_LONGCTX_SPAWNED="1",
        )
        procs.append(subprocess.Popen([sys.executable, "-m", "nemo_longctx.train", *argv], env=env))
    start = time.time()
    code = 0
    try:
        while procs and any(p.poll() is None for p in procs):
            failed = [p for p in procs if p.poll() not in (None, 0)]
            if failed:
                code = failed[0].returncode
                break
            if timeout_s is not None and time.time() - start > timeout_s:
                code = 124
                break
            time.sleep(0.2)
        for p in procs:
            if p.poll() not in (None, 0) and code == 0:
                code = p.returncode
    finally:
        for p in procs:
            if p.poll() is None:
                p.send_signal(signal.SIGTERM)
        for p in procs:
            try:
                p.wait(timeout=20)
            except subprocess.TimeoutExpired:
                p.kill()
    return code
