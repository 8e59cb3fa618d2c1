"""Which NeMo 2 / Megatron-core / NeMo-Run versions nemo_longctx is tested with, and a check of the installed ones.

``NEMO2_CONTAINERS``: NVIDIA's NGC NeMo containers that ship NeMo 2 (``nemo.collections.llm``), with the versions
their release tables give (``../shared/design.md``). ``TESTED``: the stacks this repository's CI runs, and how.
``python -m nemo_longctx.shared.versions`` (the Dockerfile runs it) prints the installed versions and whether that
stack is tested; with ``STRICT_VERSIONS=1`` an untested stack is an error (exit 1), otherwise a warning (exit 0).
"""

from __future__ import annotations

import os
import sys
from importlib import metadata
from typing import Dict, List, NamedTuple, Optional, Tuple


class Container(NamedTuple):
    tag: str
    nemo: str
    megatron_core: str
    nemo_run: str
    python: str = "3.12"


NEMO2_CONTAINERS: Tuple[Container, ...] = (
    Container("25.09", "2.5.0", "0.14.0", "0.6.0"),
    Container("25.11", "2.6.0", "0.15.0", "0.7.0"),
    Container("26.02", "2.7.0", "0.16.0", "0.8.0"),
    Container("26.04", "2.7.3", "0.17.0", "0.9.0"),  # the last container with NeMo 2
)
# (nemo-toolkit, megatron-core) -> how it is tested here
TESTED: Dict[Tuple[str, str], str] = {
    ("2.7.3", "0.15.3"): "full suite on Python 3.11 (CI: .ci/run; constraints/nemo.txt)",
    ("2.5.0", "0.14.0"): "smoke set on Python 3.12 with NeMo-Run 0.6.0 (CI: scripts/matrix_smoke.sh; "
                         "constraints/nemo-25.09.txt)",
    ("2.6.0", "0.15.0"): "smoke set on Python 3.12 with NeMo-Run 0.7.0 (CI: scripts/matrix_smoke.sh; "
                         "constraints/nemo-25.11.txt)",
}
# pairs whose PyPI NeMo cannot run with their Megatron-core (the containers ship NeMo builds that fit): only our
# Megatron-core layer is tested on them, so they stay untested stacks (a warning; an error with STRICT_VERSIONS=1)
PARTLY_TESTED: Dict[Tuple[str, str], str] = {
    ("2.7.0", "0.16.0"): "our Megatron-core layer only (CI: scripts/matrix_smoke.sh 26.02, -m matrix_mcore)",
    ("2.7.3", "0.17.0"): "our Megatron-core layer only (CI: scripts/matrix_smoke.sh 26.04, -m matrix_mcore)",
}
PACKAGES = {"nemo": "nemo-toolkit", "megatron_core": "megatron-core", "nemo_run": "nemo_run"}


def installed() -> Dict[str, Optional[str]]:
    """The installed versions (None: not installed)."""
    out: Dict[str, Optional[str]] = {}
    for key, dist in PACKAGES.items():
        try:
            out[key] = metadata.version(dist)
        except metadata.PackageNotFoundError:
            out[key] = None
    return out


def _release(version: Optional[str]) -> Optional[str]:
    """'0.15.0rc2+abc' -> '0.15.0' (containers ship pre-release builds of the listed version)."""
    if version is None:
        return None
    head = version.split("+")[0]
    for marker in ("rc", "a", "b", "dev", "post"):
        head = head.split(marker)[0]
    return head.rstrip(".")


def problems(versions: Optional[Dict[str, Optional[str]]] = None) -> List[str]:
    """Why the installed stack is not a tested one (empty: tested)."""
    v = versions if versions is not None else installed()
    if v.get("nemo") is None or v.get("megatron_core") is None:
        return [f"nemo-toolkit {v.get('nemo')} / megatron-core {v.get('megatron_core')}: the NeMo 2 front end needs "
                "both installed"]
    key = (_release(v["nemo"]), _release(v["megatron_core"]))
    if key in TESTED:
        return []
    containers = [c.tag for c in NEMO2_CONTAINERS if (c.nemo, c.megatron_core) == key]
    where = f" (NGC NeMo {', '.join(containers)})" if containers else ""
    partly = (f" (here: {PARTLY_TESTED[key]}; NeMo itself runs only in the container)" if key in PARTLY_TESTED
              else "")
    tested = "; ".join(f"nemo-toolkit {n} + megatron-core {m}: {how}" for (n, m), how in TESTED.items())
    return [f"nemo-toolkit {v['nemo']} + megatron-core {v['megatron_core']}{where} is not a tested stack{partly} "
            f"(tested: {tested}; see docs/how-to/nemo-versions.md)"]


# what `nemo-longctx --version` lists beside our own version (distribution names; read from metadata, nothing imported)
STACK = ("torch", "nemo-toolkit", "megatron-core", "nemo_run", "megatron-bridge", "transformer-engine",
         "transformer-engine-cu13", "lightning", "hydra-core", "transformers")


def version_lines() -> List[str]:
    """``nemo-longctx --version``: our version, Python's, each installed package of the stack, and whether this
    NeMo 2 / Megatron-core pair is a tested one (the Bridge stack has no NeMo: its line says so)."""
    lines = [f"nemo-longctx {metadata.version('nemo-longctx')}", f"python {sys.version.split()[0]}"]
    for dist in STACK:
        try:
            lines.append(f"{dist} {metadata.version(dist)}")
        except metadata.PackageNotFoundError:
            continue
    v = installed()
    if v.get("nemo") is not None:
        p = problems(v)
        lines.append("NeMo 2 stack: tested" if not p else f"NeMo 2 stack: {p[0]}")
    return lines


def main() -> int:
    v = installed()
    print("nemo_longctx versions: " + ", ".join(f"{PACKAGES[k]} {v[k]}" for k in PACKAGES))
    p = problems(v)
    if not p:
        print("nemo_longctx versions: a tested stack")
        return 0
    strict = os.environ.get("STRICT_VERSIONS", "0") not in ("", "0")
    for line in p:
        print(f"nemo_longctx versions: {'ERROR' if strict else 'WARNING'}: {line}", file=sys.stderr)
    return 1 if strict else 0


if __name__ == "__main__":
    sys.exit(main())
