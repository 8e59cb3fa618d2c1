"""cpu_compat fix 12: Megatron's torch norm (``WrappedTorchNorm``, the norm without TE/Apex) with
``layernorm_zero_centered_gamma=True`` builds a zero-centred stand-in. Checked against external definitions, forward
and backward: Hugging Face's ``GemmaRMSNorm`` (Gemma stores its RMSNorm weight as gamma - 1; it computes in fp32
whatever the input, hence 2e-6) for RMSNorm, and torch's LayerNorm with gamma = 1 + weight (TE's zero-centred
gamma; fp64, 1e-12) for LayerNorm."""

from __future__ import annotations

import pytest
import torch

H = 48


def _norm(normalization, eps):
    from megatron.core.transformer.torch_norm import WrappedTorchNorm
    from megatron.core.transformer.transformer_config import TransformerConfig

    from nemo_longctx.integrations.megatron import cpu_compat

    cpu_compat.apply(force=True)
    config = TransformerConfig(num_layers=1, hidden_size=H, num_attention_heads=4, normalization=normalization,
                               layernorm_zero_centered_gamma=True, layernorm_epsilon=eps)
    return WrappedTorchNorm(config, H, eps).double()


def _check(ours, ref_fn, x, tol):
    with torch.no_grad():
        ours.weight.normal_()
        if getattr(ours, "bias", None) is not None:
            ours.bias.normal_()
    x1, x2 = x.clone().requires_grad_(), x.clone().requires_grad_()
    y1 = ours(x1)
    y2 = ref_fn(x2)
    g = torch.randn_like(y1)
    (y1 * g).sum().backward()
    (y2 * g).sum().backward()
    assert (y1 - y2).abs().max() <= tol * y2.abs().max(), (y1 - y2).abs().max()
    assert (x1.grad - x2.grad).abs().max() <= tol * x2.grad.abs().max()


@pytest.mark.parametrize("shape", [(5, 2, H), (17, H)])
def test_zero_centred_rmsnorm_is_hugging_face_gemmas(shape):
    from transformers.models.gemma.modeling_gemma import GemmaRMSNorm

    ours = _norm("RMSNorm", 1e-6)
    assert torch.count_nonzero(ours.weight) == 0  # stored as gamma - 1: initialised to 0
    hf = GemmaRMSNorm(H, eps=1e-6).double()
    x = torch.randn(*shape, dtype=torch.float64)

    def ref(t):
        hf.weight.data.copy_(ours.weight.data)
        return hf(t)

    _check(ours, ref, x, 2e-6)


def test_zero_centred_layernorm_is_layernorm_with_one_plus_weight():
    ours = _norm("LayerNorm", 1e-5)
    x = torch.randn(7, 3, H, dtype=torch.float64)
    _check(ours, lambda t: torch.nn.functional.layer_norm(t, (H,), ours.weight.detach() + 1, ours.bias.detach(),
                                                          1e-5), x, 1e-12)
