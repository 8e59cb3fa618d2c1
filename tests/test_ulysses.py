"""Ulysses all-to-all attention vs an fp64 full-sequence reference on 2 and 4 gloo ranks (forward and backward):
MHA, GQA with hkv >= P and hkv < P (KV replication), MQA; causal and not; head_chunks 1/2/4; bytes sent and
the all-to-all staging-buffer bytes; bad inputs. ``run_cases`` is shared with test_hybrid.py."""

from __future__ import annotations

import itertools
import zlib

import pytest
import torch

from distributed import run_distributed
from reference import reference_forward_backward, rel_err

TOL = {torch.float32: 1e-5, torch.bfloat16: 2e-2, torch.float64: 1e-10}

# (hq, hkv) per world size: MHA, GQA hkv >= P, GQA hkv not divisible by P (replication), MQA
HEADS = {
    2: {"mha": (8, 8), "gqa": (8, 2), "gqa_rep": (6, 3), "mqa": (8, 1)},
    4: {"mha": (16, 16), "gqa": (16, 4), "gqa_rep": (16, 2), "gqa_rep3": (12, 3), "mqa": (16, 1)},
}


def min_kv_replicas(hkv: int, size: int) -> int:
    """Smallest r >= 1 with hkv * r divisible by size (written independently of the package)."""
    return next(r for r in range(1, size + 1) if (hkv * r) % size == 0)


def valid_chunks(hq: int, hkv: int, size: int, chunks: int) -> bool:
    per_rank = hq // size
    if per_rank % chunks:
        return False
    nqc, g = per_rank // chunks, hq // (hkv * min_kv_replicas(hkv, size))
    return nqc % g == 0 or g % nqc == 0


def expected_forward_bytes(case, world_size, esize):
    """Bytes a rank sends in the forward: a2a of q + (replicated) kv heads, a2a of out back, then the ring.
    Without a ring, the backward sends the same (dout out, dq/dk/dv back), twice that with regather."""
    hq, hkv = case["hq"], case["hkv"]
    u = case["ulysses"]
    r = world_size // u
    b, s_local, d, c = case["b"], case["s"] // world_size, case["d"], case["chunks"]
    rep = min_kv_replicas(hkv, u)
    g = hq // (hkv * rep)
    nqc = hq // u // c
    nkc = max(1, nqc // g)  # KV heads a chunk of nqc query heads needs
    # every query head goes out and comes back once; every (replicated) KV head goes out once, also when
    # several chunks share it; (u-1)/u of each all-to-all leaves the rank
    a2a = (u - 1) * b * s_local * d * esize * 2 * (hq + hkv * rep) // u
    ring = c * (r - 1) * 2 * b * (u * s_local) * nkc * d * esize  # the ring runs once per chunk
    return a2a + ring


def run_cases(rank, world_size, cases):
    """Run every case on this rank; return errors, bytes and staging-buffer peaks (asserted in the parent)."""
    import torch.distributed as dist

    from nemo_longctx.attention import (
        count_bytes_sent, hybrid_attention, make_cp_groups, track_a2a_buffer_bytes, ulysses_attention,
        zigzag_shard,
    )

    results = []
    for case in cases:
        hq, hkv, b, s, d = case["hq"], case["hkv"], case["b"], case["s"], case["d"]
        dtype, causal, chunks = case["dtype"], case["causal"], case["chunks"]
        gen = torch.Generator().manual_seed(zlib.crc32(case["name"].encode()))
        q, k, v, dout = (torch.randn(b, s, h, d, generator=gen).to(dtype) for h in (hq, hkv, hkv, hq))
        ref = reference_forward_backward(q, k, v, dout, causal)

        def shard(t):
            if s % (2 * world_size):  # odd local length (non-causal only): plain contiguous shards
                return t.chunk(world_size, dim=1)[rank]
            return zigzag_shard(t, 1, world_size, rank)

        # leaves in Megatron's [s, b, h, d] memory order; the functions get [b, s, h, d] views (strided if b > 1)
        leaves = [shard(t).transpose(0, 1).contiguous().requires_grad_() for t in (q, k, v)]
        ql, kl, vl = (t.transpose(0, 1) for t in leaves)
        with track_a2a_buffer_bytes() as probe:
            with count_bytes_sent() as fwd_bytes:
                if case["ulysses"] == world_size and not case.get("force_hybrid"):
                    out = ulysses_attention(ql, kl, vl, dist.group.WORLD, causal=causal, head_chunks=chunks,
                                            global_seq_len=s, regather_in_backward=case["regather"])
                else:
                    ug, rg = make_cp_groups(dist.group.WORLD, case["ulysses"])
                    out = hybrid_attention(ql, kl, vl, ug, rg, causal=causal, head_chunks=chunks, global_seq_len=s,
                                           regather_in_backward=case["regather"])
            with count_bytes_sent() as bwd_bytes:
                out.backward(shard(dout))
        errs = {name: rel_err(got, shard(want)) for name, got, want in
                zip(("out", "dq", "dk", "dv"), [out] + [t.grad.transpose(0, 1) for t in leaves], ref)}
        results.append(dict(case=case, errs=errs, dtypes=(out.dtype,) + tuple(t.grad.dtype for t in leaves),
                            fwd_bytes=fwd_bytes.bytes_sent, bwd_bytes=bwd_bytes.bytes_sent,
                            peak_buffer_bytes=probe.peak_bytes))
    return results


def check_results(per_rank, world_size, n_cases):
    checked = 0
    for rank_results in per_rank:
        for r in rank_results:
            case = r["case"]
            tol = TOL[case["dtype"]]
            for name, err in r["errs"].items():
                assert err <= tol, f"{case['name']}: {name} rel err {err:.2e} > {tol}"
            assert r["dtypes"] == (case["dtype"],) * 4, case["name"]
            esize = torch.empty(0, dtype=case["dtype"]).element_size()
            fwd = expected_forward_bytes(case, world_size, esize)
            assert r["fwd_bytes"] == fwd, (case["name"], r["fwd_bytes"])
            if case["ulysses"] == world_size:
                assert r["bwd_bytes"] == fwd * (2 if case["regather"] else 1), (case["name"], r["bwd_bytes"])
            checked += 1
    assert checked == world_size * n_cases


def make_case(world_size, label, hq, hkv, causal, dtype, chunks, ulysses, i, regather=False):
    sizes = [(1, 2 * world_size * 3, 16), (2, 2 * world_size * 2, 32), (1, 2 * world_size * 5, 16)]
    b, s, d = sizes[i % len(sizes)]
    if not causal and i % 2:
        s = world_size * 3  # odd local length: allowed without causal masking
    return dict(name=f"u{ulysses}x{world_size // ulysses}-{label}-{'causal' if causal else 'full'}-{dtype}-c{chunks}"
                     f"{'-regather' if regather else ''}-b{b}-s{s}-d{d}",
                label=label, hq=hq, hkv=hkv, causal=causal, dtype=dtype, chunks=chunks, ulysses=ulysses, b=b, s=s, d=d,
                regather=regather)


def ulysses_cases(world_size):
    cases = []
    # sizes and dtype vary per (heads, masking) group; within a group only head_chunks varies (buffer compare)
    for i, ((label, (hq, hkv)), causal) in enumerate(itertools.product(HEADS[world_size].items(), (True, False))):
        dtype = torch.bfloat16 if i % 3 == 2 else torch.float32
        regather = (i // 2 + i) % 2 == 1
        for chunks in (1, 2, 4):
            if valid_chunks(hq, hkv, world_size, chunks):
                cases.append(make_case(world_size, label, hq, hkv, causal, dtype, chunks, world_size, i, regather))
    # float64 runs the "math" kernel (its gradients need not be contiguous)
    for regather in (False, True):
        cases.append(make_case(world_size, "gqa64", 8, 2, True, torch.float64, 2, world_size, 1, regather))
    return cases


@pytest.mark.parametrize("world_size", [2, 4])
def test_ulysses_matches_fp64_reference(world_size):
    cases = ulysses_cases(world_size)
    # coverage the issue asks for: every head layout, both maskings, chunks 1/2/4, both dtypes
    assert {c["chunks"] for c in cases} == {1, 2, 4}
    assert {(c["hq"], c["hkv"]) for c in cases} >= set(HEADS[world_size].values())
    assert {c["dtype"] for c in cases} == set(TOL) and {c["causal"] for c in cases} == {True, False}
    assert {(c["regather"], c["causal"], c["chunks"] > 1) for c in cases} == set(
        itertools.product((True, False), (True, False), (True, False)))
    per_rank = run_distributed(run_cases, world_size, cases)
    check_results(per_rank, world_size, len(cases))

    # head_chunks = c holds <= 1/c of the staging-buffer bytes of head_chunks = 1 (when KV heads split evenly)
    peaks = {}
    for r in per_rank[0]:
        c = r["case"]
        peaks[(c["label"], c["hq"], c["hkv"], c["causal"], c["regather"], c["chunks"])] = r["peak_buffer_bytes"]
    compared = 0
    for (label, hq, hkv, causal, regather, chunks), peak in peaks.items():
        kv_per_rank = hkv * min_kv_replicas(hkv, world_size) // world_size
        base = peaks.get((label, hq, hkv, causal, regather, 1))
        if chunks == 1 or kv_per_rank % chunks or base is None:
            continue
        assert base > 0 and peak <= base / chunks * 1.02, (label, causal, regather, chunks, peak, base)
        compared += 1
    assert compared >= 2


def test_kv_replication_is_minimal_and_grouping_exact():
    from nemo_longctx.attention import UlyssesHeadPlan

    for size, hq, hkv in [(2, 6, 3), (4, 16, 2), (4, 12, 3), (4, 16, 1), (8, 32, 8), (8, 24, 6), (4, 8, 4)]:
        plan = UlyssesHeadPlan(size, hq, hkv, 1)
        rep = plan.kv_replicas
        assert rep == min_kv_replicas(hkv, size)
        # every query head of rank j gets the KV head of its original group
        for j in range(size):
            qs = plan.q_heads(j, 0)
            kv = plan.kv_heads(j, 0, torch.device("cpu"))
            kv = list(range(hkv))[kv] if isinstance(kv, slice) else kv.tolist()
            g_local = (qs.stop - qs.start) // len(kv)
            for i, h in enumerate(range(qs.start, qs.stop)):
                assert kv[i // g_local] == h // (hq // hkv), (size, hq, hkv, j, h)


def test_head_plan_validation_without_tensors():
    from nemo_longctx.attention import plan_ulysses_heads

    assert plan_ulysses_heads(32, 8, 8, 4).kv_replicas == 1
    assert plan_ulysses_heads(32, 8, 16, 2).kv_replicas == 2  # Ulysses degree beyond the KV-head count
    for args, text in [((12, 4, 8, 1), "hq % ulysses_size != 0"), ((32, 8, 8, 3), "head_chunks=3 must divide"),
                       ((24, 6, 2, 2), "splits a KV group"), ((8, 3, 2, 1), "multiple of key/value heads"),
                       ((8, 2, 0, 1), "ulysses_size must be a positive int")]:
        with pytest.raises(ValueError, match=text):
            plan_ulysses_heads(*args)


def test_no_group_is_plain_attention():
    from nemo_longctx.attention import ulysses_attention

    gen = torch.Generator().manual_seed(0)
    for causal, chunks in itertools.product((True, False), (1, 2)):
        q, k, v, dout = (torch.randn(2, 10, h, 16, generator=gen) for h in (4, 2, 2, 4))
        ref = reference_forward_backward(q, k, v, dout, causal, scale=0.3)
        ql, kl, vl = (t.clone().requires_grad_() for t in (q, k, v))
        out = ulysses_attention(ql, kl, vl, None, causal=causal, softmax_scale=0.3, head_chunks=chunks)
        out.backward(dout)
        for got, want in zip((out, ql.grad, kl.grad, vl.grad), ref):
            assert rel_err(got, want) <= 1e-5


def _bad_input_worker(rank, world_size):
    import torch.distributed as dist

    from nemo_longctx.attention import count_bytes_sent, ulysses_attention

    group = dist.group.WORLD

    def t(s, h, d=16):
        return torch.randn(1, s, h, d)

    bad = {
        "hq_split": (t(8, 3), t(8, 1), t(8, 1), {}),
        "chunks_divide": (t(8, 4), t(8, 2), t(8, 2), {"head_chunks": 3}),
        "chunks_zero": (t(8, 4), t(8, 2), t(8, 2), {"head_chunks": 0}),
        "chunks_group": (t(8, 24), t(8, 6), t(8, 6), {"head_chunks": 2}),
        "odd": (t(7, 4), t(7, 2), t(7, 2), {}),
        "heads": (t(8, 4), t(8, 3), t(8, 3), {}),
        "layout": (t(8, 4), t(8, 2), t(8, 2), {"global_seq_len": 8 * (world_size + 1)}),
    }
    messages = {}
    with count_bytes_sent() as sent:
        for name, (a, b_, c, kw) in bad.items():
            try:
                ulysses_attention(a, b_, c, group, **kw)
            except ValueError as e:
                messages[name] = str(e)
            else:
                messages[name] = None
    out = ulysses_attention(t(8, 4), t(8, 2), t(8, 2), group)  # the group is still usable
    dist.barrier()
    return messages, sent.bytes_sent, tuple(out.shape)


def test_bad_inputs_raise_before_communicating():
    (msgs, sent, shape), _ = run_distributed(_bad_input_worker, 2)
    assert all(m is not None for m in msgs.values()), msgs
    assert "hq % ulysses_size != 0" in msgs["hq_split"]
    assert "head_chunks=3 must divide" in msgs["chunks_divide"]
    assert "positive int" in msgs["chunks_zero"]
    assert "splits a KV group" in msgs["chunks_group"]
    assert "even" in msgs["odd"]
    assert "multiple of key/value heads" in msgs["heads"]
    assert "does not match the layout" in msgs["layout"]
    assert sent == 0
    assert shape == (1, 8, 4, 16)
