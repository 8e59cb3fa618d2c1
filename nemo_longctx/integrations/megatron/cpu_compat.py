"""Run Megatron-core 0.15 on a CPU-only torch build (gloo). With ``cpu_compat_fsdp.py`` (Megatron-FSDP's fixes), the
only code of the framework-neutral layer that patches third-party code (Megatron-core and torch.cuda, never NeMo).

Every patch below is a row of the Megatron-core patch ledger (``patches.py``: target, devices, versions, why), which
applies them in its order. ``apply()`` applies that ledger before Megatron objects are built: at the entry of code
that runs Megatron-core only, through ``integrations.nemo.compat.apply()`` (NeMo's ledger, which applies this one
first) by code that runs NeMo. Its CPU rows are applied only when CUDA is unavailable, each once per process; every
patch below says what it fixes (numbers refer to design.md's
list). NeMo's fixes keep their numbers and live in ``integrations/nemo/compat.py``: the NeMo part of 4
(``megatron_init._set_random_seed``), 7 (a note, nothing patched), 8 (``nemo.lightning.io.pl``) and 13
(``nemo.lightning.io.state.apply_transforms``).

1. ``torch.cuda.Stream/Event/stream/current_stream/synchronize`` are used unconditionally (DDP buffers, NeMo's
   strategy, Megatron's schedules): replaced by no-op stand-ins.
2. ``torch.cuda.current_device()`` is used as an allocation device: returns the CPU device. ``max_memory_*`` /
   ``memory_*`` / ``empty_cache`` return 0 / do nothing.
3. Factory calls with ``device="cuda"``, ``Tensor.cuda()``, ``Tensor.to("cuda")``, ``pin_memory=True``:
   a global ``TorchFunctionMode`` maps them to CPU; the same mode answers ``Tensor.type()`` (no argument) with the
   CUDA type name, for Megatron's ``assert grad.type() == 'torch.cuda.FloatTensor'`` (clip_grads, optimizers).
4. Megatron's ``CudaRNGStatesTracker.add/fork`` and ``tensor_parallel.random._get/_set_cuda_rng_state``: use the
   CPU default generator (``torch.default_generator.manual_seed``, not ``torch.manual_seed``, which calls
   ``torch.cuda.manual_seed_all``). (NeMo part -- ``megatron_init._set_random_seed`` also seeds the tracker on
   CPU -- in ``integrations/nemo/compat.py``.)
5. ``rope_utils.get_pos_emb_on_this_cp_rank`` builds its index with ``pin_memory=True).cuda()``: replaced (in
   every module that imported it by name) by a device-agnostic copy of the same computation.
6. ``CheckpointWithoutOutput(fp8=False)`` sets ``self.fp8 = True`` (``fp8 is not None``) and then needs TE:
   ``self.fp8`` is set from the truth value of ``fp8``.
7. NeMo's (data step and mock data; nothing patched): see ``integrations/nemo/compat.py``.
8. NeMo's (checkpoint load device): moved to ``integrations/nemo/compat.py``.
9. Megatron's ``HybridDeviceOptimizer`` (``optim.optimizer_cpu_offload``) splits parameters by ``param.is_cuda``: on
   CPU every parameter would count as already offloaded, no host copy would exist and its step would fail looking
   one up. While it sorts its parameters, the CPU stands in for the device (as in fix 2): model parameters answer
   ``is_cuda`` True and the host copies it makes (``.cpu()``) False, so the offload fraction, the host copies, the
   grad copies and the copy-back hooks all run as on a GPU.
10. NeMo's model configs default two fused-kernel flags on that Megatron refuses without the kernels:
    ``apply_rope_fusion`` (``TransformerConfig.__post_init__`` raises without TransformerEngine) and
    ``persist_layer_norm`` (``WrappedTorchNorm``, the norm used without Apex, asserts it off); NVIDIA's DeepSeek
    configs add ``gradient_accumulation_fusion`` (Megatron's linear layers raise without Apex's
    ``fused_weight_gradient_mlp_cuda``) and ``cross_entropy_loss_fusion`` with TE's implementation (the loss raises
    "Trying to use a TE block when it's not present"); Qwen3-MoE's ``moe_permute_fusion`` (TE's fused token
    permutation: "fused permutation is not available"). So NeMo's HF
    importers/exporters (``LlamaConfig``/``Qwen2Config`` built from a Hugging Face config) and configs restored from
    a checkpoint's context could not be constructed or built. Where the kernel is missing, the flag is turned off
    before the checks (kernel choices: the unfused RoPE and torch's norm compute the same values).
11. MoE without TransformerEngine: ``moe_utils.RouterGatingLinearFunction`` tests ``te_general_gemm is not None``, but
    the name is only bound when TE imports (NameError: Mixtral, Qwen3-MoE, DeepSeek die in the router). It is bound
    to None, so the router's own torch matmul (already written there for that case) runs.
12. Zero-centred norms (``layernorm_zero_centered_gamma``: Nemotron's LayerNorm, Gemma's RMSNorm): ``WrappedTorchNorm``
    (the norm without TE/Apex) asserts it off. It builds ``ZeroCenteredLayerNorm`` / ``ZeroCenteredRMSNorm`` instead:
    torch's norm with the weight stored as gamma - 1 (initialized to 0) and applied as 1 + weight -- TE's definition
    of the option (and Hugging Face Gemma's RMSNorm).
13. NeMo's (HF converters' norm keys without TE): moved to ``integrations/nemo/compat.py``.
14. ``OptimizerConfig.__post_init__`` (precision-aware optimizer) asks ``is_te_min_version("2.1.0")`` to decide
    ``store_param_remainders``; without TransformerEngine ``get_te_version()`` is None and the comparison raises
    TypeError, even with ``optimizer_cpu_offload`` (which returns before the TE FusedAdam check and runs the
    precision-aware step in Megatron's ``HybridDeviceOptimizer``: host torch AdamW with fp32 master copies). The name
    bound in ``optimizer_config`` answers False when TE is not installed -- "TE is not at least 2.1", so
    ``store_param_remainders=False`` (the hybrid optimizer keeps whole fp32 master params; the int16 remainders are
    a TE FusedAdam format). With TE installed the original function answers.
15. MoE grouped GEMM (``moe_grouped_gemm=True``: NVIDIA's DeepSeek-V2/V3, Qwen3-MoE, GPT-OSS, Llama 4 configs) needs
    the ``grouped_gemm`` package or TE's grouped linear (CUDA): Megatron's ``GroupedMLP`` asserts "Grouped GEMM is not
    available". Where it is missing, the same ``TransformerConfig.__post_init__`` wrapper as fix 10 turns the flag
    off before the layer spec reads it, so the experts are Megatron's ``SequentialMLP`` (the same math, one GEMM per
    expert), with one warning per process. Never on CUDA (``apply()`` does nothing there).
16. Multi-latent attention without TE on Megatron-core >= 0.16 (NGC 26.02/26.04): the TE extension module imports
    without TE (mock stand-ins), so ``multi_latent_attention.HAVE_TE`` is True and building ``MLASelfAttention``
    fails in ``isinstance(linear_proj, TELinear)`` (TypeError: the mock is no type); set False when TE is absent.

Megatron-FSDP (``optim=fsdp``) has its own fixes (device, DTensor mesh, gradient scaling, exit) in
``cpu_compat_fsdp.py``, applied from ``apply()``.

What cannot run without CUDA at all is refused (not patched) by ``validation.model_state_cpu_problems`` and, for MoE
layers, ``validation.moe_cpu_problems``, before step 0.
"""

from __future__ import annotations

import contextlib
import copy
import importlib.util
import logging
from typing import Any, Callable, Dict

import torch
from torch.overrides import TorchFunctionMode

log = logging.getLogger(__name__)

_APPLIED = False
_GROUPED_GEMM_NOTED = False
_MODE: "TorchFunctionMode | None" = None
CPU = torch.device("cpu")


def needed() -> bool:
    """True when this process has no usable CUDA device (the patches are only applied then)."""
    return not torch.cuda.is_available()


def is_applied() -> bool:
    return _APPLIED


# --------------------------------------------------------------------------------------------------------------
# 1, 2: torch.cuda stand-ins
class _NoOpStream:
    """Stand-in for torch.cuda.Stream (fix 1): every method is a no-op, usable as a context manager."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        pass

    def wait_stream(self, *args: Any, **kwargs: Any) -> None:
        pass

    def wait_event(self, *args: Any, **kwargs: Any) -> None:
        pass

    def record_event(self, event: Any = None) -> "_NoOpEvent":
        return event if event is not None else _NoOpEvent()

    def synchronize(self) -> None:
        pass

    def query(self) -> bool:
        return True

    def __enter__(self) -> "_NoOpStream":
        return self

    def __exit__(self, *exc: Any) -> None:
        pass


class _NoOpEvent:
    """Stand-in for torch.cuda.Event (fix 1)."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        pass

    def record(self, *args: Any, **kwargs: Any) -> None:
        pass

    def wait(self, *args: Any, **kwargs: Any) -> None:
        pass

    def synchronize(self) -> None:
        pass

    def query(self) -> bool:
        return True

    def elapsed_time(self, other: Any) -> float:
        return 0.0


_NO_STREAM = _NoOpStream()


def _patch_torch_cuda() -> None:
    cuda = torch.cuda
    cuda.Stream = _NoOpStream  # fix 1
    cuda.Event = _NoOpEvent  # fix 1
    cuda.stream = lambda stream=None: contextlib.nullcontext()  # fix 1
    cuda.current_stream = lambda device=None: _NO_STREAM  # fix 1
    cuda.default_stream = lambda device=None: _NO_STREAM  # fix 1
    cuda.synchronize = lambda device=None: None  # fix 1
    cuda.current_device = lambda: CPU  # fix 2: used as `device=torch.cuda.current_device()`
    cuda.set_device = lambda device: None  # fix 2: strategies pin their rank to a device
    cuda.empty_cache = lambda: None  # fix 2
    for name in ("max_memory_allocated", "max_memory_reserved", "memory_allocated", "memory_reserved"):
        setattr(cuda, name, lambda device=None: 0)  # fix 2: memory logging in NeMo's strategy
    cuda.reset_peak_memory_stats = lambda device=None: None  # fix 2


# --------------------------------------------------------------------------------------------------------------
# 3: device="cuda" / .cuda() / pin_memory -> CPU
def _is_cuda(device: Any) -> bool:
    if isinstance(device, torch.device):
        return device.type == "cuda"
    if isinstance(device, str):
        return device.startswith("cuda")
    return False


class _CudaToCpuMode(TorchFunctionMode):
    """Fix 3: every torch call that names a CUDA device or pins memory runs on CPU instead."""

    def __torch_function__(self, func: Callable, types: Any, args: tuple = (), kwargs: Dict | None = None):
        kwargs = dict(kwargs or {})
        name = getattr(func, "__name__", "")
        if name == "cuda":  # Tensor.cuda(...) -> the tensor itself
            return args[0]
        if name in ("pin_memory",) and args and isinstance(args[0], torch.Tensor):
            return args[0]
        if name == "type" and len(args) == 1 and not kwargs:  # `t.type() == 'torch.cuda.FloatTensor'` checks
            res = func(*args)
            return res.replace("torch.", "torch.cuda.", 1) if res.startswith("torch.") and ".cuda." not in res else res
        if kwargs.get("pin_memory"):
            kwargs["pin_memory"] = False
        if _is_cuda(kwargs.get("device")) or isinstance(kwargs.get("device"), int):
            kwargs["device"] = CPU
        if name == "to" and args:
            args = tuple(CPU if (i > 0 and (_is_cuda(a) or (i == 1 and isinstance(a, int) and not isinstance(a, bool))))
                         else a for i, a in enumerate(args))
        return func(*args, **kwargs)


# --------------------------------------------------------------------------------------------------------------
# 4: CUDA RNG tracker on the CPU generator
def _patch_rng_tracker() -> None:
    from megatron.core.tensor_parallel import random as mrandom

    def get_state(device: Any = "cuda", clone: bool = False, graph_safe: bool = False) -> torch.Tensor:
        return torch.get_rng_state()  # fix 4: "cuda" RNG state = the CPU generator's

    def set_state(new_state: torch.Tensor, device: int = -1, graph_safe: bool = False) -> None:
        torch.set_rng_state(new_state)  # fix 4

    def add(self, name: str, seed: int) -> None:  # fix 4: seed a named state without touching torch.cuda
        self._is_initialized = True
        if seed in self.seeds_:
            raise Exception(f"seed {seed} already exists")
        self.seeds_.add(seed)
        if name in self.states_:
            raise Exception(f"cuda rng state {name} already exists")
        orig = torch.get_rng_state()
        torch.default_generator.manual_seed(seed)
        self.states_[name] = torch.get_rng_state()
        torch.set_rng_state(orig)

    @contextlib.contextmanager
    def fork(self, name: str = mrandom._MODEL_PARALLEL_RNG_TRACKER_NAME):  # fix 4: swap the CPU generator state
        if name not in self.states_:
            raise Exception(f"cuda rng state {name} is not added")
        orig = torch.get_rng_state()
        torch.set_rng_state(self.states_[name])
        try:
            yield
        finally:
            self.states_[name] = torch.get_rng_state()
            torch.set_rng_state(orig)

    mrandom._get_cuda_rng_state = get_state
    mrandom._set_cuda_rng_state = set_state
    mrandom.CudaRNGStatesTracker.add = add
    mrandom.CudaRNGStatesTracker.fork = fork


# --------------------------------------------------------------------------------------------------------------
# 5: RoPE's zigzag slice without pin_memory().cuda()
def _get_pos_emb_on_this_cp_rank(pos_emb: torch.Tensor, seq_dim: int, cp_group: Any) -> torch.Tensor:
    """Fix 5: same result as megatron's rope_utils.get_pos_emb_on_this_cp_rank, index built on pos_emb.device."""
    if cp_group is None:
        raise ValueError("cp_group must be provided to get positional embedding per CP rank")
    cp_size, cp_rank = cp_group.size(), cp_group.rank()
    idx = torch.tensor([cp_rank, 2 * cp_size - cp_rank - 1], device=pos_emb.device)
    pos_emb = pos_emb.view(*pos_emb.shape[:seq_dim], 2 * cp_size, -1, *pos_emb.shape[seq_dim + 1:])
    pos_emb = pos_emb.index_select(seq_dim, idx)
    return pos_emb.view(*pos_emb.shape[:seq_dim], -1, *pos_emb.shape[seq_dim + 2:])


def _patch_rope() -> None:
    import importlib

    for modname in (
        "megatron.core.models.common.embeddings.rope_utils",
        "megatron.core.models.common.embeddings.rotary_pos_embedding",
        "megatron.core.models.common.embeddings.yarn_rotary_pos_embedding",
    ):
        mod = importlib.import_module(modname)
        if hasattr(mod, "get_pos_emb_on_this_cp_rank"):
            mod.get_pos_emb_on_this_cp_rank = _get_pos_emb_on_this_cp_rank  # fix 5 (imported by name)


# --------------------------------------------------------------------------------------------------------------
# 6: CheckpointWithoutOutput's fp8 default
def _patch_checkpoint_without_output() -> None:
    from megatron.core.tensor_parallel import random as mrandom

    original_init = mrandom.CheckpointWithoutOutput.__init__
    if getattr(original_init, "_nemo_longctx", False):
        return

    def __init__(self, fp8: Any = False) -> None:
        original_init(self, fp8)
        self.fp8 = bool(fp8)  # fix 6: upstream sets `fp8 is not None`, True for the default False

    __init__._nemo_longctx = True  # type: ignore[attr-defined]
    mrandom.CheckpointWithoutOutput.__init__ = __init__


# --------------------------------------------------------------------------------------------------------------
# 9: HybridDeviceOptimizer's device/host split on a CPU-only build
_HOST_COPY = "_nemo_longctx_host_copy"


class _ParamsOnDeviceMode(TorchFunctionMode):
    """Fix 9, active only inside ``HybridDeviceOptimizer._init_sub_optimizers``: ``t.is_cuda`` is True except for
    the host copies made inside (results of ``.cpu()`` and anything computed from them)."""

    def __torch_function__(self, func: Callable, types: Any, args: tuple = (), kwargs: Dict | None = None):
        if getattr(func, "__self__", None) is torch.Tensor.is_cuda:  # the property getter
            return not getattr(args[0], _HOST_COPY, False)
        out = func(*args, **(kwargs or {}))
        if not isinstance(out, torch.Tensor):
            return out
        if getattr(func, "__name__", "") == "cpu":
            if args and out is args[0]:  # .cpu() of a CPU tensor is the tensor itself: a host copy is a new tensor
                out = out.clone()
            setattr(out, _HOST_COPY, True)
        elif any(getattr(a, _HOST_COPY, False) for a in args if isinstance(a, torch.Tensor)):
            setattr(out, _HOST_COPY, True)  # .pin_memory(), .float() of a host copy
        return out


def _patch_hybrid_device_optimizer() -> None:
    from megatron.core.optimizer.cpu_offloading.hybrid_optimizer import HybridDeviceOptimizer

    original = HybridDeviceOptimizer._init_sub_optimizers
    if getattr(original, "_nemo_longctx", False):
        return

    def _init_sub_optimizers(self) -> None:
        with _ParamsOnDeviceMode():  # fix 9
            original(self)

    _init_sub_optimizers._nemo_longctx = True  # type: ignore[attr-defined]
    HybridDeviceOptimizer._init_sub_optimizers = _init_sub_optimizers


# --------------------------------------------------------------------------------------------------------------
# 14: OptimizerConfig's TE version check without TE
def _patch_optimizer_config_te_version() -> None:
    from megatron.core import utils as mutils
    from megatron.core.optimizer import optimizer_config

    original = optimizer_config.is_te_min_version
    if getattr(original, "_nemo_longctx", False) or mutils.get_te_version() is not None:
        return  # patched already, or TE installed: its version answers

    def is_te_min_version(version: str, check_equality: bool = True) -> bool:
        return False  # fix 14: no TransformerEngine is not at least any TE version

    is_te_min_version._nemo_longctx = True  # type: ignore[attr-defined]
    optimizer_config.is_te_min_version = is_te_min_version


def _legacy_grouped_gemm_available() -> bool:
    """Whether Megatron's grouped-GEMM experts can be built. Megatron-core < 0.19 has ``moe.grouped_gemm_util`` (the
    ``grouped_gemm`` package behind GroupedMLP); 0.19 removed it and its local backend builds SequentialMLP whatever
    ``moe_grouped_gemm`` says, so there is nothing to stand in for."""
    try:
        from megatron.core.transformer.moe import grouped_gemm_util
    except ImportError:
        return True
    return bool(grouped_gemm_util.grouped_gemm_is_available())


# --------------------------------------------------------------------------------------------------------------
# 10: NeMo's configs default apply_rope_fusion / persist_layer_norm on; Megatron refuses them without TE/Apex
def _patch_rope_fusion_without_te() -> None:
    from megatron.core.fusions import fused_layer_norm
    from megatron.core.models.common.embeddings import rope_utils
    from megatron.core.transformer.transformer_config import TransformerConfig

    from megatron.core.tensor_parallel import layers as tp_layers
    from megatron.core.transformer.moe import moe_utils

    no_grad_accum_fusion = not tp_layers._grad_accum_fusion_available  # Apex's fused_weight_gradient_mlp_cuda
    no_te = importlib.util.find_spec("transformer_engine") is None  # TE's fused cross entropy
    no_fused_rope = rope_utils.fused_apply_rotary_pos_emb is None and rope_utils.fused_apply_rotary_pos_emb_thd is None
    no_apex_norm = not fused_layer_norm.HAVE_FUSED_LAYER_NORM  # the local spec then builds WrappedTorchNorm
    no_grouped_gemm = not _legacy_grouped_gemm_available()
    no_fused_permute = getattr(moe_utils, "fused_permute", None) is None  # TE's fused MoE token permutation
    if not (no_fused_rope or no_apex_norm or no_grouped_gemm or no_grad_accum_fusion or no_te or no_fused_permute):
        return  # TE, Apex and grouped GEMM present: the fused kernels exist, nothing to change
    original = TransformerConfig.__post_init__
    if getattr(original, "_nemo_longctx", False):
        return

    def __post_init__(self) -> None:
        if no_fused_rope and self.apply_rope_fusion:
            self.apply_rope_fusion = False  # fix 10: the unfused RoPE (same values) instead of a refusal
        if no_apex_norm and self.persist_layer_norm:
            self.persist_layer_norm = False  # fix 10: torch's norm instead of an assertion in WrappedTorchNorm
        if no_grad_accum_fusion and self.gradient_accumulation_fusion:
            self.gradient_accumulation_fusion = False  # fix 10: the weight-gradient GEMM unfused (same values)
        if no_te and self.cross_entropy_loss_fusion and getattr(self, "cross_entropy_fusion_impl", "te") == "te":
            self.cross_entropy_loss_fusion = False  # fix 10: Megatron's vocab-parallel cross entropy (same values)
        if no_fused_permute and getattr(self, "moe_permute_fusion", False):
            self.moe_permute_fusion = False  # fix 10: Megatron's unfused token permutation (same values)
        if no_grouped_gemm and getattr(self, "moe_grouped_gemm", False):
            self.moe_grouped_gemm = False  # fix 15: sequential experts instead of "Grouped GEMM is not available"
            global _GROUPED_GEMM_NOTED
            if not _GROUPED_GEMM_NOTED:
                _GROUPED_GEMM_NOTED = True
                log.warning("CPU stand-in: %s sets moe_grouped_gemm=True, which needs the grouped_gemm/TE kernels; "
                            "its experts run as Megatron's SequentialMLP (one GEMM per expert: the same math, "
                            "per-expert parameter names in checkpoints)", type(self).__name__)
        original(self)

    __post_init__._nemo_longctx = True  # type: ignore[attr-defined]
    TransformerConfig.__post_init__ = __post_init__


# --------------------------------------------------------------------------------------------------------------
# 11: MoE router without TE
def _patch_moe_router_without_te() -> None:
    from megatron.core.transformer.moe import moe_utils

    if not hasattr(moe_utils, "te_general_gemm"):
        moe_utils.te_general_gemm = None  # fix 11: the router's torch matmul path


# --------------------------------------------------------------------------------------------------------------
# 16: Multi-latent attention without TE on Megatron-core >= 0.16: its TE extension module now imports without TE
# (MagicMock stand-ins), so multi_latent_attention's `HAVE_TE` is True, and `isinstance(linear_proj, TELinear)`
# against the mock raises TypeError while building MLASelfAttention (0.14/0.15 set HAVE_TE False there)
def _patch_mla_without_te() -> None:
    if importlib.util.find_spec("transformer_engine") is not None:
        return
    from megatron.core.transformer import multi_latent_attention as mla

    if getattr(mla, "HAVE_TE", False) and not isinstance(getattr(mla, "TELinear", None), type):
        mla.HAVE_TE = False  # fix 16: the checks that need TE's Linear are skipped, as without TE before 0.16


# --------------------------------------------------------------------------------------------------------------
# 12: zero-centred LayerNorm / RMSNorm without TE/Apex
class _ZeroCenteredWeight:
    """Mixin for a torch norm whose affine weight is stored zero-centred (gamma - 1): initialised to 0."""

    def reset_parameters(self) -> None:
        super().reset_parameters()  # type: ignore[misc]
        if self.elementwise_affine:  # type: ignore[attr-defined]
            torch.nn.init.zeros_(self.weight)  # type: ignore[attr-defined]


class ZeroCenteredLayerNorm(_ZeroCenteredWeight, torch.nn.LayerNorm):
    """LayerNorm whose affine weight is stored zero-centred: y = norm(x) * (1 + weight) + bias, weight init 0."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.nn.functional.layer_norm(x, self.normalized_shape, self.weight + 1, self.bias, self.eps)


class ZeroCenteredRMSNorm(_ZeroCenteredWeight, torch.nn.RMSNorm):
    """RMSNorm whose weight is stored zero-centred: y = x / rms(x) * (1 + weight), weight init 0."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.nn.functional.rms_norm(x, self.normalized_shape, self.weight + 1, self.eps)


_ZERO_CENTERED = {"LayerNorm": ZeroCenteredLayerNorm, "RMSNorm": ZeroCenteredRMSNorm}


def _patch_zero_centered_norm() -> None:
    from megatron.core.transformer.torch_norm import WrappedTorchNorm

    original = WrappedTorchNorm.__new__
    if getattr(original, "_nemo_longctx", False):
        return

    def __new__(cls, config: Any, hidden_size: int, eps: float = 1e-5, *args: Any, **kwargs: Any):
        if not getattr(config, "layernorm_zero_centered_gamma", False):
            return original(cls, config, hidden_size, eps, *args, **kwargs)
        if config.normalization not in _ZERO_CENTERED:
            raise ValueError(f"model.layernorm_zero_centered_gamma=true with model.normalization="
                             f"{config.normalization!r}: only LayerNorm and RMSNorm have a zero-centred torch form "
                             "here")
        plain = copy.copy(config)
        plain.layernorm_zero_centered_gamma = False
        original(cls, plain, hidden_size, eps, *args, **kwargs)  # every other check of WrappedTorchNorm
        return _ZERO_CENTERED[config.normalization](normalized_shape=hidden_size, eps=eps)  # fix 12

    __new__._nemo_longctx = True  # type: ignore[attr-defined]
    WrappedTorchNorm.__new__ = staticmethod(__new__)


def _enter_cuda_to_cpu_mode() -> None:
    """Fix 3: the ``TorchFunctionMode`` that maps CUDA factory calls to the CPU, active for the life of the process."""
    global _MODE
    if _MODE is None:
        _MODE = _CudaToCpuMode()
        _MODE.__enter__()


def apply(force: bool = False) -> bool:
    """Apply the Megatron-core patch ledger (``patches.LEDGER``: these fixes, then Megatron-FSDP's, on a process without
    CUDA -- or with ``force`` --, and the all-device rows everywhere), once. Returns True if the CPU fixes are active.
    Code that runs NeMo calls ``integrations.nemo.compat.apply()`` instead (NeMo's ledger, which applies this first)."""
    global _APPLIED
    from .patches import LEDGER

    LEDGER.apply(force_cpu_rows=force)
    if _APPLIED:
        return True
    if not (force or needed()):
        return False
    _APPLIED = True
    log.info("nemo_longctx.integrations.megatron.cpu_compat: CPU patches for Megatron-core applied")
    return True
