"""The default job's uninterrupted run, trained once per pytest session and shared by the files that compare with it.

The job: the tiny GQA Llama, ring CP=2 on two gloo processes, Adam + cosine LR, fp32, seq 1024, 6 steps, a checkpoint
and a validation every 2 steps (3 kept). tests/test_checkpoint_resume.py resumes from its checkpoints and reads its
validation losses, checkpoint directory and TensorBoard files; tests/test_preemption.py compares its resumed runs'
per-step losses with it. Checkpoints and validation leave the training losses bit-equal (the preemption tests' own
uninterrupted run, without either, matched this one to the last bit).
"""

from __future__ import annotations

import sys
from pathlib import Path

from run_cache import run_dir, shared_run

BIN = Path(sys.executable).parent
STEPS = 6
COMMON = ["model.seq_length=1024", f"trainer.max_steps={STEPS}", "checkpoint.every_n_steps=2", "checkpoint.keep=3",
          "trainer.val_check_interval=2", "trainer.limit_val_batches=2", "memory.track=false"]


def uninterrupted(tmp_path_factory) -> Path:
    """The output directory of the shared uninterrupted run (trained on first use, on whichever worker asks first)."""
    out = run_dir("default_job", tmp_path_factory)
    code, log = shared_run("default_job", [str(BIN / "nemo-longctx"), "train", f"output_dir={out}", *COMMON],
                           tmp_path_factory, timeout=420)
    assert code == 0, log[-4000:]
    return out
