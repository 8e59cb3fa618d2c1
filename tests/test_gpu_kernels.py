"""The CUDA kernel layer: flash-attn API detection (2.6.x vs 2.7+) with faithful fakes on CPU, broken installs,
auto selection, the start-up self-test, and -- on a CUDA machine only -- every CUDA kernel vs float64.

The fakes mimic Dao-AILab/flash-attention's ``flash_attn/flash_attn_interface.py``:
  v2.6.3  ``_flash_attn_forward(q, k, v, dropout_p, softmax_scale, causal, window_size, softcap, alibi_slopes,
          return_softmax)`` -> (out, q, k, v, out_padded, softmax_lse, S_dmask, rng_state);
          ``_flash_attn_backward(dout, q, k, v, out, softmax_lse, dq, dk, dv, dropout_p, softmax_scale, causal,
          window_size, softcap, alibi_slopes, deterministic, rng_state=None)`` -> (dq, dk, dv, softmax_d)
  v2.7.x  both are ``torch.library.custom_op``s; forward takes ``window_size_left, window_size_right`` and returns
          (out, softmax_lse, S_dmask, rng_state); backward fills dq/dk/dv in place and returns softmax_d.
The numbers come from the math kernel on CPU, so the adapter (argument order, which output is the LSE, in-place
gradients) is checked end to end against float64.
"""

from __future__ import annotations

import logging
import sys
import types
import warnings
from typing import Optional, Tuple

import pytest
import torch

from nemo_longctx.attention import kernels as K
from nemo_longctx.selftest import WRONG_KERNEL

CUDA = torch.cuda.is_available()
needs_cuda = pytest.mark.skipif(not CUDA, reason="needs a CUDA device")


# ------------------------------------------------------------------------------------------------ fakes


def _fake_interface_26(calls: list) -> types.ModuleType:
    iface = types.ModuleType("flash_attn.flash_attn_interface")

    def _flash_attn_forward(q, k, v, dropout_p, softmax_scale, causal, window_size, softcap, alibi_slopes,
                            return_softmax):
        calls.append(("fwd", window_size, dropout_p, softcap, return_softmax))
        assert isinstance(window_size, tuple) and len(window_size) == 2
        out, lse = K.math_forward(q, k, v, causal, softmax_scale)
        rng_state = torch.zeros(2, dtype=torch.int64)
        return out, q, k, v, out, lse, None, rng_state

    def _flash_attn_backward(dout, q, k, v, out, softmax_lse, dq, dk, dv, dropout_p, softmax_scale, causal,
                             window_size, softcap, alibi_slopes, deterministic, rng_state=None):
        calls.append(("bwd", window_size, deterministic))
        assert isinstance(window_size, tuple)
        a, b, c = K.math_backward(dout, q, k, v, out, softmax_lse, causal, softmax_scale)
        dq.copy_(a)
        dk.copy_(b)
        dv.copy_(c)
        return dq, dk, dv, torch.zeros_like(softmax_lse)

    iface._flash_attn_forward = _flash_attn_forward
    iface._flash_attn_backward = _flash_attn_backward
    return iface


_CALLS_27: list = []


@torch.library.custom_op("nemo_longctx_fake_fa27::_flash_attn_forward", mutates_args=())
def _fa27_forward(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, dropout_p: float, softmax_scale: float,
                  causal: bool, window_size_left: int, window_size_right: int, softcap: float,
                  alibi_slopes: Optional[torch.Tensor], return_softmax: bool
                  ) -> Tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    _CALLS_27.append(("fwd", window_size_left, window_size_right))
    out, lse = K.math_forward(q, k, v, causal, softmax_scale)
    return out, lse, torch.empty(0, dtype=q.dtype), torch.zeros(2, dtype=torch.int64)


@torch.library.custom_op("nemo_longctx_fake_fa27::_flash_attn_backward", mutates_args=("dq", "dk", "dv"))
def _fa27_backward(dout: torch.Tensor, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, out: torch.Tensor,
                   softmax_lse: torch.Tensor, dq: Optional[torch.Tensor], dk: Optional[torch.Tensor],
                   dv: Optional[torch.Tensor], dropout_p: float, softmax_scale: float, causal: bool,
                   window_size_left: int, window_size_right: int, softcap: float,
                   alibi_slopes: Optional[torch.Tensor], deterministic: bool,
                   rng_state: Optional[torch.Tensor] = None) -> torch.Tensor:
    _CALLS_27.append(("bwd", window_size_left, window_size_right))
    a, b, c = K.math_backward(dout, q, k, v, out, softmax_lse, causal, softmax_scale)
    dq.copy_(a)
    dk.copy_(b)
    dv.copy_(c)
    return torch.zeros_like(softmax_lse)


def _fake_interface_27() -> types.ModuleType:
    iface = types.ModuleType("flash_attn.flash_attn_interface")
    iface._flash_attn_forward = _fa27_forward
    iface._flash_attn_backward = _fa27_backward
    return iface


@pytest.fixture
def fake_flash(monkeypatch):
    """Install a fake flash_attn package: ``install(interface, version)``; the probe cache is reset around."""

    def install(iface, version):
        pkg = types.ModuleType("flash_attn")
        pkg.__version__ = version
        pkg.__path__ = []
        pkg.flash_attn_interface = iface
        monkeypatch.setitem(sys.modules, "flash_attn", pkg)
        monkeypatch.setitem(sys.modules, "flash_attn.flash_attn_interface", iface)
        K._flash_attn_probe.cache_clear()

    yield install
    K._flash_attn_probe.cache_clear()


def _check_flash_kernel_against_fp64():
    kern = K.KERNELS["flash_attn"]
    for hq, hkv, causal in ((4, 4, True), (8, 2, True), (4, 1, False)):
        errs = K.check_kernel_case(kern, "cpu", torch.float32, s=48, hq=hq, hkv=hkv, d=32, causal=causal)
        assert max(errs.values()) < 1e-5, (hq, hkv, causal, errs)
    errs = K.check_kernel_case(kern, "cpu", torch.float32, s=48, hq=8, hkv=2, d=32, causal=False, split_kv=True)
    assert max(errs.values()) < 1e-5, errs


def test_flash_attn_26_api_detected_and_adapted(fake_flash):
    calls: list = []
    fake_flash(_fake_interface_26(calls), "2.6.3")
    assert K.flash_attn_status() == ("ok", "flash-attn 2.6.3 (2.6 API)")
    assert K._flash_attn_available()
    _check_flash_kernel_against_fp64()
    assert ("fwd", (-1, -1), 0.0, 0.0, False) in calls and ("bwd", (-1, -1), False) in calls


def test_flash_attn_27_api_detected_and_adapted(fake_flash):
    _CALLS_27.clear()
    fake_flash(_fake_interface_27(), "2.7.4.post1")
    assert type(_fa27_forward).__name__ == "CustomOpDef"  # like the real 2.7 interface: signature hidden
    assert K.flash_attn_status() == ("ok", "flash-attn 2.7.4.post1 (2.7 API)")
    _check_flash_kernel_against_fp64()
    assert ("fwd", -1, -1) in _CALLS_27 and ("bwd", -1, -1) in _CALLS_27


def test_flash_attn_wrong_return_arity_is_an_error(fake_flash):
    iface = _fake_interface_26([])
    real = iface._flash_attn_forward

    def four_outputs(q, k, v, dropout_p, softmax_scale, causal, window_size, softcap, alibi_slopes, return_softmax):
        return real(q, k, v, dropout_p, softmax_scale, causal, window_size, softcap, alibi_slopes,
                    return_softmax)[:4]

    iface._flash_attn_forward = four_outputs
    fake_flash(iface, "2.6.9")
    q = torch.randn(1, 8, 2, 16)
    with pytest.raises(K.FlashAttnBrokenError, match="returned 4 values, expected 8"):
        K.KERNELS["flash_attn"].forward(q, q, q, True, 0.25)


def test_unknown_flash_attn_api_is_reported_as_broken(fake_flash):
    iface = types.ModuleType("flash_attn.flash_attn_interface")
    iface._flash_attn_forward = lambda q, k, v, softmax_scale, causal, window: None  # some future API
    iface._flash_attn_backward = lambda *a: None
    fake_flash(iface, "3.0.0")
    state, detail = K.flash_attn_status()
    assert state == "broken" and "unknown flash-attn API" in detail
    with pytest.raises(K.FlashAttnBrokenError, match="unknown flash-attn API"):
        K._auto_kernel_name(torch.device("cuda"), torch.bfloat16)


class _BrokenFinder:
    """Meta-path finder whose flash_attn "loads" and then fails like a mismatched CUDA build."""

    def find_spec(self, name, path=None, target=None):
        if name != "flash_attn":
            return None
        import importlib.machinery

        return importlib.machinery.ModuleSpec(name, self, is_package=True)

    def create_module(self, spec):
        return None

    def exec_module(self, module):
        raise ImportError("/site-packages/flash_attn_2_cuda.so: undefined symbol: _ZN3c105ErrorC2E")


def test_broken_flash_attn_is_an_error_not_a_silent_fallback(monkeypatch):
    for mod in ("flash_attn", "flash_attn.flash_attn_interface"):
        monkeypatch.delitem(sys.modules, mod, raising=False)
    monkeypatch.setattr(sys, "meta_path", [_BrokenFinder()] + sys.meta_path)
    K._flash_attn_probe.cache_clear()
    try:
        state, detail = K.flash_attn_status()
        assert state == "broken" and "undefined symbol" in detail
        with pytest.raises(K.FlashAttnBrokenError, match="undefined symbol.*NEMO_LONGCTX_ATTN_KERNEL=sdpa_flash"):
            K._auto_kernel_name(torch.device("cuda"), torch.bfloat16)
        # CPU selection never touches flash-attn; an explicit other kernel is honoured
        assert K.select_kernel(torch.device("cpu"), torch.float32).name == "cpu_flash"
    finally:
        K._flash_attn_probe.cache_clear()


def test_absent_flash_attn_selects_gqa_native_torch_flash(monkeypatch):
    monkeypatch.setitem(sys.modules, "flash_attn", None)  # import raises ModuleNotFoundError(name="flash_attn")
    monkeypatch.setattr(K, "_dist_installed", lambda dist: False)
    K._flash_attn_probe.cache_clear()
    try:
        assert K.flash_attn_status()[0] == "absent"
        assert K._auto_kernel_name(torch.device("cuda"), torch.bfloat16) == "sdpa_flash"
        assert K._auto_kernel_name(torch.device("cuda"), torch.float16) == "sdpa_flash"
        assert K._auto_kernel_name(torch.device("cuda"), torch.float32) == "sdpa_cuda"
        assert K.KERNELS["sdpa_flash"].gqa_native and not K.KERNELS["sdpa_cuda"].gqa_native
        # a package whose metadata is installed but whose module is missing is broken, not absent
        monkeypatch.setattr(K, "_dist_installed", lambda dist: True)
        K._flash_attn_probe.cache_clear()
        assert K.flash_attn_status()[0] == "broken"
    finally:
        K._flash_attn_probe.cache_clear()


def test_kv_head_repeat_is_never_silent(caplog):
    K._warned_gqa_expand.discard("sdpa_cuda")
    with caplog.at_level(logging.WARNING, logger="nemo_longctx.attention.kernels"), \
            warnings.catch_warnings(record=True) as got:
        warnings.simplefilter("always")
        K._warn_gqa_expand("sdpa_cuda", 4)
        K._warn_gqa_expand("sdpa_cuda", 4)
    assert sum("not GQA-native" in r.message for r in caplog.records) == 1
    assert any("repeated 4x" in str(w.message) for w in got)


def test_registered_default_wins_for_auto(monkeypatch):
    monkeypatch.delenv(K.KERNEL_ENV_VAR, raising=False)
    try:
        K.register_default_kernel("cpu", torch.float32, "math")
        assert K.select_kernel(torch.device("cpu"), torch.float32).name == "math"
        assert K.select_kernel(torch.device("cpu"), torch.bfloat16).name == "cpu_flash"
        with pytest.raises(ValueError, match="unknown attention kernel"):
            K.register_default_kernel("cpu", torch.float32, "nope")
    finally:
        K.register_default_kernel("cpu", torch.float32, None)
    assert K.select_kernel(torch.device("cpu"), torch.float32).name == "cpu_flash"


def test_start_up_self_test_passes_good_kernels_and_names_a_wrong_one():
    for dtype in (torch.float32, torch.bfloat16):
        worst = K.self_test_kernel("auto", "cpu", dtype)
        assert set(worst) == {"out", "lse", "dq", "dk", "dv"} and max(worst.values()) < K.TOLERANCE[dtype]
    with pytest.raises(K.KernelSelfTestError, match=r"'injected_wrong' disagrees .* cpu/torch.float32 .*causal=True"):
        K.self_test_kernel(WRONG_KERNEL, "cpu", torch.float32)

    def crashing(*a):
        raise RuntimeError("no kernel image is available for execution on the device")

    bad = K.AttentionKernel("crashing", crashing, crashing)
    with pytest.raises(K.KernelSelfTestError, match="'crashing' failed on cpu.*no kernel image"):
        K.self_test_kernel(bad, "cpu", torch.bfloat16)


def test_math_and_cpu_flash_kernels_value_dim_differs_against_fp64():
    errs = K.check_kernel_case(K.KERNELS["math"], "cpu", torch.float64, s=40, hq=6, hkv=2, d=32, dv=16)
    assert max(errs.values()) < 1e-12
    # cpu_flash takes d_v != d_qk too (MLA): checked against the same fp64 reference
    assert K.KERNELS["cpu_flash"].supports("cpu", torch.float32, 32, 16)
    errs = K.check_kernel_case(K.KERNELS["cpu_flash"], "cpu", torch.float32, s=40, hq=6, hkv=2, d=32, dv=16)
    assert max(errs.values()) < K.TOLERANCE[torch.float32]


# --------------------------------------------------------------------------------------------- CUDA only


CUDA_KERNELS = ["sdpa_flash", "sdpa_cuda"] + (["flash_attn"] if K.flash_attn_status()[0] == "ok" else [])


@needs_cuda
@pytest.mark.parametrize("name", CUDA_KERNELS)
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_cuda_kernel_against_fp64(name, dtype):
    kern = K.KERNELS[name]
    for hq, hkv in ((8, 8), (8, 2), (8, 1)):
        for causal in (True, False):
            for d in (64, 128):
                errs = K.check_kernel_case(kern, "cuda", dtype, s=256, hq=hq, hkv=hkv, d=d, causal=causal)
                assert max(errs.values()) <= K.TOLERANCE[dtype], (name, hq, hkv, causal, d, errs)
    errs = K.check_kernel_case(kern, "cuda", dtype, s=256, hq=8, hkv=2, d=64, causal=False, split_kv=True)
    assert max(errs.values()) <= K.TOLERANCE[dtype], errs


@needs_cuda
def test_cuda_auto_kernel_self_test_and_fastest_exact_default():
    for dtype in (torch.bfloat16, torch.float16):
        K.self_test_kernel("auto", "cuda", dtype)
    try:
        best, report = K.pick_fastest_exact_kernel("cuda", torch.bfloat16,
                                                   timing_shape=dict(s=1024, hq=8, hkv=2, d=64, repeats=2))
        assert best is not None and K.KERNELS[best].gqa_native, report
        assert K.select_kernel(torch.device("cuda"), torch.bfloat16).name == best
    finally:
        K.register_default_kernel("cuda", torch.bfloat16, None)


@needs_cuda
def test_cuda_gqa_native_kernels_do_not_repeat_kv_heads():
    from nemo_longctx.selftest import Report, gqa_memory_check

    rep = Report(stream=open("/dev/null", "w"))
    gqa_memory_check(rep, torch.device("cuda"), torch.bfloat16,
                     [n for n in CUDA_KERNELS if K.KERNELS[n].gqa_native])
    assert rep.rows and all(r.status == "PASS" for r in rep.rows), [r.detail for r in rep.rows]


def test_flash_extra_is_pinned_to_the_supported_api_range():
    import re
    from pathlib import Path

    text = (Path(__file__).resolve().parents[1] / "pyproject.toml").read_text()
    pins = re.findall(r'^flash = \["flash-attn([^"]*)"\]', text, re.M)
    assert pins == [K.FLASH_ATTN_TESTED], pins
