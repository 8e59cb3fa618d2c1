"""The ``tiling`` config group: sequence-tiled MLP and chunked output layer + loss in a NeMo 2 GPT run.

``tiling.mlp_tiles`` and ``tiling.loss_chunks`` are each ``off`` | ``auto`` | a positive int. ``auto`` means
``ceil(tokens per rank / tiling.mlp_tile_tokens)`` tiles (``/ tiling.loss_chunk_tokens`` chunks), where tokens
per rank are ``model.seq_length / cp.size`` (and ``/ tensor_model_parallel_size`` for the MLP under sequence
parallelism). ``tiling_problems`` checks them before anything is built (messages name the fields).

``SequenceTiling`` (Lightning callback, declared in ``conf/tiling/*.yaml``):
- ``__init__``: validates the settings against the Hydra config values it is given (build time, every rank);
- ``setup()`` (after the strategy attached our core attention, before the model is built): validates against
  the model config again and ``enable_tiling(config, ...)``: wraps ``config.transformer_layer_spec`` in
  ``TiledMLPLayerSpec`` (every dense MLP -> ``TiledMegatronMLP``) and ``config.forward_step_fn`` in
  ``LossMaskForwardStep`` (makes the batch's loss mask visible to the chunked loss);
- ``on_fit_start()`` (model built, before step 0): ``use_chunked_loss`` on the Megatron GPTModel(s), and checks
  that the MLPs were built tiled.
"""

from __future__ import annotations

from typing import Any, Dict, List, Optional

import lightning.pytorch as pl

from nemo_longctx.integrations.megatron.spec import resolve_layer_spec
from nemo_longctx.memory.tiling import DEFAULT_LOSS_CHUNK_TOKENS, DEFAULT_MLP_TILE_TOKENS, check_tiling_policy

FIELDS = ("tiling.mlp_tiles", "tiling.loss_chunks")


def normalize_policy(value: Any) -> Any:
    """YAML 1.1 reads a bare ``off`` as False: map it back; "16" -> 16; anything else unchanged (checked later)."""
    if value is False:
        return "off"
    if isinstance(value, str) and value.strip().isdigit():
        return int(value)
    return value


def tiling_problems(
    mlp_tiles: Any = "off",
    loss_chunks: Any = "off",
    *,
    seq_length: Optional[int] = None,
    cp_size: int = 1,
    tp_size: int = 1,
    sequence_parallel: bool = False,
    mlp_tile_tokens: int = DEFAULT_MLP_TILE_TOKENS,
    loss_chunk_tokens: int = DEFAULT_LOSS_CHUNK_TOKENS,
) -> List[str]:
    """Every problem with the tiling settings (empty list = valid); fields named as the Hydra app spells them."""
    problems = []
    policies = {"tiling.mlp_tiles": normalize_policy(mlp_tiles), "tiling.loss_chunks": normalize_policy(loss_chunks)}
    valid = {}
    for field, policy in policies.items():
        try:
            check_tiling_policy(policy, field)
            valid[field] = policy
        except ValueError as e:
            problems.append(str(e))
    for field, v in (("tiling.mlp_tile_tokens", mlp_tile_tokens), ("tiling.loss_chunk_tokens", loss_chunk_tokens)):
        if isinstance(v, bool) or not isinstance(v, int) or v <= 0:
            problems.append(f"{field} must be a positive int, got {v!r}")
    if seq_length is not None and cp_size and cp_size >= 1:
        loss_tokens = int(seq_length) // int(cp_size)
        mlp_tokens = loss_tokens // int(tp_size) if sequence_parallel and tp_size > 1 else loss_tokens
        where = f"model.seq_length={seq_length} / cp.size={cp_size}"
        for field, tokens, extra in (
            ("tiling.mlp_tiles", mlp_tokens, f" / tensor_model_parallel_size={tp_size} (sequence parallel)"
             if sequence_parallel and tp_size > 1 else ""),
            ("tiling.loss_chunks", loss_tokens, ""),
        ):
            policy = valid.get(field)
            if isinstance(policy, int) and policy > tokens:
                problems.append(
                    f"{field}={policy} exceeds the {tokens} tokens per rank ({where}{extra}): use at most {tokens}, "
                    "auto or off"
                )
    return problems


def validate_tiling(*args: Any, **kwargs: Any) -> None:
    """Raise ValueError listing every problem ``tiling_problems`` finds."""
    problems = tiling_problems(*args, **kwargs)
    if problems:
        raise ValueError("invalid tiling configuration:\n  - " + "\n  - ".join(problems))


class TiledMLPLayerSpec:
    """Callable layer spec ``spec(config, vp_stage=None)``: the base spec with every dense MLP tiled."""

    def __init__(self, base: Any, mlp_tiles: Any = "auto", tile_tokens: int = DEFAULT_MLP_TILE_TOKENS) -> None:
        self.base = base
        self.mlp_tiles = mlp_tiles
        self.tile_tokens = int(tile_tokens)

    def base_spec(self, config: Any, vp_stage: Optional[int] = None) -> Any:
        return resolve_layer_spec(self.base, config, vp_stage)

    def __call__(self, config: Any, vp_stage: Optional[int] = None) -> Any:
        from nemo_longctx.integrations.megatron.tiled_mlp_layer import tiled_mlp_layer_spec

        return tiled_mlp_layer_spec(self.base_spec(config, vp_stage), self.mlp_tiles, self.tile_tokens)

    def __repr__(self) -> str:
        return f"TiledMLPLayerSpec(base={self.base!r}, mlp_tiles={self.mlp_tiles!r})"


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


def enable_tiling(config: Any, mlp_tiles: Any = "off", loss_chunks: Any = "off",
                  mlp_tile_tokens: int = DEFAULT_MLP_TILE_TOKENS) -> Any:
    """Extend a NeMo GPT config in place (before the model is built); idempotent. Returns ``config``."""
    mlp_tiles, loss_chunks = normalize_policy(mlp_tiles), normalize_policy(loss_chunks)
    check_tiling_policy(mlp_tiles, "tiling.mlp_tiles")
    check_tiling_policy(loss_chunks, "tiling.loss_chunks")
    spec = config.transformer_layer_spec
    if isinstance(spec, TiledMLPLayerSpec):
        spec = spec.base
    config.transformer_layer_spec = spec if mlp_tiles == "off" else TiledMLPLayerSpec(spec, mlp_tiles, mlp_tile_tokens)
    step = getattr(config, "forward_step_fn", None)
    if isinstance(step, LossMaskForwardStep):
        step = step.base
    if step is not None:
        config.forward_step_fn = step if loss_chunks == "off" else LossMaskForwardStep(step)
    return config


class SequenceTiling(pl.Callback):
    """Lightning callback applying the ``tiling`` config group (see the module docstring)."""

    def __init__(
        self,
        mlp_tiles: Any = "off",
        loss_chunks: Any = "off",
        mlp_tile_tokens: int = DEFAULT_MLP_TILE_TOKENS,
        loss_chunk_tokens: int = DEFAULT_LOSS_CHUNK_TOKENS,
        seq_length: Optional[int] = None,
        cp_size: int = 1,
        tp_size: int = 1,
        sequence_parallel: bool = False,
    ) -> None:
        self.mlp_tiles, self.loss_chunks = normalize_policy(mlp_tiles), normalize_policy(loss_chunks)
        self.mlp_tile_tokens, self.loss_chunk_tokens = mlp_tile_tokens, loss_chunk_tokens
        validate_tiling(self.mlp_tiles, self.loss_chunks, seq_length=seq_length, cp_size=cp_size, tp_size=tp_size,
                        sequence_parallel=sequence_parallel, mlp_tile_tokens=mlp_tile_tokens,
                        loss_chunk_tokens=loss_chunk_tokens)
        self.num_chunked_models = 0

    @property
    def active(self) -> bool:
        return self.mlp_tiles != "off" or self.loss_chunks != "off"

    def setup(self, trainer: pl.Trainer, pl_module: Any, stage: str) -> None:
        if not self.active:
            return
        config = pl_module.config
        validate_tiling(
            self.mlp_tiles, self.loss_chunks, seq_length=config.seq_length,
            cp_size=int(config.context_parallel_size or 1), tp_size=int(config.tensor_model_parallel_size or 1),
            sequence_parallel=bool(config.sequence_parallel), mlp_tile_tokens=self.mlp_tile_tokens,
            loss_chunk_tokens=self.loss_chunk_tokens,
        )
        enable_tiling(config, self.mlp_tiles, self.loss_chunks, self.mlp_tile_tokens)

    def on_fit_start(self, trainer: pl.Trainer, pl_module: Any) -> None:
        if not self.active:
            return
        from nemo_longctx.integrations.megatron.tiled_mlp_layer import TiledMegatronMLP

        if self.mlp_tiles != "off":
            from megatron.core.transformer.mlp import MLP

            mlps = [m for m in pl_module.modules() if isinstance(m, MLP)]
            if not mlps or not all(isinstance(m, TiledMegatronMLP) for m in mlps):
                raise RuntimeError(
                    f"tiling.mlp_tiles={self.mlp_tiles!r}: the model's MLPs were not built tiled "
                    f"({sorted({type(m).__name__ for m in mlps})}); was the layer spec replaced after setup()?"
                )
        if self.loss_chunks != "off":
            from nemo_longctx.integrations.megatron.gpt_chunked_loss import use_chunked_loss

            self.num_chunked_models = use_chunked_loss(pl_module, self.loss_chunks, int(self.loss_chunk_tokens))
        if trainer.global_rank == 0:
            print(f"nemo-longctx tiling: {self.describe(pl_module.config)}", flush=True)

    def describe(self, config: Any) -> str:
        """One line: the resolved tile / chunk counts per rank (for logs)."""
        line = describe_tiling(
            self.mlp_tiles, self.loss_chunks, seq_length=int(config.seq_length),
            cp_size=int(config.context_parallel_size or 1), tp_size=int(config.tensor_model_parallel_size or 1),
            sequence_parallel=bool(config.sequence_parallel), mlp_tile_tokens=int(self.mlp_tile_tokens),
            loss_chunk_tokens=int(self.loss_chunk_tokens),
        )
        if self.loss_chunks != "off":
            line += f" ({self.num_chunked_models} chunked GPT model(s) on this rank)"
        return line


def describe_tiling(mlp_tiles: Any, loss_chunks: Any, *, seq_length: int, cp_size: int = 1, tp_size: int = 1,
                    sequence_parallel: bool = False, mlp_tile_tokens: int = DEFAULT_MLP_TILE_TOKENS,
                    loss_chunk_tokens: int = DEFAULT_LOSS_CHUNK_TOKENS) -> str:
    """One line with the tile / chunk counts per rank the settings resolve to (validated first)."""
    from nemo_longctx.memory.tiling import resolve_tiles

    mlp_tiles, loss_chunks = normalize_policy(mlp_tiles), normalize_policy(loss_chunks)
    validate_tiling(mlp_tiles, loss_chunks, seq_length=seq_length, cp_size=cp_size, tp_size=tp_size,
                    sequence_parallel=sequence_parallel, mlp_tile_tokens=mlp_tile_tokens,
                    loss_chunk_tokens=loss_chunk_tokens)
    tokens = int(seq_length) // int(cp_size)
    mlp_tokens = tokens // tp_size if sequence_parallel and tp_size > 1 else tokens
    parts = []
    if mlp_tiles != "off":
        n = resolve_tiles(mlp_tiles, mlp_tokens, int(mlp_tile_tokens), "tiling.mlp_tiles")
        parts.append(f"mlp_tiles={mlp_tiles}: {n} tile(s) of <= {-(-mlp_tokens // n)} tokens per rank")
    else:
        parts.append("mlp_tiles=off")
    if loss_chunks != "off":
        n = resolve_tiles(loss_chunks, tokens, int(loss_chunk_tokens), "tiling.loss_chunks")
        parts.append(f"loss_chunks={loss_chunks}: {n} chunk(s) of <= {-(-tokens // n)} tokens per rank")
    else:
        parts.append("loss_chunks=off")
    return "; ".join(parts)


def tiling_of(cfg: Any) -> str:
    """Validate the app config's ``tiling`` group (absent: off) against model.seq_length, cp.size and the TP /
    sequence-parallel settings, before any process is spawned; return ``describe_tiling``'s line."""
    node = cfg.get("tiling") if hasattr(cfg, "get") else None
    node = node if node is not None else {}
    s = cfg.trainer.strategy
    return describe_tiling(
        node.get("mlp_tiles", "off"), node.get("loss_chunks", "off"), seq_length=int(cfg.model.seq_length),
        cp_size=int(cfg.cp.size), tp_size=int(s.tensor_model_parallel_size),
        sequence_parallel=bool(s.sequence_parallel),
        mlp_tile_tokens=node.get("mlp_tile_tokens", DEFAULT_MLP_TILE_TOKENS),
        loss_chunk_tokens=node.get("loss_chunk_tokens", DEFAULT_LOSS_CHUNK_TOKENS),
    )
