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
        out[name] = (_losses(base / name), text)
    return out


@pytest.mark.matrix  # the version-matrix smoke set (scripts/matrix_smoke.sh)
def test_packed_documents_with_window_train_with_cp_none_losses(runs):
    none, ring = runs["none"][0], runs["ring"][0]
    assert len(none) == len(ring) == 3
    assert none[0] > none[-1]  # it trains
    for a, b in zip(ring, none):
        assert a == pytest.approx(b, rel=1e-5), (ring, none)
