"""nemo-longctx: long-context training for NeMo 2 / Megatron-core."""

__version__ = "0.1.0"
