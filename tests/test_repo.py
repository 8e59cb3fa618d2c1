"""Repository-level promises: the README's set-up commands and CI agree."""

import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def _readme_commands():
    return re.findall(r"```bash\n(.+?)\n```", (ROOT / "README.md").read_text())


def test_readme_has_two_setup_commands_and_ci_runs_the_test_one():
    commands = _readme_commands()
    assert len(commands) >= 2
    main_cmd, test_cmd = commands[0], commands[1]
    assert "nemo-longctx train" in main_cmd
    assert "pytest" in test_cmd
    ci = (ROOT / ".ci" / "run").read_text()
    assert test_cmd in ci.splitlines(), ".ci/run must run the README's test command verbatim"
    bridge = [c for c in commands if "tests_bridge" in c]  # the Megatron-Bridge stack's test command
    assert len(bridge) == 1 and bridge[0] in ci.splitlines(), ".ci/run must run the README's Bridge test command"
    matrix = [c for c in commands if "matrix_smoke.sh" in c]  # the NeMo 2 version matrix (container stacks)
    assert len(matrix) == 1 and matrix[0] in ci.splitlines(), ".ci/run must run the README's version-matrix command"
    stacks = sorted(p.stem[len("nemo-"):] for p in (ROOT / "constraints").glob("nemo-*.txt"))
    assert [a for a in matrix[0].split()[1:] if not a.startswith("--")] == stacks, \
        "the matrix command must name every container stack of constraints/"


MARKS_PLUGIN = """\
import json, os


def pytest_collection_finish(session):
    with open(os.environ["MARKS_OUT"], "w") as f:
        json.dump([[i.nodeid, sorted({m.name for m in i.iter_markers()})] for i in session.items], f)
"""


def test_the_matrix_hands_pytest_every_file_that_holds_its_tests(tmp_path):
    """``scripts/matrix_smoke.sh`` runs each set (a pytest marker) on the files its ``--files MARKER`` lists, not on
    the whole suite: those must be exactly the files whose tests pytest selects by that marker."""
    import json
    import os
    import subprocess
    import sys

    (tmp_path / "marks_plugin.py").write_text(MARKS_PLUGIN)
    env = {**os.environ, "MARKS_OUT": str(tmp_path / "marks.json"),
           "PYTHONPATH": os.pathsep.join([str(tmp_path), *filter(None, [os.environ.get("PYTHONPATH")])])}
    p = subprocess.run([sys.executable, "-m", "pytest", "-p", "marks_plugin", "-p", "no:cacheprovider",
                        "--collect-only", "-q", "tests"], cwd=ROOT, env=env, capture_output=True, text=True,
                       timeout=300)
    assert p.returncode == 0, (p.stdout + p.stderr)[-3000:]
    items = json.loads((tmp_path / "marks.json").read_text())
    for marker in ("matrix", "matrix_mcore"):
        selected = sorted({nodeid.split("::")[0] for nodeid, marks in items if marker in marks})
        listed = subprocess.run([str(ROOT / "scripts" / "matrix_smoke.sh"), "--files", marker], cwd=ROOT,
                                capture_output=True, text=True, timeout=60)
        assert listed.returncode == 0, listed.stderr
        assert sorted(listed.stdout.split()) == selected and selected, (marker, listed.stdout, selected)


def test_attention_layer_does_not_import_megatron_or_nemo():
    for sub in ("attention", "memory"):
        for path in (ROOT / "nemo_longctx" / sub).rglob("*.py"):
            text = path.read_text()
            assert not re.search(r"^\s*(from|import)\s+(megatron|nemo)\b", text, re.M), path
