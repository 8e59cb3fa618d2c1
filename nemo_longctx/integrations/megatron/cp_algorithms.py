"""Table of context-parallel attention algorithms the Megatron core-attention module can dispatch to.

An entry maps a name (the ``cp_algorithm`` ModuleSpec param, the ``cp.algorithm`` config key) to:
  attention(q, k, v, *, group, causal, softmax_scale, **kwargs) -> out
      q [b, s_local, hq, d], k/v [b, s_local, hkv, d], sequence zigzag-sharded over ``group`` (None at cp=1);
      returns [b, s_local, hq, d]. ``kwargs`` are the algorithm's own ModuleSpec params (``cp_algorithm_kwargs``).
  validate(config, cp_size) -> None     raises ValueError naming the config field (called at build time)
  cp_comm_types                          values of Megatron's ``config.cp_comm_type`` this algorithm accepts

To add an algorithm (e.g. "ulysses", "hybrid"): ``register_cp_algorithm(CPAlgorithm(name=..., attention=...))``
in this module (or from the module that implements it, imported here).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Callable, Dict, FrozenSet, Optional

from nemo_longctx.attention import ring_attention

AttentionFn = Callable[..., Any]
ValidateFn = Callable[[Any, int], None]


@dataclass(frozen=True)
class CPAlgorithm:
    name: str
    attention: AttentionFn
    validate: Optional[ValidateFn] = None
    cp_comm_types: FrozenSet[Optional[str]] = field(default_factory=lambda: frozenset({None, "p2p"}))


CP_ALGORITHMS: Dict[str, CPAlgorithm] = {}


def register_cp_algorithm(algo: CPAlgorithm) -> CPAlgorithm:
    CP_ALGORITHMS[algo.name] = algo
    return algo


def get_cp_algorithm(name: str) -> CPAlgorithm:
    try:
        return CP_ALGORITHMS[name]
    except KeyError:
        raise ValueError(
            f"cp.algorithm={name!r} is not a known context-parallel algorithm; choose one of {sorted(CP_ALGORITHMS)}"
        ) from None


def _ring(q, k, v, *, group, causal, softmax_scale, kernel: Optional[str] = None, **unused):
    if unused:
        raise ValueError(f"cp.algorithm='ring' got unknown options {sorted(unused)}")
    return ring_attention(q, k, v, group, causal, softmax_scale, kernel=kernel)


register_cp_algorithm(CPAlgorithm(name="ring", attention=_ring))
