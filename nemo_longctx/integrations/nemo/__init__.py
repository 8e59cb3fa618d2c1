"""NeMo 2 integration: long-context strategy, model-config extension, data/forward steps, data module, callbacks."""
