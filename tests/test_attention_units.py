"""Single-process checks of the attention building blocks: kernels, LSE merge, zigzag layouts, selection."""

from __future__ import annotations

import itertools
import logging

import pytest
import torch

from reference import reference_attention, reference_forward_backward, rel_err

from nemo_longctx.attention import (
    KERNELS,
    merge_attention,
    merge_attention_,
    select_kernel,
    zigzag_indices,
    zigzag_position_ids,
    zigzag_shard,
    zigzag_unshard,
)
from nemo_longctx.attention import kernels
from nemo_longctx.attention.kernels import KERNEL_ENV_VAR, TOLERANCE, flash_attn_status


def _device_kernels():
    """(device, kernel name, dtype, tolerance) for every kernel that can run on this machine's devices: the CPU
    kernels in fp32 everywhere; with CUDA, also each CUDA kernel in a dtype it supports."""
    cases = [("cpu", n, torch.float32, 1e-5) for n, k in KERNELS.items() if k.device_type in (None, "cpu")]
    if torch.cuda.is_available():
        for n, k in KERNELS.items():
            if k.device_type not in (None, "cuda") or (n == "flash_attn" and flash_attn_status()[0] != "ok"):
                continue
            dtype = torch.float32 if k.dtypes is None or torch.float32 in k.dtypes else torch.bfloat16
            # rel_err here is max-abs relative: allow 4x the Frobenius tolerance of the self-test
            cases.append(("cuda", n, dtype, 1e-5 if n == "math" else 4 * TOLERANCE[dtype]))
    return cases


DEVICE_KERNELS = _device_kernels()
_IDS = [f"{dev}-{name}-{str(dt).replace('torch.', '')}" for dev, name, dt, _ in DEVICE_KERNELS]


def _qkv(b, s, hq, hkv, d, dtype=torch.float32, seed=0, device="cpu"):
    g = torch.Generator().manual_seed(seed)
    return tuple(torch.randn(b, s, h, d, generator=g).to(device=device, dtype=dtype) for h in (hq, hkv, hkv, hq))


@pytest.mark.parametrize("device,name,dtype,tol", DEVICE_KERNELS, ids=_IDS)
def test_kernel_forward_backward_against_fp64(device, name, dtype, tol):
    kern = KERNELS[name]
    for (b, s, hq, hkv, d), causal in itertools.product(
        [(1, 16, 4, 4, 32), (2, 30, 8, 2, 64), (2, 12, 4, 1, 32)], (True, False)
    ):
        q, k, v, dout = _qkv(b, s, hq, hkv, d, dtype=dtype, device=device)
        ref_out, ref_dq, ref_dk, ref_dv = reference_forward_backward(q.cpu(), k.cpu(), v.cpu(), dout.cpu(), causal,
                                                                     scale=0.2)
        out, lse = kern.forward(q, k, v, causal, 0.2)
        assert out.shape == q.shape and lse.shape == (b, hq, s) and lse.dtype == torch.float32
        assert out.device == q.device and lse.device == q.device
        dq, dk, dv = kern.backward(dout, q, k, v, out, lse, causal, 0.2)
        for got, want in zip((out, dq, dk, dv), (ref_out, ref_dq, ref_dk, ref_dv)):
            assert got.shape == want.shape
            assert rel_err(got.cpu(), want) < tol, (name, b, s, hq, hkv, causal)


@pytest.mark.parametrize("device,name,dtype,tol", DEVICE_KERNELS, ids=_IDS)
def test_kernel_blocks_merge_to_full_attention(device, name, dtype, tol):
    """Split keys in two blocks: LSE-merged forward and per-block backward with the final (out, lse)
    reproduce full attention -- the contract ring attention is built on."""
    kern = KERNELS[name]
    b, s, hq, hkv, d = 2, 32, 8, 2, 32
    q, k, v, dout = _qkv(b, s, hq, hkv, d, seed=3, dtype=dtype, device=device)
    h = s // 2
    ref_out, ref_dq, ref_dk, ref_dv = reference_forward_backward(q.cpu(), k.cpu(), v.cpu(), dout.cpu(), causal=False)
    o1, l1 = kern.forward(q, k[:, :h], v[:, :h], False, d**-0.5)
    o2, l2 = kern.forward(q, k[:, h:], v[:, h:], False, d**-0.5)
    out, lse = merge_attention(o1, l1, o2, l2)
    assert rel_err(out.cpu(), ref_out) < tol
    out = out.to(dtype)
    g1 = kern.backward(dout, q, k[:, :h], v[:, :h], out, lse, False, d**-0.5)
    g2 = kern.backward(dout, q, k[:, h:], v[:, h:], out, lse, False, d**-0.5)
    assert rel_err((g1[0].double() + g2[0].double()).cpu(), ref_dq) < tol
    assert rel_err(torch.cat([g1[1], g2[1]], 1).cpu(), ref_dk) < tol
    assert rel_err(torch.cat([g1[2], g2[2]], 1).cpu(), ref_dv) < tol


def test_merge_handles_empty_rows_and_low_precision_partials():
    b, s, h, d = 1, 6, 2, 8
    g = torch.Generator().manual_seed(1)
    oa, ob = torch.randn(b, s, h, d, generator=g), torch.randn(b, s, h, d, generator=g)
    la, lb = torch.randn(b, h, s, generator=g), torch.randn(b, h, s, generator=g)
    la[:, :, 0] = float("-inf")
    oa[:, 0] = 0
    out, lse = merge_attention(oa, la, ob.bfloat16(), lb)
    assert out.dtype == torch.float32 and torch.isfinite(out).all()
    # row 0 saw no key in partial a: the merge is exactly partial b
    assert torch.equal(out[:, 0], ob.bfloat16().float()[:, 0]) and torch.equal(lse[:, :, 0], lb[:, :, 0])
    wa = torch.exp(la - lse).transpose(1, 2).unsqueeze(-1)
    wb = torch.exp(lb - lse).transpose(1, 2).unsqueeze(-1)
    assert torch.allclose(out, oa * wa + ob.bfloat16().float() * wb, atol=1e-6)
    both_empty, lse_e = merge_attention(torch.zeros(1, 1, 1, 2), torch.full((1, 1, 1), float("-inf")),
                                        torch.zeros(1, 1, 1, 2), torch.full((1, 1, 1), float("-inf")))
    assert torch.equal(both_empty, torch.zeros(1, 1, 1, 2)) and torch.isneginf(lse_e).all()
    # in-place variant agrees with the functional one on finite rows
    acc_o, acc_l = ob.bfloat16().float()[:, 1:].clone(), lb[:, :, 1:].clone()
    merge_attention_(acc_o, acc_l, oa[:, 1:], la[:, :, 1:])
    assert torch.allclose(acc_o, out[:, 1:], atol=1e-6) and torch.allclose(acc_l, lse[:, :, 1:], atol=1e-6)


@pytest.mark.parametrize("merge", ["merge_attention_", "merge_rows_"])
def test_inplace_merge_allocates_nothing_output_sized(merge):
    """The ring's per-step merge (and the packed/windowed/chunked paths' ``merge_rows_``) updates its float32
    accumulators in place: no output-sized temporary (the old forms made two or three: the upcast partial, the
    difference and the weighted product). Only per-row [b, h, s] weights are allocated."""
    from nemo_longctx.attention.thd import merge_rows_

    fn = {"merge_attention_": merge_attention_, "merge_rows_": merge_rows_}[merge]
    from torch.utils._python_dispatch import TorchDispatchMode

    class Allocations(TorchDispatchMode):
        def __init__(self):
            super().__init__()
            self.sizes = []

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            out = func(*args, **(kwargs or {}))
            aliases = func._schema.returns and func._schema.returns[0].alias_info is not None  # views, in-place, out=
            if isinstance(out, torch.Tensor) and not aliases:
                self.sizes.append(out.numel())
            return out

    b, s, h, d = 1, 16, 4, 32
    g = torch.Generator().manual_seed(3)
    acc_o, ob = torch.randn(b, s, h, d, generator=g), torch.randn(b, s, h, d, generator=g)
    acc_l, lb = torch.randn(b, h, s, generator=g), torch.randn(b, h, s, generator=g)
    want_o, want_l = merge_attention(acc_o, acc_l, ob, lb)
    mode = Allocations()
    with mode:
        fn(acc_o[:, 8:], acc_l[:, :, 8:], ob[:, 8:], lb[:, :, 8:])
    assert mode.sizes and max(mode.sizes) <= b * h * s, mode.sizes
    assert torch.allclose(acc_o[:, 8:], want_o[:, 8:], atol=1e-6) and torch.allclose(acc_l[:, :, 8:], want_l[:, :, 8:])


def test_merge_is_exact_for_fp64_attention_blocks():
    q, k, v, _ = _qkv(1, 10, 2, 2, 4, dtype=torch.float64)
    full = reference_attention(q, k, v, causal=False)
    parts = [KERNELS["math"].forward(q, k[:, i:i + 5], v[:, i:i + 5], False, 0.5) for i in (0, 5)]
    out, _ = merge_attention(*parts[0], *parts[1])
    assert out.dtype == torch.float64
    assert rel_err(out, full) < 1e-12


@pytest.mark.parametrize("cp", [1, 2, 3, 4])
def test_zigzag_layout_roundtrip_and_indices(cp):
    S = 2 * cp * 5
    x = torch.arange(2 * S * 3).view(2, S, 3)
    shards = [zigzag_shard(x, 1, cp, r) for r in range(cp)]
    assert torch.equal(zigzag_unshard(shards, 1), x)
    c = S // (2 * cp)
    for r, sh in enumerate(shards):
        idx = zigzag_indices(S, cp, r)
        assert torch.equal(sh, x[:, idx])
        assert torch.equal(zigzag_position_ids(S, cp, r), idx)
        expected = list(range(r * c, (r + 1) * c)) + list(range((2 * cp - 1 - r) * c, (2 * cp - r) * c))
        assert idx.tolist() == expected
    # each rank's causal work is balanced: the sum of its positions is the same on every rank
    assert len({int(zigzag_indices(S, cp, r).sum()) for r in range(cp)}) == 1


def test_zigzag_bad_arguments():
    with pytest.raises(ValueError, match="divisible by 2\\*cp_size"):
        zigzag_shard(torch.zeros(1, 10), 1, 2, 0)
    with pytest.raises(ValueError, match="cp_rank"):
        zigzag_indices(8, 2, 2)
    with pytest.raises(ValueError, match="same length"):
        zigzag_unshard([torch.zeros(4), torch.zeros(6)], 0)


def test_select_kernel_auto_override_and_errors(monkeypatch, caplog):
    monkeypatch.delenv(KERNEL_ENV_VAR, raising=False)
    assert select_kernel(torch.device("cpu"), torch.float32).name == "cpu_flash"
    assert select_kernel(torch.device("cpu"), torch.float64).name == "math"
    assert select_kernel(torch.device("cpu"), torch.float32, "math").name == "math"
    monkeypatch.setenv(KERNEL_ENV_VAR, "math")
    assert select_kernel(torch.device("cpu"), torch.bfloat16).name == "math"
    with pytest.raises(ValueError, match="unknown attention kernel"):
        select_kernel(torch.device("cpu"), torch.float32, "nope")
    with pytest.raises(ValueError, match="needs CUDA"):
        select_kernel(torch.device("cpu"), torch.float32, "sdpa_cuda")
    # The choice is logged once per (device, dtype, kernel) and process: start from an empty record of logged
    # choices and count only this block's records (an earlier test in the same worker may have set the logger to
    # INFO, so the calls above can log too).
    monkeypatch.setattr(kernels, "_logged_choices", set())
    caplog.clear()
    with caplog.at_level(logging.INFO, logger="nemo_longctx.attention.kernels"):
        select_kernel(torch.device("cpu"), torch.float16, "math")
        select_kernel(torch.device("cpu"), torch.float16, "math")
    assert sum("attention kernel: math" in r.message for r in caplog.records) == 1
