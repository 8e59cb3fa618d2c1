"""A patch ledger: every rebinding of a third-party name one framework's integration makes, declared in one table.

Each front end keeps one ledger (``integrations/megatron/patches.py`` for Megatron-core and torch,
``integrations/nemo/patches.py`` for NeMo 2, ``integrations/bridge/patches.py`` for Megatron-Bridge); a row names its
target, where it applies (``"cpu-only"``: only in a process without CUDA; ``"all devices"``), the versions it is
written for, why it exists, and the function that makes it (``"module:function"``, imported only when applied, so a
ledger can be read -- ``nemo-longctx --versions``, the self-test -- without importing the framework).

``ledger.apply()`` is called once at an app's entry: it applies the ledgers this one builds on first (NeMo's and
Bridge's build on Megatron-core's), then every row whose devices match this process, in table order, each at most
once per process. Nothing else in the package rebinds a third-party name (``tests/test_layering.py``).
"""

from __future__ import annotations

import importlib
from dataclasses import dataclass
from typing import List, Optional, Sequence, Set, Tuple

CPU_ONLY = "cpu-only"
ALL_DEVICES = "all devices"
DEVICES = (CPU_ONLY, ALL_DEVICES)


@dataclass(frozen=True)
class Patch:
    """One ledger row."""

    key: str  # short name, unique in its ledger (the compat modules' fix numbers)
    target: str  # the third-party name(s) rebound
    devices: str  # CPU_ONLY or ALL_DEVICES
    versions: str  # the versions the row is written for
    why: str  # one sentence: what goes wrong without it
    function: str  # "package.module:function" that makes the rebinding (idempotent)

    def __post_init__(self) -> None:
        if self.devices not in DEVICES:
            raise ValueError(f"patch {self.key}: devices must be one of {DEVICES}, got {self.devices!r}")
        if ":" not in self.function:
            raise ValueError(f"patch {self.key}: function must be 'module:function', got {self.function!r}")

    def applies(self, cuda: bool) -> bool:
        """Whether this row is applied in a process that has (``cuda``) or has not a CUDA device."""
        return self.devices == ALL_DEVICES or not cuda

    def line(self) -> str:
        return f"{self.key:<4} {self.devices:<11} {self.target} [{self.versions}]: {self.why}"


def _cuda_available() -> bool:
    import torch

    return torch.cuda.is_available()


class PatchLedger:
    """One framework's rows (see the module docstring); ``requires``: the ledgers applied before this one."""

    def __init__(self, framework: str, rows: Sequence[Patch], requires: Sequence["PatchLedger"] = ()) -> None:
        keys = [r.key for r in rows]
        if len(set(keys)) != len(keys):
            raise ValueError(f"{framework} patch ledger: duplicate keys {sorted(k for k in keys if keys.count(k) > 1)}")
        self.framework = framework
        self.rows: Tuple[Patch, ...] = tuple(rows)
        self.requires: Tuple[PatchLedger, ...] = tuple(requires)
        self._applied: Set[str] = set()

    def row(self, key: str) -> Patch:
        for r in self.rows:
            if r.key == key:
                return r
        raise KeyError(f"{self.framework} patch ledger has no row {key!r}")

    def rows_for(self, cuda: bool) -> List[Patch]:
        """The rows a process with (``cuda=True``) or without a CUDA device applies, in table order."""
        return [r for r in self.rows if r.applies(cuda)]

    def applied(self) -> Tuple[str, ...]:
        """The keys applied in this process so far, in table order."""
        return tuple(r.key for r in self.rows if r.key in self._applied)

    def apply(self, force_cpu_rows: bool = False, cuda: Optional[bool] = None) -> Tuple[str, ...]:
        """Apply (once per process) the required ledgers, then the rows for this process's devices (every row with
        ``force_cpu_rows``). Returns the keys of this ledger applied by this call."""
        for other in self.requires:
            other.apply(force_cpu_rows=force_cpu_rows, cuda=cuda)
        has_cuda = _cuda_available() if cuda is None else cuda
        done = []
        for r in self.rows:
            if r.key in self._applied or not (force_cpu_rows or r.applies(has_cuda)):
                continue
            module, _, name = r.function.partition(":")
            getattr(importlib.import_module(module), name)()
            self._applied.add(r.key)
            done.append(r.key)
        return tuple(done)

    def lines(self) -> List[str]:
        """The ledger as text: a heading, then one line per row (``nemo-longctx --versions``, the self-test)."""
        return [f"{self.framework} patch ledger ({len(self.rows)} rows):"] + ["  " + r.line() for r in self.rows]
