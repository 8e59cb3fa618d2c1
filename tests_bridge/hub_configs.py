"""Public ``config.json`` values of real models, and a Hugging Face offline cache holding them (what Bridge's recipe
functions read from the hub for their model; no weights), for the Bridge tests."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Dict, Mapping

LLAMA3_8B = {  # meta-llama/Meta-Llama-3-8B
    "architectures": ["LlamaForCausalLM"], "attention_bias": False, "attention_dropout": 0.0, "bos_token_id": 128000,
    "eos_token_id": 128001, "hidden_act": "silu", "hidden_size": 4096, "initializer_range": 0.02,
    "intermediate_size": 14336, "max_position_embeddings": 8192, "model_type": "llama", "num_attention_heads": 32,
    "num_hidden_layers": 32, "num_key_value_heads": 8, "pretraining_tp": 1, "rms_norm_eps": 1e-05,
    "rope_scaling": None, "rope_theta": 500000.0, "tie_word_embeddings": False, "torch_dtype": "bfloat16",
    "use_cache": True, "vocab_size": 128256}
LLAMA31_8B = {  # meta-llama/Meta-Llama-3.1-8B: Llama-3-8B's architecture, Llama 3.1's RoPE scaling and context
    **LLAMA3_8B, "max_position_embeddings": 131072,
    "rope_scaling": {"factor": 8.0, "high_freq_factor": 4.0, "low_freq_factor": 1.0,
                     "original_max_position_embeddings": 8192, "rope_type": "llama3"}}
QWEN25_14B = {  # Qwen/Qwen2.5-14B
    "architectures": ["Qwen2ForCausalLM"], "attention_dropout": 0.0, "bos_token_id": 151643, "eos_token_id": 151643,
    "hidden_act": "silu", "hidden_size": 5120, "initializer_range": 0.02, "intermediate_size": 13824,
    "max_position_embeddings": 131072, "max_window_layers": 48, "model_type": "qwen2", "num_attention_heads": 40,
    "num_hidden_layers": 48, "num_key_value_heads": 8, "rms_norm_eps": 1e-05, "rope_theta": 1000000.0,
    "sliding_window": 131072, "tie_word_embeddings": False, "torch_dtype": "bfloat16", "use_cache": True,
    "use_sliding_window": False, "vocab_size": 152064}
HUB = {"meta-llama/Meta-Llama-3-8B": LLAMA3_8B, "meta-llama/Meta-Llama-3.1-8B": LLAMA31_8B,
       "Qwen/Qwen2.5-14B": QWEN25_14B}


def offline_cache(hf_home: Path, configs: Mapping[str, Dict] = HUB) -> Path:
    """``hf_home`` (for ``HF_HOME``, with ``HF_HUB_OFFLINE=1``) holding each repository's config.json as Hugging
    Face's own cache lays it out (``hub/models--<org>--<name>/snapshots/<rev>``, ``refs/main``); returns it."""
    for repo, config in configs.items():
        snapshot = hf_home / "hub" / f"models--{repo.replace('/', '--')}" / "snapshots" / ("0" * 40)
        snapshot.mkdir(parents=True, exist_ok=True)
        (snapshot / "config.json").write_text(json.dumps(config))
        (snapshot.parents[1] / "refs").mkdir(exist_ok=True)
        (snapshot.parents[1] / "refs" / "main").write_text("0" * 40)
    return hf_home


def hf_dir(path: Path, config: Mapping) -> Path:
    """A Hugging Face model directory holding only ``config`` (config.json; no weights); returns it."""
    path.mkdir(parents=True, exist_ok=True)
    (path / "config.json").write_text(json.dumps(dict(config)))
    return path
