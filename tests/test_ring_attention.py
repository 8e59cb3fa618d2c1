"""Ring attention vs an fp64 full-sequence reference on 2 and 4 gloo ranks (forward and backward)."""

from __future__ import annotations

import itertools

import pytest
import torch

from distributed import run_distributed
from reference import reference_forward_backward, rel_err

TOL = {torch.float32: 1e-5, torch.bfloat16: 2e-2}
HEADS = {"mha": (4, 4), "gqa": (8, 2), "mqa": (4, 1)}


def _cases(world_size):
    if world_size == 8:
        # backward error must not grow with ring size in bf16 (dK/dV accumulate in fp32 across the P-1 hops)
        return [dict(name=f"gqa-causal-bf16-ring8-{heads}", heads=heads, causal=True, dtype=torch.bfloat16,
                     b=1, s=2 * 8 * 64, d=64) for heads in ("gqa", "mqa")]
    cases = []
    sizes = [(1, 2 * world_size * 7, 32), (2, 2 * world_size * 8, 64), (2, 2 * world_size * 5, 32),
             (1, 2 * world_size * 16, 64)]
    for i, (heads, causal, dtype) in enumerate(
        itertools.product(HEADS, (True, False), (torch.float32, torch.bfloat16))
    ):
        b, s, d = sizes[i % len(sizes)]
        cases.append(dict(name=f"{heads}-{'causal' if causal else 'full'}-{dtype}-b{b}-s{s}-d{d}",
                          heads=heads, causal=causal, dtype=dtype, b=b, s=s, d=d))
    return cases


def _ring_worker(rank, world_size):
    import torch.distributed as dist

    from nemo_longctx.attention import count_bytes_sent, ring_attention, zigzag_shard

    group = dist.group.WORLD
    results = []
    for case in _cases(world_size):
        hq, hkv = HEADS[case["heads"]]
        b, s, d, dtype, causal = case["b"], case["s"], case["d"], case["dtype"], case["causal"]
        gen = torch.Generator().manual_seed(1234)
        q = torch.randn(b, s, hq, d, generator=gen)
        k = torch.randn(b, s, hkv, d, generator=gen)
        v = torch.randn(b, s, hkv, d, generator=gen)
        dout = torch.randn(b, s, hq, d, generator=gen)
        # the reference sees exactly the (rounded) inputs the ring sees
        q, k, v, dout = (t.to(dtype) for t in (q, k, v, dout))
        ref = reference_forward_backward(q, k, v, dout, causal)

        def shard(t):
            return zigzag_shard(t, 1, world_size, rank)

        ql, kl, vl = (shard(t).detach().clone().requires_grad_() for t in (q, k, v))
        if b > 1:
            # Megatron hands over [s, b, h, d] tensors: our [b, s, h, d] view of them is not contiguous
            ql, kl, vl = (t.detach().transpose(0, 1).contiguous().transpose(0, 1).requires_grad_()
                          for t in (ql, kl, vl))
            assert not kl.is_contiguous()
        with count_bytes_sent() as fwd_bytes:
            out = ring_attention(ql, kl, vl, group, causal=causal, global_seq_len=s)
        with count_bytes_sent() as bwd_bytes:
            out.backward(shard(dout))
        errs = {name: rel_err(got, shard(want)) for name, got, want in
                zip(("out", "dq", "dk", "dv"), (out, ql.grad, kl.grad, vl.grad), ref)}
        kv_elems = 2 * b * (s // world_size) * hkv * d
        expected_bytes = (world_size - 1) * kv_elems * torch.empty(0, dtype=dtype).element_size()
        # backward: K/V again plus one float32 dK/dV accumulator hop per step, P-1 each
        expected_bwd = expected_bytes + (world_size - 1) * kv_elems * 4
        results.append(dict(case=case["name"], dtype=dtype, errs=errs, out_dtype=out.dtype,
                            fwd_bytes=fwd_bytes.bytes_sent, expected_bytes=expected_bytes,
                            bwd_bytes=bwd_bytes.bytes_sent, expected_bwd=expected_bwd,
                            grad_dtypes=(ql.grad.dtype, kl.grad.dtype, vl.grad.dtype)))
    return results


def _bad_input_worker(rank, world_size):
    import torch.distributed as dist

    from nemo_longctx.attention import count_bytes_sent, ring_attention

    group = dist.group.WORLD
    q = torch.randn(1, 8, 4, 16)
    kv = torch.randn(1, 8, 2, 16)
    bad = {
        "odd": (torch.randn(1, 7, 4, 16), torch.randn(1, 7, 2, 16), torch.randn(1, 7, 2, 16), {}),
        "heads": (torch.randn(1, 8, 3, 16), kv, kv, {}),
        "shape": (q, torch.randn(1, 6, 2, 16), torch.randn(1, 6, 2, 16), {}),
        # v's head dim may differ from k's (MLA), its heads may not
        "kv_mismatch": (q, kv, torch.randn(1, 8, 1, 16), {}),
        "dtype": (q, kv.double(), kv.double(), {}),
        "layout": (q, kv, kv, {"global_seq_len": 8 * (world_size + 1)}),
        "rank3": (q[0], kv[0], kv[0], {}),
    }
    messages = {}
    with count_bytes_sent() as sent:
        for name, (a, b_, c, kw) in bad.items():
            try:
                ring_attention(a, b_, c, group, **kw)
            except ValueError as e:
                messages[name] = str(e)
            else:
                messages[name] = None
    # the group is still usable afterwards (nothing half-sent)
    out = ring_attention(q, kv, kv, group)
    dist.barrier()
    return messages, sent.bytes_sent, tuple(out.shape)


@pytest.mark.parametrize("world_size", [2, 4, 8])
def test_ring_matches_fp64_reference(world_size):
    per_rank = run_distributed(_ring_worker, world_size)
    checked = 0
    for rank_results in per_rank:
        for r in rank_results:
            tol = TOL[r["dtype"]]
            for name, err in r["errs"].items():
                assert err <= tol, f"{r['case']}: {name} rel err {err:.2e} > {tol}"
            assert r["out_dtype"] == r["dtype"] and r["grad_dtypes"] == (r["dtype"],) * 3
            # GQA-native communication: only the hkv real heads travel, once per step
            assert r["fwd_bytes"] == r["expected_bytes"], r
            assert r["bwd_bytes"] == r["expected_bwd"], r
            checked += 1
    assert checked == world_size * len(_cases(world_size))


def test_single_rank_and_no_group_is_plain_attention():
    from nemo_longctx.attention import local_attention, ring_attention

    gen = torch.Generator().manual_seed(0)
    for causal, (hq, hkv) in itertools.product((True, False), HEADS.values()):
        q = torch.randn(2, 24, hq, 32, generator=gen)
        k = torch.randn(2, 24, hkv, 32, generator=gen)
        v = torch.randn(2, 24, hkv, 32, generator=gen)
        dout = torch.randn(2, 24, hq, 32, generator=gen)
        ref = reference_forward_backward(q, k, v, dout, causal, scale=0.3)
        for fn in (lambda *a, **kw: ring_attention(*a, None, **kw), local_attention):
            ql, kl, vl = (t.clone().requires_grad_() for t in (q, k, v))
            out = fn(ql, kl, vl, causal=causal, softmax_scale=0.3)
            out.backward(dout)
            for got, want in zip((out, ql.grad, kl.grad, vl.grad), ref):
                assert rel_err(got, want) <= 1e-5


def test_bad_inputs_raise_before_communicating():
    (msgs0, sent0, shape0), _ = run_distributed(_bad_input_worker, 2)
    assert all(m is not None for m in msgs0.values()), msgs0
    assert "even" in msgs0["odd"] and "2*cp" in msgs0["odd"]
    assert "multiple of key/value heads" in msgs0["heads"]
    assert "must agree" in msgs0["shape"]
    assert "k and v must agree" in msgs0["kv_mismatch"]
    assert "dtype" in msgs0["dtype"]
    assert "does not match the layout" in msgs0["layout"]
    assert "4-D" in msgs0["rank3"]
    assert sent0 == 0
    assert shape0 == (1, 8, 4, 16)


def test_single_rank_ring_is_the_kernel_itself_without_fp32_accumulators():
    """At CP size 1 the ring's forward and backward return the kernel's own results bit for bit, and create no fp32
    copy of the output or of dq for 16-bit inputs (the accumulators a multi-rank ring needs: 4 bytes per element
    of q each; the H200 peak breakdown found the dq one live at the peak of a recomputed layer's backward)."""
    from torch.utils._python_dispatch import TorchDispatchMode

    from nemo_longctx.attention.kernels import KERNELS
    from nemo_longctx.attention.ring import ring_attention_backward, ring_attention_forward

    class Created(TorchDispatchMode):
        def __init__(self):
            super().__init__()
            self.made = []

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            out = func(*args, **(kwargs or {}))
            for t in out if isinstance(out, (tuple, list)) else (out,):
                if isinstance(t, torch.Tensor):
                    self.made.append((func.__name__, tuple(t.shape), t.dtype))
            return out

    kern = KERNELS["cpu_flash"]
    gen = torch.Generator().manual_seed(3)
    for causal, dtype in itertools.product((True, False), (torch.bfloat16, torch.float32)):
        q = torch.randn(1, 40, 8, 16, generator=gen).to(dtype)
        k, v = (torch.randn(1, 40, 2, 16, generator=gen).to(dtype) for _ in range(2))
        dout = torch.randn(1, 40, 8, 16, generator=gen).to(dtype)
        out, lse = ring_attention_forward(q, k, v, None, causal, 0.25, kern)
        want_out, want_lse = kern.forward(q, k, v, causal, 0.25)
        assert torch.equal(out, want_out.to(dtype)) and torch.equal(lse, want_lse.float())
        with Created() as made:
            grads = ring_attention_backward(dout, q, k, v, out, lse, None, causal, 0.25, kern)
        for got, want in zip(grads, kern.backward(dout, q, k, v, out, lse, causal, 0.25)):
            assert got.dtype == dtype and torch.equal(got, want.to(dtype))
        if dtype == torch.bfloat16:
            assert not [m for m in made.made if m[1] == tuple(q.shape) and m[2] == torch.float32], made.made
