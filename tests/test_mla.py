"""MLA head dims (d_v != d_qk) in the kernels, ring, Ulysses and hybrid attention, vs an fp64 full-sequence
reference on 2 and 4 gloo ranks (forward and backward); K and V travel at their own sizes (bytes counted)."""

from __future__ import annotations

import zlib

import pytest
import torch

from distributed import run_distributed
from reference import reference_forward_backward, rel_err

TOL = {torch.float32: 1e-5, torch.bfloat16: 2e-2, torch.float64: 1e-10}


# ---------------------------------------------------------------------------------------------- kernels


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
@pytest.mark.parametrize("d,dv", [(48, 32), (16, 40), (192, 128)])
def test_cpu_flash_value_dim_differs(d, dv, dtype):
    from nemo_longctx.attention.kernels import KERNELS, check_kernel_case

    kern = KERNELS["cpu_flash"]
    assert kern.value_dim_differs and kern.supports("cpu", dtype, d, dv)
    tol = 2e-5 if dtype == torch.float32 else 1e-10
    for causal, split in ((True, False), (False, False), (False, True)):
        errs = check_kernel_case(kern, "cpu", dtype, s=40 if d < 100 else 24, hq=4, hkv=2, d=d, dv=dv,
                                 causal=causal, split_kv=split, seed=d + dv)
        assert max(errs.values()) <= tol, (causal, split, errs)


def test_cpu_flash_mla_output_layout():
    from nemo_longctx.attention.kernels import KERNELS

    q, k = torch.randn(1, 8, 2, 24), torch.randn(1, 8, 2, 24)
    v = torch.randn(1, 8, 2, 16)
    out, lse = KERNELS["cpu_flash"].forward(q, k, v, True, 0.2)
    assert out.shape == (1, 8, 2, 16) and out.is_contiguous() and lse.shape == (1, 2, 8)
    dq, dk, dv = KERNELS["cpu_flash"].backward(torch.randn_like(out), q, k, v, out, lse, True, 0.2)
    assert dq.shape == q.shape and dk.shape == k.shape and dv.shape == v.shape


def test_select_kernel_head_dims():
    from nemo_longctx.attention import kernels

    cpu = torch.device("cpu")
    assert kernels.select_kernel(cpu, torch.float32, head_dim=192, value_dim=128).name == "cpu_flash"
    assert kernels.select_kernel(cpu, torch.float64, head_dim=192, value_dim=128).name == "math"
    # "auto" on CUDA falls back to a kernel that takes dv != d (flash-attn/sdpa_flash do not); logic only
    cuda = torch.device("cuda")
    if not kernels._flash_attn_available():
        assert kernels._auto_kernel_for_dims(cuda, torch.bfloat16, 64, 64) == "sdpa_flash"
    assert kernels._auto_kernel_for_dims(cuda, torch.bfloat16, 128, 64) == "sdpa_cudnn"
    assert kernels._auto_kernel_for_dims(cuda, torch.bfloat16, 192, 128) == "sdpa_cuda"  # cuDNN: d <= 128
    assert not kernels.KERNELS["flash_attn"].supports("cuda", torch.bfloat16, 192, 128)


# ---------------------------------------------------------------------------------------------- ring / Ulysses / hybrid

HEADS = {2: {"mha": (4, 4), "gqa": (4, 2), "gqa_rep": (6, 3), "mqa": (4, 1)},
         4: {"mha": (8, 8), "gqa": (8, 4), "gqa_rep": (8, 2), "mqa": (4, 1)}}


def _cases(world_size):
    h = HEADS[world_size]
    f32, f64, bf16 = torch.float32, torch.float64, torch.bfloat16
    spec = [
        # algo, ulysses size, heads, causal, dtype, d, dv, head_chunks, regather, batch
        ("ring", 1, "mha", True, f32, 24, 16, 1, False, 1),
        ("ring", 1, "gqa", False, f32, 16, 24, 1, False, 2),
        ("ring", 1, "mqa", True, f64, 24, 8, 1, False, 1),
        ("ring", 1, "gqa", True, bf16, 32, 16, 1, False, 1),
        ("ulysses", world_size, "mha", True, f32, 24, 16, 1, False, 1),
        ("ulysses", world_size, "gqa", False, f32, 16, 24, 2, True, 2),
        ("ulysses", world_size, "gqa_rep", True, f32, 24, 16, 1, True, 1),
        ("ulysses", world_size, "mha", True, f64, 24, 8, 2, False, 1),
    ]
    if world_size == 4:
        spec += [("hybrid", 2, "mha", True, f32, 24, 16, 1, False, 1),
                 ("hybrid", 2, "gqa", False, f32, 16, 24, 2, True, 1),
                 ("hybrid", 2, "gqa", True, f64, 24, 16, 1, True, 2)]
    else:
        spec += [("hybrid", 1, "mha", True, f32, 24, 16, 2, False, 1)]
    cases = []
    for algo, u, heads, causal, dtype, d, dv, chunks, regather, b in spec:
        hq, hkv = h[heads]
        name = (f"{algo}-u{u}-{heads}-{'causal' if causal else 'full'}-{str(dtype)[6:]}-d{d}-dv{dv}-c{chunks}"
                f"{'-regather' if regather else ''}-b{b}")
        cases.append(dict(name=name, algo=algo, ulysses=u, hq=hq, hkv=hkv, causal=causal, dtype=dtype, d=d, dv=dv,
                          chunks=chunks, regather=regather, b=b, s=2 * world_size * 3))
    return cases


def _min_kv_replicas(hkv, size):
    return next(r for r in range(1, size + 1) if (hkv * r) % size == 0)


def _expected_bytes(case, world_size):
    """(forward, backward) bytes one rank sends, with K at d and V at dv columns (nothing padded)."""
    hq, hkv, d, dv, b = case["hq"], case["hkv"], case["d"], case["dv"], case["b"]
    esize = torch.empty(0, dtype=case["dtype"]).element_size()
    acc = 8 if case["dtype"] == torch.float64 else 4
    s_local = case["s"] // world_size
    if case["algo"] == "ring":
        kv = (world_size - 1) * b * s_local * hkv * (d + dv)
        return kv * esize, kv * esize + kv * acc
    u, c = case["ulysses"], case["chunks"]
    r = world_size // u
    rep = _min_kv_replicas(hkv, u)
    g = hq // (hkv * rep)
    nkc = max(1, hq // u // c // g)
    per_col = (u - 1) * b * s_local * esize  # bytes per column of one all-to-all, leaving this rank ...
    a2a = per_col * (hq * d + hkv * rep * (d + dv) + hq * dv) // u  # ... q, k, v out, out back
    ring = c * (r - 1) * b * (u * s_local) * nkc * (d + dv) * esize
    fwd = a2a + ring
    if r > 1:  # the ring's backward bytes are checked by the ring cases
        return fwd, None
    again = per_col * (hq * (d + dv) + hkv * rep * (d + dv)) // u if case["regather"] else 0
    return fwd, a2a + again


def _mla_worker(rank, world_size, cases):
    import torch.distributed as dist

    from nemo_longctx.attention import (
        count_bytes_sent, hybrid_attention, make_cp_groups, ring_attention, ulysses_attention, zigzag_shard)

    world = dist.group.WORLD
    results = []
    for case in cases:
        hq, hkv, b, s, d, dv = (case[x] for x in ("hq", "hkv", "b", "s", "d", "dv"))
        dtype, causal = case["dtype"], case["causal"]
        gen = torch.Generator().manual_seed(zlib.crc32(case["name"].encode()))
        q, k, v, dout = (torch.randn(b, s, h, e, generator=gen).to(dtype)
                         for h, e in ((hq, d), (hkv, d), (hkv, dv), (hq, dv)))
        scale = 0.7 / d ** 0.5  # MLA passes its own (mscale) softmax scale
        ref = reference_forward_backward(q, k, v, dout, causal, scale)

        def shard(t):
            return zigzag_shard(t, 1, world_size, rank)

        # Megatron's [s, b, h, d] memory order: [b, s, h, d] views, strided when b > 1
        leaves = [shard(t).transpose(0, 1).contiguous().requires_grad_() for t in (q, k, v)]
        ql, kl, vl = (t.transpose(0, 1) for t in leaves)
        kw = dict(causal=causal, softmax_scale=scale, global_seq_len=s)
        with count_bytes_sent() as fwd_bytes:
            if case["algo"] == "ring":
                out = ring_attention(ql, kl.contiguous(), vl.contiguous(), world, **kw)
            elif case["algo"] == "ulysses":
                out = ulysses_attention(ql, kl, vl, world, head_chunks=case["chunks"],
                                        regather_in_backward=case["regather"], **kw)
            else:
                ug, rg = make_cp_groups(world, case["ulysses"])
                out = hybrid_attention(ql, kl, vl, ug, rg, head_chunks=case["chunks"],
                                       regather_in_backward=case["regather"], **kw)
        with count_bytes_sent() as bwd_bytes:
            out.backward(shard(dout))
        grads = [t.grad.transpose(0, 1) for t in leaves]
        errs = {name: rel_err(got, shard(want)) for name, got, want in
                zip(("out", "dq", "dk", "dv"), [out] + grads, ref)}
        results.append(dict(case=case, errs=errs, out_shape=tuple(out.shape),
                            grad_shapes=[tuple(g.shape) for g in grads],
                            dtypes=(out.dtype,) + tuple(g.dtype for g in grads),
                            fwd_bytes=fwd_bytes.bytes_sent, bwd_bytes=bwd_bytes.bytes_sent))
    return results


@pytest.mark.parametrize("world_size", [2, 4])
def test_mla_dims_match_fp64_reference(world_size):
    cases = _cases(world_size)
    per_rank = run_distributed(_mla_worker, world_size, cases)
    checked = 0
    for rank_results in per_rank:
        for r in rank_results:
            case = r["case"]
            tol = TOL[case["dtype"]]
            for name, err in r["errs"].items():
                assert err <= tol, f"{case['name']}: {name} rel err {err:.2e} > {tol}"
            b, sl = case["b"], case["s"] // world_size
            assert r["out_shape"] == (b, sl, case["hq"], case["dv"]), case["name"]
            assert r["grad_shapes"] == [(b, sl, case["hq"], case["d"]), (b, sl, case["hkv"], case["d"]),
                                        (b, sl, case["hkv"], case["dv"])], case["name"]
            assert r["dtypes"] == (case["dtype"],) * 4, case["name"]
            fwd, bwd = _expected_bytes(case, world_size)
            assert r["fwd_bytes"] == fwd, (case["name"], r["fwd_bytes"], fwd)
            if bwd is not None:
                assert r["bwd_bytes"] == bwd, (case["name"], r["bwd_bytes"], bwd)
            checked += 1
    assert checked == world_size * len(cases)
    assert {c["algo"] for c in cases} == {"ring", "ulysses", "hybrid"}
