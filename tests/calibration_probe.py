"""Measure one Megatron GPTModel step (local spec + nemo_longctx core attention, CPU, fp32) under the activation
tracker for a list of planner ``Candidate``s: saved device / host bytes and the peak of live bytes. Used by
tests/test_planner_calibration.py and bench/max_seqlen.py's CPU form. Runs inside a process group whose size is
the candidates' cp_size (tests/distributed.py's run_distributed)."""

from __future__ import annotations

from typing import Any, List, Sequence, Tuple


def megatron_options(cand) -> Tuple[Any, str, dict]:
    """(MemoryOptions, cp algorithm, cp kwargs) of a planner Candidate; offload moves every saved tensor (min_bytes=0)
    so the planner's per-layer terms can be compared byte for byte."""
    from dataclasses import replace

    from nemo_longctx.planner.search import candidate_options

    memory = candidate_options(cand).memory  # the planner's own mapping onto the option model
    if cand.offload == "layer_input":
        memory = replace(memory, min_bytes=0, prefetch_depth=cand.prefetch_depth)
    algo = cand.cp_algorithm if cand.cp_size > 1 else "ring"
    cp_kwargs = {"ulysses_size": cand.ulysses_size} if algo == "hybrid" else {}
    return memory, algo, cp_kwargs


def build_model(shape, cand, seq: int, *, dtype=None):
    """GPTModel of ``shape`` with the candidate's recompute/offload/tiling applied; returns (model, runtime)."""
    import copy

    import torch
    import torch.nn.functional as F
    from megatron.core.models.gpt import GPTModel
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec
    from megatron.core.transformer.transformer_config import TransformerConfig

    from nemo_longctx.integrations.megatron.gpt_chunked_loss import ChunkedLossGPTModel, use_chunked_loss
    from nemo_longctx.integrations.megatron.memory_options import apply_recompute_fields, attach_memory_options
    from nemo_longctx.integrations.megatron.norm_recompute_layer import norm_recompute_configured
    from nemo_longctx.integrations.megatron.spec import long_context_layer_spec
    from nemo_longctx.integrations.megatron.tiled_mlp_layer import tiled_mlp_layer_spec

    opts, algo, cp_kwargs = megatron_options(cand)
    cfg = TransformerConfig(
        num_layers=shape.num_layers, hidden_size=shape.hidden_size, ffn_hidden_size=shape.ffn_hidden_size,
        num_attention_heads=shape.num_attention_heads, num_query_groups=shape.num_query_groups,
        kv_channels=shape.head_dim, gated_linear_unit=shape.gated_mlp,
        activation_func=F.silu if shape.gated_mlp else F.gelu, normalization="RMSNorm", add_bias_linear=False,
        hidden_dropout=0.0, attention_dropout=0.0, params_dtype=dtype or torch.float32,
        context_parallel_size=cand.cp_size, masked_softmax_fusion=False, bias_activation_fusion=False,
        persist_layer_norm=False, bias_dropout_fusion=False, apply_rope_fusion=False,
        gradient_accumulation_fusion=False)
    cfg = apply_recompute_fields(copy.copy(cfg), opts)
    spec = long_context_layer_spec(get_gpt_layer_local_spec(normalization="RMSNorm"), algo,
                                   norm_recompute=norm_recompute_configured(cfg), **cp_kwargs)
    if cand.mlp_tiles > 1:
        spec = tiled_mlp_layer_spec(spec, cand.mlp_tiles)
    model_class = ChunkedLossGPTModel if cand.loss_chunks > 1 else GPTModel  # the chunked loss built in
    model = model_class(cfg, spec, vocab_size=shape.vocab_size, max_sequence_length=seq,
                        position_embedding_type="rope", share_embeddings_and_output_weights=False)
    if cand.loss_chunks > 1:
        use_chunked_loss(model, cand.loss_chunks)
    return model, attach_memory_options(model, opts)


def measure(rank: int, world: int, shape, cands: Sequence, seqs: Sequence[int]) -> List[dict]:
    """Per (candidate, seq): tracker device/host saved bytes and peak live bytes of one forward + backward."""
    import gc

    import torch
    import torch.distributed as dist

    from nemo_longctx.integrations.megatron import cpu_compat

    cpu_compat.apply()
    from megatron.core import parallel_state as ps
    from megatron.core import tensor_parallel

    from nemo_longctx.integrations.megatron.batch import shard_batch_for_cp
    from nemo_longctx.integrations.megatron.gpt_chunked_loss import loss_mask_scope
    from nemo_longctx.memory.tracker import ActivationTracker

    ps.initialize_model_parallel(context_parallel_size=world)
    tensor_parallel.model_parallel_cuda_manual_seed(1234)
    out = []
    try:
        for cand in cands:
            assert cand.cp_size == world, (cand, world)
            model, rt = build_model(shape, cand, max(seqs))
            model.train()
            for seq in seqs:
                gen = torch.Generator().manual_seed(seq)
                ids = torch.randint(0, shape.vocab_size, (1, seq + 1), generator=gen)
                batch = {"tokens": ids[:, :-1], "labels": ids[:, 1:], "position_ids": torch.arange(seq)[None],
                         "loss_mask": torch.ones(1, seq)}
                if world > 1:
                    batch = shard_batch_for_cp(batch, world, rank)
                # gradients live in buffers allocated before the step (as Megatron DDP's main_grad buffers): the
                # peak inside the step is activations + transients only
                for p in model.parameters():
                    p.grad = torch.zeros_like(p)
                gc.collect()  # nothing left over from building / the previous step is freed during this one
                with ActivationTracker("cpu", params=model.parameters(), count_peak=True) as tracker:
                    with loss_mask_scope(batch["loss_mask"]):
                        token_loss = model(batch["tokens"], batch["position_ids"], None, labels=batch["labels"])
                    loss = (token_loss * batch["loss_mask"]).sum()
                    loss.backward()
                    del loss, token_loss
                rt.after_step()
                s = tracker.stats()
                out.append(dict(cand=cand, seq=seq, device=s.activation_bytes_device, host=s.activation_bytes_host,
                                peak=s.peak_bytes))
            del model, rt
            if world > 1:
                dist.barrier()
    finally:
        ps.destroy_model_parallel()
    return out
