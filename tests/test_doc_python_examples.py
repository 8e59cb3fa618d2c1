"""The manual's Python examples run as written (``tests/doc_python.py``: the block's own text, the documented shrink,
on the CPU): the NeMo-Run page's two examples in ONE script (NeMo's ``llama3_8b`` recipe shrunk to the app's tiny
model; 8 GPUs -> 2 torchrun processes; each ``run.run`` must train its 3 steps: ``run.run`` returns normally when a
job fails), the Python API page's example on 2 gloo ranks, the launching page's warm rank server (two runs). Every
```` ```python ```` block of the README and the manual is run here or by the Megatron-Bridge suite
(``RUN_BY_BRIDGE``)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import doc_python as D

TESTS = Path(__file__).resolve().parent
VENV_BIN = str(Path(sys.executable).parent)
NEMO_RUN = [("docs/how-to/nemo-run.md", 0), ("docs/how-to/nemo-run.md", 1)]
API = ("docs/how-to/python-api.md", 0)
WARM_SERVER = ("docs/how-to/launching.md", 0)
RUN_BY_BRIDGE = {  # the Megatron-Bridge stack (Python 3.12, .venv-bridge) runs these
    ("docs/how-to/bridge.md", 0): "tests_bridge/test_bridge_doc_examples.py",
}


def test_every_python_block_of_the_docs_runs_somewhere():
    blocks = {(page, n) for page, n, _ in D.python_blocks()}
    assert blocks == set(NEMO_RUN) | {API, WARM_SERVER} | set(RUN_BY_BRIDGE), blocks


def test_the_shrink_leaves_no_gpu_only_line_and_catches_an_unknown_size():
    for page, n in [*NEMO_RUN, API]:
        text = D.block(page, n)
        shrunk, _ = D.shrink(text)
        assert D.gpu_only_lines(shrunk) == [], (page, n, D.gpu_only_lines(shrunk))
    raw = D.gpu_only_lines(D.block(*NEMO_RUN[0]))  # the control: the block as written asks for 8 GPUs
    assert any("num_gpus_per_node=8" in line for line in raw) and any("cp_size=8" in line for line in raw), raw
    new = ("recipe = llm.llama3_8b.pretrain_recipe(num_gpus_per_node=4)\nrun.SlurmExecutor(nodes=1)\n"
           "f(seq_length=8192)\n")
    bad = D.gpu_only_lines(D.shrink(new)[0])
    assert [b.split(":")[0] for b in bad] == ["line 1", "line 2", "line 3"], bad


def test_every_substitution_is_used_by_some_block():
    """A substitution no block needs any more says the docs changed: the list is kept to what the pages ask."""
    used = {u.split(" -> ")[0] for _, _, text in D.python_blocks() for u in D.shrink(text)[1]}
    assert used == {old for old, _ in D.SUBSTITUTIONS}, used


def _losses(path: Path) -> list:
    rows = [json.loads(line) for line in path.read_text().splitlines() if line.strip()]
    return [r["loss"] for r in rows if "loss" in r]


def test_the_nemo_run_examples_train_as_written(tmp_path):
    blocks = []
    for page, n in NEMO_RUN:
        text, subs = D.shrink(D.block(page, n))
        blocks.append((f"{page}, python block {n + 1} (shrunk: {', '.join(subs) or 'as written'})", text))
    script = tmp_path / "doc_examples.py"
    script.write_text(D.nemo_run_script(blocks, str(tmp_path / "out")))
    env = {**os.environ, "NEMORUN_HOME": str(tmp_path / "nemorun_home"),
           "PATH": VENV_BIN + os.pathsep + os.environ["PATH"]}
    p = subprocess.run([sys.executable, str(script)], cwd=tmp_path, env=env, capture_output=True, text=True,
                       timeout=900)
    log = p.stdout + p.stderr
    assert p.returncode == 0, log[-5000:]
    # block 1: run.run with LongContextPlugin (recipe0), the rewrite without running (recipe1); block 2: run.run
    # with PlannedLongContextPlugin (recipe2)
    assert f"doc-example recipe dirs: {[str(tmp_path / 'out' / f'recipe{i}') for i in range(3)]}" in log, log[-3000:]
    for trained in ("recipe0", "recipe2"):
        metrics = tmp_path / "out" / trained / "nemo_longctx" / "metrics.jsonl"
        assert metrics.exists(), (trained, log[-5000:])
        losses = _losses(metrics)
        assert len(losses) == 3 and all(x == x for x in losses), (trained, losses)
    assert not (tmp_path / "out" / "recipe1" / "nemo_longctx").exists()
    assert "long_context_planned: cp=" in log, log[-3000:]  # the plugin's line naming the chosen candidate


def test_the_python_api_example_runs_as_written(tmp_path):
    text = D.block(*API)
    assert D.free_names(text) == D.API_PROVIDES, D.free_names(text) ^ D.API_PROVIDES
    f = tmp_path / "block.py"
    f.write_text(text)
    p = subprocess.run([sys.executable, str(TESTS / "doc_python.py"), "api", str(f), f"{API[0]}, python block 1"],
                       capture_output=True, text=True, timeout=300, cwd=tmp_path,
                       env={**os.environ, "PYTHONPATH": os.pathsep.join([str(D.ROOT), str(TESTS)])})
    log = p.stdout + p.stderr
    assert p.returncode == 0 and log.count("the example ran; out (1, 32, 4, 16)") == 2, log[-4000:]


def test_the_warm_server_example_runs_as_written(tmp_path):
    """The launching page's example: one rank server, two runs whose ranks fork from it (each trains its steps)."""
    script = tmp_path / "warm_server.py"
    script.write_text(textwrap.dedent(D.block(*WARM_SERVER)))  # (the block sits in a list item)
    p = subprocess.run([sys.executable, str(script)], cwd=tmp_path, capture_output=True, text=True, timeout=600,
                       env={**os.environ, "PATH": VENV_BIN + os.pathsep + os.environ["PATH"]})
    log = p.stdout + p.stderr
    assert p.returncode == 0, log[-4000:]
    for steps in (2, 4):
        losses = _losses(tmp_path / "runs" / str(steps) / "metrics.jsonl")
        assert len(losses) == steps and all(x == x for x in losses), (steps, losses)

