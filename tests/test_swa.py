"""Sliding-window attention (window_size=(left, right), flash-attn convention) under ring, Ulysses and hybrid CP on
2 and 4 gloo ranks vs an fp64 full-sequence reference (forward and backward): window < chunk, window > chunk,
window >= sequence, non-causal bands; only the K/V the window needs travel (bytes == the needed positions);
and windows within packed documents (THD + SWA) vs an fp64 per-document reference."""

from __future__ import annotations

import zlib

import pytest
import torch

from distributed import run_distributed
from reference import rel_err

TOL = {torch.float32: 2e-5, torch.float64: 1e-10}


def allowed(S, causal, left, right):
    i, j = torch.arange(S)[:, None], torch.arange(S)[None]
    ok = torch.ones(S, S, dtype=torch.bool)
    if left >= 0:
        ok &= j >= i - left
    if right >= 0:
        ok &= j <= i + right
    if causal:
        ok &= j <= i
    return ok


def reference_window(q, k, v, dout, causal, scale, left, right):
    q, k, v = (t.detach().double().requires_grad_() for t in (q, k, v))
    g = q.shape[2] // k.shape[2]
    s = torch.einsum("bshd,bthd->bhst", q, k.repeat_interleave(g, 2)) * scale
    s = s.masked_fill(~allowed(q.shape[1], causal, left, right), float("-inf"))
    out = torch.einsum("bhst,bthd->bshd", torch.softmax(s, -1), v.repeat_interleave(g, 2))
    out.backward(dout.double())
    return out.detach(), q.grad, k.grad, v.grad


def zigzag_positions(S, P, r):
    c = S // (2 * P)
    return list(range(r * c, (r + 1) * c)) + list(range((2 * P - 1 - r) * c, (2 * P - r) * c))


def needed_bytes(S, P, rank, causal, left, right, hkv, d, dv, esize, b=1):
    """Bytes ``rank`` sends in the forward: for every peer, the keys of ``rank`` that some query of the peer sees."""
    ok = allowed(S, causal, left, right)
    mine = zigzag_positions(S, P, rank)
    n = 0
    for p in range(P):
        if p != rank:
            rows = ok[zigzag_positions(S, P, p)]
            n += int(rows[:, mine].any(0).sum())
    return n * b * hkv * (d + dv) * esize


def _cases(world):
    S = 2 * world * 12  # chunk c = 12
    f32, f64 = torch.float32, torch.float64
    spec = [
        # algo, ulysses size, causal, (left, right), dtype, (hq, hkv), d, dv
        ("ring", 1, True, (5, 0), f32, (4, 2), 16, 16),  # window < chunk: a halo
        ("ring", 1, True, (30, 0), f64, (4, 1), 16, 16),  # window > chunk
        ("ring", 1, True, (S + 3, 0), f32, (4, 2), 16, 16),  # window >= sequence
        ("ring", 1, False, (3, 7), f64, (4, 2), 16, 8),  # a non-causal band, MLA dims
        ("ring", 1, False, (-1, 4), f32, (2, 2), 16, 16),
        ("ulysses", world, True, (5, 0), f32, (world * 2, 2), 16, 16),
        ("ulysses", world, False, (9, 2), f64, (world, 1), 16, 16),
        ("hybrid", 2, True, (5, 0), f32, (4, 2), 16, 16),
        ("hybrid", 2, True, (30, 0), f64, (4, 2), 16, 16),
    ]
    out = []
    for algo, u, causal, win, dtype, (hq, hkv), d, dv in spec:
        out.append(dict(name=f"{algo}-u{u}-{'causal' if causal else 'full'}-w{win[0]}.{win[1]}-{str(dtype)[6:]}-"
                             f"h{hq}.{hkv}-d{d}.{dv}", algo=algo, ulysses=u, causal=causal, window=win, dtype=dtype,
                        hq=hq, hkv=hkv, d=d, dv=dv, S=S))
    return out


def _swa_worker(rank, world, cases):
    import torch.distributed as dist

    import nemo_longctx.attention.window as window_mod
    from nemo_longctx.attention import (
        count_bytes_sent, hybrid_attention, make_cp_groups, ring_attention, ulysses_attention, zigzag_shard)

    window_mod.DEFAULT_TILE = 8  # many tiles, so every kind of sub-block (full, causal, masked edge) runs
    wg = dist.group.WORLD
    results = []
    for case in cases:
        S, hq, hkv, d, dv, dtype = (case[x] for x in ("S", "hq", "hkv", "d", "dv", "dtype"))
        gen = torch.Generator().manual_seed(zlib.crc32(case["name"].encode()))
        q, k, v, dout = (torch.randn(1, S, h, e, generator=gen).to(dtype)
                         for h, e in ((hq, d), (hkv, d), (hkv, dv), (hq, dv)))
        ref = reference_window(q, k, v, dout, case["causal"], 0.3, *case["window"])
        sh = lambda t: zigzag_shard(t, 1, world, rank)  # noqa: E731
        leaves = [sh(t).clone().requires_grad_() for t in (q, k, v)]
        kw = dict(causal=case["causal"], softmax_scale=0.3, window_size=case["window"])
        with count_bytes_sent() as sent:
            if case["algo"] == "ring":
                out = ring_attention(*leaves, wg, **kw)
            elif case["algo"] == "ulysses":
                out = ulysses_attention(*leaves, wg, **kw)
            else:
                ug, rg = make_cp_groups(wg, case["ulysses"])
                out = hybrid_attention(*leaves, ug, rg, **kw)
        out.backward(sh(dout))
        got = [out] + [t.grad for t in leaves]
        results.append(dict(case=case, errs=[rel_err(a, sh(w)) for a, w in zip(got, ref)], fwd_bytes=sent.bytes_sent))
    # no window and (-1, -1) are the same computation
    x = [sh(t) for t in (q, k, v)]
    results.append(torch.equal(ring_attention(*x, wg, window_size=(-1, -1)), ring_attention(*x, wg)))
    return results


@pytest.mark.parametrize("world", [2, 4])
def test_swa_matches_fp64_reference(world):
    cases = _cases(world)
    per_rank = run_distributed(_swa_worker, world, cases, timeout=300)
    for rank, rank_results in enumerate(per_rank):
        assert rank_results[-1] is True
        for r in rank_results[:-1]:
            case = r["case"]
            tol = TOL[case["dtype"]]
            for name, err in zip(("out", "dq", "dk", "dv"), r["errs"]):
                assert err <= tol, f"{case['name']}: {name} rel err {err:.2e} > {tol}"
            if case["algo"] == "ring":
                esize = torch.empty(0, dtype=case["dtype"]).element_size()
                want = needed_bytes(case["S"], world, rank, case["causal"], *case["window"], case["hkv"], case["d"],
                                    case["dv"], esize)
                assert r["fwd_bytes"] == want, (case["name"], r["fwd_bytes"], want)
                full_ring = (world - 1) * (case["S"] // world) * case["hkv"] * (case["d"] + case["dv"]) * esize
                if case["window"] == (5, 0):  # window < chunk: a halo of at most 2 x 5 tokens
                    assert 0 < r["fwd_bytes"] <= full_ring / (world - 1) / 2
                    assert r["fwd_bytes"] <= 2 * 5 * case["hkv"] * (case["d"] + case["dv"]) * esize


def test_window_blocks_cover_exactly_the_band():
    """Every allowed (query, key) pair is in exactly one sub-block, no forbidden pair is unmasked."""
    from nemo_longctx.attention.window import band_blocks, normalize_window, window_mask

    for causal, win in ((True, (5, 0)), (True, (0, 0)), (False, (3, 7)), (False, (-1, 4)), (False, (6, -1)),
                        (True, (40, 0)), (True, (-1, -1))):
        w = normalize_window(win, causal)
        if w is None:
            assert win == (-1, -1)
            continue
        for tile in (4, 7, 64):
            for (q0, q1, k0, k1) in ((0, 50, 0, 50), (10, 30, 25, 45), (30, 50, 0, 12)):
                seen = torch.zeros(50, 50, dtype=torch.int64)
                for qa, qb, ka, kb, kind in band_blocks(q0, q1, k0, k1, *w, tile=tile):
                    if kind == "full":
                        m = torch.ones(qb - qa, kb - ka, dtype=torch.bool)
                    elif kind == "causal":
                        m = torch.ones(qb - qa, kb - ka, dtype=torch.bool).tril()
                    else:
                        m = window_mask(qa, qb, ka, kb, *w, torch.float32, "cpu") == 0
                    assert m.any(1).all()  # every row of a block sees a key (finite lse)
                    seen[qa:qb, ka:kb] += m.long()
                want = torch.zeros(50, 50, dtype=torch.int64)
                want[q0:q1, k0:k1] = allowed(50, causal, *win)[q0:q1, k0:k1].long()
                assert torch.equal(seen, want), (causal, win, tile, (q0, q1, k0, k1))


def test_bad_windows():
    from nemo_longctx.attention import ring_attention, ulysses_attention

    x = torch.randn(1, 8, 2, 4)
    for fn in (ring_attention, ulysses_attention):
        for bad, msg in (((3,), "pair"), ((-2, 0), "left=-2"), ((1.5, 0), "left=1.5")):
            with pytest.raises(ValueError, match=msg):
                fn(x, x, x, None, window_size=bad)


# ---------------------------------------------------------------------------------------------- THD + SWA


def reference_packed_window(q, k, v, dout, cu, cup, causal, scale, left, right):
    """fp64 per-document windowed attention on the packed sequence; padding rows give 0."""
    q, k, v = (t.detach().double().requires_grad_() for t in (q, k, v))
    g = q.shape[2] // k.shape[2]
    pieces = []
    for i in range(len(cu) - 1):
        n, start, end = int(cu[i + 1] - cu[i]), int(cup[i]), int(cup[i + 1])
        if n:
            sl = slice(start, start + n)
            sc = torch.einsum("bshd,bthd->bhst", q[:, sl], k[:, sl].repeat_interleave(g, 2)) * scale
            sc = sc.masked_fill(~allowed(n, causal, left, right), float("-inf"))
            pieces.append(torch.einsum("bhst,bthd->bshd", torch.softmax(sc, -1), v[:, sl].repeat_interleave(g, 2)))
        pieces.append(torch.zeros(1, end - start - n, q.shape[2], v.shape[3], dtype=torch.float64))
    out = torch.cat(pieces, 1)
    out.backward(dout.double())
    return out.detach(), q.grad, k.grad, v.grad


def _thd_swa_cases(world):
    f32, f64 = torch.float32, torch.float64
    spec = [("ring", 1, True, (3, 0), f32), ("ring", 1, True, (20, 0), f64), ("ring", 1, False, (2, 5), f64),
            ("ulysses", world, True, (3, 0), f32), ("ulysses", world, False, (4, 1), f64),
            ("hybrid", 2, True, (6, 0), f64)]
    return [dict(name=f"thd-{a}-u{u}-{'causal' if c else 'full'}-w{w[0]}.{w[1]}-{str(t)[6:]}", algo=a, ulysses=u,
                 causal=c, window=w, dtype=t) for a, u, c, w, t in spec]


def _thd_swa_worker(rank, world, cases):
    import torch.distributed as dist

    import nemo_longctx.attention.window as window_mod
    from nemo_longctx.attention import hybrid_attention, make_cp_groups, ring_attention, ulysses_attention, zigzag_shard

    window_mod.DEFAULT_TILE = 4
    m = 2 * world
    lengths, extra = [5, 1, 3 * m, 0, m + 3, 2 * m - 1], (0, m, 0, m, 0, 0)
    cu, cup = [0], [0]
    for n, e in zip(lengths, extra):
        cu.append(cu[-1] + n)
        cup.append(cup[-1] + -(-n // m) * m + e)
    cu, cup = torch.tensor(cu, dtype=torch.int32), torch.tensor(cup, dtype=torch.int32)
    S = int(cup[-1])
    wg = dist.group.WORLD
    results = []
    for case in cases:
        gen = torch.Generator().manual_seed(zlib.crc32(case["name"].encode()))
        q, k, v, dout = (torch.randn(1, S, h, 16, generator=gen).to(case["dtype"]) for h in (4, 2, 2, 4))
        ref = reference_packed_window(q, k, v, dout, cu, cup, case["causal"], 0.3, *case["window"])
        sh = lambda t: zigzag_shard(t, 1, world, rank, cu_seqlens_padded=cup)  # noqa: E731
        leaves = [sh(t).clone().requires_grad_() for t in (q, k, v)]
        kw = dict(causal=case["causal"], softmax_scale=0.3, window_size=case["window"], cu_seqlens=cu,
                  cu_seqlens_padded=cup)
        if case["algo"] == "ring":
            out = ring_attention(*leaves, wg, **kw)
        elif case["algo"] == "ulysses":
            out = ulysses_attention(*leaves, wg, **kw)
        else:
            ug, rg = make_cp_groups(wg, case["ulysses"])
            out = hybrid_attention(*leaves, ug, rg, **kw)
        out.backward(sh(dout))
        results.append(dict(case=case, errs=[rel_err(a, sh(w)) for a, w in zip([out] + [t.grad for t in leaves],
                                                                                 ref)]))
    return results


@pytest.mark.parametrize("world", [2, 4])
def test_thd_swa_matches_fp64_per_document_reference(world):
    cases = _thd_swa_cases(world)
    for rank_results in run_distributed(_thd_swa_worker, world, cases, timeout=300):
        assert len(rank_results) == len(cases)
        for r in rank_results:
            tol = TOL[r["case"]["dtype"]]
            for name, err in zip(("out", "dq", "dk", "dv"), r["errs"]):
                assert err <= tol, f"{r['case']['name']}: {name} rel err {err:.2e} > {tol}"
