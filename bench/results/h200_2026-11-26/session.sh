#!/usr/bin/env bash
# one device session: gpu_check (selftest + GPU pytest), then the device benches, each under its own time limit
set -o pipefail
export PYTHONUNBUFFERED=1
t0=$(date +%s)
stamp() { echo "== session: $1 at +$(( $(date +%s) - t0 ))s"; }
nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader | tee "$OUT/env.txt"
python3 -c 'import sys, torch, numpy; print("python", sys.version.split()[0], "torch", torch.__version__, "cuda", torch.version.cuda, "numpy", numpy.__version__, "gpus", torch.cuda.device_count())' | tee -a "$OUT/env.txt"
nproc | sed 's/^/cpus /' | tee -a "$OUT/env.txt"
stamp "gpu_check"
GPU_CHECK_BRIDGE=0 GPU_CHECK_OUT="$OUT" PYTHON=python3 timeout 240 scripts/gpu_check.sh 2>&1 | tee "$OUT/gpu_check.txt"
echo "gpu_check rc ${PIPESTATUS[0]}"
stamp "ring_decomposition"
timeout 75 python3 bench/ring_decomposition.py 2>&1 | tee "$OUT/bench_ring_decomposition.txt"
stamp "offload_overlap"
timeout 45 python3 bench/offload_overlap.py 2>&1 | tee "$OUT/bench_offload_overlap.txt"
stamp "megatron-core install"
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --target /tmp/site .gpu/*.whl || exit 1
stamp "max_seqlen"
( export PYTHONPATH=/tmp/site
  timeout 60 python3 bench/max_seqlen.py --layers 2 --stacks megatron --start 4096 --granularity 4096 --time-budget-s 30
  echo "rc $?"
  timeout 140 python3 bench/max_seqlen.py --layers 2 --stacks longctx --start 131072 --granularity 131072 --max-len 1048576 --time-budget-s 40
  echo "rc $?" ) 2>&1 | grep -v "Unknown MLP type" | tee "$OUT/bench_max_seqlen.txt"
stamp "done"
