"""Reusable host buffers for activation offload.

Buffers are flat uint8 tensors, bucketed by size (rounded up to ``granularity`` bytes). With an accelerator
they are pinned (page-locked, needed for async copies); on a CPU-only torch ``pin_memory`` raises, so the
pool allocates plain host memory and the offload logic runs unchanged. A released buffer may carry an
event (the last async copy reading/writing it). ``acquire(nbytes, stream)`` never blocks the host on it:
the stream that will write the buffer waits for the event on the device (``stream.wait_event``); a buffer
whose copy has already finished is preferred. Only ``acquire`` without a stream (a host-side writer) waits
on the host.
"""

from __future__ import annotations

from collections import defaultdict
from typing import Dict, List, Optional, Tuple

import torch

from .tracker import host_allocations

Tensor = torch.Tensor


class HostPool:
    """Pool of flat uint8 host buffers. ``pin_memory=None`` pins iff CUDA is available."""

    def __init__(self, pin_memory: Optional[bool] = None, granularity: int = 512) -> None:
        if pin_memory is None:
            pin_memory = torch.cuda.is_available()
        if pin_memory and not torch.cuda.is_available():
            raise ValueError("HostPool: pin_memory=True needs an accelerator (CUDA is not available)")
        if granularity < 1 or granularity & (granularity - 1):
            raise ValueError(f"HostPool: granularity must be a power of two, got {granularity}")
        self.pin_memory = pin_memory
        self.granularity = granularity
        self._free: Dict[int, List[Tuple[Tensor, object]]] = defaultdict(list)
        self.bytes_reserved = 0  # all buffers ever allocated and not dropped by clear()
        self.bytes_in_use = 0
        self.peak_bytes_in_use = 0
        self.allocations = 0  # number of fresh allocations (reuse does not count)
        self.reuses = 0

    def _bucket(self, nbytes: int) -> int:
        g = self.granularity
        return max(g, (int(nbytes) + g - 1) // g * g)

    def acquire(self, nbytes: int, stream: object = None) -> Tensor:
        """A uint8 buffer with at least ``nbytes`` bytes. With ``stream`` (e.g. the torch.cuda.Stream that will
        copy into it) the buffer is safe to write from work enqueued on that stream afterwards: the stream
        waits for the buffer's pending event on the device, the host does not block. Without ``stream`` the
        buffer is safe to write from the host now."""
        size = self._bucket(nbytes)
        free = self._free[size]
        if free:
            idx, ready = len(free) - 1, False
            for i in range(len(free) - 1, -1, -1):  # prefer a buffer whose last copy is already done
                ev = free[i][1]
                if ev is None or ev.query():
                    idx, ready = i, True
                    break
            buf, event = free.pop(idx)
            if event is not None and not ready:
                if stream is not None:
                    stream.wait_event(event)
                else:
                    event.synchronize()
            self.reuses += 1
        else:
            with host_allocations():
                buf = torch.empty(size, dtype=torch.uint8, pin_memory=self.pin_memory)
            self.bytes_reserved += size
            self.allocations += 1
        self.bytes_in_use += size
        self.peak_bytes_in_use = max(self.peak_bytes_in_use, self.bytes_in_use)
        return buf

    def release(self, buf: Tensor, event: object = None) -> None:
        """Return ``buf``; ``event`` (e.g. a torch.cuda.Event) marks when pending copies on it are done."""
        size = buf.numel()
        self._free[size].append((buf, event))
        self.bytes_in_use -= size

    def clear(self) -> None:
        """Drop the free buffers (buffers in use stay valid and are dropped when released later)."""
        for size, entries in self._free.items():
            self.bytes_reserved -= size * len(entries)
        self._free.clear()
