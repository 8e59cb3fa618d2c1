"""The run spec: one typed, frozen form of a whole run, read once from the composed Hydra config.

The path of a config::

    command line -> Hydra composes conf/<app>.yaml -> read_run_spec(cfg)  (the one reader of a DictConfig's groups)
                 -> RunSpec (frozen) -> with_recipe(...) (the recipe's values in the keys left null: a new spec)
                 -> problems(ctx) / context(world_size) -> the front end builds from the spec

``RunSpec`` holds a typed, frozen group per config group, each built from the one ``Option`` table of the app's keys
(``shared/app_keys.py``: ``APP_OPTIONS`` for ``nemo-longctx train``, ``BRIDGE_OPTIONS`` for ``nemo-longctx bridge``,
whose rows that mean the same thing are the same rows):

  trainer     ``TrainerSpec`` (devices, steps, precision, batch sizes, validation) and its ``Layout``
              (``trainer.strategy``: tensor / pipeline parallel sizes, sequence parallelism)
  checkpoint  ``CheckpointSpec`` (interval, directory, resume, save on a signal)
  launcher    ``LauncherSpec`` (backend, threads, timeouts, start method, the Bridge app's local ranks)
  run         ``RunFlags`` (dry run, drills, signals)
  log         ``LogSpec`` (the option model's ``log.*`` keys)
  data        ``DataSpec`` (the data kind and what it reads; checked by the NeMo app's data checks)
  init_from   ``InitFromSpec`` (the pretrained checkpoint and the command line's ``model.<field>`` overrides)
  model       ``ModelSpec`` (the model group's fields as plain values, and its node, opaque, for Hydra's
              ``instantiate``: the only part of the composed config that travels on)

plus the option model (``LongContextOptions``: cp, recompute, offload, tiling, optim, memory/log/run metrics),
``recipe``, ``output_dir``, ``seed`` and Hydra's group choices. Parsing never raises on a value (like the option
model's): ``problems()`` reports every bad value at once, each naming its key; ``context(world_size)`` is the
option checks' ``Context``, built here once. ``with_recipe(values)`` returns a new spec (the composed config is never
changed in place). Nothing below the reader sees a ``DictConfig`` except the model node handed to ``instantiate``.

The other front ends describe a run with their framework's objects; each has an adapter that makes a spec of it, in
its dialect (``dialect``: whose names the messages use, ``DIALECTS``), and takes its ``Context`` from
``spec.context(...)`` too: ``integrations/nemo/recipes.spec_of_recipe`` (a NeMo-Run recipe),
``LongContextStrategy.run_spec`` (the strategy's final layout) and ``integrations/bridge/config.spec_of_container``
(a Megatron-Bridge ``ConfigContainer``). Those fill what the framework object has (``data`` None where the front end
does not read the data) and leave the rest at the defaults.

Standard library + the option model + shared modules; OmegaConf and Hydra's override parser are imported inside
the reader only.
"""

from __future__ import annotations

import copy
import hashlib
import os
from dataclasses import dataclass, field, fields, replace
from typing import Any, ClassVar, Dict, List, Mapping, Optional, Sequence, Tuple

from nemo_longctx.options import ConfigError, Context, LongContextOptions, Option, unknown_keys
from nemo_longctx.shared.signals import DEFAULT_GRACE_S, DEFAULT_SIGNALS
from nemo_longctx.shared.app_keys import (
    APP_GROUPS,
    APP_OPTIONS,
    BRIDGE_GROUPS,
    BRIDGE_KEYS,
    BRIDGE_OPTIONS,
    NEMO_KEYS,
    RECIPE_KEYS,
    RESUME_MODES,
    parse_fault,
)

MISSING = "???"  # OmegaConf's mandatory value, as to_container leaves it
# the app -> (its Option table, the groups whose every key is declared there)
TABLES = {"train": (APP_OPTIONS, APP_GROUPS), "bridge": (BRIDGE_OPTIONS, BRIDGE_GROUPS)}
# the front ends a spec is read for (``RunSpec.dialect``) -> (their names for the values the option checks need and
# for the option keys: ``Context.keys``, whether they save Megatron-FSDP's fsdp_dtensor checkpoints:
# ``Context.fsdp_checkpoints``). train: ``nemo-longctx train``'s Hydra keys (read_run_spec; and a
# ``LongContextStrategy`` with option_keys="hydra"); recipe: a NeMo-Run recipe's arguments and fields
# (integrations/nemo/recipes.spec_of_recipe, the strategy it sets up); bridge: a Megatron-Bridge ConfigContainer's
# fields (integrations/bridge/config.spec_of_container)
DIALECTS: Dict[str, Tuple[Mapping[str, str], bool]] = {
    "train": (NEMO_KEYS, True),
    "recipe": (RECIPE_KEYS, False),
    "bridge": (BRIDGE_KEYS, False),
}


def _row(key: str, table: Sequence[Option]) -> Optional[Option]:
    """``key``'s row in the app's ``table``, else in the other app's (a key one app does not declare keeps the
    shared default), else None."""
    for t in (table, APP_OPTIONS, BRIDGE_OPTIONS):
        for o in t:
            if o.key == key:
                return o
    return None


def _plain(value: Any) -> Any:
    """A YAML list as a tuple (the spec is frozen); everything else as given."""
    return tuple(_plain(v) for v in value) if isinstance(value, list) else value


def select_path(data: Mapping[str, Any], key: str, default: Any = None) -> Any:
    """The value at a dotted ``key`` of plain ``data`` (``default`` when a part is absent)."""
    node: Any = data
    for part in key.split("."):
        if not isinstance(node, Mapping) or part not in node:
            return default
        node = node[part]
    return node


def _node(data: Mapping[str, Any], path: str) -> Mapping[str, Any]:
    """The mapping at a dotted ``path`` of ``data`` (empty when absent or not a mapping)."""
    node = select_path(data, path, {})
    return node if isinstance(node, Mapping) else {}


def _group_values(cls: type, prefix: str, node: Mapping[str, Any], table: Sequence[Option]) -> Dict[str, Any]:
    """The fields of ``cls`` from ``node`` (the group ``prefix``): a key absent takes its row's default
    (``_row``)."""
    out = {}
    for f in fields(cls):
        if f.name not in cls.KEYS:
            continue
        name = cls.KEYS[f.name]
        row = _row(f"{prefix}.{name}", table)
        out[f.name] = _plain(node[name]) if name in node else (row.default if row is not None else f.default)
    return out


def _top(data: Mapping[str, Any], key: str, table: Sequence[Option]) -> Any:
    """A top-level key's value (absent: its row's default)."""
    return data[key] if key in data else _row(key, table).default


def _given(node: Mapping[str, Any]) -> Tuple[str, ...]:
    return tuple(str(k) for k in node)


# ---------------------------------------------------------------------------------------------------- the groups
@dataclass(frozen=True)
class Layout:
    """The parallel layout the strategy runs (``trainer.strategy``; cp.size is the option model's)."""

    tp: Any = 1
    pp: Any = 1
    sequence_parallel: Any = False
    given: Tuple[str, ...] = field(default=(), compare=False, repr=False)

    KEYS: ClassVar[Dict[str, str]] = {"tp": "tensor_model_parallel_size", "pp": "pipeline_model_parallel_size",
                                      "sequence_parallel": "sequence_parallel"}


@dataclass(frozen=True)
class TrainerSpec:
    """The ``trainer`` group (values as given: ``RunSpec.problems`` checks them)."""

    accelerator: Any = "auto"
    devices: Any = 2
    num_nodes: Any = 1
    max_steps: Any = None
    precision: Any = None
    micro_batch_size: Any = 1
    global_batch_size: Any = None
    val_check_interval: Any = None
    limit_val_batches: Any = 2
    layout: Layout = field(default_factory=Layout)
    given: Tuple[str, ...] = field(default=(), compare=False, repr=False)

    KEYS: ClassVar[Dict[str, str]] = {n: n for n in ("accelerator", "devices", "num_nodes", "max_steps", "precision",
                                                      "micro_batch_size", "global_batch_size", "val_check_interval",
                                                      "limit_val_batches")}

    @property
    def world_size(self) -> Optional[int]:
        """``devices x num_nodes`` when both are ints (None: not known from the trainer)."""
        devices, nodes = self.devices, self.num_nodes
        return devices * nodes if isinstance(devices, int) and isinstance(nodes, int) else None


@dataclass(frozen=True)
class CheckpointSpec:
    """The ``checkpoint`` group: when the run saves, where, what it resumes from, whether a signal saves."""

    every_n_steps: Any = None
    every_minutes: Any = None
    dir: Any = None
    resume: Any = "auto"
    keep: Any = 2
    async_save: Any = None
    on_signal: Any = None
    # whether the run saves, where a front end says so outright (not a key: a NeMo-Run recipe's ``log.ckpt``, a
    # Bridge container's ``checkpoint.save`` with its ``save_interval``); None: by the intervals above
    saving: Optional[bool] = None
    given: Tuple[str, ...] = field(default=(), compare=False, repr=False)

    KEYS: ClassVar[Dict[str, str]] = {n: n for n in ("every_n_steps", "every_minutes", "dir", "resume", "keep",
                                                      "async_save", "on_signal")}

    @property
    def saves(self) -> bool:
        """Whether the run saves checkpoints: ``saving`` where the front end set it, else ``every_n_steps > 0`` or
        ``every_minutes > 0``."""
        if self.saving is not None:
            return self.saving
        steps, minutes = self.every_n_steps, self.every_minutes
        return (isinstance(steps, int) and steps > 0) or (isinstance(minutes, (int, float)) and minutes > 0)

    @property
    def save_on_signal(self) -> bool:
        """Whether a signal saves and stops the run: ``on_signal``, by default whenever it saves checkpoints."""
        return bool(self.on_signal) if self.on_signal is not None else self.saves

    def on_signal_problems(self) -> List[str]:
        if self.on_signal is True and not self.saves:
            return ["checkpoint.on_signal=true needs checkpoint.every_n_steps or checkpoint.every_minutes > 0: the "
                    "run saves no checkpoints"]
        return []

    def directory(self, output_dir: Any) -> str:
        """``checkpoint.dir``, else ``<output_dir>/checkpoints``."""
        return str(self.dir or os.path.join(str(output_dir), "checkpoints"))

    def interval(self) -> str:
        """``every N steps`` / ``every N minutes`` / ``none``."""
        if (self.every_n_steps or 0) > 0:
            return f"every {self.every_n_steps} steps"
        return f"every {self.every_minutes:g} minutes" if (self.every_minutes or 0) > 0 else "none"


@dataclass(frozen=True)
class LauncherSpec:
    """The ``launcher`` group: how the local ranks start and how long collectives may wait."""

    backend: Any = "auto"
    threads_per_process: Any = None
    timeout_s: Any = 1800
    shutdown_timeout_s: Any = 30
    start_method: Any = "auto"
    devices: Any = None  # nemo-longctx bridge: local ranks (null: tp x pp x cp)
    given: Tuple[str, ...] = field(default=(), compare=False, repr=False)

    KEYS: ClassVar[Dict[str, str]] = {n: n for n in ("backend", "threads_per_process", "timeout_s",
                                                      "shutdown_timeout_s", "start_method", "devices")}


@dataclass(frozen=True)
class RunFlags:
    """The ``run`` group's switches (``run.print_every`` is the option model's: ``options.metrics``)."""

    dry_run: Any = False
    save_final_params: Any = False
    timeout_s: Any = None
    kernel_self_test: Any = False
    fault: Any = None
    signals: Any = DEFAULT_SIGNALS
    signal_grace_s: Any = DEFAULT_GRACE_S
    given: Tuple[str, ...] = field(default=(), compare=False, repr=False)

    KEYS: ClassVar[Dict[str, str]] = {n: n for n in ("dry_run", "save_final_params", "timeout_s", "kernel_self_test",
                                                      "fault", "signals", "signal_grace_s")}


@dataclass(frozen=True)
class LogSpec:
    """The ``log`` group (declared in the option model's ``MetricsOptions``: one reading of ``log.level``)."""

    level: Any = "info"
    tensorboard: Any = True


@dataclass(frozen=True)
class DataSpec:
    """The ``data`` group: its kind and what each kind reads (``integrations/nemo/data_checks.py`` checks it).
    ``missing``: the keys left mandatory (``???``) in the YAML; a key absent takes the default below."""

    kind: Any = None
    packing: Any = "none"
    paths: Any = None
    tokenizer: Any = None
    text_key: Any = "text"
    cache_dir: Any = None
    split: Any = "100,0,0"
    num_workers: Any = 0
    seed: Any = 1234
    period: Any = None
    skew: Any = None
    num_train_samples: Any = None
    num_val_samples: Any = 64
    doc_length: Any = 512
    packed_train: Any = None
    packed_val: Any = None
    packed_metadata: Any = None
    dataset_root: Any = None
    missing: Tuple[str, ...] = ()
    given: Tuple[str, ...] = field(default=(), compare=False, repr=False)

    @classmethod
    def from_dict(cls, node: Mapping[str, Any]) -> "DataSpec":
        names = {f.name for f in fields(cls)} - {"missing", "given"}
        missing = tuple(k for k, v in node.items() if v == MISSING)
        kw = {k: (None if v == MISSING else _plain(v)) for k, v in node.items() if k in names}
        return cls(**kw, missing=missing, given=_given(node))

    def absent(self, name: str) -> bool:
        """Not set: absent, mandatory and not given, null or empty."""
        return name not in self.given or name in self.missing or getattr(self, name, None) in (None, "")

    @property
    def path_list(self) -> List[str]:
        """``data.paths`` as a list of strings (one path given as a string: a list of it)."""
        return [str(self.paths)] if isinstance(self.paths, str) else [str(p) for p in self.paths]

    @property
    def packed(self) -> bool:
        """Packed documents (per-document attention): ``data.packing=documents`` or ``data.kind=packed_sft``."""
        return str(self.kind) == "packed_sft" or str(self.packing) == "documents"


@dataclass(frozen=True)
class InitFromSpec:
    """``init_from``: a pretrained checkpoint (NeMo or Hugging Face directory), and the command line's
    ``model.<field>=`` overrides applied on its config (``overrides``; what cannot be applied: ``problems``)."""

    path: Optional[str] = None
    overrides: Mapping[str, Any] = field(default_factory=dict)
    problems: Tuple[str, ...] = ()


@dataclass(frozen=True)
class ModelSpec:
    """The model group: its fields as plain values (resolved) and its config node for Hydra's ``instantiate``
    (``node``: opaque here; the model builder hands it to ``instantiate`` unread)."""

    fields: Mapping[str, Any] = field(default_factory=dict)
    node: Any = field(default=None, compare=False, repr=False)

    # the fields an adapter copies from a framework's model config (a recipe's, a Bridge provider's): those set
    ADAPTED_FIELDS: ClassVar[Tuple[str, ...]] = ("seq_length", "num_layers", "hidden_size", "ffn_hidden_size",
                                                 "num_attention_heads", "num_query_groups", "vocab_size")

    @property
    def seq_length(self) -> Any:
        return self.fields.get("seq_length")

    def get(self, name: str, default: Any = None) -> Any:
        return self.fields.get(name, default)


# ---------------------------------------------------------------------------------------------------- the spec
@dataclass(frozen=True)
class RunSpec:
    """A whole run (see the module docstring). ``app``: whose keys these are (train | bridge); ``dialect``: the front
    end whose names the option checks' messages use (``DIALECTS``: train | recipe | bridge); ``data``: None where
    the front end does not read the run's data (a NeMo-Run recipe's data module, a strategy's): the option checks
    then leave what needs packed documents to it."""

    options: LongContextOptions = field(default_factory=LongContextOptions)
    trainer: TrainerSpec = field(default_factory=TrainerSpec)
    checkpoint: CheckpointSpec = field(default_factory=CheckpointSpec)
    launcher: LauncherSpec = field(default_factory=LauncherSpec)
    run: RunFlags = field(default_factory=RunFlags)
    data: Optional[DataSpec] = field(default_factory=DataSpec)
    init_from: InitFromSpec = field(default_factory=InitFromSpec)
    model: ModelSpec = field(default_factory=ModelSpec)
    recipe: Any = "auto"
    output_dir: Any = "outputs/train"
    seed: Any = 1234
    choices: Mapping[str, Any] = field(default_factory=dict)
    app: str = "train"
    dialect: str = "train"
    source: Mapping[str, Any] = field(default_factory=dict, compare=False, repr=False)  # the resolved config

    # the groups a dotted key of the recipe's settings lives in (``setting``)
    SETTING_GROUPS: ClassVar[Dict[str, str]] = {"trainer": "trainer", "checkpoint": "checkpoint"}

    @property
    def log(self) -> LogSpec:
        m = self.options.metrics
        return LogSpec(level=m.level, tensorboard=m.tensorboard)

    @property
    def checkpoint_dir(self) -> str:
        return self.checkpoint.directory(self.output_dir)

    def setting(self, key: str) -> Any:
        """The value of a ``trainer.*``, ``checkpoint.*`` or ``optim.*`` key (the recipe's settings)."""
        group, name = key.split(".", 1)
        if group == "optim":
            optim = self.options.optim
            return getattr(optim, name) if hasattr(optim, name) else getattr(optim.state, name)
        return getattr(getattr(self, self.SETTING_GROUPS[group]), name)

    # ------------------------------------------------------------------------------------------- derived values
    def world_size(self, launch: Any = None) -> int:
        """The launch's world size, else ``trainer.devices x trainer.num_nodes``."""
        if launch is not None:
            return launch.world_size
        return int(self.trainer.devices) * int(self.trainer.num_nodes)

    def parallel_sizes(self) -> Dict[str, int]:
        return {"cp": self.options.cp.size, "tp": self.trainer.layout.tp, "pp": self.trainer.layout.pp}

    def global_batch_size(self, world_size: int) -> int:
        """``trainer.global_batch_size`` (null: micro batch x data-parallel size); ValueError naming the key when it
        is no multiple of micro batch x data-parallel size."""
        p = self.parallel_sizes()
        dp = max(1, world_size // (p["cp"] * p["tp"] * p["pp"]))
        mbs = int(self.trainer.micro_batch_size)
        gbs = self.trainer.global_batch_size
        gbs = mbs * dp if gbs is None else int(gbs)
        if gbs % (mbs * dp) != 0:
            raise ValueError(f"trainer.global_batch_size={gbs} must be a multiple of trainer.micro_batch_size={mbs} x "
                             f"data-parallel size {dp}")
        return gbs

    def seq_length(self) -> Any:
        """The run's sequence length as the command line knows it: ``model.seq_length``; with ``init_from`` the
        checkpoint's unless the command line sets it (None: known once the model config is built)."""
        if self.init_from.path is not None:
            return self.init_from.overrides.get("seq_length")
        return self.model.seq_length

    @property
    def keys(self) -> Mapping[str, str]:
        """The dialect's names (``Context.keys``)."""
        return DIALECTS[self.dialect][0]

    def context(self, world_size: Optional[int] = None, **changes: Any) -> Context:
        """What the option checks need from the run's other keys (their values as typed: checked by ``problems``),
        named in the spec's dialect; ``changes``: Context fields to set besides (``cuda``, ``te``). The one place a
        front end's ``Context`` is built from a run (the app's spec, a recipe's, a strategy's, a container's)."""
        layout = self.trainer.layout
        keys, fsdp_checkpoints = DIALECTS[self.dialect]
        return Context(seq_length=self.seq_length(), tp=layout.tp, pp=layout.pp, world_size=world_size,
                       sequence_parallel=layout.sequence_parallel, precision=str(self.trainer.precision),
                       checkpointing=self.checkpoint.saves, keys=keys, fsdp_checkpoints=fsdp_checkpoints,
                       packed_data=None if self.data is None else self.data.packed, **changes)

    def config_hash(self) -> str:
        """sha256 of the resolved config (keys sorted, the recipe's values filled in): every rank must train exactly
        the same configuration."""
        from omegaconf import OmegaConf

        text = OmegaConf.to_yaml(OmegaConf.create(dict(self.source)), resolve=True, sort_keys=True)
        return hashlib.sha256(text.encode()).hexdigest()

    # ------------------------------------------------------------------------------------------- the recipe
    def recipe_pending(self, settings: Sequence[str]) -> bool:
        """Whether the recipe still has keys to fill: ``recipe=auto``, ``data=auto`` or one of ``settings`` null."""
        return self.recipe == "auto" or str(self.data.kind) == "auto" or any(self.setting(k) is None
                                                                               for k in settings)

    def with_recipe(self, values: Mapping[str, Any]) -> "RunSpec":
        """A new spec with ``values`` ({dotted key: value}: the recipe's settings, ``recipe``, ``data.kind``) set."""
        source = copy.deepcopy(dict(self.source))
        for key, value in values.items():
            node = source
            *parents, name = key.split(".")
            for part in parents:
                node = node.setdefault(part, {})
            node[name] = value
        return replace(spec_from_dict(source, self.model, self.init_from, self.choices, self.app),
                       dialect=self.dialect)

    # ------------------------------------------------------------------------------------------- problems
    def key_problems(self) -> List[str]:
        """The app's own keys, each checked by the option model's one checker; a misspelt key (``+trainer.max_step=5``)
        is refused, not ignored; ``run.fault``'s form; ``checkpoint.on_signal`` without saving; a ``checkpoint.resume``
        path that is no checkpoint."""
        table, groups = TABLES[self.app]
        present = {o.key: v for o in table for v in [select_path(self.source, o.key, KeyError)] if v is not KeyError}
        p = [m for o in table if o.key in present for m in [o.problem(present[o.key])] if m]
        train = self.app == "train"
        # train: the option model's keys in the app's groups (run.print_every) are declared too, and a sub-mapping
        # is a group of its own (trainer.strategy)
        declared = {o.key for o in tuple(table) + (LongContextOptions.options() if train else ())}
        for group in groups:
            node = _node(self.source, group)
            given = {k: 0 for k, v in node.items() if not (train and isinstance(v, Mapping))}
            p += unknown_keys(group, given, [k[len(group) + 1:] for k in declared if k.startswith(group + ".")
                                             and "." not in k[len(group) + 1:]])
        fault = present.get("run.fault")
        if isinstance(fault, str) and fault and (train or not any("run.fault" in m for m in p)):
            try:
                parse_fault(fault)
            except ConfigError as e:
                p += e.problems
        if train:
            p += self.checkpoint.on_signal_problems() + self.resume_problems(present.get("checkpoint.resume"))
        return p

    @staticmethod
    def resume_problems(resume: Any) -> List[str]:
        """``checkpoint.resume=<path>``: an existing directory that is a checkpoint, and an intact one."""
        if not (isinstance(resume, str) and resume and resume not in RESUME_MODES):
            return []
        from nemo_longctx.shared.path_checks import checkpoint_folder_hint
        from nemo_longctx.shared.resume_checks import resume_problems

        p = []
        if not os.path.isdir(resume):
            p.append(f"checkpoint.resume={resume!r} is neither auto/never nor an existing checkpoint directory")
        elif (hint := checkpoint_folder_hint(resume)) is not None:
            p.append(f"checkpoint.resume={resume}: {hint}")
        return p + resume_problems(resume)  # the checkpoint it names is whole (checkpoint_integrity)

    def choice_problems(self) -> List[str]:
        """Contradictions between a config group's choice and a value set beside it (``cp=none cp.size=2`` is
        refused, not run as ring x 2)."""
        size = select_path(self.source, "cp.size", 1)
        if self.choices.get("cp") == "none" and size != 1:
            return [f"cp=none with cp.size={size}: cp=none means no context parallelism (one rank holds the whole "
                    f"sequence); for {size} context-parallel ranks choose the algorithm: cp=ring|ulysses|hybrid "
                    f"cp.size={size}"]
        return []

    def problems(self, ctx: Optional[Context] = None) -> List[str]:
        """Every problem of the spec that needs no model and no framework: the app's keys, the group choices and
        the option model's (against ``ctx``; default: ``context()``), each naming its key."""
        p = self.key_problems()
        ctx = ctx or (self.context() if not p else Context(keys=self.keys))
        return p + self.choice_problems() + self.options.problems(ctx)


# ---------------------------------------------------------------------------------------------------- the reader
def spec_from_dict(data: Mapping[str, Any], model: Optional[ModelSpec] = None,
                   init_from: Optional[InitFromSpec] = None, choices: Optional[Mapping[str, Any]] = None,
                   app: str = "train") -> RunSpec:
    """The spec of a resolved config as plain containers (``OmegaConf.to_container(cfg, resolve=True)``); never
    raises on a value. ``model``/``init_from``: what the reader took from the composed config and the command line
    (default: from ``data`` alone, no overrides)."""
    table, _ = TABLES[app]
    data = {k: v for k, v in data.items() if k != "hydra"}
    trainer = _node(data, "trainer")
    strategy = _node(data, "trainer.strategy")
    layout = Layout(**_group_values(Layout, "trainer.strategy", strategy, table), given=_given(strategy))
    groups: Dict[str, Any] = {}
    for name, cls in (("checkpoint", CheckpointSpec), ("launcher", LauncherSpec), ("run", RunFlags)):
        node = _node(data, name)
        groups[name] = cls(**_group_values(cls, name, node, table), given=_given(node))
    path = _top(data, "init_from", table)
    model = model if model is not None else ModelSpec(fields=dict(_node(data, "model")))
    init_from = init_from if init_from is not None else InitFromSpec(path=None if path in (None, "") else str(path))
    return RunSpec(
        options=LongContextOptions.from_dict(data),
        trainer=TrainerSpec(**_group_values(TrainerSpec, "trainer", trainer, table), layout=layout,
                            given=_given(trainer)),
        data=DataSpec.from_dict(_node(data, "data")), init_from=init_from, model=model,
        recipe=_top(data, "recipe", table), output_dir=_top(data, "output_dir", table),
        seed=_top(data, "seed", table), choices=dict(choices or {}),
        app=app, source=data, **groups)


def read_run_spec(cfg: Any, app: str = "train", choices: Optional[Mapping[str, Any]] = None,
                  task: Optional[Sequence[str]] = None) -> RunSpec:
    """The run spec of a composed config: the ONE place that reads the option groups of a ``DictConfig``
    (``OmegaConf.to_container`` once, then plain values). ``choices``: Hydra's group choices, ``task``: the command
    line's overrides (defaults: the config's ``hydra`` node when composed with it, else this Hydra run's)."""
    from omegaconf import OmegaConf

    run = OmegaConf.masked_copy(cfg, [k for k in cfg if k != "hydra"]) if "hydra" in cfg else cfg
    data = OmegaConf.to_container(run, resolve=True)
    choices = dict(choices if choices is not None else _hydra_value(cfg, "runtime.choices") or {})
    model = ModelSpec(fields=dict(data.get("model") or {}), node=cfg.get("model"))
    path = data.get("init_from")
    init_from = InitFromSpec(path=None if path in (None, "") else str(path))
    if path not in (None, "") and app == "train":  # (the train app's command line may override model fields)
        if task is None:
            task = list(_hydra_value(cfg, "overrides.task") or [])
        overrides, problems = model_overrides(model.fields, task)
        init_from = InitFromSpec(path=str(path), overrides=overrides, problems=tuple(problems))
    return spec_from_dict(data, model, init_from, choices, app)


# ---------------------------------------------------------------------------------------------------- the plan
@dataclass(frozen=True)
class PlanSpec:
    """``nemo-longctx plan``'s run: its ``plan`` group as plain values (typed and checked by ``PLAN_OPTIONS``:
    ``plan_keys.plan_key_problems``), the model group, and the model's name (the group choice, else ``model.name``).
    ``problems``: what reading the config found (an interpolation that does not resolve)."""

    plan: Mapping[str, Any] = field(default_factory=dict)
    model: ModelSpec = field(default_factory=ModelSpec)
    model_name: str = "model"
    problems: Tuple[str, ...] = ()

    def get(self, key: str, default: Any = None) -> Any:
        """The value of ``plan.<key>`` (dotted below ``plan``), ``default`` when absent or null."""
        value = select_path(self.plan, key, None)
        return default if value is None else value

    def with_model(self, fields: Mapping[str, Any]) -> "PlanSpec":
        """This plan for another model (its fields as plain values: a NeMo-Run recipe's model group), named by its
        ``name`` field."""
        return PlanSpec(self.plan, ModelSpec(fields=dict(fields)), str(fields.get("name") or "model"), self.problems)


def read_plan_spec(cfg: Any, model_name: Optional[str] = None) -> PlanSpec:
    """The plan spec of a composed ``conf/plan.yaml``: the one reader of its groups (``model_name``: default the model
    group's choice, else ``model.name``)."""
    from omegaconf import OmegaConf

    problems: List[str] = []
    try:
        plan = OmegaConf.to_container(cfg.plan, resolve=True) if OmegaConf.is_config(cfg.plan) else dict(cfg.plan)
    except Exception as e:  # an interpolation that does not resolve
        plan, problems = {}, [f"plan: {e}"]
    node = cfg.get("model")
    fields = (OmegaConf.to_container(node, resolve=False) if OmegaConf.is_config(node) else dict(node or {}))
    if model_name is None:
        choice = (_hydra_value(cfg, "runtime.choices") or {}).get("model")
        model_name = str(choice) if choice else str(fields.get("name") or "model")
    return PlanSpec(plan=plan, model=ModelSpec(fields=fields, node=node), model_name=model_name,
                    problems=tuple(problems))


def _hydra_value(cfg: Any, key: str) -> Any:
    """``hydra.<key>`` of the config composed with Hydra's node, else of this Hydra run (None when neither)."""
    from omegaconf import OmegaConf

    value = OmegaConf.select(cfg, f"hydra.{key}", default=None)
    if value is None:
        from hydra.core.hydra_config import HydraConfig

        if not HydraConfig.initialized():
            return None
        value = OmegaConf.select(HydraConfig.get(), key, default=None)
    return OmegaConf.to_container(value, resolve=True) if OmegaConf.is_config(value) else value


def model_overrides(model: Mapping[str, Any], task: Sequence[str]) -> Tuple[Dict[str, Any], List[str]]:
    """({field: value} of the command line's ``model.<field>=...``, problems) for an ``init_from`` run. Values come
    from the composed model group (types as Hydra parsed them)."""
    from hydra.core.override_parser.overrides_parser import OverridesParser

    out: Dict[str, Any] = {}
    problems: List[str] = []
    for o in OverridesParser.create().parse_overrides(list(task)):
        key = o.key_or_group
        if key == "model":
            problems.append(f"model={o.value()}: init_from takes the model from the checkpoint; a model group cannot "
                            f"be chosen with it (override single fields: model.seq_length=...)")
        elif key.startswith("model."):
            name = key[len("model."):]
            if o.is_delete() or "." in name:
                problems.append(f"{o.input_line}: with init_from only plain model.<field>=<value> overrides apply")
                continue
            out[name] = copy.deepcopy(model.get(name))
    return out, problems
