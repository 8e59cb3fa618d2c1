"""Sequence-tiled MLP vs the untiled module (fp64 reference): outputs, input and weight gradients, ragged tiles,
Megatron-style (output, bias) returns, dropout RNG replay, gradient hooks firing once, bad policies, and a
live-allocation bound showing that only one tile's intermediate is alive."""

from __future__ import annotations

import copy

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F
from reference import rel_err
from torch.multiprocessing.reductions import StorageWeakRef
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten

from nemo_longctx.memory.tiling import TiledMLP, check_tiling_policy, resolve_tiles, tiled_mlp


class SwiGLU(nn.Module):
    """Megatron-like MLP: fc1 -> SwiGLU -> fc2; returns (output, fc2 bias) like skip_bias_add=True."""

    def __init__(self, h: int, ffn: int, fc1_bias: bool = True, dropout: float = 0.0, norm: bool = True):
        super().__init__()
        self.fc1 = nn.Linear(h, 2 * ffn, bias=fc1_bias)
        self.fc2 = nn.Linear(ffn, h, bias=False)
        self.fc2_bias = nn.Parameter(torch.randn(h) * 0.1)
        self.norm = nn.LayerNorm(h) if norm else nn.Identity()
        self.dropout = dropout

    def forward(self, x):
        a, g = self.fc1(self.norm(x)).chunk(2, dim=-1)
        y = F.dropout(F.silu(a) * g, p=self.dropout, training=self.dropout > 0)
        return self.fc2(y), self.fc2_bias


def _loss(out, bias, w_out, w_bias):
    """A scalar that uses every output element with different weights (so grads are not uniform)."""
    return (out * w_out).sum() + (bias * w_bias).sum()


def _grads(module, x, fn_out, w_out, w_bias):
    out, bias = fn_out
    loss = _loss(out, bias, w_out, w_bias)
    params = [p for p in module.parameters() if p.requires_grad]
    inputs = ([x] if x.requires_grad else []) + params
    return out.detach(), list(torch.autograd.grad(loss, inputs))


def _check_against_fp64(dtype, shape, tiles, seq_dim, tol, tile_tokens=2048, freeze=(), x_grad=True, norm=True):
    torch.manual_seed(sum(shape) + (tiles if isinstance(tiles, int) else 0))
    h = shape[-1]
    model = SwiGLU(h, 3 * h, norm=norm)
    for name in freeze:
        model.get_parameter(name).requires_grad_(False)
    ref = copy.deepcopy(model).double()
    model = model.to(dtype)
    x = torch.randn(shape, dtype=dtype).requires_grad_(x_grad)
    w_out = torch.randn(shape, dtype=torch.float64)
    w_bias = torch.randn(h, dtype=torch.float64)
    x_ref = x.detach().double().requires_grad_(x_grad)
    want_out, want = _grads(ref, x_ref, ref(x_ref), w_out, w_bias)
    got = tiled_mlp(model, x, tiles, seq_dim=seq_dim, tile_tokens=tile_tokens)
    assert isinstance(got, tuple) and got[1] is not None
    got_out, got_grads = _grads(model, x, got, w_out.to(dtype), w_bias.to(dtype))
    assert got_out.dtype == dtype and got_out.shape == want_out.shape
    assert rel_err(got_out, want_out) <= tol
    assert len(got_grads) == len(want)
    for g, w in zip(got_grads, want):
        assert g.dtype == dtype
        assert rel_err(g, w) <= tol, (rel_err(g, w), g.shape)


@pytest.mark.parametrize(
    "shape,tiles,seq_dim,tile_tokens",
    [
        ((37, 2, 16), 5, 0, 2048),  # ragged: 8,8,7,7,7
        ((64, 1, 24), "auto", 0, 16),  # auto -> 4 tiles
        ((7, 3, 8), 7, 0, 2048),  # one token per tile
        ((2, 29, 16), 3, 1, 2048),  # [b, s, h] layout
        ((50, 2, 16), "auto", 0, 17),  # auto ragged: ceil(50/17) = 3 tiles
    ],
)
def test_tiled_mlp_fp32_matches_fp64_untiled(shape, tiles, seq_dim, tile_tokens):
    _check_against_fp64(torch.float32, shape, tiles, seq_dim, 1e-6, tile_tokens)


def test_tiled_mlp_bf16_matches_fp64_untiled():
    """Megatron's MLP (no norm inside: bf16 LayerNorm grads alone miss 1e-2 even untiled); 48 tiles checks that
    per-tile weight gradients are summed without bf16 round-off piling up."""
    _check_against_fp64(torch.bfloat16, (96, 2, 32), 6, 0, 1e-2, norm=False)
    _check_against_fp64(torch.bfloat16, (45, 1, 32), 4, 0, 1e-2, norm=False)
    _check_against_fp64(torch.bfloat16, (384, 2, 32), 48, 0, 1e-2, norm=False)


def test_frozen_params_and_input_without_grad():
    _check_against_fp64(torch.float32, (33, 2, 16), 4, 0, 1e-6, freeze=("fc1.bias", "norm.weight"))
    _check_against_fp64(torch.float32, (33, 2, 16), 4, 0, 1e-6, x_grad=False)
    model = SwiGLU(8, 16)
    for p in model.parameters():
        p.requires_grad_(False)
    x = torch.randn(10, 1, 8)
    out, bias = tiled_mlp(model, x, 3)
    assert not out.requires_grad
    assert rel_err(out, model(x)[0]) < 1e-6


def test_off_and_single_tile_call_fn_directly_and_plain_callable_needs_params():
    torch.manual_seed(1)
    model = SwiGLU(8, 16)
    x = torch.randn(12, 2, 8)
    want = model(x)[0]
    assert torch.equal(tiled_mlp(model, x, "off")[0], want)
    assert torch.equal(tiled_mlp(model, x, 1)[0], want)
    # A plain callable returning a tensor: params must be listed, the tensor comes back as a tensor.
    w = torch.randn(8, 8, dtype=torch.float64, requires_grad=True)
    xd = torch.randn(12, 2, 8, dtype=torch.float64, requires_grad=True)

    def fn(t):
        return torch.tanh(t @ w)

    with pytest.raises(ValueError, match="params"):
        tiled_mlp(fn, xd, 3)
    got = tiled_mlp(fn, xd, 5, params=[w])
    assert isinstance(got, torch.Tensor)
    gx, gw = torch.autograd.grad(got.square().sum(), [xd, w])
    rx, rw = torch.autograd.grad(fn(xd).square().sum(), [xd, w])
    assert rel_err(gx, rx) < 1e-13 and rel_err(gw, rw) < 1e-13


def test_dropout_masks_are_replayed_per_tile():
    """The recompute must see the same dropout mask as the forward: compare with running the same tiles with
    autograd (same seed) and keeping the graph."""
    torch.manual_seed(2)
    model = SwiGLU(16, 32, dropout=0.5).double()
    x = torch.randn(30, 2, 16, dtype=torch.float64, requires_grad=True)
    w_out = torch.randn(30, 2, 16, dtype=torch.float64)
    torch.manual_seed(123)
    outs = [model(t)[0] for t in x.split([10, 10, 10], dim=0)]
    want_out, want = _grads(model, x, (torch.cat(outs), model.fc2_bias), w_out, torch.zeros(16, dtype=torch.float64))
    torch.manual_seed(123)
    got_out, got = _grads(model, x, tiled_mlp(model, x, 3), w_out, torch.zeros(16, dtype=torch.float64))
    assert torch.equal(got_out, want_out)
    for g, w in zip(got, want):
        assert rel_err(g, w) < 1e-13
    # and the RNG stream after backward continues from where the forward left it
    torch.manual_seed(5)
    out, _ = tiled_mlp(model, x, 3)
    after_fwd = torch.get_rng_state()
    out.sum().backward()
    assert torch.equal(torch.get_rng_state(), after_fwd)


def test_param_grad_hooks_fire_once_per_backward():
    """Megatron DDP / FSDP hook the gradient accumulators; tiling must deliver one summed gradient per param."""
    torch.manual_seed(3)
    model = SwiGLU(8, 16)
    calls = {}
    for name, p in model.named_parameters():
        p.register_post_accumulate_grad_hook(lambda p, name=name: calls.__setitem__(name, calls.get(name, 0) + 1))
    out, bias = tiled_mlp(model, torch.randn(20, 1, 8, requires_grad=True), 4)
    (out.sum() + bias.sum()).backward()
    assert calls == {name: 1 for name, _ in model.named_parameters()}


@pytest.mark.parametrize("bad", [0, -2, "on", "8", True, 2.0, None])
def test_bad_tile_policies_raise(bad):
    model = SwiGLU(8, 16)
    with pytest.raises(ValueError, match="mlp tiles"):
        tiled_mlp(model, torch.randn(10, 1, 8), bad)
    with pytest.raises(ValueError, match="mlp tiles"):
        TiledMLP(model, bad)


def test_more_tiles_than_tokens_and_bad_tile_tokens_raise():
    model = SwiGLU(8, 16)
    with pytest.raises(ValueError, match="exceeds the 10 tokens"):
        tiled_mlp(model, torch.randn(10, 1, 8), 11)
    with pytest.raises(ValueError, match="tile_tokens"):
        tiled_mlp(model, torch.randn(10, 1, 8), "auto", tile_tokens=0)
    with pytest.raises(ValueError, match="tile_tokens"):
        TiledMLP(model, "auto", tile_tokens=-1)
    with pytest.raises(ValueError, match="sequence dim"):
        tiled_mlp(lambda t: t.sum(0, keepdim=True), torch.randn(10, 1, 8), 2, params=[])
    check_tiling_policy("auto")
    assert resolve_tiles("auto", 10, 4) == 3 and resolve_tiles("off", 10, 4) == 1 and resolve_tiles(10, 10, 4) == 10


def test_tiled_mlp_module_wrapper_matches():
    torch.manual_seed(4)
    model = SwiGLU(8, 16)
    x = torch.randn(21, 2, 8)
    out, bias = TiledMLP(model, 4)(x)
    assert rel_err(out, model(x)[0]) < 1e-6 and bias is not model.fc2_bias and torch.equal(bias, model.fc2_bias)


class LiveBytes(TorchDispatchMode):
    """Counts bytes of tensor storages created under the mode that are still alive, after every op; keeps the peak.

    A storage is freed when its last reference dies (a weak storage reference expires). Outputs that share an
    input's storage (views, in-place ops) are not new allocations. Sampling happens at op boundaries while the
    op's inputs are still referenced, so the peak is an upper bound of the true peak (to op granularity).
    """

    def __init__(self):
        super().__init__()
        self.live, self.current, self.peak = {}, 0, 0

    def _sweep(self):
        for key in [k for k, (ref, _) in self.live.items() if ref.expired()]:
            self.current -= self.live.pop(key)[1]

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        self._sweep()
        inputs = {
            (t.untyped_storage().data_ptr(), t.untyped_storage().nbytes())
            for t in tree_flatten((args, kwargs))[0]
            if isinstance(t, torch.Tensor)
        }
        for t in tree_flatten(out)[0]:
            if isinstance(t, torch.Tensor) and t.untyped_storage().nbytes() > 0:
                storage = t.untyped_storage()
                key = (storage.data_ptr(), storage.nbytes())
                if key not in self.live and key not in inputs:
                    self.live[key] = (StorageWeakRef(storage), storage.nbytes())
                    self.current += storage.nbytes()
        self.peak = max(self.peak, self.current)
        return out


def _peak_fwd_bwd(model, x, tiles):
    """Peak live bytes allocated during forward + backward (the input and the upstream gradient pre-exist)."""
    grad_out = torch.randn_like(x)
    model.zero_grad(set_to_none=True)
    with LiveBytes() as counter:
        out, _ = tiled_mlp(model, x, tiles)
        out.backward(grad_out)
        del out
    return counter.peak


def test_tiled_mlp_peak_live_bytes_is_one_tile():
    """Untiled fwd+bwd at s tokens keeps s tokens of intermediates alive; tiled (8 tiles) must stay within
    1.2x the untiled peak of ONE tile plus what tiling adds by design: the full output, the full grad_input and
    one extra set of parameter gradients (the per-tile ones being summed)."""
    torch.manual_seed(6)
    s, h, ffn, tiles = 2048, 32, 256, 8
    model = SwiGLU(h, ffn, fc1_bias=False)
    x = torch.randn(s, 1, h, requires_grad=True)
    untiled = _peak_fwd_bwd(model, x, "off")
    one_tile = _peak_fwd_bwd(model, x[: s // tiles].detach().requires_grad_(), "off")
    tiled = _peak_fwd_bwd(model, x, tiles)
    full_act = x.numel() * x.element_size()  # one [s, b, h] tensor
    param_bytes = sum(p.numel() * p.element_size() for p in model.parameters())
    bound = 1.2 * one_tile + 2 * full_act + param_bytes
    # The counter sees intermediates: untiled fwd+bwd holds >= [s, 3*ffn] fp32 of them at once.
    assert untiled >= s * 3 * ffn * 4
    assert tiled <= bound, (tiled, bound, one_tile, untiled)
    assert tiled * 3 < untiled, (tiled, untiled)


def test_extra_generator_hooks_and_autocast_are_replayed():
    """rng_state_hooks restore a generator torch does not know about; autocast (CPU bf16) is replayed in the
    recompute. Reference: the same tiles run with autograd, keeping the graph (same generator seed)."""
    torch.manual_seed(7)
    model = SwiGLU(16, 32, norm=False)
    gen = torch.Generator()

    def fn(t):
        out, bias = model(t)
        keep = torch.rand(out.shape, generator=gen) > 0.3
        return out * keep, bias

    hooks = (gen.get_state, gen.set_state)
    x = torch.randn(24, 2, 16, requires_grad=True)
    w_out = torch.randn(24, 2, 16)
    params = list(model.parameters())
    for autocast in (False, True):
        gen.manual_seed(11)
        outs = []
        for t in x.split([6, 6, 6, 6], dim=0):  # one autocast region per tile: no weight-cast cache shared by tiles
            with torch.autocast("cpu", dtype=torch.bfloat16, enabled=autocast):
                outs.append(fn(t)[0])
        want = torch.autograd.grad((torch.cat(outs).float() * w_out).sum(), [x, *params], allow_unused=True)
        gen.manual_seed(11)
        with torch.autocast("cpu", dtype=torch.bfloat16, enabled=autocast):
            out, _ = tiled_mlp(fn, x, 4, params=params, rng_state_hooks=hooks)
        assert out.dtype == (torch.bfloat16 if autocast else torch.float32)
        got = torch.autograd.grad((out.float() * w_out).sum(), [x, *params], allow_unused=True)
        assert [g is None for g in got] == [w is None for w in want] == [False, True, False, False, False]
        for g, w in zip(got, want):
            if w is not None:
                assert rel_err(g, w) < 1e-5, (autocast, rel_err(g, w))
