"""The app trained once per model-state option (``optim`` group), shared by tests/test_model_state.py (losses against
plain DDP, what Megatron built) and tests/test_planner_model_state_bytes.py (the bytes Megatron holds against the
planner): each run happens at most once per pytest session, on whichever worker asks first (tests/run_cache.py).

The job: a tiny GQA Llama with odd widths (hidden 200, 4 query heads / 2 KV groups, ffn 520, vocab 1000: no parameter
is a multiple of 64 elements, so the distributed optimizer's buffer padding shows), cp=ring cp.size=2 on two gloo
processes (the distributed optimizer and Megatron-FSDP shard over the data-parallel-with-CP group of 2), 6 steps at
seq 2048, Adam, bf16-mixed unless the run says otherwise. Every run's ModelStateCheck writes
``model_state_bytes.rank<R>.json`` after the first optimizer step.
"""

from __future__ import annotations

import sys
from pathlib import Path

from app_runner import metrics_rows
from run_cache import run_dir, shared_run

BIN = Path(sys.executable).parent
STEPS = 6
SHAPE = ["model.hidden_size=200", "model.num_attention_heads=4", "model.num_query_groups=2",
         "model.ffn_hidden_size=520", "model.vocab_size=1000"]
COMMON = [f"trainer.max_steps={STEPS}", "model.seq_length=2048", "trainer.precision=bf16-mixed", "run.timeout_s=300",
          *SHAPE]
RC_OFF = ["recompute=full", "offload=layer_input"]
# the precision-aware optimizer as it runs without TE: Megatron's HybridDeviceOptimizer (fp32 moments), bf16 main grads
PA = ["optim=precision_aware", "optim.optimizer_cpu_offload=true", "optim.exp_avg_dtype=fp32",
      "optim.exp_avg_sq_dtype=fp32", "optim.main_grads_dtype=bf16"]
# The distributed optimizer and Megatron-FSDP run in bf16 with recompute + offload only (the plain bf16 runs of both,
# 1.04e-5 and 9.6e-6 from DDP when they were in the suite, added CI time and no path of their own: the distributed
# optimizer's plain path runs in fp32 below, and model-state bytes do not depend on the activation options).
RUNS = {  # name: (overrides, baseline run, relative tolerance of its losses against the baseline's)
    "ddp": ([], None, None),
    "ddp_rc": (RC_OFF, None, None),
    "distributed_rc": (["optim=distributed", *RC_OFF], "ddp_rc", 1e-4),
    "cpu_offload": (["optim=cpu_offload"], "ddp", 1e-4),
    "cpu_offload_half_rc": (["optim=cpu_offload", "optim.optimizer_offload_fraction=0.5", *RC_OFF], "ddp_rc", 1e-4),
    "precision_aware": (PA, "ddp", 1e-4),
    "precision_aware_half_rc": ([*PA, "optim.optimizer_offload_fraction=0.5", *RC_OFF], "ddp_rc", 1e-4),
    "fsdp_rc": (["optim=fsdp", *RC_OFF], "ddp_rc", 1e-4),
    # sequence-chunked layers under Megatron-FSDP: the layer's one call (chunked_layer.py) keeps FSDP's all-gather,
    # release and reduce-scatter hooks at one per layer and step
    "fsdp_rc_chunks": (["optim=fsdp", *RC_OFF, "recompute.sequence_chunks=4"], "fsdp_rc", 1e-4),
    # the default job's own precision (fp32): the distributed optimizer against DDP
    "ddp_fp32": (["trainer.precision=32"], None, None),
    "distributed_fp32": (["optim=distributed", "trainer.precision=32"], "ddp_fp32", 1e-5),
}
# trained only by the full suite (their tests are marked slow): the fraction-0.5 offload variants and the fp32
# distributed-optimizer pair (the bf16 distributed optimizer with recompute/offload stays in CI's run)
SLOW_RUNS = {"cpu_offload_half_rc", "precision_aware_half_rc", "distributed_fp32"}
_DONE: dict = {}


def trained(name: str, tmp_path_factory) -> dict:
    """{'losses', 'log', 'dir'} of the run ``name`` (trained on first use)."""
    if name not in _DONE:  # (tests/run_cache.py: once per session, whichever worker asks first)
        out = run_dir(f"model_state_{name}", tmp_path_factory)
        code, log = shared_run(f"model_state_{name}", [str(BIN / "nemo-longctx"), "train", f"output_dir={out}",
                                                       *COMMON, *RUNS[name][0]], tmp_path_factory)
        assert code == 0, f"{name}: {log[-4000:]}"
        _DONE[name] = {"losses": [row["loss"] for row in metrics_rows(out)], "log": log, "dir": out}
    return _DONE[name]
