"""Hugging Face models on the Bridge front end, through Megatron-Bridge's own ``AutoBridge`` (the NeMo front end's
importer plays no part here).

``init_from=<HF dir>`` (``nemo-longctx bridge``)
    ``init_from_hf(container, path, own_model)``: without a recipe the model is the HF model's --
    ``AutoBridge.from_hf_pretrained(dir).to_megatron_provider(load_weights=False)``, what Bridge's recipes do with a
    hub id -- keeping the container's sequence length, with a ``NullTokenizer`` of the model's vocabulary (real data:
    Bridge's ``tokenizer.tokenizer_type=HuggingFaceTokenizer tokenizer.tokenizer_model=<dir>``); with a recipe the
    recipe's provider stays and must have the HF model's architecture. The weights are loaded by Bridge's own HF
    initialisation, ``checkpoint.pretrained_checkpoint=<dir>`` (``checkpointing._load_hf_pretrained_checkpoint`` ->
    ``AutoBridge.load_hf_weights``, after the model is built, at step 0), unless the run resumes from its own
    checkpoint (``checkpoint.load``: Bridge prefers it). Our long-context options then apply as usual.
    ``init_from_problems(path)`` (no third-party import: before Bridge is imported) and ``model_problems(container,
    path, options)`` (after Bridge's overrides, before any rank starts) name ``init_from``.

``export_hf(checkpoint, output, source=None)`` (``nemo-longctx bridge-export``)
    A checkpoint Bridge saved (``checkpoint.save``) -> a Hugging Face directory: the model is built from the HF
    source's provider (``source``, default the checkpoint's ``model.hf_model_id``: the ``init_from`` directory),
    its weights loaded from the checkpoint by Bridge's ``model_load_save.build_and_load_model``, and written by
    ``AutoBridge.save_hf_pretrained`` (config, tokenizer and generation files copied from the source). Bridge's own
    ``AutoBridge.export_ckpt`` re-creates the provider from ``run_config.yaml``, which names our
    ``transformer_layer_spec`` (``LongContextSpec.to_cfg_dict``: the class with its arguments) and which Bridge's
    loader instantiates once our prefix is on its allow-list (``config.allow_our_targets``; before, it stored the
    spec without arguments and refused it: ``InstantiationException``); that export path has not been run here. The
    spec has no parameters, so the exported tensors are those of the checkpoint either way. Bridge's export
    writes the source's ``config.json``: a checkpoint whose architecture or RoPE fields differ from the source's
    (e.g. ``model.rotary_base`` changed for long context) is refused, naming each field.
"""

from __future__ import annotations

import functools
import os
import re
import shutil
from pathlib import Path
from typing import Any, Dict, List, Optional, Tuple

# the provider fields that fix the tensors' shapes and names (compared between a recipe's or a checkpoint's model and
# the HF model's provider)
ARCHITECTURE_FIELDS = ("num_layers", "hidden_size", "ffn_hidden_size", "num_attention_heads", "num_query_groups",
                       "kv_channels", "vocab_size", "share_embeddings_and_output_weights", "normalization",
                       "gated_linear_unit", "add_bias_linear", "add_qkv_bias", "qk_layernorm")
# what the exported config.json also encodes (it is the source's: these must not have changed in training)
ROPE_FIELDS = ("position_embedding_type", "rotary_base", "rotary_percent", "rope_scaling", "rope_scaling_factor",
               "layernorm_epsilon")
_TOKENIZER_FILES = ("tokenizer.json", "tokenizer.model", "tokenizer_config.json", "vocab.json")
_WEIGHT_FILE = re.compile(r"^(model|pytorch_model)(-\d+-of-\d+)?\.(safetensors|bin)$")


def init_from_problems(path: Any) -> List[str]:
    """The directory itself (stdlib only): exists, has a config.json and Hugging Face weights."""
    if path is None:
        return []
    p = Path(str(path))
    if not p.is_dir():
        return [f"init_from={path}: not a directory (a local Hugging Face model directory is needed: config.json and "
                f"model.safetensors / pytorch_model.bin)"]
    if not (p / "config.json").is_file():
        return [f"init_from={path}: not a Hugging Face model directory (no config.json)"]
    if not any(_WEIGHT_FILE.match(f.name) for f in p.iterdir()):
        return [f"init_from={path}: no Hugging Face weights (model.safetensors, pytorch_model.bin or their shards) "
                f"next to config.json"]
    return []


def hf_config(path: Any, field: str = "init_from") -> Any:
    """transformers' config of the local HF directory ``path`` (its config.json alone), one Megatron-Bridge maps; an
    unsupported or unreadable one raises ConfigError naming ``field``."""
    from megatron.bridge import AutoBridge
    from transformers import AutoConfig

    from nemo_longctx.options import ConfigError

    try:
        config = AutoConfig.from_pretrained(str(path), local_files_only=True)
    except (OSError, ValueError, KeyError) as e:
        raise ConfigError([f"{field}={path}: config.json is not readable by transformers ({e})"]) from None
    if not AutoBridge.supports(config):
        raise ConfigError([f"{field}={path}: architecture {getattr(config, 'architectures', None)} has no "
                           f"Megatron-Bridge mapping (supported: {', '.join(AutoBridge.list_supported_models())})"])
    return config


def hf_bridge(path: Any, field: str = "init_from") -> Any:
    """``AutoBridge.from_hf_pretrained`` on a local directory (lazy: weights are read when converted); an unsupported
    or unreadable model raises ConfigError naming ``field``."""
    from megatron.bridge import AutoBridge

    hf_config(path, field)
    return AutoBridge.from_hf_pretrained(str(path))


def init_from_hf(container: Any, path: Any, own_model: bool) -> Any:
    """``init_from`` on a Bridge ``ConfigContainer`` (before Bridge's overrides and the CPU settings); returns it.
    ``own_model``: the model becomes the HF model's (no recipe); else the recipe's provider stays (checked by
    ``model_problems``)."""
    path = os.path.abspath(str(path))
    if own_model:
        provider = hf_bridge(path).to_megatron_provider(load_weights=False)
        provider.seq_length = container.model.seq_length
        container.model = provider
        if container.tokenizer.tokenizer_type == "NullTokenizer":
            container.tokenizer.vocab_size = provider.vocab_size
    container.checkpoint.pretrained_checkpoint = path
    return container


def _differences(model: Any, reference: Any, fields: Tuple[str, ...]) -> List[Tuple[str, Any, Any]]:
    get = (lambda o, f: o.get(f)) if isinstance(model, dict) else getattr
    out = []
    for f in fields:
        if (isinstance(model, dict) and f not in model) or not hasattr(reference, f):
            continue
        a, b = get(model, f), getattr(reference, f)
        if a != b and str(a) != str(b):
            out.append((f, a, b))
    return out


def model_problems(container: Any, path: Any, options: Any = None) -> List[str]:
    """``init_from`` against the container after Bridge's overrides: the model has the HF model's architecture (a
    recipe's, or an override's ``model.<field>``), ``checkpoint.pretrained_checkpoint`` is still ``init_from``, and
    our options fit the model (``config.model_problems_of`` without the world size, each message naming
    ``init_from``)."""
    from nemo_longctx.options import ConfigError

    path = os.path.abspath(str(path))
    try:
        hf = hf_bridge(path).to_megatron_provider(load_weights=False)
    except ConfigError as e:
        return e.problems
    problems = [f"model.{f}={a} but init_from={path} has {f}={b}: the weights would not fit (init_from gives the "
                f"architecture; only the layout, sequence length and RoPE may be overridden)"
                for f, a, b in _differences(container.model, hf, ARCHITECTURE_FIELDS)]
    pretrained = container.checkpoint.pretrained_checkpoint
    if pretrained is not None and os.path.abspath(str(pretrained)) != path:
        problems.append(f"checkpoint.pretrained_checkpoint={pretrained} and init_from={path} name different "
                        f"weights: give one of them")
    if options is not None:
        from nemo_longctx.integrations.bridge.config import model_problems_of

        problems += [f"init_from={path}: {p}" for p in model_problems_of(container, options, None)]
    return problems


# ----------------------------------------------------------------------------------------------------------- export
def checkpoint_iteration_dir(checkpoint: Any) -> Optional[Path]:
    """An ``iter_*`` directory of a Bridge checkpoint: ``checkpoint`` itself, else the one named by
    ``latest_checkpointed_iteration.txt``, else the highest ``iter_*`` (None: no checkpoint there)."""
    p = Path(str(checkpoint))
    if (p / "run_config.yaml").is_file() or (p / "metadata.json").is_file():
        return p
    tracker = p / "latest_checkpointed_iteration.txt"
    if tracker.is_file():
        text = tracker.read_text().strip()
        if text.isdigit() and (p / f"iter_{int(text):07d}").is_dir():
            return p / f"iter_{int(text):07d}"
    iters = sorted((d for d in p.glob("iter_*") if d.is_dir() and d.name[5:].isdigit()), key=lambda d: int(d.name[5:]))
    return iters[-1] if iters else None


def _run_config(iter_dir: Path) -> Dict[str, Any]:
    import yaml

    with open(iter_dir / "run_config.yaml") as f:
        return yaml.safe_load(f)


def export_problems(checkpoint: Any, output: Any, source: Any = None) -> Tuple[Optional[Path], Optional[str],
                                                                              List[str]]:
    """(iteration dir, HF source, problems) -- stdlib and YAML only, every problem naming its argument."""
    problems: List[str] = []
    iter_dir = checkpoint_iteration_dir(checkpoint) if Path(str(checkpoint)).is_dir() else None
    if not Path(str(checkpoint)).is_dir():
        problems.append(f"checkpoint={checkpoint}: not a directory (a Bridge checkpoint.save directory or one of "
                        f"its iter_* directories)")
    elif iter_dir is None or not (iter_dir / "run_config.yaml").is_file():
        problems.append(f"checkpoint={checkpoint}: no Megatron-Bridge checkpoint (iter_*/run_config.yaml)")
        iter_dir = None
    if source is None and iter_dir is not None:
        source = (_run_config(iter_dir).get("model") or {}).get("hf_model_id")
        if source is None:
            problems.append(f"checkpoint={checkpoint}: its model.hf_model_id is empty (trained without init_from): "
                            f"name the Hugging Face directory with source=<dir>")
    if source is not None:
        problems += [p.replace("init_from=", "source=", 1) for p in init_from_problems(source)]
        if Path(str(source)).is_dir() and not any((Path(str(source)) / f).is_file() for f in _TOKENIZER_FILES):
            problems.append(f"source={source}: no tokenizer ({', '.join(_TOKENIZER_FILES)}): Bridge's export copies "
                            f"the source's tokenizer into the output")
    out = Path(str(output))
    if out.exists() and (not out.is_dir() or any(out.iterdir())):
        problems.append(f"output={output}: exists and is not empty")
    return iter_dir, (str(source) if source is not None else None), problems


def _cpu_provider(provider: Any) -> Any:
    """The provider as the CPU trained it (``cpu_compat.cpu_settings``' model fields: local block spec, fp32, CPU
    initialisation, no fusions)."""
    import torch

    from nemo_longctx.integrations.bridge import cpu_compat

    provider.bf16 = provider.fp16 = False
    provider.params_dtype = torch.float32
    for flag in ("gradient_accumulation_fusion", "bias_activation_fusion", "bias_dropout_fusion",
                 "masked_softmax_fusion", "apply_rope_fusion", "persist_layer_norm", "cross_entropy_loss_fusion"):
        setattr(provider, flag, False)
    provider.attention_backend = None
    provider.transformer_impl = "local"
    provider.transformer_layer_spec = functools.partial(cpu_compat.local_block_spec,
                                                        normalization=getattr(provider, "normalization", "RMSNorm"))
    return provider


def export_hf(checkpoint: Any, output: Any, source: Any = None, show_progress: bool = False) -> Path:
    """Write ``checkpoint`` (a Bridge checkpoint directory or iteration) as a Hugging Face model directory at
    ``output`` (complete or absent: written beside it, then renamed); returns ``output``."""
    from megatron.bridge.training.model_load_save import build_and_load_model, temporary_distributed_context

    from nemo_longctx.options import raise_problems

    iter_dir, source, problems = export_problems(checkpoint, output, source)
    raise_problems(problems)
    bridge = hf_bridge(source, field="source")
    provider = bridge.to_megatron_provider(load_weights=False)
    trained = _run_config(iter_dir).get("model") or {}
    raise_problems([f"checkpoint={checkpoint}: model.{f}={a} but source={source} has {f}={b}: Bridge's export writes "
                    f"the source's config.json, so the exported model would not compute what was trained"
                    for f, a, b in _differences(trained, provider, ARCHITECTURE_FIELDS + ROPE_FIELDS)])
    if trained.get("transformer_impl") == "local":  # trained with Megatron's local spec (the CPU): its names
        _cpu_provider(provider)
    provider.perform_initialization = False  # the checkpoint's weights replace the initialisation
    out = Path(str(output)).absolute()
    partial = out.parent / f".{out.name}.partial"
    shutil.rmtree(partial, ignore_errors=True)
    with temporary_distributed_context(backend="gloo"):
        model = build_and_load_model(str(iter_dir), provider, use_cpu_init=True, skip_temp_dist_context=True)
        bridge.save_hf_pretrained(model, partial, show_progress=show_progress)
    if out.exists():
        out.rmdir()  # empty (export_problems)
    os.replace(partial, out)
    return out
