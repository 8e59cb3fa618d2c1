#!/usr/bin/env bash
# One command for every CUDA code path: python -m nemo_longctx.selftest (kernels vs fp64, ring/Ulysses/hybrid on
# CUDA tensors, offload on CUDA streams with pinned memory, tiled MLP / chunked loss), then the GPU tests when
# pytest is installed. Needs only PyTorch; runs from a bare checkout (no pip install). On a machine without
# CUDA the CPU checks run and the CUDA rows say "skipped: no CUDA".
#
#   scripts/gpu_check.sh                 # everything
#   scripts/gpu_check.sh --quick         # fewer kernel cases, smaller CUDA problems
#   GPU_CHECK_OUT=/tmp/out scripts/gpu_check.sh   # also write selftest.json and the GPU test log there
#   GPU_CHECK_PYTEST=0 scripts/gpu_check.sh       # skip the pytest part
#   GPU_CHECK_BENCH=1 scripts/gpu_check.sh        # also the device benchmarks (bench/ring_decomposition.py,
#                                                 # bench/offload_overlap.py, bench/max_seqlen.py; needs
#                                                 # megatron-core for max_seqlen; tens of minutes)
#
# Exit status: non-zero if any check or test failed.
set -uo pipefail
cd "$(dirname "$0")/.."
PY="${PYTHON:-}"
if [ -z "$PY" ]; then
  if [ -x .venv/bin/python ]; then PY=.venv/bin/python; else PY=python3; fi
fi
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"
OUT="${GPU_CHECK_OUT:-}"
[ -n "$OUT" ] && mkdir -p "$OUT"

echo "== gpu_check: $($PY -c 'import sys, torch; print(sys.version.split()[0], "torch", torch.__version__, "cuda", torch.version.cuda, "available", torch.cuda.is_available())')"
if command -v nvidia-smi >/dev/null 2>&1; then
  nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader || true
fi

json_args=()
[ -n "$OUT" ] && json_args=(--json "$OUT/selftest.json")
"$PY" -m nemo_longctx.selftest "${json_args[@]}" "$@"
rc=$?

if [ "${GPU_CHECK_PYTEST:-1}" != "0" ] && "$PY" -c "import pytest" >/dev/null 2>&1; then
  echo "== gpu_check: pytest tests/test_gpu_*.py tests/test_attention_units.py"
  log=/dev/stdout
  [ -n "$OUT" ] && log="$OUT/pytest_gpu.log"
  "$PY" -m pytest -q -rs tests/test_gpu_kernels.py tests/test_gpu_offload.py tests/test_attention_units.py \
    2>&1 | tee "$log" | tail -25
  prc=${PIPESTATUS[0]}
  [ "$prc" -ne 0 ] && rc=1
else
  echo "== gpu_check: pytest not installed (or GPU_CHECK_PYTEST=0): tests skipped"
fi
if [ "${GPU_CHECK_BENCH:-0}" = "1" ]; then
  for b in ring_decomposition.py offload_overlap.py max_seqlen.py; do
    echo "== gpu_check: bench/$b"
    log=/dev/stdout
    [ -n "$OUT" ] && log="$OUT/bench_${b%.py}.txt"
    "$PY" "bench/$b" 2>&1 | tee "$log" | tail -30
    [ "${PIPESTATUS[0]}" -ne 0 ] && rc=1
  done
fi
echo "== gpu_check: exit $rc"
exit $rc
