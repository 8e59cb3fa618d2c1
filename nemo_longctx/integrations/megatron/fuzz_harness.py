"""One fuzz case trained on this process's ranks with Megatron-core's own machinery, and its parameters gathered.

``train_case(case, init)`` runs on every rank of a default process group whose size is ``case.world`` (the caller
initialises it): Megatron's model-parallel state for the case's layout, a tiny fp32 ``ChunkedLossGPTModel`` per
pipeline chunk built from Megatron's local spec with nemo_longctx's core attention (``long_context_layer_spec``), the
case's memory and tiling options applied as the front ends apply them, Megatron's ``DistributedDataParallel`` (or
Megatron-FSDP), ``get_megatron_optimizer`` (SGD, no momentum, gradient norm computed and never clipped),
``get_forward_backward_func()`` (1F1B or interleaved with pipelining), per-token loss (``calculate_per_token_loss``:
sums everywhere, one division by the global token count in ``finalize_model_grads``).

The global batch is ``micro_batches x dp`` sequences, data-parallel rank d taking sequences d*M .. d*M+M-1 (Megatron's
sampler), each zigzag-sharded over the CP group (dense) or laid out per document (packed). The reference is the same
function on one rank (``Case.reference``): no parallelism, ``micro_batches x dp`` micro-batches, the same sequences.
The initial weights are the reference's: each rank takes its shard of every full tensor (``_shard``), so every layout
starts from the same model. After the steps, every full parameter is rebuilt on every rank by one all-reduce of the
shards (each placed where it belongs, with a count of holders and a sum of squares, so replicas that disagree are
measured too: ``replica_spread``).

Every step also runs the run guards (``run_guards``: CP really active, tokens per step), so no composition may trip
them falsely.

Returns ``{"losses", "grad_norms", "params", "replica_spread"}`` (+ ``"init"`` when no ``init`` was given).
"""

from __future__ import annotations

import contextlib
import functools
import re
from typing import Any, Callable, Dict, Iterator, List, Optional, Tuple

import torch

from .fuzz_cases import SEQ_LENGTH, Case

VOCAB = 128
HIDDEN, HEADS, HEAD_DIM, FFN = 64, 8, 8, 128
STEPS, LR = 3, 0.5
# Megatron's distributed optimizer and Megatron-FSDP take Adam only: those cases (and their references) train with
# Adam. Adam divides each gradient element by its own magnitude, so a wrong gradient scale hardly moves its update:
# the gradient norm (compared every step) is what sees a scale. Its epsilon is large enough that elements whose
# gradient is near zero (where reduction order decides the sign) move by next to nothing rather than by lr.
ADAM_LR, ADAM_EPS = 0.01, 1e-4
GROUPS = {"gqa": 4, "mqa": 1, "mha": 8, "moe": 4, "mla": 8, "window": 4}
WINDOW = (8, 0)
EXPERTS = 4


def first_line(e: BaseException) -> str:
    text = str(e).strip()
    return f"{type(e).__name__}: {text.splitlines()[0]}" if text else type(e).__name__


class StackRefused(Exception):
    """The stack (Megatron-core, or nemo_longctx's build-time checks) refused to build the case: a refusal by name,
    raised before the first step, not a wrong result."""


class OptionsRefused(StackRefused):
    """The option model's rules that need the model config (``validation.model_problems``) refused the case."""


# ------------------------------------------------------------------------------------------------ the model
def model_config(case: Case) -> Any:
    """The case's Megatron ``TransformerConfig`` (``MLATransformerConfig`` for MLA): tiny, fp32, no dropout."""
    import torch.nn.functional as F
    from megatron.core.transformer.transformer_config import MLATransformerConfig, TransformerConfig

    kw: Dict[str, Any] = dict(
        num_layers=case.num_layers, hidden_size=HIDDEN, num_attention_heads=HEADS, ffn_hidden_size=FFN,
        tensor_model_parallel_size=case.tp, pipeline_model_parallel_size=case.pp,
        virtual_pipeline_model_parallel_size=case.vpp, context_parallel_size=case.cp,
        expert_model_parallel_size=case.ep, expert_tensor_parallel_size=1, sequence_parallel=case.sp,
        pipeline_dtype=torch.float32, params_dtype=torch.float32, calculate_per_token_loss=True,
        attention_dropout=0.0, hidden_dropout=0.0, normalization="RMSNorm", gated_linear_unit=True,
        activation_func=F.silu, add_bias_linear=False, masked_softmax_fusion=False, bias_activation_fusion=False,
        persist_layer_norm=False, bias_dropout_fusion=False, apply_rope_fusion=False,
        gradient_accumulation_fusion=False, init_method_std=0.05, use_cpu_initialization=True)
    if case.model == "moe":
        kw.update(num_moe_experts=EXPERTS, moe_router_topk=2, moe_ffn_hidden_size=FFN // 2, moe_aux_loss_coeff=1e-2,
                  moe_router_load_balancing_type="aux_loss", moe_token_dispatcher_type="allgather",
                  moe_grouped_gemm=False)
    if case.model == "window":
        kw["window_size"] = WINDOW
    if case.model == "mla":
        return MLATransformerConfig(**kw, q_lora_rank=None, kv_lora_rank=16, qk_head_dim=HEAD_DIM,
                                    qk_pos_emb_head_dim=HEAD_DIM, v_head_dim=HEAD_DIM, rope_type="rope",
                                    rotary_base=10000)
    return TransformerConfig(**kw, num_query_groups=GROUPS[case.model], kv_channels=HEAD_DIM)


def _layer_spec(case: Case, config: Any) -> Any:
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec

    from .norm_recompute_layer import norm_recompute_configured
    from .spec import long_context_layer_spec
    from .tiled_mlp_layer import with_tiled_mlp

    base = get_gpt_layer_local_spec(num_experts=EXPERTS if case.model == "moe" else None, moe_grouped_gemm=False,
                                    multi_latent_attention=case.model == "mla", normalization="RMSNorm")
    kwargs = {"ulysses_size": case.ulysses_size} if case.cp > 1 and case.cp_algorithm == "hybrid" else {}
    spec = long_context_layer_spec(base, case.cp_algorithm if case.cp > 1 else "ring",
                                   norm_recompute=norm_recompute_configured(config), **kwargs)
    return with_tiled_mlp(spec, case.mlp_tiles)


def build_chunks(case: Case) -> Tuple[List[Any], Any, Any]:
    """(model chunks, config, memory runtime) for this rank (Megatron's parallel state must be initialised)."""
    from megatron.core import parallel_state as ps

    from .gpt_chunked_loss import ChunkedLossGPTModel, use_chunked_loss
    from .memory_options import apply_recompute_fields, attach_memory_options
    from .spec import resolve_layer_spec
    from .validation import model_problems

    options = case.options()
    config = model_config(case)
    config.seq_length = SEQ_LENGTH
    problems = model_problems(config, options, case.world, case.tp, case.pp)
    if problems:
        raise OptionsRefused(problems[0])
    config = apply_recompute_fields(config, options.memory)
    chunks = []
    for vp in range(case.vpp or 1):
        vp_stage = vp if case.vpp else None
        chunks.append(ChunkedLossGPTModel(
            config, resolve_layer_spec(_layer_spec(case, config), config, vp_stage), vocab_size=VOCAB,
            max_sequence_length=SEQ_LENGTH,
            pre_process=ps.is_pipeline_first_stage(ignore_virtual=False, vp_stage=vp_stage),
            post_process=ps.is_pipeline_last_stage(ignore_virtual=False, vp_stage=vp_stage),
            position_embedding_type="none" if case.model == "mla" else "rope",
            share_embeddings_and_output_weights=False, vp_stage=vp_stage))
    runtime = attach_memory_options(chunks, options.memory)
    if case.loss_chunks != "off":
        for chunk in chunks:
            use_chunked_loss(chunk, case.loss_chunks, 16)
    return chunks, config, runtime


# ------------------------------------------------------------------------------------------ shards and names
_LAYER = re.compile(r"^(.*?decoder\.layers\.)(\d+)\.(.*)$")
_EXPERT = re.compile(r"^(.*?local_experts\.)(\d+)\.(.*)$")


def global_names(chunk: Any, case: Case) -> Dict[str, Tuple[str, Any]]:
    """{global name: (local name, parameter)} of a chunk: layer indices from each layer's ``layer_number`` (the
    pipeline offset included), expert indices shifted by this rank's first expert."""
    from megatron.core import parallel_state as ps
    from megatron.core.transformer.transformer_layer import TransformerLayer

    numbers = {name: m.layer_number for name, m in chunk.named_modules() if isinstance(m, TransformerLayer)}
    first_expert = ps.get_expert_model_parallel_rank() * (EXPERTS // case.ep) if case.model == "moe" else 0
    out = {}
    for name, p in chunk.named_parameters():
        g = name
        m = _LAYER.match(name)
        if m:
            layer = numbers.get(m.group(1) + m.group(2))
            if layer is None:
                raise RuntimeError(f"fuzz: no TransformerLayer found for parameter {name}")
            g = f"{m.group(1)}{layer - 1}.{m.group(3)}"
        e = _EXPERT.match(g)
        if e:
            g = f"{e.group(1)}{int(e.group(2)) + first_expert}.{e.group(3)}"
        out[g] = (name, p)
    return out


def _shard(full: torch.Tensor, name: str, p: Any, config: Any) -> torch.Tensor:
    """This rank's piece of the full tensor ``full`` for parameter ``p`` (Megatron's tensor-parallel split)."""
    from megatron.core import parallel_state as ps

    if not getattr(p, "tensor_model_parallel", False):
        return full
    expert = not getattr(p, "allreduce", True)
    size = ps.get_expert_tensor_parallel_world_size() if expert else ps.get_tensor_model_parallel_world_size()
    rank = ps.get_expert_tensor_parallel_rank() if expert else ps.get_tensor_model_parallel_rank()
    dim = p.partition_dim
    if size == 1:
        return full
    if name.endswith("linear_fc1.weight") and config.gated_linear_unit:  # [gate; up], each split over TP
        gate, up = full.chunk(2, dim)
        return torch.cat([gate.chunk(size, dim)[rank], up.chunk(size, dim)[rank]], dim)
    return full.chunk(size, dim)[rank]


def load_full_state(chunks: List[Any], case: Case, config: Any, full: Dict[str, torch.Tensor]) -> None:
    """Copy each rank's shard of the full (reference) parameters into the built chunks."""
    with torch.no_grad():
        for chunk in chunks:
            for g, (name, p) in global_names(chunk, case).items():
                if g not in full:
                    raise RuntimeError(f"fuzz: parameter {g} (local {name}) is not in the reference model")
                shard = _shard(full[g], g, p, config)
                if tuple(shard.shape) != tuple(p.shape):
                    raise RuntimeError(f"fuzz: {g}: shard {tuple(shard.shape)} vs parameter {tuple(p.shape)}")
                p.copy_(shard)


def gather_full_state(chunks: List[Any], case: Case, config: Any, shapes: Dict[str, Tuple[int, ...]]
                      ) -> Tuple[Dict[str, torch.Tensor], float]:
    """(every full parameter rebuilt from the shards on all ranks, the largest disagreement between replicas
    relative to the tensor's scale). One all-reduce of [sum | count | sum of squares] over the world."""
    import torch.distributed as dist

    names = sorted(shapes)
    offsets, total = {}, 0
    for n in names:
        offsets[n] = total
        total += int(torch.Size(shapes[n]).numel())
    buf = torch.zeros(3, total, dtype=torch.float64)
    for chunk in chunks:
        for g, (name, p) in global_names(chunk, case).items():
            value = _local_value(p).detach().to(torch.float64)
            index = _shard(torch.arange(int(torch.Size(shapes[g]).numel())).view(shapes[g]), g, p, config)
            pos = index.reshape(-1) + offsets[g]
            buf[0].index_add_(0, pos, value.reshape(-1))
            buf[1].index_add_(0, pos, torch.ones_like(value.reshape(-1)))
            buf[2].index_add_(0, pos, value.reshape(-1) ** 2)
    dist.all_reduce(buf)
    if bool((buf[1] == 0).any()):
        missing = [n for n in names if bool((buf[1, offsets[n]: offsets[n] + int(torch.Size(shapes[n]).numel())]
                                             == 0).any())]
        raise RuntimeError(f"fuzz: no rank holds (part of) {missing[:4]}")
    mean = buf[0] / buf[1]
    spread = (buf[2] / buf[1] - mean ** 2).clamp_min(0).sqrt()
    out, worst = {}, 0.0
    for n in names:
        k = int(torch.Size(shapes[n]).numel())
        t = mean[offsets[n]: offsets[n] + k]
        out[n] = t.view(shapes[n]).to(torch.float32)
        scale = float(t.abs().max().clamp_min(1e-12))
        worst = max(worst, float(spread[offsets[n]: offsets[n] + k].max()) / scale)
    return out, worst


def _local_value(p: Any) -> torch.Tensor:
    """A parameter's full local (tensor-parallel shard) value: Megatron-FSDP's DTensor shards gathered."""
    full_tensor = getattr(p, "full_tensor", None)
    return full_tensor() if callable(full_tensor) else p


# ---------------------------------------------------------------------------------------------------- data
def sequences(case: Case, seed: int = 17) -> List[Dict[str, torch.Tensor]]:
    """The global batch of one step: ``micro_batches x dp`` sequences of ``SEQ_LENGTH`` tokens (packed: the
    documents' boundaries in NeMo's ``cu_seqlens`` keys, positions restarting per document)."""
    g = torch.Generator().manual_seed(seed)
    out = []
    for _ in range(case.micro_batches * case.dp):
        seq = torch.randint(0, VOCAB, (1, SEQ_LENGTH + 1), generator=g)
        batch = {"tokens": seq[:, :-1], "labels": seq[:, 1:], "loss_mask": torch.ones(1, SEQ_LENGTH)}
        if case.data == "packed":
            cu = [0]
            for n in case.documents:
                cu.append(cu[-1] + n)
            batch["position_ids"] = torch.cat([torch.arange(n) for n in case.documents])[None]
            batch["cu_seqlens"] = torch.tensor([cu], dtype=torch.int32)
            batch["loss_mask"][0, torch.tensor(cu[1:]) - 1] = 0  # no label across a document's end
        else:
            batch["position_ids"] = torch.arange(SEQ_LENGTH)[None]
        out.append(batch)
    return out


def _local_batch(batch: Dict[str, torch.Tensor], case: Case, inject: Optional[str]) -> Dict[str, Any]:
    from megatron.core import parallel_state as ps

    from .batch import shard_batch_for_cp, shard_packed_batch_for_cp

    cp, rank = ps.get_context_parallel_world_size(), ps.get_context_parallel_rank()
    if case.data == "packed":
        return shard_packed_batch_for_cp(batch, cp, rank)
    if inject == "zigzag_slice" and cp > 1:  # a contiguous slice where the attention expects the zigzag one
        return {k: v.chunk(cp, 1)[rank] for k, v in batch.items()}
    return shard_batch_for_cp(batch, cp, rank)


# ---------------------------------------------------------------------------------------------------- train
def _wrap(chunks: List[Any], case: Case, config: Any) -> List[Any]:
    from megatron.core.distributed import DistributedDataParallel, DistributedDataParallelConfig

    if case.state == "fsdp":
        from megatron.core.distributed.fsdp.mcore_fsdp_adapter import FullyShardedDataParallel

        from .model_state import MEGATRON_FSDP_DDP_FIELDS

        ddp_config = DistributedDataParallelConfig(**MEGATRON_FSDP_DDP_FIELDS)
        return [FullyShardedDataParallel(config, ddp_config, c) for c in chunks]
    ddp_config = DistributedDataParallelConfig(use_distributed_optimizer=case.state == "distributed")
    return [DistributedDataParallel(config, ddp_config, c, disable_bucketing=i > 0) for i, c in enumerate(chunks)]


def _optimizer(case: Case, models: List[Any]) -> Any:
    from megatron.core.optimizer import OptimizerConfig, get_megatron_optimizer

    adam = case.optimizer_name == "adam"
    return get_megatron_optimizer(OptimizerConfig(
        optimizer=case.optimizer_name, lr=ADAM_LR if adam else LR, sgd_momentum=0.0, adam_eps=ADAM_EPS,
        weight_decay=0.0, clip_grad=1e9, params_dtype=torch.float32,
        use_distributed_optimizer=case.state in ("distributed", "fsdp")), models)


def _loss_func(loss_mask: torch.Tensor, scale: float, output: torch.Tensor):
    mask = loss_mask.reshape(-1).float()
    total = (output.float().reshape(-1) * mask).sum() * scale
    tokens = mask.sum().to(torch.int)
    return total, tokens, {"lm loss": torch.stack([total.detach(), mask.sum()])}


def _forward_step(case: Case, inject: Optional[str]) -> Callable:
    from megatron.core import parallel_state as ps

    from .gpt_chunked_loss import loss_mask_scope

    def step(data_iterator: Iterator, model: Any):
        batch = _local_batch(next(data_iterator), case, inject)
        loss_mask = batch["loss_mask"]
        scale = float(ps.get_context_parallel_world_size()) if inject == "loss_cp_scale" else 1.0
        with loss_mask_scope(loss_mask):
            output = model(batch["tokens"], batch["position_ids"], None, labels=batch["labels"],
                           packed_seq_params=batch.get("packed_seq_params"))
        return output, functools.partial(_loss_func, loss_mask, scale)

    return step


def _step_loss(records: List[Dict[str, torch.Tensor]], case: Case) -> float:
    """The step's global mean token loss: the last stage's sums over DP x CP (and the micro-batches)."""
    import torch.distributed as dist
    from megatron.core import parallel_state as ps

    acc = torch.zeros(2, dtype=torch.float64)
    if ps.is_pipeline_last_stage(ignore_virtual=True) and ps.get_tensor_model_parallel_rank() == 0:
        for r in records:
            acc += r["lm loss"].to(torch.float64)
    dist.all_reduce(acc)
    return float(acc[0] / acc[1])


def _microbatches(case: Case, batches: List[Dict[str, torch.Tensor]], inject: Optional[str]) -> List[Dict]:
    from megatron.core import parallel_state as ps

    d = ps.get_data_parallel_rank()
    if inject == "dp_same_data":  # every data-parallel rank reads the first rank's sequences
        d = 0
    return batches[d * case.micro_batches: (d + 1) * case.micro_batches]


@contextlib.contextmanager
def injected(inject: Optional[str]):
    """Plant a defect in nemo_longctx's own code for the duration of a case (the kinds the harness cannot plant
    through its own data path)."""
    if inject != "window_dropped":
        yield
        return
    from unittest import mock

    from . import core_attention

    with mock.patch.object(core_attention, "is_layer_window_attention", lambda *a, **k: False):
        yield


def train_case(case: Case, init: Optional[Dict[str, torch.Tensor]] = None, inject: Optional[str] = None,
               steps: int = STEPS) -> Dict[str, Any]:
    """Train ``case`` on this process group (see the module docstring)."""
    from megatron.core import parallel_state as ps
    from megatron.core import tensor_parallel
    from megatron.core.distributed import finalize_model_grads
    from megatron.core.pipeline_parallel import get_forward_backward_func
    from megatron.core.transformer.moe.moe_utils import clear_aux_losses_tracker

    from nemo_longctx.attention import count_bytes_sent

    from .batch import LAST_SHARD
    from .run_guards import core_attentions, cp_problems, raise_if, tokens_problems

    try:
        ps.initialize_model_parallel(tensor_model_parallel_size=case.tp, pipeline_model_parallel_size=case.pp,
                                     virtual_pipeline_model_parallel_size=case.vpp, context_parallel_size=case.cp,
                                     expert_model_parallel_size=case.ep, expert_tensor_parallel_size=1)
        torch.manual_seed(5)
        tensor_parallel.model_parallel_cuda_manual_seed(5)
        with injected(inject):
            chunks, config, runtime = build_chunks(case)
    except OptionsRefused:
        ps.destroy_model_parallel()
        raise
    except (AssertionError, ValueError, NotImplementedError) as e:
        ps.destroy_model_parallel()
        raise StackRefused(first_line(e)) from e
    try:
        out: Dict[str, Any] = {}
        if init is None:  # the reference: its initial weights are every layout's
            if case.world != 1:
                raise RuntimeError("fuzz: only a one-rank run may draw the initial weights")
            out["init"] = {g: p.detach().clone() for g, (_, p) in global_names(chunks[0], case).items()}
            init = out["init"]
        load_full_state(chunks, case, config, init)
        try:
            models = _wrap(chunks, case, config)
            optimizer = _optimizer(case, models)
        except (AssertionError, ValueError, NotImplementedError) as e:
            raise StackRefused(first_line(e)) from e
        config.finalize_model_grads_func = finalize_model_grads
        if case.state != "fsdp" and len(models) == 1:
            config.no_sync_func = models[0].no_sync
        elif case.state != "fsdp":
            config.no_sync_func = [m.no_sync for m in models]
        batches = sequences(case)
        forward_step = _forward_step(case, inject)
        attentions = core_attentions(chunks)
        if inject == "cp_inactive":  # each rank's attention over its own slice only
            for m in attentions:
                m.cp_size = 1
        LAST_SHARD.update(sequence_tokens=None, local_tokens=None)
        losses, norms = [], []
        for _ in range(steps):
            for m in models:
                m.zero_grad_buffer()
            optimizer.zero_grad()
            mine = _microbatches(case, batches, inject)
            iterators = [iter(mine) for _ in models] if len(models) > 1 else iter(mine)
            with count_bytes_sent() as sent:
                records = get_forward_backward_func()(
                    forward_step_func=forward_step, data_iterator=iterators, model=models if len(models) > 1
                    else models[0], num_microbatches=case.micro_batches, seq_length=SEQ_LENGTH,
                    micro_batch_size=1, forward_only=False)
            step = len(losses)
            raise_if(cp_problems(attentions, case.cp, LAST_SHARD["sequence_tokens"], sent.bytes_sent, step)
                     + tokens_problems(LAST_SHARD["local_tokens"], case.micro_batches, case.dp * case.cp,
                                       case.micro_batches * case.dp * SEQ_LENGTH, step))
            ok, grad_norm, _ = optimizer.step()
            if not ok:
                raise RuntimeError("fuzz: the optimizer step was skipped")
            runtime.after_step("in the fuzz step")
            clear_aux_losses_tracker()
            losses.append(_step_loss(records, case))
            norms.append(float(grad_norm))
        shapes = {g: tuple(t.shape) for g, t in init.items()}
        params, spread = gather_full_state(chunks, case, config, shapes)
        out.update(losses=losses, grad_norms=norms, params=params, replica_spread=spread)
        runtime.detach()
        return out
    finally:
        ps.destroy_model_parallel()


def compare(got: Dict[str, Any], want: Dict[str, Any]) -> Dict[str, float]:
    """Worst relative differences of the per-step losses, gradient norms and final parameters (each parameter
    against its own largest magnitude), and the replicas' disagreement."""
    loss = max(abs(a - b) / max(abs(b), 1e-12) for a, b in zip(got["losses"], want["losses"]))
    norm = max(abs(a - b) / max(abs(b), 1e-12) for a, b in zip(got["grad_norms"], want["grad_norms"]))
    param = 0.0
    for name, w in want["params"].items():
        g = got["params"][name]
        param = max(param, float((g - w).abs().max()) / max(float(w.abs().max()), 1e-12))
    return {"loss": loss, "grad_norm": norm, "param": param, "replicas": float(got.get("replica_spread", 0.0))}
