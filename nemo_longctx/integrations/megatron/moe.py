"""MoE auxiliary losses under context parallelism: the gradient scale Megatron-core before 0.17 leaves out.

Megatron's router computes each load-balancing loss (``aux_loss``, ``seq_aux_loss``, ``global_aux_loss``) from the
token counts of the whole TP×CP (or TP×DP×CP) group but the router probabilities of the rank's own tokens, so every
CP rank holds its share of the sequence's loss and the shares sum to what one rank without CP computes. The z-loss is
split the same way (its coefficient divided by the TP×CP size). The gradients of those shares are then averaged, not
summed, over the data-parallel-with-CP group by DDP -- so under CP=c the auxiliary gradient is 1/c of cp=none's,
while the LM loss is right (each rank's token mean, averaged). Megatron-core 0.17 fixed the usual path
(``forward_step_calc_loss`` sets ``MoEAuxLossAutoScaler``'s scale to ``loss_scale * cp_size / num_microbatches``) and
0.19 the per-token-loss path (the router multiplies by the TP×CP size); NeMo 2's containers ship 0.14–0.17 and the
tested NeMo 2 stack 0.15.3, where a Mixtral with NVIDIA's ``moe_aux_loss_coeff=0.01`` trains differently under CP.

The fix for those versions is a ``MoELayer`` subclass put into the layer spec (``spec.long_context_layer_spec``) in
place of Megatron's own ``MoELayer``: after Megatron builds the layer, its router reads its loss coefficients from its
own copy of the config with every auxiliary coefficient multiplied by the CP size. The loss values Megatron logs
(``load_balancing_loss`` etc.: the loss divided by its coefficient) stay as they were; only the gradient gets the
missing factor. Nothing changes at CP size 1 or on a Megatron-core that scales the loss itself.
"""

from __future__ import annotations

import copy
import logging
from typing import Any

from megatron.core.transformer.moe.moe_layer import MoELayer

log = logging.getLogger(__name__)
_logged = False

# Megatron-core versions that scale the MoE auxiliary-loss gradient by the CP size themselves: the usual path from
# 0.17 (schedules.forward_step_calc_loss), the calculate_per_token_loss path from 0.19 (router).
SCALES_USUAL_PATH = (0, 17)
SCALES_PER_TOKEN_PATH = (0, 19)


def _megatron_version() -> tuple:
    from megatron.core import package_info

    parts = []
    for piece in package_info.__version__.split("+")[0].split(".")[:2]:
        digits = "".join(ch for ch in piece if ch.isdigit())
        parts.append(int(digits or 0))
    return tuple(parts)


def megatron_scales_aux_loss_for_cp(per_token_loss: bool, version: tuple | None = None) -> bool:
    """Whether this Megatron-core multiplies the MoE auxiliary-loss gradient by the CP size itself."""
    version = _megatron_version() if version is None else version
    return version >= (SCALES_PER_TOKEN_PATH if per_token_loss else SCALES_USUAL_PATH)


def aux_loss_cp_factor(config: Any, cp_size: int, version: tuple | None = None) -> int:
    """The factor a router's auxiliary-loss coefficients need under CP: ``cp_size`` where Megatron-core leaves it
    out, else 1."""
    if cp_size <= 1 or megatron_scales_aux_loss_for_cp(bool(getattr(config, "calculate_per_token_loss", False)),
                                                       version):
        return 1
    return cp_size


def scaled_router_config(config: Any, factor: int) -> Any:
    """A shallow copy of ``config`` whose auxiliary-loss coefficients (``moe_aux_loss_coeff``, a number or one per
    load-balancing type, and ``moe_z_loss_coeff``) are multiplied by ``factor``."""
    scaled = copy.copy(config)
    coeff = config.moe_aux_loss_coeff
    scaled.moe_aux_loss_coeff = [c * factor for c in coeff] if isinstance(coeff, (list, tuple)) else coeff * factor
    if config.moe_z_loss_coeff is not None:
        scaled.moe_z_loss_coeff = config.moe_z_loss_coeff * factor
    return scaled


def has_aux_losses(config: Any) -> bool:
    coeff = config.moe_aux_loss_coeff
    coeffs = coeff if isinstance(coeff, (list, tuple)) else [coeff]
    return any(c for c in coeffs) or bool(config.moe_z_loss_coeff)


class CPScaledAuxLossMoELayer(MoELayer):
    """Megatron's ``MoELayer``, whose router's auxiliary losses get the CP-size gradient factor that Megatron-core
    before 0.17 (0.19 for ``calculate_per_token_loss``) leaves out (see the module docstring)."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        cp_group = getattr(self.router, "cp_group", None)
        cp_size = cp_group.size() if cp_group is not None else int(self.config.context_parallel_size or 1)
        factor = aux_loss_cp_factor(self.config, cp_size)
        self.aux_loss_cp_factor = factor
        if factor != 1 and has_aux_losses(self.config):
            self.router.config = scaled_router_config(self.config, factor)
            global _logged
            if not _logged:
                _logged = True
                log.info("MoE auxiliary losses under CP=%d: the routers' coefficients are scaled by %d for the "
                         "gradient (Megatron-core %s leaves the factor out; the logged loss values are unchanged)",
                         cp_size, factor, ".".join(map(str, _megatron_version())))


def needs_cp_aux_loss_layer() -> bool:
    """Whether layer specs should get ``CPScaledAuxLossMoELayer`` (this Megatron-core misses the factor on at least
    one path)."""
    return not megatron_scales_aux_loss_for_cp(per_token_loss=True)
