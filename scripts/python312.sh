#!/usr/bin/env bash
# Prints a Python 3.12 interpreter (the Bridge stack and the NeMo 2 version matrix run on 3.12, as NVIDIA's
# containers do): $PYTHON312, else the newest pyenv 3.12 (pyenv's `python3.12` shim fails unless 3.12 is selected),
# else `python3.12` on PATH. Exit 2 naming how to get one.
#   PY=$(scripts/python312.sh "<caller>")
set -euo pipefail
py=${PYTHON312:-$(find "${PYENV_ROOT:-$HOME/.pyenv}/versions" -maxdepth 3 -path '*/3.12*/bin/python3.12' 2>/dev/null \
  | sort | tail -1)}
py=${py:-$(command -v python3.12 || true)}
if [ -z "$py" ] || ! "$py" -c 'import sys; assert sys.version_info[:2] == (3, 12)' 2>/dev/null; then
  echo "${1:-python312.sh}: needs a Python 3.12 interpreter (set PYTHON312=...; e.g. 'pyenv install 3.12' or 'uv python install 3.12')" >&2
  exit 2
fi
echo "$py"
