"""A small Megatron GPT (local spec + nemo_longctx core attention) run for a few steps under recompute/offload
options, with the activation tracker on: used by the parity tests and ``bench/memory_table.py``.

Needs Megatron's model-parallel state initialized (``parallel_state.initialize_model_parallel``); the batch is the
full sequence, zigzag-sharded over the CP group like the train app's data step. Each step: fixed RNG seeds (dropout
masks identical across settings), forward + backward of ``sum(token losses) / global tokens`` under an
``ActivationTracker``, optional SGD update. Returns losses (all-reduced over CP), per-parameter gradients,
tracker stats and step times.
"""

from __future__ import annotations

import contextlib
import time
from dataclasses import dataclass, field
from typing import Any, Dict, List, Optional

import torch

from .memory_options import MemoryOptions, apply_recompute_fields, attach_memory_options


def tiny_gpt_config(*, num_layers: int = 3, hidden_size: int = 64, heads: int = 4, groups: int = 2,
                    ffn_hidden_size: int = 128, cp: int = 1, hidden_dropout: float = 0.0,
                    dtype: torch.dtype = torch.float32) -> Any:
    """Llama-like TransformerConfig (RMSNorm, SwiGLU, no biases, GQA) that runs on a CPU."""
    import torch.nn.functional as F
    from megatron.core.transformer.transformer_config import TransformerConfig

    return TransformerConfig(
        num_layers=num_layers, hidden_size=hidden_size, num_attention_heads=heads, num_query_groups=groups,
        ffn_hidden_size=ffn_hidden_size, context_parallel_size=cp, attention_dropout=0.0,
        hidden_dropout=hidden_dropout, normalization="RMSNorm", gated_linear_unit=True, activation_func=F.silu,
        add_bias_linear=False, params_dtype=dtype, masked_softmax_fusion=False, bias_activation_fusion=False,
        persist_layer_norm=False, bias_dropout_fusion=False, apply_rope_fusion=False,
        gradient_accumulation_fusion=False, init_method_std=0.02,
    )


def _local_spec(config: Any) -> Any:
    """Megatron's local (non-TE) spec. Where TransformerEngine is installed (the Bridge stack), a model built from a
    *layer* spec still gets TE's final norm, which needs CUDA: use the local *block* spec there (every norm local)."""
    import importlib.util

    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_decoder_block_spec, get_gpt_layer_local_spec

    if importlib.util.find_spec("transformer_engine") is None:
        return get_gpt_layer_local_spec(normalization="RMSNorm",
                                        multi_latent_attention=bool(getattr(config, "multi_latent_attention", False)))
    return get_gpt_decoder_block_spec(config, use_transformer_engine=False, normalization="RMSNorm")


def build_probe_model(config: Any, opts: MemoryOptions, *, vocab_size: int, seq_length: int,
                      cp_kwargs: Optional[Dict[str, Any]] = None, params_from: Any = None, record_events: bool = False,
                      cp_algorithm: str = "ring"):
    """GPTModel with our core attention (``cp_algorithm`` with options ``cp_kwargs``), ``opts`` applied;
    parameters copied from ``params_from`` if given."""
    import copy

    from megatron.core.models.gpt import GPTModel

    from .norm_recompute_layer import norm_recompute_configured
    from .spec import long_context_layer_spec

    config = apply_recompute_fields(copy.copy(config), opts)
    spec = long_context_layer_spec(_local_spec(config), cp_algorithm, norm_recompute=norm_recompute_configured(config),
                                   **(cp_kwargs or {}))
    model = GPTModel(config, spec, vocab_size=vocab_size, max_sequence_length=seq_length,
                     position_embedding_type="rope", share_embeddings_and_output_weights=False)
    if params_from is not None:
        src = dict(params_from.named_parameters())
        with torch.no_grad():
            for name, p in model.named_parameters():
                p.copy_(src[name])
    runtime = attach_memory_options(model, opts, record_events=record_events)
    return model, runtime


def full_batches(steps: int, seq_length: int, vocab_size: int, seed: int = 0) -> List[Dict[str, torch.Tensor]]:
    g = torch.Generator().manual_seed(seed)
    out = []
    for _ in range(steps):
        tokens = torch.randint(0, vocab_size, (1, seq_length + 1), generator=g)
        out.append({"tokens": tokens[:, :-1], "labels": tokens[:, 1:], "loss_mask": torch.ones(1, seq_length),
                    "position_ids": torch.arange(seq_length).unsqueeze(0)})
    return out


@dataclass
class ProbeResult:
    losses: List[float] = field(default_factory=list)
    grads: List[Dict[str, torch.Tensor]] = field(default_factory=list)
    stats: List[Any] = field(default_factory=list)  # tracker MemoryStats per step
    step_times: List[float] = field(default_factory=list)


def run_probe_steps(model: Any, runtime: Any, batches: List[Dict[str, torch.Tensor]], *, lr: float = 0.0,
                    seed: int = 1234, keep_grads: bool = True, count_peak: bool = False,
                    track: bool = True) -> ProbeResult:
    import torch.distributed as dist
    from megatron.core import parallel_state as ps
    from megatron.core import tensor_parallel

    from nemo_longctx.memory.tracker import ActivationTracker

    from .batch import shard_batch_for_cp

    cp, cpr = ps.get_context_parallel_world_size(), ps.get_context_parallel_rank()
    group = ps.get_context_parallel_group() if cp > 1 else None
    model.train()
    res = ProbeResult()
    for i, full in enumerate(batches):
        b = shard_batch_for_cp(dict(full), cp, cpr)
        global_tokens = float(full["loss_mask"].sum())
        torch.manual_seed(seed + i)
        tensor_parallel.model_parallel_cuda_manual_seed(seed + i)
        if group is not None:
            dist.barrier(group)
        t0 = time.perf_counter()
        tracker = ActivationTracker(count_peak=count_peak, params=model.parameters()) if track else None
        with tracker if tracker is not None else contextlib.nullcontext():
            token_loss = model(input_ids=b["tokens"], position_ids=b["position_ids"], attention_mask=None,
                               labels=b["labels"])
            loss = (token_loss.float() * b["loss_mask"]).sum() / global_tokens
            loss.backward()
        if group is not None:
            dist.barrier(group)
        res.step_times.append(time.perf_counter() - t0)
        runtime.after_step(f"after probe step {i}")
        total = loss.detach().clone()
        if group is not None:
            dist.all_reduce(total, group=group)
        res.losses.append(float(total))
        if tracker is not None:
            res.stats.append(tracker.stats())
        if keep_grads:
            res.grads.append({n: p.grad.detach().clone() for n, p in model.named_parameters() if p.grad is not None})
        with torch.no_grad():
            for p in model.parameters():
                if p.grad is not None:
                    if lr:
                        p.sub_(lr * p.grad)
                    p.grad = None
    return res


def layer_device_bytes(stats: Any) -> int:
    """Saved bytes kept on the device inside the layers' scopes (``layer<N>``) at the tracked peak."""
    return sum(v["device"] for k, v in stats.per_scope.items() if k.split("/")[0].startswith("layer"))


def layer_host_bytes(stats: Any) -> int:
    return sum(v["host"] for k, v in stats.per_scope.items() if k.split("/")[0].startswith("layer"))
