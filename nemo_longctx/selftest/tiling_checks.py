"""Self-test section ``tiling``: tiled MLP and chunked output layer + loss vs untiled, both vs fp64."""

from __future__ import annotations

import math
from typing import Dict

import torch

from nemo_longctx.attention import kernels as K
from nemo_longctx.selftest.report import FAIL, PASS, SKIP, Report, dtype_label, format_error


def tiling_errors(device: torch.device, dtype: torch.dtype, s: int = 512, h: int = 64, vocab: int = 1000
                  ) -> Dict[str, Dict[str, float]]:
    """Relative errors vs fp64 of tiled vs untiled MLP and chunked vs full-logit loss (outputs and grads)."""
    import torch.nn.functional as F

    from nemo_longctx.memory import chunked_output_cross_entropy, tiled_mlp

    g = torch.Generator().manual_seed(0)
    b = 1
    mlp64 = torch.nn.Sequential(torch.nn.Linear(h, 4 * h), torch.nn.GELU(), torch.nn.Linear(4 * h, h)).double()
    x0 = torch.randn(s, b, h, generator=g, dtype=torch.float64)
    gy = torch.randn(s, b, h, generator=g, dtype=torch.float64)

    def mlp_run(model, x, tiles):
        x = x.detach().requires_grad_()
        y = model(x) if tiles is None else tiled_mlp(model, x, tiles, seq_dim=0)
        y.backward(gy.to(device=x.device, dtype=y.dtype))
        return [y.detach(), x.grad] + [p.grad for p in model.parameters()]

    ref = mlp_run(mlp64, x0, None)
    res = {}
    for label, tiles in (("untiled", None), ("tiled", 4)):
        m = torch.nn.Sequential(torch.nn.Linear(h, 4 * h), torch.nn.GELU(), torch.nn.Linear(4 * h, h))
        m.load_state_dict(mlp64.state_dict())
        m = m.to(device=device, dtype=dtype)
        got = mlp_run(m, x0.to(device=device, dtype=dtype), tiles)
        res[f"mlp {label}"] = {"out": K.rel_err(got[0].cpu(), ref[0]), "dx": K.rel_err(got[1].cpu(), ref[1]),
                               "dW": max(K.rel_err(a.cpu(), r) for a, r in zip(got[2:], ref[2:]))}
    hid = torch.randn(s, b, h, generator=g, dtype=torch.float64)
    w = torch.randn(vocab, h, generator=g, dtype=torch.float64) / math.sqrt(h)
    labels = torch.randint(0, vocab, (b, s), generator=g)

    def loss_run(hh, ww, chunks):
        hh, ww = hh.detach().requires_grad_(), ww.detach().requires_grad_()
        if chunks is None:
            logits = torch.einsum("sbh,vh->bsv", hh, ww).float() if hh.dtype != torch.float64 else \
                torch.einsum("sbh,vh->bsv", hh, ww)
            loss = F.cross_entropy(logits.reshape(b * s, vocab), labels.to(hh.device).reshape(-1),
                                   reduction="none").view(b, s)
        else:
            loss = chunked_output_cross_entropy(hh, ww, labels.to(hh.device), chunks)
        loss.sum().backward()
        return [loss.detach(), hh.grad, ww.grad]

    ref = loss_run(hid, w, None)
    for label, chunks in (("untiled", None), ("chunked", 4)):
        got = loss_run(hid.to(device=device, dtype=dtype), w.to(device=device, dtype=dtype), chunks)
        res[f"loss {label}"] = {"loss": K.rel_err(got[0].cpu(), ref[0]), "dh": K.rel_err(got[1].cpu(), ref[1]),
                                "dW": K.rel_err(got[2].cpu(), ref[2])}
    return res


def _tiling_rows(rep: Report, device: torch.device, dtype: torch.dtype) -> None:
    res = tiling_errors(device, dtype)
    tol = K.TOLERANCE[dtype]
    for what, plain, tiled in (("tiled MLP", "mlp untiled", "mlp tiled"), ("chunked loss", "loss untiled",
                                                                           "loss chunked")):
        a, t = res[plain], res[tiled]
        # tiled must be as accurate as untiled in the same dtype (within 2x + a small floor)
        ok = all(t[k2] <= 2 * a[k2] + 0.05 * tol for k2 in a)
        rep.add("tiling", what, device.type, dtype_label(dtype), PASS if ok else FAIL,
                "rel err vs fp64, tiled/untiled: "
                + " ".join(f"{k2} {format_error(t[k2])}/{format_error(a[k2])}" for k2 in a))


def section_tiling(rep: Report, cuda: bool) -> None:
    for dtype in (torch.float32, torch.bfloat16):
        _tiling_rows(rep, torch.device("cpu"), dtype)
    if not cuda:
        rep.add("tiling", "tiled MLP / chunked loss", "cuda", "-", SKIP, "skipped: no CUDA")
        return
    _tiling_rows(rep, torch.device("cuda", torch.cuda.current_device()), torch.bfloat16)
