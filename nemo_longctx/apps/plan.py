"""`nemo-longctx plan`: pick CP / TP / recompute / offload / tiling for a long-context run before the first OOM.

    nemo-longctx plan model=llama3_8b plan.seq_length=1048576 plan.gpus=8 plan.gpu_memory_gb=80
    python -m nemo_longctx.apps.plan model=llama3_70b plan.seq_length=1048576 plan.gpus=64 plan.json=true

Composes conf/plan.yaml (the same `model` group as `nemo-longctx train`, plus the `plan` group for GPU presets),
evaluates every candidate with nemo_longctx.planner.search and prints the cheapest fitting one: its layout, memory,
what limits it, its caveats and the `nemo-longctx train` command that runs it, in 100 columns (``format_summary``).
`plan.show=N` (N > 0) prints instead the full table of the N best candidates (fitting ones by relative cost, then
the closest misses) with every memory column and its legend (``format_report``, ``format_legend``), and the command on
one line. `plan.write_command=PATH` writes the one-line command to a file, `plan.write_sbatch=PATH` an sbatch script
for it, `plan.plot=PATH` a PNG of predicted per-GPU memory vs sequence length, `plan.json=true` prints JSON only.
`plan.checkpoints=true` (the default) plans a run that saves checkpoints: what the train app refuses with saving
(Megatron-FSDP at fp32 or on the Bridge front end) is not searched, and the output says so once;
`plan.checkpoints=false` searches it too and a chosen row that cannot save gets `checkpoint.every_n_steps=0` in its
command and a caveat.
Exit status 2 (with what is missing) when nothing fits.
Nothing here imports NeMo or Megatron: planning takes a second.
"""

from __future__ import annotations

import functools
import itertools
import json
import os
import re
import shlex
import sys
import textwrap
import warnings
from pathlib import Path
from typing import Any, Dict, List, Optional, Tuple

from nemo_longctx.options import ConfigError, Context, raise_problems  # noqa: F401  (ConfigError: main's refusal)
from nemo_longctx.planner.model_shapes import shape_from_config
from nemo_longctx.planner.search import (  # noqa: F401  (RECOMPUTE_GROUP, option_model: the contract's names)
    CHECKPOINT_WRITE_GB_S,
    CP_ALGORITHMS,
    OFFLOAD,
    checkpoint_estimate,
    GIB,
    RECOMPUTE,
    RECOMPUTE_GROUP,
    ActivationCoefficients,
    CostModel,
    Evaluation,
    Hardware,
    ModelState,
    Plan,
    Precision,
    candidate_options,
    memory_curve,
    optim_fields,
    option_model,
    plan as make_plan,
    what_is_missing,
)
from nemo_longctx.shared.overrides import conf_dir  # noqa: F401  (plan.conf_dir: the Hydra tree, used by the apps)
from nemo_longctx.shared.overrides import is_demo_model
from nemo_longctx.shared.plan_keys import PLAN_OPTIONS, plan_key_problems  # noqa: F401  (PLAN_OPTIONS: plan's keys)
from nemo_longctx.shared.run_spec import PlanSpec, read_plan_spec
from nemo_longctx.shared.signals import DEFAULT_GRACE_S

# How a candidate maps onto `nemo-longctx train` overrides: the option model (nemo_longctx.options) emits the option
# groups' overrides (`LongContextOptions.to_overrides`); these are the train app's other keys the plan sets.
TRAIN_KEYS = {
    "seq_length": "model.seq_length",
    "tp": "trainer.strategy.tensor_model_parallel_size",
    "sequence_parallel": "trainer.strategy.sequence_parallel",
    "precision": "trainer.precision",
    "devices": "trainer.devices",
    "num_nodes": "trainer.num_nodes",
    "checkpointing": "checkpoint.every_n_steps",
}
def train_precision(precision: Precision) -> str:
    return "bf16-mixed" if precision.activation_bytes == 2 else "32"


# The train app's CPU-only model-state checks live in its Megatron validation module, whose import brings in torch
# (through nemo_longctx.attention). torch.cuda imports `pynvml`, and the deprecated `pynvml` package warns about itself
# on import: a note for whoever installed the environment, not for someone reading a plan. Only the CPU target needs
# these checks (the GPU target's plan imports no torch); that one warning is ignored where the import happens.
PYNVML_DEPRECATED = r"The pynvml package is deprecated"


def _model_state_cpu_problems():
    """``validation.model_state_cpu_problems``, imported without pynvml's deprecation warning."""
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message=PYNVML_DEPRECATED, category=FutureWarning)
        from nemo_longctx.integrations.megatron.validation import model_state_cpu_problems
    return model_state_cpu_problems


@functools.lru_cache(maxsize=None)
def app_problems(cp_algorithm: str, recompute: str, offload: str, ms: ModelState,
                 precision: str = "bf16-mixed", target: str = "gpu", checkpointing: bool = False,
                 frontend: str = "nemo") -> tuple:
    """The train app's own option checks (the option model's ``problems``, and on a CPU target the CPU-only
    refusals) for one option combination, on the planner's target: ``gpu`` = GPU nodes running the NGC NeMo image
    (CUDA and TransformerEngine present), ``cpu`` = CPU-only nodes without TransformerEngine. ``checkpointing``: the
    run saves checkpoints (what the options refuse then is refused too: ``plan.checkpoints``); ``frontend``
    (``plan.frontend``): nemo | bridge, whose refusals with saving differ (Megatron-FSDP saves on nemo only)."""
    gpu = target == "gpu"
    opts = option_model(cp_algorithm, recompute, offload, ms)
    out = opts.problems(Context(precision=precision, cuda=gpu, te=gpu, checkpointing=checkpointing,
                                fsdp_checkpoints=frontend == "nemo"))
    if not gpu:
        out += _model_state_cpu_problems()(opts.optim.state, force=True, checkpointing=checkpointing)
    return tuple(out)


def app_accepts(precision: str = "bf16-mixed", target: str = "gpu", checkpointing: bool = False,
                frontend: str = "nemo"):
    """``candidate_configs(accept=...)``: keep the option combinations the train app accepts on ``target``
    (``checkpointing``: in a run that saves checkpoints)."""
    if target not in ("gpu", "cpu"):
        raise ValueError(f"plan.target={target!r} must be gpu or cpu")
    return lambda algo, rc, off, ms: not app_problems(algo, rc, off, ms, precision, target, checkpointing, frontend)


# ------------------------------------------------------------------------------------------------- config
def checkpointing_of(spec: PlanSpec) -> bool:
    """``plan.checkpoints``: the planned run saves checkpoints (the default)."""
    return bool(spec.get("checkpoints", True))


def inputs_from_config(spec: PlanSpec, frontend: Optional[str] = None):
    """(shape, seq_length, Hardware, Precision, ActivationCoefficients, CostModel, search kwargs) from the plan spec
    (``read_plan_spec``; ``plan.checkpoints``: for a run that saves checkpoints, ``search_space``; ``frontend``: the
    front end whose refusals filter the search, default ``plan.frontend``; ``nemo_run`` for NeMo-Run recipes)."""
    p = spec.plan
    shape = shape_from_config(dict(spec.model.fields), name=spec.model_name)
    seq = p["seq_length"]
    if isinstance(seq, bool) or not isinstance(seq, int) or seq < 2:
        raise ValueError(f"plan.seq_length must be an integer >= 2, got {seq!r}")
    hw = Hardware(gpus=int(p["gpus"]), gpu_memory_gb=float(p["gpu_memory_gb"]),
                  host_memory_gb=float(p["host_memory_gb"]), gpus_per_node=int(p["gpus_per_node"]),
                  reserve_gb=float(p["reserve_gb"]), host_reserve_gb=float(p["host_reserve_gb"]))
    precision = Precision(**{k: int(v) for k, v in p["precision"].items()})
    coef = ActivationCoefficients.preset(str(p["activation_model"]))
    cost = CostModel(**{k: float(v) for k, v in p["cost"].items()})
    search = {k: tuple(v) if not isinstance(v, (int, float)) else v for k, v in p["search"].items()}
    search = search_space(search, precision, target=str(spec.get("target", "gpu")),
                          checkpointing=checkpointing_of(spec), frontend=frontend or str(spec.get("frontend", "nemo")))
    return shape, int(seq), hw, precision, coef, cost, search


def search_space(search: Dict[str, Any], precision: Precision, target: str = "gpu",
                 checkpointing: bool = False, frontend: str = "nemo") -> Dict[str, Any]:
    """``plan.search`` -> candidate_configs keywords: the model-state lists become ModelStates, and the train
    app's validation filters every option combination (``app_accepts``; ``checkpointing``: in a run that saves
    checkpoints, ``plan.checkpoints``)."""
    search = dict(search)
    sharding = tuple(search.pop("sharding", ("distributed",)))
    fractions = tuple(float(f) for f in search.pop("optimizer_offload", (0.0,)))
    pa = tuple(bool(x) for x in search.pop("precision_aware", (False,)))
    search["model_states"] = tuple(ModelState(sh, f, a) for sh, f, a in itertools.product(sharding, fractions, pa))
    search["accept"] = app_accepts(train_precision(precision), target, checkpointing, frontend)
    return search


STATE_NAMES = {"ddp": "Megatron DDP", "distributed": "the distributed optimizer", "fsdp": "Megatron-FSDP"}


def not_searched_for_saving(search: Dict[str, Any], precision: Precision, target: str = "gpu",
                            frontend: str = "nemo") -> List[str]:
    """What a run that saves checkpoints leaves out of ``search`` (``search_space``'s keywords): the model-state
    layouts the train app accepts without checkpoint saving and refuses with it, named as users know them (a layout
    refused with saving only in some option combinations: "some ... rows"). Megatron-FSDP on the Bridge front end
    and at fp32 in this version."""
    without, saving = (app_accepts(train_precision(precision), target, c, frontend) for c in (False, True))
    algorithms = ("none",) + tuple(a for a in search.get("algorithms", CP_ALGORITHMS) if a != "none")
    dropped, kept = set(), set()
    for algo, rc, off, ms in itertools.product(algorithms, search.get("recompute", RECOMPUTE),
                                               search.get("offload", OFFLOAD), search["model_states"]):
        if without(algo, rc, off, ms):
            (kept if saving(algo, rc, off, ms) else dropped).add(ms.sharding)
    order = sorted(dropped, key=list(STATE_NAMES).index)
    return [STATE_NAMES[s] if s not in kept else f"some {STATE_NAMES[s]} rows" for s in order]


def not_searched_line(names: List[str]) -> Optional[str]:
    """The one line that says what ``plan.checkpoints=true`` left out of the search and how to include it."""
    if not names:
        return None
    it = " and ".join(names)
    return (f"{it[0].upper() + it[1:]} not searched (plan.checkpoints=true: the train app refuses "
            f"{'it' if len(names) == 1 else 'them'} with checkpoint saving); plan.checkpoints=false searches "
            f"{'it' if len(names) == 1 else 'them'} too, for a run that saves no checkpoints")


# ------------------------------------------------------------------------------------------------- output
# `plan.frontend=bridge`: our model configs -> Megatron-Bridge's recipe functions (megatron.bridge.recipes, 0.6.2)
BRIDGE_RECIPES = {"llama3_8b": "llama3_8b_pretrain_config", "llama3_70b": "llama3_70b_pretrain_config",
                  "qwen3_32b": "qwen3_32b_pretrain_config", "qwen2_5_7b": "qwen25_7b_pretrain_config",
                  "deepseek_v2_lite": "deepseek_v2_lite_pretrain_config"}
FRONTENDS = ("nemo", "bridge")


def bridge_overrides(p: Plan, ev: Evaluation, model: str) -> List[str]:
    """`nemo-longctx bridge` arguments that run candidate `ev`: the Bridge recipe, Bridge's own keys for the layout
    and precision, and the option model's overrides (the same as for `nemo-longctx train`)."""
    recipe = BRIDGE_RECIPES.get(model)
    if recipe is None:
        raise ValueError(f"plan.frontend=bridge: model={model!r} has no Megatron-Bridge recipe here (known: "
                         f"{sorted(BRIDGE_RECIPES)}); use plan.frontend=nemo")
    c, hw = ev.candidate, p.hardware
    out = [f"recipe={recipe}", f"model.seq_length={p.seq_length}", f"model.tensor_model_parallel_size={c.tp}",
           f"model.sequence_parallel={'true' if c.tp > 1 else 'false'}", f"launcher.devices={hw.gpus_on_a_node}"]
    if p.precision.activation_bytes == 2:
        out.append("mixed_precision=bf16_mixed")
    return out + candidate_options(c).to_overrides()


def frontend_overrides(spec: PlanSpec, p: Plan, ev: Evaluation, model: str, saves: bool = True
                       ) -> Tuple[str, List[str]]:
    """(command, arguments) of the chosen front end (``plan.frontend``: nemo | bridge); ``saves``: the row can
    save checkpoints (``train_overrides``)."""
    frontend = str(spec.get("frontend", "nemo"))
    if frontend not in FRONTENDS:
        raise ValueError(f"plan.frontend={frontend!r} must be one of {list(FRONTENDS)}")
    if frontend == "bridge":
        return "nemo-longctx bridge", bridge_overrides(p, ev, model)
    return "nemo-longctx train", train_overrides(p, ev, model, saves)


def train_overrides(p: Plan, ev: Evaluation, model: str, saves: bool = True) -> List[str]:
    """`nemo-longctx train` overrides that run candidate `ev`: the app's keys (TRAIN_KEYS) and the option model's.
    ``saves=False`` (a row the app refuses with checkpoint saving, ``saving_problems``): saving turned off
    explicitly (``checkpoint.every_n_steps=0``), so that the app accepts it whatever its default interval."""
    c, hw, k = ev.candidate, p.hardware, TRAIN_KEYS
    out = [f"model={model}", f"{k['seq_length']}={p.seq_length}"]
    if c.tp > 1:  # the planner assumes Megatron sequence parallelism with TP
        out += [f"{k['tp']}={c.tp}", f"{k['sequence_parallel']}=true"]
    out += [f"{k['devices']}={hw.gpus_on_a_node}", f"{k['num_nodes']}={hw.nodes}"]
    if p.precision.activation_bytes == 2:
        out.append(f"{k['precision']}=bf16-mixed")
    return out + candidate_options(c).to_overrides() + ([] if saves else [f"{k['checkpointing']}=0"])


_COLUMNS = ("cp", "cp_size", "tp", "dp", "recompute", "offload", "tiles", "chunks", "state", "weights", "grads",
            "optim", "act", "trans", "comm", "total", "host/node", "cost", "fits")


def _row(ev: Evaluation) -> list:
    c, m = ev.candidate, ev.memory.gib()
    cp = c.cp_algorithm if c.cp_size > 1 else "none"
    if cp == "hybrid":
        cp = f"hybrid {c.ulysses_size}x{c.ring_size}"
    fits = "yes" if ev.fits else ("host" if ev.fits_gpu else "no")
    return [cp, c.cp_size, c.tp, ev.dp, c.recompute_label(), c.offload_label(), c.mlp_tiles, c.loss_chunks,
            c.model_state.label(),
            f"{m['weights']:.1f}", f"{m['grads']:.1f}", f"{m['optimizer']:.1f}", f"{m['activations']:.1f}",
            f"{m['transient']:.1f}", f"{m['comm']:.1f}", f"{m['total']:.1f}", f"{m['host_per_node']:.0f}",
            f"{ev.cost:.3f}", fits]


def format_table(evs: List[Evaluation]) -> str:
    rows = [list(_COLUMNS)] + [[str(x) for x in _row(e)] for e in evs]
    widths = [max(len(r[i]) for r in rows) for i in range(len(_COLUMNS))]
    lines = ["  ".join(v.rjust(w) for v, w in zip(r, widths)) for r in rows]
    lines.insert(1, "  ".join("-" * w for w in widths))
    return "\n".join(lines)


def format_report(p: Plan, model: str, show: int, note: Optional[str] = None) -> str:
    hw = p.hardware
    fitting = [e for e in p.evaluations if e.fits]
    head = (f"{model}: {p.shape.num_layers} layers, hidden {p.shape.hidden_size}, ffn {p.shape.ffn_hidden_size}, "
            f"heads {p.shape.num_attention_heads}/{p.shape.num_query_groups} kv, vocab {p.shape.vocab_size}, "
            f"{p.shape.parameters() / 1e9:.2f}B parameters\n"
            f"seq_length {p.seq_length} on {hw.gpus} GPU(s) x {hw.gpu_memory_gb:g} GiB "
            f"({hw.nodes} node(s) x {hw.gpus_on_a_node}, host {hw.host_memory_gb:g} GiB/node): "
            f"{len(fitting)} of {len(p.evaluations)} candidates fit\n"
            f"memory columns: GiB per GPU at the step's peak (act = saved activations on the device then, trans "
            f"= that phase's working set, comm = CP buffers; the peak is the head's or a layer's backward, "
            f"whichever is larger; total includes {hw.reserve_gb:g} GiB reserve); cost = step time relative to "
            f"ideal compute\n" + (f"{note}\n" if note else ""))
    shown = fitting[:show] + [e for e in p.evaluations if not e.fits][:max(0, show - len(fitting[:show]))][:5]
    return head + "\n" + format_table(shown)


# What every abbreviation of the table and of the `chosen:` line means (printed after them: `format_legend`).
LEGEND = (
    ("cp", "CP algorithm: ring (zigzag P2P ring attention) | ulysses (all-to-all over heads) | hybrid UxR (Ulysses "
           "over U ranks x ring over R) | none (no context parallelism); `cp=ALGO:N` in the chosen line"),
    ("cp_size", "context-parallel ranks the sequence is split over (cp.size)"),
    ("tp", "tensor-parallel size (with Megatron sequence parallelism when > 1)"),
    ("dp", "data-parallel size = GPUs / (tp x cp_size)"),
    ("recompute", "`rc=` in the chosen line: none | selective_mlp (recompute=selective recompute.modules=[mlp]) | "
                  "selective_attn (recompute.modules=[core_attn]) | full (full-layer recompute) | full_keep_attn "
                  "(full recompute keeping attention's output: no second attention/ring pass in backward); "
                  "/seqchunks=N: each layer runs in N sequence chunks (recompute.sequence_chunks=N); /layersK: K "
                  "layers per checkpoint (recompute.num_layers=K: one layer input in K kept, the others recomputed)"),
    ("offload", "`off=` in the chosen line: none | layer_input (each checkpointed layer input goes to host memory, "
                "prefetched back for backward); /depth0: fetched when its layer's backward starts "
                "(offload.prefetch_depth=0)"),
    ("tiles", "sequence tiles of every MLP per rank (tiling.mlp_tiles; 1 = off)"),
    ("chunks", "chunks of the output layer + cross entropy per rank (tiling.loss_chunks; 1 = off)"),
    ("state", "model-state layout (the optim group): ddp = Megatron DDP (every rank keeps weights, grads, optimizer) | "
              "distributed = distributed optimizer (ZeRO-1: fp32 master + Adam moments sharded over dp x cp) | "
              "fsdp = Megatron-FSDP (ZeRO-3: weights, grads and optimizer sharded)"),
    ("+optoffF", "optimizer CPU offload of fraction F of the (sharded) optimizer state: its Adam step runs on the "
                 "host (optoff0.5 = half, optoff1 = all; optim.optimizer_cpu_offload)"),
    ("+pa", "precision-aware optimizer (optim.use_precision_aware_optimizer): bf16 main grads, bf16 Adam moments on "
            "the device"),
    ("weights/grads/optim", "GiB per GPU of weights, main gradients, optimizer state on the device"),
    ("act", "GiB per GPU of saved activations on the device at the peak"),
    ("trans", "GiB per GPU of the peak phase's working set (not saved for backward)"),
    ("comm", "GiB per GPU of CP communication buffers at the peak"),
    ("total", "GiB per GPU at the peak, including the reserve"),
    ("host/node", "GiB of host memory per node: offloaded activations, host optimizer state, per-process reserve"),
    ("cost", "step time relative to ideal compute (lower is faster)"),
    ("fits", "yes | host (fits the GPU, not the host memory) | no"),
)
PEAK_PHASES = {"layers": "in a layer's backward", "head": "in the output layer + loss backward"}


def format_legend() -> str:
    width = max(len(k) for k, _ in LEGEND)
    return "legend:\n" + "\n".join(f"  {k.ljust(width)}  {v}" for k, v in LEGEND)


def _largest_part(ev: Evaluation) -> str:
    m = ev.memory.gib()
    names = {"weights": "weights", "grads": "grads", "optimizer": "optim", "activations": "act",
             "transient": "trans", "comm": "comm"}
    k = max(names, key=lambda n: m[n])
    return f"largest part: {names[k]} {m[k]:.1f} GiB"


def limited_by(p: Plan) -> List[str]:
    """What limits the chosen row (the cheaper candidates, and what they exceed) or, when nothing fits, what every
    candidate is over; then the chosen row's own use of device and host memory."""
    hw, chosen = p.hardware, p.chosen
    gpu, host = f"{hw.gpu_memory_gb:g} GiB per GPU", f"{hw.host_memory_gb:g} GiB host per node"
    pool = ([e for e in p.evaluations if not e.fits and e.cost < chosen.cost] if chosen is not None
            else list(p.evaluations))
    over_gpu = [e for e in pool if not e.fits_gpu]
    over_host = [e for e in pool if e.fits_gpu and not e.fits_host]
    parts = []
    if over_gpu:
        e = min(over_gpu, key=lambda e: (e.cost, e.memory.total) if chosen else (e.memory.total, e.cost))
        parts.append(f"device memory: {len(over_gpu)} {'cheaper ' if chosen else ''}candidate(s) need more than "
                     f"{gpu} ({'cheapest' if chosen else 'closest'}: {e.candidate.label()}, cost {e.cost:.3f}, "
                     f"{e.memory.total / GIB:.1f} GiB at the peak {PEAK_PHASES[e.memory.peak_phase]}, "
                     f"{_largest_part(e)})")
    if over_host:
        e = min(over_host, key=lambda e: (e.cost, e.memory.host_per_node) if chosen else (e.memory.host_per_node,))
        parts.append(f"host memory: {len(over_host)} {'cheaper ' if chosen else ''}candidate(s) fit the GPU but "
                     f"need more than {host} ({'cheapest' if chosen else 'closest'}: {e.candidate.label()}, "
                     f"cost {e.cost:.3f}, {e.memory.host_per_node / GIB:.0f} GiB)")
    if chosen is None:
        return ["limited by: nothing fits; " + ("; ".join(parts) if parts else "no valid parallel layout")]
    out = ["limited by: " + ("; ".join(parts) if parts else
                             f"nothing searched is cheaper (cost {chosen.cost:.3f}: compute and communication)")]
    device, host_use = chosen_usage(p)
    out.append(f"  chosen row: {device}, {host_use}")
    return out


def _base_context(precision: str, target: str, frontend: str):
    from nemo_longctx.options import Context as _Context
    from nemo_longctx.shared.app_keys import NEMO_KEYS

    gpu = target == "gpu"
    return _Context(precision=precision, cuda=gpu, te=gpu, keys=NEMO_KEYS if frontend == "nemo" else {},
                    fsdp_checkpoints=frontend == "nemo")


def saving_problems(ev: Evaluation, precision: str, target: str = "gpu", frontend: str = "nemo") -> List[str]:
    """The train app's refusals of row ``ev`` that appear only with checkpoint saving (the option model's; on a CPU
    target also the CPU-only ones): non-empty = the row cannot save checkpoints (only ``plan.checkpoints=false``
    searches it)."""
    from dataclasses import replace as _replace

    opts = candidate_options(ev.candidate)
    base = _base_context(precision, target, frontend)
    have = set(opts.problems(base))
    out = [m for m in opts.problems(_replace(base, checkpointing=True)) if m not in have]
    if target != "gpu":
        model_state_cpu_problems = _model_state_cpu_problems()
        plain = set(model_state_cpu_problems(opts.optim.state, force=True))
        out += [m for m in model_state_cpu_problems(opts.optim.state, force=True, checkpointing=True,
                                                    checkpoint_key=base.key("checkpointing")) if m not in plain]
    return out


def caveats(ev: Evaluation, precision: str, target: str = "gpu", frontend: str = "nemo") -> List[str]:
    """What the chosen row cannot do in the train app, from the app's own checks: saving checkpoints (the refusals
    that appear only with saving, ``saving_problems``: the command then turns saving off), running without
    TransformerEngine (GPU target); and what is not yet run on GPUs here."""
    from dataclasses import replace as _replace

    gpu = target == "gpu"
    opts = candidate_options(ev.candidate)
    base = _base_context(precision, target, frontend)
    have = set(opts.problems(base))
    out = []
    cannot = saving_problems(ev, precision, target, frontend)
    if cannot:
        sharding = ev.candidate.model_state.sharding
        why = (("Megatron-FSDP saves checkpoints at bf16-mixed only" if frontend == "nemo" else
                "Megatron-FSDP checkpoints are saved by nemo-longctx train only") if sharding == "fsdp" else
               "the distributed optimizer cannot save without TransformerEngine (CPU nodes)"
               if sharding == "distributed" and not gpu else "; ".join(cannot))
        how = (f"the command sets {TRAIN_KEYS['checkpointing']}=0" if frontend == "nemo"
               else "leave checkpoint.save unset")
        out.append(f"saves no checkpoints: {why}; a requeued job starts over ({how})")
    if gpu:
        out += [f"without TransformerEngine: {m}" for m in opts.problems(_replace(base, te=False))
                if m not in have]
    if ev.candidate.model_state.sharding == "fsdp" and gpu:
        out.append("Megatron-FSDP on GPUs is NeMo's own path, not yet run by this project (trained here on CPU over "
                   "gloo only: conf/optim/fsdp.yaml)")
    return out


def format_caveats(items: List[str], width: Optional[int] = None) -> str:
    """The caveats block: one ``  - `` item each (``width``: each wrapped to that many columns)."""
    none = "caveats: none (the train app's checks with checkpoint saving and without TransformerEngine pass)"
    if width is None:
        return none if not items else "caveats:\n" + "\n".join(f"  - {c}" for c in items)
    if not items:
        return "\n".join(wrap(none, width=width))
    return "\n".join(["caveats:"] + [line for c in items for line in wrap(c, first="  - ", indent="    ",
                                                                          width=width)])


# ------------------------------------------------------------------------------------------------- the short view
WIDTH = 100  # columns of the default view (plan.show=0)


def wrap(text: str, indent: str = "  ", first: str = "", width: int = WIDTH) -> List[str]:
    """``text`` in lines of at most ``width`` columns (``first`` before the first line, ``indent`` before the others);
    words are never split (a single word longer than the width keeps its line)."""
    return textwrap.wrap(text, width, initial_indent=first, subsequent_indent=indent, break_long_words=False,
                         break_on_hyphens=False) or [first.rstrip()]


def command_line(command: str, args: List[str]) -> str:
    """The command on one line, each argument shell-quoted (what ``plan.write_command`` writes)."""
    return " ".join([command] + [shlex.quote(a) for a in args])


def _group(arg: str) -> str:
    return re.split(r"[.=]", arg, maxsplit=1)[0]


def wrapped_command(command: str, args: List[str], width: int = WIDTH, indent: str = "  ") -> List[str]:
    """The command as lines a shell can paste (each but the last ends in `` \\``): the arguments of one option group
    (``model``, ``trainer``, ``cp``, ``optim``, ...) share a line, a new group starts a new line, and no line is wider
    than ``width`` unless one argument is. Joined again they are ``command_line(command, args)``."""
    lines: List[str] = []
    cur = command
    for n, (_, items) in enumerate(itertools.groupby(args, key=_group)):
        for k, arg in enumerate(items):
            word = shlex.quote(arg)
            if (n > 0 and k == 0) or len(cur) + 1 + len(word) + 2 > width:
                lines.append(cur)
                cur = indent + word
            else:
                cur += " " + word
    lines.append(cur)
    return [line + " \\" for line in lines[:-1]] + lines[-1:]


def chosen_usage(p: Plan) -> Tuple[str, str]:
    """(device, host): the chosen row's memory against the limits, as the short view and ``limited_by`` say it."""
    hw, m = p.hardware, p.chosen.memory
    return (f"{m.total / GIB:.1f} of {hw.gpu_memory_gb:g} GiB per GPU at the peak {PEAK_PHASES[m.peak_phase]} "
            f"({_largest_part(p.chosen)})", f"{m.host_per_node / GIB:.0f} of {hw.host_memory_gb:g} GiB host per node")


def format_summary(p: Plan, model: str, command: Optional[Tuple[str, List[str]]], caveat_items: List[str],
                   checkpoint_line: str, missing: Optional[str] = None, note: Optional[str] = None) -> str:
    """The default view (``plan.show=0``), no line wider than ``WIDTH``: the model and hardware, the chosen layout
    (its train options in short form), its memory per GPU and host per node, what limits it, its caveats, the
    checkpoint estimate and the command that runs it, wrapped so that a shell can paste it. Nothing fitting: what is
    over budget and what is missing. ``note``: what the search left out (``not_searched_line``), after the header."""
    hw, s = p.hardware, p.shape
    fitting = sum(1 for e in p.evaluations if e.fits)
    out = wrap(f"{model}: {s.num_layers} layers, hidden {s.hidden_size}, ffn {s.ffn_hidden_size}, heads "
               f"{s.num_attention_heads}/{s.num_query_groups} kv, vocab {s.vocab_size}, "
               f"{s.parameters() / 1e9:.2f}B parameters")
    out += wrap(f"seq_length {p.seq_length} on {hw.gpus} x {hw.gpu_memory_gb:g} GiB GPUs ({hw.nodes} "
                f"node{'s' if hw.nodes > 1 else ''} x {hw.gpus_on_a_node}, host {hw.host_memory_gb:g} GiB/node): "
                f"{fitting} of {len(p.evaluations)} candidates fit")
    if note:
        out += wrap(note)
    out.append("")
    limited = limited_by(p)[0]
    if p.chosen is not None:
        device, host = chosen_usage(p)
        out += wrap(p.chosen.candidate.label(), first="chosen: ")
        out += wrap(device, first="  ", indent="    ")
        out += wrap(f"{host}; relative cost {p.chosen.cost:.3f} (step time / ideal compute)", first="  ",
                    indent="    ")
        out += wrap(limited)
        out += format_caveats(caveat_items, width=WIDTH).splitlines()
        out += wrap(checkpoint_line)
        if command is not None:
            out.append("")
            out += wrapped_command(*command)
            if command[0].endswith("train") and not is_demo_model(model):
                out += wrap("add your data: data=indexed data.paths=[<dataset prefix>] data.tokenizer=<dir> (or "
                            "data=documents ...; data=synthetic for a throughput test). Learning rate, schedule, "
                            "steps, tokens per step and checkpoint interval are the model's NeMo recipe's.",
                            first="  ", indent="  ")
        out.append("")
        out += wrap("more: plan.show=N (full table, N rows + legend), plan.write_command=FILE (one line), "
                    "plan.json=true", indent="")
    else:
        out += wrap(limited)
        out += wrap(checkpoint_line)
        out.append("")
        out += wrap(f"no fitting plan: {missing}")
        out.append("")
        out += wrap("more: plan.show=N (full table of the N closest rows + legend), plan.json=true", indent="")
    return "\n".join(out)


def source_checkout() -> str:
    """The nemo_longctx checkout this module runs from ('' when installed from a wheel: no pyproject.toml)."""
    root = Path(__file__).resolve().parents[2]
    return str(root) if (root / "pyproject.toml").exists() else ""


def _comment(text: str, width: int = 118) -> str:
    """``text`` as shell comment lines of at most ``width`` + 2 columns ('#' alone for an empty paragraph)."""
    return "\n".join("# " + line for line in textwrap.wrap(text, width, break_on_hyphens=False)) if text else "#"


# The job's data: a Megatron indexed dataset and its tokenizer, or synthetic tokens for throughput tests (the front
# end's arguments for each; Bridge's recipe without data arguments trains on its mock data).
SBATCH_DATA = {
    "nemo": ('data=(data=synthetic)', 'data=(data=indexed "data.paths=[$DATA_PREFIX]" "data.tokenizer=$TOKENIZER")'),
    "bridge": ("data=()  # the recipe's mock data",
               'data=("dataset.data_path=$DATA_PREFIX" tokenizer.tokenizer_type=HuggingFaceTokenizer\n'
               '        "tokenizer.tokenizer_model=$TOKENIZER")'),
}
SBATCH_CHECKPOINTS = {"nemo": 'checkpoint.dir="$CHECKPOINT_DIR" checkpoint.resume=auto',
                      "bridge": 'checkpoint.save="$CHECKPOINT_DIR" checkpoint.load="$CHECKPOINT_DIR"'}


def write_sbatch(path: str, p: Plan, ev: Evaluation, model: str, container_image: str, target: str = "gpu",
                 source: Optional[str] = None, frontend: str = "nemo",
                 write_gb_s: float = CHECKPOINT_WRITE_GB_S, saves: bool = True) -> str:
    """A production sbatch script for the chosen candidate: it trains on a Megatron indexed dataset with its tokenizer
    (``DATA_PREFIX`` + ``TOKENIZER``; ``DATA=synthetic`` for throughput tests; neither: exit 2 naming both), saves
    checkpoints to ``CHECKPOINT_DIR`` on the shared filesystem and resumes from the newest one (``saves=False``: a row
    the train app refuses with saving, ``plan.checkpoints=false``: saving off, said in the header), requeues itself
    after a preemption save (USR1/TERM forwarded to the ranks), and appends ``EXTRA_OVERRIDES``. It runs in the stock
    NGC NeMo image through pyxis (NeMo, Megatron-core and torch come from the image; the data, tokenizer, output and
    checkpoint directories are mounted); the job installs nemo_longctx at start with ``pip install --no-deps`` from a
    checkout visible on the nodes (``NEMO_LONGCTX_SRC``, default: the one that wrote the script) or a wheel
    (``NEMO_LONGCTX_WHEEL``), into ``$OUTPUT_DIR/.nemo_longctx_site``, then runs that install's ``nemo-longctx
    train``. ``IMAGE=`` (empty) runs the same lines without a container. Steps, batch size, learning-rate schedule and
    checkpoint interval are not set: the app's defaults for the model (NeMo's recipe for a real one).
    ``frontend="bridge"``: the same job running ``nemo-longctx bridge`` with the candidate's Bridge arguments
    (``bridge_overrides``) in a Megatron-Bridge-era image (``container_image`` is then that image).
    ``target="cpu"``: the same script without GPUs and without a container by default (``IMAGE=``), training on the
    nodes' CPUs with gloo (how tests/test_slurm_e2e.py runs it on a local Slurm). ``saves=False``: a row that cannot
    save checkpoints (``train_overrides``: saving turned off; a requeued job starts over)."""
    if target not in ("gpu", "cpu"):
        raise ValueError(f"plan.target={target!r} must be gpu or cpu")
    if frontend not in FRONTENDS:
        raise ValueError(f"plan.frontend={frontend!r} must be one of {list(FRONTENDS)}")
    hw = p.hardware
    cpu = target == "cpu"
    bridge = frontend == "bridge"
    if bridge:  # without CUDA the Bridge app itself switches to its CPU settings (fp32, gloo)
        command, ovs, stack = "bridge", bridge_overrides(p, ev, model), "Megatron-Bridge"
    else:
        command, stack = "train", "NeMo 2 and Megatron-core"
        ovs = train_overrides(p, ev, model, saves) + (["trainer.accelerator=cpu", "launcher.backend=gloo"] if cpu
                                                      else [])
    overrides = " \\\n    ".join(shlex.quote(o) for o in ovs)
    synthetic, indexed = SBATCH_DATA[frontend]
    name = Path(path).name
    hf_mount = '\n  add_mount "${HF_HOME:-}"' if bridge else ""
    hf_doc = "" if not bridge else (
        "\n#   HF_TOKEN, HF_HOME   the Bridge recipe reads the model's config.json from the Hugging Face hub (or "
        "from HF_HOME's\n#                       cache with HF_HUB_OFFLINE=1; no weights are read)")
    src = source_checkout() if source is None else source
    gpu_lines = "" if cpu else (f"#SBATCH --gpus-per-node={hw.gpus_on_a_node}\n#SBATCH --exclusive\n")
    # the signal's lead time: the default grace, or twice the planner's save estimate when that is longer
    grace = int(max(DEFAULT_GRACE_S, 2 * checkpoint_estimate(p.shape, p.precision, write_gb_s)["save_s"]))
    image = "" if cpu else container_image
    image_kind = "a Megatron-Bridge-era NGC NeMo image" if bridge else "the stock NGC NeMo image"
    bridge_doc = "\n# (the torchrun-style variables Bridge's torch.distributed env:// set-up reads)" if bridge else ""
    if bridge:
        extra = "more arguments, space separated: ours or Bridge's KEY=VALUE (e.g. train.train_iters=5000)"
        defaults = "NVIDIA's Bridge recipe for the model"
        synthetic_doc = "synthetic: the recipe's mock data instead (throughput tests)"
    else:
        extra = 'more Hydra overrides, space separated (e.g. "trainer.max_steps=5000")'
        defaults = ("the train app's defaults for the model (NVIDIA NeMo's recipe for a real model; the tiny_* demo "
                    "models save checkpoints only with checkpoint.every_n_steps=N)")
        synthetic_doc = "synthetic: synthetic tokens instead (throughput tests)"
    about = [f"Chosen: {ev.candidate.label()} (predicted {ev.memory.total / GIB:.1f} GiB per GPU, relative cost "
             f"{ev.cost:.3f})."]
    if not saves:
        about.append("This plan saves no checkpoints (plan.checkpoints=false chose a model-state layout the train app "
                     "refuses with saving): a preempted or requeued job starts over.")
    about.append("")
    about.append("Trains on a Megatron indexed dataset, saves checkpoints to CHECKPOINT_DIR and resumes from the "
                 "newest one there, so a preempted or requeued job continues where it stopped. Steps, batch size, "
                 f"learning-rate schedule and checkpoint interval are {defaults}; change them in EXTRA_OVERRIDES. "
                 f"Runs in {image_kind} (pyxis); nemo_longctx is installed by the job itself, with --no-deps.")
    header = "\n".join(_comment(par) for par in about)
    text = f"""#!/bin/bash
# Generated by `nemo-longctx plan` for {model} at seq_length={p.seq_length} on {hw.gpus} \
{'CPU process(es)' if cpu else 'GPU(s)'}.
{header}
#
#   DATA_PREFIX=/data/corpus_text_document TOKENIZER=/models/tokenizer sbatch {name}
#   DATA=synthetic sbatch {name}
#
# Environment knobs:
#   DATA_PREFIX         Megatron indexed dataset prefix (its .bin/.idx files), with
#   TOKENIZER           the local Hugging Face tokenizer directory it was made with (both required unless DATA is set)
#   DATA                {synthetic_doc}
#   OUTPUT_DIR          run directory on a shared filesystem (default: ./runs/<job id>; a requeued job keeps its id)
#   CHECKPOINT_DIR      checkpoints (default: $OUTPUT_DIR/checkpoints); a new job given the same one resumes from it
#   EXTRA_OVERRIDES     {extra}
#   IMAGE               container image (pyxis/enroot syntax); empty: no container, the nodes' own python
#   NEMO_LONGCTX_SRC    a nemo_longctx checkout visible on the nodes (mounted into the container)
#   NEMO_LONGCTX_WHEEL  or a built wheel (pip wheel --no-deps <checkout>), used instead of the checkout
#   PYTHON              python with {stack} (default: python, the image's){hf_doc}
#SBATCH --job-name=nemo-longctx-{model}
#SBATCH --nodes={hw.nodes}
#SBATCH --ntasks-per-node={hw.gpus_on_a_node}
{gpu_lines}#SBATCH --time=04:00:00
#SBATCH --output=%x-%j.out
#SBATCH --open-mode=append
#SBATCH --requeue
#SBATCH --signal=B:USR1@{grace}
# Preemption: USR1 (Slurm, {grace} s before the time limit; or scancel --signal=USR1 --batch) and TERM go to srun, which
# signals every rank; the ranks save their step (when the run saves checkpoints) and exit 75, and the job
# requeues itself to resume from it (docs/how-to/preemption.md).
set -euo pipefail

IMAGE=${{IMAGE-{image}}}
NEMO_LONGCTX_SRC=${{NEMO_LONGCTX_SRC:-{src}}}
NEMO_LONGCTX_WHEEL=${{NEMO_LONGCTX_WHEEL:-}}
PYTHON=${{PYTHON:-python}}
OUTPUT_DIR=${{OUTPUT_DIR:-$PWD/runs/$SLURM_JOB_ID}}
CHECKPOINT_DIR=${{CHECKPOINT_DIR:-$OUTPUT_DIR/checkpoints}}
SITE="$OUTPUT_DIR/.nemo_longctx_site"
read -r -a extra_overrides <<<"${{EXTRA_OVERRIDES:-}}"

if [ "${{DATA:-}}" = synthetic ] && [ -z "${{DATA_PREFIX:-}}" ]; then
  {synthetic}
elif [ -z "${{DATA:-}}" ] && [ -n "${{DATA_PREFIX:-}}" ] && [ -n "${{TOKENIZER:-}}" ]; then
  {indexed}
else
  echo "set DATA_PREFIX (a Megatron indexed dataset prefix) and TOKENIZER (its Hugging Face tokenizer directory)," \\
    "or DATA=synthetic for a throughput test on synthetic tokens (DATA=${{DATA:-}} DATA_PREFIX=${{DATA_PREFIX:-}}" \\
    "TOKENIZER=${{TOKENIZER:-}})" >&2
  exit 2
fi
mkdir -p "$OUTPUT_DIR" "$CHECKPOINT_DIR"
MASTER_ADDR=$(scontrol show hostnames "$SLURM_JOB_NODELIST" | head -n 1)
export MASTER_ADDR
export MASTER_PORT=${{MASTER_PORT:-29500}}

package=${{NEMO_LONGCTX_WHEEL:-$NEMO_LONGCTX_SRC}}
if [ -z "$package" ] || [ ! -e "$package" ]; then
  echo "nemo_longctx to install not found: set NEMO_LONGCTX_SRC (a checkout) or NEMO_LONGCTX_WHEEL (a wheel)" >&2
  exit 2
fi
container=()
if [ -n "$IMAGE" ]; then
  # the container sees these directories at their own paths: the submit directory, the run and checkpoint
  # directories, the plugin to install, the data and the tokenizer
  mounted=()
  add_mount() {{  # mount directory $1 unless empty or inside one already mounted
    local dir m
    [ -n "$1" ] || return 0
    dir=$(realpath -m "$1")
    for m in "${{mounted[@]}}"; do case "$dir/" in "$m"/*) return 0 ;; esac; done
    mounted+=("$dir")
  }}
  add_mount "$PWD"
  add_mount "$OUTPUT_DIR"
  add_mount "$CHECKPOINT_DIR"
  add_mount "$(dirname "$(realpath "$package")")"
  if [ -n "${{DATA_PREFIX:-}}" ]; then add_mount "$(dirname "$DATA_PREFIX")"; fi
  if [ -d "${{TOKENIZER:-}}" ]; then add_mount "$TOKENIZER"; fi{hf_mount}
  mounts=$(for m in "${{mounted[@]}}"; do printf '%s:%s,' "$m" "$m"; done)
  container=(--container-image="$IMAGE" --container-mounts="${{mounts%,}}" --container-workdir="$PWD"
             --no-container-mount-home)
fi

# 1. install the plugin into the shared run directory (again on a requeue: the checkout may have changed); its
# dependencies are the image's
srun --nodes=1 --ntasks=1 "${{container[@]}}" "$PYTHON" -m pip install --no-deps --no-build-isolation --upgrade \\
  --no-input --disable-pip-version-check --quiet --target "$SITE" "$package"

srun --nodes=1 --ntasks=1 "${{container[@]}}" env PYTHONPATH="$SITE${{PYTHONPATH:+:$PYTHONPATH}}" "$PYTHON" -c \\
  "import nemo_longctx, sys; print('nemo_longctx', nemo_longctx.__version__, 'from', nemo_longctx.__file__, \
'python', sys.version.split()[0])"

# 2. one task per GPU; the app reads RANK/WORLD_SIZE/LOCAL_RANK from SLURM_PROCID/SLURM_NTASKS/SLURM_LOCALID{bridge_doc}
echo "job ${{SLURM_JOB_ID:-?}} (restart ${{SLURM_RESTART_COUNT:-0}}): ${{SLURM_NTASKS:-?}} tasks -> $OUTPUT_DIR," \\
  "checkpoints $CHECKPOINT_DIR"
srun --kill-on-bad-exit=1 "${{container[@]}}" \\
  env PYTHONPATH="$SITE${{PYTHONPATH:+:$PYTHONPATH}}" "$SITE/bin/nemo-longctx" {command} \\
    {overrides} \\
    "${{data[@]}}" {SBATCH_CHECKPOINTS[frontend]} \\
    output_dir="$OUTPUT_DIR" "${{extra_overrides[@]}}" &
srun_pid=$!
# shellcheck disable=SC2317  # called from the traps below
forward() {{ kill -s "$1" "$srun_pid" 2>/dev/null || true; }}
trap 'forward USR1' USR1
trap 'forward TERM' TERM
rc=0
wait "$srun_pid" || rc=$?
while kill -0 "$srun_pid" 2>/dev/null; do  # a trapped signal ended `wait` early: wait for srun itself
  rc=0
  wait "$srun_pid" || rc=$?
done
if [ "$rc" -eq 75 ]; then
  echo "job $SLURM_JOB_ID: preempted, checkpoint saved: requeueing it to resume"
  scontrol requeue "$SLURM_JOB_ID"
fi
exit "$rc"
"""
    Path(path).parent.mkdir(parents=True, exist_ok=True)
    Path(path).write_text(text)
    os.chmod(path, 0o755)
    return text


def plot_memory(path: str, p: Plan, ev: Evaluation, model: str) -> Tuple[float, float, float]:
    """PNG: predicted per-GPU memory (stacked by component) vs sequence length for the chosen candidate, with the GPU
    memory limit as a labelled line below the top of the axes. Returns (y low, y high, the tallest stack), GiB."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    c = ev.candidate
    step = 2 * c.cp_size
    seqs = sorted({max(step, (int(p.seq_length * 2.0 ** e) // step) * step) for e in range(-6, 3)})
    curve = memory_curve(p.shape, seqs, p.hardware, c, p.precision, None)
    parts = ["weights", "grads", "optimizer", "activations", "transient", "comm", "reserve"]
    limit = p.hardware.gpu_memory_gb
    tallest = max(sum(row[k] for k in parts) for row in curve)
    fig, ax = plt.subplots(figsize=(9, 5))
    ax.stackplot(seqs, *[[row[k] for row in curve] for k in parts], labels=parts, alpha=0.85)
    ax.axhline(limit, color="red", linestyle="--", linewidth=1.5, label=f"GPU limit {limit:g} GiB", zorder=5)
    ax.axvline(p.seq_length, color="black", linestyle=":", label=f"planned {p.seq_length}")
    ax.set_xscale("log", base=2)
    ax.set_xlim(seqs[0], seqs[-1])
    ax.set_ylim(0, 1.1 * max(limit, tallest))  # headroom: the limit line is inside the axes, not on their edge
    ax.annotate(f"GPU limit {limit:g} GiB", xy=(0.01, limit), xycoords=("axes fraction", "data"),
                xytext=(0, 3), textcoords="offset points", color="red", fontsize=8, va="bottom", zorder=6)
    ax.set_xlabel("sequence length (tokens)")
    ax.set_ylabel("predicted memory per GPU (GiB)")
    ax.set_title(f"{model}: {c.label()}", fontsize=9)
    ax.legend(fontsize=7, loc="upper left", bbox_to_anchor=(1.01, 1.0), borderaxespad=0)  # beside the axes
    fig.tight_layout()
    Path(path).parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=110)
    low, high = ax.get_ylim()
    plt.close(fig)
    return float(low), float(high), float(tallest)


# ------------------------------------------------------------------------------------------------- app
def key_problems(spec: PlanSpec, ctx: Optional[Context] = None) -> List[str]:
    """Every problem of the ``plan.*`` values (``PLAN_OPTIONS``), each naming its key and value (in ``ctx``'s
    dialect: how the caller names the plan's keys)."""
    if spec.problems:
        return list(spec.problems)
    problems = plan_key_problems(spec.plan, ctx)
    return problems or output_path_problems(spec.plan)


OUTPUT_KEYS = ("write_command", "write_sbatch", "plot")  # the plan.* keys naming a file the app writes


def output_path_problems(plan_node: Dict[str, Any]) -> List[str]:
    """A file ``plan.write_command`` / ``write_sbatch`` / ``plot`` cannot be written to (a directory, or a directory
    that cannot be made or written in), each naming its key: found before planning, not as a traceback after it."""
    from nemo_longctx.shared.path_checks import writable_dir_problem

    out = []
    for key in OUTPUT_KEYS:
        value = plan_node.get(key)
        if not value:
            continue
        path = Path(os.path.abspath(os.path.expanduser(str(value))))
        if path.is_dir():
            out.append(f"plan.{key}={value}: is a directory, not a file")
            continue
        why = writable_dir_problem("directory", str(path.parent))
        if why:
            out.append(f"plan.{key}={value}: its {why.replace('=', ' ', 1)}")
    return out


def document_prediction(spec: PlanSpec, p: Plan, ev: Evaluation, frontend: str,
                        c: CostModel) -> Optional[Dict[str, Any]]:
    """``plan.document_lengths``: the chosen row's predicted gain from keeping short documents whole on one CP rank
    (``planner.documents.predict_gain`` over the lengths packed into sequences of the plan's length, the cost model of
    the model's shape on this hardware); None without the key. ``add``: the command gets
    ``cp.split_min_tokens=auto`` (CP > 1, a predicted gain of at least 1 %)."""
    path = spec.get("document_lengths", None)
    if not path:
        return None
    from nemo_longctx.planner.documents import cost_model_for, pack_documents, predict_gain, read_document_lengths

    lengths = read_document_lengths(os.path.expanduser(str(path)))
    seqs = pack_documents(lengths, p.seq_length)
    cp = ev.candidate.cp_size
    out: Dict[str, Any] = {"documents": len(lengths), "sequences": len(seqs), "cp_size": cp, "add": False}
    if not seqs:
        out["line"] = (f"plan.document_lengths: {len(lengths)} documents fill no sequence of {p.seq_length} tokens: "
                       "no prediction")
        return out
    if cp == 1:
        out["line"] = "plan.document_lengths: the chosen plan has no context parallelism: every document stays whole"
        return out
    s = p.shape
    link = c.nvlink_gbps if cp <= p.hardware.gpus_per_node else c.network_gbps
    model = cost_model_for(s.hidden_size, s.num_attention_heads, s.num_query_groups, s.head_dim, s.ffn_hidden_size,
                           gated=s.gated_mlp, device_flops=c.gpu_tflops * 1e12 * c.mfu,
                           link_bytes_per_s=link * 1e9)
    gain = predict_gain(seqs, cp, "auto", model)
    out.update(speedup=gain.speedup, perfect_speedup=gain.perfect_speedup, zigzag_balance=gain.zigzag_balance,
               documents_balance=gain.documents_balance)
    out["add"] = gain.speedup >= 1.01
    packed_by = "data.packing=documents" if frontend == "bridge" else "data.packing=documents or data=packed_sft"
    verdict = (f"added cp.split_min_tokens=auto (for packed documents: {packed_by})" if out["add"] else
               "not worth it: every document split")
    out["line"] = (f"packed documents ({len(lengths)} documents in {len(seqs)} sequences of {p.seq_length}): keeping "
                   f"short ones whole on one of the {cp} CP ranks predicts {gain.speedup:.2f}x the layer time's "
                   f"speed (perfect balance {gain.perfect_speedup:.2f}x; balance {gain.zigzag_balance:.3f} -> "
                   f"{gain.documents_balance:.3f}): {verdict}")
    return out


def run(spec: PlanSpec, out=sys.stdout) -> int:
    raise_problems(key_problems(spec))  # ConfigError: every bad plan.* value at once (main: exit 2)
    if spec.get("document_lengths", None):  # a bad file is refused before planning
        from nemo_longctx.planner.documents import read_document_lengths

        try:
            read_document_lengths(os.path.expanduser(str(spec.get("document_lengths"))))
        except (OSError, ValueError) as e:
            raise ConfigError([f"plan.document_lengths: {e}"]) from None
    shape, seq, hw, precision, coef, cost, search = inputs_from_config(spec)
    name = spec.model_name
    target, frontend = str(spec.get("target", "gpu")), str(spec.get("frontend", "nemo"))
    # plan.checkpoints=true: what the app refuses with saving is out of the search, said once
    left_out = not_searched_for_saving(search, precision, target, frontend) if checkpointing_of(spec) else []
    note = not_searched_line(left_out)
    write_gb_s = float(spec.get("checkpoint_write_gb_s", CHECKPOINT_WRITE_GB_S))
    p = make_plan(shape, seq, hw, precision, coef, cost, float(spec.get("cost_tolerance", 0.01)), **search)
    chosen = p.chosen
    missing = None if chosen else what_is_missing(p, coef, cost)
    as_json, show = bool(spec.get("json", False)), int(spec.get("show", 0))
    # plan.checkpoints=false may choose a row that cannot save: its command turns saving off
    saves = not (chosen and saving_problems(chosen, train_precision(p.precision), target, frontend))
    command = frontend_overrides(spec, p, chosen, name, saves) if chosen else None  # (train or bridge, arguments)
    try:
        documents = document_prediction(spec, p, chosen, frontend, cost) if chosen else None
    except (OSError, ValueError) as e:
        raise ConfigError([f"plan.document_lengths: {e}"]) from None
    if documents is not None and documents["add"]:
        command = (command[0], command[1] + ["cp.split_min_tokens=auto"])
    items = caveats(chosen, train_precision(p.precision), target, frontend) if chosen else None
    estimate = checkpoint_estimate(shape, precision, write_gb_s)
    if as_json:
        d = p.to_dict()
        d["model_name"] = name
        d["overrides"] = command[1] if command else None
        d["missing"] = missing
        d["limited_by"] = limited_by(p)
        d["caveats"] = items
        d["checkpoint"] = estimate
        d["checkpoints"] = checkpointing_of(spec)
        d["not_searched"] = left_out
        d["documents"] = documents
        d["candidates"] = d["candidates"][: int(spec.get("json_candidates", 50))]
        print(json.dumps(d, indent=1), file=out)
    else:
        items, ckpt_line = items or [], estimate["line"]
        if show == 0:  # the short view, 100 columns
            print(format_summary(p, name, command, items, ckpt_line, missing, note), file=out, flush=True)
        else:  # the full table of `show` rows, the one-line command, the legend
            print(format_report(p, name, show, note), file=out)
            if chosen:
                print(f"\nchosen: {chosen.candidate.label()}  ({chosen.memory.total / GIB:.1f} GiB per GPU, "
                      f"{chosen.memory.host_per_node / GIB:.0f} GiB host per node, relative cost {chosen.cost:.3f})",
                      file=out)
                print(command_line(*command), file=out, flush=True)
            print("\n" + format_legend(), file=out)
            print("\n".join(limited_by(p)), file=out)
            if chosen:
                print(format_caveats(items), file=out, flush=True)
            print(ckpt_line, file=out, flush=True)
        if documents is not None:
            print("\n".join(wrap(documents["line"], indent="  ")), file=out, flush=True)
    if chosen is None:
        if as_json:
            print(f"\nno fitting plan: {missing}", file=sys.stderr)
        elif show > 0:  # (the short view says it itself)
            print(f"\nno fitting plan: {missing}", file=out)
        return 2
    write_command = spec.get("write_command", None)
    if write_command:
        Path(str(write_command)).parent.mkdir(parents=True, exist_ok=True)
        Path(str(write_command)).write_text(command_line(*command) + "\n")
        print(f"wrote {write_command}", file=sys.stderr)
    sbatch = spec.get("write_sbatch", None)
    if sbatch:
        image = spec.get("bridge_container_image" if frontend == "bridge" else "container_image", "")
        write_sbatch(str(sbatch), p, chosen, name, str(image), target=target, write_gb_s=write_gb_s,
                     frontend=frontend, saves=saves)
        print(f"wrote {sbatch}", file=sys.stderr)
    plot = spec.get("plot", None)
    if plot:
        plot_memory(str(plot), p, chosen, name)
        print(f"wrote {plot}", file=sys.stderr)
    return 0


def main(argv: Optional[List[str]] = None) -> None:
    """Console entry (`nemo-longctx plan ...` / `python -m nemo_longctx.apps.plan ...`): Hydra overrides in argv."""
    from nemo_longctx.apps.help import maybe_print_help

    maybe_print_help("plan", sys.argv[1:] if argv is None else argv)  # -h/--help: plan's keys, exit 0
    import hydra

    if argv is not None:
        sys.argv = [sys.argv[0]] + list(argv)
    status = {"rc": 0}

    @hydra.main(config_path=conf_dir(), config_name="plan", version_base=None)
    def _app(cfg) -> None:
        try:
            status["rc"] = run(read_plan_spec(cfg))  # the composed config read once
        except ValueError as e:
            print(f"nemo-longctx plan: {e}", file=sys.stderr)
            status["rc"] = 2

    _app()
    sys.exit(status["rc"])


if __name__ == "__main__":
    main()
