"""Model-config extension: make any ``llm.GPTConfig`` / ``Llama*Config`` (including configs built from NeMo
recipes) build its layers with nemo_longctx core attention.

``enable_long_context(config, cp_algorithm="ring", **algorithm_kwargs)`` wraps ``config.transformer_layer_spec``
(a ModuleSpec or a spec function such as NeMo's ``default_layer_spec``/``local_layer_spec``) in
``LongContextLayerSpec``, which builds the original spec and swaps ``core_attention`` in every layer, and sets the
config's ``data_step_fn`` / ``forward_step_fn`` to the zigzag-sharding data step and mask-free forward step.
Idempotent: a config already extended is re-targeted, not wrapped twice. ``cp_comm_type`` is aligned with the CP
algorithm (``cp_algorithms.align_cp_comm_type``).
"""

from __future__ import annotations

import logging
from copy import deepcopy
from typing import Any, Optional

from nemo.lightning import io

from nemo_longctx.integrations.megatron.cp_algorithms import align_cp_comm_type
from nemo_longctx.integrations.megatron.spec import LongContextSpec

from .steps import long_context_data_step, long_context_forward_step


class LongContextLayerSpec(LongContextSpec, io.IOMixin):
    """``LongContextSpec`` as an ``io.IOMixin``: NeMo records its constructor arguments, so it is written into a
    checkpoint's context (``context/io.json``) and restored by ``nemo.lightning.io.load_context``."""


def enable_long_context(config: Any, cp_algorithm: str = "ring", **algorithm_kwargs: Any) -> Any:
    """Extend ``config`` in place (and return it) so every layer uses nemo_longctx core attention. A
    ``cp_comm_type`` the config class sets (NVIDIA's ``MistralConfig7B``: ``"a2a"``) yields to ``cp_algorithm``
    (logged); one the user set that contradicts it raises ValueError (``cp_algorithms.align_cp_comm_type``)."""
    note = align_cp_comm_type_with_io(config, cp_algorithm)
    if note is not None:
        logging.getLogger(__name__).info(note)
    base = config.transformer_layer_spec
    if isinstance(base, LongContextLayerSpec):
        if (base.cp_algorithm, base.algorithm_kwargs) == (cp_algorithm, dict(algorithm_kwargs)) and (
                config.data_step_fn is long_context_data_step and config.forward_step_fn is long_context_forward_step):
            return config  # already extended exactly so
        base = base.base
    set_with_io(config, "transformer_layer_spec", LongContextLayerSpec(base, cp_algorithm, algorithm_kwargs))
    set_with_io(config, "data_step_fn", long_context_data_step)
    set_with_io(config, "forward_step_fn", long_context_forward_step)
    return config


def align_cp_comm_type_with_io(config: Any, cp_algorithm: str, explicit: Optional[bool] = None) -> Optional[str]:
    """``cp_algorithms.align_cp_comm_type`` on a NeMo config, the new value recorded in NeMo's checkpoint context
    too; returns the note (None when nothing changed)."""
    note = align_cp_comm_type(config, cp_algorithm, explicit)
    if note is not None:
        set_with_io(config, "cp_comm_type", config.cp_comm_type)
    return note


def set_with_io(obj: Any, attr: str, value: Any) -> None:
    """``setattr`` that NeMo's checkpoint context sees too (the pattern of NeMo's ``llm.api._set_with_io``): a config
    built through ``io`` serializes its recorded ``__io__`` arguments, not its attributes, so a field changed after
    construction must be changed there as well."""
    setattr(obj, attr, value)
    if hasattr(obj, "__io__"):
        setattr(obj.__io__, attr, deepcopy(value.__io__) if hasattr(value, "__io__") else value)

