"""Self-test section ``kernels``: every selectable attention kernel vs the fp64 reference (the kernel table), the
GQA-native memory check, the fastest exact default and the start-up self-test; ``WRONG_KERNEL`` for ``--inject``."""

from __future__ import annotations

from typing import Dict, List, Optional, Sequence

import torch

from nemo_longctx.attention import kernels as K
from nemo_longctx.selftest.report import FAIL, INFO, NA, PASS, SKIP, Report, dtype_label, format_error


def _wrong_forward(q, k, v, causal, scale):
    # deliberately wrong: ignores the causal mask (and so the merged LSE is off too)
    return K.math_forward(q, k, v, False, scale)


def _wrong_backward(dout, q, k, v, out, lse, causal, scale):
    return K.math_backward(dout, q, k, v, out, lse, False, scale)


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
                rep.add("kernels", kern.name, device.type, dtype_label(dtype), NA, "dtype not supported by the kernel")
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
                    bad.append(label + " (" + ", ".join(f"{k2} {format_error(v)}" for k2, v in over.items()) + ")")
                if verbose:
                    print(f"      {kern.name} {dtype_label(dtype)} {label}: "
                          + " ".join(f"{k2}={format_error(v)}" for k2, v in errs.items()))
            errs_txt = " ".join(f"{k2} {format_error(worst[k2])}" for k2 in ("out", "lse", "dq", "dk", "dv")
                                if k2 in worst)
            summary = f"{ran}/{ran + len(errors)} cases, worst rel err: {errs_txt} (tol {tol:g})"
            if skipped:
                summary += f"; n/a: {len(skipped)} (dv != d or head dim unsupported)"
            if bad:
                rep.add("kernels", kern.name, device.type, dtype_label(dtype), FAIL,
                        summary + "; WRONG: " + "; ".join(bad[:4]))
            elif errors:
                required = kern.name in _REQUIRED.get(device.type, ())
                rep.add("kernels", kern.name, device.type, dtype_label(dtype), FAIL if required else NA,
                        summary + "; raised: " + "; ".join(errors[:3])
                        + ("" if required else " (optional kernel: not selectable here)"))
            elif ran == 0:
                rep.add("kernels", kern.name, device.type, dtype_label(dtype), NA, "no supported case")
            else:
                rep.add("kernels", kern.name, device.type, dtype_label(dtype), PASS, summary)
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
            rep.add("kernels", f"{name} GQA-native memory", device.type, dtype_label(dtype),
                    PASS if extra <= limit else FAIL, detail)
        else:
            rep.add("kernels", f"{name} GQA memory", device.type, dtype_label(dtype), INFO,
                    detail + " (not GQA-native: repeats KV heads, warns once)")


def section_kernels(rep: Report, cuda: bool, inject: bool, quick: bool, verbose: bool) -> Optional[str]:
    extra = [WRONG_KERNEL] if inject else []
    cpu = torch.device("cpu")
    run_kernel_table(rep, cpu, (torch.float32, torch.bfloat16), ("cpu_flash", "math"), extra, quick, verbose)
    auto_cpu = K.select_kernel(cpu, torch.float32, "auto")
    try:
        worst = K.self_test_kernel(auto_cpu, cpu, torch.float32)
        rep.add("kernels", "start-up self_test_kernel", "cpu", "fp32", PASS,
                f"auto kernel {auto_cpu.name}: worst " + " ".join(f"{k2} {format_error(v)}" for k2, v in worst.items()))
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
            rep.add("kernels", "default (fastest exact)", "cuda", dtype_label(dtype), FAIL, "no exact kernel")
            continue
        best, timings = K.pick_fastest_exact_kernel(dev, dtype, candidates=cands)
        tim = ", ".join(f"{n} {v * 1e3:.2f} ms" if isinstance(v, float) else f"{n} {v}" for n, v in timings.items())
        rep.add("kernels", "default (fastest exact)", "cuda", dtype_label(dtype), PASS if best else FAIL,
                f"{best} registered as auto default; fwd+bwd b=1 s=4096 hq=32 hkv=8 d=128 causal: {tim}")
        if dtype == torch.bfloat16:
            chosen = best
        try:
            worst = K.self_test_kernel("auto", dev, dtype)
            rep.add("kernels", "start-up self_test_kernel", "cuda", dtype_label(dtype), PASS,
                    f"auto kernel {K.select_kernel(dev, dtype).name}: worst "
                    + " ".join(f"{k2} {format_error(v)}" for k2, v in worst.items()))
        except Exception as e:  # noqa: BLE001 - KernelSelfTestError or a selection error
            rep.add("kernels", "start-up self_test_kernel", "cuda", dtype_label(dtype), FAIL, str(e))
    return chosen
