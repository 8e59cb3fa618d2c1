"""full_keep_attn building block: a toy "layer" (linear -> ring attention -> linear, dropout, residual) under
reentrant torch.utils.checkpoint keeps (out, lse) so backward runs no forward ring pass; grads must equal the
plain (no checkpoint) path, on one process and on 2 gloo ranks, incl. several microbatches. With each checkpoint
call inside an activation-offload scope (offload=layer_input), the kept out/LSE go to the host pool with the
layer input: nothing per layer stays on the device, gradients unchanged."""

from __future__ import annotations

import torch
import torch.nn as nn
from torch.utils.checkpoint import checkpoint

from distributed import run_distributed

HQ, HKV, D, HID = 4, 2, 8, 32


class _AttnLayer(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.qkv = nn.Linear(HID, (HQ + 2 * HKV) * D)
        self.proj = nn.Linear(HQ * D, HID)
        self.drop = nn.Dropout(0.25)

    def forward(self, x, group, causal, attn):
        b, s, _ = x.shape
        q, k, v = self.qkv(x).split([HQ * D, HKV * D, HKV * D], dim=-1)
        q, k, v = q.reshape(b, s, HQ, D), k.reshape(b, s, HKV, D), v.reshape(b, s, HKV, D)
        o = attn(q, k, v, group, causal)
        return x + self.drop(self.proj(o.reshape(b, s, HQ * D)))


def _make_model(layers: int = 2):
    torch.manual_seed(11)
    return nn.ModuleList(_AttnLayer() for _ in range(layers))


def _forward(model, x, group, causal, mode, cache, offloader=None):
    from nemo_longctx.attention import ring_attention
    from nemo_longctx.memory.keep_attention import kept_ring_attention

    h = x
    for i, layer in enumerate(model):
        if mode in ("keep", "keep_offload"):
            def attn(q, k, v, g, c, i=i):
                return kept_ring_attention(q, k, v, g, c, cache=cache, key=i, training=layer.training)
        else:
            def attn(q, k, v, g, c):
                return ring_attention(q, k, v, g, c)
        if mode == "plain":
            h = layer(h, group, causal, attn)
        elif offloader is not None:
            h = offloader.run_in_scope(i, checkpoint, layer, h, group, causal, attn, use_reentrant=True)
        else:
            h = checkpoint(layer, h, group, causal, attn, use_reentrant=True)
    return h


def _cases(group, world_size, rank):
    """Per case: grads/losses/bytes for plain, checkpoint + kept attention, checkpoint + plain ring attention."""
    from nemo_longctx.attention import count_bytes_sent, zigzag_shard
    from nemo_longctx.memory.keep_attention import KeptAttentionCache
    from nemo_longctx.memory.offload import ActivationOffloader
    from nemo_longctx.memory.tracker import ActivationTracker

    results = []
    for causal, b, s_global, microbatches in ((True, 2, 8 * world_size, 1), (False, 1, 12 * world_size, 1),
                                              (True, 1, 4 * world_size, 3)):
        model = _make_model()
        gen = torch.Generator().manual_seed(5)
        xs = [zigzag_shard(torch.randn(b, s_global, HID, generator=gen), 1, world_size, rank).requires_grad_()
              for _ in range(microbatches)]
        out = {}
        for mode in ("plain", "keep", "ckpt", "keep_offload", "ckpt_offload"):
            model.zero_grad(set_to_none=True)
            for x in xs:
                x.grad = None
            cache = KeptAttentionCache()
            offloader = ActivationOffloader(min_bytes=0, device="cpu") if mode.endswith("_offload") else None
            torch.manual_seed(100 + rank)  # dropout masks: same per mode, different per rank
            with ActivationTracker("cpu", params=model.parameters(), count_peak=False) as tr, \
                    count_bytes_sent() as sent:
                losses = [_forward(model, x * 1, group, causal, mode.replace("ckpt_offload", "ckpt"), cache,
                                   offloader).square().mean() for x in xs]
                kept = cache.peak_bytes_held
                for loss in losses:  # all forwards first, then the backwards: FIFO per layer
                    loss.backward()
            cache.check_empty()
            st = tr.stats()
            out[mode] = dict(losses=[l.detach() for l in losses],
                             grads=[p.grad.clone() for p in model.parameters()] + [x.grad for x in xs],
                             bytes=sent.bytes_sent, kept=kept, saved=st.activation_bytes_device,
                             host=st.activation_bytes_host, kept_offloaded=cache.bytes_offloaded,
                             live=len(offloader.live_groups()) if offloader is not None else 0)
        results.append(dict(causal=causal, b=b, s_local=s_global // world_size, mb=microbatches, **out))
    return results


def _push_without_grad(times, q, kv, group, cache, key):
    from nemo_longctx.memory.keep_attention import kept_ring_attention

    with torch.no_grad():
        for _ in range(times):
            kept_ring_attention(q, kv, kv, group, cache=cache, key=key)


def _misuse(group, world_size):
    from nemo_longctx.memory.keep_attention import KeptAttentionCache, kept_ring_attention

    errors = {}
    s = 4
    q, kv = torch.randn(1, s, HQ, D), torch.randn(1, s, HKV, D)
    cache = KeptAttentionCache(max_entries_per_key=2)
    with torch.no_grad():
        out = kept_ring_attention(q, kv, kv, group, cache=cache, key="a")
    q2 = torch.randn(1, s, HQ, D // 2, requires_grad=True)
    kv2 = torch.randn(1, s, HKV, D // 2, requires_grad=True)
    for name, fn in {
        "shape": lambda: kept_ring_attention(q2, kv2, kv2, group, cache=cache, key="a"),
        "leftover": lambda: cache.check_empty("after step 3"),
        "inplace": lambda: (out.add_(1), kept_ring_attention(q.requires_grad_(), kv, kv, group, cache=cache,
                                                             key="a")),
        "overflow": lambda: _push_without_grad(3, q.detach(), kv, group, cache, "b"),
        "key": lambda: kept_ring_attention(q, kv, kv, group, cache=cache, key=None),
        "cache": lambda: kept_ring_attention(q, kv, kv, group, cache={}, key=1),
    }.items():
        try:
            fn()
            errors[name] = None
        except (RuntimeError, ValueError) as e:
            errors[name] = f"{type(e).__name__}: {e}"
    # evaluation under no_grad with training=False keeps nothing
    cache.clear()
    with torch.no_grad():
        kept_ring_attention(q.detach(), kv, kv, group, cache=cache, key="e", training=False)
    errors["eval_kept"] = len(cache)
    return errors


def _convert(obj, fn):
    """Apply ``fn`` to every leaf of nested dicts/lists (tensors cross process boundaries as numpy)."""
    if isinstance(obj, dict):
        return {k: _convert(v, fn) for k, v in obj.items()}
    if isinstance(obj, list):
        return [_convert(v, fn) for v in obj]
    return fn(obj)


def _worker(rank, world_size):
    import torch.distributed as dist

    res = dict(cases=_cases(dist.group.WORLD, world_size, rank), misuse=_misuse(dist.group.WORLD, world_size))
    return _convert(res, lambda v: v.numpy() if isinstance(v, torch.Tensor) else v)


def _check(results, world_size):
    for r in results["cases"]:
        plain, keep, ckpt = r["plain"], r["keep"], r["ckpt"]
        keep_off, ckpt_off = r["keep_offload"], r["ckpt_offload"]
        for mode in (keep, ckpt, keep_off, ckpt_off):
            for a, b in zip(mode["losses"], plain["losses"]):
                assert torch.equal(a, b), r["causal"]
            for g, want in zip(mode["grads"], plain["grads"]):
                torch.testing.assert_close(g, want, rtol=1e-6, atol=1e-7)
        # kept: out [b, s, hq, d] fp32 + lse [b, hq, s] fp32 per layer and microbatch
        per_layer = r["b"] * r["s_local"] * HQ * (D + 1) * 4
        assert keep["kept"] == 2 * r["mb"] * per_layer
        assert ckpt["kept"] == plain["kept"] == 0
        # kept attention is observable in the tracker: the checkpoint inputs plus the kept out/lse
        assert keep["saved"] == ckpt["saved"] + keep["kept"]
        # offload=layer_input: the kept out/lse join the layer input on the host; the device keeps what plain
        # checkpoint + offload keeps (nothing per layer) and the host holds exactly the kept bytes more
        assert keep_off["kept"] == keep["kept"] and keep_off["kept_offloaded"] == keep["kept"] * 1
        assert keep_off["saved"] == ckpt_off["saved"] < ckpt["saved"]
        assert keep_off["host"] == ckpt_off["host"] + keep["kept"]
        assert keep_off["live"] == ckpt_off["live"] == 0
        if world_size > 1:
            assert plain["bytes"] > 0
            assert keep["bytes"] == keep_off["bytes"] == plain["bytes"]  # backward ran no forward ring pass
            # plain checkpoint pays one extra forward ring pass per layer and microbatch
            fwd_pass = (world_size - 1) * 2 * r["b"] * r["s_local"] * HKV * D * 4
            assert ckpt["bytes"] == plain["bytes"] + 2 * r["mb"] * fwd_pass
    m = results["misuse"]
    assert "does not match the kept forward" in m["shape"], m
    assert "after step 3" in m["leftover"] and "never" in m["leftover"], m
    assert "modified in place" in m["inplace"], m
    assert "already holds 2 entries" in m["overflow"], m
    assert m["key"].startswith("ValueError") and "key" in m["key"], m
    assert m["cache"].startswith("ValueError") and "KeptAttentionCache" in m["cache"], m
    assert m["eval_kept"] == 0


def test_keep_attention_single_process():
    _check(_worker_local(), 1)


def _worker_local():
    return dict(cases=_cases(None, 1, 0), misuse=_misuse(None, 1))


def test_keep_attention_two_gloo_ranks():
    import numpy as np

    for results in run_distributed(_worker, 2):
        _check(_convert(results, lambda v: torch.from_numpy(v) if isinstance(v, np.ndarray) else v), 2)
