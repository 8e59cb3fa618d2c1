"""The manual (docs/, built by MkDocs) and the README, CHANGELOG and ``--help`` texts:

- the site builds with ``mkdocs build --strict`` (every page in the nav, every link and anchor resolves, every
  snippet include exists);
- the generated reference blocks (option tables, CLI help) are current (``python scripts/gen_reference.py``);
- they speak to users: no commit hashes, internal issue numbers, work-log words, internal fix labels or build-machine
  paths;
- the manual's ``nemo-longctx train`` / ``plan`` examples run (the rules: ``tests/doc_examples.py``);
- the README stays a front door (at most 300 lines).
"""

from __future__ import annotations

import functools
import importlib.util
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

from doc_examples import check_plan_commands, check_train_commands, doc_pages, docs_commands, gen_reference, listing

ROOT = Path(__file__).resolve().parents[1]
README = ROOT / "README.md"
CHANGELOG = ROOT / "CHANGELOG.md"

# Words that belong to a work log, not to a manual. Each pattern is matched per line; keep them precise enough that
# real content (hex checksums, version numbers, GPU names such as B200) never matches.
FORBIDDEN = {
    "an internal issue number": re.compile(r"\bissues? #?\d+\b|(?<![\w&#/])#\d+\b", re.I),
    "a work-log word (session)": re.compile(r"\bsessions?\b", re.I),
    "a work-log word (stop N / this stop)": re.compile(r"\bthis stop\b|\bstop \d+\b", re.I),
    "a work-log word (landing)": re.compile(r"\bland(?:ing|ed)\b", re.I),
    "a work-log word (work log)": re.compile(r"\bwork[- ]?log\b", re.I),
    "an internal fix label (fix N)": re.compile(r"\bfix(?:es)? \d+\b", re.I),
    "an internal fix label (B2, F6, ...)": re.compile(r"\b[BF]\d{1,2}\b"),
    "a build-machine path": re.compile(r"(?<![\w.~$-])/(?:work|tmp)/"),
    "the build machine": re.compile(r"\b(?:the|this|our) (?:shared |idle )?2-core(?: CPU)? VM\b|\b(?:this|the) VM\b",
                                    re.I),
    "people behind the build (engineers)": re.compile(r"\bengineers?\b", re.I),
}
HEX = re.compile(r"(?<![\w./#-])[0-9a-f]{7,40}(?![\w-])")
AFTER_COMMIT = re.compile(r"\bcommit\s+([0-9a-f]{7,40})\b", re.I)


def texts():
    """{name: text} of every user-facing Markdown file."""
    out = {str(p.relative_to(ROOT)): p.read_text() for p in [README, CHANGELOG] + doc_pages()}
    assert len(out) > 20, sorted(out)
    return out


@functools.lru_cache(maxsize=None)
def help_text(*args: str) -> str:
    """``nemo-longctx ARGS --help`` as this checkout prints it (``python -m nemo_longctx.apps.cli``: no framework
    import)."""
    return gen_reference().cli_help(*args, "--help")


def forbidden_hits(name: str, text: str):
    hits = []
    for n, line in enumerate(text.splitlines(), 1):
        for what, pattern in FORBIDDEN.items():
            m = pattern.search(line)
            if m:
                hits.append(f"{name}:{n}: {what}: {m.group(0)!r} in {line.strip()[:120]!r}")
    return hits


def test_readme_is_a_front_door():
    n = len(README.read_text().splitlines())
    assert n <= 300, f"README.md has {n} lines: move the details into docs/ (the README is the front door, <= 300)"


def test_docs_build_strict(tmp_path):
    if importlib.util.find_spec("mkdocs") is None or importlib.util.find_spec("material") is None:
        pytest.skip("mkdocs / mkdocs-material are not installed (pip install -e '.[docs]'; the test extra has them)")
    r = subprocess.run([sys.executable, "-m", "mkdocs", "build", "--strict", "-f", str(ROOT / "mkdocs.yml"),
                        "-d", str(tmp_path / "site")], cwd=ROOT, capture_output=True, text=True, timeout=300,
                       env=dict(os.environ, NO_MKDOCS_2_WARNING="1"))
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-5000:]
    assert (tmp_path / "site" / "index.html").exists()
    install = (tmp_path / "site" / "install" / "index.html").read_text()
    assert "matrix_smoke.sh" in install, "the README's set-up section did not reach docs/install.md (snippet)"


def test_reference_pages_are_current():
    stale = gen_reference().stale()
    assert not stale, "stale generated reference blocks, run: python scripts/gen_reference.py\n  " + "\n  ".join(stale)


def test_docs_speak_to_users():
    hits = [h for name, text in texts().items() for h in forbidden_hits(name, text)]
    assert not hits, "\n".join(hits)


@pytest.mark.parametrize("command", ["", "train", "plan", "bridge"])
def test_help_speaks_to_users(command):
    args = (command,) if command else ()
    text = help_text(*args)
    assert "usage: nemo-longctx" in text, text[:500]
    hits = forbidden_hits(f"nemo-longctx {command} --help".replace("  ", " "), text)
    assert not hits, "\n".join(hits)


def test_no_commit_hashes():
    """Hex words of 7-40 characters with a digit and a letter (or any after "commit") that name a commit of this
    repository: a manual cites versions and dates, not commits."""
    if subprocess.run(["git", "rev-parse", "--git-dir"], cwd=ROOT, capture_output=True).returncode != 0:
        pytest.skip("not a git checkout: commits cannot be looked up")
    sources = dict(texts())
    sources.update({f"nemo-longctx {c} --help": help_text(*((c,) if c else ()))
                    for c in ("", "train", "plan", "bridge")})
    where = {}
    for name, text in sources.items():
        for word in HEX.findall(text):
            if re.search(r"\d", word) and re.search(r"[a-f]", word):
                where.setdefault(word, set()).add(name)
        for word in AFTER_COMMIT.findall(text):
            where.setdefault(word.lower(), set()).add(name)
    if not where:
        return
    words = sorted(where)
    r = subprocess.run(["git", "cat-file", "--batch-check"], cwd=ROOT, capture_output=True, text=True, timeout=60,
                       input="".join(f"{w}^{{commit}}\n" for w in words))
    lines = r.stdout.splitlines()
    assert len(lines) == len(words), r.stdout + r.stderr
    commits = [w for w, line in zip(words, lines) if line.split()[1:2] == ["commit"]]
    assert not commits, "commit hashes in user-facing text: " + "; ".join(
        f"{w} in {', '.join(sorted(where[w]))}" for w in commits)


def test_no_vanishing_tags():
    """``<name>`` outside code is read as an HTML tag and disappears from the rendered page: write it in backticks."""
    tag = re.compile(r"<(?!!--|/?(?:br|sub|sup|kbd|details|summary|a|img|div|span)\b)/?[A-Za-z_][^<>\s]*>")
    hits = []
    for name, text in texts().items():
        prose = re.sub(r"^\s*```.*?^\s*```", "", text, flags=re.S | re.M)  # fenced blocks
        prose = re.sub(r"`[^`]*`", "", prose)  # code spans (they may wrap over lines)
        hits += [f"{name}: {m.group(0)}" for m in tag.finditer(prose)]
    assert not hits, "\n".join(hits)


def test_docs_list_runnable_commands():
    runnable, skipped = docs_commands()
    assert {app for app, _, _ in runnable} == {"train", "plan"}, (runnable, skipped)
    print(listing(skipped))


def test_docs_train_commands_dry_run(tmp_path_factory):
    check_train_commands(docs_commands()[0], tmp_path_factory)


def test_docs_plan_commands_run(tmp_path):
    check_plan_commands(docs_commands()[0], tmp_path)
