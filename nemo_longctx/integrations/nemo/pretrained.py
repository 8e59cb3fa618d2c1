"""``init_from=<dir>``: train from a pretrained checkpoint instead of a random initialisation.

``<dir>`` is a NeMo checkpoint (``nemo-longctx import``'s output, or a checkpoint of a run trained from one), or a
local Hugging Face model directory, which is imported once (``nemo-longctx import`` in a subprocess, before any rank
starts) into ``<output_dir>/pretrained`` and reused from there by later runs of the same output dir.

The model config, the model class (``LlamaModel``/``Qwen2Model``: they carry NeMo's HF exporter) and the tokenizer
come from the checkpoint's context; the command line's ``model.<field>=...`` overrides are applied on top, and only
the fields of ``hf.SAFE_OVERRIDES`` (sequence length, RoPE base/scaling, dropout, recompute, kernel choices) are
accepted -- anything else (and a ``model=<group>`` choice) is refused naming the field. The weights are loaded by
NeMo's own restore path (``nl.AutoResume(restore_config=nl.RestoreConfig(path, load_model_state=True))``: the
strategy loads them after the model is built, at any TP/CP/PP layout); a checkpoint of this run in
``checkpoint.dir`` takes precedence (``checkpoint.resume=auto``), so an interrupted run resumes instead of restarting
from the pretrained weights.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path
from typing import Any, List, Optional, Tuple

from nemo_longctx.integrations.nemo import hf
from nemo_longctx.options import raise_problems
from nemo_longctx.shared.progress import wait_for
from nemo_longctx.shared.run_spec import RunSpec

IMPORTED_SUBDIR = "pretrained"


def imported_dir(spec: RunSpec) -> Path:
    return Path(os.path.abspath(str(spec.output_dir))) / IMPORTED_SUBDIR


def checkpoint_path(spec: RunSpec) -> Path:
    """The NeMo checkpoint ``init_from`` stands for (a HF directory: its import in the output dir)."""
    path = Path(os.path.abspath(spec.init_from.path))
    if hf.is_nemo_checkpoint(path):
        return path
    if hf.is_hf_dir(path):
        return imported_dir(spec)
    return hf.resolve_checkpoint(path, field="init_from")


def init_from_problems(spec: RunSpec) -> List[str]:
    """Config-level problems of ``init_from`` (no NeMo import): the path and the command line's model overrides
    (``RunSpec.init_from``: read from the command line with the spec)."""
    source = spec.init_from.path
    if source is None:
        return []
    problems: List[str] = []
    path = Path(os.path.abspath(source))
    if hf.is_hf_dir(path) and not hf.is_nemo_checkpoint(path):
        if not hf.is_nemo_checkpoint(imported_dir(spec)):
            problems += hf.hf_source_problems(path, field="init_from")
    else:
        try:
            hf.resolve_checkpoint(path, field="init_from")
        except ValueError as e:
            problems.append(f"{e} (nor a Hugging Face model directory)")
    overrides = spec.init_from.overrides
    return problems + list(spec.init_from.problems) + hf.unsafe_override_problems(list(overrides))


def prepare(spec: RunSpec, rank: int = 0, timeout_s: float = 3600, local_rank: Optional[int] = None) -> None:
    """Import a HF ``init_from`` into ``<output_dir>/pretrained`` once (rank 0, showing its progress; the other ranks
    wait for it, one per node saying so: ``progress.wait_for``)."""
    source = spec.init_from.path
    if source is None or hf.is_nemo_checkpoint(source) or not hf.is_hf_dir(source):
        return
    target = imported_dir(spec)
    if hf.is_nemo_checkpoint(target):
        return
    if rank != 0:
        wait_for(lambda: hf.is_nemo_checkpoint(target), f"import init_from={source} into {target}", rank=rank,
                 local_rank=local_rank, timeout_s=timeout_s)
        return
    target.parent.mkdir(parents=True, exist_ok=True)
    print(f"nemo-longctx: importing init_from={source} into {target} (once)", flush=True)
    # a separate process: NeMo's importer sets up its own single-process trainer and process group
    code = subprocess.call([sys.executable, "-m", "nemo_longctx.apps.cli", "import", f"source={source}",
                            f"output={target}"])
    if code != 0:
        raise RuntimeError(f"init_from={source}: importing it into {target} failed (exit {code}; see above)")


def pretrained_model_config(spec: RunSpec) -> Tuple[Any, type, Any]:
    """(model config with the command line's safe overrides, model class, tokenizer) of ``init_from``."""
    path = checkpoint_path(spec)
    if not hf.is_nemo_checkpoint(path):
        raise ValueError(f"init_from={spec.init_from.path}: {path} is not an imported checkpoint (yet)")
    model_cls, config, tokenizer = hf.pretrained_model(path)
    overrides, problems = dict(spec.init_from.overrides), list(spec.init_from.problems)
    if problems:
        raise_problems(problems + hf.unsafe_override_problems(list(overrides)))
    config = hf.apply_model_overrides(config, overrides)
    return config, model_cls, tokenizer


def restore_config(spec: RunSpec) -> Any:
    """NeMo's RestoreConfig for the pretrained weights (model state only: a fresh optimizer and schedule)."""
    from nemo import lightning as nl

    return nl.RestoreConfig(path=str(checkpoint_path(spec)), load_model_state=True, load_optim_state=False,
                            load_artifacts=False)
