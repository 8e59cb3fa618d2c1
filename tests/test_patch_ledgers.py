"""The patch ledgers (``integrations/{megatron,nemo,bridge}/patches.py``): every rebinding of a third-party name is a
row (target, devices, versions, why, the function that makes it); an app's entry applies its ledger once, the
Megatron-core ledger first; CPU-only rows are declared so and are not part of what a CUDA process applies. The
all-device rows: the GPT decoder built as our block (R2) and routed to its own recompute (R1), NeMo's group timeout
(T1), and each front end's GPT model class (M1: the chunked loss built in)."""

from __future__ import annotations

import importlib
import json
import subprocess
import sys
from pathlib import Path

from nemo_longctx.apps.ledgers import ledgers
from nemo_longctx.shared.patch_ledger import ALL_DEVICES, CPU_ONLY

ROOT = Path(__file__).resolve().parents[1]


def test_ledgers_declare_every_row_completely():
    megatron, nemo, bridge = ledgers()
    assert [ledger.framework for ledger in (megatron, nemo, bridge)] == ["Megatron-core", "NeMo 2", "Megatron-Bridge"]
    assert nemo.requires == (megatron,) and bridge.requires == (megatron,) and megatron.requires == ()
    for ledger in (megatron, nemo, bridge):
        assert ledger.rows, ledger.framework
        for row in ledger.rows:
            assert row.target and row.versions and row.why and row.devices in (CPU_ONLY, ALL_DEVICES), row
            module, _, name = row.function.partition(":")
            assert module.startswith("nemo_longctx.integrations.") and name, row


ALL_DEVICE_ROWS = {"Megatron-core": ["R2", "R1"], "NeMo 2": ["T1", "M1"], "Megatron-Bridge": ["M1"]}


def test_only_the_declared_rows_apply_on_every_device():
    """What a process with CUDA applies, read from the declarations: only the all-device rows."""
    for ledger in ledgers():
        assert [r.key for r in ledger.rows_for(cuda=True)] == ALL_DEVICE_ROWS[ledger.framework]
        assert ledger.rows_for(cuda=False) == list(ledger.rows)  # without CUDA: every row, in table order
        assert all(r.devices == CPU_ONLY for r in ledger.rows if r.key not in ALL_DEVICE_ROWS[ledger.framework])


def test_every_row_names_a_function_of_the_modules_that_may_patch():
    """Each row's function exists, in a module the layering test lets patch (megatron and NeMo stack here; Bridge's
    functions only import Bridge when called)."""
    from test_layering import PATCHING

    for ledger in ledgers():
        for row in ledger.rows:
            module, _, name = row.function.partition(":")
            assert module in PATCHING, row
            assert callable(getattr(importlib.import_module(module), name)), row


_APPLY_TWICE = r"""
import json, sys, torch
from nemo_longctx.integrations.nemo import compat
from nemo_longctx.integrations.nemo.patches import LEDGER as NEMO
from nemo_longctx.integrations.megatron.patches import LEDGER as MEGATRON
import nemo.lightning.megatron_init as megatron_init
from megatron.core import parallel_state
from megatron.core.models.gpt import gpt_model
from nemo.collections.llm.gpt.model import base
cuda_before = (torch.cuda.Stream, torch.cuda.current_device)
out = {"cuda": torch.cuda.is_available()}
if sys.argv[1] == "cuda-rows":  # a process applying what a CUDA process applies (the ledgers' own choice of rows)
    out["first"] = [NEMO.apply(cuda=True), MEGATRON.applied(), NEMO.applied()]
    out["cuda_untouched"] = (torch.cuda.Stream, torch.cuda.current_device) == cuda_before
    out["seed_untouched"] = not getattr(megatron_init._set_random_seed, "_nemo_longctx", False)
    out["timeout_routed"] = getattr(parallel_state.initialize_model_parallel, "_nemo_longctx", False)
    out["classes"] = [base.MCoreGPTModel.__name__, gpt_model.TransformerBlock.__name__]
else:
    first = compat.apply()
    seed, init = megatron_init._set_random_seed, parallel_state.initialize_model_parallel
    second = compat.apply()
    out["first"] = [first, MEGATRON.applied(), NEMO.applied()]
    out["second"] = [second, NEMO.apply(), MEGATRON.apply()]
    out["same_objects"] = seed is megatron_init._set_random_seed and init is parallel_state.initialize_model_parallel
print("RESULT " + json.dumps(out))
"""


def _run(mode: str) -> dict:
    proc = subprocess.run([sys.executable, "-c", _APPLY_TWICE, mode], cwd=ROOT, capture_output=True, text=True,
                          timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    line = next(x for x in proc.stdout.splitlines() if x.startswith("RESULT "))
    return json.loads(line[len("RESULT "):])


def test_an_entry_applies_the_ledgers_once_megatron_first():
    megatron, nemo, _ = ledgers()
    out = _run("entry")
    cuda = out["cuda"]
    ok, megatron_applied, nemo_applied = out["first"]
    assert ok is (not cuda)
    assert megatron_applied == [r.key for r in megatron.rows_for(cuda)]
    assert nemo_applied == [r.key for r in nemo.rows_for(cuda)]
    assert out["second"] == [ok, [], []]  # applied once: a second entry applies nothing
    assert out["same_objects"]  # and rebinds nothing again


def test_cuda_rows_leave_the_cpu_only_targets_alone():
    out = _run("cuda-rows")
    applied_now, megatron_applied, nemo_applied = out["first"]
    assert applied_now == nemo_applied == ALL_DEVICE_ROWS["NeMo 2"]
    assert megatron_applied == ALL_DEVICE_ROWS["Megatron-core"]
    assert out["cuda_untouched"] and out["seed_untouched"] and out["timeout_routed"]
    assert out["classes"] == ["ChunkedLossGPTModel", "decoder_block"]  # rows M1 and R2 in place
