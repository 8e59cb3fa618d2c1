"""On the Bridge stack's Megatron-core (0.19: ``MoESubmodules`` names the router, the auxiliary-loss factor is
Megatron's own), our layer spec keeps Megatron's ``MoELayer`` and puts ``moe.GroupSinkhornRouter`` into its router
entry; the NeMo 2 stack (0.15.3) gets ``LongContextMoELayer`` instead (tests/test_moe_cp.py trains both paths' logic
end to end on 0.15.3)."""

from __future__ import annotations

import pytest

pytest.importorskip("megatron.bridge", reason="the Megatron-Bridge stack (scripts/install_bridge.sh)")


@pytest.mark.smoke
def test_moe_layer_spec_gets_the_group_sinkhorn_router():
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec
    from megatron.core.transformer.moe.moe_layer import MoELayer
    from megatron.core.transformer.moe.router import TopKRouter

    from nemo_longctx.integrations.megatron import moe
    from nemo_longctx.integrations.megatron.spec import long_context_layer_spec

    base = get_gpt_layer_local_spec(num_experts=4, moe_grouped_gemm=False)
    mlp = base.submodules.mlp  # 0.19: functools.partial(MoELayer, submodules=MoESubmodules(...))
    assert mlp.func is MoELayer and mlp.keywords["submodules"].router is TopKRouter
    assert moe.has_router_submodule() and not moe.needs_long_context_moe_layer()
    ours = long_context_layer_spec(base, "ring").submodules.mlp
    assert ours.func is MoELayer and ours.keywords["submodules"].router is moe.GroupSinkhornRouter
    assert ours.keywords["submodules"].experts.func is mlp.keywords["submodules"].experts.func  # the router changes
    assert mlp.keywords["submodules"].router is TopKRouter  # the base spec is not modified
