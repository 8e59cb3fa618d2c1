"""Self-test section ``env``: torch / CUDA / GPU / driver, flash-attn status, NeMo / Megatron-core / TE presence."""

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


def _has_module(name: str) -> bool:
    try:
        return importlib.util.find_spec(name) is not None
    except (ImportError, ValueError):
        return False
