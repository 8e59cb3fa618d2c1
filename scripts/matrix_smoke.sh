#!/usr/bin/env bash
# The NeMo 2 version matrix: the smoke set (pytest -m matrix: the main job's ring parity, Ulysses/hybrid parity,
# recompute x offload, HF import -> CP training -> own-checkpoint resume -> HF export, a packed batch with a window,
# a NeMo-Run recipe) on each NeMo 2 / Megatron-core pair of constraints/nemo-<container>.txt, on Python 3.12 as the
# NGC containers run it. One venv (.venv-matrix, installed with the primary stack's pins); each pair is swapped in
# with --no-deps. The primary pair (constraints/nemo.txt) runs the whole suite on Python 3.11 and only by name here.
#   scripts/matrix_smoke.sh                 # every container stack of constraints/, each its whole set
#   scripts/matrix_smoke.sh 25.09 primary   # the named ones
#   scripts/matrix_smoke.sh --install       # only create .venv-matrix (.ci/run does it beside the NeMo 2 suite)
#   scripts/matrix_smoke.sh --ci 25.09 ...  # CI's set: a stack's file may name a smaller one for CI
#                                           # (`# matrix_smoke.sh --ci: -m <marker> (why)`)
#   scripts/matrix_smoke.sh --files MARKER  # the test files a set runs (below)
set -euo pipefail
cd "$(dirname "$0")/.."
# the test files that hold a set's tests (those naming `pytest.mark.<marker>`): pytest is handed these alone, so its
# workers import them and not the whole suite (~10 s of one core each, per stack); tests/test_repo.py checks that they
# are every file whose tests pytest selects by the marker
set_files() { grep -lE "mark\.$1\b" tests/test_*.py; }
if [ "${1:-}" = --files ]; then
  set_files "$2"
  exit 0
fi
py=$(scripts/python312.sh matrix_smoke.sh)  # PYTHON312=... to choose it
venv=.venv-matrix
if [ ! -f "$venv/.installed" ]; then  # written last: an interrupted install is redone
  "$py" -m venv "$venv"
  "$venv/bin/pip" install -q -c constraints/nemo.txt -e '.[nemo,test]'
  touch "$venv/.installed"
fi
if [ "${1:-}" = --install ]; then
  exit 0
fi
ci=0
if [ "${1:-}" = --ci ]; then
  ci=1
  shift
fi
# A CUDA build of torch on a machine without a GPU (pip's only torch for Python 3.12 here): Megatron-core 0.15.0
# JIT-compiles a CUDA allocator when imported and, with no device to read the architecture from, dies with an
# IndexError instead of the error it handles; a named architecture makes that compile fail the handled way.
export TORCH_CUDA_ARCH_LIST=${TORCH_CUDA_ARCH_LIST:-9.0}
# the fixtures skip the cases only unmarked tests read (tests/test_hf_roundtrip.py)
export NEMO_LONGCTX_MATRIX_SMOKE=1
stacks=("$@")
if [ ${#stacks[@]} -eq 0 ]; then
  for f in constraints/nemo-*.txt; do stacks+=("$(basename "$f" .txt | sed 's/^nemo-//')"); done
fi
# the set a stack's constraints file names: `# matrix_smoke.sh<tag>: -m <marker> (why)` (tag "" or " --ci")
named_set() { sed -n "s/^# matrix_smoke.sh$2: -m \([a-z_]*\).*/\1/p" "constraints/nemo-$1.txt"; }
status=0
for stack in "${stacks[@]}"; do
  if [ "$stack" = primary ]; then
    mapfile -t pins < <(grep -E '^(nemo-toolkit|megatron-core|nemo_run)==' constraints/nemo.txt)
    "$venv/bin/pip" install -q --no-deps "${pins[@]}"
  else
    [ -f "constraints/nemo-$stack.txt" ] || { echo "matrix_smoke: no constraints/nemo-$stack.txt" >&2; exit 2; }
    "$venv/bin/pip" install -q --no-deps -r "constraints/nemo-$stack.txt"
  fi
  # the test set: `matrix`, or what the stack's constraints file names (`# matrix_smoke.sh: -m <marker> (why)`)
  marker=matrix
  if [ "$stack" != primary ]; then
    marker=$(named_set "$stack" "")
    marker=${marker:-matrix}
    if [ "$ci" = 1 ]; then
      named=$(named_set "$stack" " --ci")
      marker=${named:-$marker}
    fi
  fi
  echo "=== matrix stack $stack (-m $marker): $("$venv/bin/python" -m nemo_longctx.shared.versions 2>/dev/null | head -1)"
  mapfile -t files < <(set_files "$marker")
  [ ${#files[@]} -gt 0 ] || { echo "matrix_smoke: no test file names pytest.mark.$marker" >&2; exit 2; }
  start=$(date +%s)
  if "$venv/bin/python" -m pytest -q -p no:cacheprovider -n 2 --dist loadfile -m "$marker" "${files[@]}"; then result=passed; else result=FAILED; status=1; fi
  echo "=== matrix stack $stack (-m $marker): $result in $(( $(date +%s) - start )) s"
done
exit $status
