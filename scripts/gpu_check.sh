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
#   GPU_CHECK_BRIDGE=0 scripts/gpu_check.sh       # skip the Megatron-Bridge smoke (it runs when .venv-bridge exists
#                                                 # or BRIDGE_PYTHON=<its python> is set: `nemo-longctx bridge` ring
#                                                 # CP=2 vs one rank, 3 steps; on the CPU when there is no CUDA)
#   GPU_CHECK_BENCH=1 scripts/gpu_check.sh        # also the device benchmarks (bench/ring_decomposition.py,
#                                                 # bench/offload_overlap.py, bench/max_seqlen.py; needs
#                                                 # megatron-core for max_seqlen; tens of minutes)
#
# Exit status: non-zero if any check or test failed.
set -uo pipefail
cd "$(dirname "$0")/.." || exit 2
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
# The Megatron-Bridge stack (its own Python 3.12 venv: scripts/install_bridge.sh): `nemo-longctx bridge`'s demo
# (Bridge's pretrain() + our core attention) at ring CP=2 against one rank, 3 steps each; CUDA with >= 2 GPUs (one
# GPU: the single-rank run only), else the CPU over gloo (fp32: the losses must agree to 1e-6).
BRIDGE_PY="${BRIDGE_PYTHON:-}"
if [ -z "$BRIDGE_PY" ] && [ -x .venv-bridge/bin/python ]; then BRIDGE_PY=.venv-bridge/bin/python; fi
if [ "${GPU_CHECK_BRIDGE:-1}" = "0" ]; then
  echo "== gpu_check: Megatron-Bridge: skipped (GPU_CHECK_BRIDGE=0)"
elif [ -z "$BRIDGE_PY" ]; then
  echo "== gpu_check: Megatron-Bridge: skipped (no .venv-bridge: scripts/install_bridge.sh; or BRIDGE_PYTHON=...)"
elif ! ngpu=$("$BRIDGE_PY" -c 'import torch; print(int(torch.cuda.is_available() and torch.cuda.device_count()))'); then
  echo "== gpu_check: Megatron-Bridge: FAILED: $BRIDGE_PY cannot import torch"
  rc=1
else
  bdir="${OUT:-$(mktemp -d)}/bridge"
  runs=(none ring)
  if [ "$ngpu" = 1 ]; then runs=(none); fi
  where="$ngpu GPU(s)"
  if [ "$ngpu" = 0 ]; then where="the CPU (no CUDA)"; fi
  echo "== gpu_check: Megatron-Bridge smoke with $BRIDGE_PY on $where: cp=${runs[*]} (ring CP=2 needs 2 GPUs on CUDA)"
  for cp in "${runs[@]}"; do
    args=(cp="$cp" train.train_iters=3 run.timeout_s=900 output_dir="$bdir/$cp")
    if [ "$cp" = ring ]; then args+=(cp.size=2); fi
    rm -rf "${bdir:?}/$cp"
    mkdir -p "$bdir"
    "$BRIDGE_PY" -m nemo_longctx.apps.bridge "${args[@]}" >"$bdir/$cp.log" 2>&1
    brc=$?
    if [ "$brc" -ne 0 ] || ! grep -q "layers run LongContextCoreAttention" "$bdir/$cp.log"; then
      echo "== gpu_check: Megatron-Bridge cp=$cp FAILED (exit $brc; log $bdir/$cp.log):"
      tail -20 "$bdir/$cp.log"
      rc=1
    fi
  done
  # every run: 3 finite losses; ring vs one rank: equal in fp32 on the CPU, the first step within 2% on CUDA
  "$BRIDGE_PY" - "$bdir" "$ngpu" "${runs[@]}" <<'EOF' || rc=1
import json, math, sys
root, ngpu, runs = sys.argv[1], int(sys.argv[2]), sys.argv[3:]
rows = {}
for cp in runs:
    try:
        rows[cp] = [json.loads(line)["loss"] for line in open(f"{root}/{cp}/metrics.jsonl") if line.strip()]
    except OSError as e:
        sys.exit(f"== gpu_check: Megatron-Bridge cp={cp}: no metrics ({e})")
    print(f"== gpu_check: Megatron-Bridge cp={cp} losses {rows[cp]}")
    if len(rows[cp]) != 3 or not all(isinstance(x, float) and math.isfinite(x) for x in rows[cp]):
        sys.exit(f"== gpu_check: Megatron-Bridge cp={cp}: expected 3 finite losses")
if "ring" in rows:
    ref, got = rows["none"], rows["ring"]
    tol, pairs = (1e-6, list(zip(ref, got))) if ngpu == 0 else (2e-2, [(ref[0], got[0])])
    bad = [(a, b) for a, b in pairs if abs(a - b) > tol * abs(a)]
    if bad:
        sys.exit(f"== gpu_check: Megatron-Bridge ring CP=2 vs one rank differ beyond {tol:g} relative: {bad}")
    print(f"== gpu_check: Megatron-Bridge ring CP=2 matches one rank (relative tolerance {tol:g})")
EOF
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
