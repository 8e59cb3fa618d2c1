"""Sequence-chunked layer recompute (memory/sequence_chunks.py) against the unchunked layer, forward and backward.

A toy pre-norm transformer layer in Megatron's [s, b, h] layout (RMSNorm, GQA q/k/v projections, RoPE by absolute
position, core attention, output projection, residual, RMSNorm + SiLU MLP, residual): once as plain autograd with
``local_attention`` as its core attention (the reference), once through ``sequence_chunked_checkpoint`` with
``chunk_core_attention``. Outputs, the input's gradient and every parameter gradient must agree: fp64 <= 1e-10,
fp32 <= 1e-6 (relative to the largest magnitude), for 2, 3 and 8 chunks (uneven last chunks included), causal and
not, GQA and MQA, a value head size that differs from the query's (MLA's shape), sliding windows.
"""

from __future__ import annotations

import math

import pytest
import torch

from nemo_longctx.attention.kernels import select_kernel
from nemo_longctx.attention.ring import local_attention
from nemo_longctx.memory.sequence_chunks import (
    ChunkState,
    active_sequence_chunking,
    auto_sequence_chunks,
    chunk_bounds,
    chunk_core_attention,
    sequence_chunked_checkpoint,
)


class ToyLayer(torch.nn.Module):
    def __init__(self, h=32, hq=4, hkv=2, d=8, dv=8, ffn=48, causal=True, window=None, dtype=torch.float64):
        super().__init__()
        g = torch.Generator().manual_seed(0)
        p = lambda *s: torch.nn.Parameter(torch.randn(*s, generator=g, dtype=dtype) / math.sqrt(s[-1]))  # noqa
        self.hq, self.hkv, self.d, self.dv = hq, hkv, d, dv
        self.causal, self.window = causal, window
        self.n1 = torch.nn.Parameter(1 + 0.1 * torch.randn(h, generator=g, dtype=dtype))
        self.n2 = torch.nn.Parameter(1 + 0.1 * torch.randn(h, generator=g, dtype=dtype))
        self.wq, self.wk, self.wv = p(hq * d, h), p(hkv * d, h), p(hkv * dv, h)
        self.wo, self.w1, self.w2 = p(h, hq * dv), p(2 * ffn, h), p(h, ffn)
        self.kernel = select_kernel(torch.device("cpu"), dtype)
        self.cp_group = None  # the ring CP group its chunked core attention runs under (test_sequence_chunks_cp)
        self.ulysses_group = None  # and the Ulysses group (Ulysses or hybrid CP)

    @staticmethod
    def norm(x, w):
        return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + 1e-6) * w

    def rope(self, t, start):  # t [s, b, h, d]; start: the first position, or every row's position (a tensor)
        s, d = t.shape[0], t.shape[-1]
        pos = (start.to(t.dtype) if torch.is_tensor(start) else torch.arange(start, start + s, dtype=t.dtype))
        pos = pos.unsqueeze(1)
        freqs = pos / (10000 ** (torch.arange(0, d, 2, dtype=t.dtype) / d))
        cos, sin = freqs.cos()[:, None, None, :], freqs.sin()[:, None, None, :]
        t1, t2 = t[..., 0::2], t[..., 1::2]
        return torch.stack((t1 * cos - t2 * sin, t1 * sin + t2 * cos), -1).flatten(-2)

    def forward(self, x, start=0):  # x [s, b, h]
        s, b, _ = x.shape
        y = self.norm(x, self.n1)
        q = self.rope((y @ self.wq.T).view(s, b, self.hq, self.d), start)
        k = self.rope((y @ self.wk.T).view(s, b, self.hkv, self.d), start)
        v = (y @ self.wv.T).view(s, b, self.hkv, self.dv)
        q, k, v = (t.transpose(0, 1) for t in (q, k, v))  # [b, s, h, d]
        if active_sequence_chunking() is not None:
            o = chunk_core_attention(q, k.contiguous(), v.contiguous(), causal=self.causal,
                                     scale=1 / math.sqrt(self.d), kernel=self.kernel, window_size=self.window,
                                     group=self.cp_group, ulysses_group=self.ulysses_group)
        else:
            o = local_attention(q, k, v, self.causal, kernel=self.kernel.name, window_size=self.window)
        x = x + o.transpose(0, 1).reshape(s, b, -1) @ self.wo.T
        a, g = (self.norm(x, self.n2) @ self.w1.T).chunk(2, -1)
        return x + (torch.nn.functional.silu(a) * g) @ self.w2.T


def _grads(layer, x, chunks=None, kv_first=False, params=True):
    layer.zero_grad()
    x = x.detach().clone().requires_grad_(True)
    if chunks is None:
        y = layer(x)
    else:
        y = sequence_chunked_checkpoint(lambda xc, a, b: layer(xc, a), x, chunks, kv_first=kv_first,
                                        params=list(layer.parameters()) if params else None)
    dy = torch.randn(y.shape, generator=torch.Generator().manual_seed(1), dtype=y.dtype)
    y.backward(dy)
    return [y.detach(), x.grad] + [p.grad.clone() for p in layer.parameters()]


def _rel(a, b):
    return ((a - b).abs().max() / b.abs().max().clamp_min(1e-30)).item()


CASES = {  # name: ToyLayer kwargs
    "causal_gqa": dict(),
    "causal_mqa": dict(hkv=1),
    "full_gqa": dict(causal=False),
    "causal_mla_dims": dict(d=12, dv=8),
    "causal_window": dict(window=(7, 0)),
    "full_window": dict(causal=False, window=(5, 3)),
}


@pytest.mark.parametrize("case", sorted(CASES))
@pytest.mark.parametrize("chunks", [2, 3, 8])
@pytest.mark.parametrize("dtype,tol", [(torch.float64, 1e-10), (torch.float32, 1e-6)])
def test_chunked_layer_matches_unchunked(case, chunks, dtype, tol):
    kw = CASES[case]
    layer = ToyLayer(dtype=dtype, **kw)
    x = torch.randn(43, 2, 32, generator=torch.Generator().manual_seed(2), dtype=dtype)
    ref = _grads(layer, x)
    got = _grads(layer, x, chunks, kv_first=not layer.causal)
    names = ["out", "dx"] + [n for n, _ in layer.named_parameters()]
    errs = {n: _rel(g, r) for n, g, r in zip(names, got, ref)}
    assert max(errs.values()) <= tol, errs
    assert all(torch.isfinite(g).all() for g in got)


def test_chunked_forward_without_grad_and_frozen_input():
    layer = ToyLayer()
    x = torch.randn(20, 1, 32, dtype=torch.float64)
    with torch.no_grad():
        ref = layer(x)
        got = sequence_chunked_checkpoint(lambda xc, a, b: layer(xc, a), x, 3)
    assert _rel(got, ref) <= 1e-12
    # an input that does not require grad (frozen embeddings): the parameters still get their gradients
    layer.zero_grad()
    sequence_chunked_checkpoint(lambda xc, a, b: layer(xc, a), x, 3).sum().backward()
    got_w = layer.wq.grad.clone()
    layer.zero_grad()
    layer(x).sum().backward()
    assert _rel(got_w, layer.wq.grad) <= 1e-10


def test_non_causal_layer_without_kv_pass_is_an_error():
    layer = ToyLayer(causal=False)
    x = torch.randn(12, 1, 32, dtype=torch.float64)
    with pytest.raises(RuntimeError, match="K/V pass must run first"):
        sequence_chunked_checkpoint(lambda xc, a, b: layer(xc, a), x, 3)


def test_layer_without_chunk_attention_is_an_error():
    lin = torch.nn.Linear(4, 4).double()
    x = torch.randn(6, 1, 4, dtype=torch.float64, requires_grad=True)
    y = sequence_chunked_checkpoint(lambda xc, a, b: lin(xc), x, 2)
    with pytest.raises(RuntimeError, match="without calling its core attention"):
        y.sum().backward()


def test_chunk_bounds_and_auto():
    assert chunk_bounds(10, 3) == [(0, 4), (4, 7), (7, 10)]
    assert chunk_bounds(8, 8)[-1] == (7, 8)
    for bad in (0, -1, 2.5, True):
        with pytest.raises(ValueError, match="positive int"):
            chunk_bounds(10, bad)
    with pytest.raises(ValueError, match="exceeds the 4 tokens"):
        chunk_bounds(4, 5)
    assert auto_sequence_chunks(16384) == 1 and auto_sequence_chunks(16385) == 2
    assert auto_sequence_chunks(1 << 20) == 64
    assert ChunkState([(0, 3), (3, 5)]).length == 5


def test_backward_keeps_no_full_length_activation_of_the_layer_inside():
    """The largest tensor the chunked backward allocates is layer-input sized ([s, b, h]: the input's gradient) or
    K/V sized; nothing of the MLP's [s, b, 2*ffn] width over the whole sequence (the unchunked layer has it)."""
    layer = ToyLayer(ffn=256)
    s, b, h = 64, 1, 32
    x = torch.randn(s, b, h, dtype=torch.float64, requires_grad=True)
    sizes = []
    params = {p.untyped_storage().data_ptr() for p in layer.parameters()}

    def pack(t):
        if t.untyped_storage().data_ptr() not in params:  # parameters (and views of them) are held anyway
            sizes.append(t.numel())
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        y = sequence_chunked_checkpoint(lambda xc, a, bb: layer(xc, a), x, 8)
        y.sum().backward()
    assert max(sizes) <= s * b * h  # only the layer input is saved at full length
    ffn_full = s * b * 2 * 256
    chunk_ffn = (s // 8) * b * 256  # one chunk of one MLP half (silu(a) * g saves both halves)
    assert max(sizes) < ffn_full and chunk_ffn in sizes


@pytest.mark.parametrize("causal", [True, False])
def test_parameter_gradients_reach_autograd_once_per_backward(causal):
    """With ``params`` every parameter's gradient accumulator runs once per backward however many chunks there are
    (Megatron DDP registers its grad-ready hook there and refuses a second gradient with overlap_grad_reduce); without
    it, once per chunk (and pass). Both sum to the unchunked gradients."""
    layer = ToyLayer(causal=causal)
    x = torch.randn(24, 1, 32, generator=torch.Generator().manual_seed(5), dtype=torch.float64)
    calls, accumulators = {}, []
    for name, p in layer.named_parameters():  # the hook Megatron DDP uses: on the parameter's grad accumulator
        acc = p.expand_as(p).grad_fn.next_functions[0][0]
        acc.register_hook(lambda *_, n=name: calls.__setitem__(n, calls.get(n, 0) + 1))
        accumulators.append(acc)  # kept alive, as Megatron DDP keeps them
    ref = _grads(layer, x)
    calls.clear()
    got = _grads(layer, x, 4, kv_first=not causal)
    assert calls == {n: 1 for n, _ in layer.named_parameters()}
    assert max(_rel(g, r) for g, r in zip(got, ref)) <= 1e-10
    calls.clear()
    got = _grads(layer, x, 4, kv_first=not causal, params=False)
    assert min(calls.values()) >= 4
    assert max(_rel(g, r) for g, r in zip(got, ref)) <= 1e-10


def test_key_pieces_bound_every_kernel_call_to_the_chunk_length():
    """Unmasked blocks are cut along their keys to at most the chunk's query count (the CUDA flash kernels' backward
    buffers grow with a call's keys); the pieces cover exactly the (query, key) pairs of the uncut blocks."""
    from nemo_longctx.attention.window import INF, windowed_blocks
    from nemo_longctx.memory.sequence_chunks import split_key_blocks

    def pairs(blocks):
        return {(i, j) for _, _, kind, (qa, qb, ka, kb) in blocks for i in range(qa, qb) for j in range(ka, kb)
                if kind != "causal" or j <= i}

    for window, (qa, qb), length in (((INF, 0), (48, 64), 64), ((INF, INF), (16, 32), 64), ((20, 0), (40, 60), 60)):
        blocks = list(windowed_blocks([(qa, 0, qb - qa)], [(0, 0, length)], window, qb - qa))
        cut = split_key_blocks(blocks, qb - qa)
        assert pairs(cut) == pairs(blocks)
        assert all(kb - ka <= qb - qa for _, _, kind, (_, _, ka, kb) in cut if kind == "full")
        assert all(ks.stop - ks.start == kb - ka for _, ks, _, (_, _, ka, kb) in cut)
        if window == (INF, 0):
            assert len(cut) > len(blocks)  # the prefix of 48 keys becomes three pieces of 16
