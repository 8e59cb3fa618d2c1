#!/usr/bin/env bash
# Build the manual (docs/, mkdocs.yml) with --strict: a broken link, anchor, snippet or a page missing from the nav
# fails the build. Also checks that the generated reference pages are current.
#   scripts/build_docs.sh [SITE_DIR]      (default: site/)
# PYTHON selects the interpreter (default: .venv/bin/python, else python3); it needs the docs extra:
#   .venv/bin/pip install -e '.[docs]'
set -euo pipefail
cd "$(dirname "$0")/.."
if [ -z "${PYTHON:-}" ]; then
  if [ -x .venv/bin/python ]; then PYTHON=.venv/bin/python; else PYTHON=python3; fi
fi
site_dir=${1:-site}
"$PYTHON" scripts/gen_reference.py --check
NO_MKDOCS_2_WARNING=1 "$PYTHON" -m mkdocs build --strict -f mkdocs.yml -d "$site_dir"
echo "built the manual into $site_dir/"
