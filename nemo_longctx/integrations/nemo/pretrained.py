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
from typing import Any, Dict, List, Optional, Tuple

from omegaconf import DictConfig, OmegaConf

from nemo_longctx.integrations.nemo import hf
from nemo_longctx.options import raise_problems
from nemo_longctx.shared.progress import wait_for

IMPORTED_SUBDIR = "pretrained"


def init_from_of(cfg: DictConfig) -> Optional[str]:
    value = cfg.get("init_from")
    return None if value in (None, "") else str(value)


def imported_dir(cfg: DictConfig) -> Path:
    return Path(os.path.abspath(str(cfg.output_dir))) / IMPORTED_SUBDIR


def checkpoint_path(cfg: DictConfig) -> Path:
    """The NeMo checkpoint ``init_from`` stands for (a HF directory: its import in the output dir)."""
    path = Path(os.path.abspath(init_from_of(cfg)))
    if hf.is_nemo_checkpoint(path):
        return path
    if hf.is_hf_dir(path):
        return imported_dir(cfg)
    return hf.resolve_checkpoint(path, field="init_from")


def command_line_model_overrides(cfg: DictConfig, task: Optional[List[str]] = None) -> Tuple[Dict[str, Any], List[str]]:
    """({field: value} of the command line's ``model.<field>=...``, problems). Values come from the composed config
    (types as Hydra parsed them). ``task``: the overrides (default: this Hydra run's ``overrides.task``)."""
    from hydra.core.override_parser.overrides_parser import OverridesParser

    if task is None:
        from hydra.core.hydra_config import HydraConfig

        if HydraConfig.initialized():
            task = list(HydraConfig.get().overrides.task)
        else:  # composed by Hydra's compose API with its own node (the app's preflight)
            task = list(OmegaConf.select(cfg, "hydra.overrides.task", default=None) or [])
    out: Dict[str, Any] = {}
    problems: List[str] = []
    for o in OverridesParser.create().parse_overrides(task):
        key = o.key_or_group
        if key == "model":
            problems.append(f"model={o.value()}: init_from takes the model from the checkpoint; a model group cannot "
                            f"be chosen with it (override single fields: model.seq_length=...)")
        elif key.startswith("model."):
            field = key[len("model."):]
            if o.is_delete() or "." in field:
                problems.append(f"{o.input_line}: with init_from only plain model.<field>=<value> overrides apply")
                continue
            value = cfg.model.get(field)
            out[field] = OmegaConf.to_container(value, resolve=True) if OmegaConf.is_config(value) else value
    return out, problems


def init_from_problems(cfg: DictConfig) -> List[str]:
    """Config-level problems of ``init_from`` (no NeMo import): the path and the override field names."""
    source = init_from_of(cfg)
    if source is None:
        return []
    problems: List[str] = []
    path = Path(os.path.abspath(source))
    if hf.is_hf_dir(path) and not hf.is_nemo_checkpoint(path):
        if not hf.is_nemo_checkpoint(imported_dir(cfg)):
            problems += hf.hf_source_problems(path, field="init_from")
    else:
        try:
            hf.resolve_checkpoint(path, field="init_from")
        except ValueError as e:
            problems.append(f"{e} (nor a Hugging Face model directory)")
    overrides, more = command_line_model_overrides(cfg)
    return problems + more + hf.unsafe_override_problems(list(overrides))


def prepare(cfg: DictConfig, rank: int = 0, timeout_s: float = 3600, local_rank: Optional[int] = None) -> None:
    """Import a HF ``init_from`` into ``<output_dir>/pretrained`` once (rank 0, showing its progress; the other ranks
    wait for it, one per node saying so: ``progress.wait_for``)."""
    source = init_from_of(cfg)
    if source is None or hf.is_nemo_checkpoint(source) or not hf.is_hf_dir(source):
        return
    target = imported_dir(cfg)
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


def pretrained_model_config(cfg: DictConfig) -> Tuple[Any, type, Any]:
    """(model config with the command line's safe overrides, model class, tokenizer) of ``init_from``."""
    path = checkpoint_path(cfg)
    if not hf.is_nemo_checkpoint(path):
        raise ValueError(f"init_from={init_from_of(cfg)}: {path} is not an imported checkpoint (yet)")
    model_cls, config, tokenizer = hf.pretrained_model(path)
    overrides, problems = command_line_model_overrides(cfg)
    if problems:

        raise_problems(problems + hf.unsafe_override_problems(list(overrides)))
    config = hf.apply_model_overrides(config, overrides)
    return config, model_cls, tokenizer


def restore_config(cfg: DictConfig) -> Any:
    """NeMo's RestoreConfig for the pretrained weights (model state only: a fresh optimizer and schedule)."""
    from nemo import lightning as nl

    return nl.RestoreConfig(path=str(checkpoint_path(cfg)), load_model_state=True, load_optim_state=False,
                            load_artifacts=False)
