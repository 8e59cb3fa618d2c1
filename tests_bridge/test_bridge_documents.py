"""Packed documents on the Megatron-Bridge front end (``data.packing=documents``): our forward step in Bridge's
``pretrain`` takes each full micro-batch of Bridge's pretraining data (the CPU demo's mock GPT data, documents ending
at the EOD token, ``dataset.reset_position_ids``), finds the documents where the position ids restart and lays them
out for the CP group (every document zigzag-split, or short ones kept whole: ``cp.split_min_tokens``). The per-step
losses under ring CP=2 equal cp=none's, ``balance`` is in metrics.jsonl; bad inputs are refused by key.

Three app runs (cp=none; ring CP=2 with every document split; ring CP=2 with documents under 256 tokens kept whole),
3 steps at seq 1024, fp32; plus unit checks of the data step, the container checks and the CP guard (no ranks)."""

from __future__ import annotations

import pytest
import torch
from runner import run_bridge

pytest.importorskip("megatron.bridge", reason="the Megatron-Bridge stack (scripts/install_bridge.sh)")

COMMON = ["data.packing=documents", "model.seq_length=1024"]


def _batch(lengths):
    """One ``[1, S]`` micro-batch of documents of ``lengths`` as Bridge's GPT dataset gives it (position ids reset at
    every document, token ids 1..S)."""
    s = sum(lengths)
    tokens = torch.arange(1, s + 1)[None]
    return {"tokens": tokens, "labels": tokens + 1000, "loss_mask": torch.ones(1, s),
            "position_ids": torch.cat([torch.arange(n) for n in lengths])[None], "attention_mask": None}


def _real_tokens(parts):
    return sorted(int(t) for part in parts for t in part["tokens"].reshape(-1) if int(t) != 0)


@pytest.mark.smoke
def test_the_data_step_finds_the_documents_and_lays_them_out_for_cp():
    """``packed_micro_batch``: the documents from the reset position ids; at cp=1 the real lengths, under CP=2 each
    document padded to a multiple of 4 and every real token on exactly one rank -- every document split (off), or
    with ``cp.split_min_tokens=8`` the short ones kept whole (``DocumentPackedSeqParams``)."""
    from nemo_longctx.integrations.bridge.documents import packed_micro_batch
    from nemo_longctx.integrations.megatron.batch import set_document_placement

    lengths = [5, 9, 2]
    one, tokens, cu, loss_tokens = packed_micro_batch(_batch(lengths), 1, 0)
    assert cu.tolist() == [0, 5, 14, 16] and tokens.shape == (1, 16) and loss_tokens == 16
    assert one["packed_seq_params"].cu_seqlens_q.tolist() == [0, 5, 14, 16]
    assert one["position_ids"].tolist() == [list(range(5)) + list(range(9)) + list(range(2))]
    parts = [packed_micro_batch(_batch(lengths), 2, r)[0] for r in (0, 1)]
    assert parts[0]["packed_seq_params"].cu_seqlens_q_padded.tolist() == [0, 8, 20, 24]
    assert _real_tokens(parts) == list(range(1, 17))
    assert all(float((p["loss_mask"] > 0).sum()) == float((p["tokens"] != 0).sum()) for p in parts)
    try:
        set_document_placement(8)
        parts = [packed_micro_batch(_batch(lengths), 2, r)[0] for r in (0, 1)]
        assert type(parts[0]["packed_seq_params"]).__name__ == "DocumentPackedSeqParams"
        assert _real_tokens(parts) == list(range(1, 17))
        placement = parts[0]["packed_seq_params"].placement
        assert placement.split == (1,) and placement.kept == (0, 2)  # the 9-token document split, the others whole
    finally:
        set_document_placement("off")
    with pytest.raises(ValueError, match="micro batch size 1"):
        packed_micro_batch({k: (v.repeat(2, 1) if v is not None else None) for k, v in _batch(lengths).items()}, 1, 0)


@pytest.mark.smoke
def test_the_container_checks_name_their_keys():
    """What ``data.packing=documents`` needs from the ConfigContainer, each problem naming its key; the options on
    dense data refuse ``cp.split_min_tokens`` naming the data key; with packed documents it is taken and the dataset's
    position ids restart at every document."""
    from nemo_longctx.apps.bridge import demo_config
    from nemo_longctx.integrations.bridge.config import enable_long_context, long_context_callbacks
    from nemo_longctx.integrations.bridge.documents import packed_documents_problems
    from nemo_longctx.options import ConfigError

    cfg = demo_config()
    cfg.train.micro_batch_size, cfg.model.pipeline_model_parallel_size = 2, 2
    text = "\n".join(packed_documents_problems(cfg, ["dataset.reset_position_ids"]))
    for needle in ("dataset.reset_position_ids=false", "train.micro_batch_size=1 (got 2)",
                   "model.pipeline_model_parallel_size=2"):
        assert needle in text, text
    cfg = demo_config()
    with pytest.raises(ConfigError, match=r"data \(data.packing\) are dense sequences"):
        enable_long_context(cfg, cp={"size": 2, "split_min_tokens": "auto"})
    enable_long_context(cfg, cp={"size": 2, "split_min_tokens": "auto"}, packed_documents=True)
    assert cfg.dataset.reset_position_ids is True
    assert [type(c).__name__ for c in long_context_callbacks(cfg, packed_documents=True)] == [
        "DocumentPlacement", "LongContextMemoryCallback", "LongContextRunGuards"]


MASK_KEY, POSITIONS_KEY = "dataset.reset_attention_mask", "dataset.reset_position_ids"
CP_CHOICES = [{"size": 1}, {"algorithm": "ring", "size": 2}, {"algorithm": "ulysses", "size": 2}]


def _dense(cp, packed_documents=False, **dataset):
    """``enable_long_context`` on the CPU demo's container (a rotary Llama) with the dataset fields ``dataset``: the
    problems it raises (empty: accepted)."""
    from nemo_longctx.apps.bridge import demo_config
    from nemo_longctx.integrations.bridge.config import enable_long_context
    from nemo_longctx.options import ConfigError

    cfg = demo_config()
    model = dataset.pop("model", {})
    for name, value in dataset.items():
        setattr(cfg.dataset, name, value)
    for name, value in model.items():
        setattr(cfg.model, name, value)
    try:
        enable_long_context(cfg, cp=dict(cp), packed_documents=packed_documents)
    except ConfigError as e:
        return e.problems
    return []


@pytest.mark.smoke
@pytest.mark.parametrize("cp", CP_CHOICES, ids=["none", "ring2", "ulysses2"])
def test_dense_runs_refuse_the_datasets_per_document_flags(cp):
    """Without ``data.packing=documents`` Bridge's forward step hands our attention no documents: a dataset asking for
    a per-document mask (whether the mask is dropped by Bridge, built at all, or passed on) or, on a rotary model,
    per-document positions is refused before any rank, in one message naming the key(s) and what to do."""
    for flags, keys in [({"reset_attention_mask": True}, [MASK_KEY]),
                        ({"reset_attention_mask": True, "create_attention_mask": False}, [MASK_KEY]),
                        ({"reset_attention_mask": True, "skip_getting_attention_mask_from_dataset": False}, [MASK_KEY]),
                        ({"reset_position_ids": True}, [POSITIONS_KEY]),
                        ({"reset_attention_mask": True, "reset_position_ids": True}, [MASK_KEY, POSITIONS_KEY])]:
        problems = _dense(cp, **flags)
        assert len(problems) == 1, (flags, problems)
        head = " and ".join(k + "=true" for k in keys) + " without data.packing=documents"
        assert problems[0].startswith(head), (flags, problems)
        assert "use data.packing=documents, else set " + " and ".join(k + "=false" for k in keys) in problems[0]
    assert "model.position_embedding_type=rope" in _dense(cp, reset_position_ids=True)[0]


@pytest.mark.smoke
@pytest.mark.parametrize("cp", CP_CHOICES, ids=["none", "ring2", "ulysses2"])
def test_dense_runs_refuse_megatrons_inter_document_masking(cp):
    """Megatron's ``dataset.inter_document_masking`` without ``data.packing=documents``: Bridge's forward step passes
    the dataset's ``cu_seqlens`` on as packed sequences and fails at the first step (the CPU demo: no documents left
    at cp=none, TransformerEngine's partitioning under CP), so it is refused before any rank, in one message naming
    the key and pointing to ``data.packing=documents``, whatever the other flags."""
    for flags in ({}, {"reset_attention_mask": True, "reset_position_ids": True},
                  {"model": {"position_embedding_type": "learned_absolute"}}):
        problems = _dense(cp, inter_document_masking=True, **flags)
        assert len(problems) == 1, (flags, problems)
        assert problems[0].startswith("dataset.inter_document_masking=true without data.packing=documents"), problems
        assert "use data.packing=documents with dataset.inter_document_masking=false" in problems[0], problems


@pytest.mark.smoke
@pytest.mark.parametrize("cp", CP_CHOICES, ids=["none", "ring2", "ulysses2"])
def test_runs_that_honour_the_flags_are_accepted(cp):
    """Accepted: the flags off; ``data.packing=documents`` with both (our forward step: attention within each
    document); ``dataset.reset_position_ids`` on a model whose learned absolute position embedding reads the ids."""
    assert _dense(cp) == []
    assert _dense(cp, True, reset_attention_mask=True, reset_position_ids=True) == []
    assert _dense(cp, reset_position_ids=True, model={"position_embedding_type": "learned_absolute"}) == []


@pytest.mark.smoke
def test_packed_documents_refuse_megatrons_inter_document_masking():
    """``data.packing=documents`` finds the documents where the position ids restart; with Megatron's
    ``dataset.inter_document_masking`` the dataset gives boundaries of its own (the first losses of such a run differ
    from packed documents alone): refused, naming the key, and accepted again with it off."""
    from nemo_longctx.apps.bridge import demo_config
    from nemo_longctx.integrations.bridge.documents import packed_documents_problems

    cfg = demo_config()
    cfg.dataset.inter_document_masking = True
    problems = packed_documents_problems(cfg)
    assert len(problems) == 1 and problems[0].startswith(
        "data.packing=documents with dataset.inter_document_masking=true"), problems
    assert problems[0].endswith("set dataset.inter_document_masking=false"), problems
    cfg.dataset.inter_document_masking = False
    assert packed_documents_problems(cfg) == []


@pytest.mark.smoke
def test_the_cp_guard_expects_traffic_only_when_a_document_was_split(monkeypatch):
    """With packed documents the CP guard judges neither the sequence length (the layout pads each document) nor the
    bytes of a step whose documents all stayed whole on one rank; a step that split one and sent nothing trips it."""
    from types import SimpleNamespace

    from nemo_longctx.apps.bridge import demo_config
    from nemo_longctx.attention.comm import record_bytes_sent
    from nemo_longctx.integrations.bridge import guards
    from nemo_longctx.integrations.bridge.config import enable_long_context
    from nemo_longctx.integrations.megatron import run_guards
    from nemo_longctx.integrations.megatron.batch import STEP_COSTS

    cfg = enable_long_context(demo_config(), cp={"size": 2, "split_min_tokens": 64}, packed_documents=True)
    layers = [SimpleNamespace(layer_number=1, cp_size=2, last_key_tokens=77)]  # not seq_length / 2: not judged
    monkeypatch.setattr(run_guards, "core_attentions", lambda model: layers)
    guard = guards.run_guards_callback(cfg, packed_documents=True)
    context = SimpleNamespace(model=[], state=SimpleNamespace(train_state=SimpleNamespace(step=0)))

    def step(split, sent_bytes):
        guard.on_train_step_start(context)
        STEP_COSTS.update(costs=[1.0, 1.0], split=split)  # what the data step records for the micro-batch
        record_bytes_sent(sent_bytes)
        guard.on_train_step_end(context)

    guard.on_train_start(context)
    step(False, 0)  # every document kept whole: no CP traffic expected
    step(True, 4096)
    with pytest.raises(run_guards.GuardTripped, match="sent no bytes"):
        step(True, 0)


@pytest.mark.smoke
def test_bad_values_are_refused_before_any_rank(tmp_path):
    """One app run, refused before any rank starts: ``cp.split_min_tokens`` on dense data names ``data.packing``; a
    packing that is not one, and a key the data group does not have, are named."""
    code, log, _ = run_bridge(tmp_path, "bad", "cp=ring", "cp.size=2", "cp.split_min_tokens=auto",
                              "data.packing=rows", "+data.pack=1", timeout=300)
    assert code == 2, log[-3000:]
    for needle in ("cp.split_min_tokens='auto' places packed documents, but the data (data.packing) are dense",
                   "data.packing='rows' must be one of none, documents", "data: unknown key(s) ['pack']"):
        assert needle in log, log[-3000:]
    assert "core attention:" not in log  # no rank started


@pytest.fixture(scope="module")
def packed_runs(tmp_path_factory):
    base = tmp_path_factory.mktemp("bridge_documents")
    return {name: run_bridge(base, name, *COMMON, *args, timeout=600) for name, args in {
        "none": ["cp=none"], "split": ["cp=ring", "cp.size=2"],
        "whole": ["cp=ring", "cp.size=2", "cp.split_min_tokens=256"]}.items()}


def test_packed_documents_under_ring_cp2_train_with_cp_none_losses(packed_runs):
    """Per-step losses of ring CP=2 -- every document split, and documents under 256 tokens kept whole on one rank
    -- equal cp=none's (fp32; the layouts only reorder the sums); every row logs ``balance``: 1.0 on one rank, the
    per-document zigzag's near 1, and the document-aware placement's differs from it (other documents per rank)."""
    for name, (code, log, rows) in packed_runs.items():
        assert code == 0, (name, log[-4000:])
        assert "packed documents (data.packing=documents)" in log and len(rows) == 3, (name, log[-3000:])
        assert all(r.get("balance") is not None for r in rows), (name, rows)
    none, split, whole = (packed_runs[n][2] for n in ("none", "split", "whole"))
    assert "documents shorter than 256 tokens kept whole" in packed_runs["whole"][1]
    assert none[0]["loss"] != none[-1]["loss"]  # it trains
    for rows in (split, whole):
        assert [r["cp_size"] for r in rows] == [2, 2, 2]
        for a, b in zip(none, rows):
            assert b["loss"] == pytest.approx(a["loss"], rel=1e-5), (none, rows)
    assert all(r["balance"] == 1.0 for r in none), none
    assert all(1.0 <= r["balance"] < 1.1 for r in split), split
    assert any(abs(a["balance"] - b["balance"]) > 1e-6 for a, b in zip(split, whole)), (split, whole)
