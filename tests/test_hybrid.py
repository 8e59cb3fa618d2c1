"""Hybrid Ulysses x ring attention vs the fp64 reference (2x2, 1x4, 4x1 on 4 ranks; 1x2, 2x1 on 2 ranks),
forward and backward, and the process groups make_cp_groups builds."""

from __future__ import annotations

import itertools

import pytest
import torch

from distributed import run_distributed
from test_ulysses import HEADS, check_results, make_case, run_cases, valid_chunks


def hybrid_cases(world_size):
    cases = []
    i = 0
    for ulysses in [u for u in (1, 2, 4) if world_size % u == 0]:
        heads = HEADS[max(ulysses, 2)]
        for (label, (hq, hkv)), causal in itertools.product(heads.items(), (True, False)):
            dtype = torch.bfloat16 if i % 4 == 3 else torch.float32
            for chunks in (1, 2, 4):
                if valid_chunks(hq, hkv, ulysses, chunks) and (chunks == 1 or (i + chunks) % 3 != 0):
                    case = make_case(world_size, label, hq, hkv, causal, dtype, chunks, ulysses, i,
                                     regather=(i + chunks) % 2 == 1)
                    case["force_hybrid"] = True
                    cases.append(case)
            i += 1
    return cases


@pytest.mark.parametrize("world_size", [2, 4])
def test_hybrid_matches_fp64_reference(world_size):
    cases = hybrid_cases(world_size)
    layouts = {(c["ulysses"], world_size // c["ulysses"]) for c in cases}
    assert layouts == ({(1, 2), (2, 1)} if world_size == 2 else {(1, 4), (2, 2), (4, 1)})
    assert {c["regather"] for c in cases} == {True, False}
    assert {c["chunks"] for c in cases} == {1, 2, 4} and {c["dtype"] for c in cases} == {torch.float32, torch.bfloat16}
    per_rank = run_distributed(run_cases, world_size, cases)
    check_results(per_rank, world_size, len(cases))


def _groups_worker(rank, world_size):
    import torch.distributed as dist

    from nemo_longctx.attention import make_cp_groups

    world = dist.group.WORLD
    layout = {}
    for u in (1, 2, 4):
        ug, rg = make_cp_groups(world, u)
        layout[u] = (dist.get_process_group_ranks(ug), dist.get_process_group_ranks(rg))
        again = make_cp_groups(world, u)
        assert again[0] is ug and again[1] is rg  # cached, no second set of communicators
    # two CP groups of 2 (as with data parallel 2 x CP 2): every rank knows only its own CP group
    cp_groups = [dist.new_group([0, 1]), dist.new_group([2, 3])]
    mine = cp_groups[rank // 2]
    ug, rg = make_cp_groups(mine, 2)
    sub = (dist.get_process_group_ranks(ug), dist.get_process_group_ranks(rg))
    x = torch.tensor([float(rank)])
    dist.all_reduce(x, group=ug)
    errors = []
    for bad in (3, 0, 8):
        try:
            make_cp_groups(world, bad)
        except ValueError as e:
            errors.append(str(e))
    return (layout, sub, x.item(), errors), _bad_hybrid_inputs(rank, world_size)


@pytest.fixture(scope="module")
def four_rank_groups():
    """One 4-rank spawn for the group-layout and bad-input tests."""
    return run_distributed(_groups_worker, 4)


def test_make_cp_groups_layout(four_rank_groups):
    for rank, ((layout, sub, reduced, errors), _) in enumerate(four_rank_groups):
        assert layout[1] == ([rank], [0, 1, 2, 3])
        assert layout[2] == ([2 * (rank // 2), 2 * (rank // 2) + 1], [rank % 2, rank % 2 + 2])
        assert layout[4] == ([0, 1, 2, 3], [rank])
        assert sub == ([2 * (rank // 2), 2 * (rank // 2) + 1], [rank])
        assert reduced == 4 * (rank // 2) + 1
        assert len(errors) == 3 and all("positive divisor of the CP group size 4" in e for e in errors)


def _bad_hybrid_inputs(rank, world_size):
    import torch.distributed as dist

    from nemo_longctx.attention import count_bytes_sent, hybrid_attention, make_cp_groups

    ug, rg = make_cp_groups(dist.group.WORLD, 2)
    msgs = {}
    with count_bytes_sent() as sent:
        for name, (hq, hkv, s, kw) in {"hq_split": (3, 1, 8, {}), "odd": (4, 2, 3, {}),
                                       "chunks": (4, 2, 8, {"head_chunks": 4}),
                                       "layout": (4, 2, 8, {"global_seq_len": 8 * 2})}.items():
            q, k, v = (torch.randn(1, s, h, 16) for h in (hq, hkv, hkv))
            try:
                hybrid_attention(q, k, v, ug, rg, **kw)
            except ValueError as e:
                msgs[name] = str(e)
            else:
                msgs[name] = None
    dist.barrier()
    return msgs, sent.bytes_sent


def test_hybrid_bad_inputs_raise_before_communicating(four_rank_groups):
    msgs, sent = four_rank_groups[0][1]
    assert sent == 0
    assert "hq % ulysses_size != 0" in msgs["hq_split"]
    assert "even" in msgs["odd"]
    assert "head_chunks=4 must divide" in msgs["chunks"]
    assert "group size 4 does not match the layout" in msgs["layout"]
