"""``data.packing=documents`` through the train app (real NeMo objects, gloo on CPU): a tiny Mistral (sliding window
24 on every layer) trains on rows of documents with per-document attention -- THD + SWA through our data module,
data step, forward step and core attention -- with the same per-step losses at cp=none (1 process) and under ring
CP=2 with sequence-chunked layers (the app spawns 2 processes). Two app runs, 3 SGD steps at seq 512, documents of
48..144 tokens."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

from app_runner import metrics_rows, run_app

COMMON = ["model=tiny_mistral", "data.packing=documents", "data.doc_length=96", "model.seq_length=512",
          "trainer.max_steps=3", "optim.optimizer=sgd", "optim.lr=0.5", "optim.min_lr=0.05", "log.tensorboard=false",
          "run.timeout_s=300"]


def _losses(out_dir: Path):
    return [row["loss"] for row in metrics_rows(out_dir)]


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    base = tmp_path_factory.mktemp("packed")
    out = {}
    # ring CP=2 with sequence-chunked layers (3 chunks each crossing documents, full recompute): the documents and
    # their RoPE positions reach every chunk (ring alone on packed documents: tests/test_packed_megatron.py)
    for name, extra in (("none", ["cp=none", "trainer.devices=1"]),
                        ("ring", ["cp=ring", "recompute=full", "recompute.sequence_chunks=3"])):
        code, text = run_app([sys.executable, "-m", "nemo_longctx.apps.train", f"output_dir={base / name}", *COMMON,
                              *extra], timeout=400)
        assert code == 0, text[-4000:]
        out[name] = (_losses(base / name), text, metrics_rows(base / name))
    return out


@pytest.mark.matrix  # the version-matrix smoke set (scripts/matrix_smoke.sh)
def test_packed_documents_with_window_train_with_cp_none_losses(runs):
    none, ring = runs["none"][0], runs["ring"][0]
    assert len(none) == len(ring) == 3
    assert none[0] > none[-1]  # it trains
    for a, b in zip(ring, none):
        assert a == pytest.approx(b, rel=1e-5), (ring, none)


def test_packed_runs_log_balance_per_step(runs):
    """``balance`` (max / mean predicted attention cost over the ranks) is in every step's metrics row: 1.0 on one
    rank; under CP=2 the per-document zigzag's, within a few percent of 1."""
    for name, expected in (("none", (1.0, 1.0)), ("ring", (1.0, 1.1))):
        rows = runs[name][2]
        assert rows and all(expected[0] <= r["balance"] <= expected[1] for r in rows), (name, rows)


@pytest.fixture(scope="module")
def documents_run(tmp_path_factory):
    out = tmp_path_factory.mktemp("packed_documents") / "documents"
    code, text = run_app([sys.executable, "-m", "nemo_longctx.apps.train", f"output_dir={out}", *COMMON, "cp=ring",
                          "cp.split_min_tokens=100"], timeout=400)
    assert code == 0, text[-4000:]
    return metrics_rows(out), text


@pytest.mark.slow  # one more app run (~1 min of both cores); the placement itself: test_documents_megatron.py
def test_document_aware_cp_trains_with_cp_none_losses(runs, documents_run):
    """``cp.split_min_tokens=100`` under ring CP=2: documents shorter than 100 tokens stay whole on one rank (the
    others are split), every layer with its sliding window; the per-step losses equal cp=none's and every row logs
    ``balance``."""
    rows, text = documents_run
    none = runs["none"][0]
    assert len(rows) == len(none) == 3
    for a, b in zip((r["loss"] for r in rows), none):
        assert a == pytest.approx(b, rel=1e-5), (rows, none)
    assert all(1.0 <= r["balance"] < 2.0 for r in rows), rows
    assert "documents shorter than 100 tokens kept whole" in text


@pytest.mark.slow  # two more app runs, one of 4 processes (~3 min of both cores)
def test_document_aware_cp_with_data_parallel_schedule(tmp_path):
    """DP=2 x ring CP=2 with ``cp.split_min_tokens=100``: each global batch's 4 rows are spread over the two
    data-parallel ranks by attention cost (``data_balance.CostBalancedBatches``) and each row's short documents stay
    whole on a CP rank; the per-step losses equal one process running the same 4 rows per step at cp=none."""
    rows = {}
    for name, extra in (("none", ["cp=none", "trainer.devices=1"]),
                        ("dp_cp", ["cp=ring", "cp.split_min_tokens=100", "trainer.devices=4"])):
        code, text = run_app([sys.executable, "-m", "nemo_longctx.apps.train", f"output_dir={tmp_path / name}",
                              *COMMON, "trainer.global_batch_size=4", *extra], timeout=600)
        assert code == 0, text[-4000:]
        rows[name] = metrics_rows(tmp_path / name)
    assert len(rows["none"]) == len(rows["dp_cp"]) == 3
    for a, b in zip(rows["dp_cp"], rows["none"]):
        assert a["loss"] == pytest.approx(b["loss"], rel=1e-5), rows
        assert 1.0 <= a["balance"] < 1.5, rows
