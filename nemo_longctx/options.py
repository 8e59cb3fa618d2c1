"""nemo_longctx's option model: every long-context option defined, typed, checked and documented once.

Plain Python (standard library only): the apps, the planner and every front end (NeMo 2 today, Megatron-Bridge next)
read the same objects, so a value means the same thing everywhere and a bad value gets the same message.

    options = LongContextOptions.from_dict({"cp": {...}, "recompute": {...}, "offload": {...}, "tiling": {...},
                                            "optim": {...}, "memory": {...}, "log": {...}, "run": {...}})
    problems = options.problems(Context(seq_length=..., tp=..., ...))   # every problem at once, each naming its key
    options.check(context)                                               # raise ConfigError with all of them

Groups (the config groups of ``conf/``; each key below is declared once, as an ``Option``, in its group's ``OPTIONS``):
  cp        context-parallel attention: ``CPOptions``
  recompute + offload   activation recompute and host offload: ``MemoryOptions`` (one object: their rules cross)
  tiling    sequence-tiled MLP and chunked output layer + loss: ``TilingOptions``
  optim     optimizer and model-state layout (distributed optimizer, Megatron-FSDP, optimizer CPU offload,
            precision-aware optimizer): ``OptimOptions`` (its ``state``: ``ModelStateOptions``)
  metrics   what each step measures and logs (``memory.*``, ``log.tensorboard``, ``run.print_every``):
            ``MetricsOptions``

Parsing never raises on a value: ``from_dict`` keeps what it was given, ``problems()`` reports it. Types are strict:
``cp.size=2.5``, ``cp.size=true`` and ``cp.size=abc`` are errors naming ``cp.size`` (no ``int()`` coercion). The
checks that need the built model (head counts, layers per stage, the model's own flags) live with the model, in
``integrations/megatron`` (``validation.long_context_problems``); the ones here run in the launching process before
any rank starts.
"""

from __future__ import annotations

import difflib
import math
from dataclasses import dataclass, field, fields, replace
from typing import Any, ClassVar, Dict, List, Mapping, Optional, Sequence, Tuple

_MISSING = object()


class ConfigError(ValueError):
    """Every problem of a configuration, one per line, each naming its config key."""

    def __init__(self, problems: Sequence[str]) -> None:
        self.problems = list(problems)
        super().__init__("invalid configuration:\n  - " + "\n  - ".join(self.problems))

    def __reduce__(self):  # pickled with its problems (the default would re-create it from the joined message)
        return (ConfigError, (self.problems,))


def raise_problems(problems: Sequence[str]) -> None:
    """Raise ``ConfigError`` listing ``problems`` (nothing when there are none)."""
    if problems:
        raise ConfigError(problems)


# ---------------------------------------------------------------------------------------------------- one checker
@dataclass(frozen=True)
class Option:
    """One config key: its type, default, allowed values and help line.

    kind: ``int`` | ``number`` (int or float) | ``bool`` | ``choice`` (one of ``choices``) | ``modules`` (a non-empty
    list of ``choices``) | ``tiles`` ("off", "auto" or an int >= 1) | ``str`` | ``mapping``.
    ``low``/``high``: inclusive bounds (numbers); ``above``: exclusive lower bound; ``nullable``: null allowed;
    ``requires``: config overrides under which the key is in effect (e.g. ``recompute=full`` for recompute.num_layers).
    """

    key: str
    kind: str
    default: Any
    help: str
    choices: Tuple[Any, ...] = ()
    low: Optional[float] = None
    high: Optional[float] = None
    above: Optional[float] = None
    nullable: bool = False
    requires: Tuple[str, ...] = ()

    @property
    def name(self) -> str:
        return self.key.rsplit(".", 1)[-1]

    def expectation(self) -> str:
        k = self.kind
        if k == "int":
            what = "an int"
        elif k == "number":
            what = "a number"
        elif k == "bool":
            what = "true or false"
        elif k == "choice":
            what = "one of " + ", ".join(dict.fromkeys(str(c) for c in self.choices))  # 32 and "32": one
        elif k == "modules":
            what = f"a non-empty list of {list(self.choices)}"
        elif k == "tiles":
            what = "'off', 'auto' or a positive int"
        elif k == "str":
            what = "a string"
        else:
            what = "a mapping"
        if self.low is not None and self.high is not None:
            return what + f" in [{self.low:g}, {self.high:g}]" + (" (or null)" if self.nullable else "")
        if k == "int" and self.low == 1 and self.high is None:
            return "a positive int" + (" (or null)" if self.nullable else "")
        bounds = []
        if self.above is not None:
            bounds.append(f"> {self.above:g}")
        if self.low is not None:
            bounds.append(f">= {self.low:g}")
        if self.high is not None:
            bounds.append(f"<= {self.high:g}")
        if bounds:
            what += " " + " and ".join(bounds)
        return what + (" (or null)" if self.nullable else "")

    def problem(self, value: Any, ctx: Optional["Context"] = None) -> Optional[str]:
        """None when ``value`` is valid for this key, else the message naming the key (in ``ctx``'s dialect: the
        front end's spelling of the key, ``Context.key``)."""
        if self._valid(value):
            return None
        key = ctx.key(self.key) if ctx is not None else self.key
        if self.kind == "modules" and isinstance(value, (list, tuple)) and value:
            bad = [m for m in value if m not in self.choices]
            if bad:
                what = "module(s)" if self.name == "modules" else "value(s)"
                return f"{key}: unknown {what} {bad} (choose from {list(self.choices)})"
        if self.kind == "tiles" and _is_int(value):
            what = "chunks" if self.name.endswith("chunks") else "tokens" if self.name.endswith("tokens") else "tiles"
            return f"{key} must be a positive number of {what} (or 'off'/'auto'), got {value}"
        return f"{key}={_show(value)} must be {self.expectation()}"

    def _valid(self, v: Any) -> bool:
        if v is None:
            return self.nullable
        k = self.kind
        if k in ("int", "number"):
            if isinstance(v, bool) or not isinstance(v, (int, float) if k == "number" else int):
                return False
            if isinstance(v, float) and not math.isfinite(v):
                return False
            return ((self.low is None or v >= self.low) and (self.high is None or v <= self.high)
                    and (self.above is None or v > self.above))
        if k == "bool":
            return isinstance(v, bool)
        if k == "choice":
            return not isinstance(v, (bool, list, dict)) and v in self.choices
        if k == "modules":
            return (isinstance(v, (list, tuple)) and len(v) > 0
                    and all(isinstance(m, str) and m in self.choices for m in v))
        if k == "tiles":
            if isinstance(v, str):
                return v in ("off", "auto")
            return isinstance(v, int) and not isinstance(v, bool) and v >= 1
        if k == "str":
            return isinstance(v, str) and v != ""
        return isinstance(v, Mapping)

    def bad_values(self) -> List[Any]:
        """Values this key must refuse (the generated config tests use them)."""
        k = self.kind
        out: List[Any] = [] if self.nullable or k == "mapping" else [None]
        if k in ("int", "number"):
            out += [True, "abc"] + ([2.5] if k == "int" else [float("nan")])
            if self.low is not None:
                out.append(self.low - 1)
            if self.above is not None:
                out.append(self.above)
            if self.high is not None:
                out.append(self.high + 1)
        elif k == "bool":
            out += ["yes", 1]
        elif k == "choice":
            out += ["no_such_value", 3] if isinstance(self.choices[0], str) else ["no_such_value"]
        elif k == "modules":
            out += [self.choices[0], [], ["no_such_module"]]
        elif k == "tiles":
            out += [0, -1, 2.5, True, "many"]
        elif k == "str":
            out += [5, ""]
        else:
            out += ["abc", 5]
        return out


def _show(value: Any) -> str:
    """A value as the user typed it: lists as lists, strings quoted."""
    return repr(list(value)) if isinstance(value, tuple) else repr(value)


def option_problems(options: Sequence[Option], values: Mapping[str, Any], ctx: Optional["Context"] = None
                    ) -> List[str]:
    """The type/range problems of ``values`` (keyed by Option.name) for the options present in ``values``, their keys
    in ``ctx``'s dialect."""
    return [p for o in options if o.name in values for p in [o.problem(values[o.name], ctx)] if p]


def _plain(value: Any) -> Any:
    """Lists/tuples (a YAML list) as tuples; everything else as given."""
    return tuple(value) if isinstance(value, list) else value


def _group(data: Optional[Mapping[str, Any]], name: str) -> Tuple[Dict[str, Any], List[str]]:
    """``data[name]`` as a dict, and a problem when it is not a mapping."""
    node = (data or {}).get(name)
    if node is None:
        return {}, []
    if not isinstance(node, Mapping):
        return {}, [f"{name}={node!r} must be a config group (a mapping of keys)"]
    return dict(node), []


def unknown_keys(group: str, given: Mapping[str, Any], known: Sequence[str], why: str = "",
                 noun: str = "key(s)", ctx: Optional["Context"] = None) -> List[str]:
    bad = sorted(k for k in given if k not in known)
    if not bad:
        return []
    kn = ctx.key if ctx is not None else str  # the keys in the front end's dialect

    keys = ", ".join(kn(f"{group}.{k}") for k in bad)
    near = {k: m[0] for k in bad for m in [difflib.get_close_matches(str(k), [str(x) for x in known], 1)] if m}
    hints = [kn(f"{group}.{m}") if len(bad) == 1 else f"{kn(f'{group}.{k}')} -> {kn(f'{group}.{m}')}"
             for k, m in near.items()]
    hint = f"; did you mean {', '.join(hints)}?" if hints else ""
    return [f"{group}: unknown {noun} {bad}{why} ({keys}: not set here{hint} known: {sorted(known) or 'none'})"]


def layout_problems(seq_length: Any, cp_size: Any, tp: Any = 1, pp: Any = 1, world_size: Any = None,
                    sequence_parallel: bool = False, ctx: Optional["Context"] = None) -> List[str]:
    """The parallel layout's size rules, shared by every front end and the planner (values not known yet: None):
    the sequence splits into 2 * cp.size zigzag chunks, each CP rank's part splits over TP ranks under sequence
    parallelism, and cp.size x TP x PP divides the world size."""
    ctx = ctx or Context()
    p: List[str] = []
    if not all(_is_int(v) and v >= 1 for v in (cp_size, tp, pp)):
        return p
    if _is_int(seq_length) and seq_length >= 1:
        step = 2 * cp_size * (tp if sequence_parallel and tp > 1 else 1)
        if seq_length % step:
            lower, upper = seq_length - seq_length % step, seq_length - seq_length % step + step
            size = ctx.key("cp.size")
            why = (f"2*{size} = {2 * cp_size} (zigzag layout: 2 chunks per CP rank)" if step == 2 * cp_size else
                   f"2*{size} x {ctx.key('tp')} = {step} (zigzag layout: 2 chunks per CP rank, each split over "
                   f"the TP ranks by {ctx.key('sequence_parallel')})")
            p.append(f"{ctx.key('seq_length')}={seq_length} must be divisible by {why}: use "
                     f"{lower or upper}" + (f" or {upper}" if lower else ""))
    if _is_int(world_size) and world_size >= 1 and world_size % (cp_size * tp * pp):
        p.append(f"{ctx.key('cp.size')}={cp_size} x {ctx.key('tp')}={tp} x {ctx.key('pp')}={pp} = "
                 f"{cp_size * tp * pp} does not divide the world size {world_size} ({ctx.key('world_size')})")
    return p


# ---------------------------------------------------------------------------------------------------- context
PRECISIONS = ("32", 32, "bf16-mixed", "16-mixed")  # the run's precision (trainer.precision): fp32 | bf16 | fp16 mixed


@dataclass(frozen=True)
class Context:
    """What the option checks need from the rest of the run, and how the front end spells those keys.

    ``cuda``/``te``: whether the target has CUDA / TransformerEngine (None: unknown, the checks that need them are
    left to the front end, which knows its process). ``keys``: the front end's dialect, its names for these values
    and for the option keys (``cp.size``: the NeMo-Run recipe's ``cp_size``), used in messages where they are
    written (defaults: Megatron's field names, and the option keys as the config spells them)."""

    seq_length: Optional[int] = None
    tp: int = 1
    pp: int = 1
    world_size: Optional[int] = None  # None: not known here (the layout's world-size rule is left to the build)
    sequence_parallel: bool = False
    precision: str = "bf16-mixed"
    checkpointing: bool = False
    cuda: Optional[bool] = None
    te: Optional[bool] = None
    keys: Mapping[str, str] = field(default_factory=dict)
    # whether the run's data are packed documents (cu_seqlens: per-document attention); None: not known here
    packed_data: Optional[bool] = None
    # whether the front end places packed documents per document (cp.split_min_tokens): the data steps of both apps
    # for packed documents do (the NeMo 2 app's, and the Bridge app's forward step for data.packing=documents)
    document_placement: bool = True
    # the front end saves Megatron-FSDP's fsdp_dtensor checkpoints (nemo-longctx train: its optimizer-state hooks,
    # integrations/megatron/fsdp_checkpoint.py); the others refuse Megatron-FSDP with checkpointing
    fsdp_checkpoints: bool = False

    def key(self, name: str) -> str:
        """``name`` (a value the checks need, or an option key) as the front end spells it."""
        return self.keys.get(name, _NEUTRAL_KEYS.get(name, name))


_NEUTRAL_KEYS = {"seq_length": "seq_length", "tp": "tensor_model_parallel_size",
                 "pp": "pipeline_model_parallel_size", "sequence_parallel": "sequence_parallel",
                 "precision": "precision", "checkpointing": "checkpoint interval",
                 "world_size": "world size", "num_layers": "num_layers", "packed_data": "the data"}


# ---------------------------------------------------------------------------------------------------- cp
CP_ALGORITHMS = ("ring", "ulysses", "hybrid")
CP_CHOICES = ("none",) + CP_ALGORITHMS  # the cp group's choices (cp=none: ring attention on one rank)
# per algorithm: the cp keys it uses besides size/algorithm, and the extra options cp.kwargs may pass to it
CP_ALGORITHM_KEYS = {"ring": (), "ulysses": ("head_chunks",), "hybrid": ("ulysses_size", "head_chunks")}
CP_ALGORITHM_KWARGS = {"ring": ("kernel",), "ulysses": ("kernel", "regather_in_backward"),
                       "hybrid": ("kernel", "regather_in_backward")}


@dataclass(frozen=True)
class CPOptions:
    """The ``cp`` group. ``cp=none`` is ring attention over one rank (no context parallelism: the ring's kernel runs
    the whole sequence)."""

    size: Any = 1
    algorithm: Any = "ring"
    ulysses_size: Any = None
    head_chunks: Any = 1
    kwargs: Any = field(default_factory=dict)
    split_min_tokens: Any = "off"
    given: Tuple[str, ...] = field(default=(), compare=False, repr=False)

    OPTIONS: ClassVar[Tuple[Option, ...]] = (
        Option("cp.size", "int", 1, "context-parallel ranks the sequence is split over (zigzag: 2 chunks each)",
               low=1),
        Option("cp.algorithm", "choice", "ring", "ring: zigzag P2P ring | ulysses: all-to-all over heads | hybrid: "
               "Ulysses inside groups of cp.ulysses_size ranks x ring across them", choices=CP_ALGORITHMS),
        Option("cp.ulysses_size", "int", None, "cp=hybrid: Ulysses degree (a divisor of cp.size)", low=1,
               requires=("cp=hybrid",)),
        Option("cp.head_chunks", "int", 1, "cp=ulysses|hybrid: all-to-all the heads in this many chunks "
               "(less memory per exchange)", low=1, requires=("cp=ulysses",)),
        Option("cp.kwargs", "mapping", {}, "extra options of the attention function: kernel (ring, ulysses, "
               "hybrid), regather_in_backward (ulysses, hybrid)"),
        Option("cp.split_min_tokens", "tiles", "off", "packed documents: those shorter than this stay whole on one CP "
               "rank (no communication), longer ones are split over the CP group | auto: the cost model picks it per "
               "micro-batch | off: every document split"),
    )

    @classmethod
    def from_dict(cls, d: Optional[Mapping[str, Any]]) -> "CPOptions":
        d = dict(d or {})
        kw = {o.name: _plain(d[o.name]) for o in cls.OPTIONS if o.name in d}
        if isinstance(kw.get("kwargs"), Mapping):
            kw["kwargs"] = dict(kw["kwargs"])
        if "split_min_tokens" in kw:
            kw["split_min_tokens"] = normalize_tiles(kw["split_min_tokens"])
        return cls(**kw, given=tuple(d))

    def problems(self, ctx: Optional["Context"] = None) -> List[str]:
        """Every problem of the group (empty = valid), each naming its key in ``ctx``'s dialect."""
        ctx = ctx or Context()
        kn = ctx.key
        values = {o.name: getattr(self, o.name) for o in self.OPTIONS}
        p = unknown_keys("cp", {k: 0 for k in self.given}, [o.name for o in self.OPTIONS], ctx=ctx)
        p += option_problems(self.OPTIONS[:2], values, ctx)
        if self.algorithm not in CP_ALGORITHMS:
            return p
        algo, uses = self.algorithm, CP_ALGORITHM_KEYS[self.algorithm]
        for k in ("ulysses_size", "head_chunks"):
            if k not in uses and k in self.given and values[k] not in (None, 1):
                owners = "|".join(a for a, ks in CP_ALGORITHM_KEYS.items() if k in ks)
                p.append(f"{kn('cp.algorithm')}={algo!r} got unknown options [{k!r}] ({kn('cp.' + k)} is an option "
                         f"of {kn('cp.algorithm')}={owners})")
        if "head_chunks" in uses:
            p += option_problems(self.OPTIONS[3:4], values, ctx)
        if algo == "hybrid" and not (_is_int(self.ulysses_size) and self.ulysses_size >= 1 and _is_int(self.size)
                                     and self.size >= 1 and self.size % self.ulysses_size == 0):
            u, size = kn("cp.ulysses_size"), kn("cp.size")
            p.append(f"{u}={self.ulysses_size!r} must be a positive divisor of {size}={self.size!r} (cp=hybrid: "
                     f"Ulysses over {u} consecutive CP ranks, ring over {size} / {u} of those groups)")
        p += option_problems(self.OPTIONS[4:], values, ctx)
        if self.split_min_tokens != "off" and _is_int(self.size) and self.size == 1 and self.OPTIONS[5].problem(
                self.split_min_tokens, ctx) is None:
            p.append(f"{kn('cp.split_min_tokens')}={self.split_min_tokens!r} needs context parallelism "
                     f"({kn('cp.size')} > 1): with one CP rank every document is already whole; drop it or set "
                     f"{kn('cp.size')}")
        if isinstance(self.kwargs, Mapping):
            kw = kn("cp.kwargs")
            for k in ("ulysses_size", "head_chunks"):
                if k in self.kwargs:
                    p.append(f"{kw}.{k}: set {kn('cp.' + k)} instead (one spelling per option)")
            allowed = CP_ALGORITHM_KWARGS[algo]
            bad = sorted(k for k in self.kwargs if k not in allowed and k not in ("ulysses_size", "head_chunks"))
            if bad:
                p.append(f"{kw}: {kn('cp.algorithm')}={algo!r} got unknown options {bad} (known: {list(allowed)})")
            kernel = self.kwargs.get("kernel")
            if kernel is not None and (not isinstance(kernel, str) or not kernel):
                p.append(f"{kw}.kernel={kernel!r} must be a kernel name (a string) or null")
            regather = self.kwargs.get("regather_in_backward", False)
            if not isinstance(regather, bool):
                p.append(f"{kw}.regather_in_backward={regather!r} must be true or false")
        return p

    @property
    def document_aware(self) -> bool:
        """Whether packed documents are placed per document (``cp.split_min_tokens`` other than off) under CP."""
        return self.split_min_tokens != "off" and _is_int(self.size) and self.size > 1

    @property
    def attention_kwargs(self) -> Dict[str, Any]:
        """What the algorithm's attention function receives (``cp_algorithm_kwargs`` of the layer spec)."""
        out: Dict[str, Any] = {}
        if self.algorithm == "hybrid":
            out["ulysses_size"] = self.ulysses_size
        if self.algorithm in ("ulysses", "hybrid"):
            out["head_chunks"] = self.head_chunks
        out.update(self.kwargs if isinstance(self.kwargs, Mapping) else {})
        return out

    def describe(self) -> str:
        if self.size == 1:
            return f"none ({self.algorithm} attention on 1 rank: no context parallelism)"
        if self.document_aware:
            kept = ("short documents kept whole (threshold per micro-batch: auto)" if self.split_min_tokens == "auto"
                    else f"documents shorter than {self.split_min_tokens} tokens kept whole")
            return f"{self.algorithm} x {self.size}, {kept}"
        return f"{self.algorithm} x {self.size}"


def _is_int(v: Any) -> bool:
    return isinstance(v, int) and not isinstance(v, bool)


# ---------------------------------------------------------------------------------------------------- memory
# recompute.sequence_chunks=auto: chunks of at most this many local tokens (a query chunk this long keeps the attention
# kernels and the chunk's matmuls efficient on a GPU; the planner searches larger chunks too)
DEFAULT_SEQUENCE_CHUNK_TOKENS = 16384
RECOMPUTE_MODES = ("none", "selective", "full", "full_keep_attn")
# the planner's recompute modes -> (the recompute group's choice, its selective modules); "selective" alone would be
# ambiguous: the config's recompute=selective recomputes recompute.modules (default [core_attn])
PLANNED_RECOMPUTE = {"none": ("none", None), "selective_mlp": ("selective", ("mlp",)),
                     "selective_attn": ("selective", ("core_attn",)), "full": ("full", None),
                     "full_keep_attn": ("full_keep_attn", None)}
RECOMPUTE_METHODS = ("uniform", "block")
# recompute_modules of megatron-core that apply to dense GPT layers (moe, moe_act, shared_experts and mla_up_proj
# need MoE / MLA layers, which nemo_longctx's core attention does not support)
SELECTIVE_MODULES = ("core_attn", "mlp", "layernorm")
OFFLOAD_MODES = ("none", "layer_input", "modules")
PLANNED_OFFLOAD = OFFLOAD_MODES[:2]  # the offload modes the planner models
# offload.modules names -> submodule path inside a Megatron TransformerLayer
OFFLOAD_MODULE_PATHS = {
    "self_attention": "self_attention",
    "core_attn": "self_attention.core_attention",
    "linear_qkv": "self_attention.linear_qkv",
    "linear_proj": "self_attention.linear_proj",
    "mlp": "mlp",
    "linear_fc1": "mlp.linear_fc1",
    "linear_fc2": "mlp.linear_fc2",
    "input_layernorm": "input_layernorm",
    "pre_mlp_layernorm": "pre_mlp_layernorm",
}
# offloading these modules saves nothing when the selective recompute module re-runs them
RECOMPUTED_BY = {
    "core_attn": {"core_attn"},
    "mlp": {"mlp", "linear_fc1", "linear_fc2"},
    "layernorm": {"input_layernorm", "pre_mlp_layernorm"},
}
KEEP_ATTN_ALGORITHMS = ("ring",)
SEQUENCE_CHUNK_ALGORITHMS = ("ring", "ulysses", "hybrid")  # recompute.sequence_chunks at cp.size > 1
# the keys each choice of the two groups may set (besides `name`)
GROUP_KEYS = {
    "recompute": {"selective": ("modules",), "full": ("method", "num_layers", "sequence_chunks"),
                  "full_keep_attn": ("method", "num_layers", "sequence_chunks")},
    "offload": {"layer_input": ("prefetch_depth", "min_bytes"), "modules": ("modules", "prefetch_depth", "min_bytes")},
}


@dataclass(frozen=True)
class MemoryOptions:
    """The ``recompute`` and ``offload`` groups (one object: their rules cross).

    recompute: none | selective (Megatron's selective recompute of ``modules``; layernorm runs nemo_longctx's norm
    recompute) | full (Megatron's full-layer recompute, ``method`` uniform|block, ``num_layers``) | full_keep_attn
    (full recompute whose core attention keeps (out, lse) from the forward: ring attention only).
    offload: none | layer_input (under full recompute: each checkpointed layer's input goes to host memory,
    prefetched ``prefetch_depth`` layers ahead in backward) | modules (the tensors saved by the named submodules of
    every layer, above ``min_bytes``; not with full recompute)."""

    recompute: Any = "none"
    recompute_modules: Any = ("core_attn",)
    recompute_method: Any = "uniform"
    recompute_num_layers: Any = 1
    sequence_chunks: Any = "off"
    offload: Any = "none"
    offload_modules: Any = ()
    prefetch_depth: Any = 1
    min_bytes: Any = 2**20
    given: Tuple[str, ...] = field(default=(), compare=False, repr=False)  # "recompute.x" / "offload.y" keys set

    RECOMPUTE_OPTIONS: ClassVar[Tuple[Option, ...]] = (
        Option("recompute.name", "choice", "none", "none | selective | full | full_keep_attn (the group's choice: "
               "recompute=<name>)", choices=RECOMPUTE_MODES),
        Option("recompute.modules", "modules", ("core_attn",), "recompute=selective: Megatron's recompute_modules",
               choices=SELECTIVE_MODULES, requires=("recompute=selective",)),
        Option("recompute.method", "choice", "uniform", "recompute=full|full_keep_attn: Megatron's "
               "recompute_method", choices=RECOMPUTE_METHODS, requires=("recompute=full",)),
        Option("recompute.num_layers", "int", 1, "recompute=full|full_keep_attn: Megatron's recompute_num_layers",
               low=1, requires=("recompute=full",)),
        Option("recompute.sequence_chunks", "tiles", "off", "recompute=full: each recomputed layer runs chunk by chunk "
               "over its local sequence in forward and backward (any cp algorithm): off | auto (ceil(tokens / "
               f"{DEFAULT_SEQUENCE_CHUNK_TOKENS})) | N",
               requires=("recompute=full",)),
    )
    OFFLOAD_OPTIONS: ClassVar[Tuple[Option, ...]] = (
        Option("offload.name", "choice", "none", "none | layer_input | modules (the group's choice: offload=<name>)",
               choices=OFFLOAD_MODES),
        Option("offload.modules", "modules", (), "offload=modules: the layer submodules whose saved tensors go to "
               "the host", choices=tuple(sorted(OFFLOAD_MODULE_PATHS)), requires=("offload=modules",)),
        Option("offload.prefetch_depth", "int", 1, "layers brought back ahead of the one in backward", low=0,
               requires=("recompute=full", "offload=layer_input")),
        Option("offload.min_bytes", "int", 2**20, "tensors smaller than this stay on the device", low=0,
               requires=("recompute=full", "offload=layer_input")),
    )
    _FIELD = {"recompute.name": "recompute", "recompute.modules": "recompute_modules",
              "recompute.method": "recompute_method", "recompute.num_layers": "recompute_num_layers",
              "recompute.sequence_chunks": "sequence_chunks", "offload.name": "offload",
              "offload.modules": "offload_modules",
              "offload.prefetch_depth": "prefetch_depth", "offload.min_bytes": "min_bytes"}

    @classmethod
    def from_dict(cls, recompute: Optional[Mapping[str, Any]] = None,
                  offload: Optional[Mapping[str, Any]] = None) -> "MemoryOptions":
        """From the two groups as plain dicts (``name`` + the choice's keys); None = none."""
        kw: Dict[str, Any] = {}
        given = []
        for group, node in (("recompute", recompute), ("offload", offload)):
            for k, v in dict(node or {}).items():
                given.append(f"{group}.{k}")
                f = cls._FIELD.get(f"{group}.{k}")
                if f is not None:
                    kw[f] = normalize_tiles(_plain(v)) if f == "sequence_chunks" else _plain(v)
        return cls(**kw, given=tuple(given))

    @property
    def full(self) -> bool:
        return self.recompute in ("full", "full_keep_attn")

    @property
    def trivial(self) -> bool:
        return self.recompute == "none" and self.offload == "none"

    def describe(self) -> str:
        r = self.recompute
        if r == "selective":
            r += f"[{','.join(self.recompute_modules)}]"
        elif self.full:
            r += f"({self.recompute_method},{self.recompute_num_layers})"
            if self.sequence_chunks != "off":
                r += f"[sequence_chunks={self.sequence_chunks}]"
        o = self.offload + (f"[{','.join(self.offload_modules)}]" if self.offload == "modules" else "")
        return f"recompute={r} offload={o}"

    def packed_problems(self, packed_by: str) -> List[str]:
        """The problems of these options with packed documents (``packed_by``: the key that packs them)."""
        if self.recompute == "full_keep_attn":
            return [f"recompute=full_keep_attn does not take packed documents ({packed_by}): its kept attention has "
                    "no per-document path; use recompute=full or selective"]
        return []

    def problems(self, cp_algorithm: Any = "ring", ctx: Optional["Context"] = None) -> List[str]:
        """Every problem with these options (empty = valid) that needs no model, each naming its key in ``ctx``'s
        dialect."""
        ctx = ctx or Context()
        kn = ctx.key
        p: List[str] = []
        values = {o: getattr(self, f) for o, f in self._FIELD.items()}
        for group, opts in (("recompute", self.RECOMPUTE_OPTIONS), ("offload", self.OFFLOAD_OPTIONS)):
            name = values[f"{group}.name"]
            p += option_problems(opts[:1], {"name": name}, ctx)
            if name not in (RECOMPUTE_MODES if group == "recompute" else OFFLOAD_MODES):
                continue
            allowed = GROUP_KEYS[group].get(name, ())
            given = {k.split(".", 1)[1]: 0 for k in self.given if k.startswith(group + ".")}
            given.pop("name", None)
            p += unknown_keys(group, given, allowed, f" for {group}={name}", noun="field(s)", ctx=ctx)
            # the keys this choice uses (given or defaulted)
            p += option_problems([o for o in opts[1:] if o.name in allowed],
                                 {k.split(".", 1)[1]: v for k, v in values.items() if k.startswith(group + ".")}, ctx)
        if p:
            return p
        r, o = self.recompute, self.offload
        if r == "full_keep_attn" and cp_algorithm not in KEEP_ATTN_ALGORITHMS:
            p.append(f"recompute=full_keep_attn keeps ring attention's output and LSE: it needs {kn('cp.algorithm')}="
                     f"ring (cp=ring or cp=none), got {kn('cp.algorithm')}={cp_algorithm!r}")
        if self.sequence_chunks != "off":
            if r != "full":
                p.append(f"{kn('recompute.sequence_chunks')}={self.sequence_chunks!r} needs recompute=full (with "
                         f"recompute={r} it is not implemented)")
        if o == "layer_input" and not self.full:
            p.append(f"offload=layer_input requires recompute=full or full_keep_attn (got recompute={r})")
        if o == "modules":
            if self.full:
                p.append(f"offload=modules cannot be combined with recompute={r}: a fully recomputed layer saves "
                         "nothing inside its modules; use offload=layer_input")
            if r == "selective":
                for rm in self.recompute_modules:
                    clash = sorted(RECOMPUTED_BY.get(rm, set()) & set(self.offload_modules))
                    if clash:
                        p.append(f"{kn('offload.modules')} {clash} are recomputed by {kn('recompute.modules')} [{rm}] "
                                 "(they save nothing to offload): drop them from one of the two lists")
        return p


# ---------------------------------------------------------------------------------------------------- tiling
# "auto" = ceil(tokens per rank / tile tokens) tiles, one meaning everywhere (app, planner, layers); the tile sizes
# are these defaults unless tiling.mlp_tile_tokens / tiling.loss_chunk_tokens say otherwise (measured on CPU,
# bench/tiling_memory.py: large enough that per-tile matmuls keep their speed, small enough that one tile's
# transient is a small fraction of the full-sequence one at 8K+ tokens)
DEFAULT_MLP_TILE_TOKENS = 2048
DEFAULT_LOSS_CHUNK_TOKENS = 512


def auto_tiles(tokens: int, tile_tokens: int) -> int:
    """The count ``auto`` resolves to for ``tokens`` tokens per rank: ceil(tokens / tile_tokens), in [1, tokens]."""
    return min(max(1, math.ceil(tokens / tile_tokens)), max(1, int(tokens)))


def normalize_tiles(value: Any) -> Any:
    """YAML 1.1 reads a bare ``off`` as False: map it back to "off"; everything else as given (checked later)."""
    return "off" if value is False else value


@dataclass(frozen=True)
class TilingOptions:
    """The ``tiling`` group: ``mlp_tiles`` / ``loss_chunks`` are "off", "auto" or a fixed count per rank."""

    mlp_tiles: Any = "off"
    loss_chunks: Any = "off"
    mlp_tile_tokens: Any = DEFAULT_MLP_TILE_TOKENS
    loss_chunk_tokens: Any = DEFAULT_LOSS_CHUNK_TOKENS
    given: Tuple[str, ...] = field(default=(), compare=False, repr=False)

    OPTIONS: ClassVar[Tuple[Option, ...]] = (
        Option("tiling.mlp_tiles", "tiles", "off", "sequence tiles of every dense MLP per rank: off | auto "
               "(ceil(tokens / tiling.mlp_tile_tokens)) | N"),
        Option("tiling.loss_chunks", "tiles", "off", "chunks of the output layer + cross entropy per rank: off | "
               "auto (ceil(tokens / tiling.loss_chunk_tokens)) | N"),
        Option("tiling.mlp_tile_tokens", "int", DEFAULT_MLP_TILE_TOKENS, "tokens per MLP tile for mlp_tiles=auto",
               low=1),
        Option("tiling.loss_chunk_tokens", "int", DEFAULT_LOSS_CHUNK_TOKENS, "tokens per loss chunk for "
               "loss_chunks=auto", low=1),
    )

    @classmethod
    def from_dict(cls, d: Optional[Mapping[str, Any]]) -> "TilingOptions":
        d = dict(d or {})
        kw = {o.name: normalize_tiles(d[o.name]) for o in cls.OPTIONS if o.name in d}
        return cls(**kw, given=tuple(d))

    @property
    def active(self) -> bool:
        return self.mlp_tiles != "off" or self.loss_chunks != "off"

    def tokens(self, seq_length: int, cp_size: int, tp: int = 1, sequence_parallel: bool = False) -> Tuple[int, int]:
        """(MLP tokens, loss tokens) per rank: seq_length / cp (and / tp for the MLP under sequence parallelism)."""
        loss = int(seq_length) // int(cp_size)
        return (loss // int(tp) if sequence_parallel and tp > 1 else loss), loss

    def problems(self, seq_length: Any = None, cp_size: Any = 1, tp: Any = 1, sequence_parallel: bool = False,
                 keys: Optional[Context] = None) -> List[str]:
        """Every problem of the group (empty = valid) against the tokens per rank, each naming its key in the
        dialect of ``keys`` (a ``Context``)."""
        ctx = keys or Context()
        values = {o.name: getattr(self, o.name) for o in self.OPTIONS}
        p = unknown_keys("tiling", {k: 0 for k in self.given}, [o.name for o in self.OPTIONS], ctx=ctx)
        p += option_problems(self.OPTIONS, values, ctx)
        if p or not (_is_int(seq_length) and _is_int(cp_size) and cp_size >= 1 and _is_int(tp) and tp >= 1):
            return p
        mlp_tokens, loss_tokens = self.tokens(seq_length, cp_size, tp, sequence_parallel)
        where = f"{ctx.key('seq_length')}={seq_length} / {ctx.key('cp.size')}={cp_size}"
        sp = (f" / {ctx.key('tp')}={tp} (sequence parallel)" if sequence_parallel and tp > 1 else "")
        for key, policy, tokens, extra in (("tiling.mlp_tiles", self.mlp_tiles, mlp_tokens, sp),
                                           ("tiling.loss_chunks", self.loss_chunks, loss_tokens, "")):
            if _is_int(policy) and policy > tokens:
                p.append(f"{ctx.key(key)}={policy} exceeds the {tokens} tokens per rank ({where}{extra}): use at most "
                         f"{tokens}, auto or off")
        return p

    def counts(self, seq_length: int, cp_size: int, tp: int = 1, sequence_parallel: bool = False) -> Tuple[int, int]:
        """(MLP tiles, loss chunks) per rank the settings resolve to (1 = off); valid settings only."""
        mlp_tokens, loss_tokens = self.tokens(seq_length, cp_size, tp, sequence_parallel)

        def count(policy: Any, tokens: int, tile_tokens: int) -> int:
            return 1 if policy == "off" else auto_tiles(tokens, tile_tokens) if policy == "auto" else int(policy)

        return (count(self.mlp_tiles, mlp_tokens, self.mlp_tile_tokens),
                count(self.loss_chunks, loss_tokens, self.loss_chunk_tokens))

    def describe(self, seq_length: int, cp_size: int, tp: int = 1, sequence_parallel: bool = False) -> str:
        """One line with the tile / chunk counts per rank the settings resolve to."""
        mlp_tokens, loss_tokens = self.tokens(seq_length, cp_size, tp, sequence_parallel)
        tiles, chunks = self.counts(seq_length, cp_size, tp, sequence_parallel)
        parts = [f"mlp_tiles={self.mlp_tiles}: {tiles} tile(s) of <= {-(-mlp_tokens // tiles)} tokens per rank"
                 if self.mlp_tiles != "off" else "mlp_tiles=off",
                 f"loss_chunks={self.loss_chunks}: {chunks} chunk(s) of <= {-(-loss_tokens // chunks)} tokens per "
                 "rank" if self.loss_chunks != "off" else "loss_chunks=off"]
        return "; ".join(parts)


# ---------------------------------------------------------------------------------------------------- optim
DTYPES = ("fp32", "bf16", "fp16")
MAIN_PARAMS_DTYPES = ("fp32", "fp16")  # megatron: --main-params-dtype choices
MAIN_GRADS_DTYPES = ("fp32", "bf16")  # megatron: --main-grads-dtype choices
OPTIMIZERS = ("adam", "sgd")
DTYPE_BYTES = {"fp32": 4, "bf16": 2, "fp16": 2}


@dataclass(frozen=True)
class ModelStateOptions:
    """How weights, gradients and optimizer states are kept (the ``optim`` group's model-state keys).

    use_distributed_optimizer: ZeRO-1 (fp32 master weights + Adam moments sharded over data-parallel x CP);
    megatron_fsdp: ZeRO-3 (Megatron-FSDP, optim_grads_params); optimizer_cpu_offload: Megatron's
    HybridDeviceOptimizer runs the Adam step of ``optimizer_offload_fraction`` of the (sharded) parameters on the
    host; use_precision_aware_optimizer: TE's FusedAdam keeps moments in exp_avg(_sq)_dtype and master weights in
    main_params_dtype; main_grads_dtype=bf16 reduces gradients in bf16."""

    optimizer: Any = "adam"
    use_distributed_optimizer: Any = False
    megatron_fsdp: Any = False
    optimizer_cpu_offload: Any = False
    optimizer_offload_fraction: Any = 1.0
    use_precision_aware_optimizer: Any = False
    main_grads_dtype: Any = "fp32"
    main_params_dtype: Any = "fp32"
    exp_avg_dtype: Any = "fp32"
    exp_avg_sq_dtype: Any = "fp32"

    OPTIONS: ClassVar[Tuple[Option, ...]] = (
        Option("optim.optimizer", "choice", "adam", "adam | sgd", choices=OPTIMIZERS),
        Option("optim.use_distributed_optimizer", "bool", False, "ZeRO-1: master weights and moments sharded over "
               "data-parallel x CP"),
        Option("optim.megatron_fsdp", "bool", False, "ZeRO-3: Megatron-FSDP shards weights, grads and optimizer "
               "states (needs use_distributed_optimizer)"),
        Option("optim.optimizer_cpu_offload", "bool", False, "the Adam step of a fraction of the parameters runs "
               "on the host (Megatron's HybridDeviceOptimizer)"),
        Option("optim.optimizer_offload_fraction", "number", 1.0, "fraction of the (sharded) optimizer offloaded",
               low=0.0, high=1.0),
        Option("optim.use_precision_aware_optimizer", "bool", False, "low-precision moments / master weights / "
               "grads (TE's FusedAdam)"),
        Option("optim.main_grads_dtype", "choice", "fp32", "gradient reduction dtype", choices=MAIN_GRADS_DTYPES),
        Option("optim.main_params_dtype", "choice", "fp32", "master weights dtype", choices=MAIN_PARAMS_DTYPES),
        Option("optim.exp_avg_dtype", "choice", "fp32", "Adam first moment dtype", choices=DTYPES),
        Option("optim.exp_avg_sq_dtype", "choice", "fp32", "Adam second moment dtype", choices=DTYPES),
    )

    def describe(self) -> str:
        parts = ["megatron_fsdp" if self.megatron_fsdp else
                 ("distributed_optimizer" if self.use_distributed_optimizer else "ddp")]
        if self.optimizer_cpu_offload:
            parts.append(f"optimizer_cpu_offload({self.optimizer_offload_fraction:g})")
        if self.use_precision_aware_optimizer:
            parts.append(f"precision_aware(grads={self.main_grads_dtype},params={self.main_params_dtype},"
                         f"m={self.exp_avg_dtype},v={self.exp_avg_sq_dtype})")
        return " + ".join(parts)

    def problems(self, ctx: Optional[Context] = None) -> List[str]:
        """Every problem (empty = valid), each naming its ``optim.*`` key in ``ctx``'s dialect. ``ctx.te``/
        ``ctx.cuda``: whether the target has TransformerEngine / CUDA (None: not checked here)."""
        ctx = ctx or Context()
        o = self
        p = option_problems(self.OPTIONS, {f.name: getattr(self, f.name) for f in fields(self)}, ctx)
        if p:
            return p
        precision, pp_key, prec_key = str(ctx.precision), ctx.key("pp"), ctx.key("precision")
        fsdp, dist, off, aware, opt = (ctx.key(f"optim.{n}") for n in (
            "megatron_fsdp", "use_distributed_optimizer", "optimizer_cpu_offload", "use_precision_aware_optimizer",
            "optimizer"))
        for f in ("main_grads_dtype", "main_params_dtype", "exp_avg_dtype", "exp_avg_sq_dtype"):
            v = getattr(o, f)
            if v != "fp32" and not o.use_precision_aware_optimizer:
                p.append(f"{ctx.key('optim.' + f)}={v} needs {aware}=true (Megatron keeps {f} in fp32 otherwise)")
        if o.megatron_fsdp:
            if not o.use_distributed_optimizer:
                p.append(f"{fsdp}=true needs {dist}=true (Megatron-FSDP shards the optimizer states through the "
                         "distributed optimizer)")
            if ctx.pp > 1:
                p.append(f"{fsdp}=true with {pp_key}={ctx.pp}: nemo_longctx runs Megatron-FSDP without pipeline "
                         "parallelism only")
            ck = ctx.key("checkpointing")
            if ctx.checkpointing and not ctx.fsdp_checkpoints:
                # the fsdp_dtensor save/load makes collective calls per parameter's optimizer state, and Megatron-FSDP
                # creates no state for a rank's empty shards: nemo-longctx train fills it in (fsdp_checkpoint.py);
                # the Megatron-Bridge and NeMo-Run front ends have no such hook here (not run with Bridge)
                p.append(f"{fsdp}=true with {ck} > 0: Megatron-FSDP checkpoints (the fsdp_dtensor format) are saved "
                         "by nemo-longctx train only, which gives every rank the optimizer state of every parameter "
                         f"that format needs (set {ck}=0, or train with nemo-longctx train)")
            elif ctx.checkpointing and not precision.startswith("bf16"):
                # fp32: NeMo 2.7's MegatronStrategy._get_fsdp_dtensor_state_dict looks the SwiGLU fc1 weights up as
                # "module.<key>" below the mixed-precision wrapper, which an fp32 model lacks (AttributeError);
                # 16-mixed: not run (its grad scaler state is in the checkpoint too)
                p.append(f"{fsdp}=true with {ck} > 0 and {prec_key}={precision}: Megatron-FSDP checkpoints are saved "
                         f"and resumed at {prec_key}=bf16-mixed only (with fp32 weights NeMo's save cannot find the "
                         "weights of a gated (SwiGLU) MLP; 16-mixed is not verified) (use "
                         f"{prec_key}=bf16-mixed, or set {ck}=0)")
            if o.optimizer_cpu_offload:
                # unverified, not known broken: with Megatron-FSDP the distributed optimizer skips its shard set-up
                # and HybridDeviceOptimizer would get Megatron-FSDP's DTensor parameters directly
                p.append(f"{fsdp}=true with {off}=true: not verified (Megatron-FSDP hands HybridDeviceOptimizer its "
                         f"DTensor parameters directly, which no test here can run); use {dist}=true without "
                         "megatron_fsdp for optimizer CPU offload")
        if o.optimizer_cpu_offload:
            if not o.use_distributed_optimizer:
                p.append(f"{off}=true needs {dist}=true (nemo_longctx offloads the distributed optimizer's shard)")
            if o.optimizer != "adam":
                p.append(f"{off}=true supports {opt}=adam here, got {o.optimizer!r}")
            if not (precision.startswith("bf16") or precision.startswith("16")):
                p.append(f"{off}=true needs {prec_key}=bf16-mixed or 16-mixed (got {precision}): with fp32 weights "
                         "Megatron's distributed optimizer hands HybridDeviceOptimizer views of the parameters, which "
                         "torch.optim refuses (non-leaf tensors)")
        if o.use_precision_aware_optimizer:
            if o.optimizer != "adam":
                p.append(f"{aware}=true needs {opt}=adam, got {o.optimizer!r}")
            if not o.use_distributed_optimizer:
                p.append(f"{aware}=true needs {dist}=true")
            if o.optimizer_cpu_offload:
                # Megatron builds HybridDeviceOptimizer(param_update_in_fp32=True) without the dtype arguments
                for f in ("exp_avg_dtype", "exp_avg_sq_dtype", "main_params_dtype"):
                    if getattr(o, f) != "fp32":
                        p.append(f"{ctx.key('optim.' + f)}={getattr(o, f)} with {off}=true: Megatron's "
                                 "HybridDeviceOptimizer keeps fp32 master weights and fp32 Adam moments (it ignores "
                                 f"{f}); set it to fp32")
            if ctx.te is False and not o.optimizer_cpu_offload:
                # with optimizer_cpu_offload the precision-aware step is HybridDeviceOptimizer's: no TE FusedAdam
                p.append(f"{aware}=true needs TransformerEngine's FusedAdam (it keeps the low-precision states) "
                         f"unless {off}=true: transformer_engine is not installed")
            elif ctx.te is False and ctx.cuda:
                # OptimizerConfig.__post_init__ compares TE's version (None without TE: TypeError); cpu_compat
                # answers it on CPU-only builds, nothing does on a CUDA build without TE
                p.append(f"{aware}=true on a CUDA build needs TransformerEngine installed (Megatron's OptimizerConfig "
                         f"reads its version), even with {off}=true")
            if o.main_grads_dtype != "fp32" and not precision.startswith("bf16"):
                p.append(f"{ctx.key('optim.main_grads_dtype')}={o.main_grads_dtype} needs {prec_key}=bf16-mixed "
                         f"(got {precision})")
        return p


@dataclass(frozen=True)
class OptimOptions:
    """The ``optim`` group: learning-rate schedule and optimizer hyper-parameters, and the model-state layout."""

    lr: Any = None
    min_lr: Any = None
    warmup_steps: Any = None
    weight_decay: Any = None
    clip_grad: Any = None
    adam_beta1: Any = None
    adam_beta2: Any = None
    adam_eps: Any = None
    state: ModelStateOptions = field(default_factory=ModelStateOptions)
    given: Tuple[str, ...] = field(default=(), compare=False, repr=False)

    OPTIONS: ClassVar[Tuple[Option, ...]] = (
        Option("optim.lr", "number", None, "peak learning rate (cosine schedule; null: the recipe's)", above=0.0,
               nullable=True),
        Option("optim.min_lr", "number", None, "learning rate at the end of the schedule (null: the recipe's)",
               low=0.0, nullable=True),
        Option("optim.warmup_steps", "int", None, "linear warm-up steps (null: the recipe's)", low=0, nullable=True),
        Option("optim.weight_decay", "number", None, "decoupled weight decay (null: the recipe's)", low=0.0,
               nullable=True),
        Option("optim.clip_grad", "number", None, "gradient-norm clipping (0 = off; null: the recipe's)", low=0.0,
               nullable=True),
        Option("optim.adam_beta1", "number", None, "Adam beta1 (null: the recipe's)", low=0.0, high=1.0,
               nullable=True),
        Option("optim.adam_beta2", "number", None, "Adam beta2 (null: the recipe's)", above=0.0, high=1.0,
               nullable=True),
        Option("optim.adam_eps", "number", None, "Adam epsilon (null: the recipe's)", above=0.0, nullable=True),
    ) + ModelStateOptions.OPTIONS
    SCHEDULE: ClassVar[int] = 8  # the first SCHEDULE options are the schedule's and the optimizer's hyper-parameters

    @classmethod
    def from_dict(cls, d: Optional[Mapping[str, Any]]) -> "OptimOptions":
        d = dict(d or {})
        state = {f.name for f in fields(ModelStateOptions)}
        kw = {k: _plain(v) for k, v in d.items() if k in {o.name for o in cls.OPTIONS[:cls.SCHEDULE]}}
        return cls(**kw, state=ModelStateOptions(**{k: _plain(v) for k, v in d.items() if k in state}),
                   given=tuple(d))

    def problems(self, ctx: Optional[Context] = None) -> List[str]:
        p = unknown_keys("optim", {k: 0 for k in self.given}, [o.name for o in self.OPTIONS], ctx=ctx)
        sched = self.OPTIONS[:self.SCHEDULE]
        p += option_problems(sched, {o.name: getattr(self, o.name) for o in sched}, ctx)
        return p + self.state.problems(ctx)


# ---------------------------------------------------------------------------------------------------- metrics
@dataclass(frozen=True)
class MetricsOptions:
    """What each step measures and logs."""

    track: Any = True
    track_peak: Any = False
    tensorboard: Any = True
    level: Any = "info"
    print_every: Any = 1
    given: Tuple[str, ...] = field(default=(), compare=False, repr=False)  # keys set in the memory and log groups

    OPTIONS: ClassVar[Tuple[Option, ...]] = (
        Option("memory.track", "bool", True, "per-step activation_bytes_device/_host (saved-for-backward bytes) in "
               "metrics.jsonl"),
        Option("memory.track_peak", "bool", False, "peak_bytes on CPU: counts every op's output (slower); CUDA: "
               "always"),
        Option("log.tensorboard", "bool", True, "TensorBoard event files in <output_dir>/tensorboard"),
        Option("log.level", "choice", "info", "info: quiet console (step lines, warnings once, a final summary) | "
               "debug: everything the libraries print (--verbose)", choices=("info", "debug")),
        Option("run.print_every", "int", 1, "print a step line every N steps", low=1),
    )

    @classmethod
    def from_dict(cls, data: Mapping[str, Any]) -> "MetricsOptions":
        kw = {}
        for o in cls.OPTIONS:
            group, name = o.key.split(".")
            node = data.get(group) or {}
            if isinstance(node, Mapping) and name in node:
                kw[o.name] = node[name]
        given = tuple(f"{g}.{k}" for g in ("memory", "log") if isinstance(data.get(g), Mapping) for k in data[g])
        return cls(**kw, given=given)

    def problems(self, ctx: Optional[Context] = None) -> List[str]:
        p: List[str] = []
        for group in ("memory", "log"):  # groups of their own (run.* is shared with the front end's keys)
            p += unknown_keys(group, {k.split(".", 1)[1]: 0 for k in self.given if k.startswith(group + ".")},
                              [o.name for o in self.OPTIONS if o.key.startswith(group + ".")], ctx=ctx)
        return p + option_problems(self.OPTIONS, {o.name: getattr(self, o.name) for o in self.OPTIONS}, ctx)


# ---------------------------------------------------------------------------------------------------- the model
@dataclass(frozen=True)
class LongContextOptions:
    """Every long-context option of a run (see the module docstring)."""

    cp: CPOptions = field(default_factory=CPOptions)
    memory: MemoryOptions = field(default_factory=MemoryOptions)
    tiling: TilingOptions = field(default_factory=TilingOptions)
    optim: OptimOptions = field(default_factory=OptimOptions)
    metrics: MetricsOptions = field(default_factory=MetricsOptions)
    group_problems: Tuple[str, ...] = field(default=(), compare=False, repr=False)

    GROUPS: ClassVar[Tuple[str, ...]] = ("cp", "recompute", "offload", "tiling", "optim")

    @classmethod
    def from_dict(cls, data: Optional[Mapping[str, Any]]) -> "LongContextOptions":
        """From a mapping holding the groups (plain dicts, e.g. ``OmegaConf.to_container(cfg, resolve=True)``);
        absent groups take their defaults. Never raises on a value: ``problems()`` reports them."""
        data = dict(data or {})
        nodes, bad = {}, []
        for g in cls.GROUPS:
            nodes[g], p = _group(data, g)
            bad += p
        return cls(cp=CPOptions.from_dict(nodes["cp"]), memory=MemoryOptions.from_dict(nodes["recompute"],
                                                                                       nodes["offload"]),
                   tiling=TilingOptions.from_dict(nodes["tiling"]), optim=OptimOptions.from_dict(nodes["optim"]),
                   metrics=MetricsOptions.from_dict(data), group_problems=tuple(bad))

    @classmethod
    def options(cls) -> Tuple[Option, ...]:
        """Every key of the option model (the reference tables of docs/ and the generated config tests read this)."""
        return (CPOptions.OPTIONS + MemoryOptions.RECOMPUTE_OPTIONS + MemoryOptions.OFFLOAD_OPTIONS
                + TilingOptions.OPTIONS + OptimOptions.OPTIONS + MetricsOptions.OPTIONS)

    def problems(self, ctx: Optional[Context] = None) -> List[str]:
        """Every problem that needs no model (empty = valid), each naming its key."""
        ctx = ctx or Context()
        kn = ctx.key  # the option keys in the front end's dialect
        p = list(self.group_problems) + self.cp.problems(ctx)
        cp_ok = not p
        p += self.memory.problems(self.cp.algorithm, ctx)
        p += self.tiling.problems(ctx.seq_length, self.cp.size if cp_ok else None, ctx.tp, ctx.sequence_parallel,
                                  ctx)
        p += self.optim.problems(ctx) + self.metrics.problems(ctx)
        if cp_ok:
            p += layout_problems(ctx.seq_length, self.cp.size, ctx.tp, ctx.pp, ctx.world_size, ctx.sequence_parallel,
                                 ctx)
        if (self.memory.sequence_chunks != "off" and cp_ok and self.cp.size > 1
                and self.cp.algorithm not in SEQUENCE_CHUNK_ALGORITHMS):
            p.append(f"{kn('recompute.sequence_chunks')}={self.memory.sequence_chunks} with "
                     f"{kn('cp.algorithm')}={self.cp.algorithm} ({kn('cp.size')}={self.cp.size}): sequence-chunked "
                     f"layers run under {', '.join(SEQUENCE_CHUNK_ALGORITHMS)} CP (or cp=none)")
        if self.memory.sequence_chunks != "off" and cp_ok and self.cp.size > 1 and self.cp.algorithm in (
                "ulysses", "hybrid"):
            # the chunked attention sends each sequence chunk's heads at once and saves nothing gathered
            redundant = [f"{kn('cp.head_chunks')}={self.cp.head_chunks}"] if self.cp.head_chunks != 1 else []
            if self.cp.kwargs.get("regather_in_backward"):
                redundant.append(f"{kn('cp.kwargs')}.regather_in_backward=true")
            if redundant:
                p.append(f"{kn('recompute.sequence_chunks')}={self.memory.sequence_chunks} with "
                         f"{' and '.join(redundant)}: a sequence-chunked layer's all-to-alls already move one sequence "
                         "chunk at a time and keep nothing gathered for backward; drop "
                         + " and ".join(r.split("=")[0] for r in redundant))
        if cp_ok and self.cp.document_aware:
            v, split = self.cp.split_min_tokens, kn("cp.split_min_tokens")
            if not ctx.document_placement:
                p.append(f"{split}={v!r}: document-aware placement is not available on this front end in this "
                         "version (its own data step lays packed sequences out, every document split); use the NeMo 2 "
                         f"app (nemo-longctx train) for it, or set {split}=off")
            if ctx.packed_data is False:
                p.append(f"{split}={v!r} places packed documents, but {ctx.key('packed_data')} are dense sequences "
                         "(no document boundaries): use packed documents or drop it")
            if self.memory.sequence_chunks != "off":
                p.append(f"{split}={v!r} with {kn('recompute.sequence_chunks')}={self.memory.sequence_chunks}: "
                         "sequence-chunked layers run the per-document zigzag layout only; drop one of them")
            if self.memory.recompute == "full_keep_attn":
                p.append(f"{split}={v!r} with recompute=full_keep_attn: that recompute takes no packed documents; "
                         "use recompute=full or selective")
        if self.tiling.loss_chunks != "off" and self.optim.state.megatron_fsdp:
            # found by nemo-longctx fuzz: the chunked loss builds the output layer's and embedding's gradients
            # during forward, and Megatron-FSDP's gradient pipeline asserts at the first step
            chunks = kn("tiling.loss_chunks")
            p.append(f"{chunks}={self.tiling.loss_chunks} with {kn('optim.megatron_fsdp')}=true: Megatron-FSDP "
                     f"refuses the gradients the chunked loss makes in forward; set {chunks}=off (or use "
                     f"{kn('optim.use_distributed_optimizer')}=true without megatron_fsdp)")
        if self.memory.sequence_chunks != "off" and ctx.sequence_parallel and _is_int(ctx.tp) and ctx.tp > 1:
            p.append(f"{kn('recompute.sequence_chunks')}={self.memory.sequence_chunks} with {kn('tp')}={ctx.tp} and "
                     "sequence parallelism: not supported in this version (a chunk of each TP rank's rows is not a "
                     "contiguous piece of the sequence)")
        return p

    def check(self, ctx: Optional[Context] = None) -> "LongContextOptions":
        """Raise ``ConfigError`` with every problem; returns self."""
        raise_problems(self.problems(ctx))
        return self

    def describe(self) -> Dict[str, str]:
        return {"cp": self.cp.describe(), "memory": self.memory.describe(), "model_state": self.optim.state.describe()}

    def to_overrides(self) -> List[str]:
        """Config overrides (``key=value``, the group choices as ``group=choice``) that select these options in
        the app's conf/ tree: what the planner prints and writes into sbatch scripts."""
        c, m, t = self.cp, self.memory, self.tiling
        out = ([f"cp={c.algorithm}", f"cp.size={c.size}"] if c.size > 1 else ["cp=none"])
        if c.size > 1 and c.algorithm == "hybrid":
            out.append(f"cp.ulysses_size={c.ulysses_size}")
        if c.size > 1 and c.algorithm in ("ulysses", "hybrid") and c.head_chunks != 1:
            out.append(f"cp.head_chunks={c.head_chunks}")
        if c.document_aware:
            out.append(f"cp.split_min_tokens={c.split_min_tokens}")
        out.append(f"recompute={m.recompute}")
        if m.recompute == "selective":
            out.append(f"recompute.modules=[{','.join(m.recompute_modules)}]")
        if m.full and (m.recompute_method, m.recompute_num_layers) != ("uniform", 1):
            out += [f"recompute.method={m.recompute_method}", f"recompute.num_layers={m.recompute_num_layers}"]
        if m.full and m.sequence_chunks != "off":
            out.append(f"recompute.sequence_chunks={m.sequence_chunks}")
        out.append(f"offload={m.offload}")
        if m.offload == "modules":
            out.append(f"offload.modules=[{','.join(m.offload_modules)}]")
        if m.offload != "none" and m.prefetch_depth != 1:
            out.append(f"offload.prefetch_depth={m.prefetch_depth}")
        out += [f"tiling.mlp_tiles={t.mlp_tiles}", f"tiling.loss_chunks={t.loss_chunks}"]
        if t.mlp_tiles == "auto" and t.mlp_tile_tokens != DEFAULT_MLP_TILE_TOKENS:
            out.append(f"tiling.mlp_tile_tokens={t.mlp_tile_tokens}")
        if t.loss_chunks == "auto" and t.loss_chunk_tokens != DEFAULT_LOSS_CHUNK_TOKENS:
            out.append(f"tiling.loss_chunk_tokens={t.loss_chunk_tokens}")
        s = self.optim.state
        # the sharding keys always (the group's defaults may differ between optim presets), the rest when changed
        always = ("use_distributed_optimizer", "megatron_fsdp")
        for f in fields(ModelStateOptions):
            v = getattr(s, f.name)
            if f.name in always or v != f.default:
                out.append(f"optim.{f.name}={str(v).lower() if isinstance(v, bool) else v}")
        return out

    def with_state(self, **changes: Any) -> "LongContextOptions":
        """A copy with model-state fields changed."""
        return replace(self, optim=replace(self.optim, state=replace(self.optim.state, **changes)))


def options_table(options: Optional[Sequence[Option]] = None) -> str:
    """A Markdown table of ``options`` (default: every key of the option model), for docs/reference/options.md
    (``scripts/gen_reference.py``)."""
    rows = ["| key | value | default | meaning |", "|---|---|---|---|"]
    for o in (LongContextOptions.options() if options is None else options):
        default = "null" if o.default is None else (str(o.default).lower() if isinstance(o.default, bool)
                                                    else list(o.default) if isinstance(o.default, tuple)
                                                    else o.default)
        cell = (o.expectation() + (f" (with {', '.join(o.requires)})" if o.requires else "")).replace("|", "\\|")
        rows.append(f"| `{o.key}` | {cell} | `{default}` | {o.help.replace('|', chr(92) + '|')} |")
    return "\n".join(rows)
