"""The Megatron-Bridge examples of the README and the manual run as written (the shrink of ``tests/doc_python.py``,
on the CPU): every ``nemo-longctx bridge`` command of a ```` ```bash ```` block runs (a Bridge recipe with the
model shrunk by Bridge's own overrides, ``RECIPE_SHRINK``; 8 GPUs -> 2 ranks), or is listed with the reason it
cannot (a file it names does not exist here, or ``LISTED``); the Bridge page's Python example runs under torchrun on
2 gloo ranks with the recipe it calls shrunk the same way. Hugging Face's hub is replaced by its own offline cache
holding the recipe model's config.json (no weights are read)."""

from __future__ import annotations

import json
import os
import shlex
import subprocess
import sys
from pathlib import Path

import pytest
from hub_configs import LLAMA3_8B, offline_cache
from runner import ROOT, shared_run

pytest.importorskip("megatron.bridge", reason="the Megatron-Bridge stack (scripts/install_bridge.sh)")
sys.path.insert(0, str(ROOT / "tests"))
import doc_examples  # noqa: E402  (tests/doc_examples.py: the bash blocks, the missing-file rule)
import doc_python as D  # noqa: E402  (tests/doc_python.py: the python blocks and the shrink)

VENV_BIN = Path(sys.executable).parent
# Bridge's overrides that shrink a recipe's model and run for the CPU (a key the command sets is replaced)
RECIPE_SHRINK = ["model.num_layers=2", "model.hidden_size=128", "model.ffn_hidden_size=256",
                 "model.num_attention_heads=4", "model.num_query_groups=2", "model.kv_channels=32",
                 "model.seq_length=256", "dataset.seq_length=256", "train.train_iters=2", "train.global_batch_size=1",
                 "train.micro_batch_size=1", "dataset.num_workers=0", "validation.eval_iters=0",
                 "checkpoint.save=null", "scheduler.lr_warmup_iters=1", "logger.log_interval=1"]
HF_CONFIGS = {  # recipe -> (hub id, config.json: the public values the recipe reads)
    "llama3_8b_pretrain_config": ("meta-llama/Meta-Llama-3-8B", LLAMA3_8B),
}
LISTED = {  # commands not run here, with the test that runs what they show
    "--recipe gpt_oss_20b_pretrain_config": "NVIDIA's GPT-OSS recipe (MoE, sinks) needs its own shrink: "
                                            "tests_bridge/test_gpt_oss_recipe.py trains it",
}


def bridge_commands():
    """(runnable, skipped): every ``nemo-longctx bridge`` command (its arguments) of the README's and the manual's
    bash blocks, each distinct one once; skipped: (args, reason, page)."""
    runnable, skipped, seen = [], [], set()
    for path in [ROOT / "README.md", *doc_examples.doc_pages()]:
        for block, marker in doc_examples.bash_blocks(path.read_text()):
            for line in block.replace("\\\n", " ").splitlines():
                words = shlex.split(line, comments=True)
                if len(words) < 2 or not words[0].endswith("nemo-longctx") or not words[1].startswith("bridge"):
                    continue
                args = tuple(words[2:])
                page = str(path.relative_to(ROOT))
                why = (marker or doc_examples.needs_missing_file(args)
                       or ("'...' stands for more arguments" if "..." in args else "")
                       or LISTED.get(" ".join(args), "")
                       or ("bridge-export needs a checkpoint: tests_bridge/test_bridge_hf.py exports one"
                           if words[1] == "bridge-export" else ""))
                if why:
                    skipped.append((words[1], args, why, page))
                elif args not in seen:
                    seen.add(args)
                    runnable.append((args, page))
    return runnable, skipped


def shrink_args(args):
    """(the command's arguments with ``ARG_SUBSTITUTIONS`` and, for a recipe, ``RECIPE_SHRINK`` applied, the
    arguments that still ask for more than this CPU runs)."""
    out = [D.ARG_SUBSTITUTIONS.get(a, a) for a in args]
    recipe = next((a.split("=", 1)[1] for a in out if a.startswith("recipe=")), None)
    if recipe is not None:
        for ov in RECIPE_SHRINK:
            key = ov.split("=", 1)[0]
            at = [i for i, a in enumerate(out) if a.split("=", 1)[0] == key]
            if at:
                out[at[0]] = ov
            else:
                out.append(ov)
    bad = [a for a in out if a.split("=", 1)[0] in ("cp.size", "launcher.devices")
           and int(a.split("=", 1)[1]) > D.MAX_PROCESSES]
    if recipe is not None and recipe not in HF_CONFIGS:
        bad.append(f"recipe={recipe}: no offline config.json for it (HF_CONFIGS)")
    return out, recipe, bad


def hf_cache(tmp_path: Path, recipe: str) -> dict:
    """HF_HOME with the recipe model's config.json in Hugging Face's own offline cache layout."""
    hub_id, config = HF_CONFIGS[recipe]
    return {"HF_HOME": str(offline_cache(tmp_path / "hf", {hub_id: config})), "HF_HUB_OFFLINE": "1"}


def test_every_bridge_command_is_run_or_listed():
    runnable, skipped = bridge_commands()
    pages = {page for _, page in runnable} | {page for *_, page in skipped}
    assert "docs/how-to/bridge.md" in pages and "README.md" in pages, pages
    assert {" ".join(a) for a, _ in runnable} >= {"", "recipe=llama3_8b_pretrain_config cp=ring cp.size=8 "
                                                       "recompute=full_keep_attn offload=layer_input "
                                                       "train.train_iters=100"}, runnable
    for args, page in runnable:
        assert shrink_args(args)[2] == [], (page, args, shrink_args(args)[2])
    assert {why for _, _, why, _ in skipped} >= set(LISTED.values()), skipped
    assert shrink_args(("recipe=llama3_8b_pretrain_config", "cp.size=4"))[2] == ["cp.size=4"]  # the control


@pytest.mark.smoke
def test_the_cpu_demo_command_runs_as_written():
    """``nemo-longctx bridge`` with no argument: the demo at ring CP=2 on 2 gloo ranks (the run the smoke set's
    parity test compares, shared with it: ``runner.shared_run``)."""
    code, log, rows = shared_run()
    assert code == 0 and "world 2" in log and "core attention: 2 layers run LongContextCoreAttention" in log, \
        log[-3000:]
    assert [r["cp_size"] for r in rows] == [2, 2, 2]


@pytest.mark.smoke
def test_the_recipe_commands_run_shrunk(tmp_path):
    runnable, _ = bridge_commands()
    ran = 0
    for args, page in runnable:
        shrunk, recipe, _ = shrink_args(args)
        if recipe is None:
            continue
        out = tmp_path / f"run{ran}"
        p = subprocess.run([str(VENV_BIN / "nemo-longctx"), "bridge", *shrunk, f"output_dir={out}"], cwd=tmp_path,
                           capture_output=True, text=True, timeout=900,
                           env={**os.environ, **hf_cache(tmp_path, recipe)})
        log = p.stdout + p.stderr
        assert p.returncode == 0 and f"recipe {recipe}" in log, (page, shrunk, log[-4000:])
        assert "core attention: 2 layers run LongContextCoreAttention" in log, (page, log[-3000:])
        rows = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
        assert [r["step"] for r in rows] == [1, 2] and all(r["cp_size"] == 2 for r in rows), rows
        ran += 1
    assert ran >= 1


PYTHON_BLOCKS = [("docs/how-to/bridge.md", 0)]
BRIDGE_PRELUDE = f'''# ---- the shrink (tests_bridge/test_bridge_doc_examples.py): the example's recipe, for the CPU
import megatron.bridge.recipes as _recipes
from megatron.bridge.training.utils.omegaconf_utils import process_config_with_overrides as _overrides

_real_recipe = _recipes.llama3_8b_pretrain_config


def _shrunk_recipe(*args, **kwargs):
    return _overrides(_real_recipe(*args, **kwargs), cli_overrides={RECIPE_SHRINK!r})


_recipes.llama3_8b_pretrain_config = _shrunk_recipe
'''


def test_the_python_blocks_are_the_bridge_pages():
    blocks = {(page, n) for page, n, text in D.python_blocks() if "megatron.bridge" in text}
    assert blocks == set(PYTHON_BLOCKS), blocks


@pytest.mark.smoke
def test_the_python_api_example_trains_as_written(tmp_path):
    text, subs = D.shrink(D.block(*PYTHON_BLOCKS[0]))
    assert subs == ['"size": 8 -> "size": 2'] and D.gpu_only_lines(text) == [], (subs, D.gpu_only_lines(text))
    script = tmp_path / "example.py"
    script.write_text(BRIDGE_PRELUDE + f"\n# ---- {PYTHON_BLOCKS[0][0]}, python block 1 (shrunk: {subs})\n" + text)
    p = subprocess.run([str(VENV_BIN / "torchrun"), "--standalone", "--nproc-per-node", "2", str(script)],
                       cwd=tmp_path, capture_output=True, text=True, timeout=900,
                       env={**os.environ, **hf_cache(tmp_path, "llama3_8b_pretrain_config"),
                            "OMP_NUM_THREADS": "1"})
    log = p.stdout + p.stderr
    assert p.returncode == 0, log[-5000:]
    assert "Starting training loop at iteration 0" in log and "[after training is done]" in log, log[-3000:]
    assert log.count("lm loss") == 2, log[-3000:]  # a line per step (logger.log_interval=1)
