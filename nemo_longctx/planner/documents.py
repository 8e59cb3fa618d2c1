"""Document-aware context parallelism: which documents of a packed batch stay whole on one CP rank and which are
split over the CP group, and where the kept ones go (plain Python: lengths in, a placement out).

Under CP every document of a packed batch is, by default, zigzag-split over all P ranks (rank r holds chunks r and
2P-1-r of each document, each padded to a multiple of 2P): exact, but a short document then costs a ring pass (or an
all-to-all) of tiny blocks whose communication and per-call overhead dwarf its compute. With a threshold
(``cp.split_min_tokens``) documents shorter than it stay whole on one rank -- no communication for them -- and only
the long ones are split.

The layout (``place_documents``), the same arithmetic on every rank (the result depends on the lengths only):

- Split documents are laid out as before (per-document zigzag over the P ranks, padded to 2P): ``split_local``
  tokens on every rank, the first part of each rank's shard, in packed order.
- The rest of a rank's shard holds its kept documents in two halves of ``half`` tokens each (half A, half B; each
  half's documents in packed order, the shorter half padded), then padding up to the longest rank's, so every rank
  has the same ``local_len = split_local + 2 * max(half)``. The two halves exist for Megatron's RoPE: it applies
  rotary positions to a packed shard per document with the zigzag formula (``rope_layout``: the kept region is
  declared as one document of padded length 2P*half, whose two halves get contiguous position ranges), so every kept
  document sees contiguous positions shifted by a constant -- attention with rotary embeddings depends only on the
  distance between tokens, so it is unchanged. On the last rank the two ranges are neighbours, so its kept documents
  lie back to back with no halves (``contiguous``).
- Kept documents are assigned longest first, each to the rank (and there to the shorter half) that minimizes the
  predicted step time: the slowest rank's attention cost (quadratic in length, ``AttentionCostModel``) plus the
  per-token cost of the local length (the rest of the model computes on every position, padding included); ties go
  to the least-loaded rank. Splitting every document (``split_min_tokens`` None) is the per-document zigzag layout.

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
    token a split document moves to another rank (per ring step or all-to-all), in pairs' worth; ``token``: one
    position of a rank's shard in the rest of the model (projections, MLP: the price of padding), in pairs' worth.
    The default (pairs only) balances the quadratic work; ``bench/documents_cp.py`` measures the CPU's figures,
    ``cost_model_for`` derives a model's from its shape."""

    pair: float = 1.0
    call: float = 0.0
    send: float = 0.0
    token: float = 0.0


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

    def _kept_segments(self, rank: int) -> List[Tuple[int, int]]:
        """Rank ``rank``'s kept region as (document or -1 for padding, tokens), in local order: half A's documents,
        padding to ``half``, half B's, padding to ``half`` -- on the last rank (whose two halves have contiguous
        rotary positions) its documents back to back, then padding to 2 * ``half`` -- then the remaining padding."""
        s = self.half[rank]
        out: List[Tuple[int, int]] = []
        halves = self.halves[rank]
        spans = [(halves[0] + halves[1], 2 * s)] if self.contiguous(rank) else [(halves[0], s), (halves[1], s)]
        for docs, size in spans:
            used = 0
            for i in docs:
                out.append((i, self.lengths[i]))
                used += self.lengths[i]
            if size > used:
                out.append((-1, size - used))
        rest = self.local_len - self.split_local - 2 * s
        if rest > 0:
            out.append((-1, rest))
        return out

    def contiguous(self, rank: int) -> bool:
        """Whether rank ``rank``'s kept region has contiguous rotary positions across its two halves (the last rank
        of the zigzag: chunks P-1 and P of the declared document are neighbours), so its documents need no halves."""
        return self.cp_size > 1 and rank == self.cp_size - 1

    def kept_layout(self, rank: int) -> Tuple[List[int], List[int]]:
        """(cu_seqlens, cu_seqlens_padded) of rank ``rank``'s kept region (local positions ``split_local`` to
        ``local_len``, attended locally): each kept document one entry, each padding an entry of 0 real tokens."""
        cu, cup = [0], [0]
        for i, n in self._kept_segments(rank):
            cu.append(cu[-1] + (n if i >= 0 else 0))
            cup.append(cup[-1] + n)
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
        for i, n in self._kept_segments(rank):
            docs += [i] * n
            offs += range(n) if i >= 0 else [0] * n
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


def _need(a: int, b: int, contiguous: bool) -> int:
    """Local positions a kept region of halves a, b takes (even): 2 x the longer half; back to back on the last
    rank."""
    return a + b + (a + b) % 2 if contiguous else 2 * max(a, b)


def place_documents(lengths: Sequence[int], cp_size: int, split_min_tokens: Optional[int],
                    cost: AttentionCostModel = AttentionCostModel(), causal: bool = True) -> DocumentPlacement:
    """The placement of documents of real ``lengths`` (packed order) over ``cp_size`` ranks: documents of at least
    ``split_min_tokens`` tokens (every document when None) are split, the others kept whole (module docstring).
    Deterministic: every rank computes the same placement from the same lengths."""
    check_split_min_tokens(split_min_tokens)
    if split_min_tokens == "auto":
        raise ValueError("place_documents: resolve split_min_tokens='auto' first (choose_split_min_tokens)")
    lengths = _check_lengths(lengths, cp_size)
    P = cp_size
    padded = [zigzag_padded(n, P) for n in lengths]
    split = [i for i, n in enumerate(lengths) if P == 1 or split_min_tokens is None or n >= split_min_tokens or n == 0]
    split_set = set(split)
    split_local = sum(padded[i] for i in split) // P
    loads = [0.0] * P
    for i in split:
        for r in range(P):
            work, calls = split_work(lengths[i], padded[i], P, r, causal)
            loads[r] += cost.pair * work + cost.call * calls + cost.send * (P - 1) * padded[i] / P
    kept = sorted((i for i in range(len(lengths)) if i not in split_set), key=lambda i: (-lengths[i], i))
    A, B = [0] * P, [0] * P
    members: List[Tuple[List[int], List[int]]] = [([], []) for _ in range(P)]
    def top_two(values: List[float]) -> Tuple[float, float, int]:
        """(largest, second largest, index of the largest) of ``values`` (P >= 2)."""
        k = max(range(len(values)), key=lambda x: (values[x], -x))
        return values[k], max(v for x, v in enumerate(values) if x != k), k

    for i in kept:
        n = lengths[i]
        add = cost.pair * pairs(n, causal) + cost.call
        load1, load2, load_k = top_two(loads)
        needs = [_need(A[x], B[x], x == P - 1) for x in range(P)]
        need1, need2, need_k = top_two(needs)
        best = None
        for r in range(P):
            if r == P - 1:  # contiguous halves (DocumentPlacement.contiguous): documents back to back
                need = A[r] + n + (A[r] + n) % 2
            else:
                need = 2 * max(A[r] + n, B[r]) if A[r] <= B[r] else 2 * max(A[r], B[r] + n)
            top_load = max(load2 if r == load_k else load1, loads[r] + add)
            top_need = max(need2 if r == need_k else need1, need)
            key = (top_load + cost.token * top_need, loads[r], need, r)
            if best is None or key < best[0]:
                best = (key, r)
        r = best[1]
        if r == P - 1 or A[r] <= B[r]:
            A[r] += n
            members[r][0].append(i)
        else:
            B[r] += n
            members[r][1].append(i)
        loads[r] += add
    owner = [-1] * len(lengths)
    halves = []
    for r in range(P):
        a, b = sorted(members[r][0]), sorted(members[r][1])
        if r < P - 1 and sum(lengths[i] for i in b) > sum(lengths[i] for i in a):
            a, b = b, a  # half A is the longer one (the shorter half is padded)
        for i in a + b:
            owner[i] = r
        halves.append((tuple(a), tuple(b)))
    half = tuple(_need(A[r], B[r], r == P - 1 and P > 1) // 2 for r in range(P))
    local_len = split_local + 2 * max(half)
    return DocumentPlacement(cp_size=P, lengths=tuple(lengths), owner=tuple(owner), halves=tuple(halves), half=half,
                             local_len=local_len, costs=tuple(loads), split_min_tokens=split_min_tokens)


def predicted_time(placement: DocumentPlacement, cost: AttentionCostModel) -> float:
    """The step's predicted time: the slowest rank's attention cost (ranks wait for each other) plus the per-token
    cost of the local length (every rank computes the rest of the model on ``local_len`` positions)."""
    return max(placement.costs) + cost.token * placement.local_len


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
        key = (predicted_time(p, cost), -(t or 0))
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
        za += predicted_time(a, cost)
        zb += predicted_time(b, cost)
        zc += sum(b.costs) / len(b.costs) + cost.token * b.local_len
        bal_a.append(a.balance)
        bal_b.append(b.balance)
    n = max(1, len(bal_a))
    return GainPrediction(za, zb, zc, sum(bal_a) / n, sum(bal_b) / n)


def layer_token_pairs(hidden: int, num_heads: int, kv_heads: int, head_dim: int, ffn_hidden: int,
                      gated: bool = True) -> float:
    """The rest of a transformer layer per token (QKV and output projections, the MLP; forward + backward), in
    causal attention pairs' worth of FLOPs (one pair: QK and PV, 4 x heads x head_dim forward, x 3.5 with the
    backward's recomputed scores): the price of one padding position (``AttentionCostModel.token``)."""
    for name, v in (("hidden", hidden), ("num_heads", num_heads), ("kv_heads", kv_heads), ("head_dim", head_dim),
                    ("ffn_hidden", ffn_hidden)):
        if isinstance(v, bool) or not isinstance(v, int) or v < 1:
            raise ValueError(f"layer_token_pairs: {name}={v!r} must be a positive int")
    linear = hidden * (num_heads + 2 * kv_heads) * head_dim + num_heads * head_dim * hidden
    linear += (3 if gated else 2) * hidden * ffn_hidden
    return 6.0 * linear / (4.0 * num_heads * head_dim * 3.5)


def cost_model_for(hidden: int, num_heads: int, kv_heads: int, head_dim: int, ffn_hidden: int, *,
                   gated: bool = True, device_flops: float = 400e12, call_seconds: float = 10e-6,
                   link_bytes_per_s: float = 100e9, dtype_bytes: int = 2) -> AttentionCostModel:
    """A GPU's cost model from a model's shape (``cp.split_min_tokens=auto``): one pair at ``device_flops``
    (achieved, not peak), one kernel call ``call_seconds`` (launch and the short block's inefficiency), one K/V token
    per exchange at ``link_bytes_per_s`` (forward K and V, backward K, V and fp32 dK, dV: about 4 x the K/V bytes),
    and the rest of the layer per token (``layer_token_pairs``). Rough by design: it ranks thresholds, it does not
    promise times."""
    token = layer_token_pairs(hidden, num_heads, kv_heads, head_dim, ffn_hidden, gated)
    pair_seconds = 4.0 * num_heads * head_dim * 3.5 / device_flops
    send_seconds = 4.0 * 2 * kv_heads * head_dim * dtype_bytes / link_bytes_per_s
    return AttentionCostModel(pair=1.0, call=call_seconds / pair_seconds, send=send_seconds / pair_seconds,
                              token=token)


def pack_documents(lengths: Iterable[int], seq_length: int,
                   max_sequences: Optional[int] = None) -> List[List[int]]:
    """Documents of ``lengths`` concatenated and cut into packed sequences of ``seq_length`` tokens, as Megatron's
    GPT dataset cuts its token stream (a document crossing a boundary continues in the next sequence); each sequence
    a list of its document pieces' lengths. The last, incomplete sequence is dropped. ``max_sequences``: stop once
    that many are full (``lengths`` may then be an endless iterator)."""
    if isinstance(seq_length, bool) or not isinstance(seq_length, int) or seq_length < 1:
        raise ValueError(f"pack_documents: seq_length={seq_length!r} must be a positive int")
    out: List[List[int]] = []
    cur: List[int] = []
    room = seq_length
    for i, n in enumerate(lengths):
        if isinstance(n, bool) or not isinstance(n, int) or n < 0:
            raise ValueError(f"pack_documents: document {i} has length {n!r}: lengths must be ints >= 0")
        while n > 0:
            take = min(n, room)
            cur.append(take)
            n -= take
            room -= take
            if room == 0:
                out.append(cur)
                if max_sequences is not None and len(out) >= max_sequences:
                    return out
                cur, room = [], seq_length
    return out


def read_document_lengths(path: str) -> List[int]:
    """Document lengths from a file: a JSON list of ints, or one int per line (blank lines and ``#`` comments
    skipped). ValueError naming the file and line on anything else."""
    import json

    with open(path) as f:
        text = f.read()
    if text.lstrip().startswith("["):
        try:
            values = json.loads(text)
        except ValueError as e:
            raise ValueError(f"{path}: not a JSON list of document lengths ({e})") from None
        bad = [v for v in values if isinstance(v, bool) or not isinstance(v, int) or v < 0]
        if bad:
            raise ValueError(f"{path}: document lengths must be ints >= 0, got {bad[:3]}")
        return list(values)
    out = []
    for n, line in enumerate(text.splitlines(), 1):
        line = line.split("#", 1)[0].strip()
        if not line:
            continue
        if not line.isdigit():
            raise ValueError(f"{path}:{n}: {line!r} is not a document length (an int >= 0)")
        out.append(int(line))
    return out


def schedule_global_batch(costs: Sequence[float], dp_size: int) -> List[int]:
    """The order of one global batch's sequences over the data-parallel ranks that evens out their attention cost:
    ``order[s]`` is the sequence for slot ``s`` (micro-batch ``s // dp_size`` of DP rank ``s % dp_size``, Megatron's
    sampler order at micro-batch size 1). Costliest first, each to the least-loaded rank with a free slot
    (deterministic); every rank's total is then at most the mean plus the costliest sequence's cost. The sequences of
    each rank keep their original relative order."""
    if isinstance(dp_size, bool) or not isinstance(dp_size, int) or dp_size < 1:
        raise ValueError(f"schedule_global_batch: dp size must be a positive int, got {dp_size!r}")
    n = len(costs)
    if n % dp_size:
        raise ValueError(f"schedule_global_batch: {n} sequences do not split over {dp_size} data-parallel ranks")
    per_rank = n // dp_size
    load = [0.0] * dp_size
    members: List[List[int]] = [[] for _ in range(dp_size)]
    for i in sorted(range(n), key=lambda i: (-costs[i], i)):
        d = min((d for d in range(dp_size) if len(members[d]) < per_rank), key=lambda d: (load[d], d))
        members[d].append(i)
        load[d] += costs[i]
    order = [0] * n
    for d in range(dp_size):
        for j, i in enumerate(sorted(members[d])):
            order[j * dp_size + d] = i
    return order


def sequence_cost(lengths: Sequence[int], causal: bool = True) -> int:
    """A packed sequence's attention work: the (query, key) pairs of its documents."""
    return sum(pairs(n, causal) for n in lengths)
