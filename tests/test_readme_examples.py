"""README.md's examples run: every ``nemo-longctx train ...`` and ``nemo-longctx plan ...`` command in a fenced
```` ```bash ```` block of README.md must exit 0 here.

- Line continuations (``\\``) are joined, ``# comments`` dropped, ``cmd1 && cmd2`` / ``;`` split; a command is the
  segment whose first word is ``nemo-longctx`` (or a path ending in it) followed by ``train`` or ``plan``.
- ``train`` commands run as dry runs: ``run.dry_run=true`` appended and ``output_dir`` replaced by a temporary
  directory, all of them in ONE process (Hydra's compose API + ``nemo_longctx.apps.train.run``, the app's own path after
  Hydra: option model, config problems, ``dry_run``) so NeMo is imported once; ``plan`` commands run as they are
  (``nemo-longctx plan``, in a temporary working directory).
- A command is skipped, with the reason listed, when an argument names a file that does not exist here
  (``init_from``, ``checkpoint.resume`` other than auto/never, ``data.paths``, ``data.packed_*``,
  ``data.tokenizer``, or any absolute path).
- Marker: an HTML comment ``<!-- readme-test: skip REASON -->`` on the line right before a fence skips that whole
  block (use it for commands that must not be executed here; it does not render on GitHub).
"""

from __future__ import annotations

import os
import re
import shlex
import subprocess
import sys
from pathlib import Path

import pytest

from app_runner import dry_runs_in_one_process

ROOT = Path(__file__).resolve().parents[1]
MARKER = re.compile(r"<!--\s*readme-test:\s*skip\b(.*?)-->")
FILE_KEYS = ("init_from", "checkpoint.resume", "data.paths", "data.packed_train", "data.packed_val", "data.tokenizer")


def bash_blocks(text: str):
    """(block text, skip reason or None) for every ```bash fence."""
    out = []
    lines = text.splitlines()
    i = 0
    while i < len(lines):
        if lines[i].strip() == "```bash":
            m = MARKER.search(lines[i - 1]) if i else None
            j = i + 1
            while j < len(lines) and lines[j].strip() != "```":
                j += 1
            out.append(("\n".join(lines[i + 1:j]), (m.group(1).strip() or "marked") if m else None))
            i = j
        i += 1
    return out


def commands(block: str):
    """[(app, args)] of the nemo-longctx train/plan commands in a bash block."""
    out = []
    for line in block.replace("\\\n", " ").splitlines():
        words = shlex.split(line, comments=True)
        seg: list = []
        for w in words + ["&&"]:
            if w in ("&&", ";", "||", "|"):
                if len(seg) >= 2 and seg[0].endswith("nemo-longctx") and seg[1] in ("train", "plan"):
                    out.append((seg[1], seg[2:]))
                seg = []
            else:
                seg.append(w)
    return out


def needs_missing_file(args) -> str:
    for a in args:
        key, _, value = a.lstrip("+~").partition("=")
        value = value.strip("'\"[]")
        if key in FILE_KEYS and value not in ("", "auto", "never", "null"):
            for v in value.split(","):
                if not (ROOT / v).exists():
                    return f"{key}={v} does not exist here"
        if value.startswith("/") and not Path(value).exists():
            return f"{a}: {value} does not exist here"
    return ""


def readme_commands():
    runnable, skipped = [], []
    for block, reason in bash_blocks((ROOT / "README.md").read_text()):
        for app, args in commands(block):
            why = reason or needs_missing_file(args)
            (skipped if why else runnable).append((app, args, why))
    return runnable, skipped




def test_readme_lists_runnable_commands():
    runnable, skipped = readme_commands()
    apps = {app for app, _, _ in runnable}
    assert apps == {"train", "plan"}, (runnable, skipped)
    print("skipped:\n" + "\n".join(f"  nemo-longctx {a} {' '.join(x)}: {why}" for a, x, why in skipped))


def test_readme_train_commands_dry_run(tmp_path):
    runnable, _ = readme_commands()
    runs = []
    for n, (app, args, _) in enumerate(runnable):
        if app == "train":
            args = [a for a in args if not a.startswith("output_dir=")]
            runs.append(args + ["run.dry_run=true", f"output_dir={tmp_path / f'run{n}'}"])
    assert runs
    failed = [(args, code, err) for args, code, err, _ in dry_runs_in_one_process(runs, tmp_path) if code != 0]
    assert not failed, failed


def test_readme_plan_commands_run(tmp_path):
    runnable, _ = readme_commands()
    cli = Path(sys.executable).with_name("nemo-longctx")
    plans = [args for app, args, _ in runnable if app == "plan"]
    assert plans
    for args in plans:
        r = subprocess.run([str(cli), "plan", *args], cwd=tmp_path, capture_output=True, text=True, timeout=300)
        assert r.returncode == 0, (args, r.stdout[-2000:], r.stderr[-2000:])
