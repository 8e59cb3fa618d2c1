"""`nemo-longctx train|plan|bridge --help`: our own groups and keys, generated from the option model
(``nemo_longctx.options``, ``app_keys.APP_OPTIONS``, ``plan_keys.PLAN_OPTIONS``, the Bridge app's keys) and the
conf/ tree; every declared key must have a help line and appear in its app's help; ``--hydra-help`` still reaches
Hydra; each answers without importing torch or any framework (``python -X importtime`` lists what it imported)."""

from __future__ import annotations

import subprocess
import sys
import time
from pathlib import Path

import pytest

from app_runner import HEAVY, run_importtime

ROOT = Path(__file__).resolve().parents[1]
CLI = Path(sys.executable).with_name("nemo-longctx")
CONF = ROOT / "nemo_longctx" / "conf"


def _cli(*args, timeout=60):
    t0 = time.perf_counter()
    r = subprocess.run([str(CLI), *args], cwd=ROOT, capture_output=True, text=True, timeout=timeout)
    return r, time.perf_counter() - t0


def _help(*args):
    """``nemo-longctx ARGS`` under ``python -X importtime``: (exit code, stdout, stderr, the heavy modules it imported
    -- torch included --, seconds)."""
    return run_importtime([CLI, *args], ROOT, HEAVY + ("torch",))


@pytest.mark.parametrize("flag", ["--help", "-h"])
def test_train_help_lists_every_group_choice_and_declared_key(flag):
    from nemo_longctx.apps.help import defaults_of, group_choices
    from nemo_longctx.options import LongContextOptions
    from nemo_longctx.shared.app_keys import APP_OPTIONS

    code, out, err, heavy, seconds = _help("train", flag, "model=llama3_8b")
    assert code == 0, err
    assert heavy == [] and seconds < 30, (heavy, seconds)  # (the time: a hang guard on a loaded machine)
    for group, default, _ in defaults_of("train"):
        assert f"  {group}" in out, group
        for choice, _ in group_choices(group):
            assert choice in out, (group, choice)
        assert f"* {default}" in out, (group, default)
    assert {g for g, _, _ in defaults_of("train")} >= {"model", "cp", "optim", "recompute", "offload", "tiling"}
    for o in tuple(LongContextOptions.options()) + tuple(APP_OPTIONS):
        assert o.help.strip(), f"{o.key}: declared without a help line"
        line = next((l for l in out.splitlines() if l.strip().startswith(o.key + " ")), None)
        assert line is not None, f"{o.key} missing from train --help"
        assert o.help in line and o.expectation() in line, line
    assert "run.dry_run=true" in out and "model=llama3_8b" in out  # the worked Llama-3-8B example is a dry run
    assert "--hydra-help" in out and "Traceback" not in err


def test_plan_help_lists_plan_keys_not_train_groups():
    from nemo_longctx.shared.plan_keys import PLAN_OPTIONS

    code, out, err, heavy, seconds = _help("plan", "--help")
    assert code == 0, err
    assert heavy == [] and seconds < 30, (heavy, seconds)
    for o in PLAN_OPTIONS:
        assert o.help.strip(), f"{o.key}: declared without a help line"
        assert any(l.strip().startswith(o.key + " ") for l in out.splitlines()), o.key
    assert "h100" in out and "h200" in out and "llama3_8b" in out  # the plan and model groups
    assert "  cp:" not in out and "trainer.devices" not in out and "recompute (optional group)" not in out
    assert "--hydra-help" in out


def test_plan_keys_cover_plan_yaml():
    """Every leaf key of conf/plan.yaml and of the plan presets is declared in PLAN_OPTIONS (and so in --help)."""
    import yaml

    from nemo_longctx.shared.plan_keys import PLAN_OPTIONS

    def leaves(node, prefix):
        for k, v in node.items():
            if isinstance(v, dict):
                yield from leaves(v, f"{prefix}.{k}")
            else:
                yield f"{prefix}.{k}"

    declared = {o.key for o in PLAN_OPTIONS}
    keys = set(leaves(yaml.safe_load((CONF / "plan.yaml").read_text())["plan"], "plan"))
    for preset in (CONF / "plan").glob("*.yaml"):
        keys |= set(leaves(yaml.safe_load(preset.read_text()), "plan"))
    assert keys <= declared, sorted(keys - declared)


def test_bridge_help_in_process(capsys):
    from nemo_longctx.shared.app_keys import BRIDGE_OPTIONS
    from nemo_longctx.apps.help import help_text

    out = help_text("bridge", app_options=BRIDGE_OPTIONS)
    for o in BRIDGE_OPTIONS:
        assert o.help.strip() and any(l.strip().startswith(o.key + " ") for l in out.splitlines()), o.key
    assert "cp.size" in out and "trainer.devices" not in out


@pytest.mark.parametrize("app", ["train", "plan"])
def test_hydra_help_still_reaches_hydra(app):
    r, seconds = _cli(app, "--hydra-help")
    assert r.returncode == 0, r.stderr
    assert "Hydra (" in r.stdout and "== Flags ==" in r.stdout, r.stdout[:500]


def test_python_m_train_help_is_ours():
    r = subprocess.run([sys.executable, "-m", "nemo_longctx.apps.train", "--help"], cwd=ROOT, capture_output=True,
                       text=True, timeout=60)
    assert r.returncode == 0 and r.stdout.startswith("usage: "), r.stderr


def test_the_import_check_sees_a_framework_import():
    """The control for the checks above: a process that imports Megatron-core is seen doing so (an empty list from a
    changed ``-X importtime`` format would otherwise pass them all)."""
    code, _, err, heavy, _ = run_importtime(["-c", "import megatron.core"], ROOT, HEAVY + ("torch",), timeout=120)
    assert code == 0, err[-2000:]
    assert heavy == ["megatron", "torch"], heavy
    assert "import time:" not in err


@pytest.mark.parametrize("flag", ["--version", "-V"])
def test_version_names_ours_and_the_installed_stack_without_importing_it(flag):
    from importlib import metadata

    from nemo_longctx import __version__

    code, out, err, heavy, _ = _help(flag)
    assert code == 0 and not heavy, (code, heavy, err)
    lines = out.splitlines()
    assert lines[0] == f"nemo-longctx {__version__}" and lines[1].startswith("python 3."), out
    assert f"torch {metadata.version('torch')}" in lines, out
    assert f"megatron-core {metadata.version('megatron-core')}" in lines, out
    assert lines[-1] == "NeMo 2 stack: tested", out  # this suite's stack (constraints/nemo.txt)
    assert metadata.version("nemo-longctx") == __version__  # the package's metadata and the module agree


def test_versions_lists_every_patch_ledger_row_without_importing_the_stack():
    """``--versions``: the ``--version`` lines, then the three patch ledgers (Megatron-core, NeMo 2, Megatron-Bridge),
    every row with its key, devices, target, versions and reason -- read without importing torch or a framework."""
    from nemo_longctx.apps.ledgers import ledgers

    code, out, err, heavy, _ = _help("--versions")
    assert code == 0 and not heavy, (code, heavy, err)
    lines = out.splitlines()
    code, version_out, _, _, _ = _help("--version")
    assert out.startswith(version_out), (out, version_out)  # the --version lines first, unchanged
    for ledger in ledgers():
        assert f"{ledger.framework} patch ledger ({len(ledger.rows)} rows):" in lines, out
        for row in ledger.rows:
            assert "  " + row.line() in lines, (row, out)
            assert row.devices in row.line() and row.versions in row.line() and row.why in row.line()
