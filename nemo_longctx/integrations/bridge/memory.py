"""The memory options (``recompute``, ``offload``, ``tiling``, the metrics keys) on a Megatron-Bridge run.

Bridge has no callback before the model exists, so the pieces that need the built model attach through the model
provider's own pre-wrap hook (``register_pre_wrap_hook``: called with the list of model chunks after they are built,
before Float16Module / DDP wrap them), and the per-step pieces are a Bridge ``Callback``:

``LongContextMemory(options)``   one per run (per process); ``configure(cfg)`` before the model is built:
                                 Megatron's recompute fields on the provider, every dense MLP tiled in the provider's
                                 layer spec (``TiledMLPLayerSpec``) and ``attach`` registered as a pre-wrap hook;
``attach(model_chunks)``         the pre-wrap hook: ``attach_memory_options`` (the full-recompute block with layer
                                 input offload, the kept-attention cache, module offload, layernorm recompute,
                                 per-layer tracker scopes), the chunked output layer + loss, the check that the MLPs
                                 were built tiled;
``callback()``                   a Bridge ``Callback``: one ``StepActivationMeter`` per training step (saved-for-
                                 backward bytes on the device / on the host, peak), then the check that nothing kept
                                 or offloaded outlived the step's backward; detaches at the end of training.

The same shared code as the NeMo 2 front end (``integrations/megatron``: ``attach_memory_options``,
``use_chunked_loss``, ``TiledMLPLayerSpec``; ``memory.tracker.StepActivationMeter``), mapped onto Bridge's objects.
Bridge's ``gpt_step.forward_step`` does not hand the loss mask to the model: the chunked loss then treats every
token as counted and stays exact (its weight gradient is recomputed chunk by chunk when the batch masks tokens).
"""

from __future__ import annotations

from typing import Any, Dict, List, Optional

from nemo_longctx.integrations.megatron.memory_options import apply_recompute_fields
from nemo_longctx.integrations.megatron.tiled_mlp_layer import with_tiled_mlp
from nemo_longctx.options import LongContextOptions

RUNTIME_ATTR = "_nemo_longctx_memory"  # the provider attribute holding the run's LongContextMemory


class LongContextMemory:
    def __init__(self, options: LongContextOptions) -> None:
        from nemo_longctx.memory.tracker import StepActivationMeter

        self.options = options
        self.runtime: Any = None  # integrations.megatron.memory_options.MemoryRuntime, once attached
        self.chunked_models = 0
        self.meter = StepActivationMeter(count_peak=options.metrics.track_peak, track=options.metrics.track)

    def configure(self, cfg: Any) -> Any:
        """Write the options onto ``cfg`` (a ``ConfigContainer``) before the model is built; idempotent (a second
        call replaces the first one's hook and spec)."""
        m = cfg.model
        t = self.options.tiling
        apply_recompute_fields(m, self.options.memory)
        m.transformer_layer_spec = with_tiled_mlp(m.transformer_layer_spec, t.mlp_tiles, t.mlp_tile_tokens)
        previous = getattr(m, RUNTIME_ATTR, None)
        hooks = getattr(m, "_pre_wrap_hooks", None)
        if previous is not None and hooks is not None:
            hooks[:] = [h for h in hooks if getattr(h, "__self__", None) is not previous]
        m.register_pre_wrap_hook(self.attach)
        setattr(m, RUNTIME_ATTR, self)
        return cfg

    def attach(self, model: List[Any]) -> List[Any]:
        """Bridge's pre-wrap hook: wire the built (unwrapped) model chunks; returns them."""
        from nemo_longctx.integrations.megatron.gpt_chunked_loss import use_chunked_loss
        from nemo_longctx.integrations.megatron.memory_options import attach_memory_options
        from nemo_longctx.integrations.megatron.tiled_mlp_layer import untiled_mlp_problem

        t = self.options.tiling
        problem = untiled_mlp_problem(model, t.mlp_tiles)
        if problem:
            raise RuntimeError(f"nemo-longctx bridge: {problem}")
        if self.runtime is not None:
            self.runtime.detach()
        self.runtime = attach_memory_options(list(model), self.options.memory)
        if t.loss_chunks != "off":
            self.chunked_models = sum(use_chunked_loss(chunk, t.loss_chunks, int(t.loss_chunk_tokens))
                                      for chunk in model)
        return model

    def describe(self, cfg: Any) -> str:
        t = self.options.tiling
        return self.options.memory.describe() + (f"; {self.tiling_line(cfg)}" if t.active else "")

    def tiling_line(self, cfg: Any) -> str:
        m = cfg.model
        return self.options.tiling.describe(int(m.seq_length), int(m.context_parallel_size or 1),
                                            int(m.tensor_model_parallel_size or 1), bool(m.sequence_parallel))

    def metrics(self) -> Dict[str, Any]:
        return self.meter.metrics()

    def callback(self) -> Any:
        from megatron.bridge.training.callbacks import Callback

        outer = self

        class LongContextMemoryCallback(Callback):
            """Per-step activation memory and the kept/offloaded-tensor check (see integrations.bridge.memory)."""

            def on_train_start(self, context: Any) -> None:
                if outer.runtime is None:
                    raise RuntimeError("nemo-longctx bridge: the memory options were never attached to the model "
                                       "(the provider's pre-wrap hook did not run: was cfg.model replaced after "
                                       "enable_long_context?)")
                import torch.distributed as dist

                t = outer.options.tiling
                if t.active and dist.get_rank() == 0:
                    print(f"nemo-longctx bridge: tiling: {outer.tiling_line(context.state.cfg)} "
                          f"({outer.chunked_models} chunked GPT model(s) on this rank)", flush=True)

            def on_train_step_start(self, context: Any) -> None:
                outer.meter.start(p for chunk in context.model for p in chunk.parameters())

            def on_train_step_end(self, context: Any) -> None:
                outer.meter.stop()
                outer.runtime.after_step(f"after step {context.state.train_state.step}")

            def on_train_end(self, context: Any) -> None:
                outer.meter.stop()
                if outer.runtime is not None:
                    outer.runtime.detach()

        return LongContextMemoryCallback()


def memory_of(cfg: Any) -> Optional[LongContextMemory]:
    """The ``LongContextMemory`` that ``enable_long_context`` put on ``cfg``'s provider (None if it was not called)."""
    return getattr(cfg.model, RUNTIME_ATTR, None)
