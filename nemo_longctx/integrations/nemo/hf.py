"""Hugging Face checkpoints in and out of NeMo 2, through NeMo's own connectors.

``hf_source_problems(dir)``      what is wrong with a local HF model directory for import (no NeMo import needed):
                                 not a HF model dir, an architecture NeMo's importer cannot convert exactly, a tokenizer
                                 that does not fit the vocabulary; each message names the file/field.
``import_hf(source, output)``    ``llm.import_ckpt`` with the family's model class (``LlamaModel`` -> NeMo's
                                 ``HFLlamaImporter``, ``Qwen2Model`` -> ``HFQwen2Importer``) into a temporary sibling of
                                 ``output``, renamed into place only when complete (a failure leaves nothing behind).
``export_hf(checkpoint, output)`` ``llm.export_ckpt(target="hf")`` (NeMo's ``HFLlamaExporter``/``HFQwen2Exporter``).
``pretrained_model(path)``       (model class, model config, tokenizer) of a NeMo checkpoint's context.
``apply_model_overrides(config, overrides)``  the safe fields only (``SAFE_OVERRIDES``); anything else is refused
                                 naming the field. Llama-3.1 RoPE scaling fields on a plain ``LlamaConfig`` turn it into
                                 NeMo's ``Llama31Config`` (whose ``configure_model`` applies the scaling).

What NeMo's importers do not do (handled here, see docs/how-to/extend-pretrained.md): ``HFLlamaImporter`` reads only
``factor`` of a ``rope_scaling: {rope_type: llama3}`` and keeps NeMo's defaults for ``low_freq_factor``/
``high_freq_factor``/``original_max_position_embeddings`` -> the imported context is corrected from the HF config; other
RoPE scalings (YaRN, linear, dynamic) and Qwen2's ``rope_scaling``/sliding window are ignored by the importers ->
refused; a config.json written by transformers >= 5 (``rope_parameters``) whose RoPE this venv's transformers 4.x would
read differently (its default base, no scaling) -> refused.
"""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import sys
import tempfile
from dataclasses import fields as dataclass_fields
from pathlib import Path
from typing import Any, Dict, List, Optional, Tuple

from nemo_longctx.options import raise_problems
from nemo_longctx.shared.progress import watch_directory

# HF architecture -> NeMo model class (module, name); NeMo registers the "hf" importer/exporter on these classes
FAMILIES = {
    "LlamaForCausalLM": ("nemo.collections.llm.gpt.model.llama", "LlamaModel", "Llama3Config8B"),
    "Qwen2ForCausalLM": ("nemo.collections.llm.gpt.model.qwen2", "Qwen2Model", "Qwen2Config7B"),
}
LLAMA31_ROPE = {  # Llama31Config field <- HF rope_scaling key (rope_type llama3)
    "scale_factor": "factor",
    "low_freq_factor": "low_freq_factor",
    "high_freq_factor": "high_freq_factor",
    "old_context_len": "original_max_position_embeddings",
}
# model-config fields a run from a pretrained checkpoint may change: they leave the weights' meaning intact
SAFE_OVERRIDES = frozenset({
    "seq_length", "rotary_base", *LLAMA31_ROPE,
    "attention_dropout", "hidden_dropout",
    "recompute_granularity", "recompute_method", "recompute_num_layers", "recompute_modules",
    "distribute_saved_activations", "cpu_offloading", "cpu_offloading_num_layers", "cpu_offloading_activations",
    "cpu_offloading_weights",
    "bias_activation_fusion", "masked_softmax_fusion", "persist_layer_norm", "bias_dropout_fusion",
    "apply_rope_fusion", "gradient_accumulation_fusion", "cross_entropy_loss_fusion", "cross_entropy_fusion_impl",
    "calculate_per_token_loss",
})
# fused kernels that need CUDA/TE/Apex (turned off on machines without them, like the tiny configs do)
CPU_KERNEL_FLAGS = ("bias_activation_fusion", "masked_softmax_fusion", "persist_layer_norm", "bias_dropout_fusion",
                    "apply_rope_fusion", "gradient_accumulation_fusion", "cross_entropy_loss_fusion")
TOKENIZER_FILES = ("tokenizer.json", "tokenizer.model", "vocab.json", "tokenizer_config.json")


# ---------------------------------------------------------------------------------------------------- inspection
def is_nemo_checkpoint(path: Any) -> bool:
    p = Path(str(path))
    return (p / "context" / "io.json").is_file() and (p / "weights").is_dir()


def is_hf_dir(path: Any) -> bool:
    return (Path(str(path)) / "config.json").is_file()


def read_hf_config(source: Any) -> Dict[str, Any]:
    return json.loads((Path(str(source)) / "config.json").read_text())


def hf_architecture(hf: Dict[str, Any]) -> str:
    archs = hf.get("architectures") or []
    return archs[0] if archs else f"<model_type {hf.get('model_type')!r}>"


def hf_source_problems(source: Any, field: str = "source") -> List[str]:
    """Everything that keeps ``source`` from importing exactly (empty list: importable)."""
    p = Path(str(source))
    if not p.is_dir():
        return [f"{field}={source}: not a directory (a local Hugging Face model directory is needed: config.json, "
                f"weights, tokenizer)"]
    if not (p / "config.json").is_file():
        return [f"{field}={source}: not a Hugging Face model directory (no config.json)"]
    try:
        hf = read_hf_config(p)
    except (OSError, ValueError) as e:
        return [f"{field}={source}: config.json is not readable JSON ({e})"]
    arch = hf_architecture(hf)
    if arch not in FAMILIES:
        return [f"{field}={source}: architecture {arch} is not supported (supported: {', '.join(sorted(FAMILIES))})"]
    problems = []
    if not any(p.glob("*.safetensors")) and not any(p.glob("*.bin")):
        problems.append(f"{field}={source}: no weights (*.safetensors or *.bin) in the directory")
    rope = hf.get("rope_scaling")
    if rope:
        kind = rope.get("rope_type", rope.get("type"))
        if arch == "LlamaForCausalLM" and kind != "llama3":
            problems.append(f"{field}={source}: config.json rope_scaling.rope_type={kind!r}: NeMo's Llama importer "
                            f"converts only the Llama-3.1 scaling (rope_type 'llama3'); it would drop this one")
        elif arch == "Qwen2ForCausalLM":
            problems.append(f"{field}={source}: config.json rope_scaling={rope}: NeMo's Qwen2 importer ignores RoPE "
                            f"scaling (the imported model would not compute the same logits)")
    if arch == "Qwen2ForCausalLM" and hf.get("use_sliding_window"):
        problems.append(f"{field}={source}: config.json use_sliding_window=true: NeMo's Qwen2 importer does not "
                        f"convert the sliding window")
    for flag in ("attention_bias", "mlp_bias"):
        if arch == "LlamaForCausalLM" and hf.get(flag):
            problems.append(f"{field}={source}: config.json {flag}=true: NeMo's Llama importer maps no biases")
    problems += _rope_parameters_problems(p, hf, field)
    problems += _tokenizer_problems(p, hf, arch, field)
    return problems


def _rope_parameters_problems(p: Path, hf: Dict[str, Any], field: str) -> List[str]:
    """transformers >= 5 writes the RoPE as ``rope_parameters: {rope_theta, rope_type, ...}`` (no ``rope_theta`` /
    ``rope_scaling``); NeMo's importers read config.json with this venv's transformers 4.x, which ignores that key
    and would import its own default base without scaling, silently: refused when what they read differs."""
    rope = hf.get("rope_parameters")
    if not isinstance(rope, dict):
        return []
    from transformers import AutoConfig

    seen = AutoConfig.from_pretrained(str(p), local_files_only=True)  # what HFLlamaImporter/HFQwen2Importer read
    theta, scaling = getattr(seen, "rope_theta", None), getattr(seen, "rope_scaling", None)
    lost = []
    if rope.get("rope_theta") is not None and (theta is None or float(rope["rope_theta"]) != float(theta)):
        lost.append(f"rope_theta {rope['rope_theta']} is read as {theta}")
    if rope.get("rope_type", "default") != "default" and not scaling:
        lost.append(f"rope_type {rope['rope_type']!r} is read as no scaling")
    if not lost:
        return []
    return [f"{field}={p}: config.json rope_parameters={rope} (written by transformers >= 5): NeMo's importer reads "
            f"config.json with transformers 4.x, which ignores rope_parameters ({'; '.join(lost)}): write "
            f"rope_theta / rope_scaling into config.json (the transformers 4 keys) or save the model with transformers "
            f"4.x"]


def _tokenizer_problems(p: Path, hf: Dict[str, Any], arch: str, field: str) -> List[str]:
    if not any((p / f).is_file() for f in TOKENIZER_FILES):
        return [f"{field}={p}: no tokenizer ({' / '.join(TOKENIZER_FILES)}): the imported model needs one "
                f"(training data, export)"]
    try:
        from transformers import AutoTokenizer

        tok = AutoTokenizer.from_pretrained(str(p), local_files_only=True)
    except Exception as e:  # noqa: BLE001 - any loader failure is the user's tokenizer problem
        return [f"{field}={p}: the tokenizer does not load with transformers.AutoTokenizer ({type(e).__name__}: {e})"]
    n, vocab = len(tok), int(hf.get("vocab_size") or 0)
    if n > vocab:
        return [f"{field}={p}: tokenizer/vocab mismatch: the tokenizer has {n} tokens but config.json vocab_size="
                f"{vocab}: ids >= {vocab} have no embedding row"]
    if arch == "LlamaForCausalLM" and n != vocab:
        # HFLlamaExporter writes vocab_size = len(tokenizer) and cuts the embedding to it: a round trip would drop rows
        return [f"{field}={p}: tokenizer/vocab mismatch: the tokenizer has {n} tokens but config.json vocab_size="
                f"{vocab}; NeMo's Llama exporter sizes the vocabulary from the tokenizer, so the model could not be "
                f"exported back unchanged"]
    return []


def output_problems(output: Any, field: str = "output") -> List[str]:
    p = Path(str(output))
    if p.exists() and (not p.is_dir() or any(p.iterdir())):
        return [f"{field}={output} already exists and is not empty (choose a new directory)"]
    if not p.parent.exists():
        return [f"{field}={output}: the parent directory {p.parent} does not exist"]
    return []


def resolve_checkpoint(path: Any, field: str = "checkpoint") -> Path:
    """A NeMo checkpoint directory (context/ + weights/); a run's ``checkpoints`` directory (or its output_dir)
    resolves to its newest ``*-last`` checkpoint (else the newest one)."""
    p = Path(str(path))
    if is_nemo_checkpoint(p):
        return p
    base = p / "checkpoints" if (p / "checkpoints").is_dir() else p  # a run's output_dir, or its checkpoints dir
    if base.is_dir():
        # never a run's ``pretrained`` (its init_from import): that is not what the run trained
        found = [c for c in base.iterdir() if is_nemo_checkpoint(c) and c.name != "pretrained"]
        if found:
            last = [c for c in found if c.name.endswith("-last")] or found
            return max(last, key=lambda c: c.stat().st_mtime)
    raise ValueError(f"{field}={path}: not a NeMo checkpoint directory (context/io.json and weights/), nor a run "
                     f"directory holding one")


def model_class_name(checkpoint: Path) -> str:
    """``_target_`` of the checkpoint's model (from context/model.yaml, without building anything)."""
    text = (checkpoint / "context" / "model.yaml").read_text()
    for line in text.splitlines():
        if line.startswith("_target_:"):
            return line.split(":", 1)[1].strip()
    return "?"


# ---------------------------------------------------------------------------------------------------- import/export
def _family_model(arch: str) -> Any:
    import importlib

    module, cls, default_config = FAMILIES[arch]
    mod = importlib.import_module(module)
    # the model only selects the registered "hf" importer; the importer builds the config from config.json
    return getattr(mod, cls)(config=getattr(mod, default_config)())


def _staging_dir(output: Path) -> Path:
    return Path(tempfile.mkdtemp(prefix=f".{output.name}.partial-", dir=str(output.parent)))


class _RenamingWriter:
    """A stdout stand-in that writes ``staged``'s path as ``output``'s (NeMo's own "Checkpoint exported to <path>"
    line names the staging directory it was given, which ``_publish`` renames to the final path)."""

    def __init__(self, stream: Any, staged: Path, output: Path) -> None:
        self._stream, self._old, self._new = stream, str(staged), str(output)

    def write(self, text: str) -> int:
        self._stream.write(text.replace(self._old, self._new))
        return len(text)

    def __getattr__(self, name: str) -> Any:
        return getattr(self._stream, name)


@contextlib.contextmanager
def _final_path_in_output(staged: Path, output: Path):
    """While NeMo converts into ``staged``: its console lines name ``output`` instead (rich's console is created at
    print time on ``sys.stdout``; a wide COLUMNS keeps it from folding the path across lines)."""
    old_stdout, old_columns = sys.stdout, os.environ.get("COLUMNS")
    sys.stdout = _RenamingWriter(old_stdout, staged, output)
    os.environ["COLUMNS"] = "4096"
    try:
        yield
    finally:
        sys.stdout = old_stdout
        if old_columns is None:
            os.environ.pop("COLUMNS", None)
        else:
            os.environ["COLUMNS"] = old_columns


def _publish(staged: Path, output: Path) -> None:
    if output.exists():
        output.rmdir()  # empty (checked before)
    os.replace(staged, output)


def import_hf(source: Any, output: Any) -> Path:
    """Import a local HF model directory into a NeMo 2 checkpoint at ``output`` (see the module docstring)."""
    from nemo.collections import llm


    source, output = Path(str(source)).resolve(), Path(str(output)).resolve()
    raise_problems(hf_source_problems(source) + output_problems(output))
    hf = read_hf_config(source)
    staged = _staging_dir(output)
    try:
        shutil.rmtree(staged)  # import_ckpt refuses an existing path
        with _final_path_in_output(staged, output), watch_directory(f"importing {source} into {output}", staged):
            llm.import_ckpt(model=_family_model(hf_architecture(hf)), source=f"hf://{source}", output_path=staged)
        _complete_llama31_rope(staged, hf)
        _publish(staged, output)
    finally:
        if staged.exists():
            shutil.rmtree(staged, ignore_errors=True)
    return output


def _complete_llama31_rope(checkpoint: Path, hf: Dict[str, Any]) -> None:
    """HFLlamaImporter copies only ``factor`` of a llama3 ``rope_scaling``: write the other three fields into the
    imported context when the HF config's differ from NeMo's Llama31Config defaults."""
    rope = hf.get("rope_scaling") or {}
    if hf_architecture(hf) != "LlamaForCausalLM" or rope.get("rope_type", rope.get("type")) != "llama3":
        return
    from nemo.lightning import io

    from nemo_longctx.integrations.nemo.model import set_with_io

    ctx_dir = checkpoint / "context"
    ctx = io.load_context(ctx_dir)
    config = ctx.model.config
    changed = False
    for field, key in LLAMA31_ROPE.items():
        if key in rope and getattr(config, field) != rope[key]:
            set_with_io(config, field, type(getattr(config, field))(rope[key]))
            changed = True
    if not changed:
        return
    fresh = checkpoint / "context.new"
    ctx.io_dump(fresh, yaml_attrs=["model"])  # NeMo's own context writer (copies the tokenizer artifacts)
    shutil.rmtree(ctx_dir)
    os.replace(fresh, ctx_dir)


def export_problems(checkpoint: Any, output: Any) -> Tuple[Optional[Path], List[str]]:
    problems: List[str] = []
    ckpt = None
    try:
        ckpt = resolve_checkpoint(checkpoint)
    except ValueError as e:
        problems.append(str(e))
    if ckpt is not None:
        target = model_class_name(ckpt)
        supported = {f"{m}.{c}" for m, c, _ in FAMILIES.values()}
        if target not in supported:
            problems.append(f"checkpoint={checkpoint}: model {target} has no Hugging Face exporter here (supported: "
                            f"{', '.join(sorted(supported))}; train with init_from=<imported checkpoint> to get one)")
    problems += output_problems(output)
    return ckpt, problems


def export_hf(checkpoint: Any, output: Any) -> Path:
    """Export a NeMo checkpoint (imported or trained from one) to a HF model directory at ``output``."""
    from nemo.collections import llm


    output = Path(str(output)).resolve()
    ckpt, problems = export_problems(checkpoint, output)
    raise_problems(problems)
    staged = _staging_dir(output)
    try:
        shutil.rmtree(staged)
        with _final_path_in_output(staged, output), watch_directory(f"exporting {ckpt} to {output}", staged):
            llm.export_ckpt(path=ckpt, target="hf", output_path=staged)
        _publish(staged, output)
    finally:
        if staged.exists():
            shutil.rmtree(staged, ignore_errors=True)
    return output


# ---------------------------------------------------------------------------------------------------- training side
def pretrained_model(path: Any) -> Tuple[type, Any, Any]:
    """(model class, model config, tokenizer) recorded in a NeMo checkpoint's context (no weights are read)."""
    from nemo.lightning import io

    model = io.load_context(Path(str(path)) / "context", subpath="model")
    return type(model), model.config, getattr(model, "tokenizer", None)


def unsafe_override_problems(fields: List[str]) -> List[str]:
    return [f"model.{f}: init_from takes the model from the checkpoint; only {', '.join(sorted(SAFE_OVERRIDES))} may "
            f"be overridden (model.{f} would change the architecture or the weights' meaning)"
            for f in fields if f not in SAFE_OVERRIDES]


def apply_model_overrides(config: Any, overrides: Dict[str, Any]) -> Any:
    """``config`` with the safe ``overrides`` applied (a new Llama31Config when Llama-3.1 scaling is added to a
    plain Llama config). Raises ConfigError/ValueError naming every refused field."""
    from nemo.collections.llm.gpt.model.llama import Llama31Config, LlamaConfig

    from nemo_longctx.integrations.nemo.model import set_with_io

    problems = unsafe_override_problems(list(overrides))
    rope31 = [f for f in overrides if f in LLAMA31_ROPE]
    if rope31 and not hasattr(config, "scale_factor"):
        if isinstance(config, LlamaConfig):
            config = _as_llama31(config, Llama31Config)
        else:
            problems.append(f"model.{rope31[0]}: Llama-3.1 RoPE scaling needs a Llama checkpoint "
                            f"({type(config).__name__} has no such field)")
    for field, value in overrides.items():
        if field in SAFE_OVERRIDES and not hasattr(config, field):
            problems.append(f"model.{field}: {type(config).__name__} has no field {field!r}")
    raise_problems(problems)
    for field, value in overrides.items():
        set_with_io(config, field, value)
    return config


def _as_llama31(config: Any, cls: type) -> Any:
    """The same fields in NeMo's Llama31Config (its configure_model applies the Llama-3.1 scaling)."""
    kwargs = {f.name: getattr(config, f.name) for f in dataclass_fields(config) if f.init and hasattr(config, f.name)}
    for field in LLAMA31_ROPE:
        kwargs.pop(field, None)
    return cls(**kwargs)


def cpu_kernel_flags_off(config: Any) -> None:
    """Fused kernels that need CUDA/TE/Apex off (CPU machines): kernel choices, the same values are computed."""
    from nemo_longctx.integrations.nemo.model import set_with_io

    for flag in CPU_KERNEL_FLAGS:
        if getattr(config, flag, False):
            set_with_io(config, flag, False)
