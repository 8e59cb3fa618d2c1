"""Local attention block kernels that return the softmax log-sum-exp next to the output.

Every kernel works on one (query block, key/value block) pair in our layout:

    q      [b, sq, hq, d]
    k      [b, sk, hkv, d]     hq % hkv == 0 (GQA/MQA heads are never repeated by the caller)
    v      [b, sk, hkv, dv]    dv == d unless the kernel's ``value_dim_differs`` is True
    out    [b, sq, hq, dv]     same dtype as q
    lse    [b, hq, sq]         float32 (float64 for float64 inputs), natural log of the softmax denominator

``causal=True`` means top-left aligned causal masking, i.e. query i sees keys 0..i; it is only used on
diagonal blocks where sq == sk. ``backward(dout, q, k, v, out, lse, ...)`` returns ``(dq, dk, dv)`` with
the shapes of q, k, v. ``out`` and ``lse`` may be the *final* merged values of the whole row (not this
block's own): that is how ring attention computes per-block gradients (the "split-KV contract").

Kernels:
  * ``cpu_flash``   torch's fused CPU flash attention op pair (GQA-native). The op needs one head size for
                    q, k and v: with dv != d the operands are zero-padded to max(d, dv) (exact; costs a
                    padded copy and the matmuls at the padded width).
  * ``flash_attn``  the flash-attn package on CUDA (GQA-native), 2.6.x and 2.7+ APIs, detected from the
                    signature of ``flash_attn.flash_attn_interface._flash_attn_forward`` (not a version string).
  * ``sdpa_flash``  torch's CUDA flash op pair ``aten._scaled_dot_product_flash_attention(_backward)``
                    (returns the LSE; GQA-native: KV heads are passed unrepeated).
  * ``sdpa_cudnn``  torch's cuDNN SDPA op pair (``aten._scaled_dot_product_cudnn_attention(_backward)``).
  * ``sdpa_cuda``   torch's CUDA memory-efficient SDPA op pair (returns LSE; fp32 too); it is *not* GQA-native:
                    KV heads are expanded locally for the kernel and gradients summed back per KV head (a
                    warning is logged the first time that happens).
  * ``math``        plain matmul/softmax reference, any device and dtype, computed in float32 (or float64).

``select_kernel(device, dtype, name="auto")`` picks one; ``NEMO_LONGCTX_ATTN_KERNEL`` overrides "auto".
Automatic order on CUDA for fp16/bf16: a default registered for the device (``register_default_kernel``,
e.g. by ``pick_fastest_exact_kernel`` or ``python -m nemo_longctx.selftest``), else flash_attn (when
importable), else sdpa_flash. CUDA fp32: sdpa_cuda. The choice is logged once per (device type, dtype, kernel).

A flash-attn that is installed but fails to import (anything other than the package being absent, e.g. an
undefined symbol in its CUDA extension) is an error when "auto" would have chosen it, naming the import error.

``self_test_kernel(kernel, device, dtype)`` checks a kernel against the float64 math reference on a small
input (forward, backward, GQA, causal and full, split-KV) and raises ``KernelSelfTestError`` with the
measured errors when it is wrong: an opt-in start-up check for the application.
"""

from __future__ import annotations

import functools
import importlib
import inspect
import logging
import math
import os
import sys
import time
import warnings
from dataclasses import dataclass
from typing import Callable, Dict, List, Optional, Tuple

import torch

log = logging.getLogger(__name__)

Tensor = torch.Tensor
ForwardFn = Callable[[Tensor, Tensor, Tensor, bool, float], Tuple[Tensor, Tensor]]
BackwardFn = Callable[[Tensor, Tensor, Tensor, Tensor, Tensor, Tensor, bool, float], Tuple[Tensor, Tensor, Tensor]]

KERNEL_ENV_VAR = "NEMO_LONGCTX_ATTN_KERNEL"

_HALF = (torch.float16, torch.bfloat16)


@dataclass(frozen=True)
class AttentionKernel:
    """A named forward/backward pair with the contract described in the module docstring.

    ``device_type``: where it runs ("cpu", "cuda" or None for any). ``dtypes``: supported input dtypes (None:
    any). ``gqa_native``: takes hkv < hq without repeating KV heads in memory. ``value_dim_differs``: accepts
    dv != d. ``max_head_dim``: largest supported head dim (None: unbounded).
    """

    name: str
    forward: ForwardFn
    backward: BackwardFn
    device_type: Optional[str] = None
    dtypes: Optional[Tuple[torch.dtype, ...]] = None
    gqa_native: bool = True
    value_dim_differs: bool = False
    max_head_dim: Optional[int] = None

    def __repr__(self) -> str:  # pragma: no cover - cosmetic
        return f"AttentionKernel({self.name})"

    def supports(self, device_type: str, dtype: torch.dtype, head_dim: int = 64,
                 value_dim: Optional[int] = None) -> bool:
        """Whether the kernel's declared capabilities cover this problem."""
        if self.device_type is not None and device_type != self.device_type:
            return False
        if self.dtypes is not None and dtype not in self.dtypes:
            return False
        if self.max_head_dim is not None and max(head_dim, value_dim or head_dim) > self.max_head_dim:
            return False
        if value_dim is not None and value_dim != head_dim and not self.value_dim_differs:
            return False
        return True


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


def _pad_head_dim(x: Tensor, dim: int) -> Tensor:
    """``x`` [..., e] zero-padded to [..., dim] (``x`` itself when e == dim)."""
    e = x.shape[-1]
    return x if e == dim else torch.nn.functional.pad(x, (0, dim - e))


def _cpu_flash_forward(q: Tensor, k: Tensor, v: Tensor, causal: bool, scale: float) -> Tuple[Tensor, Tensor]:
    d, dv = q.shape[-1], v.shape[-1]
    if dv != d:
        # The op wants one head size for q, k and v (MLA: d_qk=192, d_v=128). Zero-padding is exact: zero
        # columns of q/k add 0 to every score (the scale is passed explicitly), zero columns of v give zero
        # output columns, which are sliced off. Cost: one padded copy of the smaller operand(s) and the matmuls
        # of the padded width max(d, dv) (1.5x the P@V work for MLA's 192/128).
        e = max(d, dv)
        out, lse = _cpu_flash_forward(_pad_head_dim(q, e), _pad_head_dim(k, e), _pad_head_dim(v, e), causal, scale)
        return out[..., :dv].contiguous(), lse
    out, lse = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu(
        q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), 0.0, causal, attn_mask=None, scale=scale
    )
    return out.transpose(1, 2), lse


def _cpu_flash_backward(
    dout: Tensor, q: Tensor, k: Tensor, v: Tensor, out: Tensor, lse: Tensor, causal: bool, scale: float
) -> Tuple[Tensor, Tensor, Tensor]:
    d, dv = q.shape[-1], v.shape[-1]
    if dv != d:
        # Padded as in the forward: the padded out/dout columns are zero, so delta = rowsum(dout * out) and
        # every real gradient column are unchanged; the padded gradient columns are sliced off.
        e = max(d, dv)
        dq, dk, dvv = _cpu_flash_backward(
            _pad_head_dim(dout, e), _pad_head_dim(q, e), _pad_head_dim(k, e), _pad_head_dim(v, e),
            _pad_head_dim(out, e), lse, causal, scale)
        return dq[..., :d], dk[..., :d], dvv[..., :dv]
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
# [b, sq, hkv, group, d] so each KV head serves its group of query heads. dv may differ from d.
# --------------------------------------------------------------------------------------------------------


def _math_compute_dtype(dtype: torch.dtype) -> torch.dtype:
    return torch.float64 if dtype == torch.float64 else torch.float32


def _math_scores(q: Tensor, k: Tensor, causal: bool, scale: float, compute_dtype: Optional[torch.dtype] = None
                 ) -> Tensor:
    """Scaled scores [b, hkv, group, sq, sk] in the compute dtype, masked with -inf above the diagonal."""
    b, sq, hq, d = q.shape
    hkv = k.shape[2]
    ct = compute_dtype or _math_compute_dtype(q.dtype)
    qg = q.to(ct).view(b, sq, hkv, hq // hkv, d)
    scores = torch.einsum("bshgd,bthd->bhgst", qg, k.to(ct)) * scale
    if causal:
        sk = k.shape[1]
        keep = torch.ones(sq, sk, dtype=torch.bool, device=q.device).tril()
        scores = scores.masked_fill(~keep, float("-inf"))
    return scores


def _math_forward_impl(q: Tensor, k: Tensor, v: Tensor, causal: bool, scale: float,
                       compute_dtype: Optional[torch.dtype] = None) -> Tuple[Tensor, Tensor]:
    b, sq, hq, _ = q.shape
    dv = v.shape[-1]
    scores = _math_scores(q, k, causal, scale, compute_dtype)
    lse = torch.logsumexp(scores, dim=-1)  # [b, hkv, g, sq]
    probs = torch.exp(scores - lse.unsqueeze(-1))
    out = torch.einsum("bhgst,bthd->bshgd", probs, v.to(scores.dtype)).reshape(b, sq, hq, dv)
    if compute_dtype is not None:
        return out, lse.reshape(b, hq, sq)
    return out.to(q.dtype), lse.reshape(b, hq, sq).to(_math_compute_dtype(q.dtype))


def math_forward(q: Tensor, k: Tensor, v: Tensor, causal: bool, scale: float) -> Tuple[Tensor, Tensor]:
    return _math_forward_impl(q, k, v, causal, scale)


def _math_backward_impl(
    dout: Tensor, q: Tensor, k: Tensor, v: Tensor, out: Tensor, lse: Tensor, causal: bool, scale: float,
    compute_dtype: Optional[torch.dtype] = None,
) -> Tuple[Tensor, Tensor, Tensor]:
    b, sq, hq, d = q.shape
    hkv = k.shape[2]
    dvd = v.shape[-1]
    g = hq // hkv
    scores = _math_scores(q, k, causal, scale, compute_dtype)
    ct = scores.dtype
    probs = torch.exp(scores - lse.to(ct).view(b, hkv, g, sq, 1))
    do = dout.to(ct).view(b, sq, hkv, g, dvd)
    o = out.to(ct).view(b, sq, hkv, g, dvd)
    delta = (do * o).sum(-1).permute(0, 2, 3, 1).unsqueeze(-1)  # [b, hkv, g, sq, 1]
    dv = torch.einsum("bhgst,bshgd->bthd", probs, do)
    dp = torch.einsum("bshgd,bthd->bhgst", do, v.to(ct))
    ds = probs * (dp - delta) * scale
    dq = torch.einsum("bhgst,bthd->bshgd", ds, k.to(ct)).reshape(b, sq, hq, d)
    dk = torch.einsum("bhgst,bshgd->bthd", ds, q.to(ct).view(b, sq, hkv, g, d))
    if compute_dtype is not None:
        return dq, dk, dv
    return dq.to(q.dtype), dk.to(k.dtype), dv.to(v.dtype)


def math_backward(
    dout: Tensor, q: Tensor, k: Tensor, v: Tensor, out: Tensor, lse: Tensor, causal: bool, scale: float
) -> Tuple[Tensor, Tensor, Tensor]:
    return _math_backward_impl(dout, q, k, v, out, lse, causal, scale)


def reference_attention_fp64(q: Tensor, k: Tensor, v: Tensor, dout: Tensor, causal: bool, scale: float
                             ) -> Tuple[Tensor, Tensor, Tensor, Tensor, Tensor]:
    """(out, lse, dq, dk, dv) in float64 on the inputs' device: the reference every kernel is checked against."""
    out, lse = _math_forward_impl(q, k, v, causal, scale, torch.float64)
    dq, dk, dv = _math_backward_impl(dout, q, k, v, out, lse, causal, scale, torch.float64)
    return out, lse, dq, dk, dv


# --------------------------------------------------------------------------------------------------------
# flash-attn (optional package). Two API shapes exist (looked up in Dao-AILab/flash-attention):
#   2.6.x: _flash_attn_forward(q, k, v, dropout_p, softmax_scale, causal, window_size, softcap, alibi_slopes,
#              return_softmax) -> (out, q, k, v, out_padded, softmax_lse, S_dmask, rng_state)
#          _flash_attn_backward(dout, q, k, v, out, softmax_lse, dq, dk, dv, dropout_p, softmax_scale, causal,
#              window_size, softcap, alibi_slopes, deterministic, rng_state=None) -> (dq, dk, dv, softmax_d)
#   2.7+:  _flash_attn_forward(q, k, v, dropout_p, softmax_scale, causal, window_size_left, window_size_right,
#              softcap, alibi_slopes, return_softmax) -> (out, softmax_lse, S_dmask, rng_state)  [a torch custom op]
#          _flash_attn_backward(dout, q, k, v, out, softmax_lse, dq, dk, dv, dropout_p, softmax_scale, causal,
#              window_size_left, window_size_right, softcap, alibi_slopes, deterministic, rng_state=None)
#              -> softmax_d  (dq, dk, dv written in place)
# The API is told apart by the parameter names (``window_size`` vs ``window_size_left``), never by a version
# string; both write dq/dk/dv into the buffers we pass, which is what we use.
# --------------------------------------------------------------------------------------------------------

FLASH_ATTN_TESTED = ">=2.6,<2.9"


class FlashAttnBrokenError(RuntimeError):
    """flash-attn is installed but cannot be imported or has an API we do not know."""


@dataclass(frozen=True)
class FlashAttnAPI:
    """What we detected about the installed flash-attn: ``style`` is "2.6" (window_size tuple, 8 outputs) or
    "2.7" (window_size_left/right, 4 outputs); ``forward``/``backward`` are the interface functions."""

    style: str
    forward: Callable
    backward: Callable
    version: str


def _param_names(fn: Callable) -> List[str]:
    """Parameter names of ``fn``; sees through torch custom ops (``CustomOpDef._init_fn``) and op schemas."""
    target = getattr(fn, "_init_fn", fn)
    try:
        params = list(inspect.signature(target).parameters.values())
    except (TypeError, ValueError):
        params = []
    names = [p.name for p in params if p.kind not in (p.VAR_POSITIONAL, p.VAR_KEYWORD)]
    if not names:
        schema = getattr(getattr(fn, "_opoverload", None), "_schema", None) or getattr(fn, "_schema", None)
        if schema is not None:
            names = [a.name for a in schema.arguments]
    return names


def detect_flash_attn_api(interface) -> FlashAttnAPI:
    """Detect the API shape of a ``flash_attn.flash_attn_interface`` module (real or a test double)."""
    fwd = getattr(interface, "_flash_attn_forward", None)
    bwd = getattr(interface, "_flash_attn_backward", None)
    if fwd is None or bwd is None:
        raise FlashAttnBrokenError("flash_attn.flash_attn_interface has no _flash_attn_forward/_flash_attn_backward"
                                   f"; supported flash-attn: {FLASH_ATTN_TESTED}")
    fnames, bnames = _param_names(fwd), _param_names(bwd)
    root = sys.modules.get(str(getattr(interface, "__name__", "")).split(".")[0])
    version = str(getattr(root, "__version__", "?"))
    if "window_size_left" in fnames and "window_size_left" in bnames:
        style = "2.7"
    elif "window_size" in fnames and "window_size" in bnames:
        style = "2.6"
    else:
        raise FlashAttnBrokenError(
            f"unknown flash-attn API (version {version}): _flash_attn_forward{tuple(fnames)}; "
            f"supported: {FLASH_ATTN_TESTED} (window_size or window_size_left/right)")
    needed = {"softmax_scale", "causal", "softcap", "alibi_slopes"}
    if not needed <= set(fnames):
        raise FlashAttnBrokenError(f"unknown flash-attn API (version {version}): _flash_attn_forward lacks "
                                   f"{sorted(needed - set(fnames))}")
    return FlashAttnAPI(style, fwd, bwd, version)


@functools.lru_cache(maxsize=None)
def _flash_attn_probe() -> Tuple[str, object]:
    """("absent", None) | ("ok", FlashAttnAPI) | ("broken", message). Cached; ``_flash_attn_probe.cache_clear()``."""
    try:
        interface = importlib.import_module("flash_attn.flash_attn_interface")
    except ModuleNotFoundError as e:
        if e.name in ("flash_attn", "flash_attn.flash_attn_interface") and not _dist_installed("flash-attn"):
            return "absent", None
        return "broken", f"flash-attn is installed but `import flash_attn.flash_attn_interface` failed: {e!r}"
    except Exception as e:  # noqa: BLE001 - any other failure of an installed package is reported, not hidden
        return "broken", f"flash-attn is installed but `import flash_attn.flash_attn_interface` failed: {e!r}"
    try:
        return "ok", detect_flash_attn_api(interface)
    except FlashAttnBrokenError as e:
        return "broken", str(e)


def _dist_installed(dist: str) -> bool:
    try:
        from importlib import metadata

        metadata.distribution(dist)
        return True
    except Exception:  # noqa: BLE001 - PackageNotFoundError or a broken metadata dir
        return False


def flash_attn_status() -> Tuple[str, str]:
    """("absent" | "ok" | "broken", detail) for reports (``selftest``)."""
    state, info = _flash_attn_probe()
    if state == "ok":
        return state, f"flash-attn {info.version} ({info.style} API)"
    return state, "" if info is None else str(info)


def _flash_attn_available() -> bool:
    """True iff flash-attn imports and has a known API. A broken install raises FlashAttnBrokenError."""
    state, info = _flash_attn_probe()
    if state == "broken":
        raise FlashAttnBrokenError(
            f"{info}. Fix or uninstall flash-attn (tested range flash-attn{FLASH_ATTN_TESTED}), or choose "
            f"another kernel explicitly with {KERNEL_ENV_VAR}=sdpa_flash (or sdpa_cuda).")
    return state == "ok"


def _flash_api() -> FlashAttnAPI:
    if not _flash_attn_available():
        raise ValueError("attention kernel 'flash_attn' requested but the flash_attn package is not installed")
    return _flash_attn_probe()[1]


def _flash_attn_forward(q: Tensor, k: Tensor, v: Tensor, causal: bool, scale: float) -> Tuple[Tensor, Tensor]:
    api = _flash_api()
    if api.style == "2.6":
        res = api.forward(q, k, v, 0.0, scale, causal, (-1, -1), 0.0, None, False)
        if len(res) != 8:
            raise FlashAttnBrokenError(f"flash-attn 2.6-style _flash_attn_forward returned {len(res)} values, "
                                       "expected 8 (out, q, k, v, out_padded, softmax_lse, S_dmask, rng_state)")
        out, lse = res[0], res[5]
    else:
        res = api.forward(q, k, v, 0.0, scale, causal, -1, -1, 0.0, None, False)
        if len(res) != 4:
            raise FlashAttnBrokenError(f"flash-attn 2.7-style _flash_attn_forward returned {len(res)} values, "
                                       "expected 4 (out, softmax_lse, S_dmask, rng_state)")
        out, lse = res[0], res[1]
    return out, lse[..., : q.shape[1]].float()


def _flash_attn_backward(
    dout: Tensor, q: Tensor, k: Tensor, v: Tensor, out: Tensor, lse: Tensor, causal: bool, scale: float
) -> Tuple[Tensor, Tensor, Tensor]:
    api = _flash_api()
    dq, dk, dv = torch.empty_like(q), torch.empty_like(k), torch.empty_like(v)
    args = (dout.contiguous(), q, k, v, out.to(q.dtype).contiguous(), lse.float().contiguous(), dq, dk, dv, 0.0,
            scale, causal)
    if api.style == "2.6":
        api.backward(*args, (-1, -1), 0.0, None, False, rng_state=None)
    else:
        api.backward(*args, -1, -1, 0.0, None, False, rng_state=None)
    return dq, dk, dv


# --------------------------------------------------------------------------------------------------------
# torch's CUDA SDPA ops.
# --------------------------------------------------------------------------------------------------------

_warned_gqa_expand: set = set()


def _expand_kv(x: Tensor, group: int) -> Tensor:
    return x if group == 1 else x.repeat_interleave(group, dim=2)


def _sum_kv_grad(dx: Tensor, group: int) -> Tensor:
    if group == 1:
        return dx
    b, s, hq, d = dx.shape
    return dx.view(b, s, hq // group, group, d).sum(3)


def _warn_gqa_expand(name: str, group: int) -> None:
    if group > 1 and name not in _warned_gqa_expand:
        _warned_gqa_expand.add(name)
        msg = (f"nemo_longctx attention kernel {name!r} is not GQA-native: KV heads are repeated {group}x in memory "
               f"for every block. Prefer flash_attn or sdpa_flash ({KERNEL_ENV_VAR}=sdpa_flash) for GQA/MQA models.")
        log.warning(msg)
        warnings.warn(msg, RuntimeWarning, stacklevel=3)


def _sdpa_flash_forward(q: Tensor, k: Tensor, v: Tensor, causal: bool, scale: float) -> Tuple[Tensor, Tensor]:
    res = torch.ops.aten._scaled_dot_product_flash_attention(
        q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), 0.0, causal, False, scale=scale)
    out, lse = res[0], res[1]
    return out.transpose(1, 2), lse[..., : q.shape[1]].float()


def _sdpa_flash_backward(
    dout: Tensor, q: Tensor, k: Tensor, v: Tensor, out: Tensor, lse: Tensor, causal: bool, scale: float
) -> Tuple[Tensor, Tensor, Tensor]:
    philox = torch.zeros(2, dtype=torch.int64, device=q.device)  # unused without dropout
    dq, dk, dv = torch.ops.aten._scaled_dot_product_flash_attention_backward(
        dout.transpose(1, 2), q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2),
        out.to(q.dtype).transpose(1, 2), lse.float().contiguous(), None, None, q.shape[1], k.shape[1], 0.0, causal,
        philox, philox, scale=scale)
    return dq.transpose(1, 2), dk.transpose(1, 2), dv.transpose(1, 2)


_cudnn_lse_ndim: Dict[str, int] = {}


def _sdpa_cudnn_forward(q: Tensor, k: Tensor, v: Tensor, causal: bool, scale: float) -> Tuple[Tensor, Tensor]:
    res = torch.ops.aten._scaled_dot_product_cudnn_attention(
        q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), None, True, 0.0, causal, False, scale=scale)
    out, lse = res[0], res[1]
    _cudnn_lse_ndim["ndim"] = lse.dim()  # some versions return [b, h, sq, 1]
    b, sq, hq = q.shape[0], q.shape[1], q.shape[2]
    return out.transpose(1, 2), lse.reshape(b, hq, -1)[..., :sq].float()


def _sdpa_cudnn_backward(
    dout: Tensor, q: Tensor, k: Tensor, v: Tensor, out: Tensor, lse: Tensor, causal: bool, scale: float
) -> Tuple[Tensor, Tensor, Tensor]:
    philox = torch.zeros(2, dtype=torch.int64, device=q.device)
    lse = lse.float().contiguous()
    if _cudnn_lse_ndim.get("ndim", 3) == 4:
        lse = lse.unsqueeze(-1)
    out_t = out.to(q.dtype).transpose(1, 2)
    dout_t = torch.empty_like(out_t).copy_(dout.transpose(1, 2))  # same strides as out (cuDNN wants that)
    dq, dk, dv = torch.ops.aten._scaled_dot_product_cudnn_attention_backward(
        dout_t, q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), out_t, lse, philox, philox, None, None,
        None, q.shape[1], k.shape[1], 0.0, causal, scale=scale)
    return dq.transpose(1, 2), dk.transpose(1, 2), dv.transpose(1, 2)


def _pad_rows(lse: Tensor, multiple: int) -> Tensor:
    s = lse.shape[-1]
    padded = (s + multiple - 1) // multiple * multiple
    if padded == s:
        return lse.contiguous()
    buf = lse.new_zeros(*lse.shape[:-1], padded)
    buf[..., :s] = lse
    return buf


def _sdpa_cuda_forward(q: Tensor, k: Tensor, v: Tensor, causal: bool, scale: float) -> Tuple[Tensor, Tensor]:
    g = q.shape[2] // k.shape[2]
    _warn_gqa_expand("sdpa_cuda", g)
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
        None, out.to(q.dtype).transpose(1, 2), _pad_rows(lse.float(), 32), philox, philox, 0.0,
        [True, True, True, False], causal, scale=scale,
    )
    return dq.transpose(1, 2), _sum_kv_grad(dk.transpose(1, 2), g), _sum_kv_grad(dv.transpose(1, 2), g)


KERNELS: Dict[str, AttentionKernel] = {
    "cpu_flash": AttentionKernel("cpu_flash", _cpu_flash_forward, _cpu_flash_backward, device_type="cpu",
                                 dtypes=(torch.float32, torch.float64, torch.bfloat16, torch.float16),
                                 value_dim_differs=True),
    "math": AttentionKernel("math", math_forward, math_backward, value_dim_differs=True),
    "flash_attn": AttentionKernel("flash_attn", _flash_attn_forward, _flash_attn_backward, device_type="cuda",
                                  dtypes=_HALF, max_head_dim=256),
    "sdpa_flash": AttentionKernel("sdpa_flash", _sdpa_flash_forward, _sdpa_flash_backward, device_type="cuda",
                                  dtypes=_HALF, max_head_dim=256),
    "sdpa_cudnn": AttentionKernel("sdpa_cudnn", _sdpa_cudnn_forward, _sdpa_cudnn_backward, device_type="cuda",
                                  dtypes=_HALF, max_head_dim=128, value_dim_differs=True),
    "sdpa_cuda": AttentionKernel("sdpa_cuda", _sdpa_cuda_forward, _sdpa_cuda_backward, device_type="cuda",
                                 dtypes=(torch.float32,) + _HALF, gqa_native=False, value_dim_differs=True),
}

# Kernels "auto" may pick per device, in order of preference, before any registered default.
_AUTO_ORDER = {"cuda": ("flash_attn", "sdpa_flash", "sdpa_cuda"), "cpu": ("cpu_flash",)}

_logged_choices: set = set()
_registered_defaults: Dict[Tuple[str, torch.dtype], str] = {}


def register_default_kernel(device_type: str, dtype: torch.dtype, name: Optional[str]) -> None:
    """Make ``name`` the "auto" choice for (device type, dtype) in this process; None removes the entry."""
    key = (torch.device(device_type).type, dtype)
    if name is None:
        _registered_defaults.pop(key, None)
        return
    if name not in KERNELS:
        raise ValueError(f"unknown attention kernel {name!r}; choose one of {sorted(KERNELS)}")
    _registered_defaults[key] = name


def _auto_kernel_name(device: torch.device, dtype: torch.dtype) -> str:
    if dtype == torch.float64:
        return "math"
    registered = _registered_defaults.get((device.type, dtype))
    if registered is not None:
        return registered
    if device.type == "cpu":
        return "cpu_flash"
    if device.type == "cuda":
        if dtype in _HALF:
            return "flash_attn" if _flash_attn_available() else "sdpa_flash"
        return "sdpa_cuda"
    return "math"


# "auto" fallbacks, in order, when the usual choice does not take the problem's head dims (MLA: dv != d)
_AUTO_FALLBACK = ("sdpa_cudnn", "sdpa_cuda", "math")


def _auto_kernel_for_dims(device: torch.device, dtype: torch.dtype, head_dim: Optional[int],
                          value_dim: Optional[int]) -> str:
    name = _auto_kernel_name(device, dtype)
    if head_dim is None or KERNELS[name].supports(device.type, dtype, head_dim, value_dim):
        return name
    for alt in _AUTO_FALLBACK:
        if KERNELS[alt].supports(device.type, dtype, head_dim, value_dim):
            return alt
    return "math"


def select_kernel(device: torch.device, dtype: torch.dtype, name: Optional[str] = None, *,
                  head_dim: Optional[int] = None, value_dim: Optional[int] = None) -> AttentionKernel:
    """Return the kernel for ``device``/``dtype``.

    ``name`` is one of ``KERNELS`` or ``"auto"``/None; with "auto" the environment variable
    ``NEMO_LONGCTX_ATTN_KERNEL`` (if set) wins, otherwise: float64 -> math, a default registered for the
    device (``register_default_kernel``), CPU -> cpu_flash, CUDA half/bf16 -> flash_attn if installed else
    sdpa_flash, CUDA float32 -> sdpa_cuda, anything else -> math. A broken flash-attn install raises.
    ``head_dim``/``value_dim`` (q/k and v head sizes), when given: "auto" skips kernels that do not take
    them (then sdpa_cudnn, sdpa_cuda, math in that order), and a named kernel that does not is a ValueError.
    """
    requested = name or "auto"
    if requested == "auto":
        requested = os.environ.get(KERNEL_ENV_VAR, "auto") or "auto"
    dev = torch.device(device)
    chosen = _auto_kernel_for_dims(dev, dtype, head_dim, value_dim) if requested == "auto" else requested
    if chosen not in KERNELS:
        raise ValueError(f"unknown attention kernel {chosen!r}; choose one of {sorted(KERNELS)} or 'auto'")
    kern = KERNELS[chosen]
    if kern.device_type == "cpu" and dev.type != "cpu":
        raise ValueError(f"attention kernel {chosen!r} needs CPU tensors, got device {device}")
    if kern.device_type == "cuda" and dev.type != "cuda":
        raise ValueError(f"attention kernel {chosen!r} needs CUDA tensors, got device {device}")
    if chosen == "flash_attn" and not _flash_attn_available():
        raise ValueError("attention kernel 'flash_attn' requested but the flash_attn package is not installed")
    if kern.dtypes is not None and dtype not in kern.dtypes:
        raise ValueError(f"attention kernel {chosen!r} does not support {dtype} "
                         f"(supported: {[str(t) for t in kern.dtypes]})")
    if head_dim is not None and not kern.supports(dev.type, dtype, head_dim, value_dim):
        raise ValueError(f"attention kernel {chosen!r} does not support head dims q/k={head_dim}, "
                         f"v={value_dim if value_dim is not None else head_dim} (value_dim_differs="
                         f"{kern.value_dim_differs}, max_head_dim={kern.max_head_dim})")
    key = (dev.type, dtype, chosen)
    if key not in _logged_choices:
        _logged_choices.add(key)
        log.info("nemo_longctx attention kernel: %s (device=%s, dtype=%s)", chosen, key[0], dtype)
    return kern


# --------------------------------------------------------------------------------------------------------
# Checking kernels against the float64 reference.
# --------------------------------------------------------------------------------------------------------

# Relative (Frobenius) error bounds of a correct kernel vs the float64 reference on the same rounded inputs.
TOLERANCE = {torch.float64: 1e-10, torch.float32: 2e-4, torch.float16: 5e-3, torch.bfloat16: 2e-2}


class KernelSelfTestError(RuntimeError):
    """A kernel disagrees with the float64 reference (or fails to run)."""


def rel_err(got: Tensor, want: Tensor) -> float:
    """||got - want|| / ||want|| in float64 (``inf`` when got has non-finite values)."""
    got64, want64 = got.double(), want.double()
    if not torch.isfinite(got64).all():
        return float("inf")
    den = want64.norm().item()
    return (got64 - want64).norm().item() / (den if den > 0 else 1.0)


def check_kernel_case(kernel: AttentionKernel, device, dtype: torch.dtype, *, b: int = 1, s: int = 128,
                      hq: int = 4, hkv: int = 2, d: int = 64, dv: Optional[int] = None, causal: bool = True,
                      split_kv: bool = False, seed: int = 0) -> Dict[str, float]:
    """Errors of one kernel case vs float64 math: {"out", "lse", "dq", "dk", "dv"} relative errors.

    ``split_kv``: the keys are split in two blocks; the blocks' forwards are LSE-merged and each block's
    backward gets the *merged* (out, lse) of the whole row -- the contract ring attention relies on. The
    split case runs full (non-causal) attention: off-diagonal ring blocks are never causal.
    """
    from .merge import merge_attention

    dev = torch.device(device)
    dv = d if dv is None else dv
    g = torch.Generator(device="cpu").manual_seed(seed)
    q, k, v, dout = (torch.randn(b, s, h, e, generator=g).to(device=dev, dtype=dtype)
                     for h, e in ((hq, d), (hkv, d), (hkv, dv), (hq, dv)))
    scale = 1.0 / math.sqrt(d)
    causal_eff = causal and not split_kv
    r_out, r_lse, r_dq, r_dk, r_dv = reference_attention_fp64(q, k, v, dout, causal_eff, scale)
    if not split_kv:
        out, lse = kernel.forward(q, k, v, causal_eff, scale)
        dq, dk, dvv = kernel.backward(dout, q, k, v, out, lse, causal_eff, scale)
    else:
        h = s // 2
        o1, l1 = kernel.forward(q, k[:, :h], v[:, :h], False, scale)
        o2, l2 = kernel.forward(q, k[:, h:], v[:, h:], False, scale)
        out_f, lse = merge_attention(o1, l1, o2, l2)
        out = out_f.to(dtype)
        g1 = kernel.backward(dout, q, k[:, :h], v[:, :h], out, lse, False, scale)
        g2 = kernel.backward(dout, q, k[:, h:], v[:, h:], out, lse, False, scale)
        dq = g1[0].double() + g2[0].double()
        dk, dvv = torch.cat([g1[1], g2[1]], 1), torch.cat([g1[2], g2[2]], 1)
    for name, got, want in (("out", out, r_out), ("dq", dq, r_dq), ("dk", dk, r_dk), ("dv", dvv, r_dv)):
        if tuple(got.shape) != tuple(want.shape):
            raise KernelSelfTestError(f"kernel {kernel.name}: {name} has shape {tuple(got.shape)}, "
                                      f"expected {tuple(want.shape)}")
    if tuple(lse.shape) != (b, hq, s):
        raise KernelSelfTestError(f"kernel {kernel.name}: lse has shape {tuple(lse.shape)}, expected {(b, hq, s)}")
    if out.dtype != dtype:
        raise KernelSelfTestError(f"kernel {kernel.name}: out dtype {out.dtype}, expected {dtype}")
    errs = {"out": rel_err(out, r_out), "dq": rel_err(dq, r_dq), "dk": rel_err(dk, r_dk), "dv": rel_err(dvv, r_dv)}
    # the LSE is a log: compare absolute error per row (scale-free), as a relative-looking number
    errs["lse"] = float((lse.double() - r_lse).abs().max().item()) if torch.isfinite(lse).all() else float("inf")
    return errs


def self_test_kernel(kernel, device, dtype: torch.dtype, *, tolerance: Optional[float] = None) -> Dict[str, float]:
    """Opt-in start-up check of one kernel on ``device``/``dtype`` against the float64 math reference on a
    small GQA input: causal and full attention, forward and backward, and the split-KV contract.

    ``kernel`` is an AttentionKernel or a name ("auto" resolves like ``select_kernel``). Returns the worst
    relative error per quantity; raises ``KernelSelfTestError`` naming the kernel, device, dtype, case and
    errors when a case exceeds ``tolerance`` (default ``TOLERANCE[dtype]``) or the kernel raises.
    """
    if not isinstance(kernel, AttentionKernel):
        kernel = select_kernel(torch.device(device), dtype, kernel)
    tol = TOLERANCE.get(dtype, 2e-2) if tolerance is None else tolerance
    worst: Dict[str, float] = {}
    head_dim = 64 if kernel.max_head_dim is None or kernel.max_head_dim >= 64 else kernel.max_head_dim
    hkv = 2  # GQA (group of 2): the case ring attention runs for Llama-style models
    for causal, split in ((True, False), (False, False), (False, True)):
        case = f"hq=4 hkv={hkv} s=128 d={head_dim} causal={causal} split_kv={split}"
        try:
            errs = check_kernel_case(kernel, device, dtype, s=128, hq=4, hkv=hkv, d=head_dim, causal=causal,
                                     split_kv=split, seed=7)
        except KernelSelfTestError:
            raise
        except Exception as e:  # noqa: BLE001 - report what failed, with the kernel named
            raise KernelSelfTestError(f"attention kernel {kernel.name!r} failed on {device}/{dtype} ({case}): "
                                      f"{type(e).__name__}: {e}") from e
        for key, val in errs.items():
            worst[key] = max(worst.get(key, 0.0), val)
        bad = {key: val for key, val in errs.items() if not val <= tol}
        if bad:
            raise KernelSelfTestError(
                f"attention kernel {kernel.name!r} disagrees with the float64 reference on {device}/{dtype} "
                f"({case}): " + ", ".join(f"{key} rel err {val:.3g}" for key, val in bad.items())
                + f" > tolerance {tol:g}. Choose another kernel with {KERNEL_ENV_VAR}=...")
    return worst


def time_kernel(kernel: AttentionKernel, device, dtype: torch.dtype, *, b: int = 1, s: int = 4096, hq: int = 32,
                hkv: int = 8, d: int = 128, causal: bool = True, repeats: int = 5) -> float:
    """Median seconds of one forward + backward of ``kernel`` on a Llama-shaped block."""
    dev = torch.device(device)
    q, k, v = (torch.randn(b, s, h, d, device=dev, dtype=dtype) for h in (hq, hkv, hkv))
    dout = torch.randn_like(q)
    scale = 1.0 / math.sqrt(d)
    times = []
    for i in range(repeats + 1):
        if dev.type == "cuda":
            torch.cuda.synchronize(dev)
        t0 = time.perf_counter()
        out, lse = kernel.forward(q, k, v, causal, scale)
        kernel.backward(dout, q, k, v, out, lse, causal, scale)
        if dev.type == "cuda":
            torch.cuda.synchronize(dev)
        if i:
            times.append(time.perf_counter() - t0)
    times.sort()
    return times[len(times) // 2]


def pick_fastest_exact_kernel(device, dtype: torch.dtype, *, register: bool = True, candidates=None,
                              timing_shape: Optional[dict] = None) -> Tuple[Optional[str], Dict[str, object]]:
    """Self-test every kernel that supports ``device``/``dtype`` (GQA-native ones only when any is exact), time
    the exact ones on a Llama-shaped block, and (``register``) make the fastest the "auto" default for the
    device. Returns (name or None, {kernel: seconds | "error: ..."})."""
    dev = torch.device(device)
    names = candidates or [n for n, kk in KERNELS.items() if n != "math" and kk.supports(dev.type, dtype)]
    report: Dict[str, object] = {}
    exact: Dict[str, float] = {}
    for n in names:
        if n == "flash_attn":
            try:
                if not _flash_attn_available():
                    report[n] = "not installed"
                    continue
            except FlashAttnBrokenError as e:
                report[n] = f"error: {e}"
                continue
        try:
            self_test_kernel(KERNELS[n], dev, dtype)
            exact[n] = time_kernel(KERNELS[n], dev, dtype, **(timing_shape or {}))
            report[n] = exact[n]
        except Exception as e:  # noqa: BLE001 - a failing kernel is reported and never chosen
            report[n] = f"error: {type(e).__name__}: {e}"
    native = {n: t for n, t in exact.items() if KERNELS[n].gqa_native}
    pool = native or exact
    best = min(pool, key=pool.get) if pool else None
    if register and best is not None:
        register_default_kernel(dev.type, dtype, best)
    return best, report
