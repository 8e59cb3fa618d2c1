"""The one place the NeMo front end patches third-party code (NeMo 2.7 and, for NeMo's set-up, Megatron-core).

Two kinds of patches live here:

- CPU-only fixes, applied by ``apply()`` and only when CUDA is unavailable (or ``force``). ``apply()`` first applies
  the framework-neutral Megatron-core fixes (``integrations.megatron.cpu_compat.apply``), then NeMo's own. It is
  idempotent (once per process; every patched callable carries the ``_nemo_longctx`` marker where re-patching would
  wrap it twice). Fix numbers are design.md's / ``integrations.megatron.cpu_compat``'s list, which keeps the
  numbering; the NeMo parts of it live here:

  4. (NeMo part) NeMo's ``megatron_init._set_random_seed`` seeds Megatron's CUDA RNG tracker only
     ``if torch.cuda.device_count() > 0``: on CPU it is seeded as well (the tracker itself runs on the CPU generator,
     Megatron part of fix 4).
  7. NeMo's ``gpt_data_step`` moves batches with ``.cuda()`` (handled by Megatron fix 3; our own data step does not
     use it) and ``MockDataModule`` drops ``create_attention_mask`` (not used: our synthetic data module replaces
     it). Nothing is patched for it.
  8. NeMo's ``MegatronCheckpointIO.load_checkpoint`` ends with ``_fix_tensors_device``, which asserts
     ``torch.cuda.is_initialized()`` to move loaded tensors to the current GPU: on CPU the loaded tensors are
     already where they belong, so it returns the checkpoint unchanged (resume from a distributed checkpoint).
  13. NeMo's HF converters (``io.apply_transforms`` in ``HFLlamaImporter``/``HFQwen2Importer`` and their exporters)
      name the pre-attention/pre-MLP norms as TransformerEngine's fused layers do (``linear_qkv.layer_norm_weight``,
      ``linear_fc1.layer_norm_weight``). Without TE the local spec keeps them as ``input_layernorm``/
      ``pre_mlp_layernorm`` (Megatron maps those names only for distributed checkpoints): the importer silently left
      the norms at their init and the exporter failed (IndexError). For a Megatron model with local norms, the
      converter's keys on the Megatron side are renamed to the local names before NeMo's ``apply_transforms`` runs.

- T1, on every machine (not a CPU fix): NeMo 2.7 calls Megatron's ``parallel_state.initialize_model_parallel``
  without a timeout; the function NeMo looks up passes ``distributed_timeout_minutes`` inside
  ``megatron_groups_timeout(timeout_s)`` (``LongContextStrategy.setup_environment``), nothing otherwise.

Every patch here is a row of NeMo's patch ledger (``patches.py``: target, devices, versions, why), applied in its
order, once, at an app's entry.
"""

from __future__ import annotations

import contextlib
import copy
import functools
import logging
from typing import Any, Dict, Optional

from nemo_longctx.integrations.megatron import cpu_compat as megatron_cpu_compat

log = logging.getLogger(__name__)

_APPLIED = False


def needed() -> bool:
    """True when this process has no usable CUDA device (the CPU fixes are only applied then)."""
    return megatron_cpu_compat.needed()


def is_applied() -> bool:
    return _APPLIED


# --------------------------------------------------------------------------------------------------------------
# 4 (NeMo part): NeMo seeds Megatron's RNG tracker only when a GPU exists
def _patch_nemo_random_seed() -> None:
    from megatron.core.tensor_parallel import random as mrandom
    from nemo.lightning import megatron_init

    if getattr(megatron_init._set_random_seed, "_nemo_longctx", False):
        return
    original_seed = megatron_init._set_random_seed

    def _set_random_seed(seed_):
        original_seed(seed_)
        from megatron.core.parallel_state import get_pipeline_model_parallel_rank

        mrandom.model_parallel_cuda_manual_seed(seed_ + 100 * get_pipeline_model_parallel_rank())  # fix 4

    _set_random_seed._nemo_longctx = True  # type: ignore[attr-defined]
    megatron_init._set_random_seed = _set_random_seed


# --------------------------------------------------------------------------------------------------------------
# 8: checkpoint load moves tensors to "the current CUDA device"
def _patch_checkpoint_load_device() -> None:
    from nemo.lightning.io import pl as nemo_io_pl

    def _fix_tensors_device(ckpt: Dict) -> Dict:
        return ckpt  # fix 8: CPU tensors stay on the CPU

    nemo_io_pl._fix_tensors_device = _fix_tensors_device


# --------------------------------------------------------------------------------------------------------------
# 13: NeMo's HF converters name the norms as TE's fused layers; the local spec keeps them separate
_TE_TO_LOCAL_NORMS = (
    (".self_attention.linear_qkv.layer_norm_weight", ".input_layernorm.weight"),
    (".self_attention.linear_qkv.layer_norm_bias", ".input_layernorm.bias"),
    (".mlp.linear_fc1.layer_norm_weight", ".pre_mlp_layernorm.weight"),
    (".mlp.linear_fc1.layer_norm_bias", ".pre_mlp_layernorm.bias"),
)


def _has_local_norms(model: Any) -> bool:
    """A Megatron model (or a NeMo model wrapping one) built with separate norm modules (no TE fused layers)."""
    from megatron.core.transformer.module import MegatronModule

    inner = model.module if isinstance(getattr(model, "module", None), MegatronModule) else model
    if not isinstance(inner, MegatronModule):
        return False
    keys = list(inner.state_dict().keys())
    return any(k.endswith(".input_layernorm.weight") for k in keys) and not any(".layer_norm_weight" in k for k in keys)


def _to_local_norm_key(key: Any) -> Any:
    if isinstance(key, (tuple, list)):
        return type(key)(_to_local_norm_key(k) for k in key)
    if isinstance(key, dict):
        return {n: _to_local_norm_key(k) for n, k in key.items()}
    if isinstance(key, str):
        for te, local in _TE_TO_LOCAL_NORMS:
            if key.endswith(te):
                return key[: -len(te)] + local
    return key


def _patch_hf_converter_norm_keys() -> None:
    from nemo.lightning import io as nemo_io
    from nemo.lightning.io import state as nemo_state

    original = nemo_state.apply_transforms
    if getattr(original, "_nemo_longctx", False):
        return

    def apply_transforms(source: Any, target: Any, mapping: Dict, transforms: Any = None, *args: Any, **kwargs: Any):
        src_local, tgt_local = _has_local_norms(source), _has_local_norms(target)
        if src_local or tgt_local:  # fix 13: the Megatron side's norm keys in the local spec's names
            mapping = {(_to_local_norm_key(k) if src_local else k): (_to_local_norm_key(v) if tgt_local else v)
                       for k, v in mapping.items()}
            renamed = []
            for t in transforms or []:
                t = copy.copy(t)
                if src_local and hasattr(t, "source_key"):
                    t.source_key = _to_local_norm_key(t.source_key)
                if tgt_local and hasattr(t, "target_key"):
                    t.target_key = _to_local_norm_key(t.target_key)
                renamed.append(t)
            transforms = renamed if transforms is not None else None
        return original(source, target, mapping, transforms, *args, **kwargs)

    apply_transforms._nemo_longctx = True  # type: ignore[attr-defined]
    nemo_state.apply_transforms = apply_transforms
    nemo_io.apply_transforms = apply_transforms  # the connectors call it as ``io.apply_transforms``


def apply(force: bool = False) -> bool:
    """Apply NeMo's patch ledger (``patches.LEDGER``) once: first the Megatron-core ledger, then these CPU fixes when
    CUDA is unavailable (or ``force``) and the all-device row (``initialize_model_parallel``'s timeout) everywhere.
    Returns True if the CPU fixes are active."""
    global _APPLIED
    from .patches import LEDGER

    LEDGER.apply(force_cpu_rows=force)
    if _APPLIED:
        return True
    if not (force or needed()):
        return False
    megatron_cpu_compat.apply(force=force)  # (applied by the ledger above: marks the Megatron CPU fixes active)
    _APPLIED = True
    log.info("nemo_longctx.integrations.nemo.compat: CPU patches for NeMo applied")
    return True


# --------------------------------------------------------------------------------------------------------------
# T1: Megatron's process groups created by NeMo's set-up with our timeout (all machines)
_GROUPS_TIMEOUT_MIN: list = []  # the timeout (minutes) for groups created inside ``megatron_groups_timeout``


def _patch_groups_timeout() -> None:
    """NeMo 2.7 calls ``parallel_state.initialize_model_parallel`` without ``distributed_timeout_minutes`` (Megatron's
    default: 30 minutes). A group's timeout must be set when it is created: gloo's point-to-point receives (the ring's
    K/V exchange) keep the timeout of their creation, ``_set_pg_timeout`` later only reaches collectives. The function
    NeMo looks up (``parallel_state.initialize_model_parallel``) passes the timeout of the innermost
    ``megatron_groups_timeout`` when its caller gives none; outside one it is Megatron's function unchanged."""
    from megatron.core import parallel_state

    original = parallel_state.initialize_model_parallel
    if getattr(original, "_nemo_longctx", False):
        return

    @functools.wraps(original)
    def initialize_model_parallel(*args: Any, **kwargs: Any) -> Any:
        if _GROUPS_TIMEOUT_MIN and "distributed_timeout_minutes" not in kwargs:
            kwargs["distributed_timeout_minutes"] = _GROUPS_TIMEOUT_MIN[-1]
        return original(*args, **kwargs)

    initialize_model_parallel._nemo_longctx = True  # type: ignore[attr-defined]
    parallel_state.initialize_model_parallel = initialize_model_parallel


@contextlib.contextmanager
def megatron_groups_timeout(timeout_s: Optional[float]):
    """Make NeMo's ``init_model_parallel`` create Megatron's groups with ``timeout_s`` (ledger row T1, applied with
    NeMo's ledger at the app's entry)."""
    if timeout_s is None:
        yield
        return
    from .patches import LEDGER

    if "T1" not in LEDGER.applied():
        raise RuntimeError("collective_timeout_s: NeMo's patch ledger (row T1) was not applied at the app's entry "
                           "(nemo_longctx.integrations.nemo.compat.apply()), so NeMo would create Megatron's process "
                           "groups without the timeout")
    _GROUPS_TIMEOUT_MIN.append(float(timeout_s) / 60.0)
    try:
        yield
    finally:
        _GROUPS_TIMEOUT_MIN.pop()


# --------------------------------------------------------------------------------------------------------------
# M1: NeMo's GPT configs build our GPT model class (all machines)
def _patch_gpt_model_class() -> None:
    """NeMo's ``GPTConfig.configure_model`` builds ``MCoreGPTModel`` (its name for Megatron's GPTModel, bound in
    ``nemo.collections.llm.gpt.model.base``) and offers no hook for another class. The name is bound to
    ``ChunkedLossGPTModel``, Megatron's GPTModel exactly until ``tiling.loss_chunks`` sets a policy on it, so models
    are built with the chunked loss from the start (NeMo's own exact-type check in ``get_inference_wrapper`` reads the
    same name). Where that module does not import (a Megatron-core NeMo 2.7 cannot load: nothing builds through it),
    nothing is bound."""
    try:
        from nemo.collections.llm.gpt.model import base
    except ImportError as e:
        log.info("nemo_longctx.integrations.nemo.compat: NeMo's GPT model module does not import here (%s): its "
                 "model class is left as it is", e)
        return
    from nemo_longctx.integrations.megatron.gpt_chunked_loss import ChunkedLossGPTModel

    base.MCoreGPTModel = ChunkedLossGPTModel
