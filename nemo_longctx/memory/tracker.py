"""Activation-memory tracker: bytes saved for backward (device / offloaded-to-host), per scope, and peak bytes.

Usage::

    with ActivationTracker() as tracker:          # outermost: enter it before any offload scope
        with memory_scope("layer0"):
            h = layer0(x)
        loss = head(h)
    loss.backward()
    stats = tracker.stats()                       # MemoryStats, also valid after backward

What is counted
  * Saved tensors are seen through ``torch.autograd.graph.saved_tensors_hooks`` while the tracker is active
    (and reported by the offload engine / kept-attention cache, whose hooks shadow the tracker's).
    Bytes are those of the underlying *storage*, counted once per storage (views and repeated saves of one
    storage count once), and only while the storage is alive (weakref on the storage object).
  * ``activation_bytes_device``: the maximum, over the tracked region and the backward after it, of live
    saved bytes kept where the op produced them. ``activation_bytes_host``: the same for bytes the offload
    engine moved to its host pool. ``per_scope``: {scope: {"device": b, "host": b}} at the moment the live
    total (device + host) was largest.
  * Saved tensors that are autograd leaves requiring grad (parameters, or views of them such as ``w.t()``),
    and tensors whose storage is in ``params``, are not activations: they go to ``leaf_bytes`` only.
  * Tensors saved while the autograd engine runs (recompute inside backward) are not counted.
  * ``peak_bytes``: peak of live bytes allocated inside the region (forward and anything run inside it),
    above the level at entry. CUDA: ``torch.cuda.max_memory_allocated() - memory_allocated() at entry`` (the
    caching allocator's host-side counters: no device synchronization is needed; ``synchronize=True`` adds a
    ``torch.cuda.synchronize()`` at entry and exit, e.g. to time the region).
    CPU (no allocator stats): a ``TorchDispatchMode`` sees every op output whose storage is new (not an
    alias of an input) and follows its death through a weakref on the storage; offload host-pool buffers
    (allocated under ``host_allocations()``) are excluded. Run ``backward`` inside the tracker to include it.

Not thread-safe (module-level state), like autograd's own saved-tensor hook stack.
"""

from __future__ import annotations

import contextlib
import weakref
from dataclasses import dataclass, field
from typing import Any, Callable, Dict, Iterable, Iterator, List, Optional, Union

import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten

Tensor = torch.Tensor

_active_trackers: List["ActivationTracker"] = []
_scope_stack: List[str] = []
_foreign_hooks_depth = 0  # >0 while another saved-tensor hook owner (offload engine) is innermost
_host_alloc_depth = 0  # >0 while the offload host pool allocates (ignored by the CPU peak counter)

UNSCOPED = "unscoped"


# --------------------------------------------------------------------------------------------- helpers


def in_backward() -> bool:
    """True while the autograd engine is executing a backward pass on this thread."""
    return torch._C._current_graph_task_id() != -1


def current_scope() -> str:
    """Name of the current memory scope ("a/b" when nested), or "unscoped"."""
    return "/".join(_scope_stack) if _scope_stack else UNSCOPED


@contextlib.contextmanager
def memory_scope(name: str) -> Iterator[None]:
    """Attribute tensors saved inside this block to scope ``name`` (nests as "outer/inner")."""
    if not isinstance(name, str) or not name:
        raise ValueError(f"memory_scope: name must be a non-empty string, got {name!r}")
    _scope_stack.append(name)
    try:
        yield
    finally:
        _scope_stack.pop()


class _HookHandles:
    def __init__(self, handles: list) -> None:
        self.handles = handles

    def remove(self) -> None:
        for h in self.handles:
            h.remove()
        self.handles = []


def scope_modules(modules: Dict[str, torch.nn.Module]) -> _HookHandles:
    """Wrap each module's forward in ``memory_scope(name)`` via forward hooks; returns a handle with
    ``remove()``. ``modules`` maps scope name -> module (e.g. ``{f"layer{i}": l for i, l in ...}``)."""
    handles = []
    for name, module in modules.items():
        if not isinstance(module, torch.nn.Module):
            raise ValueError(f"scope_modules: {name!r} is not an nn.Module")
        cm_stack: list = []

        def pre(mod, args, _name=name, _stack=cm_stack):
            cm = memory_scope(_name)
            cm.__enter__()
            _stack.append(cm)

        def post(mod, args, out, _stack=cm_stack):
            if _stack:
                _stack.pop().__exit__(None, None, None)

        handles.append(module.register_forward_pre_hook(pre))
        handles.append(module.register_forward_hook(post, always_call=True))
    return _HookHandles(handles)


@contextlib.contextmanager
def host_allocations() -> Iterator[None]:
    """Allocations made inside are host-pool buffers: not counted in the CPU ``peak_bytes``."""
    global _host_alloc_depth
    _host_alloc_depth += 1
    try:
        yield
    finally:
        _host_alloc_depth -= 1


@contextlib.contextmanager
def foreign_saved_tensor_hooks() -> Iterator[None]:
    """Entered by code that installs its own saved-tensor hooks and reports to the trackers itself."""
    global _foreign_hooks_depth
    _foreign_hooks_depth += 1
    try:
        yield
    finally:
        _foreign_hooks_depth -= 1


def report_saved_on_device(t: Tensor) -> None:
    """Report a tensor saved for backward and kept on its device (for code whose hooks shadow ours)."""
    if in_backward():
        return
    for tracker in _active_trackers:
        tracker._record_device(t)


def report_saved_on_host(handle: object, nbytes: int) -> None:
    """Report ``nbytes`` held in host memory for as long as ``handle`` (weakref-able) is alive."""
    if in_backward():
        return
    for tracker in _active_trackers:
        tracker._record_host(handle, nbytes)


def report_released(t: Tensor) -> None:
    """``t``'s storage was freed in place (``untyped_storage().resize_(0)``, e.g. a recomputed norm output) while the
    tensor object stays alive: its saved bytes and its bytes in the CPU peak counter stop counting now."""
    if in_backward():
        return
    key = id(t.untyped_storage())
    for tracker in _active_trackers:
        tracker._drop_device(key, False)
        if tracker._counter is not None:
            tracker._counter.release(key)


def is_leaf_param(t: Tensor) -> bool:
    base = t._base if t._base is not None else t
    return base.is_leaf and base.requires_grad


# ----------------------------------------------------------------------------------------- peak counter


class _AllocationCounter(TorchDispatchMode):
    """Live bytes of storages created by ops run under this mode on ``device_type``, and their peak."""

    def __init__(self, device_type: str) -> None:
        super().__init__()
        self.device_type = device_type
        self.live = 0
        self.peak = 0
        self._known: Dict[int, weakref.ref] = {}
        self._bytes: Dict[int, int] = {}

    def _forget(self, key: int, _ref) -> None:
        self._known.pop(key, None)
        self.live -= self._bytes.pop(key, 0)

    def release(self, key: int) -> None:
        """The storage ``key`` was resized to 0 in place: its bytes are no longer live."""
        self.live -= self._bytes.get(key, 0)
        if key in self._bytes:
            self._bytes[key] = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        if _host_alloc_depth:
            return out
        outs, _ = tree_flatten(out)
        inputs = None
        for o in outs:
            if not isinstance(o, Tensor) or o.device.type != self.device_type or o.layout != torch.strided:
                continue
            st = o.untyped_storage()
            key = id(st)
            if key in self._known:
                continue
            if inputs is None:
                flat, _ = tree_flatten((args, kwargs))
                inputs = {id(a.untyped_storage()) for a in flat
                          if isinstance(a, Tensor) and a.layout == torch.strided}
            nbytes = 0 if key in inputs else st.nbytes()  # an alias of a pre-existing storage is not new
            self._known[key] = weakref.ref(st, lambda r, k=key: self._forget(k, r))
            self._bytes[key] = nbytes
            self.live += nbytes
            if self.live > self.peak:
                self.peak = self.live
        return out


# --------------------------------------------------------------------------------------------- tracker


@dataclass
class MemoryStats:
    """Measured activation memory of one tracked region (bytes). See the module docstring."""

    activation_bytes_device: int
    activation_bytes_host: int
    peak_bytes: int
    per_scope: Dict[str, Dict[str, int]] = field(default_factory=dict)
    leaf_bytes: int = 0
    device: str = "cpu"

    def as_dict(self) -> dict:
        return dict(activation_bytes_device=self.activation_bytes_device,
                    activation_bytes_host=self.activation_bytes_host, peak_bytes=self.peak_bytes,
                    leaf_bytes=self.leaf_bytes, device=self.device,
                    per_scope={k: dict(v) for k, v in self.per_scope.items()})

    def summary(self) -> str:
        """One line, e.g. for the train app's log."""
        def mib(b: int) -> str:
            return f"{b / 2**20:.1f}MiB"
        return (f"activations: device {mib(self.activation_bytes_device)}, host {mib(self.activation_bytes_host)}"
                f" | peak {mib(self.peak_bytes)} ({self.device})")


class ActivationTracker:
    """Context manager that measures saved-for-backward bytes and peak live bytes (see module docstring).

    ``device``: "cpu"/"cuda"/torch.device; default: the device of ``params`` (the model's), else taken from the
    saved tensors (both CPU and, when available, CUDA peak counters run and the device of the first saved
    tensor decides which one ``stats`` reports). ``count_peak=False`` skips the CPU dispatch-mode counter
    (peak_bytes then 0 on CPU). ``params``: tensors (e.g. ``model.parameters()``, frozen ones included)
    whose storages are never counted as activations. ``synchronize``: ``torch.cuda.synchronize()`` at entry
    and exit (off by default: the CUDA peak counters do not need it).
    """

    def __init__(self, device: Union[str, torch.device, None] = None, *, count_peak: bool = True,
                 params: Iterable[Tensor] = (), synchronize: bool = False) -> None:
        params = list(params)
        self._device: Optional[torch.device] = None
        if device is None and params:
            device = params[0].device
        if device is not None:
            self._device = torch.device(device)
            if self._device.type == "cuda" and not torch.cuda.is_available():
                raise ValueError("ActivationTracker: device='cuda' but CUDA is not available")
        self.device_type: Optional[str] = None if self._device is None else self._device.type
        self._seen_device_type: Optional[str] = None
        self.synchronize = bool(synchronize)
        self.count_peak = count_peak
        self._param_storages = {id(p.untyped_storage()): p.untyped_storage() for p in params}
        self._live_device: Dict[int, tuple] = {}  # storage id -> (nbytes, scope, weakref)
        self._live_host: Dict[int, tuple] = {}  # handle id -> (nbytes, scope, weakref)
        self._live_leaf: Dict[int, tuple] = {}
        self._device_bytes = self._host_bytes = self._leaf_bytes = 0
        self._max_device = self._max_host = self._max_total = self._max_leaf = 0
        self._scope_live: Dict[str, Dict[str, int]] = {}
        self._scope_at_max: Dict[str, Dict[str, int]] = {}
        self._counter: Optional[_AllocationCounter] = None
        self._cuda_base = 0
        self._cuda_dev: Optional[torch.device] = None
        self._cuda_peak: Optional[int] = None
        self._hooks = None
        self._entered = False

    # -- context -----------------------------------------------------------------------------------------
    def __enter__(self) -> "ActivationTracker":
        if self._entered:
            raise RuntimeError("ActivationTracker: a tracker can be entered once; create a new one per step")
        if _foreign_hooks_depth:
            raise RuntimeError(
                "ActivationTracker entered inside an offload scope: its saved-tensor hooks would shadow the "
                "offload engine's. Enter the tracker outside (around) all offload scopes."
            )
        self._entered = True
        self._hooks = torch.autograd.graph.saved_tensors_hooks(self._pack, _unpack_identity)
        self._hooks.__enter__()
        _active_trackers.append(self)
        if self.device_type == "cuda" or (self.device_type is None and torch.cuda.is_available()):
            dev = self._device if self._device is not None and self._device.type == "cuda" else None
            self._cuda_dev = torch.device("cuda", torch.cuda.current_device() if dev is None or dev.index is None
                                          else dev.index)
            if self.synchronize:
                torch.cuda.synchronize(self._cuda_dev)
            torch.cuda.reset_peak_memory_stats(self._cuda_dev)
            self._cuda_base = torch.cuda.memory_allocated(self._cuda_dev)
        if self.device_type != "cuda" and self.count_peak:
            self._counter = _AllocationCounter(self.device_type or "cpu")
            self._counter.__enter__()
        return self

    def __exit__(self, *exc) -> None:
        if self._counter is not None:
            self._counter.__exit__(*exc)
        if self._cuda_dev is not None:
            if self.synchronize:
                torch.cuda.synchronize(self._cuda_dev)
            self._cuda_peak = torch.cuda.max_memory_allocated(self._cuda_dev) - self._cuda_base
        _active_trackers.remove(self)
        self._hooks.__exit__(*exc)

    # -- recording ---------------------------------------------------------------------------------------
    def _pack(self, t: Tensor) -> Tensor:
        if not in_backward():
            self._record_device(t)
        return t.detach()  # detach: returning t itself would make a saved output keep its own graph alive

    def _bump(self, scope: str, column: str, nbytes: int) -> None:
        d = self._scope_live.setdefault(scope, {"device": 0, "host": 0})
        d[column] += nbytes

    def _update_max(self) -> None:
        self._max_device = max(self._max_device, self._device_bytes)
        self._max_host = max(self._max_host, self._host_bytes)
        self._max_leaf = max(self._max_leaf, self._leaf_bytes)
        total = self._device_bytes + self._host_bytes
        if total > self._max_total:
            self._max_total = total
            self._scope_at_max = {k: dict(v) for k, v in self._scope_live.items() if v["device"] or v["host"]}

    def _record_device(self, t: Tensor) -> None:
        if t.layout != torch.strided or t.device.type == "meta":
            return
        if self._seen_device_type is None:
            self._seen_device_type = t.device.type
        st = t.untyped_storage()
        key = id(st)
        leaf = key in self._param_storages or is_leaf_param(t)
        table = self._live_leaf if leaf else self._live_device
        if key in table:
            return
        nbytes, scope = st.nbytes(), current_scope()
        ref = weakref.ref(st, lambda r, k=key, leaf=leaf: self._drop_device(k, leaf))
        table[key] = (nbytes, scope, ref)
        if leaf:
            self._leaf_bytes += nbytes
        else:
            self._device_bytes += nbytes
            self._bump(scope, "device", nbytes)
        self._update_max()

    def _drop_device(self, key: int, leaf: bool) -> None:
        table = self._live_leaf if leaf else self._live_device
        entry = table.pop(key, None)
        if entry is None:
            return
        if leaf:
            self._leaf_bytes -= entry[0]
        else:
            self._device_bytes -= entry[0]
            self._bump(entry[1], "device", -entry[0])

    def _record_host(self, handle: object, nbytes: int) -> None:
        key = id(handle)
        if key in self._live_host:
            return
        scope = current_scope()
        ref = weakref.ref(handle, lambda r, k=key: self._drop_host(k))
        self._live_host[key] = (int(nbytes), scope, ref)
        self._host_bytes += int(nbytes)
        self._bump(scope, "host", int(nbytes))
        self._update_max()

    def _drop_host(self, key: int) -> None:
        entry = self._live_host.pop(key, None)
        if entry is not None:
            self._host_bytes -= entry[0]
            self._bump(entry[1], "host", -entry[0])

    # -- results -----------------------------------------------------------------------------------------
    @property
    def live_device_bytes(self) -> int:
        """Saved bytes kept on the device and alive right now."""
        return self._device_bytes

    @property
    def live_host_bytes(self) -> int:
        """Saved bytes held in the offload host pool right now."""
        return self._host_bytes

    def _reported_device_type(self) -> str:
        if self.device_type is not None:
            return self.device_type
        if self._seen_device_type in ("cpu", "cuda"):
            return self._seen_device_type
        return "cuda" if self._cuda_dev is not None and (self._cuda_peak or 0) > 0 else "cpu"

    def stats(self) -> MemoryStats:
        device_type = self._reported_device_type()
        if device_type == "cuda" and self._cuda_dev is not None:
            if self._cuda_peak is not None:
                peak = self._cuda_peak
            else:
                peak = torch.cuda.max_memory_allocated(self._cuda_dev) - self._cuda_base
        else:
            peak = self._counter.peak if self._counter is not None else 0
        return MemoryStats(
            activation_bytes_device=self._max_device,
            activation_bytes_host=self._max_host,
            peak_bytes=int(peak),
            per_scope={k: dict(v) for k, v in self._scope_at_max.items()},
            leaf_bytes=self._max_leaf,
            device=device_type,
        )


def _unpack_identity(t: Tensor) -> Tensor:
    return t


def track_activation_memory(fn: Callable[[], object], **kwargs) -> MemoryStats:
    """Run ``fn()`` (e.g. forward + backward of one step) under an ActivationTracker; return its stats."""
    with ActivationTracker(**kwargs) as tracker:
        fn()
    return tracker.stats()


class StepActivationMeter:
    """One ``ActivationTracker`` per training step, for any training loop's step-start / step-end hooks (the NeMo
    2 Lightning callback and the Megatron-Bridge callback both use it): ``start(params)`` before the step's
    forward (before any offload scope opens), ``stop()`` after its backward. ``metrics()``: the last step's
    ``activation_bytes_device`` / ``activation_bytes_host`` / ``peak_bytes`` (this rank; ``peak_bytes`` None when
    not counted: CPU with ``count_peak=False``), all None before the first step or when ``track=False``;
    ``summary()`` one log line."""

    def __init__(self, count_peak: bool = False, track: bool = True) -> None:
        self.count_peak, self.track = bool(count_peak), bool(track)
        self._tracker: Optional[ActivationTracker] = None
        self._stats: Optional[MemoryStats] = None

    def start(self, params: Iterable[Tensor] = ()) -> None:
        if not self.track:
            return
        self.stop()
        self._tracker = ActivationTracker(count_peak=self.count_peak, params=params)
        self._tracker.__enter__()

    def stop(self) -> None:
        if self._tracker is not None:
            self._tracker.__exit__(None, None, None)
            self._stats = self._tracker.stats()
            self._tracker = None

    @property
    def stats(self) -> Optional[MemoryStats]:
        return self._stats

    def metrics(self) -> Dict[str, Any]:
        """The last step's bytes; ``activation_bytes_by_layer``: {"layerN": device bytes} of each layer scope at the
        moment the live total was largest (the per-layer split of ``activation_bytes_device``)."""
        s = self._stats
        if s is None:
            return {"activation_bytes_device": None, "activation_bytes_host": None, "peak_bytes": None,
                    "activation_bytes_by_layer": None}
        counted = s.device == "cuda" or self.count_peak
        layers = {k: int(v.get("device", 0)) for k, v in sorted(s.per_scope.items()) if k.startswith("layer")}
        return {"activation_bytes_device": int(s.activation_bytes_device),
                "activation_bytes_host": int(s.activation_bytes_host),
                "peak_bytes": int(s.peak_bytes) if counted else None, "activation_bytes_by_layer": layers}

    def summary(self) -> str:
        m = self.metrics()
        if m["activation_bytes_device"] is None:
            return "activations: not tracked"

        def mib(b: Optional[int]) -> str:
            return "-" if b is None else f"{b / 2**20:.1f} MiB"

        dev = self._stats.device if self._stats is not None else "cpu"
        return (f"activations {dev} {mib(m['activation_bytes_device'])} host {mib(m['activation_bytes_host'])} "
                f"peak {mib(m['peak_bytes'])}")
