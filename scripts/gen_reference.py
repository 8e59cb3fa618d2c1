#!/usr/bin/env python3
"""Regenerate the generated blocks of the reference pages from the code.

    python scripts/gen_reference.py           # rewrite the blocks in place
    python scripts/gen_reference.py --check   # exit 1 naming every stale block (tests/test_docs.py runs this check)

A generated block sits between ``<!-- gen:NAME:begin -->`` and ``<!-- gen:NAME:end -->`` in a page of docs/; the text
between the markers is replaced by what ``BLOCKS[NAME]`` returns. The option tables come from the option model
(``nemo_longctx.options.options_table``: plain Python, no torch), the CLI pages from ``nemo-longctx ... --help``
(which imports no framework either).
"""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path
from typing import Callable, Dict, List

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))


def markdown_text(table: str) -> str:
    """``table`` with ``<`` and ``>`` outside code spans written as entities (``<output_dir>`` would otherwise be read
    as an HTML tag and vanish from the page)."""
    parts = table.split("`")
    return "`".join(p if i % 2 else p.replace("<", "&lt;").replace(">", "&gt;") for i, p in enumerate(parts))


def _table(table: str = "") -> str:
    """The option model's table (``table``: ``APP_OPTIONS`` or ``PLAN_OPTIONS``, else the long-context options)."""
    from nemo_longctx.options import options_table
    from nemo_longctx.shared.app_keys import APP_OPTIONS
    from nemo_longctx.shared.plan_keys import PLAN_OPTIONS

    tables = {"APP_OPTIONS": APP_OPTIONS, "PLAN_OPTIONS": PLAN_OPTIONS}
    return markdown_text(options_table(tables[table]) if table else options_table())


def cli_help(*args: str) -> str:
    """``nemo-longctx ARGS`` as this checkout answers it (``python -m nemo_longctx.apps.cli``)."""
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(ROOT)] + [p for p in [os.environ.get("PYTHONPATH")] if p]))
    r = subprocess.run([sys.executable, "-m", "nemo_longctx.apps.cli", *args], cwd=ROOT, env=env,
                       capture_output=True, text=True, timeout=120)
    if r.returncode != 0:
        raise RuntimeError(f"nemo-longctx {' '.join(args)} exited {r.returncode}: {r.stderr[-2000:]}")
    return r.stdout.rstrip("\n")


def _fenced(text: str) -> str:
    return "```text\n" + text + "\n```"


BLOCKS: Dict[str, Callable[[], str]] = {
    "options": _table,
    "app-options": lambda: _table("APP_OPTIONS"),
    "plan-options": lambda: _table("PLAN_OPTIONS"),
    "cli-usage": lambda: _fenced(cli_help("--help")),
    "cli-train": lambda: _fenced(cli_help("train", "--help")),
    "cli-plan": lambda: _fenced(cli_help("plan", "--help")),
    "cli-bridge": lambda: _fenced(cli_help("bridge", "--help")),
}
PAGES = (ROOT / "docs" / "reference" / "options.md", ROOT / "docs" / "reference" / "cli.md")
BLOCK = re.compile(r"(<!-- gen:(?P<name>[\w-]+):begin -->\n)(?P<body>.*?)\n?(<!-- gen:(?P=name):end -->)", re.S)


def render(text: str, cache: Dict[str, str]) -> str:
    def sub(m: "re.Match[str]") -> str:
        name = m.group("name")
        if name not in BLOCKS:
            raise KeyError(f"unknown generated block {name!r} (known: {', '.join(BLOCKS)})")
        if name not in cache:
            cache[name] = BLOCKS[name]()
        return m.group(1) + cache[name] + "\n" + m.group(4)

    return BLOCK.sub(sub, text)


def stale() -> List[str]:
    """'page: block' for every generated block whose text differs from what the code generates now."""
    out, cache = [], {}
    for page in PAGES:
        text = page.read_text()
        new = render(text, cache)
        if new != text:
            old_blocks = {m.group("name"): m.group("body") for m in BLOCK.finditer(text)}
            new_blocks = {m.group("name"): m.group("body") for m in BLOCK.finditer(new)}
            out += [f"{page.relative_to(ROOT)}: {n}" for n in new_blocks if new_blocks[n] != old_blocks.get(n)]
    return out


def main(argv: List[str]) -> int:
    if "--check" in argv:
        bad = stale()
        if bad:
            print("stale generated reference blocks (run: python scripts/gen_reference.py):\n  " + "\n  ".join(bad))
            return 1
        print("generated reference blocks are current")
        return 0
    cache: Dict[str, str] = {}
    for page in PAGES:
        text = page.read_text()
        new = render(text, cache)
        if new != text:
            page.write_text(new)
            print(f"rewrote {page.relative_to(ROOT)}")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
