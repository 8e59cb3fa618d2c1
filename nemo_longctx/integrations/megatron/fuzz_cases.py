"""The composition fuzzer's cases: what one case is, how a seed draws them, and which the option model refuses.

A case is a tiny fp32 model (``MODELS``), a parallel layout (TP with or without sequence parallelism, a CP algorithm
and size, PP with or without virtual stages, DP, EP for MoE), a model-state layout (DDP, distributed optimizer,
Megatron-FSDP), recompute / offload / MLP tiling / loss chunks / sequence chunks, dense or packed documents and a
number of micro-batches. It is written as ``key=value`` words (``Case.words``), the same words ``parse_case`` reads
back: what the fuzzer prints to reproduce a case (``nemo-longctx fuzz --case '<words>'``). The long-context options use
the train app's keys (``cp=ring cp.size=2 recompute=full ...``); the layout, the model kind and the data use the
fuzzer's own short keys (``tp pp vpp ep dp sp model data micro_batches``).

Drawing needs no torch: ``draw_cases(seed, count, max_world)`` gives ``count`` cases, each either valid for the option
model (``LongContextOptions.problems`` with the case's layout) or carrying the option model's refusal, which the
fuzzer counts and reports (never skipped silently). What only Megatron can refuse is found when the case is built.
"""

from __future__ import annotations

import random
from dataclasses import dataclass, replace
from typing import Any, ClassVar, Dict, List, Optional, Tuple

from nemo_longctx.options import CP_ALGORITHMS, PLANNED_OFFLOAD, RECOMPUTE_MODES, Context, LongContextOptions

MODELS = ("gqa", "mqa", "mha", "moe", "mla", "window")
STATES = ("ddp", "distributed", "fsdp")
DATA = ("dense", "packed")
SEQ_LENGTH = 64  # tokens per sequence: a multiple of 2 x CP x TP for every drawn layout
DOCUMENTS = ((16, 32, 16), (48, 16), (32, 32), (16, 16, 32))  # packed documents (multiples of 16: no CP padding)


@dataclass(frozen=True)
class Case:
    """One drawn composition (see the module docstring); ``refused``: the option model's problems, if any."""

    model: str = "gqa"
    tp: int = 1
    sp: bool = False
    cp: int = 1
    cp_algorithm: str = "ring"
    ulysses_size: Optional[int] = None
    pp: int = 1
    vpp: Optional[int] = None
    ep: int = 1
    dp: int = 1
    state: str = "ddp"
    recompute: str = "none"
    offload: str = "none"
    sequence_chunks: Any = "off"
    mlp_tiles: Any = "off"
    loss_chunks: Any = "off"
    data: str = "dense"
    documents: Tuple[int, ...] = ()
    micro_batches: int = 1
    optimizer: Optional[str] = None  # None: Adam with a sharded optimizer state (Megatron takes no other), else SGD
    refused: Tuple[str, ...] = ()

    @property
    def world(self) -> int:
        return self.tp * self.cp * self.pp * self.dp

    num_layers: ClassVar[int] = 4  # enough for pp=2 with vpp=2 (one layer per virtual stage)

    @property
    def optimizer_name(self) -> str:
        if self.optimizer:
            return self.optimizer
        return "adam" if self.state in ("distributed", "fsdp") else "sgd"

    def options_dict(self) -> Dict[str, Any]:
        """The case's long-context options as the option model's groups."""
        cp: Dict[str, Any] = {"size": self.cp, "algorithm": self.cp_algorithm if self.cp > 1 else "ring"}
        if self.cp > 1 and self.cp_algorithm == "hybrid":
            cp["ulysses_size"] = self.ulysses_size
        recompute: Dict[str, Any] = {"name": self.recompute}
        if self.sequence_chunks != "off":
            recompute["sequence_chunks"] = self.sequence_chunks
        return {"cp": cp, "recompute": recompute, "offload": {"name": self.offload},
                "tiling": {"mlp_tiles": self.mlp_tiles, "loss_chunks": self.loss_chunks},
                "optim": {"optimizer": self.optimizer_name, "megatron_fsdp": self.state == "fsdp",
                          "use_distributed_optimizer": self.state in ("distributed", "fsdp")}}

    def options(self) -> LongContextOptions:
        return LongContextOptions.from_dict(self.options_dict())

    def context(self) -> Context:
        return Context(seq_length=SEQ_LENGTH, tp=self.tp, pp=self.pp, world_size=self.world,
                       sequence_parallel=self.sp, precision="32", cuda=False)

    def words(self) -> str:
        """``key=value`` words that reproduce this case (``parse_case``)."""
        w = [f"model={self.model}", f"tp={self.tp}", f"sp={str(self.sp).lower()}", f"pp={self.pp}"]
        if self.vpp:
            w.append(f"vpp={self.vpp}")
        if self.ep > 1:
            w.append(f"ep={self.ep}")
        w.append(f"dp={self.dp}")
        w += [f"cp={self.cp_algorithm}", f"cp.size={self.cp}"] if self.cp > 1 else ["cp=none"]
        if self.cp > 1 and self.cp_algorithm == "hybrid":
            w.append(f"cp.ulysses_size={self.ulysses_size}")
        w.append(f"recompute={self.recompute}")
        if self.sequence_chunks != "off":
            w.append(f"recompute.sequence_chunks={self.sequence_chunks}")
        w.append(f"offload={self.offload}")
        if self.mlp_tiles != "off":
            w.append(f"tiling.mlp_tiles={self.mlp_tiles}")
        if self.loss_chunks != "off":
            w.append(f"tiling.loss_chunks={self.loss_chunks}")
        w.append(f"state={self.state}")
        w.append(f"data={self.data}")
        if self.data == "packed":
            w.append("documents=" + ",".join(str(n) for n in self.documents))
        w.append(f"micro_batches={self.micro_batches}")
        return " ".join(w)

    def reference(self) -> "Case":
        """The same model, data and global batch on one rank: no parallelism, no memory options, DDP."""
        return replace(self, tp=1, sp=False, cp=1, cp_algorithm="ring", ulysses_size=None, pp=1, vpp=None, ep=1, dp=1,
                       state="ddp", recompute="none", offload="none", sequence_chunks="off", mlp_tiles="off",
                       loss_chunks="off", micro_batches=self.micro_batches * self.dp,
                       optimizer=self.optimizer_name, refused=())


# ------------------------------------------------------------------------------------------------------ parsing
_INT_KEYS = {"tp": "tp", "pp": "pp", "vpp": "vpp", "ep": "ep", "dp": "dp", "cp.size": "cp",
             "cp.ulysses_size": "ulysses_size", "micro_batches": "micro_batches"}
_CHOICE_KEYS = {"model": ("model", MODELS), "state": ("state", STATES), "data": ("data", DATA),
                "recompute": ("recompute", None), "offload": ("offload", None)}
_TILE_KEYS = {"recompute.sequence_chunks": "sequence_chunks", "tiling.mlp_tiles": "mlp_tiles",
              "tiling.loss_chunks": "loss_chunks"}


def parse_case(text: str) -> Case:
    """A case from ``Case.words`` text; raises ``ValueError`` naming every bad word."""
    values: Dict[str, Any] = {}
    bad: List[str] = []
    for word in text.split():
        key, sep, value = word.partition("=")
        if not sep or not value:
            bad.append(f"{word!r} is not key=value")
        elif key in _INT_KEYS:
            try:
                values[_INT_KEYS[key]] = int(value)
            except ValueError:
                bad.append(f"{key}={value}: not an integer")
        elif key == "sp":
            if value not in ("true", "false"):
                bad.append(f"sp={value}: true or false")
            values["sp"] = value == "true"
        elif key == "cp":
            if value == "none":
                values.setdefault("cp", 1)
            elif value in CP_ALGORITHMS:
                values["cp_algorithm"] = value
            else:
                bad.append(f"cp={value}: one of none, {', '.join(CP_ALGORITHMS)}")
        elif key in _CHOICE_KEYS:
            name, choices = _CHOICE_KEYS[key]
            if choices is not None and value not in choices:
                bad.append(f"{key}={value}: one of {', '.join(choices)}")
            values[name] = value
        elif key in _TILE_KEYS:
            values[_TILE_KEYS[key]] = value if value in ("off", "auto") else _int_or(value, key, bad)
        elif key == "documents":
            try:
                values["documents"] = tuple(int(n) for n in value.split(","))
            except ValueError:
                bad.append(f"documents={value}: comma-separated integers")
        else:
            bad.append(f"unknown key {key!r} (keys: {', '.join(sorted(_known_keys()))})")
    if bad:
        raise ValueError("fuzz case: " + "; ".join(bad))
    case = Case(**values)
    if case.data == "packed" and sum(case.documents) != SEQ_LENGTH:
        raise ValueError(f"fuzz case: documents={','.join(map(str, case.documents))} must sum to {SEQ_LENGTH}")
    return replace(case, refused=tuple(option_problems(case)))


def _int_or(value: str, key: str, bad: List[str]) -> Any:
    try:
        return int(value)
    except ValueError:
        bad.append(f"{key}={value}: off, auto or an integer")
        return value


def _known_keys() -> List[str]:
    return ["sp", "cp", "documents", *_INT_KEYS, *_CHOICE_KEYS, *_TILE_KEYS]


# ------------------------------------------------------------------------------------------------------ drawing
def option_problems(case: Case) -> List[str]:
    """What the option model refuses in this case (empty: accepted), plus the layout rules the fuzzer itself needs."""
    options = case.options()
    p = options.problems(case.context())
    if case.data == "packed":
        p += options.memory.packed_problems("data=packed")
    if case.model != "moe" and case.ep > 1:
        p.append(f"ep={case.ep} needs a MoE model (model=moe)")
    if case.vpp and case.pp < 2:
        p.append(f"vpp={case.vpp} needs pp >= 2")
    if case.cp == 1 and case.cp_algorithm != "ring":
        p.append(f"cp={case.cp_algorithm} needs cp.size > 1")
    return p


def draw_case(rng: random.Random, max_world: int, accept: Any = None) -> Case:
    """One case drawn uniformly over each dimension, its world at most ``max_world``; ``accept(case) -> bool``
    (an injected defect's reach) redraws until it holds."""
    for _ in range(10000):
        model = rng.choice(MODELS)
        tp = rng.choice((1, 2))
        cp = rng.choice((1, 2, 2, 4))
        algorithm = rng.choice(CP_ALGORITHMS) if cp > 1 else "ring"
        if algorithm == "hybrid" and cp < 4:
            algorithm = rng.choice(("ring", "ulysses"))
        pp = rng.choice((1, 1, 2))
        vpp = rng.choice((None, 2)) if pp > 1 else None
        ep = rng.choice((1, 2)) if model == "moe" else 1
        dp = rng.choice((1, 2))
        if tp * cp * pp * dp > max_world:
            continue
        recompute = rng.choice(RECOMPUTE_MODES)
        offload = rng.choice(PLANNED_OFFLOAD) if recompute in ("full", "full_keep_attn") else "none"
        data = rng.choice(DATA)
        case = Case(model=model, tp=tp, sp=tp > 1 and rng.random() < 0.5, cp=cp, cp_algorithm=algorithm,
                    ulysses_size=2 if algorithm == "hybrid" else None, pp=pp, vpp=vpp, ep=ep, dp=dp,
                    state=rng.choice(STATES), recompute=recompute, offload=offload,
                    sequence_chunks=rng.choice(("off", 2)) if recompute == "full" else "off",
                    mlp_tiles=rng.choice(("off", "off", 2)), loss_chunks=rng.choice(("off", "off", 2)), data=data,
                    documents=rng.choice(DOCUMENTS) if data == "packed" else (),
                    micro_batches=rng.choice((1, 2)) * (pp if vpp else 1))
        if accept is not None and not accept(case):
            continue
        return replace(case, refused=tuple(option_problems(case)))
    raise RuntimeError("no case could be drawn under these limits (max_world too small for the injected defect?)")


def draw_cases(seed: int, count: int, max_world: int, accept: Any = None) -> List[Case]:
    """``count`` cases drawn from ``seed`` (the same seed draws the same cases)."""
    rng = random.Random(seed)
    return [draw_case(rng, max_world, accept) for _ in range(count)]


# ---------------------------------------------------------------------------------------------- injected defects
# kind: (what it plants, which cases it can reach). ``nemo-longctx fuzz --inject KIND`` draws only cases it reaches
# and must then fail: the fuzzer's check that it sees that class of defect.
INJECTIONS = {
    "zigzag_slice": ("each CP rank gets a contiguous slice of the sequence where the attention expects the zigzag "
                     "one (chunks r and 2P-1-r)", lambda c: c.cp > 1 and c.data == "dense"),
    "loss_cp_scale": ("every CP rank's loss is multiplied by the CP size (the factor of Megatron's per-micro-batch "
                      "averaging applied to per-token sums)", lambda c: c.cp > 1),
    "window_dropped": ("the sliding window is dropped from nemo_longctx's core attention (full causal attention)",
                       lambda c: c.model == "window"),
    "dp_same_data": ("every data-parallel rank reads the first rank's sequences", lambda c: c.dp > 1),
    "cp_inactive": ("each CP rank's attention runs over itself only (the sequence sharded, the keys never "
                    "exchanged): the run guard must stop it", lambda c: c.cp > 1 and c.recompute != "full_keep_attn"),
}


def inject_accepts(kind: Optional[str]) -> Any:
    """The draw filter for an injected defect: cases it reaches that the option model accepts (None: every case)."""
    if kind is None:
        return None
    reaches = INJECTIONS[kind][1]
    return lambda c: reaches(c) and not option_problems(c)
