"""The run's training settings: NVIDIA's NeMo recipe for a real model, the CPU demo's for the tiny models.

The keys of ``DEMO_SETTINGS`` (precision, steps, tokens per step, the optimizer's and the schedule's
hyper-parameters, the checkpoint interval) default to null in the YAML; ``resolve`` returns the run spec with the ones
still null taken from the run's recipe (``recipe=``; ``RunSpec.with_recipe``: a new spec) and every value the user
gave left alone:

- ``recipe=demo`` (what ``auto`` means for the tiny models, ``model=tiny_*``): ``DEMO_SETTINGS``, made to learn the
  synthetic tokens in a few steps on a CPU.
- ``recipe=<name>``: NeMo's ``nemo.collections.llm.recipes.<name>.pretrain_recipe()`` read as built (run.Partial):
  precision from its trainer's plugin, steps from its trainer, tokens per step = its global batch x its sequence
  length (our global batch = those tokens / ``model.seq_length``, a multiple of micro batch x data-parallel size),
  Adam's and the cosine schedule's values from its ``optim``, the checkpoint interval from its ``log.ckpt``
  (``every_n_train_steps`` or ``train_time_interval``) and asynchronous saving from its strategy.
- ``recipe=auto`` for any other model: the NeMo pretraining recipe whose model has the same architecture (layers,
  hidden size, FFN size, query heads, KV groups; the same config class first) and, for that recipe, the long-context
  variant NeMo ships (``<name>_<N>k``) with the longest sequence not above ``model.seq_length``. ``init_from`` runs
  are matched by the checkpoint's architecture.

A real model (any recipe but the demo) also has to name its data: ``data=auto`` (the default) is refused for it.
"""

from __future__ import annotations

import copy
import functools
import importlib
import pkgutil
import re
from datetime import timedelta
from typing import Any, Dict, Mapping, Optional, Tuple

from nemo_longctx.options import ConfigError
from nemo_longctx.shared.app_keys import DEMO_SETTINGS, recipe_global_batch
from nemo_longctx.shared.overrides import is_demo_model
from nemo_longctx.shared.run_spec import RunSpec

DEMO = "demo"
AUTO = "auto"
ARCH_FIELDS = ("num_layers", "hidden_size", "ffn_hidden_size", "num_attention_heads", "num_query_groups")
_VARIANT = re.compile(r"^(?P<base>.+)_(?P<k>\d+)k$")
DATA_CHOICES = ("data=indexed data.paths=[<dataset prefix>] data.tokenizer=<tokenizer dir>",
                "data=documents data.paths=[<JSON-lines files or folders>] data.tokenizer=<tokenizer dir>",
                "data=packed_sft data.packed_train=<.npy> data.packed_val=<.npy> data.tokenizer=<tokenizer>",
                "data=synthetic (random tokens: throughput and memory tests only)")


# ------------------------------------------------------------------------------------------------ NeMo's recipes
def _recipe_module(name: str) -> Any:
    try:
        module = importlib.import_module(f"nemo.collections.llm.recipes.{name}")
    except ImportError:
        module = None
    if module is None or not callable(getattr(module, "pretrain_recipe", None)):
        raise ConfigError([f"recipe={name!r} is not a NeMo pretraining recipe (nemo.collections.llm.recipes.<name> "
                           "with pretrain_recipe); use a NeMo recipe name, auto or demo"])
    return module


def pretrain_recipe(name: str) -> Any:
    """NeMo's ``pretrain_recipe()`` of ``name`` (a run.Partial: nothing is built or started)."""
    return _recipe_module(name).pretrain_recipe(num_nodes=1, num_gpus_per_node=1)


def _arch(get: Any) -> Tuple[Any, ...]:
    values = [get(f) for f in ARCH_FIELDS]
    if values[4] is None:  # no KV groups: multi-head attention
        values[4] = values[3]
    return tuple(values)


@functools.lru_cache(maxsize=None)
def _pretraining_recipes() -> Dict[str, Tuple[str, Tuple[Any, ...]]]:
    """Base pretraining recipe name -> (its model config class name, its architecture), from NeMo's recipes."""
    from nemo.collections.llm import recipes

    out = {}
    for info in pkgutil.iter_modules(recipes.__path__):
        if _VARIANT.match(info.name):
            continue
        try:
            module = importlib.import_module(f"{recipes.__name__}.{info.name}")
            if not (callable(getattr(module, "model", None)) and callable(getattr(module, "pretrain_recipe", None))):
                continue
            config = module.model().config
            out[info.name] = (config.__fn_or_cls__.__name__, _arch(lambda f: getattr(config, f, None)))
        except Exception:  # a recipe this installation cannot even describe (a missing optional package)
            continue
    return out


def recipe_of_architecture(config_class: str, arch: Tuple[Any, ...]) -> Optional[str]:
    """The NeMo pretraining recipe of a model with this architecture (same config class first), or None."""
    matches = [(cls != config_class, len(name), name) for name, (cls, a) in _pretraining_recipes().items()
               if a == arch]
    return min(matches)[2] if matches else None


@functools.lru_cache(maxsize=None)
def long_context_variant(name: str, seq_length: int) -> str:
    """``name`` or NeMo's long-context variant of it (``<name>_<N>k``) with the longest sequence <= ``seq_length``."""
    from nemo.collections.llm import recipes

    from nemo_longctx.integrations.nemo.recipes import recipe_value

    best, best_seq = name, 0
    for info in pkgutil.iter_modules(recipes.__path__):
        m = _VARIANT.match(info.name)
        if m is None or m.group("base") != name:
            continue
        seq = recipe_value(pretrain_recipe(info.name), "data.seq_length")
        if isinstance(seq, int) and best_seq < seq <= seq_length:
            best, best_seq = info.name, seq
    return best


def nemo_recipe_settings(name: str) -> Dict[str, Any]:
    """The ``DEMO_SETTINGS`` keys as NeMo's recipe ``name`` sets them (``trainer.global_batch_size`` as the recipe's
    tokens per step under ``tokens_per_step``); read once per process."""
    return copy.deepcopy(_nemo_recipe_settings(name))


@functools.lru_cache(maxsize=None)
def _nemo_recipe_settings(name: str) -> Dict[str, Any]:
    import fiddle as fdl

    from nemo_longctx.integrations.nemo.recipes import recipe_precision, recipe_value

    r = pretrain_recipe(name)
    gbs, seq = recipe_value(r, "data.global_batch_size"), recipe_value(r, "data.seq_length")
    out: Dict[str, Any] = {"trainer.precision": recipe_precision(r),
                           "trainer.max_steps": recipe_value(r, "trainer.max_steps"),
                           "trainer.global_batch_size": None,  # from tokens_per_step and the run's sequence length
                           "tokens_per_step": gbs * seq if isinstance(gbs, int) and isinstance(seq, int) else None}
    for key, path in (("optim.lr", "optim.config.lr"), ("optim.weight_decay", "optim.config.weight_decay"),
                      ("optim.clip_grad", "optim.config.clip_grad"), ("optim.adam_beta1", "optim.config.adam_beta1"),
                      ("optim.adam_beta2", "optim.config.adam_beta2"), ("optim.adam_eps", "optim.config.adam_eps"),
                      ("optim.warmup_steps", "optim.lr_scheduler.warmup_steps"),
                      ("optim.min_lr", "optim.lr_scheduler.min_lr")):
        out[key] = recipe_value(r, path)
    scheduler = recipe_value(r, "optim.lr_scheduler")
    kind = getattr(getattr(scheduler, "__fn_or_cls__", None), "__name__", None)
    if kind != "CosineAnnealingScheduler":
        raise ConfigError([f"recipe={name}: its learning-rate schedule is {kind}, the train app runs a cosine "
                           "schedule: set optim.lr, optim.min_lr and optim.warmup_steps, or choose another recipe"])
    ckpt = recipe_value(r, "log.ckpt")
    steps = recipe_value(ckpt, "every_n_train_steps") if ckpt is not None else None
    interval = recipe_value(ckpt, "train_time_interval") if ckpt is not None else None
    if isinstance(interval, fdl.Buildable):
        interval = fdl.build(interval)
    out["checkpoint.every_n_steps"] = int(steps) if steps else 0
    out["checkpoint.every_minutes"] = (interval.total_seconds() / 60 if isinstance(interval, timedelta)
                                       else 0) if not steps else 0
    out["checkpoint.async_save"] = bool(recipe_value(r, "trainer.strategy.ckpt_async_save"))
    missing = sorted(k for k, v in out.items()
                     if v is None and k not in ("tokens_per_step", "trainer.global_batch_size"))
    if missing:
        raise ConfigError([f"recipe={name}: the recipe does not set {', '.join(missing)}: set them on the command "
                           "line"])
    return out


# ------------------------------------------------------------------------------------------------ resolution
def model_architecture(spec: RunSpec) -> Tuple[str, Tuple[Any, ...]]:
    """(config class name, architecture) of the run's model: ``init_from``'s checkpoint, else the model group's
    ``_target_`` class with the YAML's and the command line's values over its defaults."""
    source = spec.init_from.path
    if source is not None:
        from nemo_longctx.integrations.nemo import hf

        if hf.is_hf_dir(source):  # its config.json (the checkpoint is imported later)
            h = hf.read_hf_config(source)
            names = {"num_layers": "num_hidden_layers", "ffn_hidden_size": "intermediate_size",
                     "num_query_groups": "num_key_value_heads"}
            return (h.get("architectures") or ["?"])[0], _arch(lambda f: h.get(names.get(f, f)))
        from nemo_longctx.integrations.nemo.pretrained import pretrained_model_config

        config = pretrained_model_config(spec)[0]
        return type(config).__name__, _arch(lambda f: getattr(config, f, None))
    import dataclasses

    from hydra.utils import get_class

    cls = get_class(str(spec.model.get("_target_")))
    defaults = {f.name: f.default for f in dataclasses.fields(cls) if f.default is not dataclasses.MISSING}
    return cls.__name__, _arch(lambda f: spec.model.get(f, defaults.get(f)))


def choose_recipe(spec: RunSpec, model_choice: Optional[str]) -> str:
    """The recipe name ``recipe`` stands for (``auto`` resolved; see the module's docstring)."""
    name = str(spec.recipe or AUTO)
    if name != AUTO:
        return name
    if is_demo_model(model_choice) and spec.init_from.path is None:
        return DEMO
    cls, arch = model_architecture(spec)
    base = recipe_of_architecture(cls, arch)
    if base is None:
        shape = ", ".join(f"{f} {v}" for f, v in zip(ARCH_FIELDS, arch))
        raise ConfigError([f"recipe=auto: no NeMo pretraining recipe has this model's architecture ({cls}: {shape}); "
                           "name the recipe whose precision, optimizer and schedule to use (recipe=<a recipe of "
                           "nemo.collections.llm.recipes>, e.g. recipe=llama31_8b) or recipe=demo (the CPU demo's "
                           "settings)"])
    seq = spec.model.seq_length
    return long_context_variant(base, int(seq)) if isinstance(seq, int) else base


def resolve(spec: RunSpec, model_choice: Optional[str], world_size: Optional[int] = None) -> RunSpec:
    """The spec with its null recipe keys filled (``recipe`` becomes the recipe's name, ``data=auto`` synthetic):
    a new spec (``RunSpec.with_recipe``). ``ConfigError`` for an unknown recipe, or a real model without a data
    choice."""
    if not isinstance(spec.recipe, str) or not spec.recipe.strip():
        raise ConfigError([f"recipe={spec.recipe!r} must be auto, demo or a NeMo recipe name "
                           "(nemo.collections.llm.recipes.<name>)"])
    data_kind = "" if spec.data.kind is None else str(spec.data.kind)
    demo = spec.recipe == DEMO or (spec.recipe == AUTO and is_demo_model(model_choice)
                                   and spec.init_from.path is None)
    if not demo and data_kind == AUTO:  # (before NeMo's recipes are read: a quick answer)
        raise ConfigError(["data: a real model needs a data choice (it would otherwise train on random tokens): "
                           + " | ".join(DATA_CHOICES)])
    name = choose_recipe(spec, model_choice)
    return spec.with_recipe({**recipe_values(spec, name, world_size),
                             **({"data.kind": "synthetic"} if data_kind == AUTO else {}), "recipe": name})


def recipe_values(spec: RunSpec, name: str, world_size: Optional[int] = None) -> Dict[str, Any]:
    """The recipe ``name``'s values of the keys ``spec`` leaves null ({dotted key: value}; the interval's other
    measure off when the user chose one)."""
    settings = dict(DEMO_SETTINGS) if name == DEMO else nemo_recipe_settings(name)
    tokens = settings.pop("tokens_per_step", None)
    filled: Dict[str, Any] = {}
    user_interval = any(spec.setting(k) is not None for k in ("checkpoint.every_n_steps", "checkpoint.every_minutes"))
    for key, value in settings.items():
        if spec.setting(key) is not None:
            continue
        if user_interval and key in ("checkpoint.every_n_steps", "checkpoint.every_minutes"):
            value = 0  # the user chose the interval's measure: the other one is off
        if key == "trainer.global_batch_size" and tokens and isinstance(spec.model.seq_length, int):
            value = _global_batch(spec, tokens, world_size)
        if value is not None:
            filled[key] = value
    return filled


def _global_batch(spec: RunSpec, tokens: int, world_size: Optional[int]) -> int:
    t = spec.trainer
    world = world_size or int(t.devices) * int(t.num_nodes)
    dp = max(1, world // (int(spec.options.cp.size) * int(t.layout.tp) * int(t.layout.pp)))
    return recipe_global_batch(tokens, int(spec.model.seq_length), int(t.micro_batch_size), dp)


def model_choice(choices: Optional[Mapping[str, Any]]) -> Optional[str]:
    """The model group's choice from Hydra's runtime choices (None when unknown)."""
    value = (choices or {}).get("model")
    return None if value is None else str(value)
