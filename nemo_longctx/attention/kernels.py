"""Local attention block kernels that return the softmax log-sum-exp next to the output.

Every kernel works on one (query block, key/value block) pair in our layout:

    q      [b, sq, hq, d]
    k, v   [b, sk, hkv, d]     hq % hkv == 0 (GQA/MQA heads are never repeated by the caller)
    out    [b, sq, hq, d]      same dtype as q
    lse    [b, hq, sq]         float32 (float64 for float64 inputs), natural log of the softmax denominator

``causal=True`` means top-left aligned causal masking, i.e. query i sees keys 0..i; it is only used on
diagonal blocks where sq == sk. ``backward(dout, q, k, v, out, lse, ...)`` returns ``(dq, dk, dv)`` with
the shapes of q, k, v. ``out`` and ``lse`` may be the *final* merged values of the whole row (not this
block's own): that is how ring attention computes per-block gradients.

Kernels:
  * ``cpu_flash``  torch's fused CPU flash attention op pair (GQA-native).
  * ``flash_attn`` the flash-attn package on CUDA (GQA-native), when importable.
  * ``sdpa_cuda``  torch's CUDA memory-efficient SDPA op pair (returns LSE); KV heads are expanded locally
                   for the kernel only and gradients are summed back per KV head.
  * ``math``       plain matmul/softmax reference, any device and dtype, computed in float32 (or float64).

``select_kernel(device, dtype, name="auto")`` picks one; ``NEMO_LONGCTX_ATTN_KERNEL`` overrides "auto".
The choice is logged once per (device type, dtype, kernel).
"""

from __future__ import annotations

import logging
import math
import os
from dataclasses import dataclass
from typing import Callable, Dict, Optional, Tuple

import torch

log = logging.getLogger(__name__)

Tensor = torch.Tensor
ForwardFn = Callable[[Tensor, Tensor, Tensor, bool, float], Tuple[Tensor, Tensor]]
BackwardFn = Callable[[Tensor, Tensor, Tensor, Tensor, Tensor, Tensor, bool, float], Tuple[Tensor, Tensor, Tensor]]

KERNEL_ENV_VAR = "NEMO_LONGCTX_ATTN_KERNEL"


@dataclass(frozen=True)
class AttentionKernel:
    """A named forward/backward pair with the contract described in the module docstring."""

    name: str
    forward: ForwardFn
    backward: BackwardFn

    def __repr__(self) -> str:  # pragma: no cover - cosmetic
        return f"AttentionKernel({self.name})"


def default_softmax_scale(head_dim: int) -> float:
    return 1.0 / math.sqrt(head_dim)


def resolve_softmax_scale(softmax_scale: Optional[float], head_dim: int) -> float:
    """``softmax_scale`` as a float, or 1/sqrt(head_dim) when it is None."""
    return default_softmax_scale(head_dim) if softmax_scale is None else float(softmax_scale)


# --------------------------------------------------------------------------------------------------------
# cpu_flash: torch.ops.aten._scaled_dot_product_flash_attention_for_cpu (+ _backward).
# The op takes [b, h, s, d] views; transposing our [b, s, h, d] tensors is free, and its outputs and
# gradients are allocated in [b, s, h, d] memory order, so transposing back is free too.
# --------------------------------------------------------------------------------------------------------


def _cpu_flash_forward(q: Tensor, k: Tensor, v: Tensor, causal: bool, scale: float) -> Tuple[Tensor, Tensor]:
    out, lse = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu(
        q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), 0.0, causal, attn_mask=None, scale=scale
    )
    return out.transpose(1, 2), lse


def _cpu_flash_backward(
    dout: Tensor, q: Tensor, k: Tensor, v: Tensor, out: Tensor, lse: Tensor, causal: bool, scale: float
) -> Tuple[Tensor, Tensor, Tensor]:
    dq, dk, dv = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu_backward(
        dout.transpose(1, 2),
        q.transpose(1, 2),
        k.transpose(1, 2),
        v.transpose(1, 2),
        out.transpose(1, 2),
        lse,
        0.0,
        causal,
        attn_mask=None,
        scale=scale,
    )
    return dq.transpose(1, 2), dk.transpose(1, 2), dv.transpose(1, 2)


# --------------------------------------------------------------------------------------------------------
# math: the reference. Grouped-query attention without repeating heads: q is viewed as
# [b, sq, hkv, group, d] so each KV head serves its group of query heads.
# --------------------------------------------------------------------------------------------------------


def _math_compute_dtype(dtype: torch.dtype) -> torch.dtype:
    return torch.float64 if dtype == torch.float64 else torch.float32


def _math_scores(q: Tensor, k: Tensor, causal: bool, scale: float) -> Tensor:
    """Scaled scores [b, hkv, group, sq, sk] in the compute dtype, masked with -inf above the diagonal."""
    b, sq, hq, d = q.shape
    hkv = k.shape[2]
    ct = _math_compute_dtype(q.dtype)
    qg = q.to(ct).view(b, sq, hkv, hq // hkv, d)
    scores = torch.einsum("bshgd,bthd->bhgst", qg, k.to(ct)) * scale
    if causal:
        sk = k.shape[1]
        keep = torch.ones(sq, sk, dtype=torch.bool, device=q.device).tril()
        scores = scores.masked_fill(~keep, float("-inf"))
    return scores


def _math_forward(q: Tensor, k: Tensor, v: Tensor, causal: bool, scale: float) -> Tuple[Tensor, Tensor]:
    b, sq, hq, d = q.shape
    scores = _math_scores(q, k, causal, scale)
    lse = torch.logsumexp(scores, dim=-1)  # [b, hkv, g, sq]
    probs = torch.exp(scores - lse.unsqueeze(-1))
    out = torch.einsum("bhgst,bthd->bshgd", probs, v.to(scores.dtype)).reshape(b, sq, hq, d)
    return out.to(q.dtype), lse.reshape(b, hq, sq).to(_math_compute_dtype(q.dtype))


def _math_backward(
    dout: Tensor, q: Tensor, k: Tensor, v: Tensor, out: Tensor, lse: Tensor, causal: bool, scale: float
) -> Tuple[Tensor, Tensor, Tensor]:
    b, sq, hq, d = q.shape
    hkv = k.shape[2]
    g = hq // hkv
    scores = _math_scores(q, k, causal, scale)
    ct = scores.dtype
    probs = torch.exp(scores - lse.to(ct).view(b, hkv, g, sq, 1))
    do = dout.to(ct).view(b, sq, hkv, g, d)
    o = out.to(ct).view(b, sq, hkv, g, d)
    delta = (do * o).sum(-1).permute(0, 2, 3, 1).unsqueeze(-1)  # [b, hkv, g, sq, 1]
    dv = torch.einsum("bhgst,bshgd->bthd", probs, do)
    dp = torch.einsum("bshgd,bthd->bhgst", do, v.to(ct))
    ds = probs * (dp - delta) * scale
    dq = torch.einsum("bhgst,bthd->bshgd", ds, k.to(ct)).reshape(b, sq, hq, d)
    dk = torch.einsum("bhgst,bshgd->bthd", ds, q.to(ct).view(b, sq, hkv, g, d))
    return dq.to(q.dtype), dk.to(k.dtype), dv.to(v.dtype)


# --------------------------------------------------------------------------------------------------------
# CUDA kernels (optional fast paths; imported lazily).
# --------------------------------------------------------------------------------------------------------


def _flash_attn_available() -> bool:
    try:
        import flash_attn  # noqa: F401
    except Exception:
        return False
    return True


def _flash_attn_forward(q: Tensor, k: Tensor, v: Tensor, causal: bool, scale: float) -> Tuple[Tensor, Tensor]:
    from flash_attn.flash_attn_interface import _flash_attn_forward as fa_fwd

    res = fa_fwd(q, k, v, 0.0, scale, causal=causal, window_size_left=-1, window_size_right=-1,
                 softcap=0.0, alibi_slopes=None, return_softmax=False)
    out, lse = res[0], res[1]
    return out, lse[..., : q.shape[1]].float()


def _flash_attn_backward(
    dout: Tensor, q: Tensor, k: Tensor, v: Tensor, out: Tensor, lse: Tensor, causal: bool, scale: float
) -> Tuple[Tensor, Tensor, Tensor]:
    from flash_attn.flash_attn_interface import _flash_attn_backward as fa_bwd

    dq, dk, dv = torch.empty_like(q), torch.empty_like(k), torch.empty_like(v)
    fa_bwd(dout.contiguous(), q, k, v, out.to(q.dtype).contiguous(), lse.contiguous(), dq, dk, dv, 0.0, scale,
           causal, -1, -1, 0.0, None, False, rng_state=None)
    return dq, dk, dv


def _expand_kv(x: Tensor, group: int) -> Tensor:
    return x if group == 1 else x.repeat_interleave(group, dim=2)


def _sum_kv_grad(dx: Tensor, group: int) -> Tensor:
    if group == 1:
        return dx
    b, s, hq, d = dx.shape
    return dx.view(b, s, hq // group, group, d).sum(3)


def _sdpa_cuda_forward(q: Tensor, k: Tensor, v: Tensor, causal: bool, scale: float) -> Tuple[Tensor, Tensor]:
    g = q.shape[2] // k.shape[2]
    out, lse, _, _ = torch.ops.aten._scaled_dot_product_efficient_attention(
        q.transpose(1, 2), _expand_kv(k, g).transpose(1, 2), _expand_kv(v, g).transpose(1, 2), None, True,
        0.0, causal, scale=scale,
    )
    return out.transpose(1, 2), lse[..., : q.shape[1]].float()


def _sdpa_cuda_backward(
    dout: Tensor, q: Tensor, k: Tensor, v: Tensor, out: Tensor, lse: Tensor, causal: bool, scale: float
) -> Tuple[Tensor, Tensor, Tensor]:
    g = q.shape[2] // k.shape[2]
    philox = torch.zeros(2, dtype=torch.int64, device=q.device)
    dq, dk, dv, _ = torch.ops.aten._scaled_dot_product_efficient_attention_backward(
        dout.transpose(1, 2), q.transpose(1, 2), _expand_kv(k, g).transpose(1, 2), _expand_kv(v, g).transpose(1, 2),
        None, out.to(q.dtype).transpose(1, 2), lse.contiguous(), philox, philox, 0.0, [True, True, True, False],
        causal, scale=scale,
    )
    return dq.transpose(1, 2), _sum_kv_grad(dk.transpose(1, 2), g), _sum_kv_grad(dv.transpose(1, 2), g)


KERNELS: Dict[str, AttentionKernel] = {
    "cpu_flash": AttentionKernel("cpu_flash", _cpu_flash_forward, _cpu_flash_backward),
    "math": AttentionKernel("math", _math_forward, _math_backward),
    "flash_attn": AttentionKernel("flash_attn", _flash_attn_forward, _flash_attn_backward),
    "sdpa_cuda": AttentionKernel("sdpa_cuda", _sdpa_cuda_forward, _sdpa_cuda_backward),
}

_logged_choices: set = set()


def _auto_kernel_name(device: torch.device, dtype: torch.dtype) -> str:
    if dtype == torch.float64:
        return "math"
    if device.type == "cpu":
        return "cpu_flash"
    if device.type == "cuda":
        if dtype in (torch.float16, torch.bfloat16) and _flash_attn_available():
            return "flash_attn"
        return "sdpa_cuda"
    return "math"


def select_kernel(device: torch.device, dtype: torch.dtype, name: Optional[str] = None) -> AttentionKernel:
    """Return the kernel for ``device``/``dtype``.

    ``name`` is one of ``KERNELS`` or ``"auto"``/None; with "auto" the environment variable
    ``NEMO_LONGCTX_ATTN_KERNEL`` (if set) wins, otherwise: float64 -> math, CPU -> cpu_flash,
    CUDA half/bf16 -> flash_attn if importable else sdpa_cuda, anything else -> math.
    """
    requested = name or "auto"
    if requested == "auto":
        requested = os.environ.get(KERNEL_ENV_VAR, "auto") or "auto"
    chosen = _auto_kernel_name(torch.device(device), dtype) if requested == "auto" else requested
    if chosen not in KERNELS:
        raise ValueError(f"unknown attention kernel {chosen!r}; choose one of {sorted(KERNELS)} or 'auto'")
    if chosen == "cpu_flash" and torch.device(device).type != "cpu":
        raise ValueError(f"attention kernel 'cpu_flash' needs CPU tensors, got device {device}")
    if chosen in ("flash_attn", "sdpa_cuda") and torch.device(device).type != "cuda":
        raise ValueError(f"attention kernel {chosen!r} needs CUDA tensors, got device {device}")
    if chosen == "flash_attn" and not _flash_attn_available():
        raise ValueError("attention kernel 'flash_attn' requested but the flash_attn package is not importable")
    key = (torch.device(device).type, dtype, chosen)
    if key not in _logged_choices:
        _logged_choices.add(key)
        log.info("nemo_longctx attention kernel: %s (device=%s, dtype=%s)", chosen, key[0], dtype)
    return KERNELS[chosen]
