"""Transformer shapes the planner needs (pure python).

A `ModelShape` holds only what decides memory and FLOPs of a Llama-style GPT (RMSNorm, RoPE, GQA attention,
optionally gated MLP, untied or tied embeddings, no biases). `shape_from_config` reads it from a model config
mapping (the `model` group of the Hydra tree or a NeMo/Megatron config's fields), falling back to the shapes
of well-known configs by name for fields the mapping does not spell out.
"""

from __future__ import annotations

from dataclasses import dataclass, fields, replace
from typing import Any, Mapping


@dataclass(frozen=True)
class ModelShape:
    name: str
    num_layers: int
    hidden_size: int
    ffn_hidden_size: int
    num_attention_heads: int
    num_query_groups: int
    vocab_size: int
    kv_channels: int | None = None  # head dim; hidden_size // num_attention_heads when None
    gated_mlp: bool = True  # SwiGLU: fc1 produces gate and up (2 x ffn)
    tied_embeddings: bool = False

    def __post_init__(self):
        for f in ("num_layers", "hidden_size", "ffn_hidden_size", "num_attention_heads", "num_query_groups",
                  "vocab_size"):
            if int(getattr(self, f)) <= 0:
                raise ValueError(f"model.{f} must be a positive integer, got {getattr(self, f)!r}")
        if self.num_attention_heads % self.num_query_groups:
            raise ValueError(f"model.num_attention_heads={self.num_attention_heads} is not divisible by "
                             f"model.num_query_groups={self.num_query_groups}")
        if self.kv_channels is None and self.hidden_size % self.num_attention_heads:
            raise ValueError(f"model.hidden_size={self.hidden_size} is not divisible by "
                             f"model.num_attention_heads={self.num_attention_heads}; set model.kv_channels")

    @property
    def head_dim(self) -> int:
        return int(self.kv_channels or self.hidden_size // self.num_attention_heads)

    @property
    def q_width(self) -> int:
        """hq * d: width of the query projection and of the attention output."""
        return self.num_attention_heads * self.head_dim

    @property
    def kv_width(self) -> int:
        """hkv * d: width of one of K or V."""
        return self.num_query_groups * self.head_dim

    def layer_parameters(self) -> int:
        h, f = self.hidden_size, self.ffn_hidden_size
        attn = h * (self.q_width + 2 * self.kv_width) + self.q_width * h
        mlp = (3 if self.gated_mlp else 2) * h * f
        return attn + mlp + 2 * h  # two RMSNorm weights

    def parameters(self) -> int:
        embed = self.vocab_size * self.hidden_size
        head = 0 if self.tied_embeddings else self.vocab_size * self.hidden_size
        return self.num_layers * self.layer_parameters() + embed + head + self.hidden_size


# Shapes of the configs we ship (conf/model/*) and NeMo's Llama-3 classes; used when a config only names its class.
KNOWN_SHAPES: dict[str, ModelShape] = {
    "llama3_8b": ModelShape("llama3_8b", 32, 4096, 14336, 32, 8, 128256),
    "llama3_70b": ModelShape("llama3_70b", 80, 8192, 28672, 64, 8, 128256),
    "llama31_8b": ModelShape("llama31_8b", 32, 4096, 14336, 32, 8, 128256),
    "llama31_70b": ModelShape("llama31_70b", 80, 8192, 28672, 64, 8, 128256),
    # Qwen3-32B (NeMo's Qwen3Config32B): head dim 128, so q width 8192 > hidden 5120; QK RMSNorm (not counted)
    "qwen3_32b": ModelShape("qwen3_32b", 64, 5120, 25600, 64, 8, 151936, kv_channels=128),
}
_CLASS_NAMES = {
    "Llama3Config8B": "llama3_8b", "Llama3Config70B": "llama3_70b",
    "Llama31Config8B": "llama31_8b", "Llama31Config70B": "llama31_70b", "Qwen3Config32B": "qwen3_32b",
}
_ALIASES = {"ffn_hidden": "ffn_hidden_size", "hidden": "hidden_size", "layers": "num_layers",
            "heads": "num_attention_heads", "kv_heads": "num_query_groups", "padded_vocab_size": "vocab_size"}


def _known_for(cfg: Mapping[str, Any], name: str | None) -> ModelShape | None:
    candidates = [name, cfg.get("name")]
    target = cfg.get("_target_") or cfg.get("config_class") or ""
    candidates.append(_CLASS_NAMES.get(str(target).rsplit(".", 1)[-1]))
    for key in candidates:
        if key and key in KNOWN_SHAPES:
            return KNOWN_SHAPES[key]
    return None


def _flatten(cfg: Mapping[str, Any]) -> dict[str, Any]:
    """Shape fields may sit at the top of the model group or under a nested `config:` mapping."""
    out: dict[str, Any] = {}
    for key, value in cfg.items():
        if isinstance(value, Mapping):
            for k, v in _flatten(value).items():
                out.setdefault(k, v)
    for key, value in cfg.items():
        if not isinstance(value, Mapping):
            out[_ALIASES.get(key, key)] = value
    return out


def shape_from_config(cfg: Mapping[str, Any], name: str | None = None) -> ModelShape:
    """Build a ModelShape from a model config mapping (Hydra `model` group, or a plain dict of GPTConfig fields).

    Fields present in the mapping win; missing ones come from the known shape named by `name`, `cfg.name`
    or the config class in `_target_`. Raises ValueError naming the missing fields otherwise.
    """
    flat = _flatten(cfg)
    known = _known_for(flat, name)
    values: dict[str, Any] = {}
    for f in fields(ModelShape):
        if f.name == "name":
            continue
        if flat.get(f.name) is not None:
            values[f.name] = flat[f.name]
    if "gated_linear_unit" in flat and flat["gated_linear_unit"] is not None:
        values["gated_mlp"] = bool(flat["gated_linear_unit"])
    if "share_embeddings_and_output_weights" in flat and flat["share_embeddings_and_output_weights"] is not None:
        values["tied_embeddings"] = bool(flat["share_embeddings_and_output_weights"])
    if "num_query_groups" not in values and known is None and "num_attention_heads" in values:
        values["num_query_groups"] = values["num_attention_heads"]  # Megatron: None means MHA
    label = name or flat.get("name") or (known.name if known else "model")
    if known is not None:
        return replace(known, name=str(label), **{k: v for k, v in values.items()})
    required = ["num_layers", "hidden_size", "ffn_hidden_size", "num_attention_heads", "vocab_size"]
    missing = [f"model.{k}" for k in required if k not in values]
    if missing:
        raise ValueError(f"cannot tell the model shape: missing {', '.join(missing)} (and the config names no "
                         f"known model; known: {', '.join(sorted(KNOWN_SHAPES))})")
    return ModelShape(name=str(label), **values)
