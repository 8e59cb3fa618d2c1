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

Exit status 0 iff every check that ran passed (skipped/n-a rows do not fail). ``--inject wrong_kernel`` (or
``NEMO_LONGCTX_SELFTEST_INJECT=wrong_kernel``) adds a deliberately wrong kernel to the kernel table to
demonstrate a failing run. ``--json PATH`` writes the rows.
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import math
import os
import platform
import socket
import sys
import time
import traceback
from dataclasses import asdict, dataclass
from typing import Callable, Dict, List, Optional, Sequence

import torch

from nemo_longctx.attention import kernels as K

INJECT_ENV_VAR = "NEMO_LONGCTX_SELFTEST_INJECT"
SECTIONS = ("env", "kernels", "cp", "offload", "tiling")

PASS, FAIL, SKIP, NA, INFO = "PASS", "FAIL", "SKIP", "n/a", "INFO"

_DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16, "fp64": torch.float64}
_DTYPE_NAMES = {v: k for k, v in _DTYPES.items()}


@dataclass
class Row:
    section: str
    check: str
    device: str
    dtype: str
    status: str
    detail: str = ""


class Report:
    def __init__(self, stream=None) -> None:
        self.rows: List[Row] = []
        self.stream = stream or sys.stdout

    def add(self, section: str, check: str, device: str, dtype: str, status: str, detail: str = "") -> Row:
        row = Row(section, check, device, dtype, status, detail)
        self.rows.append(row)
        print(f"  [{status:4s}] {section:7s} {check:28s} {device:5s} {dtype:5s} {detail}", file=self.stream,
              flush=True)
        return row

    def failed(self) -> List[Row]:
        return [r for r in self.rows if r.status == FAIL]

    def table(self) -> str:
        head = ("section", "check", "device", "dtype", "result", "detail")
        lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
        for r in self.rows:
            detail = r.detail.replace("|", "/")
            lines.append(f"| {r.section} | {r.check} | {r.device} | {r.dtype} | {r.status} | {detail} |")
        return "\n".join(lines)


def _dn(dtype: torch.dtype) -> str:
    return _DTYPE_NAMES.get(dtype, str(dtype).replace("torch.", ""))


def _fmt(x: float) -> str:
    return "inf" if x == float("inf") else f"{x:.2e}"


# ------------------------------------------------------------------------------------------------- env


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


# --------------------------------------------------------------------------------------------- kernels


def _wrong_forward(q, k, v, causal, scale):
    # deliberately wrong: ignores the causal mask (and so the merged LSE is off too)
    return K._math_forward(q, k, v, False, scale)


def _wrong_backward(dout, q, k, v, out, lse, causal, scale):
    return K._math_backward(dout, q, k, v, out, lse, False, scale)


WRONG_KERNEL = K.AttentionKernel("injected_wrong", _wrong_forward, _wrong_backward, value_dim_differs=True)


def kernel_cases(device_type: str, quick: bool = False) -> List[dict]:
    """The case list: MHA/GQA/MQA x causal/full x d=64/128, dv != d, split-KV (GQA and MQA)."""
    s = 128 if device_type == "cpu" else 384
    cases = []
    for label, hq, hkv in (("MHA", 4, 4), ("GQA", 8, 2), ("MQA", 4, 1)):
        for causal in (True, False):
            for d in ((64,) if quick else (64, 128)):
                cases.append(dict(label=f"{label} {'causal' if causal else 'full'} d={d}", hq=hq, hkv=hkv, d=d,
                                  causal=causal, s=s))
    cases.append(dict(label="GQA causal d=128 dv=64", hq=8, hkv=2, d=128, dv=64, causal=True, s=s))
    cases.append(dict(label="GQA split-KV d=64", hq=8, hkv=2, d=64, causal=False, split_kv=True, s=s))
    cases.append(dict(label="MQA split-KV d=128", hq=4, hkv=1, d=128, causal=False, split_kv=True, s=s))
    if device_type == "cuda":
        cases.append(dict(label="GQA causal ragged s=200", hq=8, hkv=2, d=64, causal=True, s=200))
    return cases


# kernels whose errors (exceptions) fail the run; others (cuDNN) are reported as unavailable and not chosen
_REQUIRED = {"cpu": {"cpu_flash", "math"}, "cuda": {"sdpa_flash", "sdpa_cuda", "flash_attn"}}


def run_kernel_table(rep: Report, device: torch.device, dtypes: Sequence[torch.dtype], names: Sequence[str],
                     extra: Sequence[K.AttentionKernel] = (), quick: bool = False, verbose: bool = False
                     ) -> Dict[torch.dtype, List[str]]:
    """One row per (kernel, dtype); returns {dtype: [kernels that passed every case]}."""
    passed: Dict[torch.dtype, List[str]] = {}
    kerns = [K.KERNELS[n] for n in names] + list(extra)
    cases = kernel_cases(device.type, quick)
    for dtype in dtypes:
        tol = K.TOLERANCE[dtype]
        passed[dtype] = []
        for kern in kerns:
            if kern.dtypes is not None and dtype not in kern.dtypes:
                rep.add("kernels", kern.name, device.type, _dn(dtype), NA, "dtype not supported by the kernel")
                continue
            worst: Dict[str, float] = {}
            ran, bad, errors, skipped = 0, [], [], []
            for case in cases:
                c = dict(case)
                label = c.pop("label")
                if not kern.supports(device.type, dtype, c["d"], c.get("dv")):
                    skipped.append(label)
                    continue
                try:
                    errs = K.check_kernel_case(kern, device, dtype, seed=ran, **c)
                except Exception as e:  # noqa: BLE001 - a kernel error is a result
                    errors.append(f"{label}: {type(e).__name__}: {str(e).splitlines()[0][:160]}")
                    continue
                ran += 1
                for key, val in errs.items():
                    worst[key] = max(worst.get(key, 0.0), val)
                over = {key: v for key, v in errs.items() if not v <= tol}
                if over:
                    bad.append(label + " (" + ", ".join(f"{k2} {_fmt(v)}" for k2, v in over.items()) + ")")
                if verbose:
                    print(f"      {kern.name} {_dn(dtype)} {label}: "
                          + " ".join(f"{k2}={_fmt(v)}" for k2, v in errs.items()))
            errs_txt = " ".join(f"{k2} {_fmt(worst[k2])}" for k2 in ("out", "lse", "dq", "dk", "dv") if k2 in worst)
            summary = f"{ran}/{ran + len(errors)} cases, worst rel err: {errs_txt} (tol {tol:g})"
            if skipped:
                summary += f"; n/a: {len(skipped)} (dv != d or head dim unsupported)"
            if bad:
                rep.add("kernels", kern.name, device.type, _dn(dtype), FAIL,
                        summary + "; WRONG: " + "; ".join(bad[:4]))
            elif errors:
                required = kern.name in _REQUIRED.get(device.type, ())
                rep.add("kernels", kern.name, device.type, _dn(dtype), FAIL if required else NA,
                        summary + "; raised: " + "; ".join(errors[:3])
                        + ("" if required else " (optional kernel: not selectable here)"))
            elif ran == 0:
                rep.add("kernels", kern.name, device.type, _dn(dtype), NA, "no supported case")
            else:
                rep.add("kernels", kern.name, device.type, _dn(dtype), PASS, summary)
                passed[dtype].append(kern.name)
    return passed


def gqa_memory_check(rep: Report, device: torch.device, dtype: torch.dtype, names: Sequence[str]) -> None:
    """GQA-native kernels must not allocate repeated KV heads: forward peak increment on an MQA block must stay
    below out + lse + half of the repeated K/V bytes."""
    b, s, hq, hkv, d = 1, 4096, 16, 1, 128
    g = torch.Generator(device="cpu").manual_seed(0)
    q, k, v = (torch.randn(b, s, h, d, generator=g).to(device=device, dtype=dtype) for h in (hq, hkv, hkv))
    esz = q.element_size()
    out_bytes = b * s * hq * d * esz
    lse_bytes = b * hq * s * 4
    repeated_kv = 2 * b * s * hq * d * esz
    for name in names:
        kern = K.KERNELS[name]
        kern.forward(q, k, v, True, d ** -0.5)  # warm-up (workspace, cuDNN plans)
        torch.cuda.synchronize(device)
        torch.cuda.reset_peak_memory_stats(device)
        base = torch.cuda.memory_allocated(device)
        out, lse = kern.forward(q, k, v, True, d ** -0.5)
        torch.cuda.synchronize(device)
        extra = torch.cuda.max_memory_allocated(device) - base
        del out, lse
        limit = out_bytes + lse_bytes + repeated_kv // 2
        detail = (f"MQA hq={hq} s={s} d={d}: forward peak +{extra / 2**20:.1f} MiB (out+lse "
                  f"{(out_bytes + lse_bytes) / 2**20:.1f} MiB, repeated K/V would add {repeated_kv / 2**20:.1f} MiB)")
        if kern.gqa_native:
            rep.add("kernels", f"{name} GQA-native memory", device.type, _dn(dtype),
                    PASS if extra <= limit else FAIL, detail)
        else:
            rep.add("kernels", f"{name} GQA memory", device.type, _dn(dtype), INFO,
                    detail + " (not GQA-native: repeats KV heads, warns once)")


def section_kernels(rep: Report, cuda: bool, inject: bool, quick: bool, verbose: bool) -> Optional[str]:
    extra = [WRONG_KERNEL] if inject else []
    cpu = torch.device("cpu")
    run_kernel_table(rep, cpu, (torch.float32, torch.bfloat16), ("cpu_flash", "math"), extra, quick, verbose)
    auto_cpu = K.select_kernel(cpu, torch.float32, "auto")
    try:
        worst = K.self_test_kernel(auto_cpu, cpu, torch.float32)
        rep.add("kernels", "start-up self_test_kernel", "cpu", "fp32", PASS,
                f"auto kernel {auto_cpu.name}: worst " + " ".join(f"{k2} {_fmt(v)}" for k2, v in worst.items()))
    except K.KernelSelfTestError as e:
        rep.add("kernels", "start-up self_test_kernel", "cpu", "fp32", FAIL, str(e))
    if not cuda:
        rep.add("kernels", "CUDA kernels", "cuda", "-", SKIP, "skipped: no CUDA")
        return None
    dev = torch.device("cuda", torch.cuda.current_device())
    names = ["sdpa_flash", "sdpa_cudnn", "sdpa_cuda"]
    state, detail = K.flash_attn_status()
    if state == "ok":
        names.insert(0, "flash_attn")
    else:
        rep.add("kernels", "flash_attn", "cuda", "-", FAIL if state == "broken" else NA,
                detail if state == "broken" else "flash-attn not installed")
    half = (torch.bfloat16, torch.float16)
    passed = run_kernel_table(rep, dev, half, names, extra, quick, verbose)
    run_kernel_table(rep, dev, (torch.float32,), ["sdpa_cuda"], (), quick, verbose)
    native = [n for n in passed[torch.bfloat16] if n in K.KERNELS]
    if native:
        gqa_memory_check(rep, dev, torch.bfloat16, native)
    chosen = None
    for dtype in half:
        cands = [n for n in passed[dtype] if n in K.KERNELS]
        if not cands:
            rep.add("kernels", "default (fastest exact)", "cuda", _dn(dtype), FAIL, "no exact kernel")
            continue
        best, timings = K.pick_fastest_exact_kernel(dev, dtype, candidates=cands)
        tim = ", ".join(f"{n} {v * 1e3:.2f} ms" if isinstance(v, float) else f"{n} {v}" for n, v in timings.items())
        rep.add("kernels", "default (fastest exact)", "cuda", _dn(dtype), PASS if best else FAIL,
                f"{best} registered as auto default; fwd+bwd b=1 s=4096 hq=32 hkv=8 d=128 causal: {tim}")
        if dtype == torch.bfloat16:
            chosen = best
        try:
            worst = K.self_test_kernel("auto", dev, dtype)
            rep.add("kernels", "start-up self_test_kernel", "cuda", _dn(dtype), PASS,
                    f"auto kernel {K.select_kernel(dev, dtype).name}: worst "
                    + " ".join(f"{k2} {_fmt(v)}" for k2, v in worst.items()))
        except Exception as e:  # noqa: BLE001 - KernelSelfTestError or a selection error
            rep.add("kernels", "start-up self_test_kernel", "cuda", _dn(dtype), FAIL, str(e))
    return chosen


# ------------------------------------------------------------------------------------------------- cp


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class _StagedWork:
    """Work handle for ops staged through CPU: waiting copies received CPU buffers back to the CUDA tensors."""

    def __init__(self, works, copy_back, shared) -> None:
        self._works, self._copy_back, self._shared = works, copy_back, shared

    def wait(self, *args, **kwargs):
        if not self._shared["done"]:
            for w in self._works:
                w.wait()
            for dst, src in self._copy_back:
                dst.copy_(src)
            self._shared["done"] = True
        return True

    def is_completed(self) -> bool:
        return self._shared["done"]


def install_cpu_staging() -> None:
    """Let gloo carry CUDA tensors: ``batch_isend_irecv`` and ``all_to_all_single`` copy them through CPU
    memory (only in selftest / bench worker processes; the library itself is untouched)."""
    import torch.distributed as dist

    if getattr(dist, "_nemo_longctx_staged", False):
        return
    orig_batch, orig_a2a = dist.batch_isend_irecv, dist.all_to_all_single

    def batch_isend_irecv(ops):
        new_ops, copy_back = [], []
        for op in ops:
            t = op.tensor
            if t.is_cuda:
                is_send = getattr(op.op, "__name__", "") in ("isend", "send")
                cpu = t.detach().to("cpu") if is_send else torch.empty(t.shape, dtype=t.dtype)
                if not is_send:
                    copy_back.append((t, cpu))
                new_ops.append(dist.P2POp(op.op, cpu, op.peer, op.group, op.tag))
            else:
                new_ops.append(op)
        works = orig_batch(new_ops)
        shared = {"done": False}
        return [_StagedWork(works, copy_back, shared)]

    def all_to_all_single(output, input, output_split_sizes=None, input_split_sizes=None, group=None,
                          async_op=False):
        if not (output.is_cuda or input.is_cuda):
            return orig_a2a(output, input, output_split_sizes, input_split_sizes, group=group, async_op=async_op)
        out_cpu = torch.empty(output.shape, dtype=output.dtype)
        orig_a2a(out_cpu, input.detach().to("cpu"), output_split_sizes, input_split_sizes, group=group)
        output.copy_(out_cpu)
        return _StagedWork([], [], {"done": True}) if async_op else None

    dist.batch_isend_irecv = batch_isend_irecv
    dist.all_to_all_single = all_to_all_single
    dist._nemo_longctx_staged = True


def _cp_worker(rank: int, world: int, port: int, backend: str, device_kind: str, dtype_name: str,
               kernel: Optional[str], shape: dict, queue) -> None:
    try:
        import torch.distributed as dist

        from nemo_longctx.attention import (hybrid_attention, make_cp_groups, ring_attention, ulysses_attention,
                                            zigzag_shard)

        torch.set_num_threads(1)
        if device_kind == "cuda":
            dev_index = rank if backend == "nccl" else 0
            torch.cuda.set_device(dev_index)
            device = torch.device("cuda", dev_index)
            if backend == "gloo":
                install_cpu_staging()
        else:
            device = torch.device("cpu")
        dist.init_process_group(backend, init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world)
        try:
            dtype = _DTYPES[dtype_name]
            b, s, hq, hkv, d = (shape[x] for x in ("b", "s", "hq", "hkv", "d"))
            g = torch.Generator().manual_seed(1234)
            q, k, v, dout = (torch.randn(b, s, h, d, generator=g).to(dtype) for h in (hq, hkv, hkv, hq))
            scale = d ** -0.5
            r_out, _, r_dq, r_dk, r_dv = K.reference_attention_fp64(q, k, v, dout, True, scale)
            ug, rg = make_cp_groups(dist.group.WORLD, 2) if world % 2 == 0 else (None, None)
            algos = {
                "ring": lambda a, b_, c: ring_attention(a, b_, c, dist.group.WORLD, True, kernel=kernel),
                "ulysses": lambda a, b_, c: ulysses_attention(a, b_, c, dist.group.WORLD, True, kernel=kernel),
            }
            if ug is not None:
                algos["hybrid"] = lambda a, b_, c: hybrid_attention(a, b_, c, ug, rg, True, kernel=kernel)
            result = {}
            for name, fn in algos.items():
                shard = [zigzag_shard(x, 1, world, rank) for x in (q, k, v, dout)]
                ql, kl, vl = (x.to(device).requires_grad_() for x in shard[:3])
                out = fn(ql, kl, vl)
                out.backward(shard[3].to(device))
                errs = {}
                for key, got, want in (("out", out, r_out), ("dq", ql.grad, r_dq), ("dk", kl.grad, r_dk),
                                       ("dv", vl.grad, r_dv)):
                    errs[key] = K.rel_err(got.detach().cpu(), zigzag_shard(want, 1, world, rank))
                result[name] = errs
            queue.put((rank, True, result))
        finally:
            dist.destroy_process_group()
    except BaseException:  # noqa: BLE001 - report to the parent
        queue.put((rank, False, traceback.format_exc()))


def run_spawned(target: Callable, world: int, args: tuple, timeout: float = 600) -> List[object]:
    """Spawn ``world`` processes running ``target(rank, world, port, *args, queue)``; results by rank."""
    import torch.multiprocessing as mp

    ctx = mp.get_context("spawn")
    queue = ctx.Queue()
    port = _free_port()
    procs = [ctx.Process(target=target, args=(r, world, port, *args, queue), daemon=True) for r in range(world)]
    for p in procs:
        p.start()
    results, errors = {}, []
    try:
        for _ in range(world):
            rank, ok, payload = queue.get(timeout=timeout)
            if ok:
                results[rank] = payload
            else:
                errors.append(f"rank {rank}: {payload}")
                break
    finally:
        for p in procs:
            p.join(timeout=5 if errors else 60)
            if p.is_alive():
                p.kill()
    if errors:
        raise RuntimeError("\n".join(errors))
    return [results[r] for r in range(world)]


def _cp_rows(rep: Report, device_kind: str, dtype: torch.dtype, results: List[dict], transport: str) -> None:
    tol = K.TOLERANCE[dtype]
    for algo in results[0]:
        worst = {key: max(r[algo][key] for r in results) for key in results[0][algo]}
        ok = all(v <= tol for v in worst.values())
        rep.add("cp", f"{algo} P={len(results)}", device_kind, _dn(dtype), PASS if ok else FAIL,
                f"{transport}; worst rel err over ranks: "
                + " ".join(f"{k2} {_fmt(v)}" for k2, v in worst.items()) + f" (tol {tol:g})")


def section_cp(rep: Report, cuda: bool, kernel: Optional[str], quick: bool) -> None:
    world = 4
    shape = dict(b=1, s=8 * world * 4, hq=8, hkv=2, d=32)
    try:
        res = run_spawned(_cp_worker, world, ("gloo", "cpu", "fp32", None, shape))
        _cp_rows(rep, "cpu", torch.float32, res, "gloo, 4 processes")
    except Exception as e:  # noqa: BLE001
        rep.add("cp", "ring/ulysses/hybrid", "cpu", "fp32", FAIL, f"{type(e).__name__}: {e}"[:2000])
    if not cuda:
        rep.add("cp", "ring/ulysses/hybrid", "cuda", "-", SKIP, "skipped: no CUDA")
        return
    n = torch.cuda.device_count()
    backend = "nccl" if n >= world else "gloo"
    transport = (f"nccl, {world} GPUs" if backend == "nccl"
                 else f"gloo with CPU staging, {world} processes on 1 GPU ({n} visible)")
    shape = dict(b=1, s=1024 if not quick else 256, hq=8, hkv=2, d=128)
    for dtype in (torch.bfloat16,):
        try:
            res = run_spawned(_cp_worker, world, (backend, "cuda", _dn(dtype), kernel, shape))
            _cp_rows(rep, "cuda", dtype, res, transport + f", kernel {kernel or 'auto'}")
        except Exception as e:  # noqa: BLE001
            rep.add("cp", "ring/ulysses/hybrid", "cuda", _dn(dtype), FAIL, f"{type(e).__name__}: {e}"[:2000])


# --------------------------------------------------------------------------------------------- offload


class ToyBlock(torch.nn.Module):
    def __init__(self, d: int) -> None:
        super().__init__()
        self.norm = torch.nn.LayerNorm(d)
        self.fc1 = torch.nn.Linear(d, 4 * d)
        self.fc2 = torch.nn.Linear(4 * d, d)

    def forward(self, x):
        return x + self.fc2(torch.nn.functional.gelu(self.fc1(self.norm(x))))


class ToyModel(torch.nn.Module):
    """A residual MLP stack; with ``engine`` each block's saved tensors go to host (modules mode) or, with
    ``checkpointed``, each block is checkpointed and its input offloaded (layer_input mode)."""

    def __init__(self, layers: int, d: int) -> None:
        super().__init__()
        self.blocks = torch.nn.ModuleList(ToyBlock(d) for _ in range(layers))

    def forward(self, x, engine=None, checkpointed: bool = False):
        from torch.utils.checkpoint import checkpoint

        h = x
        for i, blk in enumerate(self.blocks):
            if checkpointed:
                call = (lambda f, a: checkpoint(f, a, use_reentrant=False))
            else:
                call = (lambda f, a: f(a))
            if engine is not None:
                h = engine.run_in_scope(i, call, blk, h)
            else:
                h = call(blk, h)
        return h.float().square().mean()


def offload_step(model: ToyModel, x, engine=None, checkpointed: bool = False):
    for p in model.parameters():
        p.grad = None
    loss = model(x, engine=engine, checkpointed=checkpointed)
    loss.backward()
    return loss.detach(), [p.grad.detach().clone() for p in model.parameters()]


def offload_exactness(device: torch.device, dtype: torch.dtype, layers: int, d: int, tokens: int
                      ) -> Dict[str, object]:
    """Loss and gradients with offload (modules mode and checkpointed layer_input mode) vs without."""
    from nemo_longctx.memory import ActivationOffloader

    torch.manual_seed(0)
    model = ToyModel(layers, d).to(device=device, dtype=dtype)
    x = torch.randn(tokens, d, device=device, dtype=dtype)
    out = {}
    for mode, ckpt in (("modules", False), ("layer_input", True)):
        ref_loss, ref_grads = offload_step(model, x, None, ckpt)
        engine = ActivationOffloader(min_bytes=1024, prefetch_depth=1)
        loss, grads = offload_step(model, x, engine, ckpt)
        loss2, grads2 = offload_step(model, x, engine, ckpt)  # second step reuses the pool
        exact = (torch.equal(loss, ref_loss) and torch.equal(loss2, ref_loss)
                 and all(torch.equal(a, b) for a, b in zip(grads + grads2, ref_grads + ref_grads)))
        diff = max(float((a.double() - b.double()).abs().max()) for a, b in zip(grads, ref_grads))
        out[mode] = dict(exact=exact, max_grad_diff=diff, bytes=engine.bytes_offloaded // 2,
                         pool_in_use=engine.pool.bytes_in_use, release_errors=engine.release_errors,
                         pinned=engine.pool.pin_memory)
    return out


def pinned_bandwidth(device: torch.device, nbytes: int = 256 * 2**20, repeats: int = 5) -> Dict[str, float]:
    """D2H and H2D GB/s between device memory and a pinned host buffer."""
    host = torch.empty(nbytes, dtype=torch.uint8, pin_memory=True)
    dev = torch.empty(nbytes, dtype=torch.uint8, device=device)
    res = {}
    for name, dst, src in (("d2h", host, dev), ("h2d", dev, host)):
        dst.copy_(src, non_blocking=True)
        torch.cuda.synchronize(device)
        t0 = time.perf_counter()
        for _ in range(repeats):
            dst.copy_(src, non_blocking=True)
        torch.cuda.synchronize(device)
        res[name] = nbytes * repeats / (time.perf_counter() - t0) / 1e9
    return res


def offload_overlap(device: torch.device, dtype: torch.dtype, layers: int, d: int, tokens: int, steps: int = 5
                    ) -> Dict[str, float]:
    """Median step time without offload, with layer_input offload (checkpointed, prefetch 1) and the count of
    host-blocking synchronize calls (Event/Stream/device) made during the offloaded steps (must be 0)."""
    from nemo_longctx.memory import ActivationOffloader

    torch.manual_seed(0)
    model = ToyModel(layers, d).to(device=device, dtype=dtype)
    x = torch.randn(tokens, d, device=device, dtype=dtype)
    engine = ActivationOffloader(min_bytes=1024, prefetch_depth=1)
    calls = {"n": 0}
    orig_event_sync, orig_stream_sync = torch.cuda.Event.synchronize, torch.cuda.Stream.synchronize
    orig_sync = torch.cuda.synchronize

    def counting(orig):
        def f(self, *a, **k):
            calls["n"] += 1
            return orig(self, *a, **k)
        return f

    def timed(eng, count=False):
        times = []
        for i in range(steps + 1):
            torch.cuda.synchronize(device)
            t0 = time.perf_counter()
            if count:
                torch.cuda.Event.synchronize = counting(orig_event_sync)
                torch.cuda.Stream.synchronize = counting(orig_stream_sync)
                torch.cuda.synchronize = lambda *a, **k: (calls.__setitem__("n", calls["n"] + 1), orig_sync(*a, **k))
            try:
                for p in model.parameters():
                    p.grad = None
                model(x, engine=eng, checkpointed=True).backward()
            finally:
                torch.cuda.Event.synchronize, torch.cuda.Stream.synchronize = orig_event_sync, orig_stream_sync
                torch.cuda.synchronize = orig_sync
            torch.cuda.synchronize(device)
            if i:
                times.append(time.perf_counter() - t0)
        times.sort()
        return times[len(times) // 2]

    t_base = timed(None)
    t_off = timed(engine, count=True)
    t_base2 = timed(None)
    base = min(t_base, t_base2)
    return dict(t_base=base, t_offload=t_off, overhead=t_off / base - 1.0, host_syncs=calls["n"],
                bytes_per_step=engine.bytes_offloaded / (steps + 1))


def section_offload(rep: Report, cuda: bool, quick: bool) -> None:
    cpu = torch.device("cpu")
    res = offload_exactness(cpu, torch.float32, layers=4, d=64, tokens=256)
    for mode, r in res.items():
        ok = r["exact"] and r["pool_in_use"] == 0 and r["release_errors"] == 0
        rep.add("offload", f"{mode} exact", "cpu", "fp32", PASS if ok else FAIL,
                f"loss+grads bit-exact={r['exact']} (max diff {r['max_grad_diff']:.1e}), "
                f"{r['bytes'] / 2**20:.2f} MiB offloaded/step, pool in use after {r['pool_in_use']}, "
                f"release errors {r['release_errors']}")
    if not cuda:
        rep.add("offload", "CUDA streams + pinned", "cuda", "-", SKIP, "skipped: no CUDA")
        return
    dev = torch.device("cuda", torch.cuda.current_device())
    res = offload_exactness(dev, torch.bfloat16, layers=4, d=1024, tokens=4096)
    for mode, r in res.items():
        ok = r["exact"] and r["pool_in_use"] == 0 and r["release_errors"] == 0 and r["pinned"]
        rep.add("offload", f"{mode} exact", "cuda", "bf16", PASS if ok else FAIL,
                f"loss+grads bit-exact={r['exact']} (max diff {r['max_grad_diff']:.1e}), pinned={r['pinned']}, "
                f"{r['bytes'] / 2**20:.1f} MiB offloaded/step, release errors {r['release_errors']}")
    bw = pinned_bandwidth(dev)
    rep.add("offload", "pinned copy bandwidth", "cuda", "u8", INFO,
            f"D2H {bw['d2h']:.1f} GB/s, H2D {bw['h2d']:.1f} GB/s (256 MiB)")
    layers, d, tokens = (8, 2048, 8192) if not quick else (4, 1024, 4096)
    ov = offload_overlap(dev, torch.bfloat16, layers, d, tokens)
    rep.add("offload", "no host sync in hooks", "cuda", "bf16", PASS if ov["host_syncs"] == 0 else FAIL,
            f"Event/Stream.synchronize calls during offloaded steps: {ov['host_syncs']}")
    rep.add("offload", "overlap (step time)", "cuda", "bf16", INFO,
            f"{layers} layers d={d} tokens={tokens}, checkpointed: no offload {ov['t_base'] * 1e3:.1f} ms, "
            f"layer_input offload {ov['t_offload'] * 1e3:.1f} ms ({ov['overhead'] * 100:+.1f}%), "
            f"{ov['bytes_per_step'] / 2**20:.0f} MiB/step each way")


# ---------------------------------------------------------------------------------------------- tiling


def tiling_errors(device: torch.device, dtype: torch.dtype, s: int = 512, h: int = 64, vocab: int = 1000
                  ) -> Dict[str, Dict[str, float]]:
    """Relative errors vs fp64 of tiled vs untiled MLP and chunked vs full-logit loss (outputs and grads)."""
    import torch.nn.functional as F

    from nemo_longctx.memory import chunked_output_cross_entropy, tiled_mlp

    g = torch.Generator().manual_seed(0)
    b = 1
    mlp64 = torch.nn.Sequential(torch.nn.Linear(h, 4 * h), torch.nn.GELU(), torch.nn.Linear(4 * h, h)).double()
    x0 = torch.randn(s, b, h, generator=g, dtype=torch.float64)
    gy = torch.randn(s, b, h, generator=g, dtype=torch.float64)

    def mlp_run(model, x, tiles):
        x = x.detach().requires_grad_()
        y = model(x) if tiles is None else tiled_mlp(model, x, tiles, seq_dim=0)
        y.backward(gy.to(device=x.device, dtype=y.dtype))
        return [y.detach(), x.grad] + [p.grad for p in model.parameters()]

    ref = mlp_run(mlp64, x0, None)
    res = {}
    for label, tiles in (("untiled", None), ("tiled", 4)):
        m = torch.nn.Sequential(torch.nn.Linear(h, 4 * h), torch.nn.GELU(), torch.nn.Linear(4 * h, h))
        m.load_state_dict(mlp64.state_dict())
        m = m.to(device=device, dtype=dtype)
        got = mlp_run(m, x0.to(device=device, dtype=dtype), tiles)
        res[f"mlp {label}"] = {"out": K.rel_err(got[0].cpu(), ref[0]), "dx": K.rel_err(got[1].cpu(), ref[1]),
                               "dW": max(K.rel_err(a.cpu(), r) for a, r in zip(got[2:], ref[2:]))}
    hid = torch.randn(s, b, h, generator=g, dtype=torch.float64)
    w = torch.randn(vocab, h, generator=g, dtype=torch.float64) / math.sqrt(h)
    labels = torch.randint(0, vocab, (b, s), generator=g)

    def loss_run(hh, ww, chunks):
        hh, ww = hh.detach().requires_grad_(), ww.detach().requires_grad_()
        if chunks is None:
            logits = torch.einsum("sbh,vh->bsv", hh, ww).float() if hh.dtype != torch.float64 else \
                torch.einsum("sbh,vh->bsv", hh, ww)
            loss = F.cross_entropy(logits.reshape(b * s, vocab), labels.to(hh.device).reshape(-1),
                                   reduction="none").view(b, s)
        else:
            loss = chunked_output_cross_entropy(hh, ww, labels.to(hh.device), chunks)
        loss.sum().backward()
        return [loss.detach(), hh.grad, ww.grad]

    ref = loss_run(hid, w, None)
    for label, chunks in (("untiled", None), ("chunked", 4)):
        got = loss_run(hid.to(device=device, dtype=dtype), w.to(device=device, dtype=dtype), chunks)
        res[f"loss {label}"] = {"loss": K.rel_err(got[0].cpu(), ref[0]), "dh": K.rel_err(got[1].cpu(), ref[1]),
                                "dW": K.rel_err(got[2].cpu(), ref[2])}
    return res


def _tiling_rows(rep: Report, device: torch.device, dtype: torch.dtype) -> None:
    res = tiling_errors(device, dtype)
    tol = K.TOLERANCE[dtype]
    for what, plain, tiled in (("tiled MLP", "mlp untiled", "mlp tiled"), ("chunked loss", "loss untiled",
                                                                           "loss chunked")):
        a, t = res[plain], res[tiled]
        # tiled must be as accurate as untiled in the same dtype (within 2x + a small floor)
        ok = all(t[k2] <= 2 * a[k2] + 0.05 * tol for k2 in a)
        rep.add("tiling", what, device.type, _dn(dtype), PASS if ok else FAIL,
                "rel err vs fp64, tiled/untiled: " + " ".join(f"{k2} {_fmt(t[k2])}/{_fmt(a[k2])}" for k2 in a))


def section_tiling(rep: Report, cuda: bool) -> None:
    for dtype in (torch.float32, torch.bfloat16):
        _tiling_rows(rep, torch.device("cpu"), dtype)
    if not cuda:
        rep.add("tiling", "tiled MLP / chunked loss", "cuda", "-", SKIP, "skipped: no CUDA")
        return
    _tiling_rows(rep, torch.device("cuda", torch.cuda.current_device()), torch.bfloat16)


# ------------------------------------------------------------------------------------------------ main


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
