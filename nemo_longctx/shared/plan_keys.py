"""`nemo-longctx plan`'s own keys (``conf/plan.yaml`` and the ``plan`` group's GPU presets), declared with the option
model's one checker (``nemo_longctx.options.Option``), like the NeMo app's ``APP_OPTIONS``.

Standard library + the option model only: ``nemo-longctx plan --help`` (``nemo_longctx.apps.help``) reads these
without importing the plan app or the planner. ``nemo_longctx.apps.plan`` re-exports ``PLAN_OPTIONS`` and checks every
``plan.*`` value with ``plan_key_problems`` before planning: all problems at once, each naming its key and value.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, List, Mapping, Optional, Tuple

from nemo_longctx.options import (
    CP_ALGORITHMS,
    PLANNED_OFFLOAD,
    PLANNED_RECOMPUTE,
    Context,
    Option,
    layout_problems,
    unknown_keys,
)

SHARDINGS = ("ddp", "distributed", "fsdp")


@dataclass(frozen=True)
class ListOption(Option):
    """A non-empty list of numbers in [low, high] (kind ``numbers``) or of booleans (kind ``bools``): the planner's
    search lists that are not lists of names (names: kind ``modules``)."""

    def expectation(self) -> str:
        if self.kind == "bools":
            return "a non-empty list of true/false"
        bounds = f" in [{self.low:g}, {self.high:g}]" if self.low is not None and self.high is not None else ""
        return "a non-empty list of numbers" + bounds

    def problem(self, value: Any, ctx: Any = None):
        if self._valid(value):
            return None
        return f"{ctx.key(self.key) if ctx is not None else self.key}={value!r} must be {self.expectation()}"

    def _valid(self, v: Any) -> bool:
        if not isinstance(v, (list, tuple)) or not v:
            return False
        if self.kind == "bools":
            return all(isinstance(x, bool) for x in v)
        return all(not isinstance(x, bool) and isinstance(x, (int, float))
                   and (self.low is None or x >= self.low) and (self.high is None or x <= self.high) for x in v)

    def bad_values(self) -> List[Any]:
        return [None, [], "abc", ["abc"]] + ([[2.0]] if self.kind == "numbers" else [[1]])


PLAN_OPTIONS: Tuple[Option, ...] = (
    Option("plan.seq_length", "int", 1048576, "target sequence length (tokens)", low=2),
    Option("plan.gpus", "int", 8, "GPUs in the job (all used: dp = gpus / (tp x cp))", low=1),
    Option("plan.gpu_memory_gb", "number", 80, "memory per GPU, GiB (the plan group's GPU preset sets it)", above=0),
    Option("plan.gpus_per_node", "int", 8, "GPUs per node (TP and Ulysses stay inside a node)", low=1),
    Option("plan.reserve_gb", "number", 5, "per GPU: CUDA context, NCCL buffers, allocator fragmentation", low=0),
    Option("plan.host_memory_gb", "number", 1024, "host memory per node, GiB (offload destination)", low=0),
    Option("plan.host_reserve_gb", "number", 16, "per GPU process on the host: python, CUDA, NeMo, data loader",
           low=0),
    Option("plan.precision.activation_bytes", "int", 2, "bytes per activation element (2: bf16, 4: fp32)", low=1),
    Option("plan.precision.param_bytes", "int", 2, "bytes per weight (2: bf16 weights)", low=1),
    Option("plan.precision.grad_bytes", "int", 4, "bytes per main gradient (4: fp32 main grads)", low=1),
    Option("plan.precision.optimizer_bytes", "int", 12, "optimizer bytes per parameter (fp32 master + Adam m, v)",
           low=0),
    Option("plan.activation_model", "choice", "te_gpu", "activation coefficients: te_gpu (TE GPU layer) | "
           "local_cpu (Megatron's local spec, measured on CPU)", choices=("te_gpu", "local_cpu")),
    Option("plan.cost.gpu_tflops", "number", 989, "dense bf16 peak TFLOP/s per GPU", above=0),
    Option("plan.cost.mfu", "number", 0.45, "achieved fraction of peak for the compute estimate", above=0, high=1),
    Option("plan.cost.nvlink_gbps", "number", 300, "GB/s per GPU inside a node (collectives, P2P)", above=0),
    Option("plan.cost.network_gbps", "number", 40, "GB/s per GPU between nodes", above=0),
    Option("plan.cost.pcie_gbps", "number", 25, "GB/s per GPU host <-> device (offload copies)", above=0),
    Option("plan.cost.host_adam_gparams", "number", 1.0, "1e9 parameters/s per GPU process: host Adam step "
           "(optimizer offload)", above=0),
    Option("plan.search.algorithms", "modules", CP_ALGORITHMS, "CP algorithms searched", choices=CP_ALGORITHMS),
    Option("plan.search.recompute", "modules", ("none", "selective_mlp", "full", "full_keep_attn"),
           "recompute options searched (selective_mlp: recompute=selective recompute.modules=[mlp])",
           choices=tuple(PLANNED_RECOMPUTE)),
    Option("plan.search.offload", "modules", PLANNED_OFFLOAD, "activation offload options searched",
           choices=PLANNED_OFFLOAD),
    Option("plan.search.max_tp", "int", 8, "largest tensor-parallel size searched", low=1),
    Option("plan.search.sharding", "modules", SHARDINGS, "model-state layouts searched: ddp | distributed (ZeRO-1) | "
           "fsdp (Megatron-FSDP, ZeRO-3)", choices=SHARDINGS),
    ListOption("plan.search.optimizer_offload", "numbers", (0.0, 0.5, 1.0),
               "optimizer CPU offload fractions searched", low=0, high=1),
    ListOption("plan.search.precision_aware", "bools", (False, True), "precision-aware optimizer off / on searched"),
    Option("plan.checkpoints", "bool", True, "true: plan a run that saves checkpoints (what the train app refuses "
           "with saving on is not searched: Megatron-FSDP on the Bridge front end or at fp32); false: search those "
           "too, a chosen row that cannot save gets checkpoint.every_n_steps=0 in its command"),
    Option("plan.checkpoint_write_gb_s", "number", 2.0, "GB/s the job writes checkpoints at, all ranks together "
           "(the save-time estimate against run.signal_grace_s)", above=0),
    Option("plan.cost_tolerance", "number", 0.01, "fitting rows within this relative cost of the cheapest count as "
           "equal: least memory wins", low=0),
    Option("plan.show", "int", 0, "0: the chosen plan and its command in 100 columns; N > 0: the full table of the N "
           "best candidates (fitting ones first, then the closest misses), every memory column, and its legend",
           low=0),
    Option("plan.frontend", "choice", "nemo", "print `nemo-longctx train` (nemo) or `nemo-longctx bridge` (bridge) "
           "arguments", choices=("nemo", "bridge")),
    Option("plan.document_lengths", "str", None, "path: the document lengths of packed training data (a JSON list, or "
           "one int per line): the plan predicts what keeping short documents whole on one CP rank gains and adds "
           "cp.split_min_tokens=auto to the command when it pays", nullable=True),
    Option("plan.json", "bool", False, "print machine-readable JSON instead of the report"),
    Option("plan.json_candidates", "int", 50, "candidates in the JSON output", low=0),
    Option("plan.write_command", "str", None, "path: write the chosen plan's command on one line (for scripts)",
           nullable=True),
    Option("plan.write_sbatch", "str", None, "path: write an sbatch script (pyxis, NGC container) for the chosen "
           "plan", nullable=True),
    Option("plan.plot", "str", None, "path: PNG of predicted per-GPU memory vs sequence length", nullable=True),
    Option("plan.container_image", "str", "nvcr.io#nvidia/nemo:26.04", "sbatch container image (pyxis/enroot "
           "syntax: REGISTRY#IMAGE:TAG)"),
    Option("plan.bridge_container_image", "str", "nvcr.io#nvidia/nemo:26.08", "plan.frontend=bridge: the sbatch's "
           "Megatron-Bridge-era image"),
    Option("plan.target", "choice", "gpu", "gpu | cpu: cpu plans for CPU-only nodes (the app's CPU-only refusals "
           "apply) and writes the sbatch's CPU form", choices=("gpu", "cpu")),
)
# plan.* sub-mappings whose keys are all declared above (a misspelt `+plan.search.max_pt=4` is refused)
PLAN_GROUPS = ("plan", "plan.precision", "plan.cost", "plan.search")


def _flatten(node: Mapping[str, Any], prefix: str) -> dict:
    out = {}
    for k, v in node.items():
        key = f"{prefix}.{k}"
        out[key] = v
        if isinstance(v, Mapping):
            out.update(_flatten(v, key))
    return out


def plan_key_problems(plan: Mapping[str, Any], ctx: Optional[Context] = None) -> List[str]:
    """Every problem of the ``plan`` mapping (plain containers, as ``OmegaConf.to_container`` gives it): values
    against ``PLAN_OPTIONS`` and undeclared keys, each naming its key (in ``ctx``'s dialect: the caller's names of
    the plan keys, ``Context.keys``)."""
    if not isinstance(plan, Mapping):
        return [f"plan={plan!r} must be a mapping of the plan keys"]
    ctx = ctx or Context()
    flat = _flatten(plan, "plan")
    p = [m for o in PLAN_OPTIONS if o.key in flat for m in [o.problem(flat[o.key], ctx)] if m]
    declared = {o.key for o in PLAN_OPTIONS}
    for group in PLAN_GROUPS:
        node = plan if group == "plan" else flat.get(group)
        if not isinstance(node, Mapping):
            if group != "plan" and group in flat:
                p.append(f"{group}={node!r} must be a mapping")
            continue
        known = [k[len(group) + 1:] for k in declared if k.startswith(group + ".") and "." not in k[len(group) + 1:]]
        known += [g[len(group) + 1:] for g in PLAN_GROUPS if g.startswith(group + ".")]
        p += unknown_keys(group, {k: 0 for k in node}, known, ctx=ctx)
    seq_key = ctx.key("plan.seq_length")
    if not any(m.startswith(seq_key + "=") for m in p):  # the length every layout needs (train's own rule)
        p += layout_problems(flat.get("plan.seq_length"), 1, ctx=Context(keys={"seq_length": seq_key}))
    return p
