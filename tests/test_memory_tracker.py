"""ActivationTracker: exact saved-byte counts (storage-deduplicated, leaves apart), scopes, CPU peak counter."""

from __future__ import annotations

import pytest
import torch

from nemo_longctx.memory.tracker import (
    ActivationTracker,
    host_allocations,
    memory_scope,
    scope_modules,
    track_activation_memory,
)


class _SaveKnown(torch.autograd.Function):
    """Saves: a [4, 8] fp32 (128 B), two views of a, b [3] fp64 (24 B), the weight and a view of it."""

    @staticmethod
    def forward(ctx, x, w):
        a = x * 2
        b = torch.ones(3, dtype=torch.float64)
        ctx.save_for_backward(a, a[1:], a.t(), b, w, w.t())
        return x * w.sum()

    @staticmethod
    def backward(ctx, g):
        a, a1, at, b, w, wt = ctx.saved_tensors
        return g * w.sum(), (g * a / 2).sum() * torch.ones_like(w)


def test_exact_bytes_views_count_once_and_leaves_apart():
    x = torch.randn(4, 8)
    w = torch.nn.Parameter(torch.randn(5, 2))
    with ActivationTracker() as tr:
        with memory_scope("known"):
            y = _SaveKnown.apply(x, w)
        assert tr.live_device_bytes == 128 + 24
        with memory_scope("chain"):
            e = (y * 1.0).exp()  # exp saves its result e: 128 B
            s = e.sin()  # sin saves e again: same storage, counted once
            z = s * 3.0  # scalar multiply saves nothing
        assert tr.live_device_bytes == 128 + 24 + 128
        z.sum().backward()
    st = tr.stats()
    assert st.activation_bytes_device == 128 + 24 + 128
    assert st.activation_bytes_host == 0
    assert st.leaf_bytes == 5 * 2 * 4
    assert st.per_scope == {"known": {"device": 152, "host": 0}, "chain": {"device": 128, "host": 0}}
    assert tr.live_device_bytes == 128  # e is still referenced here; the rest was released by backward
    del e, s
    assert tr.live_device_bytes == 0
    assert w.grad is not None


def test_params_argument_and_scope_modules():
    torch.manual_seed(0)
    frozen = torch.nn.Linear(8, 8, bias=False).requires_grad_(False)
    x = torch.randn(2, 8, requires_grad=True)

    def fwd():
        return torch.nn.functional.linear(x.exp(), frozen.weight).sum()

    # without `params` the frozen weight (not a leaf requiring grad) is counted as an activation
    with ActivationTracker() as tr_plain:
        fwd()
    with ActivationTracker(params=frozen.parameters()) as tr_params:
        fwd()
    exp_out = 2 * 8 * 4
    assert tr_params.stats().activation_bytes_device == exp_out  # x.exp() result saved by exp and mm
    assert tr_params.stats().leaf_bytes == 8 * 8 * 4
    assert tr_plain.stats().activation_bytes_device == exp_out + 8 * 8 * 4

    model = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.Tanh(), torch.nn.Linear(16, 4))
    handles = scope_modules({"first": model[0], "act": model[1], "last": model[2]})
    with ActivationTracker(params=model.parameters()) as tr:
        model(x).sum().backward()
    handles.remove()
    per = tr.stats().per_scope
    # first linear saves its input x (a leaf requiring grad -> not an activation); tanh saves its output
    # [2, 16]; the last linear saves its input, the very same tanh output (counted once, under "act")
    assert per == {"act": {"device": 2 * 16 * 4, "host": 0}}


def test_cpu_peak_counter_tracks_allocations_and_frees():
    with ActivationTracker("cpu") as tr:
        a = torch.empty(1000)  # 4000 B
        b = torch.empty(500)  # 2000 B
        av = a.view(10, 100)  # alias: no new bytes
        del a, av
        c = torch.empty(250)  # 1000 B: a is freed, so the peak stays 6000
        with host_allocations():
            pool = torch.empty(10_000)  # host pool buffers are not device bytes
        d = b + 1  # 2000 B new -> live 2000 + 1000 + 2000 = 5000
        del b, c, d, pool
    assert tr.stats().peak_bytes == 6000
    st = track_activation_memory(lambda: torch.zeros(3000), device="cpu")
    assert st.peak_bytes == 12000 and st.activation_bytes_device == 0


def test_tracker_misuse():
    tr = ActivationTracker("cpu")
    with tr:
        pass
    with pytest.raises(RuntimeError, match="entered once"):
        tr.__enter__()
    with pytest.raises(ValueError, match="non-empty"):
        with memory_scope(""):
            pass
    if not torch.cuda.is_available():
        with pytest.raises(ValueError, match="CUDA is not available"):
            ActivationTracker("cuda")
