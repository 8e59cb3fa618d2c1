"""``LongContextTransformerBlock``: Megatron's TransformerBlock with its full-recompute loop re-written so that each
checkpoint *call* can run inside the activation offloader's scope (``offload=layer_input``) and inside a tracker
``memory_scope`` (per-layer attribution).

Megatron's ``TransformerBlock._checkpointed_forward`` has no hook around its ``tensor_parallel.checkpoint`` calls, so
``attach_memory_options`` changes the class of the model's decoder block instances to this subclass (no global
patch). Semantics match Megatron's for ``recompute_method``:
  uniform  layers [0, n) in chunks of ``recompute_num_layers``, each chunk one checkpoint (the last chunk is clamped
           to the layers of this pipeline stage);
  block    the first ``recompute_num_layers`` layers checkpointed one by one, the others run normally.
With an offloader (``longctx_offloader``), the tensors the checkpoint saves for backward -- the chunk's input hidden
states (and the shared rotary embedding, when above ``min_bytes``) -- go to host memory; when layers are skipped
(block), the first non-recomputed layer's output carries a prefetch trigger so the last checkpointed input comes back
while the skipped layers run backward. Recompute in backward (reentrant) restores the CPU/CUDA RNG states, so
dropout masks are replayed exactly. fp8/fp4 (te_checkpoint) is refused.
"""

from __future__ import annotations

from typing import Any

from megatron.core import tensor_parallel
from megatron.core.transformer.transformer_block import TransformerBlock

from nemo_longctx.memory.tracker import memory_scope


class LongContextTransformerBlock(TransformerBlock):
    longctx_offloader: Any = None  # memory.offload.ActivationOffloader or None

    def _checkpointed_forward(self, hidden_states, attention_mask, context, context_mask, rotary_pos_emb,
                              attention_bias=None, packed_seq_params=None, use_inner_quantization_context=False,
                              **unused):
        cfg = self.config
        if cfg.fp8 or cfg.fp4:
            raise ValueError("nemo_longctx full recompute with offload/kept attention does not support fp8/fp4")
        engine = self.longctx_offloader
        n_layers = self.num_layers_per_pipeline_rank
        k = int(cfg.recompute_num_layers)
        if cfg.recompute_method == "uniform":
            chunks = [(s, min(s + k, n_layers), True) for s in range(0, n_layers, k)]
        elif cfg.recompute_method == "block":
            chunks = [(i, i + 1, i < k) for i in range(n_layers)]
        else:
            raise ValueError(f"recompute_method={cfg.recompute_method!r} must be 'uniform' or 'block'")

        def run_layers(start: int, end: int):
            def forward(hidden_states, attention_mask, context, context_mask, rotary_pos_emb):
                for index in range(start, end):
                    hidden_states, context = self._get_layer(index)(
                        hidden_states=hidden_states, attention_mask=attention_mask, context=context,
                        context_mask=context_mask, rotary_pos_emb=rotary_pos_emb, attention_bias=attention_bias,
                        inference_context=None, packed_seq_params=packed_seq_params,
                    )
                return hidden_states, context

            return forward

        previous_recomputed = False
        for start, end, recompute in chunks:
            args = (hidden_states, attention_mask, context, context_mask, rotary_pos_emb)
            layer_number = self._get_layer(start).layer_number  # global: unique across pipeline/virtual stages
            with memory_scope(f"layer{layer_number}"):
                if not recompute:
                    hidden_states, context = run_layers(start, end)(*args)
                    if engine is not None and previous_recomputed:
                        engine.prefetch_trigger(hidden_states)
                elif engine is None:
                    hidden_states, context = tensor_parallel.checkpoint(
                        run_layers(start, end), cfg.distribute_saved_activations, *args)
                else:
                    hidden_states, context = engine.run_in_scope(
                        layer_number, tensor_parallel.checkpoint, run_layers(start, end),
                        cfg.distribute_saved_activations, *args)
            previous_recomputed = recompute
        return hidden_states
