"""Table of context-parallel attention algorithms the Megatron core-attention module can dispatch to.

An entry maps a name (the ``cp_algorithm`` ModuleSpec param, the ``cp.algorithm`` config key) to:
  attention(q, k, v, *, group, causal, softmax_scale, **kwargs) -> out
      q [b, s_local, hq, d], k/v [b, s_local, hkv, d], sequence zigzag-sharded over ``group`` (None at cp=1);
      returns [b, s_local, hq, d]. ``kwargs`` are the algorithm's own ModuleSpec params (``cp_algorithm_kwargs``)
      plus, per call, ``cu_seqlens``/``cu_seqlens_padded`` (packed THD sequences, b = 1) and ``window_size``
      (sliding window, flash-attn convention) when the layer has them.
  validate(config, cp_size, tp=1, keys=None, **kwargs) -> None
      the checks that need the model config (head counts); raises ValueError naming the config field (``cp.*``,
      ``model.*``; ``keys``: the front end's dialect, an ``options.Context``, or None); called once, by
      ``validation.long_context_problems``, when the run is built. ``tp`` = tensor-parallel size (heads are per TP
      rank), ``kwargs`` = the algorithm's options as configured. The checks
      that need no model (types, divisors, known options) are ``nemo_longctx.options.CPOptions.problems``.
  setup(group, **kwargs) -> kwargs       optional; run once per core-attention module at construction, on every CP
      rank in the same layer order (collective setup such as sub-groups goes here, never in forward); returns
      the kwargs the attention function is then called with.
  cp_comm_types                          values of Megatron's ``config.cp_comm_type`` this algorithm accepts
  takes_sinks                            whether ``attention`` takes attention sinks (``sinks=`` [hq] logits or None,
                                         ``softmax_type=`` "off-by-one" | "learnable"; ``attention.sinks``), passed
                                         only for a model with ``softmax_type`` other than "vanilla"; a model with
                                         sinks under an algorithm without them is refused by name (never run without)

Algorithms: ``ring`` (zigzag P2P ring), ``ulysses`` (all-to-all over the whole CP group, ``head_chunks``),
``hybrid`` (Ulysses over ``ulysses_size`` consecutive CP ranks x ring across them, ``head_chunks``).
To add one: ``register_cp_algorithm(CPAlgorithm(name=..., attention=...))`` in this module (or from the module
that implements it, imported here), its name and options in ``nemo_longctx.options`` (``CP_ALGORITHMS``,
``CP_ALGORITHM_KEYS``, ``CP_ALGORITHM_KWARGS``) and a ``conf/cp/<name>.yaml``.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Callable, Dict, FrozenSet, Optional

from nemo_longctx.attention import (
    hybrid_attention, make_cp_groups, plan_ulysses_heads, ring_attention, ulysses_attention)
from nemo_longctx.options import CPOptions, raise_problems

AttentionFn = Callable[..., Any]
ValidateFn = Callable[..., None]
SetupFn = Callable[..., Dict[str, Any]]


@dataclass(frozen=True)
class CPAlgorithm:
    name: str
    attention: AttentionFn
    validate: Optional[ValidateFn] = None
    setup: Optional[SetupFn] = None
    cp_comm_types: FrozenSet[Optional[str]] = field(default_factory=lambda: frozenset({None, "p2p"}))
    takes_sinks: bool = False


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


def canonical_cp_comm_type(algorithm: str) -> Optional[str]:
    """Megatron/TE's name for ``algorithm``'s communication scheme (``ring`` -> ``"p2p"``, ``ulysses`` -> ``"a2a"``,
    ``hybrid`` -> ``"a2a+p2p"``): the value a model config's ``cp_comm_type`` is set to for it."""
    names = sorted(t for t in get_cp_algorithm(algorithm).cp_comm_types if t is not None)
    return names[0] if len(names) == 1 else None


def class_default(config: Any, name: str) -> Any:
    """The default of dataclass field ``name`` in ``type(config)`` (what the model config class itself sets);
    a sentinel object when the class has no such field or default."""
    import dataclasses

    missing = object()
    if dataclasses.is_dataclass(config):
        for f in dataclasses.fields(config):
            if f.name == name:
                if f.default is not dataclasses.MISSING:
                    return f.default
                if f.default_factory is not dataclasses.MISSING:
                    return f.default_factory()
    return missing


def align_cp_comm_type(config: Any, algorithm: str, explicit: Optional[bool] = None) -> Optional[str]:
    """Make ``config.cp_comm_type`` agree with ``cp.algorithm``. NVIDIA's model configs carry a TransformerEngine
    hint (``MistralConfig7B``: ``"a2a"``); the CP algorithm is the user's choice (``cp.algorithm``), so a value the
    user did not set (``explicit`` False: a class default, a checkpoint's config) is replaced by the algorithm's name
    and a message saying so is returned (None when nothing changed). A value the user set that contradicts
    ``cp.algorithm`` (or a per-layer list, which our core attention cannot honour) raises ValueError naming both
    keys. ``explicit`` None: the user set it when it differs from the config class's own default. The caller assigns
    nothing: ``config.cp_comm_type`` is set here (front ends that record the config for a checkpoint record the new
    value themselves)."""
    algo = get_cp_algorithm(algorithm)
    current = getattr(config, "cp_comm_type", None)
    if not isinstance(current, list) and current in algo.cp_comm_types:
        return None
    if explicit is None:
        explicit = current != class_default(config, "cp_comm_type")
    if explicit:
        raise ValueError(
            f"model.cp_comm_type={current!r} contradicts cp.algorithm={algorithm!r} (which is "
            f"{sorted(map(str, algo.cp_comm_types))}): the CP algorithm is chosen by cp.algorithm; drop the "
            "model.cp_comm_type override or choose the matching cp.algorithm")
    new = canonical_cp_comm_type(algorithm)
    config.cp_comm_type = new
    return (f"model.cp_comm_type: {current!r} from {type(config).__name__} replaced by {new!r} for "
            f"cp.algorithm={algorithm} (a TransformerEngine hint of the model config; nemo_longctx's {algorithm} "
            "attention runs the context parallelism)")


def check_cp_options(cp_algorithm: str, cp_size: Any, kwargs: Dict[str, Any]) -> None:
    """Config-level checks of the ``cp`` options given as (algorithm, size, the attention function's kwargs):
    ``ConfigError`` naming the keys (``nemo_longctx.options.CPOptions.problems``)."""
    kw = dict(kwargs)
    given = {"size": cp_size, "algorithm": cp_algorithm}
    for k in ("ulysses_size", "head_chunks"):
        if k in kw:
            given[k] = kw.pop(k)
    raise_problems(CPOptions.from_dict({**given, "kwargs": kw}).problems())


# A model config whose CP options were checked against it (``validation.long_context_problems``, when a run is
# built) carries the checked (cp size, algorithm, options): the core attention of each layer then does not check
# them again; built without that (a spec used directly), the first layer checks them once for all.
_CHECKED_ATTR = "_nemo_longctx_cp_checked"


def _check_key(cp_size: int, algorithm: str, kwargs: Dict[str, Any]) -> tuple:
    return int(cp_size), str(algorithm), repr(sorted(kwargs.items()))


def mark_checked(config: Any, cp_size: int, algorithm: str, kwargs: Dict[str, Any]) -> None:
    checked = set(getattr(config, _CHECKED_ATTR, None) or ())
    checked.add(_check_key(cp_size, algorithm, kwargs))
    object.__setattr__(config, _CHECKED_ATTR, checked)


def is_checked(config: Any, cp_size: int, algorithm: str, kwargs: Dict[str, Any]) -> bool:
    return _check_key(cp_size, algorithm, kwargs) in (getattr(config, _CHECKED_ATTR, None) or ())


def _ring(q, k, v, *, group, causal, softmax_scale, kernel: Optional[str] = None, cu_seqlens=None,
          cu_seqlens_padded=None, window_size=None, sinks=None, softmax_type=None, **unused):
    if unused:
        raise ValueError(f"cp.algorithm='ring' got unknown options {sorted(unused)}")
    return ring_attention(q, k, v, group, causal, softmax_scale, kernel=kernel, cu_seqlens=cu_seqlens,
                          cu_seqlens_padded=cu_seqlens_padded, window_size=window_size, sinks=sinks,
                          softmax_type=softmax_type)


register_cp_algorithm(CPAlgorithm(name="ring", attention=_ring, takes_sinks=True))


# ------------------------------------------------------------------------------------------------ ulysses / hybrid
def _check_heads(name: str, config: Any, tp: int, ulysses_size: int, size_field: str, head_chunks: Any,
                 keys: Any = None) -> None:
    """Head counts per TP rank vs the Ulysses degree (error names ``size_field``) and ``cp.head_chunks``, the keys in
    the dialect of ``keys`` (an ``options.Context``; None: as the config spells them)."""
    kn = keys.key if keys is not None else str
    hq, hkv = config.num_attention_heads, config.num_query_groups or config.num_attention_heads
    if hq % tp or hkv % tp:
        return  # reported by validation.long_context_problems (heads vs tensor_model_parallel_size)
    where = (f"model.num_attention_heads={hq}, model.num_query_groups={hkv}"
             + (f" / tensor_model_parallel_size={tp}" if tp > 1 else ""))
    try:
        plan_ulysses_heads(hq // tp, hkv // tp, ulysses_size, 1, fn=f"cp={name}")
    except ValueError as e:
        raise ValueError(f"{kn(size_field)}={ulysses_size}: {e} ({where})") from None
    try:
        plan_ulysses_heads(hq // tp, hkv // tp, ulysses_size, head_chunks, fn=f"cp={name}")
    except ValueError as e:
        raise ValueError(f"{kn('cp.head_chunks')}={head_chunks!r}: {e} ({where}, ulysses_size={ulysses_size})"
                         ) from None


def _validate_ulysses(config: Any, cp_size: int, tp: int = 1, head_chunks: Any = 1, keys: Any = None,
                      **kwargs: Any) -> None:
    _check_heads("ulysses", config, tp, cp_size, "cp.size", head_chunks, keys)


def _ulysses(q, k, v, *, group, causal, softmax_scale, head_chunks: int = 1, **options):
    return ulysses_attention(q, k, v, group, causal, softmax_scale, head_chunks, **options)


def _validate_hybrid(config: Any, cp_size: int, tp: int = 1, ulysses_size: Any = None, head_chunks: Any = 1,
                     keys: Any = None, **kwargs: Any) -> None:
    _check_heads("hybrid", config, tp, ulysses_size, "cp.ulysses_size", head_chunks, keys)


def _setup_hybrid(group, ulysses_size: int, **options: Any) -> Dict[str, Any]:
    """Replace ``ulysses_size`` by this rank's (ulysses_group, ring_group); ``make_cp_groups`` caches them per CP
    group, so every layer after the first reuses the same groups (no collective after the first call)."""
    if group is None:  # CP size 1 (cp.ulysses_size divides it: checked with the options)
        return {"ulysses_group": None, "ring_group": None, **options}
    ulysses_group, ring_group = make_cp_groups(group, ulysses_size)
    return {"ulysses_group": ulysses_group, "ring_group": ring_group, **options}


def _hybrid(q, k, v, *, group, causal, softmax_scale, ulysses_group, ring_group, head_chunks: int = 1, **options):
    return hybrid_attention(q, k, v, ulysses_group, ring_group, causal, softmax_scale, head_chunks, **options)


# cp_comm_type: Megatron/TE's names for the same schemes ("a2a" = Ulysses, "a2a+p2p" = hierarchical) are accepted
register_cp_algorithm(CPAlgorithm(name="ulysses", attention=_ulysses, validate=_validate_ulysses,
                                  cp_comm_types=frozenset({None, "a2a"}), takes_sinks=True))
register_cp_algorithm(CPAlgorithm(name="hybrid", attention=_hybrid, validate=_validate_hybrid,
                                  setup=_setup_hybrid,
                                  cp_comm_types=frozenset({None, "a2a+p2p"}), takes_sinks=True))
