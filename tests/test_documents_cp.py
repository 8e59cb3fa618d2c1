"""Document-aware CP (``cp.split_min_tokens``): short documents stay whole on one CP rank, long ones are split.

The placement alone (plain Python, ``planner.documents``): every real token placed exactly once, every rank's shard
of one length, kept documents shorter than the threshold, determinism, the all-split placement equal to
the per-document zigzag layout, Megatron's THD RoPE slicing giving every kept document contiguous positions, bad
inputs. The attention (``attention.documents``) on 2 and 4 gloo ranks against an fp64 per-document reference of the
whole packed sequence (``cp=none``), forward and backward, with documents kept and split in one batch: ring, Ulysses,
hybrid, a sliding window, MLA's head dims, GQA, attention sinks, RoPE applied by Megatron's own THD function with the
placement's layout, padding that carries garbage; a batch with every document kept sends nothing; with every document
split the result is bit-identical to the per-document zigzag path."""

from __future__ import annotations

import random
import zlib

import pytest
import torch

from distributed import run_distributed
from reference import rel_err, reference_sink_attention

from nemo_longctx.planner.documents import (
    AttentionCostModel, choose_split_min_tokens, place_documents, predict_gain, split_work, zigzag_padded)

TOL = {torch.float32: 3e-5, torch.float64: 1e-10}
THRESHOLD = 48


def mixed_lengths(seed: int = 0):
    """4 long documents (>= THRESHOLD: split) among 22 short ones (kept) and an empty one."""
    rng = random.Random(seed)
    short = [rng.randint(1, 40) for _ in range(22)] + [0]
    return short[:5] + [150] + short[5:11] + [61, 48] + short[11:17] + [97] + short[17:]


# ------------------------------------------------------------------------------------------ the placement alone
def _check_placement(pl, lengths, threshold):
    P = pl.cp_size
    seen = {}
    for r in range(P):
        docs, offs = pl.token_sources(r)
        assert len(docs) == len(offs) == pl.local_len
        for d, o in zip(docs, offs):
            if d >= 0:
                assert 0 <= o < lengths[d] and (d, o) not in seen
                seen[(d, o)] = r
        cu, cup = pl.kept_layout(r)
        assert cup[-1] == pl.local_len - pl.split_local and all(b >= a for a, b in zip(cu, cu[1:]))
        assert 2 * pl.half[r] <= pl.local_len - pl.split_local
        if pl.contiguous(r):
            assert r == P - 1 and sum(lengths[i] for h in pl.halves[r] for i in h) <= 2 * pl.half[r]
        else:
            for half in pl.halves[r]:
                assert sum(lengths[i] for i in half) <= pl.half[r]
    assert len(seen) == sum(lengths)  # every real token exactly once
    assert pl.local_len == pl.split_local + 2 * max(pl.half) and pl.local_len % 2 == 0
    for i, n in enumerate(lengths):
        if pl.owner[i] >= 0:
            assert threshold is not None and n < threshold and n > 0
            assert all(seen[(i, o)] == pl.owner[i] for o in range(n))  # a kept document is whole on its rank
        elif threshold is not None and 0 < n < threshold:
            pass  # did not fit: split (allowed)
    assert len(pl.costs) == P and pl.balance >= 1.0


def test_placement_invariants_random():
    rng = random.Random(45)
    for trial in range(300):
        P = rng.choice([2, 3, 4, 8])
        lengths = [rng.choice([0, rng.randint(1, 9), rng.randint(1, 60), rng.randint(50, 900)])
                   for _ in range(rng.randint(1, 40))]
        threshold = rng.choice([None, 1, 8, 64, 500, 10 ** 6])
        pl = place_documents(lengths, P, threshold)
        _check_placement(pl, lengths, threshold)
        assert place_documents(lengths, P, threshold) == pl  # deterministic


def test_mixed_batch_keeps_short_and_splits_long():
    lengths = mixed_lengths()
    for P in (2, 4):
        pl = place_documents(lengths, P, THRESHOLD)
        _check_placement(pl, lengths, THRESHOLD)
        assert [lengths[i] for i in pl.split] == [150, 61, 48, 97, 0]
        assert len(pl.kept) == 22 and all(len(pl.halves[r][0]) for r in range(P))  # every rank keeps documents
        assert pl.balance < 1.05
        # the last rank's documents lie back to back: one crosses the middle of its kept region (the RoPE test on
        # gloo checks its positions are contiguous)
        docs, _ = pl.token_sources(P - 1)
        mid = pl.split_local + pl.half[P - 1]
        assert docs[mid - 1] == docs[mid] >= 0


def test_all_split_is_the_zigzag_layout():
    from nemo_longctx.attention import thd_zigzag_indices

    lengths = mixed_lengths(1)
    for P in (2, 4):
        pl = place_documents(lengths, P, None)
        assert pl.kept == () and pl.half == (0,) * P
        cup = [0]
        for n in lengths:
            cup.append(cup[-1] + zigzag_padded(n, P))
        starts = cup[:-1]
        for r in range(P):
            docs, offs = pl.token_sources(r)
            want = thd_zigzag_indices(cup, P, r).tolist()
            assert [starts[d] + o for d, o in zip(docs, offs) if d >= 0] == [
                g for g in want if any(s <= g < s + n for s, n in zip(starts, lengths))]
            assert pl.rope_layout(r) == cup


def test_rank_costs_and_split_work():
    lengths = mixed_lengths()
    for P in (2, 4):
        for t in (None, THRESHOLD):
            pl = place_documents(lengths, P, t)
            total = sum(pl.costs)
            assert total == sum(n * (n + 1) // 2 for n in lengths)  # every causal pair counted once
        # the zigzag split of one document: the pairs over all ranks are its causal pairs
        for n in (1, 7, 2 * P, 33, 150):
            assert sum(split_work(n, zigzag_padded(n, P), P, r)[0] for r in range(P)) == n * (n + 1) // 2
            assert sum(split_work(n, zigzag_padded(n, P), P, r, causal=False)[0] for r in range(P)) == n * n


def test_auto_threshold_and_gain_prediction():
    lengths = mixed_lengths()
    # with a per-call cost the cost model keeps the short documents; without any it has no reason to
    cost = AttentionCostModel(call=400.0, send=4.0)
    auto = choose_split_min_tokens(lengths, 4, cost)
    assert auto.kept and auto.split_min_tokens is not None
    assert max(auto.costs) <= max(place_documents(lengths, 4, None, cost).costs)
    gain = predict_gain([lengths, mixed_lengths(2)], 4, "auto", cost)
    assert gain.speedup > 1.0 and gain.perfect_speedup >= gain.speedup
    flat = predict_gain([lengths], 4, None, cost)
    assert flat.speedup == 1.0


def test_bad_inputs():
    for bad, match in (((-1, 3), "document 0 has length -1"), ((2.5,), "lengths must be ints")):
        with pytest.raises(ValueError, match=match):
            place_documents(list(bad), 2, 4)
    with pytest.raises(ValueError, match="cp size must be a positive int"):
        place_documents([3], 0, 4)
    for bad in (0, -3, 2.5, True, "many"):
        with pytest.raises(ValueError, match=r"cp.split_min_tokens=.* must be a positive int, 'auto' or null"):
            place_documents([3], 2, bad)


# ------------------------------------------------------------------------------------------ the attention on gloo
def _cases(world):
    f32, f64 = torch.float32, torch.float64
    spec = [  # (algo, ulysses size, dtype, causal, (hq, hkv), d, dv, window, sinks, rope, threshold)
        ("ring", 1, f64, True, (4, 2), 16, 16, None, False, True, THRESHOLD),
        ("ring", 1, f32, True, (4, 4), 16, 16, None, False, False, THRESHOLD),
        ("ring", 1, f64, False, (2, 2), 8, 8, None, False, False, THRESHOLD),
        ("ring", 1, f64, True, (4, 2), 16, 16, (24, 0), False, False, THRESHOLD),  # sliding window
        ("ring", 1, f64, True, (4, 4), 24, 16, None, False, True, THRESHOLD),  # MLA: qk 24 (16 + 8 rope), v 16
        ("ring", 1, f64, True, (4, 2), 16, 16, None, True, False, THRESHOLD),  # attention sinks
        ("ulysses", world, f64, True, (4, 2), 16, 16, None, False, True, THRESHOLD),
        ("ulysses", world, f32, True, (world * 2, world), 16, 16, (16, 0), False, False, THRESHOLD),
        ("ulysses", world, f64, True, (4, 4), 24, 16, None, True, False, THRESHOLD),  # MLA dims + sinks
        ("hybrid", 2, f64, True, (4, 2), 16, 16, None, False, True, THRESHOLD),
        ("ring", 1, f64, True, (4, 2), 16, 16, None, False, True, 10 ** 6),  # short documents only: all kept
        ("ulysses", world, f64, True, (4, 2), 16, 16, None, False, False, 10 ** 6),
        ("ring", 1, f64, True, (4, 2), 16, 16, None, False, False, None),  # every document split (the zigzag path)
    ]
    out = []
    for algo, u, dtype, causal, (hq, hkv), d, dv, window, sinks, rope, t in spec:
        name = (f"{algo}-u{u}-{str(dtype)[6:]}-{'causal' if causal else 'full'}-h{hq}.{hkv}-d{d}.{dv}"
                f"{'-w' + str(window[0]) if window else ''}{'-sinks' if sinks else ''}{'-rope' if rope else ''}-t{t}")
        out.append(dict(name=name, algo=algo, ulysses=u, dtype=dtype, causal=causal, hq=hq, hkv=hkv, d=d, dv=dv,
                        window=window, sinks=sinks, rope=rope, threshold=t))
    return out


def _rotary(x, pos, rot):
    """Reference RoPE (written independently): the first ``rot`` dims of the last axis, non-interleaved halves,
    base 10000, at integer positions ``pos`` [S]; x [1, S, h, d]."""
    inv = 1.0 / (10000 ** (torch.arange(0, rot, 2, dtype=torch.float64) / rot))
    ang = pos.double()[:, None] * inv[None]
    cos, sin = torch.cat([ang.cos()] * 2, -1)[None, :, None], torch.cat([ang.sin()] * 2, -1)[None, :, None]
    r, rest = x[..., :rot], x[..., rot:]
    r1, r2 = r[..., : rot // 2], r[..., rot // 2:]
    return torch.cat([r * cos.to(x.dtype) + torch.cat([-r2, r1], -1) * sin.to(x.dtype), rest], -1)


def _megatron_rope(x, cu_padded, rot, group):
    """Megatron's own THD RoPE (rope_utils._apply_rotary_pos_emb_thd) on a rank's [1, s, h, d] shard, frequencies of
    positions 0..max-1 as GPTModel's RotaryEmbedding makes them (rotary_base 10000, non-interleaved)."""
    from megatron.core.models.common.embeddings.rope_utils import _apply_rotary_pos_emb_thd

    longest = max(b - a for a, b in zip(cu_padded, cu_padded[1:]))
    inv = 1.0 / (10000 ** (torch.arange(0, rot, 2, dtype=torch.float64) / rot))
    freqs = torch.outer(torch.arange(longest, dtype=torch.float64), inv)
    emb = torch.cat([freqs, freqs], -1)[:, None, None, :].to(x.dtype)
    cu = torch.tensor(cu_padded, dtype=torch.int32)
    rotated = _apply_rotary_pos_emb_thd(x[0, :, :, :rot], cu, emb, cp_group=group)
    return torch.cat([rotated, x[0, :, :, rot:]], -1)[None]


def _allowed(lengths, causal, window):
    """[T, T] bool: the (query, key) pairs of the packed sequence (same document, causal, within the window)."""
    T = sum(lengths)
    doc = torch.repeat_interleave(torch.arange(len(lengths)), torch.tensor(lengths))
    pos = torch.cat([torch.arange(n) for n in lengths]) if T else torch.zeros(0, dtype=torch.long)
    ok = doc[:, None] == doc[None, :]
    diff = pos[:, None] - pos[None, :]  # query - key
    if causal:
        ok &= diff >= 0
    if window is not None:
        left, right = window
        ok &= diff <= left
        if right >= 0:
            ok &= -diff <= right
    return ok, pos


def _split_fn(case, world):
    import torch.distributed as dist

    from nemo_longctx.attention import hybrid_attention, make_cp_groups, ring_attention, ulysses_attention

    kw = dict(causal=case["causal"], softmax_scale=0.3, window_size=case["window"])
    group = dist.group.WORLD
    if case["algo"] == "ring":
        return lambda q, k, v, sinks, **thd: ring_attention(q, k, v, group, sinks=sinks, **kw, **thd)
    if case["algo"] == "ulysses":
        return lambda q, k, v, sinks, **thd: ulysses_attention(q, k, v, group, sinks=sinks, **kw, **thd)
    ug, rg = make_cp_groups(group, case["ulysses"])
    return lambda q, k, v, sinks, **thd: hybrid_attention(q, k, v, ug, rg, sinks=sinks, **kw, **thd)


def _attention_worker(rank, world, cases):
    import torch.distributed as dist

    from nemo_longctx.attention import count_bytes_sent, ring_attention
    from nemo_longctx.attention.documents import DocumentShard, document_attention

    results = []
    for case in cases:
        lengths = mixed_lengths()
        if case["threshold"] == 10 ** 6:
            lengths = [n for n in lengths if n < THRESHOLD]
        T = sum(lengths)
        starts = [sum(lengths[:i]) for i in range(len(lengths))]
        pl = place_documents(lengths, world, case["threshold"])
        cu, cup = pl.split_layout()
        kcu, kcup = pl.kept_layout(rank)
        shard = DocumentShard(pl.split_local, cu, cup, kcu, kcup)
        gen = torch.Generator().manual_seed(zlib.crc32(case["name"].encode()))
        dtype, hq, hkv, d, dv = case["dtype"], case["hq"], case["hkv"], case["d"], case["dv"]
        q, k, v, dout = (torch.randn(1, T, h, e, generator=gen, dtype=torch.float64)
                         for h, e in ((hq, d), (hkv, d), (hkv, dv), (hq, dv)))
        sinks = torch.randn(hq, generator=gen, dtype=torch.float64) if case["sinks"] else None
        rot = 8 if d == 24 else d  # MLA-like: RoPE on 8 of the 24 query/key dims; otherwise on every dim
        allowed, pos = _allowed(lengths, case["causal"], case["window"])
        # fp64 reference: the whole packed sequence on one rank (cp=none), RoPE at each document's own positions
        leaves = [t.clone().requires_grad_() for t in (q, k, v)] + ([sinks.clone().requires_grad_()] if
                                                                       sinks is not None else [])
        rq, rk = (_rotary(t, pos, rot) for t in leaves[:2]) if case["rope"] else leaves[:2]
        ref = reference_sink_attention(rq, rk, leaves[2], leaves[3] if sinks is not None else None, allowed, 0.3)
        ref.backward(dout)
        ref_grads = [t.grad for t in leaves]
        # this rank's shard: real tokens from the placement, garbage in every padding position
        docs, offs = pl.token_sources(rank)
        src = torch.tensor([starts[i] + o if i >= 0 else 0 for i, o in zip(docs, offs)])
        real = torch.tensor([i >= 0 for i in docs])
        local = []
        for t in (q, k, v, dout):
            x = t[:, src].clone()
            x[:, ~real] = 1e3 * torch.randn(x[:, ~real].shape, generator=gen, dtype=torch.float64)
            local.append(x.to(dtype))
        lq, lk, lv = (x.detach().clone().requires_grad_() for x in local[:3])
        ls = sinks.to(dtype).clone().requires_grad_() if sinks is not None else None
        split_fn = _split_fn(case, world)
        with count_bytes_sent() as sent:
            aq, ak = ((_megatron_rope(lq, pl.rope_layout(rank), rot, dist.group.WORLD),
                       _megatron_rope(lk, pl.rope_layout(rank), rot, dist.group.WORLD)) if case["rope"] else (lq, lk))
            out = document_attention(aq, ak, lv, shard, lambda a, b, c, **thd: split_fn(a, b, c, ls, **thd),
                                     causal=case["causal"], softmax_scale=0.3, window_size=case["window"], sinks=ls)
            out.backward(local[3])
        got = [out.detach(), lq.grad, lk.grad, lv.grad]
        want = [ref.detach()] + ref_grads[:3]
        res = dict(case=case, bytes=sent.bytes_sent, kept=len(pl.kept), split=len(pl.split),
                   errs=[rel_err(g[:, real], w[:, src[real]]) for g, w in zip(got, want)],
                   pad_zero=all(bool((g[:, ~real] == 0).all()) for g in got),
                   dsinks=ls.grad.double().tolist() if ls is not None else None,  # (plain lists: no tensor
                   ref_dsinks=ref_grads[3].tolist() if sinks is not None else None)  # crosses the queue)
        if case["threshold"] is None:  # every document split: bit-identical to the per-document zigzag path
            zq, zk, zv = (x.detach().clone().requires_grad_() for x in local[:3])
            zout = ring_attention(zq, zk, zv, dist.group.WORLD, True, 0.3,
                                  cu_seqlens=torch.tensor(cu, dtype=torch.int32),
                                  cu_seqlens_padded=torch.tensor(cup, dtype=torch.int32))
            zout.backward(local[3])
            res["zigzag_identical"] = (torch.equal(zout, out) and torch.equal(zq.grad, lq.grad)
                                       and torch.equal(zk.grad, lk.grad) and torch.equal(zv.grad, lv.grad))
        results.append(res)
    return results


@pytest.fixture(scope="module", params=[2, 4])
def attention_results(request):
    world = request.param
    return world, run_distributed(_attention_worker, world, _cases(world), timeout=500)


def test_document_attention_matches_fp64_reference(attention_results):
    world, per_rank = attention_results
    n = 0
    for rank_results in per_rank:
        for r in rank_results:
            case = r["case"]
            tol = TOL[case["dtype"]]
            for name, err in zip(("out", "dq", "dk", "dv"), r["errs"]):
                assert err <= tol, f"P={world} {case['name']}: {name} rel err {err:.2e} > {tol}"
            assert r["pad_zero"], case["name"]  # padding rows: output and gradients exactly 0
            n += 1
    assert n == world * len(_cases(world))
    # sinks: the sum of the ranks' partial gradients is the reference's
    for i, case in enumerate(_cases(world)):
        if case["sinks"]:
            f64 = torch.float64
            total = sum(torch.tensor(rank_results[i]["dsinks"], dtype=f64) for rank_results in per_rank)
            want = torch.tensor(per_rank[0][i]["ref_dsinks"], dtype=f64)
            assert rel_err(total, want) <= TOL[case["dtype"]], case["name"]


def test_document_attention_communication(attention_results):
    world, per_rank = attention_results
    cases = _cases(world)
    sent = {c["name"]: sum(rr[i]["bytes"] for rr in per_rank) for i, c in enumerate(cases)}
    for i, case in enumerate(cases):
        r0 = per_rank[0][i]
        if case["threshold"] == THRESHOLD:
            assert r0["kept"] == 22 and r0["split"] == 5 and sent[case["name"]] > 0  # both kinds in one batch
        if case["threshold"] == 10 ** 6:
            assert r0["kept"] == 22 and r0["split"] == 1  # (the empty document counts as split: it has no tokens)
            assert sent[case["name"]] == 0, case["name"]  # every document kept: nothing moves
    # keeping the short documents moves fewer bytes than splitting every document (same dtype and heads)
    split_all = next(c["name"] for c in cases if c["threshold"] is None)
    kept_some = next(c["name"] for c in cases if c["algo"] == "ring" and c["threshold"] == THRESHOLD
                     and c["dtype"] == torch.float64 and c["hkv"] == 2 and not c["window"] and not c["sinks"])
    assert 0 < sent[kept_some] < sent[split_all]
    assert all(rr[-1]["zigzag_identical"] for rr in per_rank)


def test_document_attention_bad_inputs():
    from nemo_longctx.attention.documents import DocumentShard, document_attention

    shard = DocumentShard(0, [0], [0], [0, 3, 6], [0, 4, 8])
    x = torch.randn(1, 8, 2, 4)
    with pytest.raises(ValueError, match="holds 0 split \\+ 8 kept positions but q/k/v have 6/6/6"):
        document_attention(x[:, :6], x[:, :6], x[:, :6], shard, None)
    with pytest.raises(ValueError, match=r"need \[1, s_local, heads, head_dim\]"):
        document_attention(torch.randn(2, 8, 2, 4), x, x, shard, None)
    with pytest.raises(ValueError, match="real <= padded"):
        document_attention(x, x, x, DocumentShard(0, [0], [0], [0, 5, 6], [0, 4, 8]), None)


def test_option_values_and_problems():
    from nemo_longctx.options import Context, LongContextOptions

    def problems(d, ctx=None):
        return LongContextOptions.from_dict(d).problems(ctx)

    for ok in (2048, "auto", "off", False):  # (YAML reads a bare off as false)
        assert problems({"cp": {"size": 2, "split_min_tokens": ok}}) == []
    for bad in (0, -1, 2.5, True, "many", None):
        (msg,) = problems({"cp": {"size": 2, "split_min_tokens": bad}})
        assert msg.startswith("cp.split_min_tokens") and "'off'" in msg and "'auto'" in msg, msg
    cases = {
        "needs context parallelism": ({"cp": {"size": 1, "split_min_tokens": 64}}, None),
        "dense sequences": ({"cp": {"size": 2, "split_min_tokens": 64}}, Context(packed_data=False)),
        "recompute.sequence_chunks=2": ({"cp": {"size": 2, "split_min_tokens": 64},
                                         "recompute": {"name": "full", "sequence_chunks": 2}}, None),
        "recompute=full_keep_attn": ({"cp": {"size": 2, "split_min_tokens": "auto"},
                                      "recompute": {"name": "full_keep_attn"}}, None),
        "not available on this front end": ({"cp": {"size": 2, "split_min_tokens": 64}},
                                            Context(document_placement=False)),
    }
    for what, (d, ctx) in cases.items():
        (msg,) = problems(d, ctx)
        assert what in msg and msg.startswith("cp.split_min_tokens="), (what, msg)
    assert problems({"cp": {"size": 2, "split_min_tokens": 64}}, Context(packed_data=True)) == []
    options = LongContextOptions.from_dict({"cp": {"size": 4, "split_min_tokens": 512}})
    assert "cp.split_min_tokens=512" in options.to_overrides()
    assert "kept whole" in options.describe()["cp"]
    assert not any("split_min" in o for o in LongContextOptions.from_dict({"cp": {"size": 4}}).to_overrides())


def test_planner_predicts_the_gain_and_adds_the_option(tmp_path):
    """``nemo-longctx plan ... plan.document_lengths=FILE``: the chosen CP plan's predicted gain from keeping short
    documents whole, and ``cp.split_min_tokens=auto`` in the command when it pays (the train app's and, with
    ``plan.frontend=bridge``, the Bridge app's); a bad file is refused naming the key."""
    import io
    import json

    from hydra import compose, initialize_config_dir

    from nemo_longctx.apps.plan import conf_dir, run
    from nemo_longctx.shared.run_spec import read_plan_spec

    rng = random.Random(7)
    lengths = [int(min(131072, 1024 / (1 - rng.random()) ** (1 / 1.3))) for _ in range(1200)]
    (tmp_path / "lengths.json").write_text(json.dumps(lengths))
    (tmp_path / "bad.txt").write_text("100\nabc\n")
    outputs = {}
    with initialize_config_dir(config_dir=conf_dir(), version_base=None):
        for name in ("nemo", "bridge", "bad"):
            path = tmp_path / ("bad.txt" if name == "bad" else "lengths.json")
            cfg = compose("plan", overrides=["model=llama3_8b", "plan.seq_length=131072", "plan.gpus=16",
                                              "plan.json=true", f"plan.document_lengths={path}"]
                          + (["plan.frontend=bridge"] if name == "bridge" else []))
            buf = io.StringIO()
            try:
                outputs[name] = (run(read_plan_spec(cfg, model_name="llama3_8b"), out=buf), json.loads(buf.getvalue()))
            except ValueError as e:
                outputs[name] = (2, str(e))
    rc, d = outputs["nemo"]
    assert rc == 0 and d["documents"]["cp_size"] > 1 and d["documents"]["speedup"] > 1.01, d["documents"]
    assert d["documents"]["perfect_speedup"] >= d["documents"]["speedup"]
    assert d["overrides"][-1] == "cp.split_min_tokens=auto" and d["documents"]["add"]
    rc, d = outputs["bridge"]
    assert rc == 0 and d["documents"]["add"] and d["overrides"][-1] == "cp.split_min_tokens=auto", d
    rc, msg = outputs["bad"]
    assert rc == 2 and "plan.document_lengths" in msg and "bad.txt:2: 'abc' is not a document length" in msg


def test_data_parallel_schedule_balances_each_global_batch():
    """``schedule_global_batch`` / ``data_balance.CostBalancedBatches``: a permutation within each global batch (the
    same samples make each optimizer step), every data-parallel rank's attention work within the stated bound (mean
    + the costliest sample), more even than the sampler's own order on long-tail rows, deterministic."""
    from nemo_longctx.planner.documents import pack_documents, schedule_global_batch, sequence_cost

    rng = random.Random(3)
    lengths = [int(min(4096, 64 / (1 - rng.random()) ** (1 / 1.1))) for _ in range(3000)]
    seqs = pack_documents(lengths, 4096)
    G, dp = 16, 4
    worse = 0
    for g in range(len(seqs) // G):
        costs = [sequence_cost(s) for s in seqs[g * G:(g + 1) * G]]
        order = schedule_global_batch(costs, dp)
        assert sorted(order) == list(range(G)) and order == schedule_global_batch(costs, dp)
        per_rank = [sum(costs[order[s]] for s in range(d, G, dp)) for d in range(dp)]
        mean = sum(costs) / dp
        assert max(per_rank) <= mean + max(costs)
        before = [sum(costs[s] for s in range(d, G, dp)) for d in range(dp)]
        worse += max(per_rank) > max(before)
    assert worse == 0 and len(seqs) // G >= 4
    with pytest.raises(ValueError, match="do not split over 3"):
        schedule_global_batch([1.0] * 4, 3)

    torch_data = pytest.importorskip("torch.utils.data")

    class Rows(torch_data.Dataset):  # PerDocumentPacking's format: cu_seqlens (-1 filled) + its argmin
        def __len__(self):
            return len(seqs)

        def __getitem__(self, i):
            cu = [0]
            for n in seqs[i]:
                cu.append(cu[-1] + n)
            return {"id": i, "cu_seqlens": torch.tensor(cu + [-1] * 3, dtype=torch.int32),
                    "cu_seqlens_argmin": torch.tensor([len(cu)])}

    from nemo_longctx.integrations.megatron.data_balance import CostBalancedBatches

    balanced = CostBalancedBatches(Rows(), G, dp)
    ids = [balanced[i]["id"] for i in range(len(seqs))]
    for g in range(len(seqs) // G):
        assert sorted(ids[g * G:(g + 1) * G]) == list(range(g * G, (g + 1) * G))
    assert ids != list(range(len(seqs)))


def test_step_balance_is_a_collective_only_where_the_data_are_packed(tmp_path, monkeypatch):
    """The metrics callback reduces the step's document costs over the data-parallel ranks (a collective every step)
    only when it is told the data are packed documents; a dense run's ranks skip it (nothing to compare)."""
    from nemo_longctx.integrations.nemo import callbacks

    calls = []
    monkeypatch.setattr(callbacks, "step_balance_over_ranks", lambda: calls.append(1) or 1.25)
    for packed, expected in ((False, []), (True, [1])):
        calls.clear()
        metrics = callbacks.StepMetrics(str(tmp_path), tokens_per_step=8, balance=packed)
        metrics.on_train_batch_end(None, None, None, None, 0)  # not the metrics rank: returns after the collective
        assert calls == expected, (packed, calls)
