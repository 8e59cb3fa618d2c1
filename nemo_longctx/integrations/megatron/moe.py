"""MoE routing under context parallelism: the auxiliary-loss gradient scale Megatron-core before 0.17 leaves out, and
Sinkhorn routing balanced over the whole sequence instead of each rank's part of it.

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

Sinkhorn routing (``moe_router_load_balancing_type='sinkhorn'``): Megatron chooses each token's experts from the
Sinkhorn-normalised router logits, and its normalisation (``moe_utils.sinkhorn``) alternates between scaling the
rows (tokens) and the columns (experts) of the rank's own ``[tokens, experts]`` matrix -- so under CP (every Megatron
version, Megatron's own CP included) each rank balances the experts over its part of the sequence and routes
differently from one rank holding all of it. ``GroupSinkhornRouter`` runs the same iteration with the column sums
all-reduced over the router's TP×CP group (the group Megatron's auxiliary losses count tokens over: the ranks that
split one sequence), which is the one-rank Sinkhorn of the whole sequence; each rank keeps its own rows. The layer
builds it in place of Megatron's ``TopKRouter`` (same parameters, copied from the router Megatron initialised, so the
random stream is untouched) when the routing is Sinkhorn and that group has more than one rank.
"""

from __future__ import annotations

import copy
import logging
from typing import Any

import torch
import torch.distributed as dist
from megatron.core.transformer.moe.moe_layer import MoELayer
from megatron.core.transformer.moe.router import TopKRouter

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


def group_sinkhorn(cost: torch.Tensor, group: Any, tol: float = 0.0001) -> torch.Tensor:
    """Megatron's ``moe_utils.sinkhorn`` of the ``[tokens, experts]`` matrix made of every rank's rows in ``group``,
    returned for this rank's rows: the column (expert) sums are all-reduced, the row scaling stays local, and every
    rank stops at the same iteration (the convergence test reads the all-reduced column scaling). Same constants as
    Megatron's (eps 1e-8, tolerance on the mean change of the column scaling)."""
    cost = torch.exp(cost)
    tokens = torch.tensor([cost.size(0)], dtype=torch.float64, device=cost.device)
    dist.all_reduce(tokens, group=group)
    n_tokens, n_experts = float(tokens.item()), cost.size(1)
    eps = 0.00000001
    d1 = torch.ones(n_experts, device=cost.device, dtype=cost.dtype)
    d1_old, error = d1, 1e9
    while error > tol:
        d0 = (1 / n_tokens) * 1 / (torch.sum(d1 * cost, 1) + eps)
        col = torch.sum(d0.unsqueeze(1) * cost, 0)
        dist.all_reduce(col, group=group)
        d1 = (1 / n_experts) * 1 / (col + eps)
        error = torch.mean(torch.abs(d1_old - d1)).item()
        d1_old = d1
    return d1 * cost * d0.unsqueeze(1)


class GroupSinkhornRouter(TopKRouter):
    """Megatron's ``TopKRouter`` whose Sinkhorn normalisation (training) spans the tokens of its TP×CP group (see the
    module docstring); everything else, evaluation-time Sinkhorn routing included, is Megatron's."""

    def sinkhorn_load_balancing(self, logits: torch.Tensor):
        group = self.tp_cp_group
        if not self.training or group is None or group.size() == 1:
            return super().sinkhorn_load_balancing(logits)
        assert self.config.moe_aux_loss_coeff == 0, "Sinkhorn routing does not support aux loss."
        with torch.no_grad():
            norm_logits = group_sinkhorn(logits.to(dtype=torch.float32), group)
            _, indices = torch.topk(norm_logits, k=self.topk, dim=1)
        if self.topk == 1:  # Megatron's activation of the chosen scores
            logits = torch.sigmoid(logits)
        else:
            logits = torch.softmax(logits, dim=-1, dtype=torch.float32).type_as(logits)
        routing_map = torch.zeros_like(logits).int().scatter(1, indices, 1).bool()
        return logits * routing_map, routing_map


def _is_sinkhorn(config: Any) -> bool:
    routing = getattr(config, "moe_router_load_balancing_type", None)
    return routing == "sinkhorn" or (isinstance(routing, (list, tuple)) and "sinkhorn" in routing)


class LongContextMoELayer(MoELayer):
    """Megatron's ``MoELayer``, whose router's auxiliary losses get the CP-size gradient factor that Megatron-core
    before 0.17 (0.19 for ``calculate_per_token_loss``) leaves out, and whose Sinkhorn routing spans the sequence's
    TP×CP group (see the module docstring)."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        group = getattr(self.router, "tp_cp_group", None)
        if (_is_sinkhorn(self.config) and group is not None and group.size() > 1
                and not isinstance(self.router, GroupSinkhornRouter)):
            self.router = _rebuilt_router(self.router, GroupSinkhornRouter)
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


def _rebuilt_router(router: TopKRouter, cls: type) -> TopKRouter:
    """``router`` rebuilt as ``cls`` from its own config and process groups, with its parameters and buffers (no
    initialisation: the random stream stays as Megatron left it). For Megatron-core without ``MoESubmodules.router``
    (< 0.19), where ``MoELayer`` builds ``TopKRouter`` itself."""
    from megatron.core.process_groups_config import ProcessGroupCollection

    config = copy.copy(router.config)
    config.perform_initialization = False
    pgs = ProcessGroupCollection()  # the groups Router.__init__ reads (fields are set after creation)
    pgs.tp, pgs.cp = router.tp_group, router.cp_group
    pgs.tp_cp, pgs.tp_dp_cp = router.tp_cp_group, router.tp_dp_cp_group
    new = cls(config=config, pg_collection=pgs)
    new.config = router.config
    new.load_state_dict(router.state_dict())
    if getattr(router, "layer_number", None) is not None:
        new.set_layer_number(router.layer_number)
    return new


def has_router_submodule() -> bool:
    """Whether this Megatron-core's ``MoESubmodules`` names the router class (0.19 on): the spec then carries
    ``GroupSinkhornRouter`` itself."""
    from megatron.core.transformer.moe.moe_layer import MoESubmodules

    return "router" in getattr(MoESubmodules, "__dataclass_fields__", {})


def needs_long_context_moe_layer() -> bool:
    """Whether layer specs should get ``LongContextMoELayer`` in place of ``MoELayer``: this Megatron-core misses the
    auxiliary-loss factor on at least one path, or builds its router without a spec entry (both before 0.19)."""
    return not megatron_scales_aux_loss_for_cp(per_token_loss=True) or not has_router_submodule()
