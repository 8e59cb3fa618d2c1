"""Chunked output layer + cross entropy vs full logits + F.cross_entropy in fp64: per-token loss, grad of hidden and
of the output weight; ragged chunks, loss masks, ignore_index, bf16; vocab-parallel TP=2 over gloo; CP=2 zigzag
shards (labels shifted before sharding); bad settings; a live-bytes bound (no full logits)."""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F
from distributed import run_distributed
from reference import rel_err
from test_tiling_mlp import LiveBytes
from torch.utils._python_dispatch import TorchDispatchMode

from nemo_longctx.attention.layouts import zigzag_shard, zigzag_unshard
from nemo_longctx.memory.tiling import chunked_output_cross_entropy, shift_labels

aten = torch.ops.aten


def make_case(seed: int, s: int, b: int, h: int, vocab: int, dtype=torch.float32, masked=True):
    """hidden [s, b, h], weight [vocab, h], labels [b, s] (with vocab-shard edge ids and ignore_index), mask [b, s],
    upstream grad [b, s]; the same on every process for a given seed."""
    g = torch.Generator().manual_seed(seed)
    hidden = torch.randn(s, b, h, generator=g).to(dtype)
    weight = (torch.randn(vocab, h, generator=g) / h**0.5).to(dtype)
    labels = torch.randint(0, vocab, (b, s), generator=g)
    edges = torch.tensor([0, vocab // 2 - 1, vocab // 2, vocab - 1])
    labels.view(-1)[: min(4, b * s)] = edges[: min(4, b * s)]
    if b * s > 6:
        labels.view(-1)[5] = -100
    mask = (torch.rand(b, s, generator=g) > 0.2).float() if masked else torch.ones(b, s)
    grad = torch.randn(b, s, generator=g)
    return hidden, weight, labels, mask, grad


def reference(hidden, weight, labels, mask, grad):
    """fp64 (loss [b, s], grad_hidden, grad_weight) from full logits and F.cross_entropy."""
    h = hidden.detach().double().requires_grad_()
    w = weight.detach().double().requires_grad_()
    logits = torch.einsum("sbh,vh->bvs", h, w)
    loss = F.cross_entropy(logits, labels, reduction="none", ignore_index=-100) * mask.double()
    gh, gw = torch.autograd.grad(loss, [h, w], grad.double())
    return loss.detach(), gh, gw


def run_chunked(hidden, weight, labels, mask, grad, chunks, **kw):
    h = hidden.detach().requires_grad_()
    w = weight.detach().requires_grad_()
    loss = chunked_output_cross_entropy(h, w, labels, chunks, loss_mask=mask, **kw)
    gh, gw = torch.autograd.grad(loss, [h, w], grad.to(loss.dtype))
    return loss.detach(), gh, gw


@pytest.mark.parametrize("precompute", [True, False])
@pytest.mark.parametrize(
    "s,b,h,vocab,chunks,kw",
    [
        (37, 2, 16, 64, 5, {}),  # ragged chunks 8,8,7,7,7
        (40, 1, 8, 50, 40, {}),  # one token per chunk
        (33, 3, 16, 96, "auto", {"chunk_tokens": 10}),  # ceil(33/10) = 4
        (16, 2, 8, 32, "off", {}),  # one chunk
    ],
)
def test_chunked_loss_fp32_matches_fp64_full_logits(s, b, h, vocab, chunks, kw, precompute):
    """Per-token upstream gradients (different on every token): with precompute the weight grad is recomputed."""
    kw = dict(kw, precompute_grads=precompute)
    case = make_case(s + vocab, s, b, h, vocab)
    want = reference(*case)
    got = run_chunked(*case, chunks, **kw)
    assert got[0].dtype == torch.float32 and got[0].shape == (b, s)
    for g, w in zip(got, want):
        assert rel_err(g, w) <= 1e-6, rel_err(g, w)
    assert (got[0][case[3] == 0] == 0).all() and got[0].view(-1)[5] == 0  # masked and ignored tokens


@pytest.mark.parametrize("precompute", [True, False])
def test_chunked_loss_bf16(precompute):
    case = make_case(7, 64, 2, 32, 128, torch.bfloat16)
    want = reference(*case)
    got = run_chunked(*case, 8, precompute_grads=precompute)
    assert got[0].dtype == torch.float32 and got[1].dtype == got[2].dtype == torch.bfloat16
    for g, w in zip(got, want):
        assert rel_err(g, w) <= 1e-2, rel_err(g, w)


class MatmulCounter(TorchDispatchMode):
    def __init__(self):
        super().__init__()
        self.matmuls = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.matmuls += func.overloadpacket in (aten.mm, aten.addmm, aten.addmm_, aten.bmm)
        return func(*args, **(kwargs or {}))


@pytest.mark.parametrize("dtype,tol", [(torch.float32, 1e-6), (torch.bfloat16, 1e-2)])
@pytest.mark.parametrize("precompute", [True, False])
def test_masked_mean_loss_fast_path_without_recompute(dtype, tol, precompute):
    """The usual reduction sum(loss * mask) / sum(mask): with precomputed grads backward runs no matmul."""
    hidden, weight, labels, mask, _ = make_case(8, 45, 2, 16, 64, dtype)
    h, w = hidden.clone().requires_grad_(), weight.clone().requires_grad_()
    loss = chunked_output_cross_entropy(h, w, labels, 6, loss_mask=mask, precompute_grads=precompute)
    loss = loss.sum() / mask.sum()
    with MatmulCounter() as counter:
        loss.backward()
    assert counter.matmuls == (0 if precompute else 3 * 6)
    hd, wd = hidden.double().requires_grad_(), weight.double().requires_grad_()
    ce = F.cross_entropy(torch.einsum("sbh,vh->bvs", hd, wd), labels, reduction="none", ignore_index=-100)
    want_loss = (ce * mask.double()).sum() / mask.sum()
    want_loss.backward()
    assert rel_err(loss, want_loss) <= tol and rel_err(h.grad, hd.grad) <= tol and rel_err(w.grad, wd.grad) <= tol


def test_precomputed_grads_fall_back_to_recompute_for_unequal_token_grads():
    """Mask NOT passed in: masked tokens get upstream grad 0, others 1/N -> weight grad must be recomputed."""
    hidden, weight, labels, mask, _ = make_case(12, 30, 1, 16, 64)
    h, w = hidden.clone().requires_grad_(), weight.clone().requires_grad_()
    loss = (chunked_output_cross_entropy(h, w, labels, 4) * mask).sum() / mask.sum()
    with MatmulCounter() as counter:
        loss.backward()
    assert counter.matmuls == 2 * 4  # logits + grad_weight per chunk, no grad_hidden matmul
    _, want_gh, want_gw = reference(hidden, weight, labels, mask, mask / mask.sum())
    assert rel_err(h.grad, want_gh) <= 1e-6 and rel_err(w.grad, want_gw) <= 1e-6


def test_cp2_zigzag_shards_sum_to_full_sequence_loss():
    """Labels shifted on the full sequence, then zigzag-sharded with the tokens: per-rank chunked losses (chunks
    that straddle the two zigzag halves) sum to the full-sequence loss; grads unshard to the full grads."""
    torch.manual_seed(9)
    b, s, h, vocab, cp = 2, 48, 16, 64, 2
    tokens = torch.randint(0, vocab, (b, s))
    token_mask = (torch.rand(b, s) > 0.1).float()
    labels, mask = shift_labels(tokens, token_mask)
    assert torch.equal(labels[:, :-1], tokens[:, 1:]) and (labels[:, -1] == -100).all()
    assert torch.equal(mask[:, :-1], token_mask[:, 1:]) and (mask[:, -1] == 0).all()
    hidden, weight, *_ = make_case(10, s, b, h, vocab)
    grad = torch.ones(b, s)  # the loss is summed over all tokens of all ranks
    want_loss, want_gh, want_gw = reference(hidden, weight, labels, mask, grad)
    losses, ghs, gw_sum = [], [], torch.zeros_like(weight)
    for r in range(cp):
        shard = lambda t, d: zigzag_shard(t, d, cp, r)  # noqa: E731
        loss, gh, gw = run_chunked(shard(hidden, 0), weight, shard(labels, 1), shard(mask, 1), shard(grad, 1), 5)
        losses.append(loss)
        ghs.append(gh)
        gw_sum += gw
    total = sum(l.sum(dtype=torch.float64) for l in losses)
    assert rel_err(total, want_loss.sum()) <= 1e-6
    assert rel_err(zigzag_unshard(losses, dim=1), want_loss) <= 1e-6
    assert rel_err(zigzag_unshard(ghs, dim=0), want_gh) <= 1e-6
    assert rel_err(gw_sum, want_gw) <= 1e-6
    # The failure class this guards against: shifting labels after sharding pairs each chunk's last token
    # with the wrong target.
    naive = 0.0
    for r in range(cp):
        local_labels, local_mask = shift_labels(zigzag_shard(tokens, 1, cp, r), zigzag_shard(token_mask, 1, cp, r))
        naive += run_chunked(zigzag_shard(hidden, 0, cp, r), weight, local_labels, local_mask, grad[:, : s // cp], 5)[
            0
        ].sum()
    assert abs(naive - want_loss.sum()) > 1e-3


def test_chunked_loss_peak_live_bytes_is_a_fraction_of_full_logits():
    """16 chunks: one chunk's fp32 logits are 1/16 of the full ones; the rest is grad_weight, grad_hidden, loss."""
    s, b, h, vocab, chunks = 1024, 1, 16, 2048, 16
    hidden, weight, labels, mask, grad = make_case(11, s, b, h, vocab)
    full_logits = s * b * vocab * 4
    with LiveBytes() as full:
        run = reference(hidden.float(), weight, labels, mask, grad)  # fp64 path: >= 2 x [s, vocab] fp64
        del run
    with LiveBytes() as chunked:
        run = run_chunked(hidden, weight, labels, mask, grad, chunks)
        del run
    assert full.peak >= 2 * full_logits  # the counter sees full logits when they exist
    assert chunked.peak <= full_logits / 8, (chunked.peak, full_logits)


@pytest.mark.parametrize("precompute", [True, False])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_tracker_counts_every_byte_the_chunked_loss_keeps(precompute, dtype):
    """Saved-for-backward bytes the tracker reports are exactly what the chunked loss keeps until backward: hidden,
    labels (int64), loss mask, the fp32 log-sum-exp and, with precomputed gradients, grad_hidden (hidden's dtype)
    and the fp32 grad_weight [v, h] held on ctx (issue 13: these used to be invisible)."""
    from nemo_longctx.memory.tracker import ActivationTracker

    s, b, h, vocab = 96, 2, 16, 320
    hidden, weight, labels, mask, grad = make_case(5, s, b, h, vocab, dtype=dtype)
    weight.requires_grad_()
    leaf = hidden.clone().requires_grad_()
    with ActivationTracker("cpu", params=[weight], count_peak=False) as tr:
        x = leaf * 1  # an activation (a leaf requiring grad would count as a parameter)
        loss = chunked_output_cross_entropy(x, weight, labels, 4, loss_mask=mask, precompute_grads=precompute)
        during = tr.live_device_bytes
        loss.sum().backward()
    el = hidden.element_size()
    want = s * b * h * el + b * s * 8 + b * s * 4 + s * b * 4  # hidden, labels, mask (fp32), lse (fp32)
    if precompute:
        want += s * b * h * el + vocab * h * 4  # grad_hidden, fp32 grad_weight
    assert during == want, (during, want)
    assert tr.stats().activation_bytes_device == want


@pytest.mark.parametrize(
    "kwargs,match",
    [
        ({"chunks": 0}, "loss chunks"),
        ({"chunks": -1}, "loss chunks"),
        ({"chunks": 11}, "exceeds the 10 tokens"),
        ({"chunks": "many"}, "loss chunks"),
        ({"chunk_tokens": 0}, "tile_tokens"),
        ({"labels": torch.zeros(2, 9, dtype=torch.long)}, "labels must be"),
        ({"labels": torch.zeros(2, 10)}, "integer"),
        ({"hidden": torch.zeros(10, 8)}, "hidden must be"),
        ({"weight": torch.zeros(32, 7)}, "weight must be"),
        ({"loss_mask": torch.ones(10, 2)}, "loss_mask"),
        ({"weight": torch.zeros(32, 8, dtype=torch.float64)}, "same dtype"),
    ],
)
def test_bad_settings_raise(kwargs, match):
    args = dict(hidden=torch.zeros(10, 2, 8), weight=torch.zeros(32, 8), labels=torch.zeros(2, 10, dtype=torch.long))
    args.update(kwargs)
    with pytest.raises(ValueError, match=match):
        chunked_output_cross_entropy(**args)


# ----------------------------------------------------------------------------------------------- TP=2 over gloo

TP_CASES = [
    # (seed, s, b, h, vocab, dtype, chunks, extra kwargs)
    (20, 37, 2, 16, 64, torch.float32, 5, {}),
    (21, 64, 1, 32, 128, torch.bfloat16, 8, {}),
    (22, 30, 2, 8, 40, torch.float32, "auto", {"chunk_tokens": 7}),
    (23, 24, 1, 8, 32, torch.float32, 3, {"reduce_grad_hidden": False}),
    (25, 37, 2, 16, 64, torch.float32, 5, {"precompute_grads": False}),
    (26, 29, 2, 16, 64, torch.bfloat16, 4, {"precompute_grads": False}),
    (27, 33, 2, 16, 64, torch.float32, 4, {"constant_grad": True}),  # fast path: grads precomputed in forward
]


def _to_numpy(results):
    """Tensors -> float64 numpy arrays (pickled by value: shared-memory tensors die with the worker)."""
    if isinstance(results, torch.Tensor):
        return results.detach().double().numpy()
    return [_to_numpy(r) for r in results]


def _from_numpy(results):
    if isinstance(results, list):
        return [_from_numpy(r) for r in results]
    return torch.from_numpy(results)


def _tp_worker(rank, world_size):
    torch.manual_seed(0)
    group = dist.new_group(list(range(world_size)))
    out = []
    for seed, s, b, h, vocab, dtype, chunks, kw in TP_CASES:
        hidden, weight, labels, mask, grad = make_case(seed, s, b, h, vocab, dtype)
        if kw.pop("constant_grad", False):
            grad = torch.full_like(grad, 0.25)
        shard = weight.chunk(world_size, dim=0)[rank]
        out.append(run_chunked(hidden, shard, labels, mask, grad, chunks, tp_group=group, **kw))
    # CP=2 x TP=2: each TP rank computes both CP shards of a zigzag-sharded sequence.
    hidden, weight, labels, mask, grad = make_case(24, 40, 2, 16, 64)
    shard = weight.chunk(world_size, dim=0)[rank]
    cp = [
        run_chunked(*(zigzag_shard(t, d, 2, r) for t, d in ((hidden, 0),)), shard, zigzag_shard(labels, 1, 2, r),
                    zigzag_shard(mask, 1, 2, r), zigzag_shard(grad, 1, 2, r), 3, tp_group=group)
        for r in range(2)
    ]
    out.append(cp)
    return _to_numpy(out)


def test_vocab_parallel_tp2_matches_fp64_full_vocab():
    results = _from_numpy(run_distributed(_tp_worker, 2))
    for i, (seed, s, b, h, vocab, dtype, chunks, kw) in enumerate(TP_CASES):
        hidden, weight, labels, mask, grad = make_case(seed, s, b, h, vocab, dtype)
        case = (hidden, weight, labels, mask, torch.full_like(grad, 0.25) if kw.get("constant_grad") else grad)
        want_loss, want_gh, want_gw = reference(*case)
        tol = 1e-2 if dtype == torch.bfloat16 else 1e-6
        losses = [r[i][0] for r in results]
        assert torch.equal(losses[0], losses[1])
        assert rel_err(losses[0], want_loss) <= tol
        assert rel_err(torch.cat([r[i][2] for r in results]), want_gw) <= tol
        if kw.get("reduce_grad_hidden", True):
            for r in results:
                assert rel_err(r[i][1], want_gh) <= tol
        else:  # each rank holds its vocab shard's partial; the sum is the full gradient
            assert rel_err(results[0][i][1] + results[1][i][1], want_gh) <= tol
            assert rel_err(results[0][i][1], want_gh) > 1e-3
    want_loss, want_gh, want_gw = reference(*make_case(24, 40, 2, 16, 64))
    per_tp = [r[-1] for r in results]  # per_tp[tp_rank][cp_rank] = (loss, gh, gw)
    for cp_runs in per_tp:
        assert rel_err(zigzag_unshard([c[0] for c in cp_runs], dim=1), want_loss) <= 1e-6
        assert rel_err(zigzag_unshard([c[1] for c in cp_runs], dim=0), want_gh) <= 1e-6
    gw = torch.cat([cp_runs[0][2] + cp_runs[1][2] for cp_runs in per_tp])
    assert rel_err(gw, want_gw) <= 1e-6
