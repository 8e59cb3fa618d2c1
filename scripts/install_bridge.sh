#!/usr/bin/env bash
# The Megatron-Bridge stack in its own venv (default .venv-bridge): Python 3.12, megatron-bridge 0.6.2,
# megatron-core 0.19.2, TransformerEngine 2.20.2 (prebuilt core + the PyTorch extension), transformers 5.x.
#   scripts/install_bridge.sh [VENV]        (PYTHON312=<interpreter> to choose the Python 3.12)
#   scripts/install_bridge.sh --deps [VENV] everything but the checkout itself, which it does not write to (CI runs it
#                                           beside the NeMo 2 install, whose editable build writes the egg-info)
# pip cannot install megatron-bridge with its declared deps (GPU-only packages that need torch to build), so:
# 1. `pip install -c constraints/bridge.txt -e '.[bridge,test]'`: what Bridge's pretrain() really needs (pinned);
# 2. --no-deps: megatron-bridge, transformer-engine (the Python package), its PyTorch extension;
# 3. nvidia-resiliency-ext 0.6.0 (imported by Bridge's pretrain.py): its wheel is tagged manylinux_2_39, its Python
#    part runs on older glibc: installed --no-deps into <venv>/nvrx (a .pth file puts it on the path).
# The TE PyTorch extension is an sdist (minutes of nvcc): it is built once into a wheel cache keyed by TE version,
# torch version and Python tag (NEMO_LONGCTX_WHEEL_CACHE, default ~/.cache/nemo-longctx/wheels) and reused; a
# prebuilt wheel in ../shared/wheels (CI machines) seeds the cache.
set -euo pipefail
cd "$(dirname "$0")/.."
DEPS_ONLY=0
if [ "${1:-}" = --deps ]; then
  DEPS_ONLY=1
  shift
fi
VENV=${1:-.venv-bridge}
TE=2.20.2
PY=$(scripts/python312.sh install_bridge.sh)
[ -x "$VENV/bin/python" ] || "$PY" -m venv "$VENV"
PIP=("$VENV/bin/python" -m pip)
if [ "$DEPS_ONLY" = 1 ]; then  # the requirements of '.[bridge,test]' as pyproject.toml declares them
  mapfile -t REQS < <("$VENV/bin/python" -c 'import tomllib; p = tomllib.load(open("pyproject.toml", "rb"))["project"]
print("\n".join(p["dependencies"] + p["optional-dependencies"]["bridge"] + p["optional-dependencies"]["test"]))')
  "${PIP[@]}" install -q -c constraints/bridge.txt "${REQS[@]}"
else
  "${PIP[@]}" install -q -c constraints/bridge.txt -e '.[bridge,test]'
fi
"${PIP[@]}" install -q --no-deps megatron-bridge==0.6.2 "transformer-engine==$TE"
TORCH=$("$VENV/bin/python" -c 'import torch; print(torch.__version__.split("+")[0])')
CACHE=${NEMO_LONGCTX_WHEEL_CACHE:-$HOME/.cache/nemo-longctx/wheels}/te$TE-torch$TORCH-cp312
mkdir -p "$CACHE"
WHEEL=transformer_engine_torch-$TE-cp312-cp312-linux_x86_64.whl
if [ ! -f "$CACHE/$WHEEL" ] && [ -f ../shared/wheels/$WHEEL ] && [ "$TORCH" = 2.13.0 ]; then
  cp ../shared/wheels/$WHEEL "$CACHE/"
fi
if [ ! -f "$CACHE/$WHEEL" ]; then
  echo "install_bridge.sh: building TransformerEngine's PyTorch extension $TE for torch $TORCH (nvcc; ~9 min on 2 cores)" >&2
  SP=$("$VENV/bin/python" -c 'import site; print(site.getsitepackages()[0])')
  export CUDA_HOME=${CUDA_HOME:-/usr/local/cuda}
  export PATH=$CUDA_HOME/bin:$PATH
  CPATH=$(find "$SP/nvidia" -mindepth 2 -maxdepth 2 -name include -type d | tr '\n' ':'); export CPATH
  LIBRARY_PATH=$(find "$SP/nvidia" -mindepth 2 -maxdepth 2 -name lib -type d | tr '\n' ':'); export LIBRARY_PATH
  export NVTE_FRAMEWORK=pytorch NVTE_CUDA_ARCHS=${NVTE_CUDA_ARCHS:-90} MAX_JOBS=${MAX_JOBS:-2}
  "${PIP[@]}" download -q --no-deps "transformer-engine-torch==$TE" -d "$CACHE/sdist"
  "${PIP[@]}" wheel -q --no-build-isolation --no-deps -w "$CACHE" "$CACHE/sdist/transformer_engine_torch-$TE.tar.gz"
fi
"${PIP[@]}" install -q --no-deps "$CACHE/$WHEEL"
SITE=$("$VENV/bin/python" -c 'import site; print(site.getsitepackages()[0])')
if [ ! -d "$VENV/nvrx/nvidia_resiliency_ext" ]; then
  "${PIP[@]}" install -q --no-deps --platform manylinux_2_39_x86_64 --only-binary=:all: --python-version 3.12 \
    --target "$VENV/nvrx" nvidia-resiliency-ext==0.6.0
fi
(cd "$VENV/nvrx" && pwd) > "$SITE/nemo_longctx_nvrx.pth"
"$VENV/bin/python" -c 'import torch, transformer_engine.pytorch, megatron.bridge, megatron.bridge.training.pretrain' \
  2>/dev/null || { echo "install_bridge.sh: import megatron.bridge failed in $VENV" >&2; exit 1; }
if [ "$DEPS_ONLY" = 1 ]; then
  echo "install_bridge.sh: $VENV has the dependencies (run it again without --deps for nemo_longctx itself)"
  exit 0
fi
echo "install_bridge.sh: $VENV ready (megatron-bridge 0.6.2, megatron-core 0.19.2, TE $TE, torch $TORCH)"
