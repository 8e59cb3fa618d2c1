"""The ``tiling`` group in a NeMo 2 GPT run: sequence-tiled MLP and chunked output layer + loss.

The options (``tiling.mlp_tiles`` / ``tiling.loss_chunks``: off | auto | N, and the tile sizes of ``auto``) are
``nemo_longctx.options.TilingOptions``, checked before any rank starts and against the model config when the run is
built. ``SequenceTiling(options)`` (Lightning callback, added by the app when tiling is on):
- ``setup()`` (after the strategy attached our core attention, before the model is built): ``enable_tiling``: wraps
  ``config.transformer_layer_spec`` in ``TiledMLPLayerSpec`` (every dense MLP -> ``TiledMegatronMLP``) and
  ``config.forward_step_fn`` in ``LossMaskForwardStep`` (makes the batch's loss mask visible to the chunked loss);
- ``on_fit_start()`` (model built, before step 0): ``use_chunked_loss`` sets the policy on the GPT model(s), built as
  ``ChunkedLossGPTModel`` (NeMo's patch ledger, row M1), and checks that the MLPs were built tiled.
"""

from __future__ import annotations

from typing import Any, Dict

import lightning.pytorch as pl

from nemo_longctx.integrations.megatron.tiled_mlp_layer import TiledMLPLayerSpec, untiled_mlp_problem, with_tiled_mlp
from nemo_longctx.options import TilingOptions

__all__ = ["TiledMLPLayerSpec", "LossMaskForwardStep", "enable_tiling", "SequenceTiling"]


class LossMaskForwardStep:
    """``forward_step_fn(model, batch)`` wrapper: runs ``base`` with the batch's loss mask in ``loss_mask_scope``
    so the chunked loss knows which tokens count (NeMo's GPTModel.forward has no loss_mask argument)."""

    def __init__(self, base: Any) -> None:
        self.base = base

    def __call__(self, model: Any, batch: Dict[str, Any]) -> Any:
        from nemo_longctx.integrations.megatron.gpt_chunked_loss import loss_mask_scope

        with loss_mask_scope(batch.get("loss_mask") if isinstance(batch, dict) else None):
            return self.base(model, batch)

    def __repr__(self) -> str:
        return f"LossMaskForwardStep({self.base!r})"


def enable_tiling(config: Any, tiling: TilingOptions) -> Any:
    """Extend a NeMo GPT config in place (before the model is built); idempotent. Returns ``config``."""
    loss_chunks = tiling.loss_chunks
    config.transformer_layer_spec = with_tiled_mlp(config.transformer_layer_spec, tiling.mlp_tiles,
                                                   tiling.mlp_tile_tokens)
    step = getattr(config, "forward_step_fn", None)
    if isinstance(step, LossMaskForwardStep):
        step = step.base
    if step is not None:
        config.forward_step_fn = step if loss_chunks == "off" else LossMaskForwardStep(step)
    return config


class SequenceTiling(pl.Callback):
    """Lightning callback applying the ``tiling`` options (see the module docstring)."""

    def __init__(self, options: TilingOptions) -> None:
        self.options = options
        self.num_chunked_models = 0

    def setup(self, trainer: pl.Trainer, pl_module: Any, stage: str) -> None:
        enable_tiling(pl_module.config, self.options)

    def on_fit_start(self, trainer: pl.Trainer, pl_module: Any) -> None:
        o = self.options
        problem = untiled_mlp_problem(pl_module, o.mlp_tiles)
        if problem:
            raise RuntimeError(problem)
        if o.loss_chunks != "off":
            from nemo_longctx.integrations.megatron.gpt_chunked_loss import use_chunked_loss

            self.num_chunked_models = use_chunked_loss(pl_module, o.loss_chunks, int(o.loss_chunk_tokens))
        if trainer.global_rank == 0:
            print(f"nemo-longctx tiling: {self.describe(pl_module.config)}", flush=True)

    def describe(self, config: Any) -> str:
        """One line: the resolved tile / chunk counts per rank (for logs)."""
        line = self.options.describe(int(config.seq_length), int(config.context_parallel_size or 1),
                                     int(config.tensor_model_parallel_size or 1), bool(config.sequence_parallel))
        if self.options.loss_chunks != "off":
            line += f" ({self.num_chunked_models} chunked GPT model(s) on this rank)"
        return line
