"""Lint the Dockerfile (docker cannot build on these machines): pinned NGC NeMo bases overridable by build args, the
front end (NeMo 2 by default, or Megatron-Bridge) chosen by FRONTEND, plugin installed with --no-deps, no
TransformerEngine install, the front end's imports checked at build time (the RUN step's shell run here with stubs for
python, pip and nemo-longctx), context kept small."""

import os
import re
import sys
import subprocess
from pathlib import Path

import pytest

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


def _global_args(ins):
    """The ARGs before the first FROM (the ones a FROM line can use): name -> default."""
    out = {}
    for op, rest in ins:
        if op == "FROM":
            return out
        assert op == "ARG", (op, rest)
        name, _, default = rest.partition("=")
        out[name] = default
    raise AssertionError("no FROM")


def _tag(image):
    m = re.fullmatch(r"nvcr\.io/nvidia/nemo:(\d\d)\.(\d\d)(\.\d+)?", image)  # a pinned yy.mm tag
    assert m, image
    return int(m[1]), int(m[2])


def test_the_base_is_a_pinned_ngc_nemo_image_chosen_by_build_args():
    ins = _instructions()
    args = _global_args(ins)
    assert args["FRONTEND"] == "nemo"  # NeMo 2 stays the default path
    assert _tag(args["NEMO_IMAGE"]) <= (26, 4), "26.04 is the last container with NeMo 2"
    from nemo_longctx.shared.versions import NEMO2_CONTAINERS

    tag = "%02d.%02d" % _tag(args["NEMO_IMAGE"])
    assert tag in [c.tag for c in NEMO2_CONTAINERS], "the default base must be a container of the version table"
    assert _tag(args["BRIDGE_IMAGE"]) >= (26, 6), "Megatron-Bridge is the LLM entry from 26.06 on"
    froms = [rest for op, rest in ins if op == "FROM"]
    assert froms == ["${NEMO_IMAGE} AS base-nemo", "${BRIDGE_IMAGE} AS base-bridge", "base-${FRONTEND}"], froms
    last = max(i for i, (op, _) in enumerate(ins) if op == "FROM")
    assert ("ARG", "FRONTEND") in ins[last + 1:], "the final stage must declare FRONTEND again to read it"


def test_plugin_installed_without_deps_and_import_checked():
    runs = [rest for op, rest in _instructions() if op == "RUN"]
    pip = [r for r in runs if "pip install" in r]
    assert pip and all("--no-deps" in r for r in pip)
    joined = " ".join(runs)
    assert "import nemo_longctx" in joined and "from nemo.collections import llm" in joined
    assert "from megatron.bridge.training.pretrain import pretrain" in joined and "nemo_longctx.apps.bridge" in joined
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


@pytest.mark.parametrize("frontend", ["nemo", "bridge", "neither"])
def test_the_run_step_checks_the_chosen_front_end(tmp_path, frontend):
    """The RUN step's shell (what docker runs with FRONTEND in its environment), with python and nemo-longctx
    replaced by stubs that record their arguments: each front end checks its own stack; another value fails."""
    runs = [rest for op, rest in _instructions() if op == "RUN"]
    assert len(runs) == 1
    log = tmp_path / "calls.log"
    for name in ("python", "nemo-longctx"):
        stub = tmp_path / name
        stub.write_text('#!/bin/sh\necho "$(basename "$0") $*" >>"$LOG"\n')
        stub.chmod(0o755)
    r = subprocess.run(["sh", "-c", runs[0]], capture_output=True, text=True, timeout=30,
                       env={"PATH": f"{tmp_path}:/usr/bin:/bin", "FRONTEND": frontend, "LOG": str(log)})
    calls = log.read_text().splitlines()
    assert calls[0] == "python -m pip install --no-cache-dir --no-deps ."
    assert calls[1].startswith("python -c import nemo_longctx,")
    if frontend == "neither":
        assert r.returncode == 2 and "FRONTEND=neither must be nemo or bridge" in r.stderr
        return
    assert r.returncode == 0, r.stderr
    if frontend == "nemo":  # the installed NeMo / Megatron-core checked against the tested stacks
        check, versions, plan = calls[2:]
        assert versions == "python -m nemo_longctx.shared.versions"
    else:
        check, plan = calls[2:]
    if frontend == "bridge":
        assert "megatron.bridge.training.pretrain" in check and "nemo.collections" not in check
        assert plan.startswith("nemo-longctx plan ") and "plan.frontend=bridge" in plan
    else:
        assert "from nemo.collections import llm" in check and "megatron.bridge" not in check
        assert plan.startswith("nemo-longctx plan ") and "frontend" not in plan


def test_the_version_check_names_untested_stacks_and_fails_only_when_strict(tmp_path):
    from nemo_longctx.shared import versions

    assert versions.problems({"nemo": "2.7.3", "megatron_core": "0.15.3", "nemo_run": "0.11.1"}) == []
    assert versions.problems({"nemo": "2.5.0", "megatron_core": "0.14.0rc2", "nemo_run": "0.6.0"}) == []
    p = versions.problems({"nemo": "2.7.3", "megatron_core": "0.17.0rc1+abc", "nemo_run": "0.9.0"})
    assert len(p) == 1 and "megatron-core 0.17.0rc1+abc (NGC NeMo 26.04) is not a tested stack" in p[0], p
    assert "nemo-toolkit 2.7.3 + megatron-core 0.15.3" in p[0]
    assert "needs both installed" in versions.problems({"nemo": None, "megatron_core": "0.19.2"})[0]
    # the module run the Dockerfile does: a warning, or an error with STRICT_VERSIONS=1 (stubbed metadata)
    code = ("import sys, nemo_longctx.shared.versions as v; v.installed = lambda: {'nemo': '2.7.0', 'megatron_core': "
            "'0.16.0', 'nemo_run': '0.8.0'}; sys.exit(v.main())")
    for strict, rc, word in (("0", 0, "WARNING"), ("1", 1, "ERROR")):
        r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60,
                           env={**os.environ, "STRICT_VERSIONS": strict})
        assert r.returncode == rc and f"{word}: nemo-toolkit 2.7.0 + megatron-core 0.16.0 (NGC NeMo 26.02)" in r.stderr
