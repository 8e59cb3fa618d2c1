"""Shard a full-sequence training batch over the context-parallel group (zigzag, identical to Megatron-core's
``megatron.core.utils.get_batch_on_this_cp_rank``).

Batch keys ``tokens``, ``labels``, ``loss_mask``, ``position_ids`` are ``[b, S]`` (sequence on dim 1); an
``attention_mask`` would be ``[b, 1, S, S]`` (sharded on dim 2, like Megatron). Labels are already shifted by the
dataset (labels[i] = tokens[i+1]), so sharding tokens and labels with the same index keeps every pair together,
including at chunk boundaries.

Packed documents (THD, ``shard_packed_batch_for_cp``): a ``[1, T]`` batch with NeMo's ``cu_seqlens`` keys is laid out
per document (each padded to a multiple of 2*cp) and sharded per document like Megatron/TE's THD partitioning
(``thd_get_partitioned_indices``); the model gets Megatron's ``PackedSeqParams``. With document-aware placement
(``cp.split_min_tokens``, set once per process with ``set_document_placement``) short documents stay whole on one CP
rank and only the long ones are split (``planner.documents``); the model then gets ``DocumentPackedSeqParams``.

Per step (``STEP_COSTS``): each CP rank's predicted attention cost summed over the step's micro-batches (the front
ends reset it at step start and report ``balance`` from it: ``step_balance_over_ranks``) and whether any
micro-batch split a document over the CP group (the run guards expect CP traffic only then).
"""

from __future__ import annotations

import itertools
from dataclasses import dataclass
from typing import Any, Dict, List, Optional, Sequence, Tuple

from nemo_longctx.attention import zigzag_shard
from nemo_longctx.attention.documents import DocumentShard
from nemo_longctx.planner.documents import (
    AttentionCostModel, DocumentPlacement, check_split_min_tokens, pairs, resolve_placement)


def seq_dim_of(key: str) -> int:
    return 2 if key == "attention_mask" else 1


# the last sharded micro-batch of this process: one sequence's tokens before sharding and this rank's share of the
# micro-batch's tokens (the run guards compare them with what the attention saw and what the layout promises); None
# where unknown (a middle pipeline stage of a dense batch gets no token tensors)
LAST_SHARD: Dict[str, Any] = {"sequence_tokens": None, "local_tokens": None}

# this step's micro-batches (reset by the front ends at step start): each CP rank's predicted attention cost, summed
# ("costs"), and whether some micro-batch sent a document over the CP group ("split": the CP attention communicates)
STEP_COSTS: Dict[str, Any] = {"costs": None, "split": False}


def _note_shard(sequence_tokens: Any, local_tokens: Any) -> None:
    LAST_SHARD["sequence_tokens"], LAST_SHARD["local_tokens"] = sequence_tokens, local_tokens


def reset_step_costs() -> None:
    STEP_COSTS.update(costs=None, split=False)


def _note_costs(costs: Sequence[float], split: bool) -> None:
    old = STEP_COSTS["costs"]
    STEP_COSTS["costs"] = list(costs) if old is None else [a + b for a, b in zip(old, costs)]
    STEP_COSTS["split"] = bool(STEP_COSTS["split"] or split)


def step_balance_over_ranks() -> Optional[float]:
    """``balance`` of the step that just ran: max / mean of the predicted attention cost of every data- and
    context-parallel rank (``batch.STEP_COSTS``: each CP rank's, summed over the step's micro-batches; every rank of
    a CP group computes the whole group's), reduced over the data-parallel ranks of this pipeline stage. A
    collective: every rank calls it at every step. None when no micro-batch recorded a cost."""
    import torch
    from megatron.core import parallel_state as ps

    costs = STEP_COSTS["costs"]
    local = torch.tensor([max(costs) if costs else 0.0, sum(costs) if costs else 0.0, len(costs) if costs else 0.0],
                         dtype=torch.float64)
    if (torch.distributed.is_initialized() and ps.model_parallel_is_initialized()
            and ps.get_data_parallel_world_size() > 1):
        group = ps.get_data_parallel_group()
        device = torch.device("cuda", torch.cuda.current_device()) if torch.cuda.is_available() else local.device
        local = local.to(device)
        top = local[:1].clone()
        torch.distributed.all_reduce(top, op=torch.distributed.ReduceOp.MAX, group=group)
        torch.distributed.all_reduce(local, group=group)
        local[0] = top[0]
    top, total, count = (float(x) for x in local.cpu())
    return top / (total / count) if count and total > 0 else None


@dataclass(frozen=True)
class DocumentPolicy:
    """How this process places packed documents under CP: ``split_min_tokens`` "off" (every document split: the
    per-document zigzag), an int or "auto"; ``cost``: the cost model ranking placements (``planner.documents``)."""

    split_min_tokens: Any = "off"
    cost: AttentionCostModel = AttentionCostModel()


_POLICY: List[DocumentPolicy] = [DocumentPolicy()]


def set_document_placement(split_min_tokens: Any, cost: Optional[AttentionCostModel] = None) -> DocumentPolicy:
    """Set this process's document placement (``cp.split_min_tokens``: "off", "auto" or a positive int), once at a
    front end's start on every rank; ValueError naming the key on a bad value."""
    value = None if split_min_tokens == "off" else split_min_tokens
    check_split_min_tokens(value)
    _POLICY[0] = DocumentPolicy(split_min_tokens if value is not None else "off", cost or AttentionCostModel())
    return _POLICY[0]


def document_policy() -> DocumentPolicy:
    return _POLICY[0]


def cost_model_of(config: Any, cuda: Optional[bool] = None) -> AttentionCostModel:
    """The cost model ``cp.split_min_tokens=auto`` ranks placements with, from a Megatron model config (head counts
    and dims: MLA's query/key and value dims when it has them; ``planner.documents.cost_model_for``) and the device
    (a GPU's throughput, or a CPU's)."""
    import torch

    from nemo_longctx.planner.documents import cost_model_for

    if cuda is None:
        cuda = torch.cuda.is_available()
    hq = int(config.num_attention_heads)
    hkv = int(getattr(config, "num_query_groups", None) or hq)
    head_dim = int(getattr(config, "kv_channels", None) or config.hidden_size // hq)
    if getattr(config, "multi_latent_attention", False):
        head_dim = int(config.qk_head_dim + config.qk_pos_emb_head_dim)
        hkv = hq
    ffn = int(getattr(config, "moe_ffn_hidden_size", None) or config.ffn_hidden_size)
    kw = {} if cuda else {"device_flops": 5e10, "call_seconds": 60e-6, "link_bytes_per_s": 1e9, "dtype_bytes": 4}
    return cost_model_for(int(config.hidden_size), hq, hkv, head_dim, ffn,
                          gated=bool(getattr(config, "gated_linear_unit", False)), **kw)


def shard_batch_for_cp(batch: Dict[str, Any], cp_size: int, cp_rank: int) -> Dict[str, Any]:
    """New dict with every tensor value replaced by this CP rank's zigzag shard (None values kept)."""
    ref = next((v for k, v in batch.items() if k in TOKEN_KEYS and v is not None), None)
    if ref is not None:  # (tokens of the micro-batch: batch x sequence)
        _note_shard(int(ref.shape[1]), int(ref.numel()) // max(1, cp_size))
        # the zigzag gives every rank the same causal pairs of each dense sequence
        _note_costs([float(ref.shape[0] * pairs(int(ref.shape[1]))) / max(1, cp_size)] * max(1, cp_size), True)
    if cp_size == 1:
        return dict(batch)
    out = {}
    for key, val in batch.items():
        if val is None:
            out[key] = None
            continue
        dim = seq_dim_of(key)
        if val.shape[dim] % (2 * cp_size) != 0:
            raise ValueError(
                f"batch[{key!r}] has sequence length {val.shape[dim]}, not divisible by 2*cp.size = {2 * cp_size}"
            )
        out[key] = zigzag_shard(val, dim, cp_size, cp_rank)
    return out


# ------------------------------------------------------------------------------------------------ packed (THD)
PACKED_KEYS = ("cu_seqlens", "cu_seqlens_argmin", "cu_seqlens_unpadded", "cu_seqlens_unpadded_argmin", "max_seqlen")
TOKEN_KEYS = ("tokens", "labels", "loss_mask", "position_ids")


def _trim(cu: Any, argmin: Any, name: str) -> List[int]:
    """One sample's cumulative lengths without NeMo's trailing -1 fill (``[b=1, n]`` or ``[n]``)."""
    import torch

    if cu.dim() == 2:
        if cu.shape[0] != 1:
            raise ValueError(f"packed sequences need micro batch size 1: batch[{name!r}] "
                             f"has shape {tuple(cu.shape)}")
        cu = cu[0]
    vals = [int(x) for x in cu.tolist()]
    if argmin is not None:
        vals = vals[: int(torch.as_tensor(argmin).reshape(-1)[0])]
    elif -1 in vals:
        vals = vals[: vals.index(-1)]
    if len(vals) < 2 or vals[0] != 0 or any(b < a for a, b in zip(vals, vals[1:])):
        raise ValueError(f"batch[{name!r}] must be cumulative document lengths starting at 0, got {vals[:8]}...")
    return vals


def packed_documents(batch: Dict[str, Any]) -> Tuple[List[int], List[int]]:
    """(starts, real lengths) of the documents of a packed batch in NeMo's format (``GPTSFTPackedDataset``:
    ``cu_seqlens`` = the packed layout, ``cu_seqlens_unpadded`` = the real lengths, both -1 filled, with their
    ``*_argmin``; our ``data.packing=documents`` yields the same keys). Without ``cu_seqlens_unpadded`` every position
    of a document is real."""
    layout = _trim(batch["cu_seqlens"], batch.get("cu_seqlens_argmin"), "cu_seqlens")
    starts = layout[:-1]
    padded = [b - a for a, b in zip(layout, layout[1:])]
    if batch.get("cu_seqlens_unpadded") is None:
        return starts, padded
    real_cu = _trim(batch["cu_seqlens_unpadded"], batch.get("cu_seqlens_unpadded_argmin"), "cu_seqlens_unpadded")
    real = [b - a for a, b in zip(real_cu, real_cu[1:])]
    if len(real) != len(padded) or any(r > p for r, p in zip(real, padded)):
        raise ValueError(f"batch['cu_seqlens_unpadded'] ({len(real)} documents) does not fit batch['cu_seqlens'] "
                         f"({len(padded)} documents): need the same documents, real length <= padded length")
    return starts, real


def _zigzag_costs(lengths: Sequence[int], layout: Sequence[int], cp_size: int) -> List[float]:
    """Each rank's attention pairs under the per-document zigzag (the balance of the default layout)."""
    from nemo_longctx.planner.documents import split_work

    padded = [b - a for a, b in zip(layout, layout[1:])]
    return [float(sum(split_work(n, p, cp_size, r)[0] for n, p in zip(lengths, padded))) for r in range(cp_size)]


def cp_packed_layout(lengths: Sequence[int], cp_size: int) -> List[int]:
    """``cu_seqlens_padded`` of documents of real ``lengths`` laid out for ``cp_size`` ranks: every document padded
    to a multiple of 2*cp (Megatron/TE's THD rule; at cp = 1 no padding)."""
    mult = 2 * cp_size if cp_size > 1 else 1
    out = [0]
    for n in lengths:
        out.append(out[-1] + -(-n // mult) * mult)
    return out


def _gather_tokens(batch: Dict[str, Any], src: Any, real: Any, offset: Any) -> Dict[str, Any]:
    """This rank's token tensors of a packed batch: position i takes sequence position ``src[i]`` where ``real[i]``
    (a real token), else padding (token/label 0, loss mask 0); ``position_ids`` are ``offset`` (the position within
    its document)."""
    out: Dict[str, Any] = {}
    for key in TOKEN_KEYS:
        val = batch.get(key)
        if val is None:
            out[key] = None
            continue
        picked = val.index_select(1, src.to(val.device))
        keep = real.to(val.device)
        if key == "position_ids":
            picked = offset.to(val.device, val.dtype)[None]
        elif key == "loss_mask":
            picked = picked * keep.to(picked.dtype)
        else:
            picked = picked.masked_fill(~keep, 0)
        out[key] = picked
    return out


def _document_packed_seq_params():
    """``DocumentPackedSeqParams``: Megatron's ``PackedSeqParams`` that also carries this rank's ``DocumentShard``
    (``documents``) and its ``placement``. Megatron's RoPE reads ``cu_seqlens_q_padded`` (the placement's
    ``rope_layout`` for this rank) and ``max_seqlen_q``; our core attention reads ``documents``."""
    from dataclasses import field, make_dataclass

    from megatron.core.packed_seq_params import PackedSeqParams

    cls = globals().get("DocumentPackedSeqParams")
    if cls is None:  # made at first use (this module imports Megatron lazily); a module attribute, so it pickles
        cls = make_dataclass("DocumentPackedSeqParams", [("documents", Any, field(default=None)),
                                                         ("placement", Any, field(default=None))],
                             bases=(PackedSeqParams,), namespace={"__module__": __name__})
        globals()["DocumentPackedSeqParams"] = cls
    return cls


def _shard_documents(batch: Dict[str, Any], starts: List[int], lengths: List[int], ref: Any, cp_size: int,
                     cp_rank: int, policy: DocumentPolicy) -> Dict[str, Any]:
    """``shard_packed_batch_for_cp`` under document-aware placement (``planner.documents``)."""
    import torch

    placement: DocumentPlacement = resolve_placement(lengths, cp_size, policy.split_min_tokens, policy.cost)
    docs, offs = placement.token_sources(cp_rank)
    src = torch.tensor([starts[i] + o if i >= 0 else 0 for i, o in zip(docs, offs)], dtype=torch.long)
    real = torch.tensor([i >= 0 for i in docs], dtype=torch.bool)
    out = _gather_tokens(batch, src, real, torch.tensor(offs, dtype=torch.long))
    device = ref.device if ref is not None else torch.device("cpu")
    cu, cup = placement.split_layout()
    shard = DocumentShard(placement.split_local, cu, cup, *placement.kept_layout(cp_rank))
    rope = placement.rope_layout(cp_rank)
    rope_t = torch.tensor(rope, dtype=torch.int32, device=device)
    longest = max(b - a for a, b in zip(rope, rope[1:]))
    _note_shard(placement.local_len * cp_size, None)
    _note_costs(placement.costs, placement.split_local > 0)
    out["packed_seq_params"] = _document_packed_seq_params()(
        qkv_format="thd", cu_seqlens_q=rope_t, cu_seqlens_kv=rope_t, cu_seqlens_q_padded=rope_t,
        cu_seqlens_kv_padded=rope_t, max_seqlen_q=longest, max_seqlen_kv=longest, documents=shard,
        placement=placement)
    return out


def shard_packed_batch_for_cp(batch: Dict[str, Any], cp_size: int, cp_rank: int,
                              policy: Optional[DocumentPolicy] = None) -> Dict[str, Any]:
    """This CP rank's part of a packed batch (``[1, T]`` token tensors + ``cu_seqlens`` keys, NeMo's format).

    The documents are re-laid out for the CP group -- each keeps its real tokens and is padded to a multiple of
    2*cp -- and sharded per document (rank r holds chunks r and 2*cp-1-r of every document, Megatron/TE's THD
    partitioning). Pad positions get loss_mask 0 (token, label 0; position ids continue the document), so padding
    contributes nothing to the loss or gradients. Returns the token keys ``[1, t_local]`` plus ``packed_seq_params``
    (Megatron's ``PackedSeqParams``, qkv_format 'thd': ``cu_seqlens_q/kv`` = real lengths, ``*_padded`` = the
    layout, int32, global; ``max_seqlen_*`` = the longest padded document) for the model's forward."""
    import torch
    from megatron.core.packed_seq_params import PackedSeqParams

    starts, lengths = packed_documents(batch)
    # a middle pipeline stage gets no token keys (all None): only the layout (PackedSeqParams) is built
    ref = next((batch[k] for k in TOKEN_KEYS if batch.get(k) is not None), None)
    if ref is not None and (ref.dim() != 2 or ref.shape[0] != 1):
        raise ValueError(f"packed sequences need micro batch size 1: tokens have shape "
                         f"{tuple(ref.shape)}")
    if ref is not None and starts and starts[-1] + lengths[-1] > ref.shape[1]:
        raise ValueError(f"batch['cu_seqlens'] covers {starts[-1] + lengths[-1]} positions but the packed sequence "
                         f"has {ref.shape[1]}")
    policy = document_policy() if policy is None else policy
    if cp_size > 1 and policy.split_min_tokens != "off":
        return _shard_documents(batch, starts, lengths, ref, cp_size, cp_rank, policy)
    layout = cp_packed_layout(lengths, cp_size)
    total = layout[-1]
    src = torch.zeros(total, dtype=torch.long)   # position in the packed batch each laid-out position reads
    real = torch.zeros(total, dtype=torch.bool)
    offset = torch.zeros(total, dtype=torch.long)  # position within the document (pads continue it)
    for start, n, a, b in zip(starts, lengths, layout, layout[1:]):
        if n:
            src[a:a + n] = torch.arange(start, start + n)
            real[a:a + n] = True
        offset[a:b] = torch.arange(b - a)
    idx = zigzag_shard(torch.arange(total), 0, cp_size, cp_rank, cu_seqlens_padded=layout)
    out = _gather_tokens(batch, src[idx], real[idx], offset[idx])
    device = ref.device if ref is not None else torch.device("cpu")
    cu = torch.tensor([0] + list(itertools.accumulate(lengths)), dtype=torch.int32, device=device)
    cu_padded = torch.tensor(layout, dtype=torch.int32, device=device)
    max_len = max(b - a for a, b in zip(layout, layout[1:]))
    # the attention covers the laid-out documents; the tokens guard is not applied to packed rows (their layout pads
    # each document for CP, and NeMo's packed fine-tuning rows need not fill the sequence)
    _note_shard(total, None)
    _note_costs(_zigzag_costs(lengths, layout, cp_size), cp_size > 1 and total > 0)
    out["packed_seq_params"] = PackedSeqParams(
        qkv_format="thd", cu_seqlens_q=cu, cu_seqlens_kv=cu, cu_seqlens_q_padded=cu_padded,
        cu_seqlens_kv_padded=cu_padded, max_seqlen_q=max_len, max_seqlen_kv=max_len)
    return out


def documents_from_position_ids(position_ids: Any) -> List[int]:
    """Document lengths of one ``[S]`` sample whose position ids restart at 0 at every document start (Megatron's
    ``reset_position_ids``: a document ends after each EOD token)."""
    import torch

    pos = position_ids.reshape(-1)
    starts = torch.nonzero(pos == 0).reshape(-1).tolist()
    if not starts or starts[0] != 0:
        raise ValueError("per-document position_ids must start at 0")
    bounds = starts + [pos.numel()]
    return [b - a for a, b in zip(bounds, bounds[1:])]


def packed_from_position_ids(batch: Dict[str, Any]) -> Dict[str, Any]:
    """A ``[1, S]`` pretraining micro-batch whose ``position_ids`` restart at 0 where a document starts (Megatron's
    ``reset_position_ids``: a document ends after each EOD token) as a packed batch in NeMo's format: the token keys
    plus ``cu_seqlens`` (int32, on the host: the layout is computed there), ready for ``shard_packed_batch_for_cp``.
    ValueError when the batch is not one such row."""
    import torch

    pos = batch.get("position_ids")
    if pos is None:
        raise ValueError("packed documents need the batch's position_ids (the documents are where they restart at 0)")
    if pos.dim() != 2 or pos.shape[0] != 1:
        raise ValueError(f"packed documents need micro batch size 1: position_ids have shape {tuple(pos.shape)}")
    lengths = documents_from_position_ids(pos[0].cpu())
    out = {k: batch.get(k) for k in TOKEN_KEYS}
    out["cu_seqlens"] = torch.tensor([0] + list(itertools.accumulate(lengths)), dtype=torch.int32)
    return out
