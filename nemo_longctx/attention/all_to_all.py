"""Equal-split all-to-all over a process group, and a probe of the staging-buffer bytes it needs.

``all_to_all_equal(send, recv, group)``: ``send`` and ``recv`` are contiguous tensors of the same shape whose
first dimension is the group size P; ``send[j]`` goes to group rank j and ``recv[i]`` arrives from group rank i
(``torch.distributed.all_to_all_single``). The bytes that leave this process ((P-1)/P of ``send``; the own
slice stays local) are added to the active ``comm.count_bytes_sent()`` counters.

``track_a2a_buffer_bytes()`` measures the staging buffers (send/receive/reorder buffers) that the Ulysses
functions hold alive at once: ``with track_a2a_buffer_bytes() as probe: ...; probe.peak_bytes``. The
functions register the buffers they allocate (their storage sizes) with ``hold_buffers`` and release them
when the pass ends; saved activations and kernel outputs are not staging buffers and are not counted.
"""

from __future__ import annotations

import contextlib
from typing import Iterator, List, Optional

import torch
import torch.distributed as dist

from .comm import record_bytes_sent

Tensor = torch.Tensor

_active_probes: List["A2ABufferProbe"] = []


class A2ABufferProbe:
    """Live and peak bytes of all-to-all staging buffers while active."""

    def __init__(self) -> None:
        self.live_bytes = 0
        self.peak_bytes = 0

    def _add(self, nbytes: int) -> None:
        self.live_bytes += nbytes
        self.peak_bytes = max(self.peak_bytes, self.live_bytes)


@contextlib.contextmanager
def track_a2a_buffer_bytes() -> Iterator[A2ABufferProbe]:
    """Context manager yielding a probe whose ``peak_bytes`` is the most staging-buffer bytes held at once."""
    probe = A2ABufferProbe()
    _active_probes.append(probe)
    try:
        yield probe
    finally:
        _active_probes.remove(probe)


@contextlib.contextmanager
def hold_buffers(*buffers: Tensor) -> Iterator[None]:
    """Count ``buffers`` (by storage size) as live staging memory for the duration of the block."""
    nbytes = sum(t.untyped_storage().nbytes() for t in buffers)
    for p in _active_probes:
        p._add(nbytes)
    try:
        yield
    finally:
        for p in _active_probes:
            p._add(-nbytes)


def all_to_all_equal(send: Tensor, recv: Tensor, group: Optional[dist.ProcessGroup]) -> Tensor:
    """Exchange equal slices along dim 0 (size P = group size); returns ``recv``. P == 1 is a local copy."""
    if send.shape != recv.shape or not (send.is_contiguous() and recv.is_contiguous()):
        raise ValueError("all_to_all_equal needs contiguous send/recv tensors of one shape")
    size = 1 if group is None else dist.get_world_size(group)
    if size == 1:
        recv.copy_(send)
        return recv
    if send.shape[0] != size:
        raise ValueError(f"all_to_all_equal: dim 0 ({send.shape[0]}) must equal the group size ({size})")
    record_bytes_sent(send.numel() * send.element_size() * (size - 1) // size)
    dist.all_to_all_single(recv, send, group=group)
    return recv
