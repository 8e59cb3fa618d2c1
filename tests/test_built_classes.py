"""Models built with our classes from the start (no class change after the build), one gloo rank on the CPU:

* a model config marked by ``apply_recompute_fields`` with a full recompute builds its GPT decoder as
  ``LongContextTransformerBlock`` (the Megatron-core ledger's row R2); without the mark, or without a full recompute,
  Megatron's ``TransformerBlock`` is built, as before; ``attach_memory_options`` refuses a full recompute on a block
  that was not built as ours, naming why;
* ``ChunkedLossGPTModel`` without a policy is Megatron's GPTModel bit for bit (same state dict keys, the same per-token
  loss and gradients with ``torch.equal``), and ``use_chunked_loss`` refuses a model built as Megatron's GPTModel;
* the norms of a layer spec built for norm recompute (``RecomputableNorm``) keep the plain norm's state dict keys and
  values, and compute the same loss and gradients bit for bit while not armed.
"""

from __future__ import annotations

from distributed import run_distributed

SEQ, VOCAB = 32, 64


def _worker(rank: int, world: int):
    import copy

    import torch
    from megatron.core import parallel_state as ps
    from megatron.core import tensor_parallel
    from megatron.core.models.gpt import GPTModel
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec

    from nemo_longctx.integrations.megatron import cpu_compat

    cpu_compat.apply()
    from nemo_longctx.integrations.megatron.gpt_chunked_loss import ChunkedLossGPTModel, use_chunked_loss
    from nemo_longctx.integrations.megatron.memory_options import (MemoryOptions, apply_recompute_fields,
                                                                   attach_memory_options)
    from nemo_longctx.integrations.megatron.memory_probe import tiny_gpt_config
    from nemo_longctx.integrations.megatron.norm_recompute_layer import RecomputableNorm
    from nemo_longctx.integrations.megatron.offload_block import LongContextTransformerBlock
    from nemo_longctx.integrations.megatron.spec import long_context_layer_spec

    ps.initialize_model_parallel()
    tensor_parallel.model_parallel_cuda_manual_seed(5)
    out = {}
    base = get_gpt_layer_local_spec(normalization="RMSNorm")

    def build(cls, config, spec):
        torch.manual_seed(1)
        tensor_parallel.model_parallel_cuda_manual_seed(5)
        return cls(config, spec, vocab_size=VOCAB, max_sequence_length=SEQ, position_embedding_type="rope",
                   share_embeddings_and_output_weights=False)

    g = torch.Generator().manual_seed(3)
    tokens = torch.randint(0, VOCAB, (1, SEQ + 1), generator=g)
    batch = dict(input_ids=tokens[:, :-1], position_ids=torch.arange(SEQ).unsqueeze(0), attention_mask=None,
                 labels=tokens[:, 1:])

    def step(model):
        model.train()
        loss = model(**batch)
        loss.sum().backward()
        return loss.detach(), {n: p.grad.clone() for n, p in model.named_parameters()}

    # -- the decoder block class, chosen by the config's mark when the model is built
    cfg = tiny_gpt_config(num_layers=2)
    spec = long_context_layer_spec(base, "ring")
    blocks = {}
    for name, opts in (("full", MemoryOptions(recompute="full")), ("selective", MemoryOptions(recompute="selective")),
                       ("none", MemoryOptions())):
        blocks[name] = type(build(GPTModel, apply_recompute_fields(copy.copy(cfg), opts), spec).decoder).__name__
    blocks["unmarked"] = type(build(GPTModel, cfg, spec).decoder).__name__
    out["blocks"] = blocks
    full_cfg = apply_recompute_fields(copy.copy(cfg), MemoryOptions(recompute="full"))
    plain_block = build(GPTModel, tiny_gpt_config(num_layers=2), spec)
    plain_block.config.recompute_granularity = "full"  # recompute fields set after the build: a plain block
    try:
        attach_memory_options(plain_block, MemoryOptions(recompute="full"))
        out["attach_plain_block"] = None
    except ValueError as e:
        out["attach_plain_block"] = str(e)
    out["full_is_ours"] = isinstance(build(GPTModel, full_cfg, spec).decoder, LongContextTransformerBlock)

    # -- ChunkedLossGPTModel without a policy == GPTModel, bit for bit
    plain = build(GPTModel, cfg, spec)
    ours = build(ChunkedLossGPTModel, cfg, spec)
    out["chunked_keys_equal"] = list(plain.state_dict()) == list(ours.state_dict())
    out["chunked_init_equal"] = all(torch.equal(a, b) for a, b in zip(plain.parameters(), ours.parameters()))
    (l0, g0), (l1, g1) = step(plain), step(ours)
    out["chunked_bitwise"] = torch.equal(l0, l1) and all(torch.equal(g0[n], g1[n]) for n in g0)
    try:
        use_chunked_loss(plain, 2)
        out["chunked_on_plain"] = None
    except ValueError as e:
        out["chunked_on_plain"] = str(e)
    out["chunked_set"] = use_chunked_loss(ours, 2) == 1 and ours.loss_chunks == 2

    # -- the norms of norm recompute, built by the spec: same state dict, same numbers while not armed
    norms = long_context_layer_spec(base, "ring", norm_recompute=True)
    a, b = build(GPTModel, cfg, spec), build(GPTModel, cfg, norms)
    sa, sb = a.state_dict(), b.state_dict()
    out["norm_keys_equal"] = list(sa) == list(sb)
    out["norm_values_equal"] = all(torch.equal(sa[k], sb[k]) for k in sa if torch.is_tensor(sa[k]))
    layer = b.decoder.layers[0]
    out["norm_classes"] = [type(layer.input_layernorm).__name__, type(layer.pre_mlp_layernorm).__name__]
    out["norm_built"] = isinstance(layer.input_layernorm, RecomputableNorm) and not layer.input_layernorm.armed
    (l0, g0), (l1, g1) = step(a), step(b)
    out["norm_bitwise"] = torch.equal(l0, l1) and all(torch.equal(g0[n], g1[n]) for n in g0)
    ps.destroy_model_parallel()
    return out


def test_models_are_built_with_our_classes():
    out = run_distributed(_worker, 1, timeout=300)[0]
    assert out["blocks"] == {"full": "LongContextTransformerBlock", "selective": "TransformerBlock",
                             "none": "TransformerBlock", "unmarked": "TransformerBlock"}, out["blocks"]
    assert out["full_is_ours"]
    assert "was built as TransformerBlock, not LongContextTransformerBlock" in out["attach_plain_block"], out
    assert out["chunked_keys_equal"] and out["chunked_init_equal"] and out["chunked_bitwise"], out
    assert "built as Megatron's GPTModel, not ChunkedLossGPTModel" in out["chunked_on_plain"], out
    assert out["chunked_set"]
    assert out["norm_classes"] == ["RecomputableNorm", "RecomputableNorm"] and out["norm_built"], out
    assert out["norm_keys_equal"] and out["norm_values_equal"] and out["norm_bitwise"], out
