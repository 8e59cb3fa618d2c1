#!/usr/bin/env bash
# device session 2 (372 s of budget left): where the CUDA peak of bench/max_seqlen.py's longctx step goes
set -o pipefail
export PYTHONUNBUFFERED=1
nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader | tee "$OUT/env.txt"
python3 -c 'import torch; print("torch", torch.__version__, "cuda", torch.version.cuda)' | tee -a "$OUT/env.txt"
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --target /tmp/site .gpu/*.whl || exit 1
export PYTHONPATH=/tmp/site
timeout 120 python3 bench/max_seqlen.py --layers 2 --peak-breakdown 262144 2>&1 | grep -v "Unknown MLP type\|warn" \
  | tee "$OUT/peak_breakdown_262144.txt"
# the search with every parameter in bf16 (as under Float16Module)
timeout 100 python3 bench/max_seqlen.py --layers 2 --stacks longctx --start 524288 --granularity 65536 --max-len 1048576 --time-budget-s 60 2>&1 | grep -v "Unknown MLP type\|warn" | tee "$OUT/max_seqlen_bf16.txt"
echo "rc ${PIPESTATUS[0]}"
