"""Packed documents (THD) end to end through Megatron: our data step + PackedSeqParams + core attention vs the
unmodified path, on 2 gloo ranks (one spawn, assertions in the parent).

The reference is Megatron's own GPTModel with its local spec (``DotProductAttention``) at cp=1 on the unpadded
sequence, attending within documents through the mask Megatron's GPTDataset builds for ``reset_attention_mask``
(``_get_ltor_masks_and_position_ids``, documents end after each EOD token). Ours: the same weights with our core
attention; the sample goes through ``PerDocumentPacking`` (what ``data.packing=documents`` yields) and our data step
(``long_context_data_step``: each document padded to a multiple of 2*cp, sharded per document, PackedSeqParams),
for cp=none and ring / Ulysses / hybrid at CP=2, each also with sequence-chunked layers (``recompute.sequence_chunks``,
full recompute, layer-input offload). NeMo's packed fine-tuning data (a packed .npy read by NeMo's
GPTSFTPackedDataset through ``data=packed_sft``'s data module, its own collate) against a block-diagonal causal mask
over the same documents. The summed loss over real tokens and every gradient must match
(fp64 model; Megatron's RoPE and cross entropy run in float32). Also: NeMo's packed fine-tuning format (documents
pre-padded, ``cu_seqlens`` = layout, ``cu_seqlens_unpadded`` = real lengths) gives the same loss; pad tokens do not
change the loss or any gradient; documents shorter than 2*cp; the RoPE positions Megatron applies (THD, per
document) and ours agree because without per-document attention (plain causal) the loss clearly differs (anchor).
"""

from __future__ import annotations

import pytest
import torch

from distributed import run_distributed
from reference import rel_err

EOD = 0
VOCAB = 64
DOCS = [37, 5, 1, 60, 25, 2, 30]  # real lengths (incl. each document's final EOD): some shorter than 2*cp


def _config(cp):
    from megatron.core.transformer.transformer_config import TransformerConfig

    return TransformerConfig(
        num_layers=2, hidden_size=64, num_attention_heads=4, num_query_groups=2, ffn_hidden_size=128,
        context_parallel_size=cp, attention_dropout=0.0, hidden_dropout=0.0, masked_softmax_fusion=False,
        add_bias_linear=False, normalization="RMSNorm", gated_linear_unit=True, params_dtype=torch.float64,
        bf16=False, init_method_std=0.2, apply_rope_fusion=False, bias_activation_fusion=False,
    )


def _sample():
    """One pretraining sample as Megatron's GPTDataset yields it with reset_position_ids/reset_attention_mask."""
    from megatron.core.datasets.gpt_dataset import _get_ltor_masks_and_position_ids

    g = torch.Generator().manual_seed(3)
    s = sum(DOCS)
    seq = torch.randint(1, VOCAB, (s + 1,), generator=g)
    for end in torch.tensor(DOCS).cumsum(0):
        seq[end - 1] = EOD  # every document ends with EOD
    tokens, labels = seq[:-1].clone(), seq[1:].clone()
    mask, loss_mask, pos = _get_ltor_masks_and_position_ids(tokens, EOD, True, True, False, True)
    return {"tokens": tokens, "labels": labels, "loss_mask": loss_mask, "position_ids": pos, "attention_mask": mask}


def _nemo_prepadded(sample, cp):
    """The same documents in NeMo's packed fine-tuning format: each pre-padded to a multiple of 2*cp (cu_seqlens =
    the layout, with -1 fill) and cu_seqlens_unpadded = the real lengths (GPTSFTPackedDataset's collate)."""
    mult = 2 * cp
    toks, labs, lm, cu, cu_real = [], [], [], [0], [0]
    start = 0
    for n in DOCS:
        p = -(-n // mult) * mult + mult  # one extra chunk of padding: the data step must drop and re-pad it
        pad = p - n
        toks.append(torch.cat([sample["tokens"][start:start + n], torch.full((pad,), 7)]))
        labs.append(torch.cat([sample["labels"][start:start + n], torch.full((pad,), 9)]))
        lm.append(torch.cat([sample["loss_mask"][start:start + n], torch.ones(pad)]))  # pads flagged 1 on purpose
        cu.append(cu[-1] + p)
        cu_real.append(cu_real[-1] + n)
        start += n
    fill = lambda c: torch.tensor(c + [-1], dtype=torch.int32)[None]  # noqa: E731
    return {"tokens": torch.cat(toks)[None], "labels": torch.cat(labs)[None], "loss_mask": torch.cat(lm)[None],
            "position_ids": torch.zeros(1, cu[-1], dtype=torch.long), "cu_seqlens": fill(cu),
            "cu_seqlens_argmin": torch.tensor([[len(cu)]]), "cu_seqlens_unpadded": fill(cu_real),
            "cu_seqlens_unpadded_argmin": torch.tensor([[len(cu_real)]]), "max_seqlen": torch.tensor([[max(DOCS)]]),
            "attention_mask": torch.ones(1, cu[-1], dtype=torch.long)}


def _packed_sft_batch(tmp):
    """A batch from NeMo's own packed fine-tuning data: a packed .npy in NeMo's format (what
    prepare_packed_sequence_data writes: input_ids, seq_start_id, loss_mask per pack) read through our
    ``packed_sft_data_module`` (FineTuningDataModule + PackedSequenceSpecs -> GPTSFTPackedDataset) and its collate."""
    import numpy as np
    from hf_models import make_tokenizer
    from nemo_longctx.integrations.nemo.data import packed_sft_data_module
    from nemo_longctx.shared.run_spec import DataSpec

    tok_dir = tmp / "tok"
    tok = make_tokenizer(VOCAB)
    tok.save_pretrained(tok_dir)
    g = torch.Generator().manual_seed(5)
    lens = [d + 1 for d in DOCS]  # each sequence one longer: the collate drops the last token (labels = shifted)
    ids = [torch.randint(5, VOCAB, (n,), generator=g) for n in lens]
    mask = [(torch.rand(n, generator=g) > 0.3).long() for n in lens]  # answer-only loss: some tokens masked
    starts = [0] + list(np.cumsum(lens)[:-1])
    pack = {"input_ids": torch.cat(ids).tolist(), "seq_start_id": [int(x) for x in starts],
            "loss_mask": torch.cat(mask).tolist()}
    for name in ("train", "val"):
        np.save(tmp / f"{name}.npy", np.array([pack], dtype=object), allow_pickle=True)
    data = DataSpec.from_dict({"packed_train": str(tmp / "train.npy"), "packed_val": str(tmp / "val.npy"),
                               "tokenizer": str(tok_dir), "num_workers": 0, "seed": 1})
    dm = packed_sft_data_module(data, 256, 1, 1)
    ds = dm._create_dataset(str(tmp / "train.npy"))
    batch = ds.collate_fn([ds[0]])
    return batch


def _worker(rank, world, tmp):
    from nemo_longctx.integrations.nemo import compat

    compat.apply()
    import torch.distributed as dist
    from megatron.core import parallel_state as ps
    from megatron.core import tensor_parallel
    from megatron.core.models.gpt import GPTModel
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec

    from nemo_longctx.integrations.megatron.memory_options import (
        MemoryOptions, apply_recompute_fields, attach_memory_options)
    from nemo_longctx.integrations.megatron.spec import long_context_layer_spec
    from nemo_longctx.integrations.nemo.data import PerDocumentPacking
    from nemo_longctx.integrations.nemo.steps import long_context_data_step

    base = get_gpt_layer_local_spec(normalization="RMSNorm")
    sample = _sample()
    S = sum(DOCS)
    collate = torch.utils.data.default_collate

    def build(cp, spec, opts=None):
        tensor_parallel.model_parallel_cuda_manual_seed(7)
        torch.manual_seed(7)
        config = _config(cp) if opts is None else apply_recompute_fields(_config(cp), opts)
        model = GPTModel(config, spec, vocab_size=VOCAB, max_sequence_length=4 * S, position_embedding_type="rope")
        if opts is not None:
            attach_memory_options(model, opts)
        return model

    def grads(model):
        return {n: p.grad.detach().clone() for n, p in model.named_parameters()}

    # -- the unmodified path: Megatron's DotProductAttention at cp=1 with GPTDataset's document mask
    ps.initialize_model_parallel(context_parallel_size=1)
    ref_model = build(1, base)
    state = {k: v.clone() for k, v in ref_model.state_dict().items() if isinstance(v, torch.Tensor)}
    b = collate([sample])
    loss = (ref_model(b["tokens"], b["position_ids"], b["attention_mask"], labels=b["labels"])
            * b["loss_mask"]).sum()
    loss.backward()
    ref = (loss.item(), grads(ref_model))

    def ours(cp, algo, kwargs, batch, packed=True, opts=None):
        model = build(cp, long_context_layer_spec(base, algo, **kwargs), opts)
        model.load_state_dict(state, strict=False)
        local = long_context_data_step(iter([batch]))
        if not packed:  # anchor: the same shards attended causally across documents
            local["packed_seq_params"] = None
        out = model(local["tokens"], local["position_ids"], None, labels=local["labels"],
                    packed_seq_params=local["packed_seq_params"])
        loss = (out * local["loss_mask"]).sum()
        loss.backward()
        g = grads(model)
        loss = loss.detach()
        if cp > 1:
            dist.all_reduce(loss, group=ps.get_context_parallel_group())
            for t in g.values():
                dist.all_reduce(t, group=ps.get_context_parallel_group())
        real = int(local["loss_mask"].sum().item())
        return loss.item(), max(rel_err(g[n], ref[1][n]) for n in ref[1]), real, tuple(local["tokens"].shape)

    packed = collate([PerDocumentPacking([sample])[0]])
    res = {"ref": ref[0], "S": S}
    res["none"] = ours(1, "ring", {}, packed)
    # sequence-chunked layers (3 chunks: uneven, crossing document boundaries) with full recompute and layer-input
    # offload: the documents reach the chunk state, Megatron's THD RoPE positions go row by row
    chunked = MemoryOptions(recompute="full", sequence_chunks=3, offload="layer_input", min_bytes=0)
    res["chunks_none"] = ours(1, "ring", {}, packed, opts=chunked)
    ps.destroy_model_parallel()
    ps.initialize_model_parallel(context_parallel_size=world)
    for name, algo, kwargs in (("ring", "ring", {}), ("ulysses", "ulysses", {}),
                               ("hybrid", "hybrid", {"ulysses_size": 2})):
        res[name] = ours(world, algo, kwargs, packed)
        res[f"chunks_{name}"] = ours(world, algo, kwargs, packed, opts=chunked)
    res["nemo_prepadded"] = ours(world, "ring", {}, _nemo_prepadded(sample, world))
    noisy = _nemo_prepadded(sample, world)
    g = torch.Generator().manual_seed(rank + 99)
    pad = torch.ones_like(noisy["tokens"], dtype=torch.bool)
    cu, cu_real = noisy["cu_seqlens"][0].tolist()[:-1], noisy["cu_seqlens_unpadded"][0].tolist()[:-1]
    for a, n in zip(cu[:-1], [y - x for x, y in zip(cu_real, cu_real[1:])]):
        pad[0, a:a + n] = False
    noisy["tokens"] = torch.where(pad, torch.randint(1, VOCAB, noisy["tokens"].shape, generator=g), noisy["tokens"])
    res["pads_changed"] = ours(world, "ring", {}, noisy)
    res["anchor_causal"] = ours(world, "ring", {}, packed, packed=False)

    # NeMo's packed fine-tuning batch: the reference is the unpadded documents with a block-diagonal causal mask
    sft = _packed_sft_batch(tmp / f"sft{rank}")
    cu = sft["cu_seqlens"][0, : int(sft["cu_seqlens_argmin"][0, 0])].tolist()
    s_real = cu[-1]
    doc = torch.zeros(s_real, dtype=torch.long)
    for i, (a, b) in enumerate(zip(cu, cu[1:])):
        doc[a:b] = i
    masked = (doc[:, None] != doc[None, :]) | torch.ones(s_real, s_real, dtype=torch.bool).triu(1)
    ps.destroy_model_parallel()
    ps.initialize_model_parallel(context_parallel_size=1)
    ref_model = build(1, base)
    ref_model.load_state_dict(state, strict=False)
    t, lab, lm = (sft[k][:, :s_real] for k in ("tokens", "labels", "loss_mask"))
    loss = (ref_model(t, torch.arange(s_real)[None], masked[None, None], labels=lab) * lm).sum()
    loss.backward()
    ref = (loss.item(), grads(ref_model))
    res["sft_ref"] = ref[0]
    res["sft_none"] = ours(1, "ring", {}, sft)
    ps.destroy_model_parallel()
    ps.initialize_model_parallel(context_parallel_size=world)
    res["sft_ring"] = ours(world, "ring", {}, sft)
    res["sft_ulysses"] = ours(world, "ulysses", {}, sft)
    res["sft_keys"] = sorted(sft)

    # MLA (tiny DeepSeek-V2-Lite-style, MoE, d_qk 24 != d_v 16) on packed documents vs the same model run on every
    # document alone (Megatron's local spec has no MLA attention of its own: DotProductAttention refuses k_channels)
    res["mla"] = _mla_packed(world, ps, packed, sample)
    ps.destroy_model_parallel()
    return res


def _mla_packed(world, ps, packed, sample):
    import torch.distributed as dist
    from megatron.core import tensor_parallel

    from nemo_longctx.integrations.nemo.steps import long_context_data_step
    from test_model_families_cp import _model_config

    def model_for(cp, algo):
        ps.destroy_model_parallel()
        ps.initialize_model_parallel(context_parallel_size=cp)
        cfg = _model_config("tiny_deepseek_v2_lite", cp, algo, {})
        cfg.vocab_size = VOCAB
        torch.manual_seed(3)
        tensor_parallel.model_parallel_cuda_manual_seed(3)
        return cfg.configure_model(None)

    def packed_loss(cp, algo):
        model = model_for(cp, algo)
        b = long_context_data_step(iter([packed]))
        out = model(b["tokens"], b["position_ids"], None, labels=b["labels"], packed_seq_params=b["packed_seq_params"])
        loss = (out * b["loss_mask"]).sum().detach()
        if cp > 1:
            dist.all_reduce(loss, group=ps.get_context_parallel_group())
        return loss.item()

    model = model_for(1, "ring")
    alone, start = 0.0, 0
    for n in DOCS:  # every document as its own sequence: positions 0.., causal, no packing
        t, lab, lm = (sample[k][None, start:start + n] for k in ("tokens", "labels", "loss_mask"))
        alone += (model(t, torch.arange(n)[None], None, labels=lab) * lm).sum().item()
        start += n
    return {"alone": alone, "none": packed_loss(1, "ring"), "ring": packed_loss(world, "ring"),
            "ulysses": packed_loss(world, "ulysses")}


@pytest.fixture(scope="module")
def results(tmp_path_factory):
    return run_distributed(_worker, 2, tmp_path_factory.mktemp("packed"), timeout=600)


def test_packed_losses_and_grads_equal_megatron_document_mask(results):
    for r in results:
        ref = r["ref"]
        for key in ("none", "ring", "ulysses", "hybrid", "nemo_prepadded", "pads_changed", "chunks_none",
                    "chunks_ring", "chunks_ulysses", "chunks_hybrid"):
            loss, grad_err, real, _ = r[key]
            assert loss == pytest.approx(ref, rel=2e-6, abs=0), (key, r)
            assert grad_err < 1e-5, (key, r)
        assert abs(r["anchor_causal"][0] - ref) > 1e-3 * abs(ref), r  # >= 500x the tolerance
        assert r["pads_changed"][:2] == r["nemo_prepadded"][:2], r  # NeMo's pad tokens never reach the model


def test_packed_layout_pads_every_document_to_2cp(results):
    r = results[0]
    # the loss counts every real token once (the loss mask is all ones on real tokens: eod_mask_loss=False)
    assert r["none"][2] == r["S"] and r["none"][3] == (1, r["S"])  # cp=none: no padding at all
    padded = sum(-(-n // 4) * 4 for n in DOCS)
    total_real = sum(rr["ring"][2] for rr in results)
    assert total_real == r["S"], results
    assert r["ring"][3] == (1, padded // 2)
    assert r["nemo_prepadded"][3] == (1, padded // 2)  # NeMo's extra padding is dropped, re-laid out for CP


def test_nemo_packed_sft_batches_equal_megatron_document_mask(results):
    for r in results:
        assert {"cu_seqlens", "cu_seqlens_unpadded", "max_seqlen"} <= set(r["sft_keys"]), r["sft_keys"]
        for key in ("sft_none", "sft_ring", "sft_ulysses"):
            loss, grad_err, _, _ = r[key]
            assert loss == pytest.approx(r["sft_ref"], rel=2e-6, abs=0), (key, r)
            assert grad_err < 1e-5, (key, r)


def test_mla_moe_model_on_packed_documents(results):
    for r in results:
        m = r["mla"]
        for key in ("none", "ring", "ulysses"):
            assert m[key] == pytest.approx(m["alone"], rel=2e-6, abs=0), m
