"""The training settings of ``nemo-longctx bridge``: the CPU demo's, or those of NVIDIA's Megatron-Bridge recipe for
the model (``recipe``, the same values as ``recipe`` of ``nemo-longctx train``).

- ``recipe=auto`` (the default): without ``init_from`` the CPU demo (``apps.bridge.demo_config``: a tiny Llama and its
  settings). With ``init_from=<HF dir>`` the model is the HF model's and the training settings are those of the
  Megatron-Bridge pretraining recipe (``megatron.bridge.recipes.<base>_pretrain_config``) whose model has the HF
  model's architecture -- layers, hidden size, FFN size, query heads, KV groups (``ARCH_FIELDS``); among several,
  the one of the same HF architecture class (``LlamaForCausalLM``) and provider class, then the one that also shares
  the most of ``TIE_FIELDS`` (vocabulary, RoPE, ...), then the shortest name -- and, of that recipe, the
  long-context variant Bridge ships (``<base>_<N>k_pretrain_config``) with the longest sequence not above the run's
  ``model.seq_length`` (a Bridge override; without one the recipe's sequence length is the run's). The settings are
  read from the recipe's own ``ConfigContainer`` (``apply_settings``): its optimizer, its scheduler (warm-up, decay),
  its mixed precision, ``train.train_iters``, its tokens per step (its global batch x its sequence length, as
  sequences of the run's length: ``global_batch``) and ``checkpoint.save_interval``. Bridge's overrides apply after
  them and win. A HF model no recipe has the architecture of is refused, naming ``recipe=<name>`` and
  ``recipe=demo``.
- ``recipe=demo``: the CPU demo's settings (with ``init_from``: the HF model trained with them; what the tiny test
  models use).
- ``recipe=<Bridge recipe function>``: that recipe's whole ``ConfigContainer`` (with ``init_from`` its model stays
  and must have the HF model's architecture).

Nothing is downloaded to match: most recipes read their model's config.json from the Hugging Face hub
(``AutoBridge.from_hf_pretrained(<id>)``), and Bridge retries a missing one for seconds, so a recipe is built only
when its ids (read from the recipe function's source: ``_hub_ids``) have their config.json in Hugging Face's local
cache (``HF_HOME``), or when it builds its model in code; the others are counted, and named in the refusal. Each
recipe is built once per process; the launching process hands its choice to the local ranks (``CHOSEN_ENV``).
"""

from __future__ import annotations

import ast
import copy
import functools
import inspect
import json
import os
import re
import textwrap
from typing import Any, Dict, FrozenSet, List, Optional, Tuple

AUTO = "auto"
DEMO = "demo"
# the architecture a recipe's model must share with the HF model
ARCH_FIELDS = ("num_layers", "hidden_size", "ffn_hidden_size", "num_attention_heads", "num_query_groups")
# among recipes of one architecture: the one sharing the most of these with the HF model (Llama 3 vs 3.1: RoPE)
TIE_FIELDS = ("vocab_size", "kv_channels", "rotary_base", "rope_scaling", "rope_scaling_factor",
              "position_embedding_type", "share_embeddings_and_output_weights", "normalization", "gated_linear_unit",
              "add_qkv_bias", "qk_layernorm")
_PRETRAIN = re.compile(r"^(?P<base>.+)_pretrain_config$")
_VARIANT = re.compile(r"^(?P<base>.+)_(?P<k>\d+)k$")
# the launching process's choice for the local ranks it starts (they build the same container: no second search)
CHOSEN_ENV = "NEMO_LONGCTX_BRIDGE_AUTO_RECIPE"


def _arch(provider: Any) -> Tuple[Any, ...]:
    values = [getattr(provider, f, None) for f in ARCH_FIELDS]
    if values[4] is None:  # no KV groups: multi-head attention
        values[4] = values[3]
    return tuple(values)


def _recipes_module() -> Any:
    from megatron.bridge import recipes

    return recipes


def _names() -> List[str]:
    recipes = _recipes_module()
    names = getattr(recipes, "__all__", None) or [n for n in dir(recipes) if not n.startswith("_")]
    return sorted(n for n in set(names) if _PRETRAIN.match(n) and callable(getattr(recipes, n, None)))


def base_recipes() -> List[str]:
    """Bridge's pretraining recipe functions that are not a long-context variant of another (``<base>_pretrain_config``,
    ``<base>`` not ending in ``_<N>k``)."""
    return [n for n in _names() if not _VARIANT.match(_PRETRAIN.match(n).group("base"))]


def variants(name: str) -> List[str]:
    """The long-context variants Bridge ships of the base recipe ``name`` (``<base>_<N>k_pretrain_config``)."""
    base = _PRETRAIN.match(name).group("base")
    return [n for n in _names() if (m := _VARIANT.match(_PRETRAIN.match(n).group("base"))) and m.group("base") == base]


def _hub_ids(fn: Any, depth: int = 0) -> Optional[FrozenSet[str]]:
    """The Hugging Face ids whose config.json recipe function ``fn`` reads (``AutoBridge.from_hf_pretrained(<id>)`` in
    its source or in the recipe functions it calls, the id a literal or a module constant); None when an id is not
    a constant (then it is not known without building the recipe)."""
    try:
        tree = ast.parse(textwrap.dedent(inspect.getsource(fn)))
    except (OSError, TypeError, SyntaxError):
        return None
    names, ids = getattr(fn, "__globals__", {}), set()
    for node in ast.walk(tree):
        if not isinstance(node, ast.Call):
            continue
        f = node.func
        if isinstance(f, ast.Attribute) and f.attr == "from_hf_pretrained":
            arg = node.args[0] if node.args else None
            value = (arg.value if isinstance(arg, ast.Constant) else
                     names.get(arg.id) if isinstance(arg, ast.Name) else None)
            if not isinstance(value, str):
                return None
            ids.add(value)
        elif (isinstance(f, ast.Name) and inspect.isfunction(names.get(f.id)) and depth < 4
              and str(getattr(names[f.id], "__module__", "")).startswith(_recipes_module().__name__)):
            called = _hub_ids(names[f.id], depth + 1)
            if called is None:
                return None
            ids |= called
    return frozenset(ids)


def _not_readable_here(name: str) -> Optional[str]:
    """Why recipe ``name``'s model cannot be read without downloading (None: it can): a Hugging Face id whose
    config.json is not in the local Hugging Face cache (``HF_HOME``), or one only known by building the recipe."""
    from huggingface_hub import try_to_load_from_cache

    ids = _hub_ids(getattr(_recipes_module(), name))
    if ids is None:
        return "its model's Hugging Face id is known only by building the recipe"
    for repo in sorted(ids):
        if os.path.isfile(os.path.join(repo, "config.json")):
            continue
        if not isinstance(try_to_load_from_cache(repo, "config.json"), str):
            return f"{repo}'s config.json is not in the Hugging Face cache"
    return None


@functools.lru_cache(maxsize=None)
def _built(name: str) -> Tuple[Any, Optional[str]]:
    """(Bridge's ``ConfigContainer`` of recipe ``name``, None) or (None, why it could not be built)."""
    try:
        return getattr(_recipes_module(), name)(), None
    except Exception as e:  # its model's config.json not readable (offline, gated), an optional package missing, ...
        first = str(e).strip().splitlines()[0] if str(e).strip() else ""
        return None, f"{type(e).__name__}: {first[:200]}"


def recipe_container(name: str) -> Any:
    """A copy of Bridge's ``ConfigContainer`` of recipe ``name`` (built once per process); ``ConfigError`` naming
    ``recipe`` when it cannot be built."""
    from nemo_longctx.options import ConfigError

    if name not in _names():
        raise ConfigError([f"recipe={name!r} is not a Megatron-Bridge pretraining recipe "
                           "(megatron.bridge.recipes.<name>_pretrain_config)"])
    container, why = _built(name)
    if container is None:
        raise ConfigError([f"recipe={name}: Megatron-Bridge's recipe could not be built ({why}); its model's "
                           "config.json comes from the Hugging Face hub or, offline (HF_HUB_OFFLINE=1), from the "
                           "Hugging Face cache (HF_HOME)"])
    return copy.deepcopy(container)


def _described(model: Any) -> Optional[Tuple[str, Tuple[Any, ...], Tuple[Any, ...]]]:
    """(provider class name, architecture, ``TIE_FIELDS`` values) of a model provider; None for one without a
    transformer of that kind (a diffusion or vision recipe)."""
    if model is None or any(getattr(model, f, None) is None for f in ARCH_FIELDS[:4]):
        return None
    return type(model).__name__, _arch(model), tuple(getattr(model, f, None) for f in TIE_FIELDS)


def _hub_family(name: str) -> Optional[str]:
    """The Hugging Face architecture class (``LlamaForCausalLM``) of recipe ``name``'s model, from its config.json in
    the local cache (None: a model the recipe builds in code)."""
    from huggingface_hub import try_to_load_from_cache

    ids = _hub_ids(getattr(_recipes_module(), name)) or frozenset()
    for repo in sorted(ids):
        local = os.path.join(repo, "config.json")
        path = local if os.path.isfile(local) else try_to_load_from_cache(repo, "config.json")
        if isinstance(path, str):
            with open(path) as f:
                architectures = json.load(f).get("architectures") or []
            if architectures:
                return str(architectures[0])
    return None


@functools.lru_cache(maxsize=None)
def _recipe_models() -> Tuple[Dict[str, Tuple[str, str, Tuple[Any, ...], Tuple[Any, ...]]], Dict[str, str]]:
    """({base recipe: (its model's family, its provider's class name, architecture, TIE_FIELDS values)},
    {recipe: why its model cannot be read here}); the family: the HF architecture class, else the provider class."""
    found, unreadable = {}, {}
    for name in base_recipes():
        why = _not_readable_here(name)
        if why is not None:
            unreadable[name] = why
            continue
        container, why = _built(name)
        if container is None:
            unreadable[name] = why
            continue
        described = _described(getattr(container, "model", None))
        if described is not None:
            found[name] = (_hub_family(name) or described[0], *described)
    return found, unreadable


def hf_model(path: Any) -> Tuple[Any, Optional[str]]:
    """(Bridge's model provider, HF architecture class) of the HF directory ``path`` from its config.json alone
    (``AutoBridge.from_hf_config``: no weights read); ``ConfigError`` naming ``init_from`` for a config transformers
    or Bridge cannot take."""
    from megatron.bridge import AutoBridge

    from nemo_longctx.integrations.bridge.hf import hf_config

    config = hf_config(path)
    architectures = getattr(config, "architectures", None) or []
    return (AutoBridge.from_hf_config(config).to_megatron_provider(load_weights=False),
            str(architectures[0]) if architectures else None)


def recipe_of_provider(provider: Any, family: Optional[str] = None) -> Optional[str]:
    """The base Bridge pretraining recipe whose model has ``provider``'s architecture (see the module's docstring), or
    None; ``family``: the HF model's architecture class (``LlamaForCausalLM``), preferred first."""
    cls, arch, tie = _described(provider) or ("", None, ())
    found, _ = _recipe_models()
    matches = [(fam != (family or cls), c != cls, -sum(a == b for a, b in zip(t, tie)), len(name), name)
               for name, (fam, c, a, t) in found.items() if a == arch]
    return min(matches)[-1] if matches else None


def long_context_variant(name: str, seq_length: Optional[int]) -> str:
    """``name`` or its long-context variant with the longest sequence <= ``seq_length`` (None: ``name``)."""
    if seq_length is None:
        return name
    best, best_seq = name, 0
    for variant in variants(name):
        container, _ = _built(variant)
        seq = getattr(getattr(container, "model", None), "seq_length", None)
        if isinstance(seq, int) and best_seq < seq <= seq_length:
            best, best_seq = variant, seq
    return best


def choose(init_from: Any, seq_length: Optional[int]) -> str:
    """The recipe ``recipe=auto`` stands for with ``init_from=<HF dir>`` (its architecture; ``seq_length``: the run's
    ``model.seq_length`` override, None without one); ``ConfigError`` naming ``recipe=`` when no recipe has it."""
    from nemo_longctx.options import ConfigError

    provider, family = hf_model(init_from)
    chosen = os.environ.get(CHOSEN_ENV)
    if chosen:  # a local rank: the launching process chose (checked again: the same architecture)
        if _arch(recipe_container(chosen).model) != _arch(provider):
            raise ConfigError([f"{CHOSEN_ENV}={chosen}: that recipe's model does not have the architecture of "
                               f"init_from={init_from}"])
        return chosen
    base = recipe_of_provider(provider, family)
    if base is None:
        shape = ", ".join(f"{f} {v}" for f, v in zip(ARCH_FIELDS, _arch(provider)))
        _, unreadable = _recipe_models()
        first = sorted(unreadable)[0] if unreadable else None
        note = (f"; {len(unreadable)} of Bridge's {len(base_recipes())} pretraining recipes have a model that cannot "
                "be read here without downloading (a recipe's model is read from Hugging Face's cache, HF_HOME: "
                f"e.g. {first}: {unreadable[first]})" if unreadable else "")
        raise ConfigError([f"recipe=auto: no Megatron-Bridge pretraining recipe has the architecture of "
                           f"init_from={init_from} ({family or type(provider).__name__}: {shape}){note}; name the "
                           "recipe whose optimizer, schedule and precision to use (recipe=<a recipe of "
                           "megatron.bridge.recipes>, e.g. recipe=llama3_8b_pretrain_config, whose model must then "
                           "have this architecture) or recipe=demo (the CPU demo's settings)"])
    return long_context_variant(base, seq_length)


def apply_settings(container: Any, recipe: Any) -> Any:
    """``recipe``'s training settings onto ``container`` (the HF model's; before Bridge's overrides, which win):
    optimizer, scheduler and mixed precision (copies), ``train.train_iters``, ``checkpoint.save_interval``, and its
    sequence length on the model and the dataset. The global batch follows from ``tokens_per_step``."""
    container.optimizer = copy.deepcopy(recipe.optimizer)
    container.scheduler = copy.deepcopy(recipe.scheduler)
    container.mixed_precision = copy.deepcopy(recipe.mixed_precision)
    container.train.train_iters = recipe.train.train_iters
    if getattr(recipe.checkpoint, "save_interval", None):
        container.checkpoint.save_interval = recipe.checkpoint.save_interval
    container.model.seq_length = container.dataset.seq_length = recipe.model.seq_length
    return container


def tokens_per_step(recipe: Any) -> int:
    """The recipe's tokens per optimizer step: its global batch x its sequence length."""
    return int(recipe.train.global_batch_size) * int(recipe.model.seq_length)


def precision_name(mixed_precision: Any) -> str:
    """A ``mixed_precision`` value as a name (``bf16_mixed``; a config object: its precision flags)."""
    if mixed_precision is None:
        return "fp32"
    if isinstance(mixed_precision, str):
        return mixed_precision
    flags = [f for f in ("bf16", "fp16", "fp8", "fp4") if getattr(mixed_precision, f, None)]
    return f"{type(mixed_precision).__name__}({', '.join(flags) or 'fp32'})"
