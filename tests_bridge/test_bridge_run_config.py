"""Bridge's saved run config (``run_config.yaml``, written by ``ConfigContainer.to_yaml`` at every checkpoint) names our
classes as ``_target_``s, and megatron-bridge 0.6 instantiates a ``_target_`` only under allowed module prefixes
(``megatron.bridge.utils.instantiate_utils``: megatron., torch., nvidia., transformers., numpy., nemo.).
``enable_long_context`` registers ``nemo_longctx`` through Bridge's own ``register_allowed_target_prefix``, and our
layer specs write their arguments (``to_cfg_dict``), so Bridge's own loaders -- ``ConfigContainer.from_yaml`` and
``model_load_save.load_model_config`` (what loading a checkpoint's model config does) -- rebuild them. Control: with
the prefix taken off Bridge's allow-list the same file is refused ("not in the allowlist")."""

from __future__ import annotations

import pytest

pytest.importorskip("megatron.bridge", reason="the Megatron-Bridge stack (scripts/install_bridge.sh)")


@pytest.mark.smoke
def test_a_saved_run_config_naming_our_classes_reloads_through_bridges_loaders(tmp_path):
    from megatron.bridge.training.config import ConfigContainer
    from megatron.bridge.training.model_load_save import load_model_config
    from megatron.bridge.utils.instantiate_utils import InstantiationException, target_allowlist

    from nemo_longctx.apps import bridge as bridge_app
    from nemo_longctx.integrations.bridge import cpu_compat
    from nemo_longctx.integrations.bridge.config import TARGET_PREFIX, enable_long_context
    from nemo_longctx.integrations.megatron.spec import LongContextSpec
    from nemo_longctx.integrations.megatron.tiled_mlp_layer import TiledMLPLayerSpec

    cfg = bridge_app.demo_config()
    cpu_compat.cpu_settings(cfg)  # the base spec of a CPU run: cpu_compat.local_block_spec (a partial)
    enable_long_context(cfg, cp={"algorithm": "hybrid", "size": 4, "ulysses_size": 2, "head_chunks": 2},
                        tiling={"mlp_tiles": 2})
    path = tmp_path / "run_config.yaml"
    cfg.to_yaml(str(path))  # Bridge's writer (checkpointing.py saves run_config.yaml with it)
    text = path.read_text()
    assert "_target_: nemo_longctx.integrations.megatron.tiled_mlp_layer.TiledMLPLayerSpec" in text
    assert "_target_: nemo_longctx.integrations.megatron.spec.LongContextSpec" in text
    assert "_target_: nemo_longctx.integrations.bridge.cpu_compat.local_block_spec" in text

    def check(spec):
        assert isinstance(spec, TiledMLPLayerSpec) and (spec.mlp_tiles, spec.tile_tokens) == (2, 2048)
        inner = spec.base
        assert isinstance(inner, LongContextSpec) and inner.cp_algorithm == "hybrid"
        assert inner.algorithm_kwargs == {"ulysses_size": 2, "head_chunks": 2}
        assert inner.base.func is cpu_compat.local_block_spec and inner.base.keywords == {"normalization": "RMSNorm"}

    loaded = ConfigContainer.from_yaml(str(path))
    check(loaded.model.transformer_layer_spec)
    assert loaded.model.context_parallel_size == 4
    model_cfg, _ = load_model_config(str(tmp_path))  # a checkpoint directory's run_config.yaml
    check(model_cfg.transformer_layer_spec)

    # control: Bridge's allow-list without our prefix refuses the same file
    target_allowlist.remove_prefix(TARGET_PREFIX + ".")
    try:
        with pytest.raises(InstantiationException, match="is not in the allowlist"):
            ConfigContainer.from_yaml(str(path))
    finally:
        target_allowlist.add_prefix(TARGET_PREFIX + ".")
