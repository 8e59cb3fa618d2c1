"""Megatron-core integration: core-attention module, layer-spec rewriting, batch sharding, CPU compatibility."""
