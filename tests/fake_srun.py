"""Run an sbatch script with bash, with `srun` (and `scontrol`) replaced by stubs that record their arguments: the
command lines a job would start, fully expanded by the script's own shell, without Slurm, pyxis or GPUs."""

from __future__ import annotations

import os
import subprocess
from pathlib import Path
from typing import Dict, List, Optional, Tuple

_SRUN = """#!/bin/bash
# records one srun call: its arguments, NUL-separated, in the next numbered file
n=$(find "$FAKE_SRUN_DIR" -maxdepth 1 -name 'call.*' | wc -l)
printf '%s\\0' "$@" >"$FAKE_SRUN_DIR/call.$(printf %03d "$n")"
"""
_SCONTROL = """#!/bin/bash
# `scontrol show hostnames NODELIST` -> one fake host
echo node001
"""


def run_with_fake_srun(script: Path, tmp: Path, env: Optional[Dict[str, str]] = None,
                       timeout: float = 60) -> Tuple[subprocess.CompletedProcess, List[List[str]]]:
    """(bash's result, the argv of every srun call in order). ``env`` adds to os.environ (SLURM_* removed)."""
    bin_dir, calls = tmp / "fake_bin", tmp / "srun_calls"
    bin_dir.mkdir(parents=True, exist_ok=True)
    calls.mkdir(parents=True, exist_ok=True)
    for name, text in (("srun", _SRUN), ("scontrol", _SCONTROL)):
        (bin_dir / name).write_text(text)
        (bin_dir / name).chmod(0o755)
    base = {k: v for k, v in os.environ.items() if not k.startswith("SLURM_")}
    full = {**base, "SLURM_JOB_ID": "4242", "SLURM_JOB_NODELIST": "node001", **(env or {}),
            "FAKE_SRUN_DIR": str(calls), "PATH": f"{bin_dir}{os.pathsep}{base.get('PATH', '')}"}
    r = subprocess.run(["bash", str(script)], cwd=tmp, env=full, capture_output=True, text=True, timeout=timeout)
    argvs = [f.read_bytes().decode().split("\0")[:-1] for f in sorted(calls.glob("call.*"))]
    return r, argvs
