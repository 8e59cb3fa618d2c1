#!/usr/bin/env bash
# Fill .gpu/ with the wheels a GPU device image lacks (constraints/gpu_carry.txt: NeMo 2, Megatron-core and what they
# import; Python 3.12, x86_64 Linux), so a device call can carry them with the checkout (carry: [".gpu"]) and
# scripts/gpu_measure.sh installs them there without a package index. Source-only packages are built into wheels
# here (pure Python). Needs network access and a Python 3.12 (scripts/python312.sh).
#
#   scripts/gpu_wheels.sh            # download into .gpu/ (skips what is there)
#   PYTHON=<a Python 3.12 with torch> scripts/gpu_wheels.sh --check   # install .gpu/ into a scratch folder and
#                                    # import the app from it
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-$(scripts/python312.sh gpu_wheels.sh)}
mkdir -p .gpu
if [ "${1:-}" != "--check" ]; then
  "$PY" -m pip download -q --no-deps -d .gpu -r constraints/gpu_carry.txt
  shopt -s nullglob
  for sdist in .gpu/*.tar.gz .gpu/*.zip; do
    "$PY" -m pip wheel -q --no-deps -w .gpu "$sdist"
    rm -f "$sdist"
  done
  echo "gpu_wheels: $(find .gpu -name '*.whl' | wc -l) wheels, $(du -sh .gpu | cut -f1) in .gpu/"
  exit 0
fi
site=$(mktemp -d)
trap 'rm -rf "$site"' EXIT
"$PY" -m pip install -q --no-index --no-deps --no-compile --target "$site" .gpu/*.whl
PYTHONPATH="$PWD:$site" "$PY" -c 'import megatron.core, nemo.collections.llm, nemo_longctx.apps.train; print("gpu_wheels: imports OK")'
