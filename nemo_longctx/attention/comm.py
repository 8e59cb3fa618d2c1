"""Point-to-point ring exchange over a process group, with a byte counter for tests and benchmarks.

``RingExchange(group)`` knows the calling rank's neighbours in the ring ``rank -> rank+1``.
``start(tensors)`` posts, in one ``batch_isend_irecv``, sends of ``tensors`` to the next rank and receives
of same-shaped buffers from the previous rank, and returns a handle whose ``wait()`` gives the received
tensors. Every byte this process sends is added to the active ``count_bytes_sent()`` counters.
"""

from __future__ import annotations

import contextlib
from typing import Iterator, List, Optional, Sequence

import torch
import torch.distributed as dist

Tensor = torch.Tensor

_active_counters: List["ByteCounter"] = []


class ByteCounter:
    """Bytes sent by this process (all tensor payloads of ring/all-to-all exchanges) while active."""

    def __init__(self) -> None:
        self.bytes_sent = 0
        self.messages = 0

    def add(self, nbytes: int) -> None:
        self.bytes_sent += int(nbytes)
        self.messages += 1


@contextlib.contextmanager
def count_bytes_sent() -> Iterator[ByteCounter]:
    """Context manager: ``with count_bytes_sent() as c: ...; c.bytes_sent``. Nests."""
    counter = ByteCounter()
    _active_counters.append(counter)
    try:
        yield counter
    finally:
        _active_counters.remove(counter)


def record_bytes_sent(nbytes: int) -> None:
    for counter in _active_counters:
        counter.add(nbytes)


def group_size_and_rank(group: Optional[dist.ProcessGroup]) -> tuple:
    """(size, rank) of ``group``; (1, 0) when there is no group or torch.distributed is not initialized."""
    if group is None or not dist.is_available() or not dist.is_initialized():
        return 1, 0
    return dist.get_world_size(group), dist.get_rank(group)


class _Pending:
    def __init__(self, works: list, sent: List[Tensor], received: List[Tensor]) -> None:
        self._works = works
        self._sent = sent  # kept alive until the sends complete
        self._received = received

    def wait(self) -> List[Tensor]:
        for w in self._works:
            w.wait()
        self._works, self._sent = [], []
        return self._received


class RingExchange:
    """Send to the next rank and receive from the previous one in ``group`` (a ring of its members)."""

    def __init__(self, group: dist.ProcessGroup) -> None:
        self.group = group
        self.size = dist.get_world_size(group)
        self.rank = dist.get_rank(group)
        self.next_global = dist.get_global_rank(group, (self.rank + 1) % self.size)
        self.prev_global = dist.get_global_rank(group, (self.rank - 1) % self.size)

    def start(self, tensors: Sequence[Tensor], out: Optional[Sequence[Tensor]] = None) -> _Pending:
        """Post sends of ``tensors`` to next and receives into ``out`` (fresh buffers if None) from prev."""
        sent = [t.contiguous() for t in tensors]
        received = [torch.empty_like(t) for t in sent] if out is None else list(out)
        ops = []
        # Even ranks send first, odd ranks receive first: keeps transports that pair ops in order happy.
        for t, r in zip(sent, received):
            send = dist.P2POp(dist.isend, t, self.next_global, self.group)
            recv = dist.P2POp(dist.irecv, r, self.prev_global, self.group)
            ops.extend([send, recv] if self.rank % 2 == 0 else [recv, send])
            record_bytes_sent(t.numel() * t.element_size())
        works = dist.batch_isend_irecv(ops)
        return _Pending(works, sent, received)
