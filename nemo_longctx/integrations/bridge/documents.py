"""Packed documents on the Megatron-Bridge front end (``data.packing=documents``): attention within each document of
Bridge's pretraining data, the documents laid out for the CP group by our data step.

Bridge's GPT datasets (``GPTDatasetConfig``, real or mock) concatenate documents that end with the EOD token; with
``dataset.reset_position_ids=True`` each micro-batch's ``position_ids`` restart at 0 where a document starts. Bridge's
own ``gpt_step.forward_step`` slices that micro-batch over the CP ranks as one causal sequence; ours takes it whole::

    pretrain(cfg, packed_documents_forward_step, callbacks=long_context_callbacks(cfg, packed_documents=True))

``packed_documents_forward_step(state, data_iterator, model)``  Bridge's forward-step signature (Bridge passes its
        ``GlobalState``): the full micro-batch (``[1, S]``, before any CP slicing), its documents from the reset
        position ids (``cu_seqlens``), this CP rank's part of them (``batch.shard_packed_batch_for_cp``: every
        document zigzag-split, or placed per ``cp.split_min_tokens``), the model with the ``PackedSeqParams`` and
        Bridge's own loss function (``losses.masked_next_token_loss``; under CP each rank's loss sum is weighted by
        its share of the micro-batch's loss tokens, which differ between ranks in this layout, so the gradient is
        the micro-batch's token mean, as at cp=none);
``packed_documents_problems(cfg, keys)``  what such a run needs from the container, each naming its key;
``dense_document_problems(cfg)``  a run without it: the dataset's per-document flags our attention cannot honour;
``use_packed_documents(cfg)``  the dataset's ``reset_position_ids`` on (the documents' boundaries);
``placement_callback(options)``  a Bridge callback setting this process's document placement at train start (every
        rank), with the cost model of the built model's config.
"""

from __future__ import annotations

from functools import partial
from typing import Any, Iterable, List, Sequence, Tuple

PACKING_KEY = "data.packing=documents"


def packed_documents_problems(cfg: Any, keys: Sequence[str] = ()) -> List[str]:
    """What ``data.packing=documents`` needs from the ConfigContainer ``cfg`` (``keys``: the Bridge keys the command
    line set), each problem naming its key."""
    from megatron.bridge.training.config import GPTDatasetConfig

    p: List[str] = []
    ds, m = cfg.dataset, cfg.model
    if not isinstance(ds, GPTDatasetConfig):
        p.append(f"{PACKING_KEY} takes Bridge's pretraining data (a GPTDatasetConfig, documents ending at the EOD "
                 f"token); this run's dataset is a {type(ds).__name__}: drop data.packing or use pretraining data")
    elif "dataset.reset_position_ids" in keys and not ds.reset_position_ids:
        p.append(f"{PACKING_KEY} with dataset.reset_position_ids=false: the documents are found where the position "
                 "ids restart; drop dataset.reset_position_ids=false (data.packing=documents sets it)")
    if getattr(ds, "inter_document_masking", False):
        # the dataset then also samples and bounds its documents itself (its own cu_seqlens, which our data step does
        # not read): on the CPU demo the first steps' losses differed from data.packing=documents alone by up to
        # 7e-4 relative, and which documents each run attends within is unverified
        p.append(f"{PACKING_KEY} with dataset.inter_document_masking=true: the dataset then gives its own document "
                 "boundaries, which this data step does not read (it finds the documents where the position ids "
                 "restart), and the two disagree; set dataset.inter_document_masking=false")
    mbs = int(cfg.train.micro_batch_size)
    if mbs != 1:
        p.append(f"{PACKING_KEY} needs train.micro_batch_size=1 (got {mbs}): a packed micro-batch is one row of "
                 "documents; raise train.global_batch_size instead")
    pp = int(m.pipeline_model_parallel_size or 1)
    if pp > 1:
        p.append(f"{PACKING_KEY} with model.pipeline_model_parallel_size={pp}: Bridge builds the data on the first and "
                 "last pipeline stages only, and every stage's attention needs the documents; use "
                 "model.pipeline_model_parallel_size=1")
    if int(getattr(m, "mtp_num_layers", None) or 0) > 0:
        p.append(f"{PACKING_KEY} with model.mtp_num_layers={m.mtp_num_layers}: multi-token prediction is not wired "
                 "into our packed-documents data step; set model.mtp_num_layers=null")
    if getattr(m, "overlap_moe_expert_parallel_comm", False):
        p.append(f"{PACKING_KEY} with model.overlap_moe_expert_parallel_comm=true: Bridge's schedule plan of that "
                 "overlap takes its own data step; set it false")
    return p


# the position embeddings that read the batch's position ids (Megatron's GPTModel: rotary and YaRN angles are
# computed from the sequence length, the position ids are not read)
READS_POSITION_IDS = ("learned_absolute",)


def dense_document_problems(cfg: Any) -> List[str]:
    """A run without ``data.packing=documents`` (Bridge's own forward step) whose dataset asks for per-document
    attention or positions that the run would not give -- silently, so refused by key (one message):

    ``dataset.reset_attention_mask=true``: nemo_longctx core attention is installed at every ``cp`` (``cp=none`` runs
    our ring attention on one rank; there is no path through Bridge's own attention here) and is causal over the
    whole sequence, with no per-document mask: Bridge's ``gpt_step`` drops the dataset's mask
    (``skip_getting_attention_mask_from_dataset``, true by default: ``attention_mask=None`` reaches the model); with
    that flag false and Megatron's ``create_attention_mask`` on, the per-document mask reaches our attention, which
    refuses explicit masks at the first step, after every rank has started; with ``create_attention_mask`` off the
    dataset builds no mask at all. In every case the documents of a sequence would attend to each other.

    ``dataset.reset_position_ids=true``: the position ids never reach the core attention; Megatron's model reads them
    only for learned absolute position embeddings, where they restart at the documents as asked (the same training
    as with Bridge's own attention; the documents attend to each other, which is what
    ``dataset.reset_attention_mask=false`` asks): not refused. Rotary (and YaRN) angles are computed from the sequence
    length, so there the flag would silently change nothing: refused.

    ``dataset.inter_document_masking=true`` (refused alone, whatever the other flags; not silent, but late): Megatron's
    dataset then gives each sample's document ``cu_seqlens`` (padded to ``sequence_length + 1`` entries with copies of
    the sequence length) and Bridge's forward step passes them to the model as packed sequences. Checked on the CPU
    demo (rotary), both runs fail at the first step, after every rank has started: at ``cp=none`` Bridge trims the
    ``cu_seqlens`` at their ``argmin`` (it expects -1 padding), which is the leading 0, so no documents are left and
    Megatron's rotary embedding fails (``split_with_sizes ... got split_sizes=[]``; without rotary the empty
    ``cu_seqlens`` would reach our attention); under ring CP=2 Bridge partitions the batch with TransformerEngine's
    ``thd_get_partitioned_indices``, which needs an NVIDIA driver (on a GPU, by Bridge's code, it would ask for a
    ``cu_seqlens_argmin`` the dataset does not give, and TE's per-document split needs documents padded to a
    multiple of ``2 * cp``, which the dataset's are not). ``data.packing=documents`` gives attention within each
    document.

    Not judged: datasets without these flags."""
    ds, m = getattr(cfg, "dataset", None), cfg.model
    if ds is None:
        return []
    if getattr(ds, "inter_document_masking", False):
        return [f"dataset.inter_document_masking=true without {PACKING_KEY}: Bridge's forward step passes the "
                "dataset's document cu_seqlens to the model as packed sequences, and that path does not train here "
                "(it fails at the first step, after every rank has started: Bridge trims the cu_seqlens Megatron's "
                "dataset pads with the sequence length down to no documents, and under context parallelism it "
                "partitions them with TransformerEngine, which needs documents padded to a multiple of 2*cp); for "
                f"attention within each document use {PACKING_KEY} with dataset.inter_document_masking=false"]
    embedding = getattr(m, "position_embedding_type", None)
    mask = bool(getattr(ds, "reset_attention_mask", False))
    positions = bool(getattr(ds, "reset_position_ids", False)) and embedding not in READS_POSITION_IDS
    if not (mask or positions):
        return []
    keys = [k for k, on in (("dataset.reset_attention_mask", mask), ("dataset.reset_position_ids", positions)) if on]
    why = []
    if mask:
        why.append("nemo_longctx attention (every cp, cp=none too) is causal over the whole sequence and takes no "
                   "per-document mask (Bridge's forward step drops the dataset's mask by default), so the "
                   "documents would attend to each other")
    if positions:
        why.append(f"the model's position embedding (model.position_embedding_type={embedding}) is computed from "
                   "the sequence length, not from the position ids, so the positions would not restart at the "
                   "documents")
    return [f"{' and '.join(k + '=true' for k in keys)} without {PACKING_KEY}: {'; '.join(why)}; for attention "
            f"within each document use {PACKING_KEY}, else set {' and '.join(k + '=false' for k in keys)}"]


def use_packed_documents(cfg: Any) -> Any:
    """The dataset's position ids restart at every document (``dataset.reset_position_ids=True``): where our data
    step finds the documents. Returns ``cfg``."""
    cfg.dataset.reset_position_ids = True
    return cfg


def _device() -> Any:
    import torch

    return torch.device("cuda", torch.cuda.current_device()) if torch.cuda.is_available() else torch.device("cpu")


def packed_micro_batch(batch: dict, cp_size: int, cp_rank: int) -> Tuple[dict, Any, Any, float]:
    """(this CP rank's part of one full micro-batch of Bridge's pretraining data, the unsharded tokens and the real
    ``cu_seqlens`` for Bridge's FLOPs account, the micro-batch's loss tokens over the whole CP group): the documents
    from the reset position ids, laid out for the CP group under this process's placement policy
    (``batch.set_document_placement``)."""
    from nemo_longctx.integrations.megatron.batch import TOKEN_KEYS, packed_from_position_ids, \
        shard_packed_batch_for_cp

    missing = [k for k in TOKEN_KEYS if batch.get(k) is None]
    if missing:
        raise ValueError(f"{PACKING_KEY}: the data loader's micro-batch has no {missing} (Bridge's GPT datasets give "
                         "tokens, labels, loss_mask and position_ids)")
    device = _device()
    full = {k: batch[k].to(device, non_blocking=True) for k in TOKEN_KEYS}
    full["position_ids"] = batch["position_ids"]  # read on the host (the documents), moved below
    packed = packed_from_position_ids(full)
    packed["position_ids"] = batch["position_ids"].to(device, non_blocking=True)
    loss_tokens = float(batch["loss_mask"].sum())  # (the loader's host tensor: no device sync)
    return shard_packed_batch_for_cp(packed, cp_size, cp_rank), full["tokens"], packed["cu_seqlens"], loss_tokens


def _group_mean_loss(loss_fn: Any, scale: Any, output_tensor: Any) -> Tuple[Any, Any, Any]:
    """Bridge's loss function with this rank's loss sum scaled by ``scale`` (its share of the micro-batch's loss
    tokens times the CP size): Megatron divides each rank's sum by the rank's own token count and averages the
    gradients over the CP ranks, which is the micro-batch's token mean only when every rank holds as many loss tokens
    -- the per-document layout's ranks do not. The reported loss (sum, tokens) is Bridge's, unscaled."""
    loss, num_tokens, report = loss_fn(output_tensor)
    return loss * scale, num_tokens, report


def packed_documents_forward_step(state: Any, data_iterator: Iterable, model: Any,
                                  return_schedule_plan: bool = False) -> Tuple[Any, Any]:
    """Bridge's forward step for packed documents (see the module docstring): (the model's per-token losses,
    Bridge's loss function of this rank's loss mask)."""
    from megatron.bridge.training.losses import masked_next_token_loss
    from megatron.bridge.training.utils.flop_utils import accumulate_flops_metadata, get_model_chunk_vp_stage
    from megatron.bridge.training.utils.pg_utils import get_pg_collection
    from megatron.core.utils import get_model_config

    if return_schedule_plan:
        raise ValueError(f"{PACKING_KEY}: Bridge asked for a schedule plan (model.overlap_moe_expert_parallel_comm), "
                         "which takes its own data step")
    config = get_model_config(model)
    cp = get_pg_collection(model).cp
    timers = state.timers
    timers("batch-generator", log_level=2).start()
    with state.straggler_timer(bdata=True):
        batch, tokens, cu_seqlens, loss_tokens = packed_micro_batch(next(data_iterator), cp.size(), cp.rank())
    timers("batch-generator").stop()
    accumulate_flops_metadata(state, tokens, vp_stage=get_model_chunk_vp_stage(model),
                              config_seq_len=getattr(config, "seq_length", None),
                              cu_seqlens=cu_seqlens.to(tokens.device))
    with state.straggler_timer:
        output = model(input_ids=batch["tokens"], position_ids=batch["position_ids"], attention_mask=None,
                       labels=batch["labels"], packed_seq_params=batch["packed_seq_params"])
    rerun = state.cfg.rerun_state_machine
    loss_fn = partial(masked_next_token_loss, batch["loss_mask"], check_for_nan_in_loss=rerun.check_for_nan_in_loss,
                      check_for_spiky_loss=rerun.check_for_spiky_loss)
    if cp.size() == 1 or getattr(config, "calculate_per_token_loss", False) or loss_tokens == 0:
        return output, loss_fn  # (per-token loss: Megatron divides by the tokens of the whole step itself)
    scale = batch["loss_mask"].sum() * (cp.size() / loss_tokens)
    return output, partial(_group_mean_loss, loss_fn, scale)


def placement_callback(options: Any) -> Any:
    """A Bridge callback: at train start, on every rank, this process's document placement (``cp.split_min_tokens``;
    off without context parallelism) with the cost model of the built model's config."""
    from megatron.bridge.training.callbacks import Callback

    cp = options.cp

    class DocumentPlacement(Callback):
        def on_train_start(self, context: Any) -> None:
            from megatron.core.utils import get_model_config

            from nemo_longctx.integrations.megatron.batch import cost_model_of, set_document_placement

            set_document_placement(cp.split_min_tokens if cp.document_aware else "off",
                                   cost_model_of(get_model_config(context.model[0])))

    return DocumentPlacement()
