"""The ``key=value`` arguments of the converters (``nemo-longctx import|export``, ``apps/convert.py``, and
``nemo-longctx bridge-export``, ``apps/bridge_convert.py``): standard library only, so the Bridge converter reads its
arguments without the NeMo app's converter module."""

from __future__ import annotations

import sys
from typing import Dict, List, Sequence


def parse_args(argv: List[str], required: List[str], usage: str, optional: Sequence[str] = ()) -> Dict[str, str]:
    """``KEY=VALUE`` arguments of a converter: the ``required`` keys and any of ``optional``; anything else, or a
    missing required key, exits 2 with every problem and the usage; ``-h``/``--help`` prints the usage."""
    if any(a in ("-h", "--help", "help") for a in argv):
        print(usage)
        sys.exit(0)
    args, problems = {}, []
    expected = " ".join([k + "=..." for k in required] + [f"[{k}=...]" for k in optional])
    for a in argv:
        key, sep, value = a.partition("=")
        if not sep or key not in (*required, *optional):
            problems.append(f"unknown argument {a!r} (expected {expected})")
        else:
            args[key] = value
    problems += [f"{k}= is required" for k in required if not args.get(k)]
    if problems:
        print("invalid arguments:\n  - " + "\n  - ".join(problems) + "\n\n" + usage, file=sys.stderr)
        sys.exit(2)
    return args
