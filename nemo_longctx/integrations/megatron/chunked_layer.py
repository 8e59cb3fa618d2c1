"""``LongContextTransformerLayer``: Megatron's ``TransformerLayer``, put into every layer spec by
``spec.long_context_layer_spec`` (in place of exactly ``TransformerLayer``; other layer classes stay), that can run
one call chunk by chunk.

Called as Megatron calls a layer it is Megatron's layer. Called with ``longctx_chunking=fn`` (what
``LongContextTransformerBlock`` does under ``recompute.sequence_chunks``), the call returns ``fn(layer, kwargs)``:
the block's sequence-chunked checkpoint, which runs the layer's own computation (``TransformerLayer.forward``) on
each chunk directly. Module hooks on the layer therefore fire once per layer and step, as for an unchunked layer:
Megatron-FSDP's parameter all-gather before the call and release after it, its pre-backward all-gather on the output,
and its post-backward gradient reduce-scatter on the input -- after the chunked backward has delivered the layer's
summed parameter gradients. (Calling the layer once per chunk ran those hooks per chunk: FSDP reduced the
gradients before they existed.)
"""

from __future__ import annotations

from typing import Any, Callable, Optional

from megatron.core.transformer.transformer_layer import TransformerLayer


class LongContextTransformerLayer(TransformerLayer):
    def forward(self, *args: Any, longctx_chunking: Optional[Callable] = None, **kwargs: Any):
        if longctx_chunking is None:
            return super().forward(*args, **kwargs)
        if args:
            raise TypeError("LongContextTransformerLayer: a chunked call passes every input by keyword")
        return longctx_chunking(self, kwargs)

    def layer_forward(self, **kwargs: Any):
        """Megatron's layer computation on the given inputs, without this module's hooks (one chunk)."""
        return super().forward(**kwargs)
