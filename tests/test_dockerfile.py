"""Lint the Dockerfile (docker cannot build on these machines): pinned NGC NeMo base overridable by build arg,
plugin installed with --no-deps, no TransformerEngine install, import checked at build time, context kept small."""

import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def _instructions():
    text = (ROOT / "Dockerfile").read_text()
    text = re.sub(r"\\\n", " ", text)  # join continuation lines
    out = []
    for line in text.splitlines():
        line = line.strip()
        if line and not line.startswith("#"):
            op, _, rest = line.partition(" ")
            out.append((op.upper(), rest.strip()))
    return out


def test_from_is_a_pinned_ngc_nemo_image_overridable_by_arg():
    ins = _instructions()
    ops = [op for op, _ in ins]
    assert ops[0] == "ARG" and "FROM" in ops
    arg_name, _, default = ins[0][1].partition("=")
    assert re.fullmatch(r"nvcr\.io/nvidia/nemo:\d\d\.\d\d(\.\d+)?", default), default  # pinned yy.mm tag
    assert not default.endswith((":latest", ":dev"))
    frm = dict(ins)["FROM"]
    assert frm == "${" + arg_name + "}"


def test_plugin_installed_without_deps_and_import_checked():
    runs = [rest for op, rest in _instructions() if op == "RUN"]
    pip = [r for r in runs if "pip install" in r]
    assert pip and all("--no-deps" in r for r in pip)
    joined = " ".join(runs)
    assert "import nemo_longctx" in joined and "from nemo.collections import llm" in joined
    assert not re.search(r"transformer[-_]engine", joined, re.I)  # never (re)install TE over the container's
    assert not re.search(r"pip install[^&]*\btorch\b", joined)
    copies = [rest for op, rest in _instructions() if op == "COPY"]
    assert any(c.startswith("nemo_longctx") for c in copies) and any(c.startswith("conf") for c in copies)


def test_dockerignore_keeps_the_context_small():
    ignored = (ROOT / ".dockerignore").read_text().split()
    for entry in (".git", ".venv", "tests"):
        assert entry in ignored
    for needed in ("nemo_longctx", "conf", "pyproject.toml"):
        assert needed not in ignored
