"""Model FLOPs and the achieved fraction of a device's peak (MFU), plain Python.

``flops_per_token(shape, seq_length)``  model FLOPs of one trained token (forward + backward): 6 per parameter plus
                                        causal attention's scores and values at ``seq_length``
                                        (``model_flops_per_token(config)``: of a Megatron model config);
``peak_flops(device_name, precision)``  the dense tensor-core peak of one named GPU (FLOP/s) at the run's precision;
                                        None for a CPU, an unknown GPU or an fp32 run (no made-up peak);
``mfu(...)``                            model FLOPs per second over the peak of every device of the run.

The one formula the train app's step lines and ``bench/attention_ab.py`` use.
"""

from __future__ import annotations

import math
from typing import Any, Optional

from nemo_longctx.planner.model_shapes import ModelShape, shape_from_config

# bf16/fp16 dense tensor-core peak, TFLOP/s per GPU (NVIDIA's data sheets, without sparsity), by a substring of the
# device name torch reports ("NVIDIA H100 80GB HBM3", "NVIDIA A100-SXM4-80GB", ...): the first match wins, so the
# more specific names come first ("GH200" holds "H200", "H200 NVL" holds "H200").
PEAK_TFLOPS_16BIT = {
    "GH200": 989.0,
    "H200 NVL": 835.0,
    "H200": 989.0,
    "H100 PCIe": 756.0,
    "H100 NVL": 835.0,
    "H100": 989.0,  # SXM ("NVIDIA H100 80GB HBM3")
    "A100": 312.0,
    "B200": 2250.0,
}
# trainer.precision values whose matrix products run in bf16/fp16 on the tensor cores
SIXTEEN_BIT = ("bf16", "bf16-mixed", "bf16-true", "16", "16-mixed", "fp16", "fp16-mixed", "half")


def flops_per_token(shape: ModelShape, seq_length: int, parameters: Optional[int] = None) -> float:
    """Model FLOPs per trained token: 6 per parameter (forward 2, backward 4; ``parameters``: counted on a built
    model, default the shape's count) + causal attention's scores and values: 4 x s x (heads x head dim) per layer
    forward, halved by the causal mask, x 3 with the backward. Counts full causal attention over the whole sequence
    (per-document masks and sliding windows do less work)."""
    params = shape.parameters() if parameters is None else int(parameters)
    return 6.0 * params + 6.0 * shape.num_layers * shape.q_width * int(seq_length)


def model_flops_per_token(config: Any) -> Optional[float]:
    """``flops_per_token`` of a Megatron model config (any object with a ``TransformerConfig``'s fields) at its
    ``seq_length``; None for a model the formula does not describe (mixture of experts, multi-latent attention) or
    whose shape the config does not spell out."""
    if getattr(config, "num_moe_experts", None) or getattr(config, "multi_latent_attention", False):
        return None
    names = ("num_layers", "hidden_size", "ffn_hidden_size", "num_attention_heads", "num_query_groups", "kv_channels",
             "vocab_size", "gated_linear_unit", "share_embeddings_and_output_weights")
    fields = {n: getattr(config, n) for n in names if getattr(config, n, None) is not None}
    seq = getattr(config, "seq_length", None)
    try:
        return flops_per_token(shape_from_config(fields, name="run"), int(seq)) if seq else None
    except (ValueError, TypeError):
        return None


def peak_flops(device_name: Optional[str], precision: str) -> Optional[float]:
    """The dense peak FLOP/s of one device named ``device_name`` (torch's ``get_device_name``) for
    ``trainer.precision``; None when it is not known: no device name (a CPU), a GPU not in ``PEAK_TFLOPS_16BIT``,
    or a precision other than bf16/fp16 (an fp32 run's peak depends on whether TF32 is allowed)."""
    if not device_name or str(precision).lower() not in SIXTEEN_BIT:
        return None
    tflops = next((v for k, v in PEAK_TFLOPS_16BIT.items() if k in str(device_name)), None)
    return None if tflops is None else tflops * 1e12


def mfu(flops_per_token: Optional[float], tokens_per_s: float, peak_per_device: Optional[float],
        devices: int) -> Optional[float]:
    """Model FLOPs utilisation: ``flops_per_token x tokens_per_s / (peak_per_device x devices)``; None when the
    FLOPs or the peak are not known."""
    if not flops_per_token or not peak_per_device or devices <= 0 or not (0 < tokens_per_s < math.inf):
        return None
    return float(flops_per_token) * float(tokens_per_s) / (float(peak_per_device) * int(devices))
