"""Long-context planner: per-GPU memory and a relative step-cost model for every candidate configuration.

Pure python. Units: bytes internally, GiB (2**30) in reports; `gpu_memory_gb`/`host_memory_gb` are GiB.

Parallel layout: N GPUs = tp x cp x dp (pipeline parallel = 1), tp and Ulysses inside a node, Megatron's sequence
parallelism on whenever tp > 1 (so every activation below is divided by tp), micro batch = 1 sequence of
`seq_length` tokens per data-parallel replica, zigzag CP sharding (each GPU holds seq_length / cp tokens).

Per-GPU memory of one candidate (`MemoryBreakdown`); model states by `ModelState` (`model_state_bytes`), with
S = dp * cp the data-parallel-with-CP group that the distributed optimizer and Megatron-FSDP shard over:
  weights     = param_bytes * P / tp                           (bf16 weights, vocab-parallel embedding/output)
                fsdp: param_bytes * (P / S + 2 layers + non-layer params) / tp   (shard + all-gathered units)
  grads       = grad_bytes * P / tp                            (DDP main grads: fp32, bf16 when precision-aware)
                fsdp: grad_bytes * (P / S + 2 layers + non-layer params) / tp    (shard + reduce-scatter units)
  optimizer   = (master 4 + moments 8) * P / (tp * S)          (distributed optimizer / fsdp; ddp: not / S)
                fp32 weights (param_bytes 4): master 0 (the weights are the master; Megatron makes no copy)
                precision-aware: moments 2 + 2 (bf16); optimizer offload fraction f (HybridDeviceOptimizer):
                the host holds f of (fp32 master + fp32 grad copy + fp32 moments) = 16 bytes per parameter; the
                device keeps the distributed optimizer's fp32 master shard of the offloaded part (4 bytes), except
                with the precision-aware optimizer, where the master lives only on the host (its device part,
                0 < f < 1, steps fp32 copies of the bf16 shards with fp32 copies of their bf16 grads: + 4 bytes;
                without offload TE >= 2.1 keeps the fp32 master as a 2-byte remainder). Megatron moves whole
                (pieces of) parameter tensors until at least f of the shard is on the host: the device part is
                counted at f (the most that stays), the host part, for 0 < f < 1, at f + one largest parameter
                tensor (the most that moves)
                not counted: Megatron DDP's buffer padding under the distributed optimizer (each parameter starts
                on a multiple of 64 elements, each bucket ends on one of lcm(S, 128)): < 64 elements per tensor
                plus one alignment per bucket; tests/test_planner_model_state_bytes.py measures every term
  activations, transient, comm: the step's predicted activation peak (`predicted_peak_bytes`) is the larger of
                two phases of backward (`_peak_phase`), calibrated with the saved bytes against the tracker on CPU
                (tests/test_planner_calibration.py):
                head:   tokens * (L_dev * layer_saved + head_saved) + the loss head's working set
                layers: tokens * L_dev * layer_saved + max(recomputed layer, recomputed/tiled MLP, attention)
                        (the head's saved tensors are freed once its backward ran)
                with L_dev = L, or under layer-input offload the layer in backward + those prefetched (none in the
                head's backward: the last layer's input is fetched once its output's gradient exists);
                sequence-chunked layers (recompute.sequence_chunks=N): the recomputed layer's set is one chunk's
                (1/N) plus the K/V buffers and their fp32 gradients over the whole local sequence, plus the layer's
                parameter gradients summed over the chunks (fp32); under ring CP one chunk's set is at least the
                ring's K/V and fp32 dK/dV buffers of the whole local sequence (each chunk passes them around);
                activations = the saved bytes live at the peak, transient = that phase's working set less comm,
                comm = tokens * CP communication buffers (ring KV/dKV or Ulysses all-to-all), layers phase only
  reserve     = fixed bytes for CUDA context, NCCL, allocator fragmentation
  total       = sum of the above; fits when total <= gpu_memory_gb.
Host memory per node = gpus_per_node * (offloaded activations per GPU + host_reserve_gb).

Activation model (calibratable, `ActivationCoefficients`): saved bytes per token per layer are
  b * (hidden*h + query*hq*d + kv*r*hkv*d + ffn*f + rope*d) + 4 * (lse*hq + norm)      (divided by tp)
with b the activation dtype size, r the Ulysses KV replication factor; each named coefficient counts the
tensors of that width the Megatron layer saves with our core attention (see the field comments). Recompute,
offload and tiling remove terms (see `layer_saved_bytes`). tests/test_planner_calibration.py checks the result
against the tracker's measurement of a real Megatron GPTModel.

Cost model (`CostModel`): step time per sequence = compute + exposed communication + exposed transfers,
relative to the ideal compute of the same sequence (cost 1.0 = no recompute, no exposed communication):
  compute  = flops / (cp*tp) / (gpu_tflops * mfu); flops = 3 * forward + recompute forward, where
             forward per token = L * (matmul + causal attention 2*hq*d*seq) + logits 2*h*V;
             full recompute re-runs the layer forward, full_keep_attn the layer matmuls only (not attention),
             selective the MLP forward, tiled MLP re-runs the MLP forward, chunked loss the logits forward.
  tp comm  = 2 all-gathers + 2 reduce-scatters of the local hidden states per layer per forward pass
             (sequence parallel), not overlapped, over NVLink.
  ring     = (cp-1) KV blocks per layer per pass (forward: K,V; backward: K,V + fp32 dK,dV), overlapped
             with that pass's attention compute; only the excess is exposed.
  ulysses  = 4 all-to-alls per layer per pass (q, k, v in, output back), not overlapped.
  offload  = layer input D2H after each layer's forward and H2D before its backward, overlapped with the
             layer's compute; only the excess is exposed (prefetch_depth=0: the H2D is exposed).
  chunks   = sequence-chunked layers: the backward's K/V pass (norm + QKV once more per layer) and each chunk's
             re-read of the layer weights from device memory (4 passes per chunk).
Bandwidths: NVLink when the group fits in one node, the inter-node network otherwise. The chosen candidate is
the smallest-memory one among the fitting candidates within 1% (`cost_tolerance`) of the cheapest.
"""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass, field, replace
from typing import Any, Iterable, Mapping, Optional

from nemo_longctx.options import (
    CP_CHOICES,
    DEFAULT_SEQUENCE_CHUNK_TOKENS,
    PLANNED_OFFLOAD,
    PLANNED_RECOMPUTE,
    Context,
    LongContextOptions,
    auto_tiles,
    layout_problems,
)
from nemo_longctx.shared.signals import DEFAULT_GRACE_S

from .model_shapes import ModelShape, shape_from_config

GIB = float(2**30)
CP_ALGORITHMS = CP_CHOICES  # the algorithms searched: "none" (cp.size 1) and every CP algorithm
# searched by default (PLANNED_RECOMPUTE's "selective_attn" is predicted, not searched unless asked)
RECOMPUTE = tuple(m for m in PLANNED_RECOMPUTE if m != "selective_attn")
OFFLOAD = PLANNED_OFFLOAD
DTYPE_BYTES = {"bf16": 2, "fp16": 2, "fp32": 4, "float32": 4, "bfloat16": 2, "float16": 2}


# --------------------------------------------------------------------------------------------------- inputs
@dataclass(frozen=True)
class Hardware:
    gpus: int
    gpu_memory_gb: float = 80.0
    host_memory_gb: float = 1024.0  # per node
    gpus_per_node: int = 8
    reserve_gb: float = 5.0  # per GPU: CUDA context, NCCL buffers, allocator fragmentation
    host_reserve_gb: float = 16.0  # per GPU process on the host: python, CUDA, NeMo, data loader

    def __post_init__(self):
        if self.gpus < 1:
            raise ValueError(f"plan.gpus must be >= 1, got {self.gpus}")
        if self.gpu_memory_gb <= 0:
            raise ValueError(f"plan.gpu_memory_gb must be > 0, got {self.gpu_memory_gb}")
        if self.host_memory_gb < 0:
            raise ValueError(f"plan.host_memory_gb must be >= 0, got {self.host_memory_gb}")
        if self.gpus_per_node < 1:
            raise ValueError(f"plan.gpus_per_node must be >= 1, got {self.gpus_per_node}")

    @property
    def nodes(self) -> int:
        return math.ceil(self.gpus / self.gpus_per_node)

    @property
    def gpus_on_a_node(self) -> int:
        return min(self.gpus, self.gpus_per_node)


@dataclass(frozen=True)
class Precision:
    activation_bytes: int = 2  # bf16 activations
    param_bytes: int = 2  # bf16 weights
    grad_bytes: int = 4  # fp32 main grads (NeMo bf16-mixed: grad_reduce_in_fp32=True)
    # fp32 master weights + Adam exp_avg + exp_avg_sq, sharded (distributed optimizer); with fp32 weights
    # (param_bytes=4) the weights are the master and only the moments (optimizer_bytes - 4) are counted
    optimizer_bytes: int = 12


@dataclass(frozen=True)
class ActivationCoefficients:
    """Tensors saved for backward, counted per token in units of one shape term (see module docstring).

    Defaults (`TE_GPU`): Megatron-core's TransformerEngine GPT layer as NeMo's Llama configs build it (fused
    LayerNorm+Linear, fused bias-SwiGLU, fused RoPE, no biases, no dropout) with nemo_longctx's core attention;
    counted from the code (no GPU here to measure). `LOCAL_CPU`: Megatron's local (non-TE) spec, unfused SwiGLU
    and RoPE, as measured with the tracker on CPU (tests/test_planner_calibration.py).
    """

    hidden: float = 4.0  # x h: per norm+linear pair the norm input and the normalised linear input (2 pairs)
    query: float = 2.0  # x hq*d: q after RoPE, attention output (also the out-projection input: same storage)
    kv: float = 2.0  # x hkv*d: k after RoPE, and the contiguous copy of v our core attention makes
    # x (hq + 2 hkv)*d: the fused QKV projection output; 0 because nothing keeps it alive (v is copied, not viewed)
    qkv_buffer: float = 0.0
    ffn: float = 3.0  # x f, gated MLP: fc1 output (gate and up) kept by the fused SwiGLU, fc2 input
    ffn_plain: float = 2.0  # x f, non-gated MLP: fc1 output, fc2 input
    rope: float = 0.0  # x d: per-token cos/sin copies made by an unfused RoPE application (q and k)
    lse: float = 1.0  # x hq, fp32: attention log-sum-exp
    norm: float = 2.0  # x 1, fp32: per-token norm statistics (two norms)
    layer_input: float = 1.0  # x h: what full recompute keeps per layer (the checkpointed layer input)
    recompute_rope: float = 1.0  # x d, fp32, once per model under full recompute: RoPE frequencies (checkpoint arg)
    head_hidden: float = 2.0  # x h, once per model: final-norm input, output-layer input
    head_norm: float = 1.0  # x 1, fp32, once per model: final-norm statistics
    logits: float = 1.0  # x V (fp32): what the cross entropy keeps for backward when the loss is not chunked
    # bytes, once per model: input ids (int64), Megatron cross entropy's target index (int64) and mask (bool), the fp32
    # loss mask the loss reduction multiplies the per-token loss with (saved by that product)
    token_bytes: float = 21.0
    # chunked loss (loss_chunks > 1), per token of the sequence it sees (gathered under sequence parallelism, so not
    # divided by tp): the precomputed grad_hidden it holds on ctx (activation dtype, x h), and in bytes the int64 labels
    # + fp32 log-sum-exp + fp32 counted-token mask it saves, less Megatron's cross-entropy target index + mask (9 B)
    # that token_bytes counts; plus, once per GPU, the fp32 grad_weight [V/tp, h] it holds (loss_fixed_bytes)
    loss_grad_hidden: float = 1.0
    loss_chunk_bytes: float = 7.0
    # transient (not saved) terms
    # x f (/ tiles): gradient of the fc1 output ([s, 2f] gated, [s, f] plain) alive during the MLP backward next to
    # what the MLP saved (measured on CPU: tests/test_planner_calibration.py)
    mlp_grad: float = 2.0
    mlp_grad_plain: float = 1.0
    mlp_tile_grad: float = 1.0  # x f / tiles: gradient live next to one tile's recomputed intermediate (tiled MLP)
    # x MLP weights (per GPU, not per token): a tiled MLP's backward forms each tile's weight gradients before they
    # are accumulated (one extra set of MLP weight gradients, in the activation dtype)
    mlp_tile_wgrad: float = 1.0
    attn_accum: float = 1.0  # x hq*d fp32: output accumulator (forward) / dq accumulator (backward)
    attn_kv_accum: float = 2.0  # x hkv*d fp32: dk, dv accumulators in the ring backward
    # sequence-chunked layers (recompute.sequence_chunks), per token of the whole local sequence: the K and V buffers
    # (activation dtype, x hkv*d each) and their fp32 gradient accumulators (x hkv*d each) of the layer in backward
    chunk_kv: float = 2.0
    chunk_kv_grad: float = 2.0
    # x the layer's parameters (per GPU, not per token), fp32: the chunks' parameter gradients summed before they reach
    # autograd once (4 B/param) + the current chunk's, partly alive; measured 1.26 on CPU (fp32)
    chunk_param_grads: float = 1.25
    # under ring CP, per token of the local sequence x hkv*d: the K/V received (x activation bytes; measured 2.5 with
    # the in-flight pair) and the fp32 dK/dV accumulators travelling (sent + received: 4); with them the chunk's graph
    # up to its attention (x one chunk's recomputed-layer set). Fitted on CPU, 1024/2048 local tokens, 4-32 chunks
    chunk_ring_kv: float = 2.5
    chunk_ring_grad: float = 4.0
    chunk_ring_graph: float = 0.32
    # the attention kernel's own backward buffers (transient, alive only inside one kernel call), per token of the
    # call's queries / keys: ``attn_bwd_q`` x hq*d x (4 + b) bytes (the fp32 dq accumulator and the dq output, plus 4 B
    # per query head of softmax row sums) and ``attn_bwd_kv`` x 2b x hq*d bytes (dK and dV formed at the query heads
    # under GQA, then reduced to the KV heads: + 2b x hkv*d). What the CUDA flash kernels (torch's flash SDPA,
    # flash-attn 2) allocate; measured on an H200 from the allocator's history (45,184 B/token for Llama-3-8B's 32/8
    # heads, bf16: bench/results/h200_2026-11-26b/peak_breakdown_262144.txt). 0 on the CPU presets: the CPU kernel's
    # buffers never set the tracker's peak (tests/test_planner_calibration.py)
    attn_bwd_q: float = 1.0
    attn_bwd_kv: float = 1.0

    @classmethod
    def preset(cls, name: str) -> "ActivationCoefficients":
        try:
            return ACTIVATION_PRESETS[name]
        except KeyError:
            raise ValueError(f"plan.activation_model={name!r} is not one of {sorted(ACTIVATION_PRESETS)}") from None


TE_GPU = ActivationCoefficients()
# Megatron's local spec on a CUDA device (what bench/max_seqlen.py builds): the CPU-calibrated layer coefficients
# with the CUDA attention kernels' backward buffers
LOCAL_GPU = replace(TE_GPU, hidden=6.0, ffn=5.0, rope=4.0, head_hidden=3.0)
LOCAL_CPU = replace(LOCAL_GPU, attn_bwd_q=0.0, attn_bwd_kv=0.0)
ACTIVATION_PRESETS = {"te_gpu": TE_GPU, "local_cpu": LOCAL_CPU, "local_gpu": LOCAL_GPU}


@dataclass(frozen=True)
class CostModel:
    gpu_tflops: float = 989.0  # H100 SXM dense bf16
    mfu: float = 0.45  # achieved fraction of peak for the compute estimate
    nvlink_gbps: float = 300.0  # GB/s per GPU, intra-node collectives / p2p
    network_gbps: float = 40.0  # GB/s per GPU, inter-node (400 Gb/s IB per GPU, effective)
    pcie_gbps: float = 25.0  # GB/s per GPU, host <-> device copies (pinned)
    host_adam_gparams: float = 1.0  # 1e9 parameters/s per GPU process: host Adam step (optimizer offload), modelled
    hbm_gbps: float = 3350.0  # GB/s, device memory (H100 SXM): weight re-reads of sequence-chunked layers


SHARDING = ("ddp", "distributed", "fsdp")  # Megatron DDP | distributed optimizer (ZeRO-1) | Megatron-FSDP (ZeRO-3)


@dataclass(frozen=True)
class ModelState:
    """How weights, gradients and optimizer states are kept (the train app's `optim` group)."""

    sharding: str = "distributed"  # ddp | distributed | fsdp
    optimizer_offload: float = 0.0  # HybridDeviceOptimizer: fraction of the (sharded) Adam step on the host
    # Megatron's precision-aware optimizer: bf16 main grads, and bf16 Adam moments on the device (with an optimizer
    # offload the host moments stay fp32: torch AdamW); the fp32 master is held by the optimizer itself
    precision_aware: bool = False

    def __post_init__(self):
        if self.sharding not in SHARDING:
            raise ValueError(f"model state sharding={self.sharding!r} is not one of {SHARDING}")
        if not 0.0 <= float(self.optimizer_offload) <= 1.0:
            raise ValueError(f"optimizer_offload={self.optimizer_offload!r} must be in [0, 1]")

    def label(self) -> str:
        out = self.sharding
        if self.optimizer_offload:
            out += f"+optoff{self.optimizer_offload:g}"
        if self.precision_aware:
            out += "+pa"
        return out


# searched by default: every sharding, optimizer offload 0 / 0.5 / 1, precision-aware off / on; the plan app keeps
# the combinations its validation accepts (nemo_longctx.apps.plan.app_accepts)
MODEL_STATES = tuple(ModelState(sh, f, pa) for sh in SHARDING for f in (0.0, 0.5, 1.0) for pa in (False, True))


@dataclass(frozen=True)
class Candidate:
    cp_algorithm: str = "none"  # none | ring | ulysses | hybrid
    cp_size: int = 1
    ulysses_size: int = 1  # Ulysses degree (ulysses: = cp_size; hybrid: the intra-node factor; else 1)
    tp: int = 1
    recompute: str = "none"  # none | selective (modules: mlp) | full | full_keep_attn
    offload: str = "none"  # none | layer_input
    mlp_tiles: int = 1  # 1 = off
    loss_chunks: int = 1  # 1 = off
    prefetch_depth: int = 1  # layer_input offload: layers brought back ahead of the one in backward
    model_state: ModelState = ModelState()
    sequence_chunks: int = 1  # recompute=full: each layer runs in this many sequence chunks (1 = off)
    # recompute=full (uniform): layers per checkpoint (recompute.num_layers); searched above 1 with sequence chunks:
    # only every k-th layer input is kept (offloaded), the k-1 inner ones are recomputed in backward
    recompute_layers: int = 1

    @property
    def ring_size(self) -> int:
        return self.cp_size // self.ulysses_size

    def recompute_label(self) -> str:
        """``recompute`` with its sequence chunks and layers per checkpoint (``/seqchunks=N``, ``/layersK``)."""
        return (self.recompute + (f"/seqchunks={self.sequence_chunks}" if self.sequence_chunks > 1 else "")
                + (f"/layers{self.recompute_layers}" if self.recompute_layers > 1 else ""))

    def offload_label(self) -> str:
        """``offload`` with a prefetch depth other than 1 (``/depthN``)."""
        return self.offload + (f"/depth{self.prefetch_depth}" if self.offload != "none" and self.prefetch_depth != 1
                               else "")

    def label(self) -> str:
        cp = self.cp_algorithm if self.cp_size > 1 else "none"
        if cp == "hybrid":
            cp = f"hybrid{self.ulysses_size}x{self.ring_size}"
        return (f"cp={cp}:{self.cp_size} tp={self.tp} rc={self.recompute_label()} off={self.offload_label()} "
                f"tiles={self.mlp_tiles} chunks={self.loss_chunks} state={self.model_state.label()}")


@dataclass
class MemoryBreakdown:
    weights: float
    grads: float
    optimizer: float
    activations: float  # saved for backward, on the device, live at the step's peak (see `peak_phase`)
    transient: float  # the peak phase's working set (less the CP buffers)
    comm: float  # CP buffers live at the peak (0 when the peak is in the head's backward)
    reserve: float
    host_offload: float  # per GPU, on the host
    host_per_node: float
    # "head": the peak is reached in the loss/output layer's backward, with everything saved still alive;
    # "layers": in a transformer layer's backward, after the head's saved tensors were freed
    peak_phase: str = "layers"

    @property
    def total(self) -> float:
        return (self.weights + self.grads + self.optimizer + self.activations + self.transient + self.comm
                + self.reserve)

    def gib(self) -> dict:
        out = {k: v / GIB for k, v in asdict(self).items() if k != "peak_phase"}
        out["total"] = self.total / GIB
        return out


@dataclass
class Evaluation:
    candidate: Candidate
    dp: int
    tokens_per_gpu: int
    memory: MemoryBreakdown
    fits_gpu: bool
    fits_host: bool
    cost: float
    notes: list = field(default_factory=list)

    @property
    def fits(self) -> bool:
        return self.fits_gpu and self.fits_host

    def to_dict(self) -> dict:
        return {"candidate": asdict(self.candidate), "label": self.candidate.label(), "dp": self.dp,
                "tokens_per_gpu": self.tokens_per_gpu, "memory_gib": self.memory.gib(),
                "fits": self.fits, "fits_gpu": self.fits_gpu, "fits_host": self.fits_host,
                "relative_cost": self.cost, "notes": list(self.notes)}


class PlanError(ValueError):
    """No candidate fits; the message says what would be needed."""


# --------------------------------------------------------------------------------------------------- memory
def kv_replication(shape: ModelShape, tp: int, ulysses: int) -> float:
    """Factor by which Ulysses stores more K/V than the ring: KV heads are replicated up to the Ulysses degree."""
    kv_local = shape.num_query_groups / tp
    return max(kv_local, ulysses) / kv_local if ulysses > 1 else 1.0


def layer_saved_bytes(shape: ModelShape, c: Candidate, coef: ActivationCoefficients, b: int,
                      recompute: str | None = None) -> float:
    """Bytes saved for backward per local token per layer (before offload), per GPU (already divided by tp).

    Ulysses (and hybrid) attention saves its all-to-all outputs instead of the projection's buffers: q, k, v in
    the head-sharded layout (K/V replicated r times when the degree exceeds the KV heads), its own output and the
    output sent back (the out-projection input).
    """
    recompute = c.recompute if recompute is None else recompute
    h, d, f = shape.hidden_size, shape.head_dim, shape.ffn_hidden_size
    lse = 4 * coef.lse * shape.num_attention_heads
    if recompute == "full":  # the checkpoint's input, one per recompute_layers layers
        return b * coef.layer_input * h / c.tp / c.recompute_layers
    if recompute == "full_keep_attn":
        return (b * (coef.layer_input * h + shape.q_width) + lse) / c.tp
    if c.ulysses_size > 1:
        r = kv_replication(shape, c.tp, c.ulysses_size)
        attn = (coef.query + 1) * shape.q_width + 2 * r * shape.kv_width
    elif recompute == "selective_attn":
        # Megatron's checkpoint around core attention saves its inputs: q and k after RoPE and v as a *view* of
        # the fused QKV output, which therefore stays alive in full (our contiguous v copy happens inside the
        # checkpoint); plus the attention output (the out-projection input)
        attn = coef.query * shape.q_width + shape.kv_width + (shape.q_width + 2 * shape.kv_width)
    else:
        attn = (coef.query * shape.q_width + coef.kv * shape.kv_width
                + coef.qkv_buffer * (shape.q_width + 2 * shape.kv_width))
    ffn_coef = coef.ffn if shape.gated_mlp else coef.ffn_plain
    ffn = 0.0 if (recompute == "selective_mlp" or c.mlp_tiles > 1) else ffn_coef * f
    if recompute == "selective_attn":  # Megatron's selective core_attn: the checkpoint keeps q, k, v; no LSE
        lse = 0.0
    elems = coef.hidden * h + attn + ffn + coef.rope * d
    return (b * elems + lse + 4 * coef.norm) / c.tp


def head_saved_bytes(shape: ModelShape, c: Candidate, coef: ActivationCoefficients, b: int) -> float:
    """Bytes saved per local token outside the transformer layers (embedding ids, final norm, output, loss).

    Under full recompute (either kind) the RoPE table is a checkpoint argument (``recompute_rope``); with
    ``offload=layer_input`` each layer's checkpoint offloads its own copy (see ``offloaded_layer_bytes``), so it is
    not counted here. The chunked loss holds its precomputed hidden gradient (``loss_grad_hidden``) and saves its
    labels/LSE/mask (``loss_chunk_bytes``) instead of the fp32 logits; its fp32 weight gradient is per GPU
    (``loss_fixed_bytes``)."""
    if c.loss_chunks > 1:
        loss = b * coef.loss_grad_hidden * shape.hidden_size + coef.loss_chunk_bytes
        # under sequence parallelism (tp > 1) it saves the all-gathered hidden states (Megatron's output layer saves
        # its sharded input, counted in head_hidden / tp): the rest of the gathered copy (modelled, not calibrated)
        loss += b * shape.hidden_size * (1 - 1 / c.tp)
    else:
        loss = 4 * coef.logits * shape.vocab_size / c.tp
    full = c.recompute in ("full", "full_keep_attn")
    # sequence-chunked layers take the RoPE table by reference, not as a saved checkpoint argument (unless several
    # of them share one Megatron checkpoint)
    rope_saved = full and c.offload != "layer_input" and (c.sequence_chunks == 1 or c.recompute_layers > 1)
    rope = 4 * coef.recompute_rope * shape.head_dim if rope_saved else 0.0
    return (b * coef.head_hidden * shape.hidden_size + 4 * coef.head_norm) / c.tp + loss + coef.token_bytes + rope


def loss_fixed_bytes(shape: ModelShape, c: Candidate) -> float:
    """Bytes per GPU, independent of the sequence length, that the chunked loss holds from forward to backward: its
    fp32 weight gradient ``[V/tp, h]`` (the untiled path forms it in backward, as a transient of the same size)."""
    return 4.0 * shape.vocab_size * shape.hidden_size / c.tp if c.loss_chunks > 1 else 0.0


def offloaded_layer_bytes(shape: ModelShape, c: Candidate, coef: ActivationCoefficients, b: int) -> float:
    """Bytes per local token and layer that ``offload=layer_input`` moves to the host: everything the recomputed
    layer keeps (``layer_saved_bytes``: its input, and under full_keep_attn the kept attention output and LSE) plus
    that layer's copy of the RoPE table (a checkpoint argument of every layer)."""
    rope = 0.0  # one copy per checkpoint (chunked layers, one per checkpoint, take it by reference)
    if c.sequence_chunks == 1 or c.recompute_layers > 1:
        rope = 4 * coef.recompute_rope * shape.head_dim / c.recompute_layers
    return layer_saved_bytes(shape, c, coef, b) + rope


def _comm_buffer_bytes(shape: ModelShape, c: Candidate, b: int) -> float:
    """Per local token: CP communication buffers alive during attention."""
    if c.cp_size == 1:
        return 0.0
    kv = shape.kv_width / c.tp * kv_replication(shape, c.tp, c.ulysses_size)
    q = shape.q_width / c.tp
    total = 0.0
    if c.ulysses_size > 1:  # all-to-all receive buffers for q, k, v (and output back), for all local heads
        total += (2 * q + 2 * kv) * b
    if c.ring_size > 1:  # double-buffered K, V in flight (forward) / K, V + fp32 dK, dV (backward)
        ring_tokens = c.ulysses_size  # hybrid: a ring block holds ulysses_size x more tokens, 1/u of the heads
        kv_ring = kv / c.ulysses_size * ring_tokens
        # K, V in flight and fp32 dK, dV (backward); double-buffered once the ring has more than one step
        total += min(2, c.ring_size - 1) * kv_ring * (b + 4)
    return total


def attention_backward_workspace(shape: ModelShape, c: Candidate, coef: ActivationCoefficients, b: int,
                                 q_tokens: float, kv_tokens: float) -> float:
    """Bytes per GPU of the attention kernel's own backward buffers in its largest call (``attn_bwd_q``,
    ``attn_bwd_kv``): ``q_tokens`` queries against ``kv_tokens`` keys, this GPU's heads (Ulysses moves heads for
    tokens: the same bytes per local token)."""
    q, kv = shape.q_width / c.tp, shape.kv_width / c.tp
    heads = shape.num_attention_heads / c.tp
    per_q = coef.attn_bwd_q * (q * (4 + b) + 4 * heads)
    per_kv = coef.attn_bwd_kv * 2 * b * (q + (kv if shape.kv_width < shape.q_width else 0))
    return per_q * q_tokens + per_kv * kv_tokens


def working_sets(shape: ModelShape, c: Candidate, coef: ActivationCoefficients, b: int, tokens: float) -> dict:
    """Bytes per GPU of the short-lived working sets of one step, on top of the saved activations; the step's peak
    is the larger of the head's backward (everything saved + ``head``) and a layer's backward (the layers' saved bytes
    + the largest other set), see ``_peak_phase`` (calibrated against the tracker's peak on CPU:
    tests/test_planner_calibration.py).

    head       the loss + output layer: untiled, the output weight's gradient before accumulation (fp32 [V/tp, h])
               and, with half-precision activations, the half logits next to their fp32 copy; chunked, one chunk's
               fp32 logits (+ their half-precision matmul output); plus the hidden gradients in and out (2 x h)
    recompute  full / full_keep_attn: the layer being recomputed in backward (what the non-recomputed layer saves,
               less what is kept; with tiled MLP one tile's MLP intermediate and its gradient) + gradients in/out
    mlp        selective (mlp) or tiled MLP: the recomputed MLP intermediate (one tile) + gradients in/out; tiled adds
               a gradient of the tile (``mlp_tile_grad``)
    attention  CP buffers (``_comm_buffer_bytes``) + gradients in/out + the kernel's backward buffers
               (``attention_backward_workspace``: its largest call, the local sequence against itself; with sequence
               chunks one chunk's queries against at most as many keys)
    Every set that runs an MLP backward also holds the fc1-output gradient (``mlp_grad``, one tile's when tiled) and,
    tiled, one tile's MLP weight gradients (``mlp_tile_wgrad``); without recompute that is the ``mlp_backward`` set
    (the intermediates it needs are among the saved bytes).
    """
    h, f, v = shape.hidden_size, shape.ffn_hidden_size, shape.vocab_size
    tp = c.tp
    grads_io = 2 * b * h / tp * tokens
    half = b if b < 4 else 0
    ffn_coef = coef.ffn if shape.gated_mlp else coef.ffn_plain
    tiles = max(1, c.mlp_tiles)
    mlp_bwd = (coef.mlp_grad if shape.gated_mlp else coef.mlp_grad_plain) * f * b / tp / tiles * tokens
    if tiles > 1:
        mlp_bwd += coef.mlp_tile_wgrad * (3 if shape.gated_mlp else 2) * f * h * b / tp
    n_chunks = c.sequence_chunks if c.recompute == "full" and c.sequence_chunks > 1 else 1
    # sequence chunks: a chunk's queries against key pieces of at most the chunk's length (split_key_blocks)
    attn_ws = attention_backward_workspace(shape, c, coef, b, tokens / n_chunks, tokens / n_chunks)
    sets = {}
    if c.loss_chunks > 1:
        chunk = math.ceil(tokens / c.loss_chunks)
        sets["head"] = (4 * coef.logits + half) * v / tp * chunk + grads_io / 2
    else:
        sets["head"] = 4.0 * v * h / tp + half * v / tp * tokens + grads_io / 2
    if c.recompute in ("full", "full_keep_attn"):
        none_layer = layer_saved_bytes(shape, replace(c, mlp_tiles=1), coef, b, recompute="none")
        regained = none_layer - layer_saved_bytes(shape, replace(c, recompute_layers=1), coef, b)
        if tiles > 1:  # the tiled MLP saves nothing; one tile's intermediate and a gradient of it live
            regained -= ffn_coef * f * b / tp * (1 - 1 / tiles) - coef.mlp_tile_grad * f * b / tp / tiles
        if c.sequence_chunks > 1:  # one chunk's recomputed layer (and its attention accumulators) + K/V buffers
            n = c.sequence_chunks
            accum = 4 * coef.attn_accum * shape.q_width / tp
            # (Ulysses: the buffers hold this rank's heads of the whole sequence, KV heads replicated as attention
            # needs them when they do not divide by the Ulysses size)
            rep = kv_replication(shape, tp, c.ulysses_size)
            kv = (coef.chunk_kv * b + coef.chunk_kv_grad * 4) * shape.kv_width / tp * rep
            param_sums = coef.chunk_param_grads * 4 * shape.layer_parameters() / tp
            # the recomputed chunk's MLP backward, then its attention backward (the kernel's buffers)
            chunk = (regained + accum) * tokens / n + max(mlp_bwd / n, attn_ws)
            if c.ring_size > 1:
                # under ring CP each chunk's attention backward passes the whole local K/V around the ring with the
                # fp32 dK/dV accumulators travelling (sent + received), at the full local length; alive then: the
                # gradients of the modules after attention (o-proj, MLP) and part of the chunk's graph
                ring = (coef.chunk_ring_kv * b + coef.chunk_ring_grad * 4) * shape.kv_width / tp * rep * tokens
                after_attn = shape.layer_parameters() - h * (shape.q_width + 2 * shape.kv_width)
                chunk = max(chunk, ring + 4 * after_attn / tp + coef.chunk_ring_graph * chunk)
            # k layers per checkpoint: the checkpoint's recompute keeps the k-1 inner layers' inputs and its own
            # recomputed output (Megatron's checkpoint differentiates it)
            inner = (c.recompute_layers if c.recompute_layers > 1 else 0) * b * coef.layer_input * h / tp
            sets["recompute"] = chunk + (kv + inner) * tokens + grads_io + param_sums
        else:
            sets["recompute"] = regained * tokens + grads_io + max(mlp_bwd, attn_ws)
    elif c.recompute == "selective_mlp" or tiles > 1:
        grad = coef.mlp_tile_grad if tiles > 1 else 0.0
        sets["mlp"] = (ffn_coef + grad) * f * b / tp / tiles * tokens + grads_io + mlp_bwd
    else:
        sets["mlp_backward"] = mlp_bwd + grads_io
    # attn_accum / attn_kv_accum (our fp32 accumulators across blocks) are not added: on CPU they never set the peak
    # (measured); the kernel's own buffers are attn_ws
    sets["attention"] = _comm_buffer_bytes(shape, c, b) * tokens + grads_io + attn_ws
    return sets


def _peak_phase(shape: ModelShape, c: Candidate, coef: ActivationCoefficients, b: int, tokens: float,
                layers_saved: float, head_saved: float, layers_at_head: float | None = None) -> tuple:
    """(phase, saved bytes live at the peak, transient, comm) per GPU. Two phases of backward can set the peak:

    head    the loss + output layer's backward (first in backward): every saved byte is alive -- the layers' saved
            bytes on the device then (``layers_at_head``, default ``layers_saved``; under layer-input offload none: the
            last layer's input is fetched once its output's gradient exists) and the head's own (``head_saved``) --
            plus the head working set;
    layers  a transformer layer's backward: the head's saved tensors (final-norm / output-layer inputs, fp32 logits
            or the chunked loss's precomputed gradients) were freed by autograd after the head's backward, so only
            the layers' saved bytes and the largest layer working set (recomputed layer, MLP, attention) are alive.

    The transient of the layers phase is reported less the CP buffers, which ``comm`` reports (they are part of the
    attention working set). Calibrated on CPU against the tracker's peak, with a vocabulary large enough for the
    head to matter (tests/test_planner_calibration.py)."""
    sets = working_sets(shape, c, coef, b, tokens)
    layer_ws = max(v for k, v in sets.items() if k != "head")
    at_head = layers_saved if layers_at_head is None else layers_at_head
    if at_head + head_saved + sets["head"] >= layers_saved + layer_ws:
        return "head", at_head + head_saved, sets["head"], 0.0
    comm = tokens * _comm_buffer_bytes(shape, c, b)
    return "layers", layers_saved, max(0.0, layer_ws - comm), comm


def largest_parameter_tensor(shape: ModelShape) -> int:
    """Elements of the largest parameter tensor (before tensor parallelism): embedding / output layer, fused QKV,
    attention output, MLP fc1 / fc2."""
    h, f = shape.hidden_size, shape.ffn_hidden_size
    return max(shape.vocab_size * h, h * (shape.q_width + 2 * shape.kv_width), shape.q_width * h,
               (2 if shape.gated_mlp else 1) * f * h, f * h)


def model_state_bytes(shape: ModelShape, c: Candidate, dp: int, precision: Precision = Precision()) -> dict:
    """Per-GPU bytes of weights, grads and optimizer states on the device, and optimizer bytes on the host, for
    `c.model_state` (see the module docstring). Megatron-FSDP's unsharded working set: two TransformerLayer units
    (the one computing and the one prefetched) plus the non-layer parameters (embedding, output layer, final norm),
    as parameters in forward and as gradients before their reduce-scatter."""
    ms = c.model_state
    p = shape.parameters()
    shard = max(1, dp) * c.cp_size
    grad_bytes = 2 if ms.precision_aware else precision.grad_bytes
    # fp32 weights are their own master: Megatron's FP32Optimizer / the distributed optimizer's fp32 shards are the
    # parameters (views of DDP's parameter buffer), no copy
    master, moments = (4.0 if precision.param_bytes < 4 else 0.0), float(precision.optimizer_bytes - 4)
    if ms.precision_aware and ms.optimizer_offload == 0:
        moments = 4.0  # bf16 exp_avg + exp_avg_sq in TE's FusedAdam
        if precision.param_bytes == 2:  # TE >= 2.1 (store_param_remainders, Megatron's default): the fp32 master is
            master = 2.0  # kept as its 16-bit remainder next to the bf16 weight
    if ms.sharding == "fsdp":
        unit = 2 * shape.layer_parameters() + (p - shape.num_layers * shape.layer_parameters())
        weights = precision.param_bytes * (p / shard + unit) / c.tp
        grads = grad_bytes * (p / shard + unit) / c.tp
    else:
        weights = precision.param_bytes * p / c.tp
        grads = grad_bytes * p / c.tp
    opt_params = p / c.tp / (1 if ms.sharding == "ddp" else shard)
    f = float(ms.optimizer_offload)
    on_device = (1 - f) * (master + moments) + (0.0 if ms.precision_aware else f * master)
    if ms.precision_aware and 0.0 < f < 1.0:
        # HybridDeviceOptimizer's device part steps fp32 copies of the bf16 shards: each holds an fp32 copy of its
        # bf16 main grad as .grad (`grad.to(fp32)`, kept until the next step)
        on_device += (1 - f) * 4.0
    # HybridDeviceOptimizer offloads whole shard pieces until >= f of the shard's elements: at most one more piece
    host_f = min(1.0, f + largest_parameter_tensor(shape) / c.tp / opt_params) if 0.0 < f < 1.0 else f
    host = host_f * (4.0 + 4.0 + 8.0)  # fp32 master copy, fp32 grad copy, fp32 moments
    return {"weights": weights, "grads": grads, "optimizer": on_device * opt_params, "host": host * opt_params}


CHECKPOINT_WRITE_GB_S = 2.0  # GB/s the ranks of a job write to the checkpoint filesystem, all together (default)


def checkpoint_bytes(shape: ModelShape, precision: Precision = Precision()) -> float:
    """Bytes of one checkpoint of the model and its optimizer, all ranks together (Megatron's distributed checkpoint
    writes each shard once): the weights, the fp32 master copy (none with fp32 weights) and Adam's two moments."""
    master = 4.0 if precision.param_bytes < 4 else 0.0
    return shape.parameters() * (precision.param_bytes + master + (precision.optimizer_bytes - 4))


def checkpoint_save_seconds(shape: ModelShape, precision: Precision = Precision(),
                            write_gb_s: float = CHECKPOINT_WRITE_GB_S) -> float:
    """The planner's estimate of one save: ``checkpoint_bytes`` at ``write_gb_s`` GB/s."""
    return checkpoint_bytes(shape, precision) / (float(write_gb_s) * 1e9)


def checkpoint_estimate(shape: ModelShape, precision: Precision, write_gb_s: float = CHECKPOINT_WRITE_GB_S,
                        grace_s: float = DEFAULT_GRACE_S) -> dict:
    """One save's size and time (``checkpoint_save_seconds``) against the preemption grace, with the line
    ``nemo-longctx plan`` prints (and the train app warns with when the save would not fit the grace)."""
    size, seconds = checkpoint_bytes(shape, precision), checkpoint_save_seconds(shape, precision, write_gb_s)
    fits = seconds <= grace_s
    line = (f"checkpoint: {size / 1e9:.1f} GB per save (weights + fp32 master + Adam moments), ~{seconds:.0f} s at "
            f"{write_gb_s:g} GB/s (plan.checkpoint_write_gb_s); " + (
                f"within the preemption grace (run.signal_grace_s={grace_s:g}, sbatch --signal=B:USR1@{grace_s:g})"
                if fits else f"MORE than the preemption grace run.signal_grace_s={grace_s:g}: raise it and the "
                "sbatch's --signal=B:USR1@<grace>"))
    return {"bytes": size, "save_s": seconds, "write_gb_s": write_gb_s, "grace_s": grace_s, "fits_grace": fits,
            "line": line}


def save_time_warning(model: Mapping[str, Any], param_bytes: int, grace_s: float) -> Optional[str]:
    """A run's start-up warning when the estimate of one save (``checkpoint_estimate`` at the default write
    bandwidth) of the model (a model config mapping: ``shape_from_config``) exceeds the preemption grace, else None
    (also for a model the planner cannot size: the measured save time is still reported)."""
    try:
        shape = shape_from_config(model)
    except ValueError:
        return None
    est = checkpoint_estimate(shape, Precision(param_bytes=param_bytes), grace_s=float(grace_s))
    return None if est["fits_grace"] else "nemo-longctx: WARNING: " + est["line"]


def memory_breakdown(shape: ModelShape, seq_length: int, hw: Hardware, c: Candidate,
                     precision: Precision = Precision(), coef: ActivationCoefficients | None = None
                     ) -> MemoryBreakdown:
    coef = coef or TE_GPU
    b = precision.activation_bytes
    dp = hw.gpus // (c.tp * c.cp_size)
    states = model_state_bytes(shape, c, dp, precision)
    tokens = seq_length / c.cp_size
    layer = layer_saved_bytes(shape, c, coef, b)
    head = head_saved_bytes(shape, c, coef, b)
    L = shape.num_layers
    if c.offload == "layer_input":  # on the device in backward: the layer being recomputed + those prefetched
        layer = offloaded_layer_bytes(shape, c, coef, b)
        # (per layer: a checkpoint of recompute_layers layers keeps one input, counted 1/k per layer)
        on_device_layers = min(L, (1 + c.prefetch_depth) * c.recompute_layers)
        layers_saved = tokens * on_device_layers * layer
        host = tokens * (L - on_device_layers) * layer
    else:
        layers_saved = tokens * L * layer
        host = 0.0
    head_saved = tokens * head + loss_fixed_bytes(shape, c)
    phase, device_act, transient, comm = _peak_phase(shape, c, coef, b, tokens, layers_saved, head_saved,
                                                     0.0 if c.offload == "layer_input" else layers_saved)
    host += states["host"]
    return MemoryBreakdown(
        weights=states["weights"],
        grads=states["grads"],
        optimizer=states["optimizer"],
        activations=device_act,
        transient=transient,
        comm=comm,
        reserve=hw.reserve_gb * GIB,
        host_offload=host,
        host_per_node=hw.gpus_on_a_node * (host + hw.host_reserve_gb * GIB),
        peak_phase=phase,
    )


def predicted_activation_bytes(shape: ModelShape, seq_length: int, c: Candidate,
                               coef: ActivationCoefficients | None = None, activation_bytes: int = 2,
                               include_head: bool = True) -> dict:
    """Saved-for-backward bytes per GPU as the tracker measures them (its maximum over the step, reached at the end
    of forward): {'device', 'host', 'per_layer'}. With ``offload=layer_input`` every layer's saved bytes are on the
    host then ('device' holds the head only; ``memory_breakdown`` adds the layers prefetched in backward)."""
    coef = coef or TE_GPU
    b = activation_bytes
    tokens = seq_length / c.cp_size
    L = shape.num_layers
    head = tokens * head_saved_bytes(shape, c, coef, b) + loss_fixed_bytes(shape, c) if include_head else 0.0
    if c.offload == "layer_input":
        layer = tokens * offloaded_layer_bytes(shape, c, coef, b)
        return {"device": head, "host": L * layer, "per_layer": layer}
    layer = tokens * layer_saved_bytes(shape, c, coef, b)
    return {"device": L * layer + head, "host": 0.0, "per_layer": layer}


def predicted_peak_bytes(shape: ModelShape, seq_length: int, c: Candidate,
                         coef: ActivationCoefficients | None = None, activation_bytes: int = 2) -> float:
    """Peak of live activation bytes per GPU during one forward + backward, above the model states (weights, grads in
    preallocated buffers, optimizer): ``memory_breakdown``'s activations + transient + comm (what the tracker's
    ``peak_bytes`` measures when the gradient buffers exist before the step)."""
    coef = coef or TE_GPU
    m = memory_breakdown(shape, seq_length, Hardware(gpus=c.tp * c.cp_size), c,
                         Precision(activation_bytes=activation_bytes), coef)
    return m.activations + m.transient + m.comm


# --------------------------------------------------------------------------------------------------- cost
def _bandwidth(group_gpus: int, hw: Hardware, cost: CostModel) -> float:
    return (cost.nvlink_gbps if group_gpus <= hw.gpus_per_node else cost.network_gbps) * 1e9


def relative_cost(shape: ModelShape, seq_length: int, hw: Hardware, c: Candidate,
                  precision: Precision = Precision(), cost: CostModel = CostModel()) -> float:
    """Step time of one sequence relative to its ideal compute time (see the module docstring)."""
    h, f, V, L = shape.hidden_size, shape.ffn_hidden_size, shape.vocab_size, shape.num_layers
    b = precision.activation_bytes
    qkv_o = 2 * (h * (shape.q_width + 2 * shape.kv_width) + shape.q_width * h)
    mlp = 2 * (3 if shape.gated_mlp else 2) * h * f
    attn = 2 * shape.q_width * seq_length  # causal: 4*hq*d per key over seq/2 keys on average
    logits = 2 * h * V
    fwd = seq_length * (L * (qkv_o + mlp + attn) + logits)
    extra = 0.0
    if c.recompute == "full":
        extra += seq_length * L * (qkv_o + mlp + attn)
        if c.sequence_chunks > 1:  # the K/V pass of the backward: each layer's norm + QKV projection once more
            extra += seq_length * L * 2 * h * (shape.q_width + 2 * shape.kv_width)
        if c.recompute_layers > 1:  # the checkpoint's recompute runs its layers forward once more (chunked)
            extra += seq_length * L * (qkv_o + mlp + attn)
    elif c.recompute == "full_keep_attn":
        extra += seq_length * L * (qkv_o + mlp)
    elif c.recompute == "selective_mlp":
        extra += seq_length * L * mlp
    elif c.recompute == "selective_attn":
        extra += seq_length * L * attn
    if c.mlp_tiles > 1:
        extra += seq_length * L * mlp
    if c.loss_chunks > 1:
        extra += seq_length * logits
    gpus_per_seq = c.cp_size * c.tp
    rate = cost.gpu_tflops * 1e12 * cost.mfu
    ideal = 3 * fwd / gpus_per_seq / rate
    compute = (3 * fwd + extra) / gpus_per_seq / rate
    fwd_passes = 2 if c.recompute in ("full", "full_keep_attn") else 1
    tokens = seq_length / c.cp_size
    exposed = 0.0
    if c.tp > 1:  # sequence parallel: 2 AG + 2 RS of [tokens, h] per layer per pass, not overlapped
        vol = 4 * tokens * h * b * (c.tp - 1) / c.tp
        exposed += L * (fwd_passes + 1) * vol / _bandwidth(c.tp, hw, cost)
    attn_time_pass = seq_length * attn / gpus_per_seq / rate  # one layer's attention forward on one GPU
    if c.ulysses_size > 1:
        kv = shape.kv_width * kv_replication(shape, c.tp, c.ulysses_size)
        vol = tokens * (2 * shape.q_width + 2 * kv) * b / c.tp * (c.ulysses_size - 1) / c.ulysses_size
        exposed += L * (fwd_passes + 1) * vol / _bandwidth(c.ulysses_size * c.tp, hw, cost)
    if c.ring_size > 1:
        kv_block = tokens * c.ulysses_size * 2 * shape.kv_width / c.tp / c.ulysses_size
        kv_block *= kv_replication(shape, c.tp, c.ulysses_size)
        bw = _bandwidth(c.cp_size * c.tp, hw, cost)
        fwd_comm = (c.ring_size - 1) * kv_block * b / bw
        bwd_comm = (c.ring_size - 1) * kv_block * (b + 4) / bw
        ring_passes = 2 if c.recompute in ("full", "selective_attn") else 1
        # sequence-chunked layers: one ring pass per chunk, each hiding behind 1/n of the attention
        n = c.sequence_chunks
        ring_passes += 1 if c.recompute_layers > 1 else 0
        exposed += L * n * (ring_passes * max(0.0, fwd_comm - attn_time_pass / n)
                            + max(0.0, bwd_comm - 2 * attn_time_pass / n))
    if c.offload == "layer_input":
        move = tokens * h * b / c.tp / (cost.pcie_gbps * 1e9) / c.recompute_layers
        layer_fwd = seq_length * (qkv_o + mlp + attn) / gpus_per_seq / rate
        # back in backward: prefetched while the previous layer runs backward, or (prefetch_depth=0) on demand
        back = move if c.prefetch_depth == 0 else max(0.0, move - 2 * layer_fwd)
        exposed += L * (max(0.0, move - layer_fwd) + back)
    if c.sequence_chunks > 1:  # every chunk reads the layer's weights again (forward, K/V pass, recompute, backward)
        weights = shape.layer_parameters() * precision.param_bytes / c.tp
        exposed += L * 4 * (c.sequence_chunks - 1) * weights / (cost.hbm_gbps * 1e9)
    exposed += _model_state_seconds(shape, hw, c, precision, cost, compute)
    return (compute + exposed) / ideal


def _model_state_seconds(shape: ModelShape, hw: Hardware, c: Candidate, precision: Precision, cost: CostModel,
                         compute: float) -> float:
    """Exposed seconds per step of the model-state options: Megatron-FSDP's parameter all-gathers (forward,
    backward, and the recompute forward) beyond the compute they overlap with; the optimizer offload's grad D2H,
    parameter H2D and host Adam step (not overlapped)."""
    ms = c.model_state
    dp = max(1, hw.gpus // (c.tp * c.cp_size))
    shard = dp * c.cp_size
    p_local = shape.parameters() / c.tp
    out = 0.0
    if ms.sharding == "fsdp" and shard > 1:
        passes = 3 if c.recompute in ("full", "full_keep_attn") else 2
        vol = p_local * precision.param_bytes * (shard - 1) / shard * passes
        out += max(0.0, vol / _bandwidth(hw.gpus, hw, cost) - compute)
    if ms.optimizer_offload:
        n = ms.optimizer_offload * p_local / (1 if ms.sharding == "ddp" else shard)
        grad = 2 if ms.precision_aware else precision.grad_bytes
        out += n * (grad + 4) / (cost.pcie_gbps * 1e9) + n / (cost.host_adam_gparams * 1e9)
    return out


# --------------------------------------------------------------------------------------------------- search
def _powers_of_two_dividing(n: int, limit: int) -> list[int]:
    out, k = [], 1
    while k <= min(n, limit):
        if n % k == 0:
            out.append(k)
        k *= 2
    return out


# The planner proposes explicit tile / chunk counts (what it prints is `tiling.mlp_tiles=N`), computed with the one
# meaning of "auto" (options.auto_tiles: ceil(tokens / tile tokens)) but GPU-scale tile sizes: the config's defaults
# (2048 / 512 tokens) were measured on CPU.
PLAN_MLP_TILE_TOKENS = 16384
PLAN_LOSS_CHUNK_TOKENS = 8192


def planned_mlp_tiles(tokens_per_gpu: float, tp: int, tile_tokens: int = PLAN_MLP_TILE_TOKENS) -> int:
    """Tiles so that one tile holds at most `tile_tokens` tokens of the MLP input."""
    return auto_tiles(math.ceil(tokens_per_gpu), tile_tokens)


def planned_loss_chunks(tokens_per_gpu: float, chunk_tokens: int = PLAN_LOSS_CHUNK_TOKENS) -> int:
    return auto_tiles(math.ceil(tokens_per_gpu), chunk_tokens)


def planned_sequence_chunks(tokens_per_gpu: float, chunk_tokens: int = DEFAULT_SEQUENCE_CHUNK_TOKENS) -> list[int]:
    """The sequence-chunk counts searched: `recompute.sequence_chunks=auto`'s (ceil(tokens / 16384)) and a quarter
    and a sixteenth of it (larger chunks, fewer weight re-reads), each at least 2."""
    auto = auto_tiles(math.ceil(tokens_per_gpu), chunk_tokens)
    return sorted({n for n in (auto, auto // 4, auto // 16) if n >= 2})


RECOMPUTE_GROUP = PLANNED_RECOMPUTE  # the planner's recompute modes -> (recompute group choice, selective modules)


def optim_fields(ms: ModelState) -> dict:
    """The ``optim`` group's values that run model state ``ms`` (conf/optim/default.yaml keys)."""
    out = {"use_distributed_optimizer": ms.sharding != "ddp", "megatron_fsdp": ms.sharding == "fsdp"}
    if ms.optimizer_offload:
        out.update(optimizer_cpu_offload=True, optimizer_offload_fraction=float(ms.optimizer_offload))
    if ms.precision_aware:
        out.update(use_precision_aware_optimizer=True, main_grads_dtype="bf16")
        if not ms.optimizer_offload:  # the host optimizer (torch AdamW) keeps fp32 moments
            out.update(exp_avg_dtype="bf16", exp_avg_sq_dtype="bf16")
    return out


def option_model(cp_algorithm: str, recompute: str, offload: str, ms: ModelState, cp_size: int = 1,
                 ulysses_size: int = 1, mlp_tiles: int = 1, loss_chunks: int = 1,
                 sequence_chunks: int = 1, prefetch_depth: int = 1, recompute_layers: int = 1) -> LongContextOptions:
    """The option model (nemo_longctx.options) that runs a planner candidate: cp_algorithm "none" = cp=none (ring
    attention, size 1); tiles / chunks 1 = off."""
    name, modules = RECOMPUTE_GROUP[recompute]
    cp = {"size": cp_size, "algorithm": "ring" if cp_algorithm == "none" else cp_algorithm}
    if cp_algorithm == "hybrid":
        cp["ulysses_size"] = ulysses_size
    rc = {"name": name, **({"modules": list(modules)} if modules else {})}
    if sequence_chunks > 1:
        rc["sequence_chunks"] = sequence_chunks
    if recompute_layers > 1:
        rc["num_layers"] = recompute_layers
    return LongContextOptions.from_dict({
        "cp": cp, "recompute": rc,
        "offload": {"name": offload, **({"prefetch_depth": prefetch_depth} if prefetch_depth != 1 else {})},
        "tiling": {"mlp_tiles": mlp_tiles if mlp_tiles > 1 else "off",
                   "loss_chunks": loss_chunks if loss_chunks > 1 else "off"},
        "optim": optim_fields(ms)})


def candidate_of(options: LongContextOptions, seq_length: int, tp: int = 1,
                 sequence_parallel: bool = False) -> Optional[Candidate]:
    """The planner's candidate for a run's options (``option_model``'s inverse, "auto" counts resolved for this
    length), or None where the planner does not model them (``offload=modules``, selective recompute of modules
    other than ``[mlp]`` or ``[core_attn]``)."""
    cp, mem, state = options.cp, options.memory, options.optim.state
    algorithm = "none" if cp.size == 1 else cp.algorithm
    ulysses = cp.size if algorithm == "ulysses" else int(cp.ulysses_size or 1) if algorithm == "hybrid" else 1
    labels = {(name, tuple(modules or ())): label for label, (name, modules) in RECOMPUTE_GROUP.items()}
    modules = tuple(mem.recompute_modules) if mem.recompute == "selective" else ()
    recompute = labels.get((mem.recompute, modules))  # RECOMPUTE_GROUP read backwards
    if recompute is None or mem.offload not in PLANNED_OFFLOAD:
        return None
    tiles, chunks = options.tiling.counts(seq_length, cp.size, tp, sequence_parallel)
    n = mem.sequence_chunks
    n = 1 if n == "off" else auto_tiles(seq_length // cp.size, DEFAULT_SEQUENCE_CHUNK_TOKENS) if n == "auto" else int(n)
    sharding = "fsdp" if state.megatron_fsdp else "distributed" if state.use_distributed_optimizer else "ddp"
    ms = ModelState(sharding, float(state.optimizer_offload_fraction) if state.optimizer_cpu_offload else 0.0,
                    bool(state.use_precision_aware_optimizer))
    return Candidate(algorithm, cp.size, ulysses, tp, recompute, mem.offload, tiles, chunks, int(mem.prefetch_depth),
                     ms, n, int(mem.recompute_num_layers) if n > 1 else 1)


def candidate_options(c: Candidate) -> LongContextOptions:
    return option_model(c.cp_algorithm, c.recompute, c.offload, c.model_state, c.cp_size, c.ulysses_size,
                        c.mlp_tiles, c.loss_chunks, c.sequence_chunks, c.prefetch_depth, c.recompute_layers)


def structural_accept(cp_algorithm: str, recompute: str, offload: str, model_state: ModelState,
                      precision: str = "bf16-mixed") -> bool:
    """The planner's option filter when no `accept` is given: the option model's own rules (no copy of them here)
    for a GPU target with TransformerEngine (the plan app adds the CPU target's refusals: `plan.app_accepts`)."""
    opts = option_model(cp_algorithm, recompute, offload, model_state)
    return not opts.problems(Context(precision=precision, cuda=True, te=True))


def candidate_configs(shape: ModelShape, seq_length: int, hw: Hardware,
                      recompute: Iterable[str] = RECOMPUTE, offload: Iterable[str] = OFFLOAD,
                      algorithms: Iterable[str] = CP_ALGORITHMS, max_tp: int = 8,
                      model_states: Iterable[ModelState] = (ModelState(),), accept=None,
                      tiling: bool = True, sequence_chunks: bool = True) -> list[Candidate]:
    """Every valid layout x memory option x model state for `hw.gpus` GPUs (all GPUs used: dp = gpus / (tp * cp)).
    `accept(cp_algorithm, recompute, offload, model_state) -> bool` keeps the option combinations the train app
    accepts (default: `structural_accept`); cp_algorithm is "none" for cp_size 1. `tiling=False`: no tiled MLP or
    chunked loss (a front end without them)."""
    accept = accept or structural_accept
    model_states = tuple(model_states)
    recompute, offload = tuple(recompute), tuple(offload)
    out = []
    hq, hkv = shape.num_attention_heads, shape.num_query_groups
    algorithms = tuple(algorithms)
    for tp in _powers_of_two_dividing(hw.gpus, min(max_tp, hw.gpus_per_node)):
        if hq % tp or hkv % tp:
            continue
        for cp in _powers_of_two_dividing(hw.gpus // tp, hw.gpus):
            if layout_problems(seq_length, cp, tp, 1, hw.gpus, sequence_parallel=tp > 1):  # train's own rule
                continue
            layouts = []
            if cp == 1:
                layouts.append(("none", 1))
            else:
                if "ring" in algorithms:
                    layouts.append(("ring", 1))
                if "ulysses" in algorithms and (hq // tp) % cp == 0:
                    layouts.append(("ulysses", cp))
                if "hybrid" in algorithms:
                    for u in _powers_of_two_dividing(cp, hw.gpus_per_node // tp):
                        if 1 < u < cp and (hq // tp) % u == 0:
                            layouts.append(("hybrid", u))
            tokens = seq_length / cp
            tiles = sorted({1, planned_mlp_tiles(tokens, tp)}) if tiling else [1]
            chunks = sorted({1, planned_loss_chunks(tokens)}) if tiling else [1]
            # sequence-chunked layers run without sequence parallelism (the option model refuses it), under every
            # CP algorithm; they make the tiled MLP redundant (a chunk's MLP is chunk-sized)
            seq_chunks = planned_sequence_chunks(tokens) if (sequence_chunks and tp == 1) else []
            for algo, u in layouts:
                for rc in recompute:
                    for off in offload:
                        for ms in model_states:
                            if not accept(algo, rc, off, ms):
                                continue
                            # Megatron-FSDP refuses the gradients the chunked loss makes in forward (option model)
                            ms_chunks = [1] if ms.sharding == "fsdp" else chunks
                            for t in tiles:
                                for ch in ms_chunks:
                                    out.append(Candidate(algo, cp, u, tp, rc, off, t, ch, model_state=ms))
                            if rc != "full":
                                continue
                            # layer inputs fetched on demand (prefetch_depth 0): one layer input less on the device;
                            # at the lengths chunking is for, one layer's backward hides far more than the copy
                            depths = (1, 0) if off == "layer_input" else (1,)
                            # 2 or 4 layers per checkpoint: half / a quarter of the layer inputs on the host
                            ks = [k for k in (1, 2, 4) if shape.num_layers % k == 0] if off == "layer_input" else [1]
                            chunked_ok = seq_chunks and not candidate_options(Candidate(
                                algo, cp, u, tp, rc, off, model_state=ms, sequence_chunks=2)).problems()
                            for n in (seq_chunks if chunked_ok else ()):
                                for ch in ms_chunks:
                                    for depth in depths:
                                        for k in ks:
                                            out.append(Candidate(algo, cp, u, tp, rc, off, 1, ch, prefetch_depth=depth,
                                                                 model_state=ms, sequence_chunks=n,
                                                                 recompute_layers=k))
    return out


def evaluate(shape: ModelShape, seq_length: int, hw: Hardware, c: Candidate, precision: Precision = Precision(),
             coef: ActivationCoefficients | None = None, cost: CostModel = CostModel()) -> Evaluation:
    mem = memory_breakdown(shape, seq_length, hw, c, precision, coef)
    notes = []
    fits_gpu = mem.total <= hw.gpu_memory_gb * GIB
    fits_host = mem.host_per_node <= hw.host_memory_gb * GIB
    if not fits_gpu:
        notes.append(f"needs {mem.total / GIB:.1f} GiB per GPU")
    if not fits_host:
        notes.append(f"needs {mem.host_per_node / GIB:.0f} GiB host memory per node")
    return Evaluation(c, hw.gpus // (c.tp * c.cp_size), int(seq_length // c.cp_size), mem, fits_gpu, fits_host,
                      relative_cost(shape, seq_length, hw, c, precision, cost), notes)


def _rank(evs: list[Evaluation], cost_tolerance: float = 0.01) -> list[Evaluation]:
    """Fitting candidates by cost, then the rest by memory. The first is the least-memory candidate among those
    within `cost_tolerance` (relative) of the cheapest: finer cost differences are below the model's resolution,
    while memory headroom protects against its errors."""
    fitting = sorted((e for e in evs if e.fits), key=lambda e: (round(e.cost, 4), e.memory.total))
    if fitting:
        near = [e for e in fitting if e.cost <= fitting[0].cost * (1 + cost_tolerance)]
        best = min(near, key=lambda e: (e.memory.total, e.cost))
        fitting.remove(best)
        fitting.insert(0, best)
    others = sorted((e for e in evs if not e.fits), key=lambda e: (e.memory.total, e.cost))
    return fitting + others


@dataclass
class Plan:
    shape: ModelShape
    seq_length: int
    hardware: Hardware
    precision: Precision
    evaluations: list  # ranked: fitting by cost, then the rest by memory
    chosen: Evaluation | None
    search: dict = field(default_factory=dict)  # candidate_configs keywords this plan searched with

    def to_dict(self) -> dict:
        return {"model": asdict(self.shape), "seq_length": self.seq_length, "hardware": asdict(self.hardware),
                "precision": asdict(self.precision),
                "chosen": self.chosen.to_dict() if self.chosen else None,
                "candidates": [e.to_dict() for e in self.evaluations]}


def _validate(shape: ModelShape, seq_length: int) -> None:
    if seq_length < 2 or int(seq_length) != seq_length:
        raise ValueError(f"plan.seq_length must be an integer >= 2, got {seq_length!r}")


def plan(shape: ModelShape, seq_length: int, hw: Hardware, precision: Precision = Precision(),
         coef: ActivationCoefficients | None = None, cost: CostModel = CostModel(), cost_tolerance: float = 0.01,
         **search) -> Plan:
    """Evaluate every candidate; `chosen` is the cheapest one that fits (None when none fits), see `_rank`."""
    _validate(shape, seq_length)
    evs = [evaluate(shape, seq_length, hw, c, precision, coef, cost)
           for c in candidate_configs(shape, seq_length, hw, **search)]
    ranked = _rank(evs, cost_tolerance)
    chosen = ranked[0] if ranked and ranked[0].fits else None
    return Plan(shape, seq_length, hw, precision, ranked, chosen, dict(search))


def _fits_any(shape, seq_length, hw, precision, coef, cost, **search) -> Evaluation | None:
    p = plan(shape, seq_length, hw, precision, coef, cost, **search)
    return p.chosen


def what_is_missing(p: Plan, coef: ActivationCoefficients | None = None, cost: CostModel = CostModel(),
                    max_gpus: int = 16384) -> str:
    """A sentence naming the smallest change that makes the request fit (more GPUs, more host memory, bigger GPUs)."""
    hw, shape, s = p.hardware, p.shape, p.seq_length
    options = []
    n = hw.gpus
    while n < max_gpus:
        n *= 2
        if _fits_any(shape, s, replace(hw, gpus=n), p.precision, coef, cost, **p.search) is not None:
            options.append(f"needs >= {n} GPUs of {hw.gpu_memory_gb:g} GB")
            break
    device_ok_offload = [e for e in p.evaluations if e.fits_gpu and not e.fits_host]
    if device_ok_offload:
        best = min(device_ok_offload, key=lambda e: e.memory.host_per_node)
        options.append(f"host memory >= {math.ceil(best.memory.host_per_node / GIB)} GB per node for offload "
                       f"({best.candidate.label()})")
    host_ok = [e for e in p.evaluations if e.fits_host]
    smallest = min(host_ok, key=lambda e: e.memory.total) if host_ok else None
    if smallest is not None:
        options.append(f"GPUs with >= {math.ceil(smallest.memory.total / GIB)} GB "
                       f"({smallest.candidate.label()})")
    have = (f"{shape.name} at seq_length={s} does not fit on {hw.gpus} GPUs of {hw.gpu_memory_gb:g} GB "
            f"with {hw.host_memory_gb:g} GB host memory per node")
    if not p.evaluations:
        return have + ": no valid parallel layout (check heads / query groups vs GPU count and seq_length)"
    return have + ": " + ", or ".join(options)


def plan_or_raise(shape: ModelShape, seq_length: int, hw: Hardware, precision: Precision = Precision(),
                  coef: ActivationCoefficients | None = None, cost: CostModel = CostModel(), **search) -> Plan:
    p = plan(shape, seq_length, hw, precision, coef, cost, **search)
    if p.chosen is None:
        raise PlanError(what_is_missing(p, coef, cost))
    return p


def memory_curve(shape: ModelShape, seq_lengths: Iterable[int], hw: Hardware, c: Candidate,
                 precision: Precision = Precision(), coef: ActivationCoefficients | None = None) -> list[dict]:
    """Per-GPU breakdown (GiB) of one fixed candidate across sequence lengths (for plots)."""
    return [dict(seq_length=s, **memory_breakdown(shape, s, hw, c, precision, coef).gib()) for s in seq_lengths]
