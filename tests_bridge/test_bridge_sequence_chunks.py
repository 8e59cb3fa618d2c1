"""``recompute.sequence_chunks`` on the Bridge stack's Megatron-core (0.19: its block runs full recompute through
``megatron.core.recompute.checkpointed_forward``, which our dispatcher routes to the chunked loop): a Megatron GPTModel
(local spec, our core attention) trained 3 SGD steps with 2, 3 and 4 chunks, with layer-input offload, the block method
and a sliding window, against ``recompute=full``: losses and every gradient within 1e-6 (fp32; TransformerEngine's
norms in this stack take no float64, which tests/test_sequence_chunks_megatron.py covers on the NeMo 2 stack)."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

pytest.importorskip("megatron.bridge", reason="the Megatron-Bridge stack (scripts/install_bridge.sh)")

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))

from distributed import run_distributed  # noqa: E402
from test_sequence_chunks_megatron import _worker, check_parity  # noqa: E402


@pytest.mark.smoke
def test_chunked_layers_match_full_recompute_on_megatron_core_0_19():
    out = run_distributed(_worker, 1, ("float32",), timeout=400)[0]
    check_parity(out["parity"], n_dtypes=1)
    assert out["peaks"]["chunks4"] < out["peaks"]["full"]
