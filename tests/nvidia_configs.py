"""Every ``GPTConfig`` NVIDIA ships in ``nemo.collections.llm.gpt.model``, shrunk to a tiny size and trained under
cp=none, ring, Ulysses and hybrid CP through Megatron-core's own training machinery (CPU, fp32, gloo).

Used by ``tests/test_nvidia_configs_cp.py`` (a CI-sized subset) and ``bench/nvidia_configs_sweep.py`` (all of them).

- ``discover_gpt_configs()``: imports every module of the package (``pkgutil.iter_modules``) and walks
  ``GPTConfig.__subclasses__()`` recursively, so a config class NeMo adds is swept without anyone listing it.
- ``shrink(config, seq_length=128)``: ONE generic rule set, no per-family table. It reads the size fields of the
  config (an instance with NVIDIA's defaults, or the class itself where NVIDIA's defaults do not instantiate) and
  rebuilds the same class from the arguments the config was constructed with plus tiny sizes, so every other field
  keeps NVIDIA's value and ``__post_init__`` re-derives what depends on the sizes. Sizes: 4 attention heads with the
  attention kind kept (MHA 4/4, GQA 4/2, MQA 4/1; per block too in heterogeneous Llama-Nemotron json); head dims
  (``kv_channels`` and MLA's ``qk_head_dim``/``qk_pos_emb_head_dim``/``v_head_dim``) / 8; ``hidden_size`` keeping
  its ratio to heads x head dim; widths (FFN, MoE FFN, shared expert, MLA ranks) keeping their ratio to the hidden
  size; experts >= 2 x top-k and divisible by the router groups with enough experts in the selected groups; layers:
  enough for every per-layer pattern (``moe_layer_freq`` first-k-dense / interleaved lists, ``window_attn_skip_freq``,
  ``no_rope_freq``, ``nope_layer_interval``, ``interleaved_attn_pattern``; heterogeneous blocks: the first block of
  each kind), per-layer lists cut to that many layers; ``window_size`` (and ``attention_chunk_size``) below a CP=2
  zigzag chunk of the 128-token sequence so sliding windows act; vocab 256.
- ``comparison_overrides(cp)``: what the comparison itself needs, not sizes: fp32 (params, no bf16/fp16, no
  pipeline dtype), TP = PP = EP = 1, the run's CP size, and dropout 0 (masks depend on how the sequence is laid out
  over the ranks, so no two layouts could agree; a config whose NVIDIA dropout is not 0 says so in its note).
- ``sweep_job(rank, world, groups)``: the per-rank job (one ``tests/distributed.run_distributed`` spawn of 2 gloo
  ranks). Each model is built as NeMo builds it (``enable_long_context`` then the config's own ``configure_model``)
  and trained STEPS SGD steps the way NeMo trains it: Megatron's ``DistributedDataParallel`` (grads averaged over the
  data-parallel-with-CP group, ``finalize_model_grads``), ``get_forward_backward_func()`` (no pipelining) with the
  config's ``data_step_fn`` (``long_context_data_step``: ``shard_batch_for_cp``) and ``forward_step_fn``, NeMo's
  ``MaskedTokenLossReduction`` as the loss function and its ``reduce`` (sum / count over dp x cp) as the reported
  loss; SGD on the DDP main grads. cp=none: CP size 1, so the two ranks are data parallel and both get the SAME
  sequence (DDP's average of two equal gradients is that sequence's gradient); CP=2: that sequence sharded over
  the two ranks. Every mode starts from the cp=none model's initial weights.
- ``format_table(...)``: the Markdown table (and the verbatim messages).
"""

from __future__ import annotations

import dataclasses
import functools
import gc
import importlib
import json
import math
import os
import pkgutil
import time
import traceback
import types
from typing import Any, Dict, List, Mapping, Optional, Sequence, Tuple

import torch

PACKAGE = "nemo.collections.llm.gpt.model"
SEQ, STEPS, LR, VOCAB = 128, 3, 0.5, 256
TOL = 5e-6  # relative, per step, vs cp=none
# the no-communication control must differ from cp=none by more than twice the tolerance and by more than
# CONTROL_FACTOR times the worst difference the real CP modes showed on the same config
CONTROL_MIN = 2 * TOL
CONTROL_FACTOR = 20
CP_MODES = (("ring", "ring", {}), ("ulysses", "ulysses", {"head_chunks": 1}), ("hybrid", "hybrid", {"ulysses_size": 2}))
MODES = ("none",) + tuple(m for m, _, _ in CP_MODES)

# The families of the package today: a test checks that discovery still finds each one.
FAMILY_MODULES = ("baichuan", "base", "chatglm", "deepseek", "gemma", "gemma2", "gemma3", "gpt_oss", "llama",
                  "llama_embedding", "llama_nemotron", "mistral", "mixtral", "nemotron", "phi3mini", "qwen2", "qwen3",
                  "reranker", "starcoder", "starcoder2")

# Not causal LMs trained by this path (checked, not assumed: the job builds each one and reports what NeMo built).
_EMBEDDING = ("bidirectional embedding model, not a causal LM: NeMo's nv-embedding layer spec (attention without the "
              "causal mask) and post_process=False (the model returns hidden states for a contrastive loss)")
_RERANKER = ("bidirectional reranker, not a causal LM: bidirectional_attention_layer_spec and post_process=False "
             "(hidden states pooled into a score head)")
EXCLUDED = {"Llama32EmbeddingConfig1B": _EMBEDDING, "Llama32EmbeddingConfig3B": _EMBEDDING,
            "Llama32Reranker1BConfig": _RERANKER, "Llama32Reranker500MConfig": _RERANKER}

HEAD_DIM_FIELDS = ("kv_channels", "qk_head_dim", "qk_pos_emb_head_dim", "v_head_dim")
WIDTH_FIELDS = ("ffn_hidden_size", "moe_ffn_hidden_size", "moe_shared_expert_intermediate_size", "q_lora_rank",
                "kv_lora_rank")
LAYER_PATTERN_FIELDS = ("moe_layer_freq", "window_attn_skip_freq", "no_rope_freq", "nope_layer_interval",
                        "interleaved_attn_pattern")
HETEROGENEOUS_JSON = "heterogeneous_layers_config_encoded_json"
# Megatron's model build records the config's attention backend in these and asserts them at the next build: a
# process that builds models of different backends (Gemma's flash, the others' auto) restores them after each.
BACKEND_ENV = ("NVTE_FLASH_ATTN", "NVTE_FUSED_ATTN", "NVTE_UNFUSED_ATTN")


# ---------------------------------------------------------------------------------------------------- discovery
def discover_gpt_configs() -> List[Tuple[str, type]]:
    """(module short name, class) of every ``GPTConfig`` subclass defined in the package, sorted by both names.
    Every module of the package is imported first (``pkgutil.iter_modules``; an import error raises, nothing is
    skipped). Its one subpackage, ``megatron``, holds Hyena's layers (some need TransformerEngine), no configs."""
    pkg = importlib.import_module(PACKAGE)
    from nemo.collections.llm.gpt.model.base import GPTConfig

    for info in pkgutil.iter_modules(pkg.__path__, prefix=PACKAGE + "."):
        importlib.import_module(info.name)
    found, stack = set(), [GPTConfig]
    while stack:
        for sub in stack.pop().__subclasses__():
            if sub not in found:
                found.add(sub)
                stack.append(sub)
    return sorted(((c.__module__.rsplit(".", 1)[-1], c) for c in found if c.__module__.startswith(PACKAGE + ".")),
                  key=lambda mc: (mc[0], mc[1].__name__))


def class_path(cls: type) -> str:
    return f"{cls.__module__}:{cls.__qualname__}"


def resolve(path: str) -> type:
    module, name = path.split(":")
    return getattr(importlib.import_module(module), name)


# ------------------------------------------------------------------------------------------------------- shrink
def _ceil8(x: float, floor: int = 8) -> int:
    return max(floor, 8 * math.ceil(x / 8))


def _tiny_heads(heads: Optional[int], groups: Optional[int]) -> Tuple[int, int]:
    """4 query heads, keeping the attention kind: MHA 4/4, GQA 4/2, MQA 4/1."""
    if not heads or groups in (None, heads):
        return 4, 4
    return (4, 1) if groups == 1 else (4, 2)


def _period(seq: Sequence) -> int:
    """Length of the shortest prefix that repeated gives ``seq``."""
    for p in range(1, len(seq) + 1):
        if all(seq[i] == seq[i - p] for i in range(p, len(seq))):
            return p
    return len(seq)


def _layers_needed(value: Any, num_layers: int) -> int:
    """Layers a per-layer pattern field needs so that each kind of layer it defines is built at least once.

    An int k: every k-th layer differs, so k layers. A list as long as the model: per-layer flags; a leading run
    (first-k-dense MoE) plus one period of the rest, or one period of the whole list, whichever is shorter. A
    shorter sequence (Gemma 3's ``interleaved_attn_pattern=(local, global)``): counts of layers per kind, summed."""
    if value is None or isinstance(value, bool):
        return 1
    if isinstance(value, int):
        return max(1, value)
    seq = list(value)
    if not seq:
        return 1
    if len(seq) != num_layers:
        return max(1, sum(int(v) for v in seq))
    lead = next((i for i, v in enumerate(seq) if v != seq[0]), len(seq))
    rest = seq[lead:]
    return min(_period(seq), lead + (_period(rest) if rest else 0))


def _block_kind(block: Mapping) -> tuple:
    attn, ffn = block.get("attention", {}), block.get("ffn") or block.get("mlp") or {}
    return (bool(attn.get("no_op")), bool(attn.get("replace_with_linear")), bool(ffn.get("no_op")),
            bool(ffn.get("replace_with_linear")))


def _shrink_heterogeneous(encoded: str, heads: int, tiny_heads: int) -> Tuple[str, int]:
    """Heterogeneous (Llama-Nemotron) block list: the first block of each kind (normal / no-op / linear attention and
    MLP), each block's ``n_heads_in_group`` mapped like the model's own heads (GQA stays GQA, MQA stays MQA)."""
    spec = json.loads(encoded)
    kinds: Dict[tuple, dict] = {}
    for block in spec["block_configs"]:
        kinds.setdefault(_block_kind(block), block)
    blocks = [json.loads(json.dumps(b)) for b in kinds.values()]
    if len(blocks) < 2:
        blocks = [json.loads(json.dumps(b)) for b in spec["block_configs"][:2]]
    for block in blocks:
        n = block.get("attention", {}).get("n_heads_in_group")
        if n:
            _, groups = _tiny_heads(heads, heads // n)
            block["attention"]["n_heads_in_group"] = tiny_heads // groups
    spec["block_configs"] = blocks
    if "num_hidden_layers" in spec:
        spec["num_hidden_layers"] = len(blocks)
    return json.dumps(spec), len(blocks)


def tiny_sizes(values: Mapping[str, Any], seq_length: int = SEQ) -> Dict[str, Any]:
    """The tiny values of the size fields of a config whose fields are ``values`` (see the module docstring)."""
    out: Dict[str, Any] = {"seq_length": seq_length, "vocab_size": VOCAB}
    heads, groups = values.get("num_attention_heads") or 0, values.get("num_query_groups")
    out["num_attention_heads"], out["num_query_groups"] = _tiny_heads(heads, groups)
    for f in HEAD_DIM_FIELDS:
        if values.get(f):
            out[f] = min(32, _ceil8(values[f] / 8))
    mla = bool(values.get("multi_latent_attention"))
    ref = "v_head_dim" if mla else "kv_channels"
    hidden = values.get("hidden_size") or 0
    ratio = hidden / (heads * values[ref]) if hidden and heads and values.get(ref) else 1.0
    out["hidden_size"] = min(128, max(32, _ceil8(out["num_attention_heads"] * out.get(ref, 16) * ratio)))
    for f in WIDTH_FIELDS:
        if values.get(f):
            scale = out["hidden_size"] / hidden if hidden else 1 / 64
            out[f] = _ceil8(values[f] * scale, floor=16)
    experts = values.get("num_moe_experts")
    if experts:
        topk = values.get("moe_router_topk") or 1
        n_groups = values.get("moe_router_num_groups") or 1
        group_topk = values.get("moe_router_group_topk") or n_groups
        per_group = max(math.ceil(min(experts, max(4, 2 * topk)) / n_groups), math.ceil(topk / group_topk))
        out["num_moe_experts"] = min(experts, per_group * n_groups)
    old_layers = values.get("num_layers") or 0
    layers = max([2] + [_layers_needed(values.get(f), old_layers) for f in LAYER_PATTERN_FIELDS])
    layers = min(layers, old_layers) if old_layers else layers
    for f in LAYER_PATTERN_FIELDS:
        v = values.get(f)
        if isinstance(v, (list, tuple)) and old_layers and len(v) == old_layers:
            out[f] = list(v[:layers])
    if values.get(HETEROGENEOUS_JSON):
        out[HETEROGENEOUS_JSON], layers = _shrink_heterogeneous(values[HETEROGENEOUS_JSON], heads,
                                                                out["num_attention_heads"])
    out["num_layers"] = layers
    window, limit = values.get("window_size"), 3 * seq_length // 16  # below a CP=2 zigzag chunk (S/4)
    if window is not None:
        if isinstance(window, (list, tuple)):  # a tuple: Megatron's mask cache needs it hashable
            out["window_size"] = tuple(min(int(w), limit) if int(w) >= 0 else int(w) for w in window)
        else:
            out["window_size"] = min(int(window), limit)
    if values.get("attention_chunk_size"):
        out["attention_chunk_size"] = min(int(values["attention_chunk_size"]), seq_length // 4)
    return out


def field_values(config: Any) -> Dict[str, Any]:
    """A config's field values; for a class, its field defaults."""
    if not isinstance(config, type):
        return {f.name: getattr(config, f.name) for f in dataclasses.fields(config)}
    out = {}
    for f in dataclasses.fields(config):
        if f.default is not dataclasses.MISSING:
            out[f.name] = f.default
        elif f.default_factory is not dataclasses.MISSING:  # type: ignore[misc]
            out[f.name] = f.default_factory()  # type: ignore[misc]
    return out


def constructor_args(config: Any) -> Dict[str, Any]:
    """The arguments the config was constructed with (NeMo records them in ``__io__``); none for a class."""
    io_cfg = getattr(config, "__io__", None) if not isinstance(config, type) else None
    return dict(getattr(io_cfg, "__arguments__", {}) or {})


def shrink(config: Any, seq_length: int = SEQ, **overrides: Any) -> Any:
    """The same config class at tiny sizes: rebuilt from ``config``'s constructor arguments, the tiny size fields
    (``tiny_sizes``) and ``overrides``. ``config`` is an instance (NVIDIA's defaults) or, where those do not
    instantiate (an abstract family base with zero sizes), the class."""
    cls = config if isinstance(config, type) else type(config)
    return cls(**{**constructor_args(config), **tiny_sizes(field_values(config), seq_length), **overrides})


def comparison_overrides(cp: int) -> Dict[str, Any]:
    """Non-size fields the comparison sets: fp32, no model parallelism but the run's CP size, no dropout."""
    return dict(params_dtype=torch.float32, bf16=False, fp16=False, pipeline_dtype=None, autocast_dtype=torch.float32,
                tensor_model_parallel_size=1, pipeline_model_parallel_size=1,
                virtual_pipeline_model_parallel_size=None, expert_model_parallel_size=1,
                expert_tensor_parallel_size=1, sequence_parallel=False, context_parallel_size=cp,
                hidden_dropout=0.0, attention_dropout=0.0)


def tiny_config(cls: type, cp: int = 1) -> Tuple[Any, List[str]]:
    """(tiny fp32 config of ``cls`` for CP size ``cp``, notes). Raises what building the config raises."""
    notes = []
    try:
        base: Any = cls()
    except Exception as e:  # noqa: BLE001 - abstract bases: sizes from the class fields (reported)
        base = cls
        notes.append(f"NVIDIA's defaults do not instantiate ({first_line(e)}): sizes from the class fields")
    values = field_values(base)
    dropout = {k: values.get(k) for k in ("attention_dropout", "hidden_dropout") if values.get(k)}
    if dropout:
        notes.append("NVIDIA's " + ", ".join(f"{k}={v}" for k, v in dropout.items()) + " set to 0 for the comparison")
    return shrink(base, SEQ, **comparison_overrides(cp)), notes


def _describe(value: Any) -> Any:
    """A hashable, address-free description of a field value (for deduplication)."""
    if isinstance(value, functools.partial):
        return ("partial", _describe(value.func), tuple(_describe(a) for a in value.args),
                tuple(sorted((k, _describe(v)) for k, v in value.keywords.items())))
    if isinstance(value, (types.FunctionType, types.BuiltinFunctionType, type)):
        return f"{value.__module__}.{value.__qualname__}"
    if isinstance(value, (list, tuple)):
        return (type(value).__name__,) + tuple(_describe(v) for v in value)
    if isinstance(value, dict):
        return tuple(sorted((str(k), _describe(v)) for k, v in value.items()))
    text = repr(value)
    return ("object", type(value).__qualname__, id(value)) if " at 0x" in text else text


def dedupe_key(config: Any) -> tuple:
    """Equal keys: same ``configure_model`` and the same value in every field, so the same model is trained."""
    build = type(config).configure_model
    return (f"{build.__module__}.{build.__qualname__}",) + tuple(
        (f.name, _describe(getattr(config, f.name))) for f in dataclasses.fields(config))


def plan(classes: Sequence[Tuple[str, type]]) -> List[Dict[str, Any]]:
    """Groups of configs that are the same model once shrunk (each run once), in discovery order. A config that
    cannot be built, and each excluded one, is its own group."""
    groups: Dict[Any, Dict[str, Any]] = {}
    for module, cls in classes:
        try:
            key = ("config",) + dedupe_key(tiny_config(cls)[0]) if cls.__name__ not in EXCLUDED else ("own", cls)
        except Exception:  # noqa: BLE001 - reported by the job, which builds it again
            key = ("own", cls)
        group = groups.setdefault(key, {"paths": [], "names": [], "modules": []})
        group["paths"].append(class_path(cls))
        group["names"].append(cls.__name__)
        if module not in group["modules"]:
            group["modules"].append(module)
    return list(groups.values())


# ---------------------------------------------------------------------------------------------------- the job
def first_line(e: BaseException) -> str:
    text = str(e).strip()
    return f"{type(e).__name__}: {text.splitlines()[0] if text else ''}".rstrip(": ")


def _error(e: BaseException, step: Optional[int]) -> Dict[str, Any]:
    frames = traceback.extract_tb(e.__traceback__)
    where = ""
    if frames:
        path = os.path.normpath(frames[-1].filename)
        for root in ("site-packages/", os.path.normpath(os.path.join(os.path.dirname(__file__), "..")) + "/"):
            path = path.split(root)[-1]
        where = f"{path}:{frames[-1].lineno}"
    return {"status": "refused" if step in (None, 0) else f"failed at step {step}", "error": first_line(e),
            "full": f"{type(e).__name__}: {str(e).strip()}"[:3000], "where": where}


def _batch() -> Dict[str, torch.Tensor]:
    """One sequence, the same every step (the loss must fall: the model memorizes it)."""
    g = torch.Generator().manual_seed(11)
    seq = torch.randint(0, VOCAB, (1, SEQ + 1), generator=g)
    return {"tokens": seq[:, :-1], "labels": seq[:, 1:], "loss_mask": torch.ones(1, SEQ),
            "position_ids": torch.arange(SEQ)[None]}


def _build(cls: type, cp: int, algo: str, kwargs: Mapping, long_context: bool = True) -> Any:
    from nemo_longctx.integrations.nemo.model import enable_long_context

    config, _ = tiny_config(cls, cp)
    if long_context:
        enable_long_context(config, algo, **dict(kwargs))
    return config


def _configure(config: Any) -> Any:
    """``config.configure_model(None)``, leaving the attention-backend environment as it found it."""
    env = {k: os.environ.get(k) for k in BACKEND_ENV}
    try:
        return config.configure_model(None)
    finally:
        for k, v in env.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v


def train(config: Any, state: Optional[Dict[str, torch.Tensor]] = None, local_only: bool = False
          ) -> Tuple[List[float], Dict[str, torch.Tensor]]:
    """STEPS steps of NeMo's training path (module docstring); returns (per-step global mean token loss, the
    initial state dict). ``state``: initial weights to load; ``local_only``: every core attention with CP size 1
    (each rank attends only within its own shards: the no-communication control). An exception carries the step
    it happened in as ``e.step`` (None while building)."""
    from megatron.core import tensor_parallel
    from megatron.core.distributed import DistributedDataParallel, DistributedDataParallelConfig, finalize_model_grads
    from megatron.core.pipeline_parallel import get_forward_backward_func
    from megatron.core.transformer.moe.moe_utils import clear_aux_losses_tracker
    from nemo.lightning.megatron_parallel import MaskedTokenLossReduction

    step = None
    try:
        torch.manual_seed(3)
        tensor_parallel.model_parallel_cuda_manual_seed(3)
        model = _configure(config)
        if state is not None:
            missing, unexpected = model.load_state_dict(state, strict=False)
            if unexpected or any(not k.endswith("_extra_state") for k in missing):
                raise RuntimeError(f"initial state does not fit: missing {missing}, unexpected {unexpected}")
        init = {k: v.detach().clone() for k, v in model.state_dict().items() if isinstance(v, torch.Tensor)}
        if local_only:
            for module in model.modules():
                if hasattr(module, "cp_size") and hasattr(module, "algorithm"):
                    module.cp_size = 1
        ddp = DistributedDataParallel(config, DistributedDataParallelConfig(check_for_nan_in_grad=True), model)
        config.no_sync_func = ddp.no_sync
        config.finalize_model_grads_func = finalize_model_grads
        reduction = MaskedTokenLossReduction()

        def forward_step(data_iterator, chunk):  # NeMo's MegatronParallel step: data step, forward step, loss fn
            data = config.data_step_fn(data_iterator)
            return config.forward_step_fn(chunk, data), functools.partial(reduction.forward, data)

        losses = []
        for step in range(STEPS):
            ddp.zero_grad_buffer()
            store = get_forward_backward_func()(
                forward_step_func=forward_step, data_iterator=iter([_batch()]), model=[ddp], num_microbatches=1,
                seq_length=SEQ, micro_batch_size=1, forward_only=False)
            losses.append(float(reduction.reduce(store)))
            with torch.no_grad():
                for p in ddp.module.parameters():
                    if p.requires_grad:
                        p.add_(p.main_grad.to(p.dtype), alpha=-LR)
            clear_aux_losses_tracker()
        return losses, init
    except Exception as e:
        e.step = step  # type: ignore[attr-defined]
        raise


def _run(fn, *args, **kwargs) -> Tuple[Optional[Any], Optional[Dict[str, Any]]]:
    try:
        return fn(*args, **kwargs), None
    except Exception as e:  # noqa: BLE001 - every exception is a result, reported in the table
        return None, _error(e, getattr(e, "step", None))


def _compare(losses: List[float], ref: List[float]) -> Dict[str, Any]:
    worst = max(abs(a - b) / abs(b) for a, b in zip(losses, ref))
    ok = len(losses) == len(ref) and all(math.isfinite(x) for x in losses) and worst <= TOL
    return {"status": "match" if ok else "MISMATCH", "worst": worst, "losses": losses}


def _excluded_check(cls: type) -> Dict[str, Any]:
    """What NeMo builds for an excluded config (plain, cp=1) and whether our attention takes it."""
    model, err = _run(lambda: _configure(_build(cls, 1, "ring", {}, long_context=False)))
    if err:
        return {"built": err["error"]}
    mask = next((str(getattr(m.core_attention, "attn_mask_type", "?")) for m in model.modules()
                 if hasattr(m, "core_attention")), "no attention")
    _, ours = _run(lambda: _configure(_build(cls, 1, "ring", {})))
    return {"built": f"post_process={model.post_process}, attention {mask}",
            "ours": ours["error"] if ours else "built (nothing refused it)"}


def sweep_job(rank: int, world: int, groups: Sequence[Mapping[str, Any]], control: bool = True,
              discover: bool = False) -> Dict[str, Any]:
    """One rank of a sweep over ``groups`` (``plan``'s groups; the first class of each is trained). cp=none for
    every group first (CP size 1), then ring / Ulysses / hybrid at CP=``world``, then the no-communication control
    on the first group whose ring run matched. ``discover``: rank 0 also returns the discovered (module, class name)
    list and ``plan``'s groups of all of them (the CI test's coverage check)."""
    from megatron.core import parallel_state as ps

    from nemo_longctx.integrations.nemo import compat

    compat.apply()
    out: Dict[str, Any] = {"results": [], "control": None}
    if discover and rank == 0:
        found = discover_gpt_configs()
        out["discovered"] = [(m, c.__name__) for m, c in found]
        out["plan"] = [g["names"] for g in plan(found)]
    states: Dict[int, Dict[str, torch.Tensor]] = {}
    ps.initialize_model_parallel(context_parallel_size=1, distributed_timeout_minutes=10)
    for i, group in enumerate(groups):
        t0 = time.perf_counter()
        cls = resolve(group["paths"][0])
        res: Dict[str, Any] = {"names": list(group["names"]), "modules": list(group["modules"]), "notes": []}
        out["results"].append(res)
        if cls.__name__ in EXCLUDED:
            res["excluded"] = EXCLUDED[cls.__name__]
            res["check"] = _excluded_check(cls)
            res["seconds"] = time.perf_counter() - t0
            continue
        cfg, err = _run(tiny_config, cls, 1)
        if err:
            res["none"] = err
        else:
            res["notes"] += cfg[1]
            result, err = _run(lambda: train(_build(cls, 1, "ring", {})))
            if err:
                res["none"] = err
            else:
                res["none"] = {"status": "ok", "losses": result[0]}
                states[i] = result[1]
        res["seconds"] = time.perf_counter() - t0
    ps.destroy_model_parallel()
    ps.initialize_model_parallel(context_parallel_size=world, distributed_timeout_minutes=10)
    for i, (group, res) in enumerate(zip(groups, out["results"])):
        if "excluded" in res:
            continue
        t0 = time.perf_counter()
        cls = resolve(group["paths"][0])
        ref = res["none"].get("losses")
        for mode, algo, kwargs in CP_MODES:
            result, err = _run(lambda: train(_build(cls, world, algo, kwargs), states.get(i)))
            if err:
                res[mode] = err
            elif ref is None:
                res[mode] = {"status": "ran (no cp=none reference)", "losses": result[0]}
            else:
                res[mode] = _compare(result[0], ref)
        res["seconds"] += time.perf_counter() - t0
        gc.collect()  # the models of the group (a config holds its DDP wrapper through no_sync_func)
    if control:
        matched = [i for i, r in enumerate(out["results"]) if r.get("ring", {}).get("status") == "match"]
        # prefer a config without MLA (tiny MLA models mix little across the sequence: a weaker control)
        matched.sort(key=lambda i: bool(getattr(resolve(groups[i]["paths"][0]), "multi_latent_attention", False)))
        if matched:
            pick = matched[0]
            cls = resolve(groups[pick]["paths"][0])
            result, err = _run(lambda: train(_build(cls, world, "ring", {}), states[pick], local_only=True))
            ref = out["results"][pick]["none"]["losses"]
            agreement = max(out["results"][pick][m]["worst"] for m in ("ring", "ulysses", "hybrid")
                            if out["results"][pick].get(m, {}).get("status") == "match")
            out["control"] = {"config": cls.__name__, "cp_agreement": agreement,
                              **(err or _compare(result[0], ref))}
    ps.destroy_model_parallel()
    return out


def check_control(control: Optional[Mapping[str, Any]]) -> float:
    """The no-communication control must differ from cp=none by more than twice the tolerance and by more than
    CONTROL_FACTOR times what the real CP modes differed on the same config (else the comparison could not tell CP
    attention from no attention across ranks). Returns its worst relative difference."""
    assert control is not None, "no config matched under ring: no control could be run"
    assert "worst" in control, f"the no-communication control did not run: {control}"
    need = max(CONTROL_MIN, CONTROL_FACTOR * control["cp_agreement"])
    assert control["worst"] > need, f"the no-communication control is too close to cp=none (needs > {need:.1e}): " \
                                    f"{control}"
    return control["worst"]


# ------------------------------------------------------------------------------------------------------- table
def _cell(res: Mapping[str, Any], mode: str) -> str:
    if "excluded" in res:
        return "excluded"
    r = res.get(mode)
    if r is None:
        return "not run"
    if r["status"] == "MISMATCH":
        return f"MISMATCH {r['worst']:.1e}"
    if mode == "none" and r["status"] == "ok":
        return "ok" if r["losses"][0] > r["losses"][-1] else "ok (loss not falling)"
    return r["status"]


def _note(res: Mapping[str, Any]) -> str:
    if "excluded" in res:
        check = res.get("check", {})
        return (f"{res['excluded']}. Built: {check.get('built')}; with our attention: {check.get('ours', '-')}")
    parts: List[str] = []
    by_error: Dict[str, List[str]] = {}
    for mode in MODES:
        r = res.get(mode) or {}
        if "error" in r:
            by_error.setdefault(r["error"], []).append(mode)
        elif r.get("status") == "MISMATCH":
            parts.append(f"{mode}: worst rel diff {r['worst']:.2e}")
    for error, modes in by_error.items():
        parts.append(f"{'all modes' if len(modes) == len(MODES) else ', '.join(modes)}: {error}")
    return "; ".join(parts + list(res.get("notes", [])))


def _escape(text: str) -> str:
    return text.replace("|", "\\|").replace("\n", " ")


def format_table(results: Sequence[Mapping[str, Any]]) -> str:
    """Markdown: family module | config class(es) | none | ring | ulysses | hybrid | note | s."""
    lines = ["| family module | config class(es) | none | ring | ulysses | hybrid | note | s |",
             "|---|---|---|---|---|---|---|---|"]
    for res in sorted(results, key=lambda r: (r["modules"][0], r["names"][0])):
        cells = [", ".join(res["modules"]), ", ".join(res["names"])] + [_cell(res, m) for m in MODES]
        cells += [_note(res), f"{res.get('seconds', 0):.1f}"]
        lines.append("| " + " | ".join(_escape(c) for c in cells) + " |")
    return "\n".join(lines)


def format_messages(results: Sequence[Mapping[str, Any]]) -> str:
    """Every distinct refusal / failure message in full, with where it was raised and who got it."""
    seen: Dict[Tuple[str, str], List[str]] = {}
    for res in results:
        for mode in MODES:
            r = res.get(mode) or {}
            if "full" in r:
                seen.setdefault((r["full"], r["where"]), []).append(f"{res['names'][0]}/{mode}")
    out = []
    for (full, where), who in seen.items():
        out.append(f"- `{where}` ({len(who)}: {', '.join(who)}):\n\n  ```\n  " + full.replace("\n", "\n  ")
                   + "\n  ```")
    return "\n".join(out)
