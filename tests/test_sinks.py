"""Attention sinks (GPT-OSS learnable per-head sink logits; the off-by-one softmax) under ring, Ulysses and hybrid
CP on 2 and 4 gloo ranks, dense, packed (THD) and sliding-window, vs an fp64 full-sequence reference with the
extra denominator term (forward, dq, dk, dv and dsinks; the sinks' gradient summed over the ranks, as data-parallel
reduction over the CP group does). Controls show the checks can fail: attention without sinks, the sink applied per
ring block, and sinks assigned to the wrong heads all miss the reference by far more than the tolerance. Plus
single-process ``local_attention`` and the input checks."""

from __future__ import annotations

import zlib

import pytest
import torch

from distributed import run_distributed
from reference import reference_attention, reference_sink_attention, reference_sinks_forward_backward, rel_err

TOL = {torch.float32: 1e-5, torch.float64: 1e-12, torch.bfloat16: 2e-2}
THD_TOL = {torch.float32: 2e-5, torch.float64: 1e-12}  # as test_thd / test_swa (more merges per row)
CONTROL_FACTOR = 100  # a control must miss the reference by this many tolerances

F32, F64, BF16 = torch.float32, torch.float64, torch.bfloat16


# ---------------------------------------------------------------------------------------------- masks


def packed(lengths, multiple, extra_pad=()):
    """(cu_seqlens, cu_seqlens_padded) int32: real ``lengths``, each padded up to ``multiple`` (+ ``extra_pad``)."""
    cu, cup = [0], [0]
    for i, n in enumerate(lengths):
        cu.append(cu[-1] + n)
        cup.append(cup[-1] + -(-n // multiple) * multiple + (extra_pad[i] if i < len(extra_pad) else 0))
    return torch.tensor(cu, dtype=torch.int32), torch.tensor(cup, dtype=torch.int32)


def allowed_mask(S, causal, window=None, cu=None, cup=None):
    """[S, S] bool: query i may see key j (causal, flash-attn window (left, right) with -1 = unbounded, and for a
    packed sequence only the real tokens of the same document)."""
    i, j = torch.arange(S)[:, None], torch.arange(S)[None]
    ok = torch.ones(S, S, dtype=torch.bool)
    if causal:
        ok &= j <= i
    if window is not None:
        left, right = window
        if left >= 0:
            ok &= j >= i - left
        if right >= 0:
            ok &= j <= i + right
    if cu is not None:
        doc = torch.full((S,), -1)
        real = torch.zeros(S, dtype=torch.bool)
        for d, (a, n) in enumerate(zip(cup.tolist(), (cu[1:] - cu[:-1]).tolist())):
            doc[a:a + n] = d
            real[a:a + n] = True
        ok &= (doc[:, None] == doc[None]) & real[:, None] & real[None]
    return ok


def padding_positions(S, cu, cup):
    """[S] bool: positions of a packed sequence that are padding."""
    pad = torch.ones(S, dtype=torch.bool)
    for a, n in zip(cup.tolist(), (cu[1:] - cu[:-1]).tolist()):
        pad[a:a + n] = False
    return pad


# ---------------------------------------------------------------------------------------------- cases


def _case(algo, kind, heads, causal, *, u=1, b=1, c=6, d=16, dv=None, dtype=F32, softmax="learnable", chunks=1,
          regather=False, window=None, docs=None, sinks_dtype=F32):
    name = (f"{algo}{'-u%d' % u if algo == 'hybrid' else ''}-{kind}-{'causal' if causal else 'full'}-h{heads[0]}."
            f"{heads[1]}-{str(dtype)[6:]}-{softmax}" + (f"-chunks{chunks}" if chunks > 1 else "")
            + ("-regather" if regather else "") + (f"-w{window[0]}.{window[1]}" if window else ""))
    return dict(name=name, algo=algo, kind=kind, hq=heads[0], hkv=heads[1], causal=causal, u=u, b=b, c=c, d=d,
                dv=dv or d, dtype=dtype, softmax=softmax, chunks=chunks, regather=regather, window=window, docs=docs,
                sinks_dtype=sinks_dtype)


def sink_cases(world):
    """Many shapes on one spawn: MHA/GQA/MQA, causal and not, dense, packed, windowed, off-by-one."""
    W = world
    mha, gqa, mqa = (4, 4), (8, 2), (4, 1)
    mixed = ([5, 1, 4 * W, 3, 0, 2 * W + 1, 7], (0, 2 * W, 0, 0, 2 * W))  # short, exact, padded, empty documents
    cases = [
        # ring, dense
        _case("ring", "dense", mha, True, b=2, c=8),
        _case("ring", "dense", gqa, False, c=6, d=32, sinks_dtype=F64),
        _case("ring", "dense", mqa, True, b=2, c=5, dv=8),
        _case("ring", "dense", gqa, True, softmax="off-by-one"),
        _case("ring", "dense", gqa, True, dtype=BF16, c=8),
        _case("ring", "dense", mha, True, dtype=F64, c=4, sinks_dtype=F64),
        # Ulysses, dense (hq % W == 0; gqa over 4 ranks replicates its 2 KV heads)
        _case("ulysses", "dense", gqa, True, b=2),
        _case("ulysses", "dense", gqa, True, chunks=2),
        _case("ulysses", "dense", mqa, False, regather=True),
        _case("ulysses", "dense", mha, True, softmax="off-by-one", c=5),
        # packed documents
        _case("ring", "thd", gqa, True, docs=mixed),
        _case("ring", "thd", mqa, False, docs=mixed, softmax="off-by-one"),
        _case("ulysses", "thd", gqa, True, docs=mixed),
        _case("ulysses", "thd", mha, False, docs=mixed, regather=True),
        # sliding windows (window < chunk, a non-causal band), also within packed documents
        _case("ring", "window", gqa, True, window=(5, 0)),
        _case("ring", "window", mha, False, window=(3, 7), dv=8),
        _case("ulysses", "window", gqa, True, window=(5, 0)),
        _case("ring", "thd_window", gqa, True, docs=mixed, window=(4, 0)),
    ]
    if W == 4:  # hybrid 2 x 2
        cases += [
            _case("hybrid", "dense", gqa, True, u=2, b=2),
            _case("hybrid", "dense", mha, False, u=2, regather=True),
            _case("hybrid", "dense", gqa, True, u=2, chunks=2, softmax="off-by-one"),
            _case("hybrid", "thd", gqa, True, u=2, docs=mixed),
            _case("hybrid", "window", gqa, True, u=2, window=(5, 0)),
        ]
    else:  # 2 ranks: the hybrid entry point as ulysses 2 x ring 1 and ulysses 1 x ring 2 (head-chunked and plain)
        cases += [
            _case("hybrid", "dense", gqa, True, u=2),
            _case("hybrid", "dense", gqa, True, u=1, chunks=2),
            _case("hybrid", "thd", mqa, True, u=1, docs=mixed),
            _case("hybrid", "window", gqa, True, u=2, window=(5, 0)),
        ]
    return cases


# ---------------------------------------------------------------------------------------------- the worker


def _inputs(case, world):
    """Full-sequence q, k, v, dout, sinks (rounded to the case's dtypes), the mask, and the packed layout."""
    gen = torch.Generator().manual_seed(zlib.crc32(case["name"].encode()))
    cu = cup = None
    if case["docs"] is not None:
        cu, cup = packed(*case["docs"][:1], 2 * world, case["docs"][1])
        S, b = int(cup[-1]), 1
    else:
        S, b = 2 * world * case["c"], case["b"]
    hq, hkv, d, dv = case["hq"], case["hkv"], case["d"], case["dv"]
    q, k, v, dout = (torch.randn(b, S, h, e, generator=gen).to(case["dtype"])
                     for h, e in ((hq, d), (hkv, d), (hkv, dv), (hq, dv)))
    # logits of the size of a row's log-sum-exp (a few), so that the sink takes a sizable share
    sinks = (torch.rand(hq, generator=gen) * 5 - 1).to(case["sinks_dtype"])
    allowed = allowed_mask(S, case["causal"], case["window"], cu, cup)
    return q, k, v, dout, sinks, allowed, cu, cup


def _attend(case, q, k, v, sinks, cu, cup):
    """The case's algorithm on this rank's shards; ``sinks`` None runs it without a sink (a control)."""
    import torch.distributed as dist

    from nemo_longctx.attention import hybrid_attention, make_cp_groups, ring_attention, ulysses_attention

    world = dist.group.WORLD
    kw = dict(causal=case["causal"])
    if sinks is not None or case["softmax"] != "learnable":
        kw.update(sinks=sinks, softmax_type=case["softmax"])
    if cu is not None:
        kw.update(cu_seqlens=cu, cu_seqlens_padded=cup)
    if case["window"] is not None:
        kw.update(window_size=case["window"])
    if case["algo"] == "ring":
        return ring_attention(q, k, v, world, **kw)
    extra = dict(head_chunks=case["chunks"], regather_in_backward=case["regather"])
    if case["algo"] == "ulysses":
        return ulysses_attention(q, k, v, world, **kw, **extra)
    ug, rg = make_cp_groups(world, case["u"])
    return hybrid_attention(q, k, v, ug, rg, **kw, **extra)


def _run_case(case, rank, world):
    from nemo_longctx.attention import zigzag_shard

    q, k, v, dout, sinks, allowed, cu, cup = _inputs(case, world)
    learnable = case["softmax"] == "learnable"
    ref_sinks = sinks if learnable else torch.zeros(case["hq"], dtype=torch.float64)
    ref = reference_sinks_forward_backward(q, k, v, dout, ref_sinks, allowed)

    def shard(t):
        return zigzag_shard(t, 1, world, rank, cu_seqlens_padded=cup)

    leaves = [shard(t).detach().clone().requires_grad_() for t in (q, k, v)]
    sink_leaf = sinks.clone().requires_grad_() if learnable else None
    out = _attend(case, *leaves, sink_leaf, cu, cup)
    out.backward(shard(dout))
    errs = {name: rel_err(got, shard(want)) for name, got, want in
            zip(("out", "dq", "dk", "dv"), (out, *(t.grad for t in leaves)), ref)}
    # plain lists: tensors would travel to the parent as shared memory that dies with the worker
    result = dict(case=case, errs=errs, out_dtype=out.dtype, ref_dsinks=ref[4].tolist())
    if learnable:
        result.update(dsinks=sink_leaf.grad.double().tolist(), dsinks_dtype=sink_leaf.grad.dtype)
    if cu is not None:  # padding rows: output and gradients exactly 0
        pad = shard(padding_positions(int(cup[-1]), cu, cup).view(1, -1)).view(-1)
        result["pad_rows"] = int(pad.sum())
        result["pad_abs"] = max(t[:, pad].abs().max().item() if pad.any() else 0.0
                                for t in (out, *(t.grad for t in leaves)))
    return result


def _controls(rank, world):
    """Forward errors vs the sink reference of attention that is wrong on purpose (each must be large):
    no sinks at all, the sink entering every ring block, and the sinks of the wrong heads."""
    import dataclasses

    import torch.distributed as dist

    from nemo_longctx.attention import KERNELS, apply_sinks, ring_attention, zigzag_shard
    from nemo_longctx.attention.ring import ring_attention_forward

    case = _case("ring", "dense", (4, 4), True, b=2, c=8)
    q, k, v, dout, sinks, allowed, _, _ = _inputs(case, world)
    want = zigzag_shard(reference_sink_attention(q, k, v, sinks, allowed), 1, world, rank)
    ql, kl, vl = (zigzag_shard(t, 1, world, rank) for t in (q, k, v))
    cpu = KERNELS["cpu_flash"]

    def per_block_forward(qb, kb, vb, causal, scale):
        o, lse = cpu.forward(qb, kb, vb, causal, scale)
        o, lse = apply_sinks(o, lse, sinks)
        return o.to(qb.dtype), lse

    per_block = dataclasses.replace(cpu, name="sink_per_block", forward=per_block_forward)
    errs = {
        "no_sinks": rel_err(ring_attention(ql, kl, vl, dist.group.WORLD), want),
        "per_block": rel_err(ring_attention_forward(ql, kl, vl, dist.group.WORLD, True, 16 ** -0.5, per_block)[0],
                             want),
        "rolled_heads": rel_err(ring_attention(ql, kl, vl, dist.group.WORLD, sinks=sinks.roll(1)), want),
        "correct": rel_err(ring_attention(ql, kl, vl, dist.group.WORLD, sinks=sinks), want),
    }
    return errs


def _bad_sinks(rank, world):
    """Every entry point rejects bad sinks with a ValueError before sending a byte (all ranks alike)."""
    import torch.distributed as dist

    from nemo_longctx.attention import (
        count_bytes_sent, hybrid_attention, make_cp_groups, ring_attention, ulysses_attention)

    wg = dist.group.WORLD
    ug, rg = make_cp_groups(wg, 2)
    q, kv = torch.randn(1, 8, 4, 16), torch.randn(1, 8, 2, 16)
    calls = {
        "ring": lambda **kw: ring_attention(q, kv, kv, wg, **kw),
        "ulysses": lambda **kw: ulysses_attention(q, kv, kv, wg, **kw),
        "hybrid": lambda **kw: hybrid_attention(q, kv, kv, ug, rg, **kw),
    }
    bad = {"heads": dict(sinks=torch.zeros(3)), "rank2": dict(sinks=torch.zeros(1, 4)),
           "vanilla_with_sinks": dict(sinks=torch.zeros(4), softmax_type="vanilla"),
           "learnable_without": dict(softmax_type="learnable"), "type": dict(softmax_type="offbyone")}
    messages = {}
    with count_bytes_sent() as sent:
        for fn, call in calls.items():
            for name, kw in bad.items():
                try:
                    call(**kw)
                except ValueError as e:
                    messages[f"{fn}:{name}"] = str(e)
                else:
                    messages[f"{fn}:{name}"] = None
    dist.barrier()
    return messages, sent.bytes_sent


def _sinks_worker(rank, world, cases):
    return [_run_case(case, rank, world) for case in cases], _controls(rank, world), _bad_sinks(rank, world)


# ---------------------------------------------------------------------------------------------- checks


def _owned_heads(case, world, rank):
    """Query heads whose sinks ``rank`` computes: all for ring, its Ulysses slice under Ulysses / hybrid."""
    u = {"ring": 1, "ulysses": world, "hybrid": case["u"]}[case["algo"]]
    per = case["hq"] // u
    mine = rank % u  # hybrid: cp rank = ring rank * U + Ulysses rank
    return set(range(mine * per, (mine + 1) * per))


@pytest.fixture(scope="module", params=[2, 4], ids=["cp2", "cp4"])
def sink_runs(request):
    """One spawn per CP size, every case in it."""
    world = request.param
    cases = sink_cases(world)
    return world, cases, run_distributed(_sinks_worker, world, cases)


def test_sinks_match_fp64_reference(sink_runs):
    world, cases, per_rank = sink_runs
    algos = {(c["algo"], c["kind"]) for c in cases}
    assert {("ring", "dense"), ("ulysses", "dense"), ("hybrid", "dense"), ("ring", "thd"), ("ulysses", "thd"),
            ("hybrid", "thd"), ("ring", "window"), ("ulysses", "window"), ("hybrid", "window")} <= algos
    for i, case in enumerate(cases):
        results = [per_rank[r][0][i] for r in range(world)]
        tol = (THD_TOL if case["docs"] is not None or case["window"] else TOL)[case["dtype"]]
        for rank, res in enumerate(results):
            assert res["case"]["name"] == case["name"]
            assert res["out_dtype"] == case["dtype"]
            for name, err in res["errs"].items():
                assert err <= tol, f"{case['name']} rank {rank}: {name} rel err {err:.2e} > {tol}"
        if case["softmax"] != "learnable":
            continue
        total = sum(torch.tensor(res["dsinks"], dtype=F64) for res in results)
        err = rel_err(total, torch.tensor(results[0]["ref_dsinks"], dtype=F64))
        assert err <= tol, f"{case['name']}: dsinks rel err {err:.2e} > {tol}"
        assert all(res["dsinks_dtype"] == case["sinks_dtype"] for res in results)
        for rank, res in enumerate(results):  # a rank's gradient covers only the heads it computed
            others = sorted(set(range(case["hq"])) - _owned_heads(case, world, rank))
            assert all(res["dsinks"][h] == 0 for h in others), f"{case['name']} rank {rank}: dsinks of heads {others}"


def test_sinks_padding_rows_stay_zero(sink_runs):
    world, cases, per_rank = sink_runs
    packed_cases = [i for i, c in enumerate(cases) if c["docs"] is not None]
    assert packed_cases
    assert sum(per_rank[r][0][i]["pad_rows"] for i in packed_cases for r in range(world)) > 0
    for i in packed_cases:
        for r in range(world):
            assert per_rank[r][0][i]["pad_abs"] == 0.0, f"{cases[i]['name']} rank {r}: padding rows not zero"


def test_sinks_controls_fail_the_checks(sink_runs):
    """The same comparison rejects attention without sinks, a sink per ring block and sinks on the wrong heads;
    a single rank's partial dsinks is not the full gradient (the sum over ranks is what matches)."""
    world, cases, per_rank = sink_runs
    for rank in range(world):
        errs = per_rank[rank][1]
        assert errs["correct"] <= TOL[F32], errs
        for name in ("no_sinks", "per_block", "rolled_heads"):
            # every rank holds rows that see several ring blocks, so the per-block placement fails on each
            assert errs[name] > CONTROL_FACTOR * TOL[F32], f"control {name} passed on rank {rank}: {errs}"
    i = next(i for i, c in enumerate(cases) if c["algo"] == "ring" and c["softmax"] == "learnable")
    ref = torch.tensor(per_rank[0][0][i]["ref_dsinks"], dtype=F64)
    assert rel_err(torch.tensor(per_rank[0][0][i]["dsinks"], dtype=F64), ref) > CONTROL_FACTOR * TOL[F32]


def test_sinks_bad_inputs_raise_before_communicating(sink_runs):
    world, _, per_rank = sink_runs
    for messages, sent in (r[2] for r in per_rank):
        assert sent == 0
        for key, msg in messages.items():
            assert msg is not None, f"{key}: no ValueError"
        assert "[4]" in messages["ring:heads"] and "(3,)" in messages["ring:heads"]
        assert "hybrid_attention" in messages["hybrid:rank2"] and "ulysses_attention" in messages["ulysses:heads"]
        assert "'learnable'" in messages["ring:vanilla_with_sinks"]
        assert "needs sinks" in messages["ulysses:learnable_without"]
        assert "'offbyone'" in messages["hybrid:type"]


# ---------------------------------------------------------------------------------------------- one process


def test_reference_with_sinks_is_the_plain_reference_at_minus_inf():
    """The sink reference without a sink term (-inf logit) is the plain reference; a sink only lowers the row
    weights (all by the same factor per row)."""
    gen = torch.Generator().manual_seed(3)
    q, k, v = torch.randn(2, 12, 4, 8, generator=gen), torch.randn(2, 12, 2, 8, generator=gen), \
        torch.randn(2, 12, 2, 8, generator=gen)
    causal = allowed_mask(12, True)
    plain = reference_attention(q, k, v, True)
    assert rel_err(reference_sink_attention(q, k, v, torch.full((4,), float("-inf")), causal), plain) < 1e-14
    # the first query sees one key: softmax over [s_00, sink] gives it the weight sigmoid(s_00 - sink)
    sinks = torch.tensor([0.0, 1.0, -2.0, 3.0])
    got = reference_sink_attention(q, k, v, sinks, causal)
    s00 = torch.einsum("bhd,bhd->bh", q[:, 0].double(), k[:, 0].double().repeat_interleave(2, 1)) * 8 ** -0.5
    want = torch.sigmoid(s00 - sinks.double()).unsqueeze(-1) * v[:, 0].double().repeat_interleave(2, 1)
    assert rel_err(got[:, 0], want) < 1e-14


LOCAL_CASES = [
    # name, dtype, causal, window, packed, softmax, heads
    ("dense-causal-gqa", F32, True, None, False, "learnable", (8, 2)),
    ("dense-full-mqa", F32, False, None, False, "learnable", (4, 1)),
    ("dense-causal-f64", F64, True, None, False, "learnable", (4, 4)),
    ("dense-off-by-one", F32, True, None, False, "off-by-one", (4, 2)),
    ("window", F32, True, (3, 0), False, "learnable", (4, 2)),
    ("window-band-f64", F64, False, (2, 5), False, "learnable", (4, 1)),
    ("packed", F32, True, None, True, "learnable", (4, 2)),
    ("packed-window-off-by-one", F64, True, (3, 0), True, "off-by-one", (4, 2)),
]


@pytest.mark.parametrize("case", LOCAL_CASES, ids=[c[0] for c in LOCAL_CASES])
def test_local_attention_with_sinks(case):
    from nemo_longctx.attention import local_attention

    name, dtype, causal, window, is_packed, softmax, (hq, hkv) = case
    gen = torch.Generator().manual_seed(zlib.crc32(name.encode()))
    cu = cup = None
    if is_packed:
        cu, cup = packed([5, 1, 9, 0, 4], 1, (0, 3, 0, 2))
    S = int(cup[-1]) if is_packed else 20
    b = 1 if is_packed else 2
    q, k, v, dout = (torch.randn(b, S, h, 16, generator=gen).to(dtype) for h in (hq, hkv, hkv, hq))
    sinks = (torch.rand(hq, generator=gen) * 5 - 1).to(dtype)  # float64 inputs: a float64 parameter
    learnable = softmax == "learnable"
    ref = reference_sinks_forward_backward(q, k, v, dout, sinks if learnable else torch.zeros(hq),
                                           allowed_mask(S, causal, window, cu, cup))
    leaves = [t.clone().requires_grad_() for t in (q, k, v)]
    sink_leaf = sinks.clone().requires_grad_() if learnable else None
    kw = dict(sinks=sink_leaf) if learnable else dict(softmax_type=softmax)
    out = local_attention(*leaves, causal, window_size=window, cu_seqlens=cu, cu_seqlens_padded=cup, **kw)
    out.backward(dout)
    tol = (THD_TOL if is_packed or window else TOL)[dtype]
    got = [out, *(t.grad for t in leaves)] + ([sink_leaf.grad] if learnable else [])
    for label, g, want in zip(("out", "dq", "dk", "dv", "dsinks"), got, ref):
        assert rel_err(g, want) <= tol, f"{name}: {label} rel err {rel_err(g, want):.2e} > {tol}"
    # without the sink (or with the fixed zero sink missing) the result is far off
    plain = local_attention(*(t.detach() for t in leaves), causal, window_size=window, cu_seqlens=cu,
                            cu_seqlens_padded=cup)
    assert rel_err(plain, ref[0]) > CONTROL_FACTOR * tol


def test_local_attention_without_sinks_is_unchanged():
    """softmax_type "vanilla" (explicit or default) is the plain path, bit for bit."""
    from nemo_longctx.attention import local_attention

    gen = torch.Generator().manual_seed(5)
    q, k, v = (torch.randn(1, 16, h, 8, generator=gen) for h in (4, 2, 2))
    assert torch.equal(local_attention(q, k, v), local_attention(q, k, v, softmax_type="vanilla", sinks=None))


def test_sinks_input_checks():
    from nemo_longctx.attention import local_attention

    q, kv = torch.randn(1, 8, 4, 16), torch.randn(1, 8, 2, 16)
    bad = [
        (dict(sinks=torch.zeros(3)), "shape [num_query_heads] = [4]"),
        (dict(sinks=torch.zeros(4, 1)), "got (4, 1)"),
        (dict(sinks=torch.zeros(4, dtype=torch.int64)), "floating-point"),
        (dict(sinks=[0.0] * 4), "torch.Tensor"),
        (dict(sinks=torch.zeros(4, device="meta")), "q's device"),
        (dict(sinks=torch.zeros(4), softmax_type="vanilla"), "only 'learnable' takes a sink tensor"),
        (dict(sinks=torch.zeros(4), softmax_type="off-by-one"), "fixed sink logit of 0"),
        (dict(softmax_type="learnable"), "needs sinks"),
        (dict(softmax_type="sink"), "must be one of"),
    ]
    for kw, text in bad:
        with pytest.raises(ValueError, match="ring_attention") as info:
            local_attention(q, kv, kv, **kw)
        assert text in str(info.value), (kw, str(info.value))
    # a low-precision sinks parameter is taken (the math runs in float32) and gets its gradient in its dtype
    s = torch.zeros(4, dtype=torch.bfloat16, requires_grad=True)
    local_attention(q, kv, kv, sinks=s).sum().backward()
    assert s.grad.dtype == torch.bfloat16 and s.grad.shape == (4,)
