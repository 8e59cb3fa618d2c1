"""NeMo 2's patch ledger: every third-party name the NeMo front end rebinds (``compat.py`` holds the patches).

Applied once at the entry of an app that runs NeMo (``compat.apply()``), after the Megatron-core ledger
(``integrations/megatron/patches.py``), which it requires; never from a constructor. Reading it imports nothing of
NeMo or Megatron (``nemo-longctx --versions``, the self-test).
"""

from __future__ import annotations

from nemo_longctx.integrations.megatron.patches import LEDGER as MEGATRON_LEDGER
from nemo_longctx.shared.patch_ledger import ALL_DEVICES, CPU_ONLY, Patch, PatchLedger

_COMPAT = "nemo_longctx.integrations.nemo.compat"
NEMO = "nemo-toolkit 2.7"

LEDGER = PatchLedger("NeMo 2", (
    Patch("4N", "nemo.lightning.megatron_init._set_random_seed", CPU_ONLY, NEMO,
          "it seeds Megatron's RNG tracker only when a GPU exists", f"{_COMPAT}:_patch_nemo_random_seed"),
    Patch("8", "nemo.lightning.io.pl._fix_tensors_device", CPU_ONLY, NEMO,
          "resuming asserts torch.cuda.is_initialized() to move loaded tensors to the GPU",
          f"{_COMPAT}:_patch_checkpoint_load_device"),
    Patch("13", "nemo.lightning.io.state.apply_transforms, nemo.lightning.io.apply_transforms", CPU_ONLY, NEMO,
          "the HF converters name the norms as TE's fused layers; the local spec keeps them as separate norms",
          f"{_COMPAT}:_patch_hf_converter_norm_keys"),
    Patch("T1", "megatron.core.parallel_state.initialize_model_parallel", ALL_DEVICES,
          f"{NEMO} with megatron-core 0.14-0.17",
          "NeMo creates Megatron's groups without distributed_timeout_minutes (gloo's point-to-point receives keep "
          "the timeout they were created with): inside LongContextStrategy's set-up the run's collective timeout is "
          "passed, elsewhere the call is unchanged",
          f"{_COMPAT}:_patch_groups_timeout"),
    Patch("M1", "nemo.collections.llm.gpt.model.base.MCoreGPTModel", ALL_DEVICES, NEMO,
          "GPTConfig.configure_model builds this class and offers no hook for another one: bound to "
          "ChunkedLossGPTModel (Megatron's GPTModel exactly until tiling.loss_chunks sets a policy)",
          f"{_COMPAT}:_patch_gpt_model_class"),
), requires=(MEGATRON_LEDGER,))

