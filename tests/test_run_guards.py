"""The run guards (``integrations.megatron.run_guards``): each one trips on the failure it is for and stays quiet on a
correct run. The CP guard tripping inside a real multi-rank run is ``test_fuzz.py``'s ``cp_inactive`` defect (every
fuzz case also runs the guards: none may trip on a correct composition); a real app run with the guards on is every
app test (the default job runs CP=2 with them)."""

from __future__ import annotations

import math
from types import SimpleNamespace

import pytest

from nemo_longctx.integrations.megatron.run_guards import (GuardTripped, cp_problems, loss_problems, mfu_problems,
                                                           raise_if, tokens_problems)


def _attention(layer, cp_size, key_tokens):
    # the three attributes the guard reads from a built LongContextCoreAttention
    return SimpleNamespace(layer_number=layer, cp_size=cp_size, last_key_tokens=key_tokens)


def test_cp_guard_passes_a_working_layout_and_trips_on_each_failure():
    ok = [_attention(1, 2, 512), _attention(2, 2, 512)]
    assert cp_problems(ok, 2, 1024, 4096, 0) == []
    # the attention built over a CP group of 1 while the run shards over 2 (each rank attends its own slice)
    p = cp_problems([_attention(1, 1, 512)], 2, 1024, 4096, 0)
    assert any("runs over 1 CP rank(s) but the run's CP size is 2" in x for x in p)
    assert any("covered 512 key tokens per sequence" in x for x in p)
    # nothing exchanged at CP > 1
    p = cp_problems(ok, 2, 1024, 0, 3)
    assert p == ["run guard (step 3): CP size 2 but the attention sent no bytes to the other CP ranks in this step: "
                 "context parallelism is not active"]
    # a sequence-chunked layer records no key count: it is not judged on it
    assert cp_problems([_attention(1, 2, None)], 2, 1024, 10, 0) == []
    # cp = 1 sends nothing, rightly
    assert cp_problems([_attention(1, 1, 1024)], 1, 1024, 0, 0) == []


def test_tokens_guard_compares_the_trained_tokens_with_the_layout():
    assert tokens_problems(512, 4, 4, 4 * 4 * 512, 0) == []
    p = tokens_problems(512, 4, 4, 2 * 4 * 4 * 512, 1)
    assert len(p) == 1 and "trained 8,192 tokens" in p[0] and "the layout says 16,384" in p[0]
    assert tokens_problems(None, 4, 4, 1, 0) == []  # a rank that saw no tokens (middle pipeline stage)


def test_loss_and_mfu_guards():
    assert loss_problems(2.5, 0) == [] and mfu_problems(0.45, 0) == [] and mfu_problems(None, 0) == []
    assert "the loss is nan" in loss_problems(math.nan, 4)[0]
    assert "the loss is inf" in loss_problems(math.inf, 4)[0]
    p = mfu_problems(1.93, 7)
    assert p and "193% exceeds the device's peak" in p[0] and "context parallelism not active" in p[0]


def test_a_tripped_guard_stops_with_every_message():
    raise_if([])
    with pytest.raises(GuardTripped, match=r"(?s)loss is nan.*193%"):
        raise_if(loss_problems(math.nan, 1) + mfu_problems(1.93, 1))
