"""The manual's Python examples, run as written: every ```` ```python ```` block of README.md and docs/**/*.md is the
exact text executed (``tests/test_doc_python_examples.py``; the Megatron-Bridge page's block:
``tests_bridge/test_bridge_doc_examples.py``), with only the shrink below applied, on the CPU:

- ``SUBSTITUTIONS``: the documented sizes that need GPUs, each replaced by the CPU's (8 GPUs -> 2 gloo processes,
  1M tokens -> ``SEQ``). ``gpu_only_lines(block)`` names every line that still asks for more than this machine has
  (a process count or CP size above 2, a sequence above ``MAX_SEQ``, an executor other than ``LocalExecutor``): a
  new example with a size no substitution knows fails the test instead of running something else.
- A prelude, shown in the assembled script: NeMo's ``llama3_8b`` recipe shrunk to the app's tiny model
  (``nemo_run_recipes.shrink_recipe``: tiny Llama, synthetic data, fp32, CPU, 3 steps; a global batch of
  2, one sample per process); for the Python API page the
  inputs the example takes as given (``q``, ``k_local``, ``cp_group``, ...; ``free_names`` checks that the prelude
  defines exactly the names the block uses without defining them).

``python tests/doc_python.py api BLOCK_FILE`` runs the Python API block on 2 gloo ranks.
"""

from __future__ import annotations

import ast
import builtins
import os
import sys
from pathlib import Path
from typing import Dict, List, Set, Tuple

ROOT = Path(__file__).resolve().parents[1]
SEQ = 1024  # tests/nemo_run_recipes.SEQ
MAX_SEQ = 4096
MAX_PROCESSES = 2
# (documented text, what runs here): 8 GPUs -> 2 processes (the CP size with them), 1M tokens -> SEQ
SUBSTITUTIONS: List[Tuple[str, str]] = [
    ("num_gpus_per_node=8", "num_gpus_per_node=2"),
    ("ntasks_per_node=8", "ntasks_per_node=2"),
    ("cp_size=8", "cp_size=2"),
    ("seq_length=1048576", f"seq_length={SEQ}"),
    ('"size": 8', '"size": 2'),  # an option group's CP size (the Bridge page)
]
# the same for a command's KEY=VALUE arguments (the Bridge page's `nemo-longctx bridge` commands)
ARG_SUBSTITUTIONS = {"cp.size=8": "cp.size=2"}
PROCESS_KEYWORDS = {"num_gpus_per_node", "ntasks_per_node", "num_nodes", "nodes", "devices", "cp_size", "tp_size",
                    "ulysses_size", "gpus", "nproc_per_node"}
SEQ_KEYWORDS = {"seq_length", "seq_len"}

Block = Tuple[str, int, str]  # (page relative to the root, ordinal of the python block on the page, text)


def pages() -> List[Path]:
    return [ROOT / "README.md", *sorted((ROOT / "docs").rglob("*.md"))]


def python_blocks() -> List[Block]:
    """Every ```python fence of the README and the manual."""
    out = []
    for path in pages():
        lines, n, i = path.read_text().splitlines(), 0, 0
        while i < len(lines):
            if lines[i].strip() == "```python":
                j = i + 1
                while j < len(lines) and lines[j].strip() != "```":
                    j += 1
                out.append((str(path.relative_to(ROOT)), n, "\n".join(lines[i + 1:j]) + "\n"))
                n += 1
                i = j
            i += 1
    return out


def block(page: str, n: int) -> str:
    return next(text for p, i, text in python_blocks() if (p, i) == (page, n))


def shrink(text: str) -> Tuple[str, List[str]]:
    """(the block with ``SUBSTITUTIONS`` applied, the substitutions that applied)."""
    used = []
    for old, new in SUBSTITUTIONS:
        if old in text:
            text = text.replace(old, new)
            used.append(f"{old} -> {new}")
    return text, used


def gpu_only_lines(text: str) -> List[str]:
    """The lines of ``text`` (after ``shrink``) that still ask for more than this CPU runs."""
    bad = []
    lines = text.splitlines()
    for node in ast.walk(ast.parse(text)):
        why = ""
        if isinstance(node, ast.keyword) and isinstance(node.value, ast.Constant) and isinstance(node.value.value,
                                                                                                 int):
            if node.arg in PROCESS_KEYWORDS and node.value.value > MAX_PROCESSES:
                why = f"{node.arg}={node.value.value} > {MAX_PROCESSES} processes"
            elif node.arg in SEQ_KEYWORDS and node.value.value > MAX_SEQ:
                why = f"{node.arg}={node.value.value} > {MAX_SEQ} tokens"
        elif isinstance(node, ast.Dict):
            for key, value in zip(node.keys, node.values):
                if (isinstance(key, ast.Constant) and key.value in PROCESS_KEYWORDS | {"size"}
                        and isinstance(value, ast.Constant) and isinstance(value.value, int)
                        and value.value > MAX_PROCESSES):
                    why = f"{key.value!r}: {value.value} > {MAX_PROCESSES} processes"
        elif isinstance(node, (ast.Attribute, ast.Name)):
            name = node.attr if isinstance(node, ast.Attribute) else node.id
            if name.endswith("Executor") and name != "LocalExecutor":
                why = f"{name} (not a local executor)"
        if why:
            bad.append(f"line {node.lineno}: {lines[node.lineno - 1].strip()}: {why}")
    return bad


def free_names(text: str) -> Set[str]:
    """The names ``text`` reads without binding them (imports, assignments) nor taking them from builtins."""
    bound, read = set(), set()
    for node in ast.walk(ast.parse(text)):
        if isinstance(node, ast.Name):
            (read if isinstance(node.ctx, ast.Load) else bound).add(node.id)
        elif isinstance(node, (ast.Import, ast.ImportFrom)):
            bound |= {(a.asname or a.name).split(".")[0] for a in node.names}
    return read - bound - set(dir(builtins))


# ------------------------------------------------------------------------------------------ NeMo-Run pages
def nemo_run_script(blocks: List[Tuple[str, str]], out: str) -> str:
    """One script: the shrink prelude, then each (label, shrunk block) in order (a later block of a page continues
    the earlier ones, as a reader runs them), then a line per recipe the examples trained."""
    parts = [f'''# ---- the shrink (tests/doc_python.py): NeMo's llama3_8b recipe as the example calls it, for the CPU
import sys as _sys
_sys.path.insert(0, {str(ROOT / "tests")!r})
import nemo_run_recipes as _shrink
from nemo.collections.llm.recipes import llama3_8b as _llama3_8b

_real_recipe, _recipe_dirs = _llama3_8b.pretrain_recipe, []


def _shrunk_recipe(*args, **kwargs):
    _recipe_dirs.append({out!r} + f"/recipe{{len(_recipe_dirs)}}")
    recipe = _shrink.shrink_recipe(_real_recipe(*args, **{{"dir": _recipe_dirs[-1], **kwargs}}))
    recipe.data.global_batch_size = 2  # one sample per process, whatever data-parallel size a plan leaves
    return recipe


_llama3_8b.pretrain_recipe = _shrunk_recipe
''']
    for label, text in blocks:
        parts.append(f"# ---- {label}\n{text}")
    parts.append('if __name__ == "__main__":\n    print("doc-example recipe dirs:", _recipe_dirs, flush=True)\n')
    return "\n".join(parts)


# ------------------------------------------------------------------------------------------ Python API page
API_INPUTS = '''
# ---- the inputs the example takes as given (tests/doc_python.py): 2 gloo ranks in one CP group, a 64-token
# sequence, GQA (4 query heads, 2 KV heads), two packed documents of 21 and 37 tokens padded to 24 and 40
import torch
import torch.distributed as dist
from nemo_longctx.attention import zigzag_shard as _shard

cp, rank, cp_group = dist.get_world_size(), dist.get_rank(), dist.new_group(list(range(dist.get_world_size())))
torch.manual_seed(0)
q, _k, _v = torch.randn(1, 64, 4, 16), torch.randn(1, 64, 2, 16), torch.randn(1, 64, 2, 16)
k_local, v_local = _shard(_k, dim=1, cp_size=cp, cp_rank=rank), _shard(_v, dim=1, cp_size=cp, cp_rank=rank)
cu = torch.tensor([0, 21, 58], dtype=torch.int32)
cu_padded = torch.tensor([0, 24, 64], dtype=torch.int32)
sinks = torch.nn.Parameter(torch.zeros(4))
'''
API_PROVIDES = {"cp", "rank", "cp_group", "q", "k_local", "v_local", "cu", "cu_padded", "sinks"}


def _api_rank(rank: int, world: int, port: int, text: str, label: str) -> None:
    import torch.distributed as dist

    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=rank, world_size=world)
    ns: Dict[str, object] = {"__name__": "__main__"}
    exec(compile(API_INPUTS, "tests/doc_python.py:API_INPUTS", "exec"), ns)
    exec(compile(text, label, "exec"), ns)  # the block as written
    out = ns["out"]
    assert tuple(out.shape) == (1, 32, 4, 16), out.shape
    print(f"rank {rank}: the example ran; out {tuple(out.shape)}", flush=True)
    dist.destroy_process_group()


def run_api(block_file: str, label: str) -> None:
    import socket

    import torch.multiprocessing as mp

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    mp.spawn(_api_rank, args=(2, port, Path(block_file).read_text(), label), nprocs=2)


if __name__ == "__main__":
    if sys.argv[1] == "api":
        run_api(sys.argv[2], sys.argv[3])
    else:
        sys.exit(f"usage: {sys.argv[0]} api BLOCK_FILE LABEL")
