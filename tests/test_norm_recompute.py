"""memory.norm_recompute.RecomputedNorm (plain PyTorch): a norm -> linear consumer with the norm output released and
recomputed in backward. Gradients (input, norm weight, linear weight) equal the plain path, under no hooks, under
the activation tracker and inside an offload scope; the released output stops counting in the tracker; a consumer
without grad keeps the output; bad layouts are refused. (The Megatron layers: tests/test_memory_integration.py.)"""

from __future__ import annotations

import pytest
import torch

from nemo_longctx.memory.norm_recompute import RecomputedNorm
from nemo_longctx.memory.offload import ActivationOffloader
from nemo_longctx.memory.tracker import ActivationTracker

S, H = 64, 32


def _modules():
    torch.manual_seed(3)
    norm = torch.nn.RMSNorm(H, eps=1e-5)
    with torch.no_grad():
        norm.weight.uniform_(0.5, 1.5)
    lin = torch.nn.Linear(H, 3 * H, bias=False)
    return norm, lin


def _step(mode, hooks):
    norm, lin = _modules()
    x0 = torch.randn(S, H, generator=torch.Generator().manual_seed(1), dtype=torch.float32)
    leaf = x0.clone().requires_grad_()
    tracker = offloader = None
    if hooks in ("tracker", "tracker+offload"):
        tracker = ActivationTracker("cpu", params=list(norm.parameters()) + list(lin.parameters()), count_peak=False)
        tracker.__enter__()
    if hooks == "tracker+offload":
        offloader = ActivationOffloader(min_bytes=0, device="cpu")
    x = leaf * 2.0  # an activation
    rn = None
    if mode == "plain":
        y = norm(x)
    else:
        rn = RecomputedNorm(type(norm).forward.__get__(norm), list(norm.parameters()))
        y = rn(x)
    if offloader is not None:
        with offloader.offload_scope("consumer"):
            out = lin(y)
    else:
        out = lin(y)
    released = None
    if rn is not None:
        before = tracker.live_device_bytes if tracker else 0
        rn.discard(out)
        released = before - (tracker.live_device_bytes if tracker else 0)
        assert y.untyped_storage().nbytes() == 0
    loss = (out.sin().sum(-1) * x.sum(-1)).sum()
    loss.backward()
    if tracker is not None:
        tracker.__exit__(None, None, None)
    return {"x": leaf.grad, "norm": norm.weight.grad, "lin": lin.weight.grad, "released": released}


@pytest.mark.parametrize("hooks", ["none", "tracker", "tracker+offload"])
def test_gradients_equal_the_plain_path(hooks):
    want = _step("plain", "none")
    got = _step("recompute", hooks)
    for k in ("x", "norm", "lin"):
        torch.testing.assert_close(got[k], want[k], rtol=1e-6, atol=1e-6)
        assert got[k].abs().sum() > 0
    if hooks == "tracker":  # the norm output [S, H] fp32 was a saved tensor of the linear: released in the tracker
        assert got["released"] == S * H * 4
    if hooks == "tracker+offload":  # the linear's copy went to the host: nothing on the device to release
        assert got["released"] == 0


def test_consumer_without_grad_keeps_output_and_layout_is_checked():
    norm, lin = _modules()
    x = torch.randn(S, H, requires_grad=True)
    rn = RecomputedNorm(type(norm).forward.__get__(norm), list(norm.parameters()))
    y = rn(x)
    rn.discard(lin(y).detach())
    assert y.untyped_storage().nbytes() == S * H * 4  # kept: no backward through the consumer
    rn2 = RecomputedNorm(lambda t: norm(t).t(), list(norm.parameters()))
    y2 = rn2(x)
    with pytest.raises(RuntimeError, match="contiguous"):
        rn2.discard(lin(y2.t()))
