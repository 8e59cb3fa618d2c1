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


def test_attention_layer_does_not_import_megatron_or_nemo():
    for sub in ("attention", "memory"):
        for path in (ROOT / "nemo_longctx" / sub).rglob("*.py"):
            text = path.read_text()
            assert not re.search(r"^\s*(from|import)\s+(megatron|nemo)\b", text, re.M), path
