"""Checkpoint save/load time and size of the CPU demo (tiny GQA Llama, ring CP=2, Adam, fp32), and the size the
same format has for Llama-3-8B.

    python bench/checkpoint_io.py [--steps 4] [--seq 1024]

Runs ``nemo-longctx train`` with ``checkpoint.every_n_steps=2`` (NeMo ModelCheckpoint -> Megatron torch_dist through
MegatronCheckpointIO), then the same command with more steps (AutoResume loads the latest checkpoint). Save times
are NeMo's own "Save duration" log lines; the load time is the wall time of the restore (NeMo's "Restoring states"
line to the first resumed step). Sizes are what is on disk. The Llama-3-8B row is computed, not measured: bytes per
parameter of Megatron's distributed checkpoint with bf16 weights and the distributed Adam state (fp32 main weights,
exp_avg, exp_avg_sq) = 2 + 12 bytes x the parameter count of ``model_shapes.KNOWN_SHAPES['llama3_8b']``.
"""

from __future__ import annotations

import argparse
import re
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from nemo_longctx.planner.model_shapes import KNOWN_SHAPES, shape_from_config  # noqa: E402


def _run(args, log: Path) -> tuple:
    t0 = time.time()
    with open(log, "w") as f:
        code = subprocess.run([str(Path(sys.executable).with_name("nemo-longctx")), "train", *args], cwd=ROOT,
                              stdout=f, stderr=subprocess.STDOUT).returncode
    if code != 0:
        raise SystemExit(f"run failed ({code}); see {log}")
    return log.read_text(), time.time() - t0


def _size(path: Path) -> int:
    return sum(p.stat().st_size for p in path.rglob("*") if p.is_file())


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--steps", type=int, default=4)
    ap.add_argument("--seq", type=int, default=1024)
    a = ap.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        out = Path(tmp) / "run"
        common = [f"output_dir={out}", f"model.seq_length={a.seq}", "checkpoint.every_n_steps=2", "checkpoint.keep=2",
                  "memory.track=false"]
        text, _ = _run([*common, f"trainer.max_steps={a.steps}"], Path(tmp) / "save.log")
        saves = [float(x) for x in re.findall(r"Rank: 0 : Iteration: \d+ : .*?Save duration: ([0-9.]+)s", text)]
        ckpts = sorted(p for p in (out / "checkpoints").iterdir() if not p.name.endswith("-last"))
        size = _size(ckpts[-1])
        weights = _size(ckpts[-1] / "weights")
        text2, _ = _run([*common, f"trainer.max_steps={a.steps + 1}"], Path(tmp) / "load.log")
        lines = text2.splitlines()
        t_restore = next(i for i, ln in enumerate(lines) if "Restoring states from the checkpoint" in ln)
        stamp = re.compile(r"\[(\d{4}-\d\d-\d\d \d\d:\d\d:\d\d,\d+)\]")
        from datetime import datetime

        def at(i):
            m = stamp.search(lines[i])
            return datetime.strptime(m.group(1), "%Y-%m-%d %H:%M:%S,%f") if m else None

        start = at(t_restore)
        end = next((at(i) for i in range(t_restore + 1, len(lines)) if at(i) is not None
                    and "Restored all states" in lines[i]), None)
        load_s = (end - start).total_seconds() if start and end else float("nan")

    import yaml

    tiny = shape_from_config(yaml.safe_load((ROOT / "conf" / "model" / "tiny_llama.yaml").read_text()))
    p_tiny = tiny.parameters()
    p8b = KNOWN_SHAPES["llama3_8b"].parameters()
    print("checkpoint I/O, tiny GQA Llama (fp32, Adam), ring CP=2 on 2 gloo CPU ranks, Megatron torch_dist format")
    print("| model | params | checkpoint size | of which weights+optimizer | bytes/param | save (s) | load (s) |")
    print("|---|---|---|---|---|---|---|")
    print(f"| tiny_llama (measured) | {p_tiny / 1e6:.2f} M | {size / 2**20:.1f} MiB | {weights / 2**20:.1f} MiB | "
          f"{weights / p_tiny:.1f} | first {saves[0]:.2f}, then {min(saves[1:] or saves):.2f} | {load_s:.2f} |")
    est = p8b * (2 + 12)
    print(f"| llama3_8b (computed: bf16 weights + fp32 main/exp_avg/exp_avg_sq) | {p8b / 1e9:.2f} B | "
          f"{est / 2**30:.0f} GiB | {est / 2**30:.0f} GiB | 14 | - | - |")


if __name__ == "__main__":
    main()
