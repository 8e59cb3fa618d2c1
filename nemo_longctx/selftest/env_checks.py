"""Self-test section ``env``: torch / CUDA / GPU / driver, flash-attn status, NeMo / Megatron-core / TE presence, and
the patch ledgers (which third-party names an app patches on this machine)."""

from __future__ import annotations

import importlib.util
import platform

import torch

from nemo_longctx.attention import kernels as K
from nemo_longctx.selftest.report import FAIL, INFO, SKIP, Report


def section_env(rep: Report, cuda: bool) -> None:
    rep.add("env", "python / torch", "-", "-", INFO,
            f"python {platform.python_version()}, torch {torch.__version__}, cuda {torch.version.cuda}")
    if cuda:
        n = torch.cuda.device_count()
        p = torch.cuda.get_device_properties(0)
        driver = ""
        try:
            driver = f", driver {torch.cuda.driver_version()}" if hasattr(torch.cuda, "driver_version") else ""
        except Exception:  # noqa: BLE001 - cosmetic
            driver = ""
        rep.add("env", "gpu", "cuda", "-", INFO,
                f"{n} x {p.name}, sm_{p.major}{p.minor}, {p.total_memory / 2**30:.0f} GiB{driver}, "
                f"cudnn {torch.backends.cudnn.version()}")
    else:
        rep.add("env", "gpu", "cuda", "-", SKIP, "skipped: no CUDA")
    state, detail = K.flash_attn_status()
    if state == "broken":
        rep.add("env", "flash-attn", "-", "-", FAIL, f"installed but broken: {detail}")
    else:
        rep.add("env", "flash-attn", "-", "-", INFO, detail if state == "ok" else "not installed")
    present = [m for m in ("nemo", "megatron.core", "transformer_engine") if _has_module(m)]
    rep.add("env", "nemo / mcore / te", "-", "-", INFO, "present: " + (", ".join(present) or "none"))
    section_patch_ledgers(rep, cuda)


def section_patch_ledgers(rep: Report, cuda: bool) -> None:
    """One row per patch ledger: its rows (key and target) that an app applies on this machine, and those it does not
    (``nemo-longctx --versions`` lists every row with its reason)."""
    from nemo_longctx.apps.ledgers import ledgers

    for ledger in ledgers():
        applied = ledger.rows_for(cuda)
        skipped = [r for r in ledger.rows if r not in applied]
        detail = f"{len(applied)} of {len(ledger.rows)} rows applied here"
        if applied:
            detail += ": " + "; ".join(f"{r.key} {r.target}" for r in applied)
        if skipped:
            detail += f" (cpu-only, not with CUDA: {', '.join(r.key for r in skipped)})"
        rep.add("env", f"patches: {ledger.framework}", "-", "-", INFO, detail)


def _has_module(name: str) -> bool:
    try:
        return importlib.util.find_spec(name) is not None
    except (ImportError, ValueError):
        return False
