"""Self-test section ``offload``: activation offload + prefetch exactness on a toy model, pinned copy bandwidth,
no host-blocking synchronize in the offloaded step, and the step time with vs without offload."""

from __future__ import annotations

import time
from typing import Dict

import torch

from nemo_longctx.selftest.report import FAIL, INFO, PASS, SKIP, Report


class ToyBlock(torch.nn.Module):
    def __init__(self, d: int) -> None:
        super().__init__()
        self.norm = torch.nn.LayerNorm(d)
        self.fc1 = torch.nn.Linear(d, 4 * d)
        self.fc2 = torch.nn.Linear(4 * d, d)

    def forward(self, x):
        return x + self.fc2(torch.nn.functional.gelu(self.fc1(self.norm(x))))


class ToyModel(torch.nn.Module):
    """A residual MLP stack; with ``engine`` each block's saved tensors go to host (modules mode) or, with
    ``checkpointed``, each block is checkpointed and its input offloaded (layer_input mode)."""

    def __init__(self, layers: int, d: int) -> None:
        super().__init__()
        self.blocks = torch.nn.ModuleList(ToyBlock(d) for _ in range(layers))

    def forward(self, x, engine=None, checkpointed: bool = False):
        from torch.utils.checkpoint import checkpoint

        h = x
        for i, blk in enumerate(self.blocks):
            if checkpointed:
                call = (lambda f, a: checkpoint(f, a, use_reentrant=False))
            else:
                call = (lambda f, a: f(a))
            if engine is not None:
                h = engine.run_in_scope(i, call, blk, h)
            else:
                h = call(blk, h)
        return h.float().square().mean()


def offload_step(model: ToyModel, x, engine=None, checkpointed: bool = False):
    for p in model.parameters():
        p.grad = None
    loss = model(x, engine=engine, checkpointed=checkpointed)
    loss.backward()
    return loss.detach(), [p.grad.detach().clone() for p in model.parameters()]


def offload_exactness(device: torch.device, dtype: torch.dtype, layers: int, d: int, tokens: int
                      ) -> Dict[str, object]:
    """Loss and gradients with offload (modules mode and checkpointed layer_input mode) vs without."""
    from nemo_longctx.memory import ActivationOffloader

    torch.manual_seed(0)
    model = ToyModel(layers, d).to(device=device, dtype=dtype)
    x = torch.randn(tokens, d, device=device, dtype=dtype)
    out = {}
    for mode, ckpt in (("modules", False), ("layer_input", True)):
        ref_loss, ref_grads = offload_step(model, x, None, ckpt)
        engine = ActivationOffloader(min_bytes=1024, prefetch_depth=1)
        loss, grads = offload_step(model, x, engine, ckpt)
        loss2, grads2 = offload_step(model, x, engine, ckpt)  # second step reuses the pool
        exact = (torch.equal(loss, ref_loss) and torch.equal(loss2, ref_loss)
                 and all(torch.equal(a, b) for a, b in zip(grads + grads2, ref_grads + ref_grads)))
        diff = max(float((a.double() - b.double()).abs().max()) for a, b in zip(grads, ref_grads))
        out[mode] = dict(exact=exact, max_grad_diff=diff, bytes=engine.bytes_offloaded // 2,
                         pool_in_use=engine.pool.bytes_in_use, release_errors=engine.release_errors,
                         pinned=engine.pool.pin_memory)
    return out


def pinned_bandwidth(device: torch.device, nbytes: int = 256 * 2**20, repeats: int = 5) -> Dict[str, float]:
    """D2H and H2D GB/s between device memory and a pinned host buffer."""
    host = torch.empty(nbytes, dtype=torch.uint8, pin_memory=True)
    dev = torch.empty(nbytes, dtype=torch.uint8, device=device)
    res = {}
    for name, dst, src in (("d2h", host, dev), ("h2d", dev, host)):
        dst.copy_(src, non_blocking=True)
        torch.cuda.synchronize(device)
        t0 = time.perf_counter()
        for _ in range(repeats):
            dst.copy_(src, non_blocking=True)
        torch.cuda.synchronize(device)
        res[name] = nbytes * repeats / (time.perf_counter() - t0) / 1e9
    return res


def offload_overlap(device: torch.device, dtype: torch.dtype, layers: int, d: int, tokens: int, steps: int = 5
                    ) -> Dict[str, float]:
    """Median step time without offload, with layer_input offload (checkpointed, prefetch 1) and the count of
    host-blocking synchronize calls (Event/Stream/device) made during the offloaded steps (must be 0)."""
    from nemo_longctx.memory import ActivationOffloader

    torch.manual_seed(0)
    model = ToyModel(layers, d).to(device=device, dtype=dtype)
    x = torch.randn(tokens, d, device=device, dtype=dtype)
    engine = ActivationOffloader(min_bytes=1024, prefetch_depth=1)
    calls = {"n": 0}
    orig_event_sync, orig_stream_sync = torch.cuda.Event.synchronize, torch.cuda.Stream.synchronize
    orig_sync = torch.cuda.synchronize

    def counting(orig):
        def f(self, *a, **k):
            calls["n"] += 1
            return orig(self, *a, **k)
        return f

    def timed(eng, count=False):
        times = []
        for i in range(steps + 1):
            torch.cuda.synchronize(device)
            t0 = time.perf_counter()
            if count:
                torch.cuda.Event.synchronize = counting(orig_event_sync)
                torch.cuda.Stream.synchronize = counting(orig_stream_sync)
                torch.cuda.synchronize = lambda *a, **k: (calls.__setitem__("n", calls["n"] + 1), orig_sync(*a, **k))
            try:
                for p in model.parameters():
                    p.grad = None
                model(x, engine=eng, checkpointed=True).backward()
            finally:
                torch.cuda.Event.synchronize, torch.cuda.Stream.synchronize = orig_event_sync, orig_stream_sync
                torch.cuda.synchronize = orig_sync
            torch.cuda.synchronize(device)
            if i:
                times.append(time.perf_counter() - t0)
        times.sort()
        return times[len(times) // 2]

    t_base = timed(None)
    t_off = timed(engine, count=True)
    t_base2 = timed(None)
    base = min(t_base, t_base2)
    return dict(t_base=base, t_offload=t_off, overhead=t_off / base - 1.0, host_syncs=calls["n"],
                bytes_per_step=engine.bytes_offloaded / (steps + 1))


def section_offload(rep: Report, cuda: bool, quick: bool) -> None:
    cpu = torch.device("cpu")
    res = offload_exactness(cpu, torch.float32, layers=4, d=64, tokens=256)
    for mode, r in res.items():
        ok = r["exact"] and r["pool_in_use"] == 0 and r["release_errors"] == 0
        rep.add("offload", f"{mode} exact", "cpu", "fp32", PASS if ok else FAIL,
                f"loss+grads bit-exact={r['exact']} (max diff {r['max_grad_diff']:.1e}), "
                f"{r['bytes'] / 2**20:.2f} MiB offloaded/step, pool in use after {r['pool_in_use']}, "
                f"release errors {r['release_errors']}")
    if not cuda:
        rep.add("offload", "CUDA streams + pinned", "cuda", "-", SKIP, "skipped: no CUDA")
        return
    dev = torch.device("cuda", torch.cuda.current_device())
    res = offload_exactness(dev, torch.bfloat16, layers=4, d=1024, tokens=4096)
    for mode, r in res.items():
        ok = r["exact"] and r["pool_in_use"] == 0 and r["release_errors"] == 0 and r["pinned"]
        rep.add("offload", f"{mode} exact", "cuda", "bf16", PASS if ok else FAIL,
                f"loss+grads bit-exact={r['exact']} (max diff {r['max_grad_diff']:.1e}), pinned={r['pinned']}, "
                f"{r['bytes'] / 2**20:.1f} MiB offloaded/step, release errors {r['release_errors']}")
    bw = pinned_bandwidth(dev)
    rep.add("offload", "pinned copy bandwidth", "cuda", "u8", INFO,
            f"D2H {bw['d2h']:.1f} GB/s, H2D {bw['h2d']:.1f} GB/s (256 MiB)")
    layers, d, tokens = (8, 2048, 8192) if not quick else (4, 1024, 4096)
    ov = offload_overlap(dev, torch.bfloat16, layers, d, tokens)
    rep.add("offload", "no host sync in hooks", "cuda", "bf16", PASS if ov["host_syncs"] == 0 else FAIL,
            f"Event/Stream.synchronize calls during offloaded steps: {ov['host_syncs']}")
    rep.add("offload", "overlap (step time)", "cuda", "bf16", INFO,
            f"{layers} layers d={d} tokens={tokens}, checkpointed: no offload {ov['t_base'] * 1e3:.1f} ms, "
            f"layer_input offload {ov['t_offload'] * 1e3:.1f} ms ({ov['overhead'] * 100:+.1f}%), "
            f"{ov['bytes_per_step'] / 2**20:.0f} MiB/step each way")
