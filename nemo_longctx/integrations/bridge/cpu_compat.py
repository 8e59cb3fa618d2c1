"""Run Megatron-Bridge's own training loop (``pretrain`` + ``gpt_step.forward_step``) on a CPU-only machine over gloo.

The one place the Bridge front end patches third-party code. ``apply()`` first applies the framework-neutral
Megatron-core fixes (``integrations.megatron.cpu_compat``: no-op CUDA streams, CUDA factory calls mapped to the CPU,
the RNG tracker on the CPU generator, ...), then these named Bridge stand-ins -- each a row of Bridge's patch
ledger (``patches.py``), applied in its order; nothing here is applied when CUDA is available. Each says what it
stands in for (B-numbers; file:line as of megatron-bridge 0.6.2 / megatron-core 0.19.2):

B2. ``training/setup.py`` calls ``initialize_megatron`` without ``allow_no_cuda`` (``initialize.py:91`` asserts CUDA):
    it is called with ``allow_no_cuda=True``.
B3. ``initialize.py:147`` builds the dataset index helpers with ``make`` (``core/datasets/utils.py:25``), but the
    wheel ships the prebuilt ``helpers_cpp`` and no Makefile: the prebuilt module is imported instead (an error
    names it if it is missing).
B4. ``initialize.py`` warms up JIT-fused kernels on CUDA tensors (``_warmup_jit_function``): skipped (the fused
    kernels are off on the CPU).
B5. Checkpoints: ``checkpointing.py:491`` (``get_rng_state``) saves ``torch.cuda.get_rng_state()`` and
    ``checkpointing.py:3155/3167`` restore it with ``torch.cuda.set_rng_state`` (CUDA init fails without a driver).
    There is no CUDA generator: the CPU generator's state is saved in its place (the same state is saved as
    ``torch_rng_state`` and restored from there), restoring it is a no-op. Megatron's RNG tracker states (fix 4: CPU
    generator states) are saved and restored by Bridge unchanged.
B9. ``initialize.py:869`` (``_set_random_seed``) seeds Megatron's RNG tracker only ``if torch.cuda.device_count() >
    0``; the attention's ``get_cuda_rng_tracker().fork()`` then fails. It runs with ``device_count`` answering 1, so
    the tracker is seeded exactly as on a GPU (the tracker itself holds CPU generator states: Megatron fix 4).
B7. Megatron-core picks TransformerEngine's fused optimizers and multi-tensor kernels whenever TE imports
    (``core/optimizer/__init__.py:13-17``, ``optimizer.py:17``, ``distrib_optimizer.py:23``, ``clip_grads.py:10``):
    CUDA kernels. Without CUDA the names are bound to what Megatron-core itself binds when TE and Apex are absent:
    torch's ``AdamW``/``SGD`` (``USING_PYTORCH_OPTIMIZER = True``) and ``megatron.core.utils``'
    ``local_multi_tensor_*`` (grad norm, clipping and scaling in plain torch).
B10. The MoE router's gating GEMM (``moe/moe_utils.py:1326/1359``, ``RouterGatingLinearFunction``) runs TE's
    ``general_gemm`` (cuBLAS) whenever TE imports (``moe_utils.te_general_gemm`` is bound), whatever the config says:
    every MoE model (GPT-OSS, Qwen3-MoE, DeepSeek, ...) dies in the first router call without a driver. Without CUDA
    the name is bound to None, what Megatron-core binds when TE is absent: the function's own torch ``mm``/``addmm``
    (the same product and bias, fp32). TE's other MoE kernels (fused permutation, fused router) are config choices
    (``moe_permute_fusion``, ``moe_router_fusion``): ``cpu_settings`` turns them off like the other fusions.
"""

from __future__ import annotations

import functools
import logging
from typing import Any

log = logging.getLogger(__name__)

_APPLIED = False


def needed() -> bool:
    import torch

    return not torch.cuda.is_available()


def _mark(fn: Any) -> Any:
    fn._nemo_longctx = True
    return fn


def _allow_no_cuda() -> None:  # B2
    from megatron.bridge.training import initialize, setup

    original = initialize.initialize_megatron
    if getattr(setup.initialize_megatron, "_nemo_longctx", False):
        return
    setup.initialize_megatron = _mark(functools.partial(original, allow_no_cuda=True))


def _prebuilt_dataset_helpers() -> None:  # B3
    from megatron.bridge.training import initialize

    def compile_helpers() -> None:
        try:
            from megatron.core.datasets import helpers_cpp  # noqa: F401
        except ImportError as e:
            raise RuntimeError("megatron-core's dataset helpers (megatron/core/datasets/helpers_cpp) are neither "
                               f"prebuilt nor buildable here: {e}") from None

    initialize.compile_helpers = _mark(compile_helpers)


def _skip_jit_warmup() -> None:  # B4
    from megatron.bridge.training import initialize

    initialize._warmup_jit_function = _mark(lambda *args, **kwargs: None)


def _seed_rng_tracker() -> None:  # B9
    import torch
    from megatron.bridge.training import initialize

    original = initialize._set_random_seed
    if getattr(original, "_nemo_longctx", False):
        return

    @functools.wraps(original)
    def _set_random_seed(*args: Any, **kwargs: Any) -> None:
        count = torch.cuda.device_count
        torch.cuda.device_count = lambda: 1
        try:
            original(*args, **kwargs)
        finally:
            torch.cuda.device_count = count

    initialize._set_random_seed = _mark(_set_random_seed)


def _checkpoint_rng_state() -> None:  # B5
    import torch

    if getattr(torch.cuda.get_rng_state, "_nemo_longctx", False):
        return
    torch.cuda.get_rng_state = _mark(lambda device="cuda": torch.get_rng_state())
    torch.cuda.set_rng_state = _mark(lambda new_state, device="cuda": None)


def _torch_optimizers() -> None:  # B7
    import torch
    from megatron.core import optimizer as mopt
    from megatron.core import utils as mutils
    from megatron.core.optimizer import clip_grads, distrib_optimizer
    from megatron.core.optimizer import optimizer as moptimizer

    mopt.Adam, mopt.SGD, mopt.USING_PYTORCH_OPTIMIZER = torch.optim.AdamW, torch.optim.SGD, True
    distrib_optimizer.Adam = torch.optim.Adam  # what distrib_optimizer.py binds without TE and Apex
    distrib_optimizer.USING_TE_OPTIMIZER = distrib_optimizer.USING_APEX_OPTIMIZER = False
    distrib_optimizer.HAVE_APEX_OR_TE = False
    moptimizer.multi_tensor_applier = mutils.local_multi_tensor_applier
    moptimizer.multi_tensor_scale_impl = mutils.local_multi_tensor_scale
    clip_grads.multi_tensor_applier = mutils.local_multi_tensor_applier
    clip_grads.l2_norm_impl = mutils.local_multi_tensor_l2_norm
    clip_grads.multi_tensor_scale_impl = mutils.local_multi_tensor_scale
    clip_grads.multi_tensor_scale_tensor_impl = None


def _moe_router_gemm() -> None:  # B10
    from megatron.core.transformer.moe import moe_utils

    moe_utils.te_general_gemm = None


def cpu_settings(cfg: Any) -> Any:
    """A ``ConfigContainer`` set up for the CPU (configuration, not patches; logged): fp32 without mixed precision;
    the fused kernels off; CPU initialization; Megatron's local (non-TE) **block** spec as the base spec -- with a
    layer spec the final norm stays TE's ``TENorm`` and ``attention_backend=local`` makes the provider swap the core
    attention back (gpt_provider.py:277-279); TE's MoE token permutation and router fusions off (Megatron's unfused
    permutation and router: the same values); gloo without decentralized process groups (those are NCCL only);
    no overlapped grad reduce / param gather (CUDA streams); no manual GC and no timers in TensorBoard."""
    import torch

    m = cfg.model
    m.bf16 = m.fp16 = False
    m.params_dtype = torch.float32
    m.use_cpu_initialization = True
    for flag in ("gradient_accumulation_fusion", "bias_activation_fusion", "bias_dropout_fusion",
                 "masked_softmax_fusion", "apply_rope_fusion", "persist_layer_norm", "cross_entropy_loss_fusion",
                 "moe_permute_fusion", "moe_router_fusion"):
        setattr(m, flag, False)
    m.attention_backend = None
    m.transformer_impl = "local"
    normalization = getattr(m, "normalization", "RMSNorm")
    m.transformer_layer_spec = functools.partial(local_block_spec, normalization=normalization)
    cfg.mixed_precision = None
    cfg.optimizer.bf16 = cfg.optimizer.fp16 = False
    cfg.ddp.overlap_grad_reduce = cfg.ddp.overlap_param_gather = False
    cfg.dist.distributed_backend = "gloo"
    cfg.dist.use_decentralized_pg = False
    cfg.train.manual_gc = False
    cfg.logger.log_timers_to_tensorboard = False
    cfg.scheduler.start_weight_decay = cfg.scheduler.start_weight_decay or 0.0
    cfg.scheduler.end_weight_decay = cfg.scheduler.end_weight_decay or 0.0
    log.info("nemo_longctx.integrations.bridge.cpu_compat: CPU settings (fp32, local block spec, gloo)")
    return cfg


def local_block_spec(provider: Any, vp_stage: Any = None, normalization: str = "RMSNorm") -> Any:
    """Megatron's local (non-TE) GPT block spec of ``provider`` (public: a run config names it as the
    ``transformer_layer_spec`` base, and Bridge's loader refuses private names)."""
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_decoder_block_spec

    return get_gpt_decoder_block_spec(provider, use_transformer_engine=False, normalization=normalization,
                                      vp_stage=vp_stage)


def _gpt_model_class() -> None:  # M1 (all machines)
    """Bridge's ``GPTModelProvider.provide`` builds ``MCoreGPTModel`` (its name for Megatron's GPTModel, bound in
    ``megatron.bridge.models.gpt_provider``) and offers no hook for another class: the name is bound to
    ``ChunkedLossGPTModel``, Megatron's GPTModel exactly until ``tiling.loss_chunks`` sets a policy on it."""
    from megatron.bridge.models import gpt_provider

    from nemo_longctx.integrations.megatron.gpt_chunked_loss import ChunkedLossGPTModel

    gpt_provider.MCoreGPTModel = ChunkedLossGPTModel


def apply(force: bool = False) -> bool:
    """Apply Megatron-Bridge's patch ledger (``patches.LEDGER``: the Megatron-core ledger first, then these stand-ins
    when CUDA is unavailable -- or with ``force``), once. Returns True if the CPU stand-ins are active."""
    global _APPLIED
    from nemo_longctx.integrations.bridge.patches import LEDGER

    LEDGER.apply(force_cpu_rows=force)
    if _APPLIED:
        return True
    if not (force or needed()):
        return False
    from nemo_longctx.integrations.megatron import cpu_compat

    cpu_compat.apply(force=force)  # (applied by the ledger above: marks the Megatron CPU fixes active)
    _APPLIED = True
    log.info("nemo_longctx.integrations.bridge.cpu_compat: CPU stand-ins for Megatron-Bridge applied")
    return True
