"""Megatron-core APIs that differ between the versions the NeMo 2 containers ship (0.14 .. 0.17), one function per
API, named after it. Everything else in ``integrations/`` calls Megatron-core directly; a difference found by the
version matrix (docs/how-to/nemo-versions.md) gets its function here, never an ``if version`` at the call site.
"""

from __future__ import annotations

from typing import Any


def is_layer_window_attention(config: Any, layer_number: int) -> bool:
    """Whether layer ``layer_number`` (1-based) of ``config`` uses its sliding window, as Megatron's own attention
    decides it. Megatron-core >= 0.15: ``transformer.utils.is_layer_window_attention`` (``window_attn_skip_freq``:
    every n-th layer full, or a per-layer list). 0.14 has neither: ``window_size`` applies to every layer."""
    try:
        from megatron.core.transformer.utils import is_layer_window_attention as megatron_rule
    except ImportError:  # Megatron-core 0.14
        return bool(getattr(config, "window_size", None))
    return megatron_rule(config.window_size, getattr(config, "window_attn_skip_freq", None), layer_number)


def process_groups(pg_collection: Any = None, model_comm_pgs: Any = None) -> Any:
    """The model's process-group collection a Megatron module is built with: ``pg_collection`` (Megatron-core
    >= 0.15), ``model_comm_pgs`` in 0.14 (the same object under its earlier name)."""
    if pg_collection is not None and model_comm_pgs is not None and pg_collection is not model_comm_pgs:
        raise ValueError("both pg_collection and model_comm_pgs given, and they differ")
    return pg_collection if pg_collection is not None else model_comm_pgs


def uses_fp8_or_fp4(config: Any) -> bool:
    """Whether ``config`` trains in fp8 or fp4 (``fp4`` exists from Megatron-core 0.15 on; 0.14 has fp8 only)."""
    return bool(getattr(config, "fp8", None) or getattr(config, "fp4", None))


def block_submodules(config: Any, layer_spec: Any, pp_rank: int) -> Any:
    """Megatron's ``transformer_block._get_block_submodules`` for pipeline stage ``pp_rank`` (the layer specs of
    that stage, without process groups). Megatron-core 0.14's takes no ``pp_rank`` and reads the initialised
    pipeline rank: there a run without pipeline parallelism gets its block the way that function builds it from a
    layer spec (``num_layers`` copies), and a pipeline-parallel one is refused by name."""
    import inspect

    from megatron.core.transformer.spec_utils import ModuleSpec
    from megatron.core.transformer.transformer_block import TransformerBlockSubmodules, _get_block_submodules
    from megatron.core.transformer.transformer_layer import BaseTransformerLayer

    if "pp_rank" in inspect.signature(_get_block_submodules).parameters:
        return _get_block_submodules(config, layer_spec, vp_stage=None, pp_rank=pp_rank)
    if pp_rank != 0 or int(getattr(config, "pipeline_model_parallel_size", 1) or 1) > 1:
        raise ValueError(f"listing the layers of pipeline stage {pp_rank} (pipeline_model_parallel_size="
                         f"{config.pipeline_model_parallel_size}) needs Megatron-core >= 0.15 (_get_block_submodules "
                         "takes pp_rank from 0.15 on)")
    if isinstance(layer_spec, ModuleSpec) and issubclass(layer_spec.module, BaseTransformerLayer):
        return TransformerBlockSubmodules(layer_specs=[layer_spec] * int(config.num_layers))
    return _get_block_submodules(config, layer_spec, vp_stage=None)  # a block spec: no rank needed


def thd_freqs_on_this_cp_rank(cp_rank: int, cp_size: int, x: Any, freqs: Any, offset: int) -> Any:
    """Megatron's ``rope_utils._get_thd_freqs_on_this_cp_rank``: the RoPE frequencies of one packed document's rows
    on this CP rank. From Megatron-core 0.15 it takes ``offset`` (the document's start when ``freqs`` covers the
    whole packed sequence); 0.14's THD RoPE always starts every document at position 0, so it is called so there."""
    import inspect

    from megatron.core.models.common.embeddings.rope_utils import _get_thd_freqs_on_this_cp_rank

    if "offset" in inspect.signature(_get_thd_freqs_on_this_cp_rank).parameters:
        return _get_thd_freqs_on_this_cp_rank(cp_rank, cp_size, x, freqs, offset)
    return _get_thd_freqs_on_this_cp_rank(cp_rank, cp_size, x, freqs)


def sharded_tensors_for_checkpoint(state_dict: Any, prefix: str, tensor_parallel_layers_axis_map: Any,
                                   sharded_offsets: Any, tp_group: Any = None, metadata: Any = None) -> Any:
    """Megatron's ``transformer.utils.make_sharded_tensors_for_checkpoint``. Megatron-core 0.19 takes the module's
    TP group and the data-parallel-with-CP group (``metadata['dp_cp_group']``, Megatron's global one where metadata
    lacks it), as its own modules pass them; earlier versions take neither and read the global groups."""
    import inspect

    from megatron.core.transformer.utils import make_sharded_tensors_for_checkpoint

    if "dp_cp_group" not in inspect.signature(make_sharded_tensors_for_checkpoint).parameters:
        return make_sharded_tensors_for_checkpoint(state_dict, prefix, tensor_parallel_layers_axis_map,
                                                   sharded_offsets)
    dp_cp_group = (metadata or {}).get("dp_cp_group")
    if dp_cp_group is None:
        from megatron.core import parallel_state

        dp_cp_group = parallel_state.get_data_parallel_group(with_context_parallel=True)
    return make_sharded_tensors_for_checkpoint(state_dict, prefix, tensor_parallel_layers_axis_map, sharded_offsets,
                                               tp_group=tp_group, dp_cp_group=dp_cp_group)
