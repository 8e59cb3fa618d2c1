"""Activation offload engine: bit-exact round trips, tracker columns, prefetch order, exact training parity
with torch.utils.checkpoint (reentrant and not) incl. dropout, modules mode, retain_graph."""

from __future__ import annotations

import pytest
import torch
import torch.nn as nn
from torch.utils.checkpoint import checkpoint

from nemo_longctx.memory.host_pool import HostPool
from nemo_longctx.memory.offload import ActivationOffloader, storage_span
from nemo_longctx.memory.tracker import ActivationTracker, memory_scope

_INT_OF = {1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}


def _bits(t: torch.Tensor) -> torch.Tensor:
    """Raw bits of t's elements (NaN payloads and -0.0 included)."""
    c = t.contiguous()
    return c.view(_INT_OF[c.element_size()]) if c.dtype != torch.bool else c


class _SaveAndCapture(torch.autograd.Function):
    """Saves ``t`` for backward; backward hands the unpacked tensor to ``sink``."""

    @staticmethod
    def forward(ctx, x, t, sink):
        ctx.save_for_backward(t)
        ctx.sink = sink
        return x * 2

    @staticmethod
    def backward(ctx, g):
        (t,) = ctx.saved_tensors
        ctx.sink.append(t)
        return g * 2, None, None


def _odd_tensors():
    gen = torch.Generator().manual_seed(0)
    base = torch.randn(6, 10, generator=gen)
    base[0, 0], base[0, 1], base[1, 0] = float("nan"), -0.0, float("inf")
    return {
        "contiguous_fp32": base.clone(),
        "bf16": base.to(torch.bfloat16),
        "fp64": base.double(),
        "transposed": base.t(),
        "gapped_slice": base[1:5, ::3],
        "offset_view": base[2:],
        "expanded": torch.randn(1, 10, generator=gen).expand(5, 10),
        "channels_last": torch.randn(2, 3, 4, 5, generator=gen).to(memory_format=torch.channels_last),
        "int64": torch.randint(-9, 9, (7, 3), generator=gen),
        "bool": torch.rand(9, generator=gen) > 0.5,
        "complex": torch.randn(4, 3, dtype=torch.complex64, generator=gen),
        "scalar": torch.tensor(3.5),
    }


def test_round_trip_bit_exact_and_tracker_columns():
    engine = ActivationOffloader(min_bytes=0, prefetch_depth=1)
    for name, t in _odd_tensors().items():
        keep = t.clone()  # the original may be freed; compare against a copy of its values
        x = torch.randn(3, requires_grad=True)
        sink: list = []
        with ActivationTracker("cpu", count_peak=False) as tr:
            with engine.offload_scope(name):
                y = _SaveAndCapture.apply(x * 1, t, sink)
            live = (tr.live_device_bytes, tr.live_host_bytes)
            y.sum().backward()
        (back,) = sink
        assert back.dtype == t.dtype and back.shape == t.shape, name
        assert back.stride() == t.stride(), name
        assert torch.equal(_bits(back), _bits(keep)), name
        assert back.storage_offset() == 0
        # t is still referenced by the test, but what autograd held moved to the host column
        assert live == (0, storage_span(t) * t.element_size()), name
        assert tr.stats().activation_bytes_host == storage_span(t) * t.element_size()
        del back, sink
        assert engine.live_groups() == [] and engine.pool.bytes_in_use == 0, name


def test_skip_rules_and_validation():
    engine = ActivationOffloader(min_bytes=64)
    w = nn.Parameter(torch.randn(8, 8))
    small = torch.randn(4)  # 16 B < 64
    big = torch.randn(32)  # 128 B
    x = torch.randn(3, requires_grad=True)
    with ActivationTracker("cpu", count_peak=False) as tr:
        with engine.offload_scope("s"):
            ys = [_SaveAndCapture.apply(x * 1, t, []) for t in (w, w.t(), small, big)]
        cols = (tr.live_device_bytes, tr.live_host_bytes, tr.stats().leaf_bytes)
    assert cols == (16, 128, 8 * 8 * 4)
    assert engine.tensors_offloaded == 1
    del ys
    for kwargs, field in (({"prefetch_depth": -1}, "prefetch_depth"), ({"min_bytes": 1.5}, "min_bytes")):
        with pytest.raises(ValueError, match=field):
            ActivationOffloader(**kwargs)
    if not torch.cuda.is_available():
        with pytest.raises(ValueError, match="pin_memory"):
            HostPool(pin_memory=True)
        with pytest.raises(ValueError, match="CUDA"):
            ActivationOffloader(device="cuda")
    with ActivationOffloader().offload_scope(0):
        with pytest.raises(RuntimeError, match="outside"):
            with ActivationTracker("cpu"):
                pass


class _Layer(nn.Module):
    def __init__(self, d: int, p: float) -> None:
        super().__init__()
        self.norm = nn.LayerNorm(d)
        self.mlp = nn.Sequential(nn.Linear(d, 2 * d), nn.GELU(), nn.Dropout(p), nn.Linear(2 * d, d))

    def forward(self, x):
        return x + self.mlp(self.norm(x))


class _Toy(nn.Module):
    def __init__(self, layers: int = 4, d: int = 16, p: float = 0.2) -> None:
        super().__init__()
        self.inp = nn.Linear(d, d)
        self.layers = nn.ModuleList(_Layer(d, p) for _ in range(layers))
        self.out = nn.Linear(d, 1)

    def forward(self, x, *, ckpt_layers=(), reentrant=True, engine=None, offload_layers=(), triggers=False,
                marker=None):
        h = self.inp(x)
        for i, layer in enumerate(self.layers):
            run = (lambda f, *a, **k: f(*a, **k)) if engine is None or i not in offload_layers else (
                lambda f, *a, **k: engine.run_in_scope(i, f, *a, trigger=triggers, **k))
            if i in ckpt_layers:
                h = run(checkpoint, layer, h, use_reentrant=reentrant)
            else:
                h = run(layer, h)
            if marker is not None and h.requires_grad:
                h.register_hook(lambda g, i=i: marker.append(("grad", i, 0)) and None)
            if triggers and i not in offload_layers:  # offloaded layers got theirs from run_in_scope
                engine.prefetch_trigger(h)
        return self.out(h).square().mean()


def _run(model, x, seed, **kw):
    torch.manual_seed(seed)
    model.zero_grad(set_to_none=True)
    loss = model(x, **kw)
    loss.backward()
    return loss.detach(), [p.grad.clone() for p in model.parameters()]


def test_layer_input_offload_under_checkpoint_matches_plain_training():
    torch.manual_seed(0)
    model = _Toy(layers=4, d=16, p=0.2)
    x = torch.randn(3, 24, 16)
    ref_loss, ref_grads = _run(model, x, seed=7)
    one_layer_input = 3 * 24 * 16 * 4
    cases = [
        dict(ckpt_layers=range(4), offload_layers=range(4), reentrant=True, depth=1),
        dict(ckpt_layers=range(4), offload_layers=range(4), reentrant=False, depth=2),
        dict(ckpt_layers=range(2), offload_layers=range(2), reentrant=True, depth=1),  # recompute 2 of 4
        dict(ckpt_layers=range(2), offload_layers=range(2), reentrant=False, depth=0),
        dict(ckpt_layers=(0, 2), offload_layers=(0, 2), reentrant=True, depth=3, triggers=True),
        dict(ckpt_layers=range(4), offload_layers=range(4), reentrant=False, depth=1, triggers=True),
    ]
    for case in cases:
        engine = ActivationOffloader(min_bytes=1024, prefetch_depth=case.pop("depth"))
        with ActivationTracker("cpu", params=model.parameters(), count_peak=False) as tr:
            loss, grads = _run(model, x, seed=7, engine=engine, **case)
        assert torch.equal(loss, ref_loss), case
        for g, r in zip(grads, ref_grads):
            assert torch.equal(g, r), case
        st = tr.stats()
        assert st.activation_bytes_host == len(case["offload_layers"]) * one_layer_input, case
        assert engine.live_groups() == [] and engine.pool.bytes_in_use == 0
        # a second step with the same engine reuses the host buffers: no new allocation
        loss2, grads2 = _run(model, x, seed=7, engine=engine, **case)
        assert torch.equal(loss2, ref_loss) and all(torch.equal(g, r) for g, r in zip(grads2, ref_grads))
        assert engine.pool.allocations == len(case["offload_layers"]), case
    # the un-offloaded, fully checkpointed run keeps every layer input on the device instead
    with ActivationTracker("cpu", params=model.parameters(), count_peak=False) as tr_ckpt:
        _run(model, x, seed=7, ckpt_layers=range(4))
    with ActivationTracker("cpu", params=model.parameters(), count_peak=False) as tr_off:
        _run(model, x, seed=7, ckpt_layers=range(4), engine=ActivationOffloader(min_bytes=1024),
             offload_layers=range(4))
    a, b = tr_ckpt.stats(), tr_off.stats()
    assert a.activation_bytes_host == 0 and b.activation_bytes_host == 4 * one_layer_input
    assert b.activation_bytes_device == a.activation_bytes_device - 4 * one_layer_input


def _events(engine):
    return [(what, key) for what, key, _ in engine.events]


def test_prefetch_order_with_skipped_layers():
    torch.manual_seed(1)
    model = _Toy(layers=6, d=8, p=0.0)
    x = torch.randn(2, 4, 8)
    offl = (0, 2, 4)
    fwd = [("d2h", 0), ("d2h", 2), ("d2h", 4)]
    for depth, expected in (
        (0, fwd + [("h2d", 4), ("unpack", 4), ("h2d", 2), ("unpack", 2), ("h2d", 0), ("unpack", 0)]),
        (1, fwd + [("h2d", 4), ("h2d", 2), ("unpack", 4), ("h2d", 0), ("unpack", 2), ("unpack", 0)]),
        (2, fwd + [("h2d", 4), ("h2d", 2), ("h2d", 0), ("unpack", 4), ("unpack", 2), ("unpack", 0)]),
    ):
        for reentrant in (True, False):
            engine = ActivationOffloader(min_bytes=0, prefetch_depth=depth, record_events=True)
            _run(model, x, 0, ckpt_layers=range(6), reentrant=reentrant, engine=engine, offload_layers=offl)
            assert _events(engine) == expected, (depth, reentrant)

    # recompute_num_layers < L: layers 0..2 offloaded, 3..5 plain; a trigger on every layer output keeps the
    # next offloaded group resident from the start of the backward on (layer 5's output gradient), instead
    # of fetching it synchronously when layer 2's backward unpacks it
    engine = ActivationOffloader(min_bytes=0, prefetch_depth=1, record_events=True)
    _run(model, x, 0, ckpt_layers=range(3), engine=engine, offload_layers=range(3), triggers=True,
         marker=engine.events)
    got = [e for e in _events(engine) if e[0] != "d2h"]
    assert got == [("grad", 5), ("h2d", 2), ("grad", 4), ("grad", 3), ("grad", 2), ("h2d", 1), ("unpack", 2),
                   ("grad", 1), ("h2d", 0), ("unpack", 1), ("grad", 0), ("unpack", 0)], got

    # two microbatches before any backward (pipeline style): prefetching stays inside each pass
    engine = ActivationOffloader(min_bytes=0, prefetch_depth=1, record_events=True)
    torch.manual_seed(0)
    losses = [model(x + k, ckpt_layers=range(6), engine=engine, offload_layers=offl) for k in range(2)]
    for loss in losses:
        loss.backward()
    passes = [(w, k, p) for w, k, p in engine.events if w != "d2h"]
    assert passes == [("h2d", 4, 0), ("h2d", 2, 0), ("unpack", 4, 0), ("h2d", 0, 0), ("unpack", 2, 0),
                      ("unpack", 0, 0), ("h2d", 4, 1), ("h2d", 2, 1), ("unpack", 4, 1), ("h2d", 0, 1),
                      ("unpack", 2, 1), ("unpack", 0, 1)], passes


def test_modules_mode_and_retain_graph():
    torch.manual_seed(2)
    model = _Toy(layers=3, d=16, p=0.1)
    x = torch.randn(2, 32, 16)
    ref_loss, ref_grads = _run(model, x, seed=3)
    engine = ActivationOffloader(min_bytes=2 * 32 * 16 * 4, prefetch_depth=1, record_events=True)
    handles = engine.offload_modules({f"layers.{i}.mlp": l.mlp for i, l in enumerate(model.layers)})
    with memory_scope("step"), ActivationTracker("cpu", params=model.parameters(), count_peak=False) as tr:
        loss, grads = _run(model, x, seed=3)
    handles.remove()
    assert torch.equal(loss, ref_loss) and all(torch.equal(g, r) for g, r in zip(grads, ref_grads))
    assert engine.tensors_offloaded > 0 and tr.stats().activation_bytes_host == engine.bytes_offloaded
    assert {k for _, k, _ in engine.events} == {"layers.0.mlp", "layers.1.mlp", "layers.2.mlp"}

    # retain_graph: the host copy stays until autograd drops the saved tensor, so backward can run twice
    engine = ActivationOffloader(min_bytes=0, prefetch_depth=1)
    torch.manual_seed(3)
    model.zero_grad(set_to_none=True)
    loss = model(x, ckpt_layers=range(3), engine=engine, offload_layers=range(3))
    loss.backward(retain_graph=True)
    loss.backward()
    for p, r in zip(model.parameters(), ref_grads):
        torch.testing.assert_close(p.grad, 2 * r, rtol=1e-6, atol=1e-7)
    del loss
    assert engine.live_groups() == [] and engine.pool.bytes_in_use == 0
