"""The patch ledgers of the three integrations, as ``nemo-longctx --versions`` and the self-test list them.

Each ledger module only declares its rows (nothing of NeMo, Bridge or Megatron is imported to read them)."""

from __future__ import annotations

from typing import List


def ledgers() -> list:
    """Megatron-core's, NeMo 2's and Megatron-Bridge's ledgers (``shared.patch_ledger.PatchLedger``), in that order."""
    from nemo_longctx.integrations.bridge.patches import LEDGER as BRIDGE
    from nemo_longctx.integrations.megatron.patches import LEDGER as MEGATRON
    from nemo_longctx.integrations.nemo.patches import LEDGER as NEMO

    return [MEGATRON, NEMO, BRIDGE]


def ledger_lines() -> List[str]:
    """Every row of every ledger (key, devices, target, versions, why), each ledger under its heading."""
    out: List[str] = []
    for ledger in ledgers():
        out += ledger.lines()
    return out
