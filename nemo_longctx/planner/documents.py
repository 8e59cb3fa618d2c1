"""Document-aware context parallelism: which documents of a packed batch stay whole on one CP rank and which are
split over the CP group, and where the kept ones go (plain Python: lengths in, a placement out).

Under CP every document of a packed batch is, by default, zigzag-split over all P ranks (rank r holds chunks r and
2P-1-r of each document, each padded to a multiple of 2P): exact, but a short document then costs a ring pass (or an
all-to-all) of tiny blocks whose communication and per-call overhead dwarf its compute. With a threshold
(``cp.split_min_tokens``) documents shorter than it stay whole on one rank -- no communication for them -- and only
the long ones are split.

The layout (``place_documents``), the same arithmetic on every rank (the result depends on the lengths only):

- Every rank keeps the local length of the per-document zigzag layout, ``local_len = sum(pad(L_i, 2P)) / P``, so
  the model's shapes do not change with the placement.
- Split documents are laid out as before (per-document zigzag over the P ranks, padded to 2P): ``split_local``
  tokens on every rank, the first part of each rank's shard, in packed order.
- The rest of a rank's shard (capacity ``C = local_len - split_local``) holds its kept documents in two halves of
  ``half`` tokens each (half A, half B; each half's documents in packed order, the shorter half padded), then
  padding. The two halves exist for Megatron's RoPE: it applies rotary positions to a packed shard per document with
  the zigzag formula (``rope_layout``: the kept region is declared as one document of padded length 2P*half, whose
  two halves get contiguous position ranges), so every kept document sees contiguous positions shifted by a constant
  -- attention with rotary embeddings depends only on the distance between tokens, so it is unchanged. A kept
  document therefore needs ``2 * max(A, B) <= C`` on its rank.
- Kept documents are assigned largest cost first to the least-loaded rank (attention cost: quadratic in length,
  ``AttentionCostModel``) among those with room, each to the smaller half; a document that fits nowhere is split
  instead and the assignment starts over (splitting every document -- the default layout -- always fits).

``balance`` = max / mean of the ranks' predicted attention costs (1.0 = perfect). ``choose_split_min_tokens``
picks the threshold with the lowest predicted step time for a batch (``cp.split_min_tokens=auto``), and
``predict_gain`` compares the layouts of a set of batches (the planner's prediction for ``bench/documents_cp.py``).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Iterable, List, Optional, Sequence, Tuple


@dataclass(frozen=True)
class AttentionCostModel:
    """Relative time of one rank's attention (forward + backward), in units of one (query, key) pair.

    ``call``: one kernel call (a dense sub-block of one document), as many pairs' worth of time; ``send``: one K/V
    token a split document moves to another rank (per ring step or all-to-all), in pairs' worth. The default (pairs
    only) balances the quadratic work; ``bench/documents_cp.py`` measures the CPU's figures, the planner derives a
    GPU's from the model's head dims."""

    pair: float = 1.0
    call: float = 0.0
    send: float = 0.0


def pairs(n: int, causal: bool = True) -> int:
    """(query, key) pairs of one document of ``n`` tokens attending to itself."""
    return n * (n + 1) // 2 if causal else n * n


def zigzag_padded(n: int, cp_size: int) -> int:
    """A document's padded length in the per-document zigzag layout (a multiple of 2*cp; at cp = 1: n)."""
    m = 2 * cp_size if cp_size > 1 else 1
    return -(-n // m) * m


def split_work(n: int, padded: int, cp_size: int, rank: int, causal: bool = True) -> Tuple[int, int]:
    """(pairs, kernel calls) rank ``rank`` computes for one document of ``n`` real tokens zigzag-split over
    ``cp_size`` ranks (chunks ``rank`` and ``2P-1-rank`` of its queries against every chunk of its keys; empty
    blocks skipped: the ring's per-document blocks, ``attention.thd.ThdLayout.blocks``)."""
    P = cp_size
    c = padded // (2 * P)
    real = [min(max(n - a * c, 0), c) for a in range(2 * P)]
    work = calls = 0
    for a in (rank, 2 * P - 1 - rank):
        nq = real[a]
        if not nq:
            continue
        for b in range(2 * P):
            nk = real[b]
            if not nk or (causal and b > a):
                continue
            work += nq * (nq + 1) // 2 if (causal and a == b) else nq * nk
            calls += 1
    return work, calls


@dataclass(frozen=True)
class DocumentPlacement:
    """Where every document of one packed micro-batch lives under CP (see the module docstring).

    ``owner[i]``: the rank keeping document i whole, or -1 (split over the CP group). ``halves[r]``: rank r's kept
    documents as (half A, half B), each in packed order; ``half[r]``: the size of each half (0: none kept).
    ``costs[r]``: rank r's predicted attention cost (``AttentionCostModel``)."""

    cp_size: int
    lengths: Tuple[int, ...]
    owner: Tuple[int, ...]
    halves: Tuple[Tuple[Tuple[int, ...], Tuple[int, ...]], ...]
    half: Tuple[int, ...]
    local_len: int
    costs: Tuple[float, ...]
    split_min_tokens: Optional[int] = None

    @property
    def split(self) -> Tuple[int, ...]:
        return tuple(i for i, o in enumerate(self.owner) if o < 0)

    @property
    def kept(self) -> Tuple[int, ...]:
        return tuple(i for i, o in enumerate(self.owner) if o >= 0)

    @property
    def split_padded(self) -> Tuple[int, ...]:
        return tuple(zigzag_padded(self.lengths[i], self.cp_size) for i in self.split)

    @property
    def split_local(self) -> int:
        """Tokens of the split documents on every rank (the first part of each rank's shard)."""
        return sum(self.split_padded) // self.cp_size

    @property
    def balance(self) -> float:
        """max / mean of the ranks' predicted attention costs (1.0: perfectly balanced; 1.0 when there is none)."""
        mean = sum(self.costs) / len(self.costs)
        return max(self.costs) / mean if mean > 0 else 1.0

    def split_layout(self) -> Tuple[List[int], List[int]]:
        """(cu_seqlens, cu_seqlens_padded) of the split documents (global, the same on every rank): the packed
        sequence the CP algorithm runs over, its local part the first ``split_local`` tokens of every shard."""
        cu, cup = [0], [0]
        for i, p in zip(self.split, self.split_padded):
            cu.append(cu[-1] + self.lengths[i])
            cup.append(cup[-1] + p)
        return cu, cup

    def kept_layout(self, rank: int) -> Tuple[List[int], List[int]]:
        """(cu_seqlens, cu_seqlens_padded) of rank ``rank``'s kept region (local positions ``split_local`` to
        ``local_len``, attended locally): each kept document one entry, the padding of a half and the remainder
        entries of 0 real tokens."""
        real, padded = [], []
        s = self.half[rank]
        for docs in self.halves[rank]:
            used = 0
            for i in docs:
                real.append(self.lengths[i])
                padded.append(self.lengths[i])
                used += self.lengths[i]
            if s > used:
                real.append(0)
                padded.append(s - used)
        rest = self.local_len - self.split_local - 2 * s
        if rest > 0:
            real.append(0)
            padded.append(rest)
        cu, cup = [0], [0]
        for n, p in zip(real, padded):
            cu.append(cu[-1] + n)
            cup.append(cup[-1] + p)
        return cu, cup

    def rope_layout(self, rank: int) -> List[int]:
        """``cu_seqlens_padded`` to give Megatron's RoPE on rank ``rank`` (its per-document zigzag slicing of the
        rotary frequencies, ``rope_utils._get_thd_freqs_on_this_cp_rank``): the split documents as they are, the
        kept region as one document of padded length 2P*half (its halves get positions [r*half, (r+1)*half) and
        [(2P-1-r)*half, (2P-r)*half): contiguous within each kept document), the remaining padding as one more."""
        P = self.cp_size
        out = [0]
        for p in self.split_padded:
            out.append(out[-1] + p)
        s = self.half[rank]
        if s:
            out.append(out[-1] + 2 * P * s)
        rest = self.local_len - self.split_local - 2 * s
        if rest:
            out.append(out[-1] + P * rest)
        return out

    def token_sources(self, rank: int) -> Tuple[List[int], List[int]]:
        """(document, offset) of every position of rank ``rank``'s shard (``local_len`` each); padding is document
        -1 (offset: the position within the padded document for a split document's padding, else 0)."""
        P = self.cp_size
        docs: List[int] = []
        offs: List[int] = []
        for i, p in zip(self.split, self.split_padded):
            c = p // (2 * P)
            n = self.lengths[i]
            for a in (rank, 2 * P - 1 - rank):
                for o in range(a * c, (a + 1) * c):
                    docs.append(i if o < n else -1)
                    offs.append(o)
        s = self.half[rank]
        for half_docs in self.halves[rank]:
            used = 0
            for i in half_docs:
                docs += [i] * self.lengths[i]
                offs += range(self.lengths[i])
                used += self.lengths[i]
            docs += [-1] * (s - used)
            offs += [0] * (s - used)
        rest = self.local_len - len(docs)
        docs += [-1] * rest
        offs += [0] * rest
        return docs, offs

    def describe(self) -> str:
        kept = self.kept
        return (f"{len(self.lengths)} documents over {self.cp_size} CP ranks: {len(self.split)} split, {len(kept)} "
                f"kept ({sum(self.lengths[i] for i in kept)} tokens); balance {self.balance:.3f}")


def check_split_min_tokens(value, name: str = "cp.split_min_tokens") -> None:
    if value is None or value == "auto":
        return
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise ValueError(f"{name}={value!r} must be a positive int, 'auto' or null")


def _check_lengths(lengths: Sequence[int], cp_size: int) -> List[int]:
    if isinstance(cp_size, bool) or not isinstance(cp_size, int) or cp_size < 1:
        raise ValueError(f"document placement: cp size must be a positive int, got {cp_size!r}")
    out = list(lengths)
    for i, n in enumerate(out):
        if isinstance(n, bool) or not isinstance(n, int) or n < 0:
            raise ValueError(f"document placement: document {i} has length {n!r}: lengths must be ints >= 0")
    return out


def place_documents(lengths: Sequence[int], cp_size: int, split_min_tokens: Optional[int],
                    cost: AttentionCostModel = AttentionCostModel(), causal: bool = True) -> DocumentPlacement:
    """The placement of documents of real ``lengths`` (packed order) over ``cp_size`` ranks: documents of at least
    ``split_min_tokens`` tokens (every document when None) are split, the others kept whole where they fit (module
    docstring). Deterministic: every rank computes the same placement from the same lengths."""
    check_split_min_tokens(split_min_tokens)
    if split_min_tokens == "auto":
        raise ValueError("place_documents: resolve split_min_tokens='auto' first (choose_split_min_tokens)")
    lengths = _check_lengths(lengths, cp_size)
    P = cp_size
    padded = [zigzag_padded(n, P) for n in lengths]
    local_len = sum(padded) // P
    split = {i for i, n in enumerate(lengths)
             if P == 1 or split_min_tokens is None or n >= split_min_tokens or n == 0}
    while True:
        split_local = sum(padded[i] for i in split) // P
        cap = local_len - split_local
        loads = [0.0] * P
        for i in split:
            for r in range(P):
                work, calls = split_work(lengths[i], padded[i], P, r, causal)
                loads[r] += cost.pair * work + cost.call * calls + cost.send * (P - 1) * padded[i] / P
        kept = sorted((i for i in range(len(lengths)) if i not in split),
                      key=lambda i: (-lengths[i], i))
        A, B = [0] * P, [0] * P
        members: List[Tuple[List[int], List[int]]] = [([], []) for _ in range(P)]
        failed = None
        for i in kept:
            n = lengths[i]
            for r in sorted(range(P), key=lambda r: (loads[r], r)):
                to_a = A[r] <= B[r]
                if 2 * max(A[r] + n if to_a else A[r], B[r] if to_a else B[r] + n) <= cap:
                    if to_a:
                        A[r] += n
                        members[r][0].append(i)
                    else:
                        B[r] += n
                        members[r][1].append(i)
                    loads[r] += cost.pair * pairs(n, causal) + cost.call
                    break
            else:
                failed = i
                break
        if failed is None:
            break
        split.add(failed)  # fits nowhere: split it (always feasible: with every document split the layout is today's)
    owner = [-1] * len(lengths)
    halves = []
    for r in range(P):
        a, b = sorted(members[r][0]), sorted(members[r][1])
        if sum(lengths[i] for i in b) > sum(lengths[i] for i in a):
            a, b = b, a  # half A is the longer one (the shorter half is padded)
        for i in a + b:
            owner[i] = r
        halves.append((tuple(a), tuple(b)))
    half = tuple(max(A[r], B[r]) for r in range(P))
    return DocumentPlacement(cp_size=P, lengths=tuple(lengths), owner=tuple(owner), halves=tuple(halves), half=half,
                             local_len=local_len, costs=tuple(loads), split_min_tokens=split_min_tokens)


def predicted_time(placement: DocumentPlacement) -> float:
    """The step's predicted attention time: the slowest rank's cost (ranks wait for each other)."""
    return max(placement.costs)


def threshold_candidates(lengths: Sequence[int], most: int = 16) -> List[Optional[int]]:
    """Thresholds worth trying for a batch: None (split all) and, for up to ``most`` distinct lengths spread over
    the batch's range, the threshold that keeps every document up to that length."""
    distinct = sorted({n for n in lengths if n > 0})
    if len(distinct) > most:
        distinct = [distinct[round(k * (len(distinct) - 1) / (most - 1))] for k in range(most)]
    return [None] + [n + 1 for n in distinct]


def choose_split_min_tokens(lengths: Sequence[int], cp_size: int, cost: AttentionCostModel,
                            causal: bool = True) -> DocumentPlacement:
    """``cp.split_min_tokens=auto`` for one batch: the placement with the lowest predicted time over the candidate
    thresholds (``threshold_candidates``); ties go to the larger threshold (fewer documents split)."""
    best = None
    for t in threshold_candidates(lengths):
        p = place_documents(lengths, cp_size, t, cost, causal)
        key = (predicted_time(p), -(t or 0))
        if best is None or key < best[0]:
            best = (key, p)
    return best[1]


def resolve_placement(lengths: Sequence[int], cp_size: int, split_min_tokens, cost: AttentionCostModel,
                      causal: bool = True) -> DocumentPlacement:
    """The placement for ``cp.split_min_tokens`` as configured: an int, ``"auto"`` or None (every document split)."""
    check_split_min_tokens(split_min_tokens)
    if split_min_tokens == "auto":
        return choose_split_min_tokens(lengths, cp_size, cost, causal)
    return place_documents(lengths, cp_size, split_min_tokens, cost, causal)


@dataclass(frozen=True)
class GainPrediction:
    """The cost model's step times of a set of batches (sum over the batches of the slowest rank), relative to
    the per-document zigzag layout: ``documents`` (the document-aware placement), ``perfect`` (its mean rank
    cost: the bound of perfect balance), and the mean balance of each."""

    zigzag_time: float
    documents_time: float
    perfect_time: float
    zigzag_balance: float
    documents_balance: float

    @property
    def speedup(self) -> float:
        return self.zigzag_time / self.documents_time if self.documents_time else 1.0

    @property
    def perfect_speedup(self) -> float:
        return self.zigzag_time / self.perfect_time if self.perfect_time else 1.0


def predict_gain(batches: Iterable[Sequence[int]], cp_size: int, split_min_tokens, cost: AttentionCostModel,
                 causal: bool = True) -> GainPrediction:
    """Predicted attention time of ``batches`` (each a list of document lengths) under (a) the per-document zigzag
    layout, (b) the document-aware placement with ``split_min_tokens`` (int or "auto"), (c) (b)'s mean rank cost."""
    za = zb = zc = 0.0
    bal_a: List[float] = []
    bal_b: List[float] = []
    for lengths in batches:
        a = place_documents(lengths, cp_size, None, cost, causal)
        b = resolve_placement(lengths, cp_size, split_min_tokens, cost, causal)
        za += predicted_time(a)
        zb += predicted_time(b)
        zc += sum(b.costs) / len(b.costs)
        bal_a.append(a.balance)
        bal_b.append(b.balance)
    n = max(1, len(bal_a))
    return GainPrediction(za, zb, zc, sum(bal_a) / n, sum(bal_b) / n)
