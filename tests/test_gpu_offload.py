"""Offload / host pool / tracker behaviour that matters on CUDA: no host-blocking waits in the pack path,
release errors reported, devices taken from the tensors, tracker synchronization only when asked. The CPU
tests drive the same code with stand-in events/streams; the CUDA tests (skipped without CUDA) run the real
streams and pinned memory."""

from __future__ import annotations

import logging

import pytest
import torch

from nemo_longctx.memory.host_pool import HostPool
from nemo_longctx.memory.offload import ActivationOffloader
from nemo_longctx.memory.tracker import ActivationTracker
from nemo_longctx.selftest import ToyModel, offload_exactness, offload_step

CUDA = torch.cuda.is_available()
needs_cuda = pytest.mark.skipif(not CUDA, reason="needs a CUDA device")


class _Event:
    def __init__(self, done: bool) -> None:
        self.done = done
        self.synchronized = 0

    def query(self) -> bool:
        return self.done

    def synchronize(self) -> None:
        self.synchronized += 1
        self.done = True


class _Stream:
    def __init__(self) -> None:
        self.waited = []

    def wait_event(self, event) -> None:
        self.waited.append(event)


def test_pool_reuse_waits_on_the_stream_not_the_host():
    pool = HostPool(pin_memory=False)
    a, b = pool.acquire(1000), pool.acquire(1000)
    busy, done = _Event(False), _Event(True)
    pool.release(a, done)
    pool.release(b, busy)
    stream = _Stream()
    # the buffer whose copy already finished is preferred (b was released last but is still busy)
    assert pool.acquire(1000, stream=stream) is a and stream.waited == []
    got = pool.acquire(1000, stream=stream)
    assert got is b and stream.waited == [busy] and busy.synchronized == 0  # device-side wait only
    pool.release(got, busy)
    assert pool.acquire(1000) is b and busy.synchronized == 1  # a host writer (no stream) waits on the host
    assert pool.allocations == 2 and pool.reuses == 3


def test_release_errors_are_logged_and_counted(caplog):
    engine = ActivationOffloader(min_bytes=0)

    def broken_release(buf, event=None):
        raise RuntimeError("pool corrupted")

    engine.pool.release = broken_release
    x = torch.randn(64, requires_grad=True)
    with caplog.at_level(logging.ERROR, logger="nemo_longctx.memory.offload"):
        with engine.offload_scope("s"):
            y = (x * 2).sin()  # sin saves its input: offloaded
        del y  # the graph (and the offloaded handle) dies: release runs in __del__
    assert engine.release_errors >= 1 and "pool corrupted" in engine.last_release_error
    assert any("releasing an offloaded tensor's host buffer failed" in r.message for r in caplog.records)


def test_offloader_and_tracker_take_the_device_from_the_tensors():
    engine = ActivationOffloader(min_bytes=0)
    assert engine.device_type is None
    model = ToyModel(2, 16)
    x = torch.randn(8, 16)
    ref_loss, ref_grads = offload_step(model, x)
    with ActivationTracker(params=model.parameters(), count_peak=False) as tr:
        loss, grads = offload_step(model, x, engine)
    assert engine.device_type == "cpu" and engine.tensors_offloaded > 0
    assert torch.equal(loss, ref_loss) and all(torch.equal(a, b) for a, b in zip(grads, ref_grads))
    assert tr.device_type == "cpu" and tr.stats().device == "cpu" and tr.stats().activation_bytes_host > 0
    with ActivationTracker() as tr2:  # no params, no device: from the saved tensors
        offload_step(model, x)
    assert tr2.stats().device == "cpu" and tr2.stats().activation_bytes_device > 0 and tr2.stats().peak_bytes > 0


def test_tracker_synchronizes_cuda_only_when_asked(monkeypatch):
    """Stand-in torch.cuda counters (no GPU here): the tracker's CUDA path must not call synchronize unless
    ``synchronize=True``, and must read the allocator counters of the tracked device."""
    calls = {"sync": 0}
    allocated = {"now": 1000, "peak": 1000}
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "current_device", lambda: 0)
    monkeypatch.setattr(torch.cuda, "synchronize", lambda device=None: calls.__setitem__("sync", calls["sync"] + 1))
    monkeypatch.setattr(torch.cuda, "reset_peak_memory_stats", lambda device=None: allocated.__setitem__(
        "peak", allocated["now"]))
    monkeypatch.setattr(torch.cuda, "memory_allocated", lambda device=None: allocated["now"])
    monkeypatch.setattr(torch.cuda, "max_memory_allocated", lambda device=None: allocated["peak"])
    for sync, expected in ((False, 0), (True, 2)):
        calls["sync"] = 0
        with ActivationTracker("cuda", synchronize=sync) as tr:
            allocated["peak"] = allocated["now"] + 4096
        assert calls["sync"] == expected
        assert tr.stats().peak_bytes == 4096 and tr.stats().device == "cuda"


# --------------------------------------------------------------------------------------------- CUDA only


@needs_cuda
def test_cuda_offload_exact_with_pinned_memory_and_side_streams():
    res = offload_exactness(torch.device("cuda"), torch.bfloat16, layers=3, d=256, tokens=1024)
    for mode, r in res.items():
        assert r["exact"] and r["pinned"] and r["pool_in_use"] == 0 and r["release_errors"] == 0, (mode, r)


@needs_cuda
def test_cuda_offload_makes_no_host_blocking_sync():
    from nemo_longctx.selftest import offload_overlap

    ov = offload_overlap(torch.device("cuda"), torch.bfloat16, layers=3, d=512, tokens=2048, steps=2)
    assert ov["host_syncs"] == 0, ov


@needs_cuda
def test_cuda_tracker_default_device_from_params_and_no_sync():
    model = ToyModel(2, 64).cuda()
    x = torch.randn(128, 64, device="cuda")
    with ActivationTracker(params=model.parameters()) as tr:
        offload_step(model, x)
    st = tr.stats()
    assert st.device == "cuda" and st.peak_bytes > 0 and st.activation_bytes_device > 0
