"""The documented examples: every ``nemo-longctx train ...`` and ``nemo-longctx plan ...`` command in a fenced
```` ```bash ```` block of README.md and of the manual (docs/**/*.md) must exit 0 here. One helper serves both:
``tests/test_readme_examples.py`` checks the README's commands, ``tests/test_docs.py`` the manual's; a command that
appears in both is the README's (each distinct command runs once per test session).

- Line continuations (``\\``) are joined, ``# comments`` dropped, ``cmd1 && cmd2`` / ``;`` split; a command is the
  segment whose first word is ``nemo-longctx`` (or a path ending in it) followed by ``train`` or ``plan``.
- ``train`` commands run as dry runs: ``run.dry_run=true`` appended and ``output_dir`` replaced by a temporary
  directory, all of them (README's and the manual's) in ONE process per session (Hydra's compose API +
  ``nemo_longctx.apps.train.run``, the app's own path after Hydra: option model, config problems, ``dry_run``) so
  NeMo is imported once; ``plan`` commands run as they are (``nemo-longctx plan``, in a temporary working directory).
- A command is skipped, with the reason listed, when an argument names a file that does not exist here
  (``init_from``, ``checkpoint.resume`` other than auto/never, ``data.paths``, ``data.packed_*``,
  ``data.tokenizer``, or any absolute path).
- Marker: an HTML comment ``<!-- readme-test: skip REASON -->`` on the line right before a fence skips that whole
  block (use it for commands that must not be executed here; it does not render).
"""

from __future__ import annotations

import functools
import importlib.util
import re
import shlex
import subprocess
import sys
from pathlib import Path
from typing import Dict, List, Sequence, Tuple

from app_runner import dry_runs_in_one_process
from run_cache import session_dir, shared_result

ROOT = Path(__file__).resolve().parents[1]
README = ROOT / "README.md"
MARKER = re.compile(r"<!--\s*readme-test:\s*skip\b(.*?)-->")
FILE_KEYS = ("init_from", "checkpoint.resume", "data.paths", "data.packed_train", "data.packed_val", "data.tokenizer")

Command = Tuple[str, Tuple[str, ...]]  # (app, args)


@functools.lru_cache(maxsize=None)
def gen_reference():
    """``scripts/gen_reference.py`` as a module (it is a script, not part of the package)."""
    spec = importlib.util.spec_from_file_location("gen_reference", ROOT / "scripts" / "gen_reference.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def doc_pages() -> List[Path]:
    """The manual's Markdown pages."""
    return sorted((ROOT / "docs").rglob("*.md"))


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


def page_commands(paths: Sequence[Path]):
    """(runnable, skipped) over ``paths``: runnable = [(app, args, page)], each distinct command once (its first
    page); skipped = [(app, args, reason, page)]."""
    runnable, skipped, seen = [], [], set()
    for path in paths:
        for block, reason in bash_blocks(path.read_text()):
            for app, args in commands(block):
                why = reason or needs_missing_file(args)
                if why:
                    skipped.append((app, args, why, path.relative_to(ROOT)))
                elif (app, tuple(args)) not in seen:
                    seen.add((app, tuple(args)))
                    runnable.append((app, args, path.relative_to(ROOT)))
    return runnable, skipped


def readme_commands():
    return page_commands([README])


def docs_commands():
    """The manual's runnable commands that the README does not already have (those run with the README's)."""
    in_readme = {(app, tuple(args)) for app, args, _ in readme_commands()[0]}
    runnable, skipped = page_commands(doc_pages())
    return [c for c in runnable if (c[0], tuple(c[1])) not in in_readme], skipped


def listing(skipped) -> str:
    return "skipped:\n" + "\n".join(f"  {page}: nemo-longctx {a} {' '.join(x)}: {why}" for a, x, why, page in skipped)


def _train_run(args: Sequence[str], out: Path) -> List[str]:
    return [a for a in args if not a.startswith("output_dir=")] + ["run.dry_run=true", f"output_dir={out}"]


def train_dry_runs(tmp_path_factory) -> Dict[Tuple[str, ...], Tuple[int, str]]:
    """{train args: (exit code, error)} for every runnable train command of the README and the manual, dry-run in one
    process the first time any pytest-xdist worker of the session asks (a file lock in the session's shared folder)."""
    shared = session_dir(tmp_path_factory) / "doc_examples"

    def dry_run_all() -> list:
        shared.mkdir(parents=True, exist_ok=True)
        trains = [args for app, args, _ in readme_commands()[0] + docs_commands()[0] if app == "train"]
        runs = [_train_run(args, shared / f"run{n}") for n, args in enumerate(trains)]
        results = dry_runs_in_one_process(runs, shared) if runs else []
        return [[args, code, err] for args, (_, code, err, _) in zip(trains, results)]

    record = shared_result("doc_examples_train_dry_runs", dry_run_all, tmp_path_factory)
    return {tuple(args): (code, err) for args, code, err in record}


def check_train_commands(runnable, tmp_path_factory) -> None:
    results = train_dry_runs(tmp_path_factory)
    trains = [(args, page) for app, args, page in runnable if app == "train"]
    assert trains
    failed = [(str(page), args, results[tuple(args)]) for args, page in trains if results[tuple(args)][0] != 0]
    assert not failed, failed


def check_plan_commands(runnable, cwd: Path) -> None:
    cli = Path(sys.executable).with_name("nemo-longctx")
    plans = [(args, page) for app, args, page in runnable if app == "plan"]
    assert plans
    for args, page in plans:
        r = subprocess.run([str(cli), "plan", *args], cwd=cwd, capture_output=True, text=True, timeout=300)
        assert r.returncode == 0, (str(page), args, r.stdout[-2000:], r.stderr[-2000:])
