"""Checks that cost nothing and catch silently wrong training at step 0 and at every logged step.

Each returns a message naming the likely cause (None: all is well); the front ends raise ``GuardTripped`` with it,
which stops the run:

- ``cp_problems``: context parallelism is really active. Every nemo_longctx core attention of the model was built
  over the run's CP group (``cp_size``), this rank's attention saw ``seq_len / cp`` key tokens per call (times the CP
  size: the whole sequence the data step sharded), and with CP > 1 the step sent bytes to the other CP ranks
  (``attention.count_bytes_sent``) -- unless document-aware placement kept every document of the step whole. The
  failure this catches: a layout that shards the sequence over ranks whose
  attention never sees the other ranks' keys -- every loss finite, every rank training on its own slice.
- ``tokens_problems``: the tokens a step trained (this rank's share of each micro-batch, times the data- and
  context-parallel ranks and the micro-batches) equal what the layout says (global batch x sequence length).
- ``loss_problems``: the loss is finite.
- ``mfu_problems``: the measured model FLOPs utilisation is at most 100 % of the device's peak; a higher figure means
  the step did less work than the model's FLOPs formula counts (CP inactive, tokens over-counted, a wrong peak).
"""

from __future__ import annotations

import math
from typing import Any, Iterable, List, Optional


class GuardTripped(RuntimeError):
    """A run guard found the run training wrong; the message names the check and the likely cause."""


class StepBytes:
    """The bytes this process's CP attention sends during one step (``attention.count_bytes_sent``), for a front
    end's step-start / step-end hooks: ``start()``, then ``stop()`` returns the count (None if not started)."""

    def __init__(self) -> None:
        self._counter: Any = None
        self._sent: Any = None

    def start(self) -> None:
        from nemo_longctx.attention import count_bytes_sent

        self._counter = count_bytes_sent()
        self._sent = self._counter.__enter__()

    def stop(self) -> Optional[int]:
        if self._counter is None:
            return None
        self._counter.__exit__(None, None, None)
        self._counter = None
        return int(self._sent.bytes_sent)


def core_attentions(model: Any) -> List[Any]:
    """Every nemo_longctx core attention inside ``model`` (a module or a list of model chunks)."""
    from .core_attention import LongContextCoreAttention

    roots: Iterable[Any] = model if isinstance(model, (list, tuple)) else [model]
    return [m for root in roots for m in root.modules() if isinstance(m, LongContextCoreAttention)]


def cp_problems(attentions: List[Any], cp_size: int, sequence_tokens: Optional[int], bytes_sent: Optional[int],
                step: int, expect_traffic: bool = True) -> List[str]:
    """Problems of the CP layout as the last step ran it (see the module docstring). ``expect_traffic`` False: no
    micro-batch of the step split a document over the CP group (document-aware placement kept every document
    whole), so no bytes are expected."""
    p: List[str] = []
    for m in attentions:
        if m.cp_size != cp_size:
            p.append(f"run guard (step {step}): layer {m.layer_number}'s attention runs over {m.cp_size} CP rank(s) "
                     f"but the run's CP size is {cp_size}: the sequence is sharded over ranks whose attention does "
                     "not see each other's keys")
            break
    seen = [(m.layer_number, m.last_key_tokens * m.cp_size) for m in attentions if m.last_key_tokens is not None]
    if sequence_tokens is not None:
        wrong = [(layer, n) for layer, n in seen if n != sequence_tokens]
        if wrong:
            layer, n = wrong[0]
            p.append(f"run guard (step {step}): layer {layer}'s attention covered {n} key tokens per sequence over "
                     f"its CP group, the data step's sequence has {sequence_tokens}: the attention does not see the "
                     "whole sequence")
    if cp_size > 1 and seen and expect_traffic and bytes_sent is not None and bytes_sent <= 0:
        p.append(f"run guard (step {step}): CP size {cp_size} but the attention sent no bytes to the other CP ranks "
                 "in this step: context parallelism is not active")
    return p


def tokens_problems(local_tokens: Optional[int], micro_batches: int, dp_cp_ranks: int, expected: int,
                    step: int) -> List[str]:
    """The step's trained tokens against the layout's promise (``local_tokens``: this rank's share of one
    micro-batch's sequence; None where this rank saw no tokens)."""
    if local_tokens is None:
        return []
    trained = int(local_tokens) * int(micro_batches) * int(dp_cp_ranks)
    if trained != int(expected):
        return [f"run guard (step {step}): the step trained {trained:,} tokens ({local_tokens} per rank x "
                f"{micro_batches} micro-batch(es) x {dp_cp_ranks} data/context-parallel ranks) but the layout says "
                f"{int(expected):,} (global batch x sequence length): the data and the layout disagree"]
    return []


def loss_problems(loss: float, step: int) -> List[str]:
    if not math.isfinite(loss):
        return [f"run guard (step {step}): the loss is {loss}: training diverged or a step produced NaN/inf "
                "(lower the learning rate, check the data; bf16 overflow shows here first)"]
    return []


def mfu_problems(mfu: Optional[float], step: int) -> List[str]:
    if mfu is not None and mfu > 1.0:
        return [f"run guard (step {step}): measured model FLOPs utilisation {100 * mfu:.0f}% exceeds the device's "
                "peak: the step did less work than the model's FLOPs formula counts (context parallelism not active, "
                "so each rank attended only its own slice; tokens per step over-counted; or a wrong peak for this "
                "device)"]
    return []


def raise_if(problems: List[str]) -> None:
    if problems:
        raise GuardTripped("\n".join(problems))
