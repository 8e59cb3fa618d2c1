"""The Megatron-core (and torch) patch ledger: every third-party name the framework-neutral layer rebinds.

Applied once at an app's entry (``LEDGER.apply()``; the NeMo 2 and Megatron-Bridge ledgers apply it first), never
from a constructor. The CPU-only rows are the fixes of ``cpu_compat.py`` (numbers 1-16) and ``cpu_compat_fsdp.py``
(F1-F6), whose docstrings explain each one in full; the two all-device rows build a full-recompute decoder as our
block subclass (R2: Megatron's GPTModel has no hook for the block's class) and route it to its own method on the
Megatron-core versions that no longer call it (R1). Reading this module imports nothing of Megatron.
"""

from __future__ import annotations

from nemo_longctx.shared.patch_ledger import ALL_DEVICES, CPU_ONLY, Patch, PatchLedger

_CPU = "nemo_longctx.integrations.megatron.cpu_compat"
_FSDP = "nemo_longctx.integrations.megatron.cpu_compat_fsdp"
TESTED = "megatron-core 0.14-0.19"

LEDGER = PatchLedger("Megatron-core", (
    Patch("1-2", "torch.cuda.Stream/Event/stream/current_stream/default_stream/synchronize/current_device/set_device/"
          "memory statistics", CPU_ONLY, "torch 2.x",
          "DDP buffers, schedules and strategies use CUDA streams and the current device unconditionally",
          f"{_CPU}:_patch_torch_cuda"),
    Patch("4", "megatron.core.tensor_parallel.random: CudaRNGStatesTracker.add/fork, _get/_set_cuda_rng_state",
          CPU_ONLY, TESTED, "the model-parallel RNG tracker runs on the CPU generator",
          f"{_CPU}:_patch_rng_tracker"),
    Patch("5", "rope_utils.get_pos_emb_on_this_cp_rank (and the modules that import it by name)", CPU_ONLY, TESTED,
          "it builds its index with pin_memory=True).cuda()", f"{_CPU}:_patch_rope"),
    Patch("6", "tensor_parallel.random.CheckpointWithoutOutput.__init__", CPU_ONLY, TESTED,
          "fp8=False is read as fp8 on, which needs TransformerEngine", f"{_CPU}:_patch_checkpoint_without_output"),
    Patch("10", "TransformerConfig.__post_init__", CPU_ONLY, TESTED,
          "fused-kernel flags (RoPE fusion, persistent norm, gradient-accumulation fusion, TE cross entropy, MoE "
          "permute fusion, grouped GEMM: fix 15) are refused without their kernels: turned off where missing",
          f"{_CPU}:_patch_rope_fusion_without_te"),
    Patch("9", "optimizer_cpu_offload.HybridDeviceOptimizer._init_sub_optimizers", CPU_ONLY, TESTED,
          "it sorts parameters by is_cuda, which is False for every parameter on the CPU",
          f"{_CPU}:_patch_hybrid_device_optimizer"),
    Patch("11", "moe_utils.te_general_gemm", CPU_ONLY, TESTED,
          "the name is unbound without TransformerEngine (NameError in the MoE router)",
          f"{_CPU}:_patch_moe_router_without_te"),
    Patch("12", "torch_norm.WrappedTorchNorm.__new__", CPU_ONLY, TESTED,
          "zero-centred norms are refused by the norm used without TE/Apex", f"{_CPU}:_patch_zero_centered_norm"),
    Patch("14", "optimizer_config.is_te_min_version", CPU_ONLY, TESTED,
          "without TransformerEngine the version comparison raises TypeError",
          f"{_CPU}:_patch_optimizer_config_te_version"),
    Patch("16", "multi_latent_attention.HAVE_TE", CPU_ONLY, "megatron-core 0.16-0.19",
          "True without TE (mock stand-ins): building MLA fails", f"{_CPU}:_patch_mla_without_te"),
    Patch("F1", "distributed.fsdp.mcore_fsdp_adapter.FullyShardedDataParallel.__init__", CPU_ONLY, TESTED,
          "Megatron-FSDP's adapter defaults its device to cuda:<current>", f"{_FSDP}:_patch_adapter_device"),
    Patch("F2", "distributed.fsdp.mcore_fsdp_adapter.DeviceMesh", CPU_ONLY, TESTED,
          "the adapter builds a CUDA DeviceMesh over gloo groups", f"{_FSDP}:_patch_adapter_mesh"),
    Patch("F3", "megatron_fsdp.MegatronFSDP.__init__", CPU_ONLY, TESTED,
          "it formats cuda:<current_device()>, invalid once the CPU stands for the device",
          f"{_FSDP}:_patch_megatron_fsdp_init"),
    Patch("F6", "megatron_fsdp.param_and_grad_buffer.AllGatherPipeline.all_gather_params", CPU_ONLY, TESTED,
          "asynchronous gloo all-gathers beside the training thread corrupt the heap: issued synchronously",
          f"{_FSDP}:_patch_synchronous_param_gather"),
    Patch("F5", "atexit (Megatron-FSDP's synchronize_param_gather before finalization)", CPU_ONLY, TESTED,
          "a gloo all-gather left in flight after the last step aborts the rank at exit",
          f"{_FSDP}:_wait_for_param_gathers_at_exit"),
    Patch("3", "torch function mode for the process (device='cuda', Tensor.cuda(), .to('cuda'), pin_memory, "
          "Tensor.type())", CPU_ONLY, "torch 2.x",
          "CUDA factory calls and CUDA type checks all over Megatron: mapped to the CPU",
          f"{_CPU}:_enter_cuda_to_cpu_mode"),
    Patch("R2", "megatron.core.models.gpt.gpt_model.TransformerBlock", ALL_DEVICES, TESTED,
          "GPTModel builds its decoder with this name and takes no spec or argument for the block's class: a model "
          "whose config carries our full-recompute mark is built with LongContextTransformerBlock (offload, kept "
          "attention, sequence chunks), every other model with Megatron's TransformerBlock as before",
          "nemo_longctx.integrations.megatron.offload_block:build_decoder_blocks_by_config"),
    Patch("R1", "megatron.core.transformer.transformer_block.checkpointed_forward", ALL_DEVICES,
          "megatron-core >= 0.19 (where megatron.core.recompute exists; nothing is rebound before)",
          "TransformerBlock.forward calls this function instead of the block's _checkpointed_forward: blocks built "
          "as LongContextTransformerBlock (full recompute with offload, kept attention or sequence chunks) are sent "
          "to their own method, every other block to Megatron's function unchanged",
          "nemo_longctx.integrations.megatron.offload_block:route_block_recompute"),
))
