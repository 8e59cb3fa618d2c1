"""``moe.group_sinkhorn`` (Sinkhorn over the rows of every rank of a group) equals Megatron's own
``moe_utils.sinkhorn`` of the whole matrix, row for row, on 4 gloo ranks (one spawn: each process imports Megatron);
fp64 and fp32; even and uneven row splits (the row count is all-reduced). The end-to-end check (a Mixtral with
Sinkhorn routing under ring / Ulysses / hybrid CP = cp=none) is ``tests/test_moe_cp.py``."""

from __future__ import annotations

import torch

from distributed import run_distributed

WORLD = 4
CASES = [  # (rows per rank, experts, dtype, logit scale)
    ([32, 32, 32, 32], 8, torch.float64, 1.0),
    ([32, 32, 32, 32], 8, torch.float32, 3.0),
    ([50, 78, 10, 5], 4, torch.float64, 2.0),
    ([16, 16, 16, 16], 16, torch.float64, 1.0),
    ([7, 33, 20, 4], 6, torch.float32, 1.0),
]


def _job(rank, world):
    from megatron.core.transformer.moe.moe_utils import sinkhorn

    from nemo_longctx.integrations.megatron.moe import group_sinkhorn

    import torch.distributed as dist

    out = []
    for i, (rows, experts, dtype, scale) in enumerate(CASES):
        g = torch.Generator().manual_seed(i)
        full = torch.randn(sum(rows), experts, generator=g, dtype=torch.float64).to(dtype) * scale
        start = sum(rows[:rank])
        mine = full[start:start + rows[rank]]
        ours = group_sinkhorn(mine.clone(), dist.group.WORLD)
        ref = sinkhorn(full.clone())[start:start + rows[rank]]
        err = ((ours - ref).abs().max() / ref.abs().max()).item()
        local = sinkhorn(mine.clone())  # Megatron's per-rank Sinkhorn: the control
        control = ((local - ref).abs().max() / ref.abs().max()).item()
        same_top = bool((ours.topk(2, dim=1).indices == ref.topk(2, dim=1).indices).all())
        out.append((i, str(dtype), err, control, same_top))
    return out


def test_group_sinkhorn_is_megatrons_sinkhorn_of_the_whole_matrix():
    rows = [r for rank in run_distributed(_job, WORLD) for r in rank]
    assert len(rows) == WORLD * len(CASES)
    for i, dtype, err, control, same_top in rows:
        tol = 1e-12 if dtype == "torch.float64" else 2e-6
        assert err <= tol and same_top, (i, dtype, err)
        assert control > 1e-3, (i, dtype, control)  # per-rank balancing really is different
