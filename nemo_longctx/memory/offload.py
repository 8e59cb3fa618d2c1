"""Activation offload on saved-tensor hooks: tensors saved for backward inside an offload scope are copied
to a host pool at save time and brought back (prefetched) during backward.

Two ways to use one engine (they share all code):
  * layer_input -- under full recompute, wrap each checkpointed layer (the checkpoint *call*, not the
    function it runs) in ``offload_scope(layer_idx)``: the only tensors saved there are the checkpoint's
    inputs (reentrant: ``CheckpointFunction.save_for_backward``; non-reentrant: ``_NoopSaveInputs``), so
    each layer's input moves to host right after its forward.
  * modules -- ``offload_modules({name: module})`` wraps chosen modules' forwards in scopes (forward hooks):
    the tensors they save (above ``min_bytes``) go to host.

Each scope entry is a *group*. Groups are kept in forward order within a *pass* (a new pass starts when a
key repeats, e.g. the next microbatch, or on ``new_pass()``). During backward, the first unpack from a group
fetches that whole group and prefetches the ``prefetch_depth`` groups before it in forward order (those
are the next to run backward, whichever layers were skipped); ``prefetch_trigger(t)`` additionally starts
prefetching when the gradient of ``t`` (e.g. a layer's output) is computed.

Copies: the storage span covered by the tensor is copied (1-D, ``span = 1 + sum((size-1)*stride)``
elements) and restored with the same dtype, size and strides (storage offset 0), so the tensor that comes
back is bit-identical, with the same memory layout. On CUDA, nothing in the hooks blocks the host:
  * D2H runs on a side stream (which waits for the compute stream) into a pinned pool buffer; a reused
    buffer's previous copy is waited for on that stream (``stream.wait_event``), not on the host; the source
    gets ``record_stream(d2h)`` so the allocator cannot hand its memory out before the copy is done.
  * H2D runs on another side stream into memory allocated on that stream (so it never waits for the compute
    stream), after the D2H event; at unpack the compute stream waits for the H2D event and the tensor gets
    ``record_stream(compute)`` before autograd uses (and later frees) it.
Host buffers return to the pool, with the event of their last copy, when autograd drops the saved tensor
(so ``retain_graph`` / a second backward still work). A failure while releasing is logged and counted in
``release_errors`` (never swallowed). On CPU the same path runs with synchronous copies.

Device: ``device=None`` takes it from the tensors -- the first tensor that qualifies fixes the device type
(cuda or cpu) the engine offloads from; pass ``device`` to fix it up front.

Tensors that are kept for backward outside autograd's saved tensors (e.g. the kept attention output and LSE of
``full_keep_attn``, held by ``KeptAttentionCache`` across a no-grad forward) join the group of the innermost active
scope through ``offload_into_active_scope(t)`` (returns a handle, or ``t`` itself when no scope is active or the
tensor is not offloaded) and come back with ``restore(handle)``: same group, same prefetch and release rules.

Not offloaded (kept, reported to the tracker as device bytes): tensors below ``min_bytes``, leaves that
require grad (parameters: the caller holds them anyway), tensors on another device type, tensor subclasses,
non-strided layouts, conj/neg views, and anything saved while the autograd engine runs (recompute).
Saved tensors must not be modified in place after saving (autograd forbids it; here it is not detected).
"""

from __future__ import annotations

import contextlib
import logging
import sys
import weakref
from typing import Callable, Dict, Iterator, List, Optional, Sequence, Union

import torch
from torch.utils._pytree import tree_flatten

from .host_pool import HostPool
from .tracker import (foreign_saved_tensor_hooks, in_backward, is_leaf_param, report_saved_on_device,
                      report_saved_on_host)

Tensor = torch.Tensor

log = logging.getLogger(__name__)

_active_scopes: List[tuple] = []  # (engine, group) of the offload scopes entered, innermost last


def storage_span(t: Tensor) -> int:
    """Number of storage elements from ``t.storage_offset()`` that ``t``'s (size, stride) can touch."""
    if t.numel() == 0:
        return 0
    return 1 + sum((s - 1) * st for s, st in zip(t.shape, t.stride()))


class OffloadGroup:
    """Tensors offloaded in one scope entry (one layer of one microbatch)."""

    def __init__(self, key: object, pass_id: int, seq: int) -> None:
        self.key = key
        self.pass_id = pass_id
        self.seq = seq
        self._handles: List[weakref.ref] = []

    def handles(self) -> List["_Offloaded"]:
        alive = [h for h in (r() for r in self._handles) if h is not None]
        return alive

    def __repr__(self) -> str:
        return f"OffloadGroup(key={self.key!r}, pass={self.pass_id}, tensors={len(self.handles())})"


class _Offloaded:
    """What autograd stores instead of an offloaded tensor."""

    __slots__ = ("engine", "group", "dtype", "size", "stride", "device", "span", "nbytes", "buf", "host",
                 "d2h_event", "dev", "h2d_event", "unpacks", "__weakref__")

    def __del__(self) -> None:
        engine = getattr(self, "engine", None)
        if engine is None:
            return
        try:
            engine._release(self)
        except Exception as e:  # noqa: BLE001 - reported, not swallowed (raising in __del__ is not possible)
            engine._release_failed(e)


class ActivationOffloader:
    """Offload engine (see module docstring).

    ``prefetch_depth``: groups fetched ahead during backward (0: fetch on demand). ``min_bytes``: smaller
    tensors stay on the device. ``device``: device type whose tensors are offloaded (default: taken from the
    first tensor that qualifies). ``pool``: a HostPool (default: a new one, pinned iff CUDA is available).
    ``record_events``: keep a log of ("d2h" | "h2d" | "unpack", group key, pass) for tests and debugging.
    """

    def __init__(self, *, prefetch_depth: int = 1, min_bytes: int = 2**20,
                 device: Union[str, torch.device, None] = None, pool: Optional[HostPool] = None,
                 record_events: bool = False) -> None:
        if not isinstance(prefetch_depth, int) or prefetch_depth < 0:
            raise ValueError(f"ActivationOffloader: prefetch_depth must be an int >= 0, got {prefetch_depth!r}")
        if not isinstance(min_bytes, int) or min_bytes < 0:
            raise ValueError(f"ActivationOffloader: min_bytes must be an int >= 0, got {min_bytes!r}")
        self.device_type: Optional[str] = None if device is None else torch.device(device).type
        if self.device_type not in (None, "cpu", "cuda"):
            raise ValueError(f"ActivationOffloader: device must be 'cpu' or 'cuda', got {device!r}")
        if self.device_type == "cuda" and not torch.cuda.is_available():
            raise ValueError("ActivationOffloader: device='cuda' but CUDA is not available")
        self.prefetch_depth = prefetch_depth
        self.min_bytes = min_bytes
        self.pool = pool if pool is not None else HostPool()
        self.events: Optional[list] = [] if record_events else None
        self._streams: Dict[int, tuple] = {}  # CUDA device index -> (d2h stream, h2d stream)
        self.release_errors = 0
        self.last_release_error: Optional[str] = None
        self._groups: List[OffloadGroup] = []
        self._pass_id = 0
        self._pass_keys: set = set()
        self._seq = 0
        self.bytes_offloaded = 0  # cumulative
        self.tensors_offloaded = 0

    # -- scopes ------------------------------------------------------------------------------------------
    def new_pass(self) -> None:
        """Start a new forward pass (microbatch): prefetching never crosses passes."""
        self._pass_id += 1
        self._pass_keys = set()

    @contextlib.contextmanager
    def offload_scope(self, key: object) -> Iterator[Optional[OffloadGroup]]:
        """Offload what is saved for backward inside this block as group ``key``; yields the group
        (None while the autograd engine runs, e.g. a recompute: nothing is offloaded then)."""
        if in_backward():
            yield None
            return
        if key in self._pass_keys:
            self.new_pass()
        self._pass_keys.add(key)
        self._prune()
        group = OffloadGroup(key, self._pass_id, self._seq)
        self._seq += 1
        self._groups.append(group)

        def pack(t: Tensor):
            return self._pack(t, group)

        _active_scopes.append((self, group))
        try:
            with foreign_saved_tensor_hooks(), torch.autograd.graph.saved_tensors_hooks(pack, self._unpack):
                yield group
        finally:
            _active_scopes.pop()

    def run_in_scope(self, key: object, fn: Callable, *args, trigger: bool = True, **kwargs):
        """``fn(*args, **kwargs)`` inside ``offload_scope(key)`` -- e.g. ``fn`` = a checkpoint call of one
        layer. With ``trigger``, every tensor output gets a ``prefetch_trigger`` (see there)."""
        with self.offload_scope(key):
            out = fn(*args, **kwargs)
        if trigger:
            for t in tree_flatten(out)[0]:
                if isinstance(t, Tensor):
                    self.prefetch_trigger(t)
        return out

    def offload_modules(self, modules: Dict[str, torch.nn.Module]):
        """``modules`` mode: wrap each module's forward in ``offload_scope(name)``. Returns a handle whose
        ``remove()`` detaches the hooks."""
        handles = []
        for name, module in modules.items():
            if not isinstance(module, torch.nn.Module):
                raise ValueError(f"offload_modules: {name!r} is not an nn.Module")
            stack: list = []

            def pre(mod, args, _name=name, _stack=stack):
                cm = self.offload_scope(_name)
                cm.__enter__()
                _stack.append(cm)

            def post(mod, args, out, _stack=stack):
                if _stack:
                    _stack.pop().__exit__(None, None, None)

            handles.append(module.register_forward_pre_hook(pre))
            handles.append(module.register_forward_hook(post, always_call=True))
        return _Handles(handles)

    def prefetch_trigger(self, t: Tensor) -> Tensor:
        """When the gradient of ``t`` is computed, prefetch ``prefetch_depth`` groups that were opened
        before now (nearest first). Returns ``t``; a no-op when ``t`` does not require grad."""
        if not t.requires_grad or self.prefetch_depth == 0:
            return t
        pass_id, seq_limit = self._pass_id, self._seq

        def hook(grad):
            self._prefetch_before(pass_id, seq_limit, self.prefetch_depth)
            return None

        t.register_hook(hook)
        return t

    # -- pack / unpack -----------------------------------------------------------------------------------
    @property
    def _cuda(self) -> bool:
        return self.device_type == "cuda"

    def _cuda_streams(self, device: torch.device) -> tuple:
        idx = device.index if device.index is not None else torch.cuda.current_device()
        if idx not in self._streams:
            self._streams[idx] = (torch.cuda.Stream(device=idx), torch.cuda.Stream(device=idx))
        return self._streams[idx]

    def _should_offload(self, t: Tensor) -> bool:
        ok = (
            type(t) is torch.Tensor
            and t.layout == torch.strided
            and t.device.type in (self.device_type or t.device.type,)
            and t.device.type in ("cpu", "cuda")
            and not t.is_conj() and not t.is_neg()
            and not is_leaf_param(t)
            and storage_span(t) * t.element_size() >= max(self.min_bytes, 1)
        )
        if ok and self.device_type is None:
            self.device_type = t.device.type  # device from the tensors: fixed by the first one offloaded
        return ok

    def _pack(self, t: Tensor, group: OffloadGroup):
        if in_backward() or not self._should_offload(t):
            report_saved_on_device(t)
            return t.detach()
        h = _Offloaded()
        h.engine, h.group = self, group
        h.dtype, h.size, h.stride, h.device = t.dtype, tuple(t.shape), tuple(t.stride()), t.device
        h.span = storage_span(t)
        h.nbytes = h.span * t.element_size()
        h.dev = h.h2d_event = h.d2h_event = None
        h.unpacks = 0
        with torch.no_grad():
            src = torch.as_strided(t.detach(), (h.span,), (1,), t.storage_offset())
            if self._cuda:
                d2h, _ = self._cuda_streams(t.device)
                h.buf = self.pool.acquire(h.nbytes, stream=d2h)  # d2h waits for the buffer's last copy
                h.host = h.buf[: h.nbytes].view(t.dtype)
                d2h.wait_stream(torch.cuda.current_stream(t.device))
                with torch.cuda.stream(d2h):
                    h.host.copy_(src, non_blocking=True)
                    h.d2h_event = torch.cuda.Event()
                    h.d2h_event.record(d2h)
                t.record_stream(d2h)  # the source must outlive the async copy
            else:
                h.buf = self.pool.acquire(h.nbytes)
                h.host = h.buf[: h.nbytes].view(t.dtype)
                h.host.copy_(src)
        group._handles.append(weakref.ref(h))
        self.bytes_offloaded += h.nbytes
        self.tensors_offloaded += 1
        self._log("d2h", group)
        report_saved_on_host(h, h.nbytes)
        return h

    def _unpack(self, h):
        if isinstance(h, Tensor):
            return h
        group = h.group
        for other in group.handles():  # the whole group is needed by this layer's backward
            if other.dev is None and (other is h or other.unpacks == 0):
                self._fetch(other)
        self._prefetch_before(group.pass_id, group.seq, self.prefetch_depth)
        dev = h.dev
        if self._cuda:
            compute = torch.cuda.current_stream(dev.device)
            compute.wait_event(h.h2d_event)
            dev.record_stream(compute)  # allocated on the H2D stream, used (and freed) on the compute stream
        h.dev = None
        h.unpacks += 1
        self._log("unpack", group)
        return dev.as_strided(h.size, h.stride, 0)

    def _fetch(self, h: "_Offloaded") -> None:
        if self._cuda:
            _, h2d = self._cuda_streams(h.device)
            h2d.wait_event(h.d2h_event)  # the host buffer is complete
            with torch.cuda.stream(h2d):
                # allocated on the H2D stream: its memory is ordered after earlier H2D work, not compute work,
                # so the copy does not wait for the compute stream (prefetch overlaps backward compute)
                dev = torch.empty(h.span, dtype=h.dtype, device=h.device)
                dev.copy_(h.host, non_blocking=True)
                h.h2d_event = torch.cuda.Event()
                h.h2d_event.record(h2d)
        else:
            dev = torch.empty(h.span, dtype=h.dtype, device=h.device)
            dev.copy_(h.host)
        h.dev = dev
        self._log("h2d", h.group)

    def _prefetch_before(self, pass_id: int, seq_limit: int, depth: int) -> None:
        """Fetch pending tensors of the ``depth`` latest groups of ``pass_id`` opened before ``seq_limit``."""
        if depth <= 0:
            return
        taken = 0
        for group in reversed(self._groups):
            if group.pass_id != pass_id or group.seq >= seq_limit:
                continue
            pending = [h for h in group.handles() if h.unpacks == 0]
            if not pending:
                continue  # already consumed (its backward ran) or nothing offloaded
            for h in pending:
                if h.dev is None:
                    self._fetch(h)
            taken += 1
            if taken == depth:
                return

    def _release(self, h: "_Offloaded") -> None:
        if h.buf is None:
            return
        event = h.h2d_event if h.h2d_event is not None else h.d2h_event
        buf = h.buf
        h.buf = h.host = h.dev = None
        self.pool.release(buf, event)

    def _release_failed(self, exc: BaseException) -> None:
        self.release_errors += 1
        self.last_release_error = f"{type(exc).__name__}: {exc}"
        if sys.is_finalizing():
            return
        log.error("ActivationOffloader: releasing an offloaded tensor's host buffer failed (%d so far): %s; "
                  "its pinned buffer is not returned to the pool", self.release_errors, self.last_release_error)

    def _prune(self) -> None:
        self._groups = [g for g in self._groups if g.handles() or g.pass_id == self._pass_id]

    def _log(self, what: str, group: OffloadGroup) -> None:
        if self.events is not None:
            self.events.append((what, group.key, group.pass_id))

    # -- introspection -----------------------------------------------------------------------------------
    def live_groups(self) -> List[OffloadGroup]:
        """Groups that still hold offloaded tensors (empty once every backward has run)."""
        self._prune()
        return [g for g in self._groups if g.handles()]

    def host_bytes_in_use(self) -> int:
        return sum(h.nbytes for g in self._groups for h in g.handles())


def offload_into_active_scope(t: Tensor):
    """Offload ``t`` (kept for backward by the caller, not saved through autograd) into the group of the innermost
    active offload scope. Returns the handle to pass to ``restore``, or ``t`` itself (reported to the tracker as
    device bytes) when no scope is active, in backward, or the tensor does not qualify (``min_bytes``, ...)."""
    if not _active_scopes or in_backward():
        report_saved_on_device(t)
        return t
    engine, group = _active_scopes[-1]
    return engine._pack(t, group)  # reports the host (or, when not offloaded, the device) bytes to the trackers


def restore(handle) -> Tensor:
    """The tensor behind a handle from ``offload_into_active_scope`` (on its device; ``handle`` if a tensor)."""
    if isinstance(handle, Tensor):
        return handle
    if not isinstance(handle, _Offloaded) or handle.engine is None:
        raise TypeError(f"restore: not an offload handle: {type(handle).__name__}")
    return handle.engine._unpack(handle)


def is_offloaded(handle) -> bool:
    return isinstance(handle, _Offloaded)


class _Handles:
    def __init__(self, handles: Sequence) -> None:
        self.handles = list(handles)

    def remove(self) -> None:
        for h in self.handles:
            h.remove()
        self.handles = []
