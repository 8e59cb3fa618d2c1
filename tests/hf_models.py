"""Tiny Hugging Face models built locally (transformers random init + a BPE tokenizer trained with `tokenizers`), and
the NeMo side of the logits comparisons: a gloo worker that builds the model of a NeMo checkpoint the way the train
app does (context config -> safe overrides -> our core attention), loads the checkpoint's weights with Megatron's
dist_checkpointing, runs the full sequence zigzag-sharded under each CP algorithm and gathers the logits."""

from __future__ import annotations

import random
from pathlib import Path
from typing import Any, Dict, List, Optional, Tuple

import torch

WORDS = ["alpha", "beta", "gamma", "delta", "long", "context", "ring", "ulysses", "token", "model", "train", "rope",
         "window", "memory", "shard", "query", "key", "value", "head", "layer"]


def corpus(n: int = 200, seed: int = 0, words: int = 60) -> List[str]:
    rng = random.Random(seed)
    return [" ".join(rng.choice(WORDS) for _ in range(rng.randint(words // 2, words * 3))) for _ in range(n)]


def make_tokenizer(vocab_size: int = 300):
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE(unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, special_tokens=["<unk>", "<s>", "</s>"],
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    tok.train_from_iterator(corpus(), trainer)
    return PreTrainedTokenizerFast(tokenizer_object=tok, bos_token="<s>", eos_token="</s>", unk_token="<unk>")


def make_hf_model(out: Path, family: str, tokenizer: Any, vocab_size: Optional[int] = None, seed: int = 0,
                  **config: Any) -> Path:
    """A 2-layer GQA model (4 query heads, 2 KV heads, head dim 16) in fp32, saved with its tokenizer."""
    from transformers import LlamaConfig, LlamaForCausalLM, Qwen2Config, Qwen2ForCausalLM

    torch.manual_seed(seed)
    common = dict(vocab_size=vocab_size or len(tokenizer), hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                  num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=256, rope_theta=10000.0,
                  bos_token_id=tokenizer.bos_token_id, eos_token_id=tokenizer.eos_token_id, torch_dtype="float32")
    common.update(config)
    if family == "llama":
        model = LlamaForCausalLM(LlamaConfig(**common))
    else:
        common.setdefault("tie_word_embeddings", True)  # as Qwen2.5's small models
        model = Qwen2ForCausalLM(Qwen2Config(**common))
    with torch.no_grad():  # larger than the default init so RoPE/attention differences show in the logits; norms
        for name, p in model.named_parameters():  # away from 1 so a norm the converter drops cannot go unnoticed
            p.normal_(1.0, 0.2) if "norm" in name else p.normal_(0.0, 0.08)
    model.save_pretrained(out)
    tokenizer.save_pretrained(out)
    return out


def hf_logits(model_dir: Path, tokens: torch.Tensor, config_changes: Optional[Dict[str, Any]] = None) -> torch.Tensor:
    """Hugging Face's own forward (the reference): logits [b, S, V] in fp32."""
    from transformers import AutoConfig, AutoModelForCausalLM

    cfg = AutoConfig.from_pretrained(model_dir)
    for k, v in (config_changes or {}).items():
        setattr(cfg, k, v)
    model = AutoModelForCausalLM.from_pretrained(model_dir, config=cfg, torch_dtype=torch.float32,
                                                 attn_implementation="eager")
    model.eval()
    with torch.no_grad():
        return model(input_ids=tokens).logits.float()


def hf_loss(model_dir: Path, tokens: torch.Tensor, labels: torch.Tensor) -> float:
    logits = hf_logits(model_dir, tokens)
    return float(torch.nn.functional.cross_entropy(logits.reshape(-1, logits.shape[-1]), labels.reshape(-1)))


# ------------------------------------------------------------------------------------------------ NeMo side (gloo)
Case = Tuple[str, str, Dict[str, Any], str]  # (name, NeMo checkpoint dir, model overrides, cp algorithm)


def nemo_logits_worker(rank: int, world: int, cases: List[Case], tokens: torch.Tensor) -> Dict[str, Any]:
    from nemo_longctx.integrations.nemo import compat

    compat.apply()
    import torch.distributed as dist
    from megatron.core import dist_checkpointing
    from megatron.core import parallel_state as ps
    from megatron.core.tensor_parallel.random import get_cuda_rng_tracker, model_parallel_cuda_manual_seed

    from nemo_longctx.attention import zigzag_unshard
    from nemo_longctx.integrations.megatron.batch import shard_batch_for_cp
    from nemo_longctx.integrations.nemo.hf import apply_model_overrides, cpu_kernel_flags_off, pretrained_model
    from nemo_longctx.integrations.nemo.model import enable_long_context

    out: Dict[str, Any] = {}
    for cp_none in (True, False):
        todo = [c for c in cases if (c[3] == "none") == cp_none]
        if not todo:
            continue
        cp = 1 if cp_none else world
        ps.initialize_model_parallel(context_parallel_size=cp)
        get_cuda_rng_tracker().reset()
        model_parallel_cuda_manual_seed(1234)
        for name, ckpt, overrides, algorithm in todo:
            _, config, tokenizer = pretrained_model(ckpt)
            config = apply_model_overrides(config, dict(overrides))
            cpu_kernel_flags_off(config)
            config.context_parallel_size = cp
            enable_long_context(config, "ring" if algorithm == "none" else algorithm)
            model = config.configure_model(tokenizer)
            sharded = model.sharded_state_dict(prefix="module.")
            loaded = dist_checkpointing.load(sharded, str(Path(ckpt) / "weights"))
            model.load_state_dict({k[len("module."):]: v for k, v in loaded.items() if k.startswith("module.")},
                                  strict=True)
            model.eval()
            batch = {"tokens": tokens, "position_ids": torch.arange(tokens.shape[1]).unsqueeze(0)}
            local = shard_batch_for_cp(batch, cp, ps.get_context_parallel_rank())
            with torch.no_grad():
                logits = model(input_ids=local["tokens"], position_ids=local["position_ids"], attention_mask=None)
            if cp > 1:
                parts = [torch.empty_like(logits) for _ in range(cp)]
                dist.all_gather(parts, logits.contiguous(), group=ps.get_context_parallel_group())
                logits = zigzag_unshard(parts, dim=1)
            # numpy: a tensor would travel as a shared-memory handle that dies with this process
            out[name] = {"logits": logits.float().numpy(), "config": type(config).__name__,
                         "rotary_base": config.rotary_base}
        ps.destroy_model_parallel()
    return out if rank == 0 else {}
