"""Megatron-Bridge's patch ledger: every third-party name the Bridge front end rebinds (``cpu_compat.py`` holds the
stand-ins and explains each one).

Applied once at the entry of the Bridge apps (``cpu_compat.apply()``), after the Megatron-core ledger
(``integrations/megatron/patches.py``), which it requires; never from a constructor. Reading it imports nothing of
Bridge or Megatron (``nemo-longctx --versions``, the self-test).
"""

from __future__ import annotations

from nemo_longctx.integrations.megatron.patches import LEDGER as MEGATRON_LEDGER
from nemo_longctx.shared.patch_ledger import ALL_DEVICES, CPU_ONLY, Patch, PatchLedger

_COMPAT = "nemo_longctx.integrations.bridge.cpu_compat"
BRIDGE = "megatron-bridge 0.6 with megatron-core 0.19"

LEDGER = PatchLedger("Megatron-Bridge", (
    Patch("B2", "megatron.bridge.training.setup.initialize_megatron", CPU_ONLY, BRIDGE,
          "called without allow_no_cuda, it asserts CUDA", f"{_COMPAT}:_allow_no_cuda"),
    Patch("B3", "megatron.bridge.training.initialize.compile_helpers", CPU_ONLY, BRIDGE,
          "it runs make on the dataset helpers the wheel ships prebuilt", f"{_COMPAT}:_prebuilt_dataset_helpers"),
    Patch("B4", "megatron.bridge.training.initialize._warmup_jit_function", CPU_ONLY, BRIDGE,
          "it warms fused kernels up on CUDA tensors", f"{_COMPAT}:_skip_jit_warmup"),
    Patch("B5", "torch.cuda.get_rng_state/set_rng_state", CPU_ONLY, BRIDGE,
          "checkpoints save and restore the CUDA generator's state", f"{_COMPAT}:_checkpoint_rng_state"),
    Patch("B9", "megatron.bridge.training.initialize._set_random_seed", CPU_ONLY, BRIDGE,
          "it seeds Megatron's RNG tracker only when a GPU exists", f"{_COMPAT}:_seed_rng_tracker"),
    Patch("B7", "megatron.core optimizer, distrib_optimizer and clip_grads: TE's fused optimizers and multi-tensor "
          "kernels", CPU_ONLY, BRIDGE, "they are chosen whenever TE imports: bound to torch's and Megatron's own",
          f"{_COMPAT}:_torch_optimizers"),
    Patch("B10", "megatron.core.transformer.moe.moe_utils.te_general_gemm", CPU_ONLY, BRIDGE,
          "the router's gating GEMM runs TE's cuBLAS GEMM whenever TE imports", f"{_COMPAT}:_moe_router_gemm"),
    Patch("M1", "megatron.bridge.models.gpt_provider.MCoreGPTModel", ALL_DEVICES, BRIDGE,
          "GPTModelProvider.provide builds this class and offers no hook for another one: bound to "
          "ChunkedLossGPTModel (Megatron's GPTModel exactly until tiling.loss_chunks sets a policy)",
          f"{_COMPAT}:_gpt_model_class"),
), requires=(MEGATRON_LEDGER,))
