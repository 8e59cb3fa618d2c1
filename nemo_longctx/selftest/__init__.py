"""``python -m nemo_longctx.selftest``: every attention kernel, CP algorithm, offload path and tiling path this
machine can run, checked against float64 references, in one table.

Needs only PyTorch (NeMo, Megatron-core, TransformerEngine and flash-attn are reported and used when present).
Sections (``--sections``, default all):

  env       torch / CUDA / GPU / driver, flash-attn status (a present-but-broken flash-attn FAILs), NeMo/TE/MCore.
  kernels   each selectable kernel vs the fp64 math reference: MHA/GQA/MQA, causal/full, d=64/128, dv != d
            (kernels that support it), forward and backward, the split-KV contract (each key block's backward
            gets the merged out/lse of the whole row). CPU: cpu_flash, math (fp32, bf16). CUDA: flash_attn
            (when installed), sdpa_flash, sdpa_cudnn, sdpa_cuda (bf16, fp16). On CUDA also: GQA-native kernels
            must not allocate repeated KV heads; the fastest exact kernel becomes the "auto" default for the
            device (``kernels.pick_fastest_exact_kernel``), and the start-up check ``self_test_kernel`` of the
            auto choice runs.
  cp        ring (P=4), Ulysses (P=4) and hybrid (2x2) forward+backward on 4 spawned processes vs the fp64
            reference: CPU tensors over gloo; CUDA tensors over NCCL with >= 4 GPUs, else 4 processes on one
            GPU over gloo with the CUDA tensors staged through CPU memory.
  offload   activation offload + prefetch vs the same model without offload (bit-exact loss and gradients); on
            CUDA with pinned memory on side streams: no host-blocking synchronize in the step, pinned copy
            bandwidth, and the step time with vs without offload (overlap).
  tiling    tiled MLP and chunked output layer + loss vs untiled, both vs fp64 (CPU fp32/bf16, CUDA bf16).

The sections live in ``env_checks``, ``kernel_checks``, ``cp_checks``, ``offload_checks`` and ``tiling_checks``
(shared rows/report/formatting in ``report``); their public names are re-exported here.
"""

from __future__ import annotations

import argparse
import json
import os
import time
import traceback
from dataclasses import asdict
from typing import Optional, Sequence

import torch

from nemo_longctx.selftest.cp_checks import section_cp
from nemo_longctx.selftest.env_checks import section_env
from nemo_longctx.selftest.kernel_checks import WRONG_KERNEL, gqa_memory_check, section_kernels  # noqa: F401
from nemo_longctx.selftest.offload_checks import (  # noqa: F401  (tests and bench/offload_overlap.py use them)
    ToyModel, offload_exactness, offload_overlap, offload_step, pinned_bandwidth, section_offload)
from nemo_longctx.selftest.report import FAIL, INFO, NA, PASS, SKIP, Report, Row  # noqa: F401
from nemo_longctx.selftest.tiling_checks import section_tiling

INJECT_ENV_VAR = "NEMO_LONGCTX_SELFTEST_INJECT"
SECTIONS = ("env", "kernels", "cp", "offload", "tiling")

__all__ = [
    "INJECT_ENV_VAR", "SECTIONS", "run", "main", "PASS", "FAIL", "SKIP", "NA", "INFO", "Row", "Report",
    "WRONG_KERNEL", "gqa_memory_check", "ToyModel", "offload_step", "offload_exactness", "pinned_bandwidth",
    "offload_overlap",
]


def run(sections: Sequence[str] = SECTIONS, *, cuda: Optional[bool] = None, inject: bool = False,
        quick: bool = False, verbose: bool = False, stream=None) -> Report:
    """Run the chosen sections; returns the Report (``Report.failed()`` empty iff all passed)."""
    rep = Report(stream)
    if cuda is None:
        cuda = torch.cuda.is_available()
    chosen = None
    steps = {
        "env": lambda: section_env(rep, cuda),
        "kernels": lambda: section_kernels(rep, cuda, inject, quick, verbose),
        "cp": lambda: section_cp(rep, cuda, chosen, quick),
        "offload": lambda: section_offload(rep, cuda, quick),
        "tiling": lambda: section_tiling(rep, cuda),
    }
    for name in SECTIONS:
        if name not in sections:
            continue
        t0 = time.perf_counter()
        try:
            value = steps[name]()
            if name == "kernels":
                chosen = value
        except Exception as e:  # noqa: BLE001 - a crashing section is a failed check, the others still run
            rep.add(name, "section crashed", "-", "-", FAIL, f"{type(e).__name__}: {e}"[:2000])
            traceback.print_exc()
        print(f"  ({name}: {time.perf_counter() - t0:.1f} s)", file=rep.stream, flush=True)
    return rep


def main(argv: Optional[Sequence[str]] = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m nemo_longctx.selftest", description=__doc__.split("\n\n")[0])
    ap.add_argument("--sections", default=",".join(SECTIONS),
                    help=f"comma-separated subset of {','.join(SECTIONS)} (default: all)")
    ap.add_argument("--no-cuda", action="store_true", help="run the CPU checks only (CUDA rows: skipped)")
    ap.add_argument("--inject", choices=["wrong_kernel"], default=os.environ.get(INJECT_ENV_VAR) or None,
                    help=f"add a deliberately wrong kernel (also via {INJECT_ENV_VAR}=wrong_kernel)")
    ap.add_argument("--quick", action="store_true", help="fewer kernel cases and smaller CUDA problems")
    ap.add_argument("--verbose", action="store_true", help="print every kernel case")
    ap.add_argument("--json", default=None, help="write the rows as JSON to this path")
    args = ap.parse_args(argv)
    sections = [s.strip() for s in args.sections.split(",") if s.strip()]
    unknown = [s for s in sections if s not in SECTIONS]
    if unknown:
        ap.error(f"unknown sections {unknown}; choose from {list(SECTIONS)}")
    cuda = torch.cuda.is_available() and not args.no_cuda
    print(f"nemo_longctx selftest: sections {','.join(sections)}; CUDA "
          f"{'available' if cuda else 'not available (CUDA checks skipped)'}", flush=True)
    t0 = time.perf_counter()
    rep = run(sections, cuda=cuda, inject=args.inject == "wrong_kernel", quick=args.quick, verbose=args.verbose)
    print("\n" + rep.table())
    failed = rep.failed()
    counts = {st: sum(r.status == st for r in rep.rows) for st in (PASS, FAIL, SKIP, NA, INFO)}
    print(f"\nselftest: {counts[PASS]} passed, {counts[FAIL]} failed, {counts[SKIP]} skipped, {counts[NA]} n/a, "
          f"{counts[INFO]} info in {time.perf_counter() - t0:.0f} s -> {'FAILED' if failed else 'OK'}")
    for r in failed:
        print(f"  FAILED: {r.section} / {r.check} / {r.device} / {r.dtype}: {r.detail}")
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"ok": not failed, "rows": [asdict(r) for r in rep.rows]}, f, indent=1)
    return 1 if failed else 0
