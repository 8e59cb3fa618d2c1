"""The planner-driven NeMo-Run plugin: ``PlannedLongContextPlugin`` (``run.plugins=long_context_planned``) lets
``nemo-longctx plan``'s planner pick CP / TP / recompute / offload / tiling / model state for the recipe's model on the
executor's GPUs, then applies the chosen candidate with ``long_context_recipe`` (``LongContextPlugin``'s checks and
rewrite)::

    run.run(llm.llama3_8b.pretrain_recipe(...), executor=run.LocalExecutor(ntasks_per_node=8, launcher="torchrun"),
            plugins=[PlannedLongContextPlugin(gpu="h100", seq_length=1048576)])
    nemo llm pretrain --factory llama3_8b run.executor=... run.plugins=long_context_planned run.plugins.gpu=h100 \\
        run.plugins.seq_length=1048576

What ``setup(task, executor)`` plans with (``plan_for_recipe``):

- GPUs: ``executor.nnodes() x executor.nproc_per_node()``, ``nproc_per_node()`` per node. GPU type: ``gpu`` (a preset
  of conf/plan/: h100 | h200), else the one the executor names (``executor_gpu_types``); neither, an unknown preset,
  or the two disagreeing: ``ConfigError`` (there is no default GPU).
- model shape: the recipe's model config built (its GPTConfig fields, ``recipe_model_group``); vocabulary: the
  config's ``vocab_size``, else the recipe's tokenizer when its config spells ``vocab_size`` (padded to
  ``make_vocab_size_divisible_by``), else the known shape of the config's class (``model_shapes.KNOWN_SHAPES``: the
  model family's tokenizer; NeMo's ``MockDataModule`` without a tokenizer trains GPT-2's smaller vocabulary, so the
  plan is on the safe side there), else ``ConfigError`` naming ``model.config.vocab_size``. Dense GPT layers only.
- ``seq_length`` (written to ``model.config.seq_length`` and ``data.seq_length`` when given), else the recipe's
  ``model.config.seq_length``; precision: the trainer's precision plugin (16-bit mixed: conf/plan.yaml's
  ``plan.precision``; 32: 4-byte activations and weights); ``host_memory_gb`` per node (None: conf/plan.yaml's).
- search space, cost constants, GPU memory: conf/plan.yaml with the preset, composed and read as ``nemo-longctx plan``
  does (``plan.inputs_from_config``, ``search_space``), with ``plan.checkpoints`` = whether the recipe saves
  checkpoints (``log.ckpt``): a saving recipe drops the option combinations the option model refuses with checkpoint
  saving (Megatron-FSDP) from the search.

Nothing fits: ``ConfigError`` with the planner's ``what_is_missing`` sentence. Otherwise one log line names the
candidate, and the layout the planner assumes is set (TP, sequence parallelism with TP, pipeline size 1,
``trainer.devices``/``num_nodes`` = the executor's) before ``long_context_recipe`` checks and rewrites the recipe
with the candidate's options (``candidate_arguments``).
"""

import dataclasses  # no `from __future__ import annotations`: NeMo-Run's CLI parser needs the fields' real types
import os
import re
from typing import Any, Dict, List, Optional, Tuple

import fiddle as fdl
import nemo_run as run

from nemo_longctx.options import ConfigError, raise_problems
from nemo_longctx.shared.overrides import compose, conf_dir

from nemo_longctx.integrations.nemo.recipes import (long_context_recipe, plain_value, recipe_model_config,
                                                   recipe_precision, recipe_value)
from nemo_longctx.shared.app_keys import argument_name

# the GPTConfig fields model_shapes.shape_from_config reads (besides vocab_size)
SHAPE_FIELDS = ("num_layers", "hidden_size", "ffn_hidden_size", "num_attention_heads", "num_query_groups",
                "kv_channels", "gated_linear_unit", "share_embeddings_and_output_weights")


# ------------------------------------------------------------------------------------------ the GPU
def gpu_presets() -> List[str]:
    """The GPU presets of the plan group (``conf/plan/<name>.yaml``)."""
    return sorted(f[:-5] for f in os.listdir(os.path.join(conf_dir(), "plan")) if f.endswith(".yaml"))


def executor_gpu_types(executor: Any) -> List[str]:
    """The GPU types an executor names, lower-case: ``SkypilotExecutor``/``SkypilotJobsExecutor.gpus`` ("H100",
    "H100:8" or a list of alternatives), ``SlurmExecutor.gres`` ("gpu:h100:8"), ``LeptonExecutor.resource_shape``
    ("gpu.8xh100-80gb"). The other nemo_run 0.11.1 executors (local, Docker, DGX Cloud, Kubeflow, ...) carry a GPU
    count only."""
    gpus = getattr(executor, "gpus", None)
    out = [str(g).split(":")[0] for g in ([gpus] if isinstance(gpus, str) else
                                          gpus if isinstance(gpus, (list, tuple)) else [])]
    for part in str(getattr(executor, "gres", None) or "").split(","):
        kind = part.strip().split(":")
        if len(kind) == 3 and kind[0] == "gpu":
            out.append(kind[1])
    shape = re.fullmatch(r"gpu\.\d+x([\w.-]+)", str(getattr(executor, "resource_shape", None) or ""))
    if shape:
        out.append(shape.group(1))
    return [g.strip().lower() for g in out if g.strip()]


def choose_gpu(gpu: Optional[str], executor: Any) -> str:
    """The GPU preset to plan for: ``gpu``, else the executor's (both given: they must agree)."""
    presets = gpu_presets()
    known = f"known presets: {', '.join(presets)} (conf/plan/<name>.yaml)"
    if gpu is not None and gpu not in presets:
        raise ConfigError([f"gpu={gpu!r} is not a GPU preset; {known}"])
    named = executor_gpu_types(executor)
    found = {next((p for p in presets if re.match(rf"{re.escape(p)}(?!\d)", g)), None) for g in named}
    where = f"{type(executor).__name__} names {', '.join(repr(g) for g in named)}"
    if gpu is not None:
        if named and found != {gpu}:
            raise ConfigError([f"gpu={gpu!r} disagrees with the executor's GPU type ({where})"])
        return gpu
    if not named:
        raise ConfigError([f"gpu= is not set and the executor ({type(executor).__name__}) names no GPU type: give "
                           f"gpu=<preset>; {known}"])
    if None in found or len(found) != 1:
        raise ConfigError([f"gpu= is not set and the executor's GPU type is not one preset ({where}): give "
                           f"gpu=<preset>; {known}"])
    return found.pop()


# ------------------------------------------------------------------------------------------ the model
def _vocab_size(recipe: Any, config: Any) -> Tuple[Optional[int], str]:
    """(vocabulary size or None, where it came from): None leaves it to the known shape of the config's class."""
    if getattr(config, "vocab_size", None) is not None:
        return int(config.vocab_size), "model.config.vocab_size"
    for key in ("model.tokenizer", "data.tokenizer"):  # llm.pretrain hands the data's tokenizer to the model
        if recipe_value(recipe, key) is None:
            continue
        size = recipe_value(recipe, f"{key}.vocab_size")
        if isinstance(size, int) and not isinstance(size, bool):
            multiple = int(getattr(config, "make_vocab_size_divisible_by", 1) or 1)
            return -(-size // multiple) * multiple, f"{key}.vocab_size={size} padded to a multiple of {multiple}"
        return None, f"the known shape of {type(config).__name__} ({key} is not loaded here)"
    return None, f"the known shape of {type(config).__name__} (the recipe names no tokenizer)"


def recipe_model_group(recipe: Any) -> Tuple[Dict[str, Any], str]:
    """(the ``model`` group ``shape_from_config`` reads: the built model config's shape fields, its class as
    ``_target_`` and its name, where the vocabulary size comes from)."""
    from nemo_longctx.planner.model_shapes import shape_from_config

    config = recipe_model_config(recipe)
    for flag in ("num_moe_experts", "multi_latent_attention"):
        if getattr(config, flag, None):
            raise ConfigError([f"model.config.{flag}={getattr(config, flag)!r}: the planner models dense GPT "
                               "layers with standard attention; choose the options yourself (LongContextPlugin)"])
    cls = type(config)
    group: Dict[str, Any] = {f: getattr(config, f) for f in SHAPE_FIELDS}
    group["_target_"] = f"{cls.__module__}.{cls.__qualname__}"
    try:  # a known model's name (llama3_8b: the planner's sentences name it as `nemo-longctx plan model=...` does)
        group["name"] = shape_from_config({"_target_": group["_target_"]}).name
    except ValueError:
        group["name"] = cls.__name__
    vocab, source = _vocab_size(recipe, config)
    if vocab is not None:
        group["vocab_size"] = vocab
    try:
        shape_from_config(group, name=group["name"])
    except ValueError as e:  # no vocabulary size known (or a shape the planner cannot take)
        raise ConfigError([str(e).replace("model.", "model.config.") + (
            ": set model.config.vocab_size (the tokenizer's padded vocabulary size)" if "vocab_size" in str(e)
            else "")]) from None
    return group, source


# ------------------------------------------------------------------------------------------ planning
def _precision_overrides(recipe: Any) -> List[str]:
    precision = recipe_precision(recipe)
    if precision in ("32", "32-true"):
        return ["plan.precision.activation_bytes=4", "plan.precision.param_bytes=4"]
    if "16" in precision:  # bf16-mixed, 16-mixed, ...: conf/plan.yaml's plan.precision
        return []
    raise ConfigError([f"trainer.plugins.precision={precision!r}: the planner plans 16-bit mixed or 32-bit runs"])


def plan_for_recipe(recipe: Any, gpus: int, gpus_per_node: int, gpu: str, seq_length: Any,
                    host_memory_gb: Optional[float] = None,
                    seq_key: str = "seq_length") -> Tuple[Any, Optional[str], str]:
    """(Plan, what is missing when nothing fits, where the vocabulary size came from) for ``recipe``'s model on
    ``gpus`` GPUs of preset ``gpu``: conf/plan.yaml composed with the preset and these values, read by
    ``nemo-longctx plan``'s own ``inputs_from_config``. ``seq_key``: how problems name the sequence length."""
    from nemo_longctx.apps import plan as plan_app
    from nemo_longctx.options import Context
    from nemo_longctx.shared.run_spec import read_plan_spec
    from nemo_longctx.planner.search import plan as make_plan
    from nemo_longctx.planner.search import what_is_missing

    model, vocab_source = recipe_model_group(recipe)
    # a recipe that saves checkpoints (log.ckpt): what the options refuse then is out of the search (plan.checkpoints)
    saving = recipe_value(recipe, "log.ckpt") is not None
    args = [f"plan={gpu}", f"plan.gpus={gpus}", f"plan.gpus_per_node={gpus_per_node}",
            f"plan.seq_length={seq_length}", f"plan.checkpoints={'true' if saving else 'false'}",
            *_precision_overrides(recipe)]
    if host_memory_gb is not None:
        args.append(f"plan.host_memory_gb={host_memory_gb}")
    cfg, problems = compose("plan", args)
    raise_problems(problems)
    spec = read_plan_spec(cfg).with_model(model)  # the recipe's model group
    # the plugin's names of the plan keys it sets (messages are written with them)
    names = Context(keys={"plan.seq_length": seq_key, "plan.host_memory_gb": "host_memory_gb"})
    raise_problems(plan_app.key_problems(spec, names))
    try:
        shape, seq, hw, precision, coef, cost, search = plan_app.inputs_from_config(spec, frontend="nemo_run")
    except ValueError as e:
        raise ConfigError([str(e)]) from None
    p = make_plan(shape, seq, hw, precision, coef, cost, float(spec.get("cost_tolerance")), **search)
    return p, (None if p.chosen else what_is_missing(p, coef, cost)), vocab_source


# ------------------------------------------------------------------------------------------ applying it
def candidate_arguments(candidate: Any) -> Dict[str, Any]:
    """``long_context_recipe`` arguments that run a planner candidate: the option model's overrides of it (what
    ``nemo-longctx plan`` prints), read back by Hydra's parser, and its whole model state (a field the candidate
    keeps at its default must not stay at the recipe's value)."""
    from hydra.core.override_parser.overrides_parser import OverridesParser

    from nemo_longctx.planner.search import candidate_options

    options, parser = candidate_options(candidate), OverridesParser.create()
    out: Dict[str, Any] = {}
    for text in options.to_overrides():
        override = parser.parse_override(text)
        if not override.key_or_group.startswith("optim."):
            out[argument_name(override.key_or_group)] = plain_value(override.value())
    state = options.optim.state
    out.update({f"optim_{f.name}": getattr(state, f.name) for f in dataclasses.fields(state) if f.name != "optimizer"})
    return out


def global_batch_problems(global_batch: Any, gpus: int, candidate: Any) -> List[str]:
    """The recipe's ``data.global_batch_size`` must split evenly over the data-parallel ranks the chosen layout
    leaves (one sequence per micro batch): refused before the recipe is rewritten or anything launches."""
    dp = max(1, gpus // (candidate.tp * candidate.cp_size))
    if not isinstance(global_batch, int) or global_batch % dp == 0:
        return []
    lower, upper = global_batch - global_batch % dp, global_batch - global_batch % dp + dp
    return [f"data.global_batch_size={global_batch} does not split over the {dp} data-parallel ranks of the chosen "
            f"layout ({candidate.label()} on {gpus} GPUs, one sequence per micro batch): use "
            + (f"{lower} or {upper}" if lower else f"{upper}")]


def _set_layout(recipe: Any, tp: int, devices: int, nodes: int) -> List[str]:
    """The parallel layout the planner assumes: TP with sequence parallelism, pipeline size 1, all executor GPUs.
    Returns the recipe's values it changed (``key old -> new``) for the log line."""
    wanted = {"trainer.strategy.tensor_model_parallel_size": tp, "trainer.strategy.sequence_parallel": tp > 1,
              "trainer.strategy.pipeline_model_parallel_size": 1, "trainer.devices": devices,
              "trainer.num_nodes": nodes}
    if recipe_value(recipe, "trainer.strategy.pipeline_model_parallel_size", 1) != 1:
        wanted["trainer.strategy.virtual_pipeline_model_parallel_size"] = None
    changed = []
    for key, value in wanted.items():
        old = recipe_value(recipe, key)
        if old != value:
            changed.append(f"{key} {old} -> {value}")
        parent, name = key.rsplit(".", 1)
        setattr(recipe_value(recipe, parent), name, value)
    return changed


@dataclasses.dataclass(kw_only=True)
class PlannedLongContextPlugin(run.Plugin):
    """A NeMo-Run plugin that plans the long-context options of a NeMo pretraining recipe for the executor's GPUs
    (``nemo-longctx plan``'s planner) and rewrites the recipe with the chosen ones (module docstring).

    gpu: GPU preset (conf/plan/: h100 | h200); None: the executor's GPU type. seq_length: None = the recipe's
    model.config.seq_length. host_memory_gb: host memory per node; None = conf/plan.yaml's."""

    gpu: Optional[str] = None
    seq_length: Optional[int] = None
    host_memory_gb: Optional[float] = None

    def setup(self, task: Any, executor: Any) -> None:
        from nemo.utils import logging

        from nemo_longctx.planner.search import GIB

        if not isinstance(task, fdl.Buildable) or recipe_value(task, "trainer.strategy") is None:
            raise ConfigError(["PlannedLongContextPlugin rewrites a NeMo recipe (run.Partial(llm.pretrain, ...)), got "
                               f"{type(task).__name__}: plan a script's run with nemo-longctx plan instead"])
        if executor is None:
            raise ConfigError(["PlannedLongContextPlugin plans for the executor's GPUs: run the recipe with an "
                               "executor"])
        nodes, per_node = int(executor.nnodes()), int(executor.nproc_per_node())
        gpu = choose_gpu(self.gpu, executor)
        micro = recipe_value(task, "data.micro_batch_size", 1)
        if micro != 1:
            raise ConfigError([f"data.micro_batch_size={micro}: the planner plans one sequence per micro batch; set "
                               "data.micro_batch_size=1"])
        given = self.seq_length is not None
        seq = self.seq_length if given else recipe_value(task, "model.config.seq_length")
        p, missing, vocab = plan_for_recipe(task, nodes * per_node, per_node, gpu, seq, self.host_memory_gb,
                                            "seq_length" if given else "model.config.seq_length")
        if p.chosen is None:
            raise ConfigError([f"no fitting plan: {missing}"])
        c, hw = p.chosen.candidate, p.hardware
        raise_problems(global_batch_problems(recipe_value(task, "data.global_batch_size"), nodes * per_node, c))
        if given:
            task.model.config.seq_length = seq
            data = recipe_value(task, "data")
            if isinstance(data, fdl.Buildable) and "seq_length" in fdl.ordered_arguments(data, include_defaults=True):
                data.seq_length = seq
        changed = _set_layout(task, c.tp, per_node, nodes)
        searched = ("; Megatron-FSDP not searched (the recipe saves checkpoints: log.ckpt)"
                    if recipe_value(task, "log.ckpt") is not None else "")
        logging.info(f"long_context_planned: {c.label()} (predicted {p.chosen.memory.total / GIB:.1f} of "
                     f"{hw.gpu_memory_gb:g} GiB per GPU ({gpu}), relative cost {p.chosen.cost:.3f}) for "
                     f"{p.shape.name} at seq_length={p.seq_length} on {hw.gpus} GPUs ({nodes} x {per_node}); "
                     f"vocabulary {p.shape.vocab_size} from {vocab}; the recipe's layout changed: "
                     f"{'; '.join(changed) or 'nothing'}{searched}")
        long_context_recipe(task, world_size=nodes * per_node, **candidate_arguments(c))


@run.cli.factory(target=run.Plugin, name="long_context_planned")
def long_context_planned_plugin() -> run.Config[PlannedLongContextPlugin]:
    """``run.plugins=long_context_planned run.plugins.gpu=h100 run.plugins.seq_length=1048576`` on NeMo-Run's CLI."""
    return run.Config(PlannedLongContextPlugin)
