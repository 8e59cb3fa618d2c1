"""NeMo-Run front end: nemo_longctx inside NeMo's own pretraining recipes.

Two entry points, one mapping (``long_context_recipe``), validated once by the option model:

- CLI: for every pretraining recipe NeMo registers for ``llm.pretrain`` (``nemo llm pretrain --factory llama3_8b``) a
  factory ``<name>_long_context`` is generated here and registered for ``llm.pretrain`` too; this module is loaded
  through the ``nemo_run.cli`` entry-point group (``llm = nemo_longctx.integrations.nemo.recipes``, merged into NeMo's
  own ``nemo llm`` group). ``nemo llm pretrain --factory 'llama3_8b_long_context(cp_size=8)' trainer.devices=8``.
- Python: ``LongContextPlugin`` (a ``run.Plugin``) for ``run.run(recipe, executor=..., plugins=[...])`` and
  ``run.Experiment``; it does the same rewrite in ``setup(task, executor)`` against the executor's world size. On
  the CLI: ``run.plugins=long_context run.plugins.cp_size=2`` (the plugin factory ``long_context``).

The arguments mirror the app's Hydra groups (``LongContextOptions.options()``): a key's dots become underscores
(``cp.size`` -> ``cp_size``, ``recompute.sequence_chunks`` -> ``recompute_sequence_chunks``), the group choices are
``cp`` (none | ring | ulysses | hybrid), ``recompute`` and ``offload``, with the app's defaults (``cp="ring"`` with
the ring group's ``size: 2``; an argument left at None takes the chosen group's YAML value). The model-state
arguments (``optim_*``) default to the recipe's own optimizer settings; the learning-rate schedule, logging and run
keys are the recipe's and are not arguments here.

The rewrite: the recipe's ``MegatronStrategy`` becomes ``LongContextStrategy`` (same arguments, plus the CP size and
algorithm and the options, which it checks again against the final layout when the run starts: a size only a later
``trainer.devices=``/``trainer.num_nodes=`` override contradicts fails there with the same message); the model
config's layer spec and step functions are our extension; the optimizer/DDP/precision fields of the model-state
options; our callbacks (step metrics, memory options, tiling, the check that every attention layer is ours).
"""

from __future__ import annotations

import copy
import dataclasses
import importlib.util
import inspect
import os
from dataclasses import fields, make_dataclass
from typing import Any, Dict, List, Mapping, Optional, Tuple

import fiddle as fdl
import nemo_run as run

from nemo_longctx.options import CP_CHOICES, ConfigError, LongContextOptions, Option, raise_problems
from nemo_longctx.shared.overrides import conf_dir
from nemo_longctx.shared.run_spec import CheckpointSpec, Layout, ModelSpec, RunSpec, TrainerSpec

from nemo_longctx.shared.app_keys import APP_ONLY, GROUP_CHOICES, argument_name

_TYPES = {"int": Optional[int], "number": Optional[float], "bool": Optional[bool], "choice": Optional[str],
          "modules": Optional[List[str]], "tiles": Optional[str], "str": Optional[str], "mapping": Optional[dict]}
_DTYPE_NAMES = {"float32": "fp32", "bfloat16": "bf16", "float16": "fp16"}


def recipe_options() -> Tuple[Option, ...]:
    """The option-model keys the recipe front end takes as arguments."""
    return tuple(o for o in LongContextOptions.options() if not o.key.startswith(APP_ONLY))


def argument_defaults() -> Dict[str, Any]:
    """Argument -> default: the app's group choices, None (= the chosen group's YAML value / the recipe's own) else."""
    out = {argument_name(o.key): None for o in recipe_options()}
    out.update(cp="ring", recompute="none", offload="none")
    return out


def argument_annotations() -> Dict[str, Any]:
    out = {argument_name(o.key): _TYPES[o.kind] for o in recipe_options()}
    out.update(cp=str, recompute=str, offload=str)
    return out


def _conf_group(group: str, choice: str) -> Dict[str, Any]:
    """``conf/<group>/<choice>.yaml`` as a dict (the app's group defaults)."""
    from omegaconf import OmegaConf

    path = os.path.join(conf_dir(), group, f"{choice}.yaml")
    if not os.path.exists(path):
        known = sorted(f[:-5] for f in os.listdir(os.path.join(conf_dir(), group)) if f.endswith(".yaml"))
        raise ConfigError([f"{group}={choice!r} is not a choice (one of {known})"])
    return OmegaConf.to_container(OmegaConf.load(path), resolve=True)


def plain_value(value: Any) -> Any:
    """Tuples as lists (the mapping is serialized by NeMo-Run and read back by the strategy)."""
    return list(value) if isinstance(value, tuple) else value


def _normalize(value: Any) -> Any:
    """CLI strings of the tiles keys: digits as ints."""
    if isinstance(value, str) and value.strip().lstrip("-").isdigit():
        return int(value)
    return value


def recipe_model_state(recipe: Any) -> Dict[str, Any]:
    """The recipe's own model-state settings (the ``optim`` arguments' defaults)."""
    out: Dict[str, Any] = {}
    config = getattr(getattr(recipe, "optim", None), "config", None)
    if config is not None:
        for name in ("optimizer", "use_distributed_optimizer", "optimizer_cpu_offload", "optimizer_offload_fraction",
                     "use_precision_aware_optimizer", "main_grads_dtype", "main_params_dtype", "exp_avg_dtype",
                     "exp_avg_sq_dtype"):
            try:
                value = getattr(config, name)
            except AttributeError:
                continue
            if name.endswith("_dtype"):
                value = _DTYPE_NAMES.get(str(value).replace("torch.", ""), str(value))
            out[name] = value
    strategy = getattr(getattr(recipe, "trainer", None), "strategy", None)
    if strategy is not None:
        out["megatron_fsdp"] = getattr(strategy, "fsdp", None) == "megatron"
    return out


def options_from_arguments(args: Mapping[str, Any], recipe: Any = None
                           ) -> Tuple[LongContextOptions, Dict[str, Any], List[str]]:
    """The option model for recipe arguments, the group mapping it was read from (plain values: what the strategy
    keeps and reads again) and the problems found on the way (unknown arguments, unknown group choices)."""
    defaults = argument_defaults()
    bad = sorted(k for k in args if k not in defaults)
    problems = []
    if bad:
        import difflib

        for k in bad:
            near = difflib.get_close_matches(k, list(defaults), 1)
            problems.append(f"{k}: not a long-context argument" + (f"; did you mean {near[0]}?" if near else "")
                            + f" (known: {', '.join(sorted(defaults))})")
    given = {**defaults, **{k: v for k, v in args.items() if k in defaults}}
    cp = given["cp"]
    if cp not in CP_CHOICES:
        return LongContextOptions(), {}, problems + [f"cp={cp!r} must be one of {', '.join(CP_CHOICES)}"]
    groups: Dict[str, Dict[str, Any]] = {"cp": _conf_group("cp", cp)}
    for group in ("recompute", "offload"):
        try:
            groups[group] = _conf_group(group, str(given[group]))
        except ConfigError as e:
            problems += e.problems
            groups[group] = {}
    groups["tiling"] = _conf_group("tiling", "none")
    groups["optim"] = dict(recipe_model_state(recipe)) if recipe is not None else {}
    data: Dict[str, Any] = dict(groups)
    for o in recipe_options():
        name = argument_name(o.key)
        value = given[name]
        if value is None or o.key in GROUP_CHOICES:
            continue
        group, key = o.key.split(".", 1)
        data.setdefault(group, {})[key] = _normalize(value) if o.kind == "tiles" else plain_value(value)
    return LongContextOptions.from_dict(data), data, problems


# ------------------------------------------------------------------------------------------ reading the recipe
def recipe_value(config: Any, path: str, default: Any = None) -> Any:
    node = config
    for part in path.split("."):
        try:
            node = getattr(node, part)
        except AttributeError:
            return default
        if node is None:
            return default
    return node


def _plugins(recipe: Any) -> List[Any]:
    """The trainer's plugins (a recipe sets one or a list)."""
    plugins = recipe_value(recipe, "trainer.plugins")
    return list(plugins) if isinstance(plugins, (list, tuple)) else [plugins]


def recipe_precision(recipe: Any) -> str:
    for p in _plugins(recipe):
        value = getattr(p, "precision", None)
        if value is not None:
            return str(value)
    return "32"


def spec_of_recipe(recipe: Any, options: Optional[LongContextOptions] = None) -> RunSpec:
    """The run spec of a NeMo-Run recipe, in the recipe's dialect (``RECIPE_KEYS``): the trainer (devices, nodes,
    steps, the precision plugin's precision, the data module's batch sizes, validation) and its strategy's layout,
    whether ``log.ckpt`` saves checkpoints (and every how many steps), the model config's fields; the recipe's data
    module is its own (``data`` None). ``spec.context(world_size)`` is what the option checks need
    (``spec.trainer.world_size``: the trainer's devices x nodes)."""
    ckpt = recipe_value(recipe, "log.ckpt")
    layout = Layout(tp=recipe_value(recipe, "trainer.strategy.tensor_model_parallel_size", 1),
                    pp=recipe_value(recipe, "trainer.strategy.pipeline_model_parallel_size", 1),
                    sequence_parallel=bool(recipe_value(recipe, "trainer.strategy.sequence_parallel", False)))
    trainer = TrainerSpec(accelerator=recipe_value(recipe, "trainer.accelerator", "auto"),
                          devices=recipe_value(recipe, "trainer.devices", 1),
                          num_nodes=recipe_value(recipe, "trainer.num_nodes", 1),
                          max_steps=recipe_value(recipe, "trainer.max_steps"), precision=recipe_precision(recipe),
                          micro_batch_size=recipe_value(recipe, "data.micro_batch_size", 1),
                          global_batch_size=recipe_value(recipe, "data.global_batch_size"),
                          val_check_interval=recipe_value(recipe, "trainer.val_check_interval"),
                          limit_val_batches=recipe_value(recipe, "trainer.limit_val_batches"), layout=layout)
    checkpoint = CheckpointSpec(every_n_steps=recipe_value(ckpt, "every_n_train_steps") if ckpt is not None else None,
                                async_save=recipe_value(recipe, "trainer.strategy.ckpt_async_save"),
                                saving=ckpt is not None)
    model = {name: value for name in ModelSpec.ADAPTED_FIELDS
             for value in [recipe_value(recipe, f"model.config.{name}")] if value is not None}
    return RunSpec(options=options if options is not None else LongContextOptions(), trainer=trainer,
                   checkpoint=checkpoint, data=None, model=ModelSpec(fields=model), dialect="recipe")


def recipe_model_config(recipe: Any) -> Any:
    """The recipe's model config built (for the model checks); CUDA/TE-only kernel flags off where TE is missing."""
    from megatron.core.transformer.transformer_config import TransformerConfig

    from nemo_longctx.integrations.nemo.hf import CPU_KERNEL_FLAGS

    buildable = copy.deepcopy(recipe_value(recipe, "model.config"))
    if buildable is None:
        raise ConfigError(["the recipe has no model.config: nemo_longctx extends a Megatron GPT model config"])
    if importlib.util.find_spec("transformer_engine") is None:
        for flag in CPU_KERNEL_FLAGS:
            if flag in inspect.signature(fdl.get_callable(buildable)).parameters:
                setattr(buildable, flag, False)
    config = fdl.build(buildable)
    if not isinstance(config, TransformerConfig) or not hasattr(config, "transformer_layer_spec"):
        raise ConfigError([f"model.config is a {type(config).__name__}: nemo_longctx extends Megatron GPT model "
                           "configs (llm.GPTConfig and its subclasses)"])
    return config


def recipe_problems(recipe: Any, options: LongContextOptions, world_size: Optional[int] = None) -> List[str]:
    """Every problem of ``options`` against the recipe, named by recipe argument / recipe key (the recipe's dialect,
    ``RECIPE_KEYS``: written so where each message is made)."""
    from nemo.collections.llm.gpt.model.base import GPTConfig

    from nemo_longctx.integrations.megatron.validation import model_problems

    spec = spec_of_recipe(recipe, options)
    ctx = spec.context(world_size if world_size is not None else spec.trainer.world_size)
    p = options.problems(ctx)
    if not p:
        config = recipe_model_config(recipe)
        if not isinstance(config, GPTConfig):
            p.append(f"model.config is a {type(config).__name__}, not an llm.GPTConfig: nemo_longctx's layer "
                     "extension targets GPT models (Llama, Mistral, Qwen, ...)")
        else:
            p += model_problems(config, options, ctx.world_size, ctx.tp, ctx.pp, ctx)
    return p


# ------------------------------------------------------------------------------------------ the rewrite
def as_config(value: Any) -> Any:
    """Dataclass instances (the option model's groups) as ``run.Config`` (fiddle-serializable), recursively."""
    if dataclasses.is_dataclass(value) and not isinstance(value, type):
        return run.Config(type(value), **{f.name: as_config(getattr(value, f.name)) for f in fields(value)
                                          if f.init})
    if isinstance(value, dict):
        return {k: as_config(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return type(value)(as_config(v) for v in value)
    return value


def _callback_configs(recipe: Any, options: LongContextOptions) -> List[Any]:
    from nemo_longctx.integrations.nemo.callbacks import (
        DocumentPlacementPolicy, StepMetrics, VerifyLongContextAttention)
    from nemo_longctx.integrations.nemo.memory_callbacks import ActivationMemoryMetrics, MemoryOptionsCallback
    from nemo_longctx.integrations.nemo.model_state_callback import ModelStateCheck
    from nemo_longctx.integrations.nemo.sequence_tiling import SequenceTiling

    metrics = options.metrics
    output_dir = os.path.join(str(recipe_value(recipe, "log.log_dir") or os.path.join(os.getcwd(), "nemo_experiments")),
                              "nemo_longctx")
    gbs = recipe_value(recipe, "data.global_batch_size", 1)
    tokens = int(gbs) * int(recipe_value(recipe, "model.config.seq_length", 0) or 0)
    mem = run.Config(ActivationMemoryMetrics, count_peak=bool(metrics.track_peak),
                     track_activations=bool(metrics.track))
    out = [mem, run.Config(StepMetrics, output_dir=output_dir, tokens_per_step=tokens, extra=mem),
           run.Config(VerifyLongContextAttention, cp_size=options.cp.size, cp_algorithm=options.cp.algorithm,
                      pp=recipe_value(recipe, "trainer.strategy.pipeline_model_parallel_size", 1))]
    if not options.memory.trivial:
        out.append(run.Config(MemoryOptionsCallback, options=as_config(options.memory)))
    if options.cp.document_aware:
        out.append(run.Config(DocumentPlacementPolicy, split_min_tokens=options.cp.split_min_tokens))
    if options.tiling.active:
        out.append(run.Config(SequenceTiling, options=as_config(options.tiling)))
    out.append(run.Config(ModelStateCheck, options=as_config(options.optim.state), output_dir=output_dir))
    return out


def _rewrite(recipe: Any, options: LongContextOptions, groups: Dict[str, Any]) -> None:
    from nemo.lightning.run.plugins import _merge_callbacks

    from nemo_longctx.integrations.megatron.model_state import (
        MEGATRON_FSDP_DDP_FIELDS,
        checkpoint_settings,
        grad_reduce_in_fp32,
        optimizer_fields,
    )
    from nemo_longctx.integrations.nemo.model import LongContextLayerSpec
    from nemo_longctx.integrations.nemo.steps import long_context_data_step, long_context_forward_step
    from nemo_longctx.integrations.nemo.strategy import LongContextStrategy

    cp, state = options.cp, options.optim.state
    strategy = recipe.trainer.strategy
    fdl.update_callable(strategy, LongContextStrategy)
    strategy.context_parallel_size = cp.size
    strategy.cp_algorithm = cp.algorithm
    strategy.cp_algorithm_kwargs = dict(cp.attention_kwargs)
    strategy.long_context_options = groups
    strategy.option_keys = "recipe"
    ckpt = checkpoint_settings(state)
    if state.megatron_fsdp:  # NeMo's recipes' way: the DDP config asks for Megatron-FSDP, fsdp="megatron"
        from megatron.core.distributed import DistributedDataParallelConfig

        ddp = getattr(strategy, "ddp", None)
        if not isinstance(ddp, fdl.Config):
            ddp = run.Config(DistributedDataParallelConfig)
            strategy.ddp = ddp
        for name, value in MEGATRON_FSDP_DDP_FIELDS.items():
            setattr(ddp, name, value)
        strategy.fsdp = "megatron"
        strategy.save_ckpt_format = ckpt["format"]
    elif isinstance(getattr(strategy, "ddp", None), fdl.Config) and getattr(strategy, "fsdp", None) == "megatron":
        strategy.fsdp = None
        strategy.ddp.use_megatron_fsdp = False
    if ckpt["optim_fully_reshardable"]:
        strategy.ckpt_optim_fully_reshardable = True
    if isinstance(getattr(strategy, "ddp", None), fdl.Config):
        strategy.ddp.use_distributed_optimizer = bool(state.use_distributed_optimizer)

    config = getattr(getattr(recipe, "optim", None), "config", None)
    if config is not None:
        cls = fdl.get_callable(config)
        defaults = {f.name: f.default for f in fields(cls)} if dataclasses.is_dataclass(cls) else {}
        for name, value in optimizer_fields(state).items():
            if not (name.endswith("_dtype") and defaults.get(name) == value):  # unchanged dtypes stay unset
                setattr(config, name, value)
    for p in _plugins(recipe):
        if isinstance(p, fdl.Config) and "grad_reduce_in_fp32" in inspect.signature(fdl.get_callable(p)).parameters:
            p.grad_reduce_in_fp32 = grad_reduce_in_fp32(state)
            if isinstance(getattr(strategy, "ddp", None), fdl.Config):
                strategy.ddp.grad_reduce_in_fp32 = grad_reduce_in_fp32(state)

    model_config = recipe.model.config
    base = model_config.transformer_layer_spec
    if isinstance(base, fdl.Config) and fdl.get_callable(base) is LongContextLayerSpec:
        base = base.base
    model_config.transformer_layer_spec = run.Config(LongContextLayerSpec, base=base, cp_algorithm=cp.algorithm,
                                                     algorithm_kwargs=dict(cp.attention_kwargs))
    model_config.data_step_fn = long_context_data_step
    model_config.forward_step_fn = long_context_forward_step
    model_config.context_parallel_size = cp.size
    _merge_callbacks(recipe, _callback_configs(recipe, options))


def long_context_recipe(recipe: Any, world_size: Optional[int] = None, **args: Any) -> Any:
    """Rewrite a NeMo pretraining recipe (``run.Partial(llm.pretrain, ...)``) in place to train with nemo_longctx
    and return it. ``args``: the long-context arguments (module docstring). Every bad value raises ``ConfigError``
    naming its argument before anything launches."""
    if not isinstance(recipe, fdl.Buildable) or recipe_value(recipe, "trainer.strategy") is None:
        raise ConfigError([f"long_context_recipe needs a NeMo recipe (run.Partial(llm.pretrain, model=..., "
                           f"trainer=...)), got {type(recipe).__name__}"])
    options, groups, problems = options_from_arguments(args, recipe)
    if not problems:
        problems = recipe_problems(recipe, options, world_size)
    raise_problems(problems)
    _rewrite(recipe, options, groups)
    return recipe


# ------------------------------------------------------------------------------------------ the plugin
def _plugin_setup(self: Any, task: Any, executor: Any) -> None:
    if isinstance(task, run.Script):
        raise ConfigError(["LongContextPlugin rewrites a NeMo recipe (run.Partial(llm.pretrain, ...)); a run.Script "
                           "is a command line it cannot change: use nemo-longctx train's overrides instead"])
    world = None
    if executor is not None:
        world = int(executor.nnodes()) * int(executor.nproc_per_node())
    long_context_recipe(task, world_size=world, **self.arguments())


def _plugin_arguments(self: Any) -> Dict[str, Any]:
    defaults = argument_defaults()
    return {k: getattr(self, k) for k in defaults if getattr(self, k) != defaults[k]}


LongContextPlugin = make_dataclass(
    "LongContextPlugin",
    [(name, argument_annotations()[name], dataclasses.field(default=default))
     for name, default in argument_defaults().items()],
    bases=(run.Plugin,), kw_only=True,
    namespace={"setup": _plugin_setup, "arguments": _plugin_arguments, "__module__": __name__,
               "__doc__": "A NeMo-Run plugin that rewrites a NeMo pretraining recipe to train with nemo_longctx "
                          "(arguments: see nemo_longctx.integrations.nemo.recipes; checked against the executor's "
                          "world size in setup)."},
)


@run.cli.factory(target=run.Plugin, name="long_context")
def long_context_plugin() -> run.Config[LongContextPlugin]:
    """``run.plugins=long_context run.plugins.cp_size=2 ...`` on NeMo-Run's CLI."""
    return run.Config(LongContextPlugin)


# ------------------------------------------------------------------------------------------ CLI factories
def _recipe_factories() -> Dict[str, Any]:
    """NeMo's pretraining recipe factories registered for ``llm.pretrain`` (name -> factory)."""
    import catalogue
    from nemo.collections import llm
    from nemo_run.config import get_type_namespace

    namespace = get_type_namespace(llm.pretrain)
    return {key[-1]: fn for key, fn in catalogue._get_all([namespace]).items()
            if not key[-1].endswith("_long_context")}


def _long_context_factory(name: str, factory: Any) -> Any:
    """``<name>_long_context``: NeMo's recipe factory ``name`` with our arguments (keyword-only) added."""
    recipe_params = [p for p in inspect.signature(factory).parameters.values()
                     if p.name != "fn" and p.kind in (p.POSITIONAL_OR_KEYWORD, p.KEYWORD_ONLY)]
    ours = [inspect.Parameter(k, inspect.Parameter.KEYWORD_ONLY, default=v, annotation=argument_annotations()[k])
            for k, v in argument_defaults().items()]
    clash = {p.name for p in recipe_params} & {p.name for p in ours}
    if clash:
        raise RuntimeError(f"NeMo recipe {name} has arguments named like ours: {sorted(clash)}")
    recipe_names = [p.name for p in recipe_params]

    def make(*args: Any, **kwargs: Any) -> run.Partial:
        bound = dict(zip(recipe_names, args))
        bound.update({k: v for k, v in kwargs.items() if k in recipe_names})
        long_context = {k: v for k, v in kwargs.items() if k not in recipe_names}
        return long_context_recipe(factory(**bound), **long_context)

    make.__name__ = make.__qualname__ = f"{name}_long_context"
    make.__doc__ = (f"NeMo's `{name}` pretraining recipe with nemo_longctx context parallelism and memory options "
                    "(arguments: nemo_longctx.integrations.nemo.recipes).")
    make.__signature__ = inspect.Signature([p.replace(kind=p.POSITIONAL_OR_KEYWORD) for p in recipe_params]
                                           + ours, return_annotation=run.Partial)
    make.__annotations__ = {**{p.name: p.annotation for p in recipe_params + ours
                               if p.annotation is not inspect.Parameter.empty}, "return": run.Partial}
    return make


def register_recipe_factories() -> List[str]:
    """Register ``<name>_long_context`` for every NeMo pretraining recipe factory; returns the names."""
    from nemo.collections import llm

    names = []
    for name, factory in sorted(_recipe_factories().items()):
        fn = _long_context_factory(name, factory)
        run.cli.factory(target=llm.pretrain, name=fn.__name__)(fn)
        globals()[fn.__name__] = fn
        names.append(fn.__name__)
    return names


RECIPE_FACTORIES = register_recipe_factories()
