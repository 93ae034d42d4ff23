"""Tensors in and out of the pool: DMA between pool pages and device memory, no staging.

:class:`HostRegistry` keeps pool memory registered with the CUDA driver (page-locked for
DMA, ``cudaHostRegister``) for as long as this process maps it: a registration is made once
per mapping and reused by every later copy, and it is dropped before the mapping can go (the
registry holds the object that keeps the mapping alive until it unregisters).

- a raw pool (``devdax:``, ``file:``) is mapped once per process and registered once, whole,
  read-only: every retrieved entry of it lies in that one registration;
- a memfs entry is a file of its own: its mapping is registered when first copied from and
  kept, least recently used first out past ``capacity`` bytes;
- an allocation (the store side) is registered writable before the device writes it and
  unregistered before it is published (publication replaces its mapping). Allocations can be
  reserved ahead, registered, so a store does not pay for registering (:meth:`TensorIO.reserve`).

:class:`TensorIO` does the copies for :class:`maru.MaruHandler`'s ``retrieve_into`` /
``store_from`` verbs. CPU tensors take the same path (a memcpy, nothing registered); torch is
imported only when a tensor verb is used, and CUDA only when a CUDA tensor is.

A remote handler (``storage_backend="remote"``) moves CPU tensors the same way, through its
staging buffer (the copy between the tensor and the staging piece is the only one; NIXL moves
the piece to and from the pool). CUDA tensors are refused there: that needs the staging
buffer in GPU memory registered with NIXL (GPUDirect RDMA), or the host staging buffer
registered with CUDA whole, neither built (doc/PYTHON.md, "Remote").
"""

from __future__ import annotations

import collections
import logging
import os
import threading
import time
import warnings
from dataclasses import dataclass
from typing import Any, Dict, Iterable, List, Optional, Protocol, Sequence, Tuple

from .buffers import address_of

logger = logging.getLogger(__name__)

#: cudaHostRegister flags (driver_types.h).
CUDA_HOST_REGISTER_PORTABLE = 0x01
CUDA_HOST_REGISTER_MAPPED = 0x02
CUDA_HOST_REGISTER_READ_ONLY = 0x08

#: Default bound on the bytes of memfs entry mappings kept registered
#: (``MARU_CUDA_REGISTER_BYTES``); raw pools are registered whole regardless. A registration
#: keeps its entry mapped, so entries deleted or evicted meanwhile hold their memory until
#: newer registrations push theirs out: the bound is also what that can hold back.
DEFAULT_REGISTER_BYTES = 4 << 30


class Driver(Protocol):
    """What the registry needs from the CUDA runtime (a fake one in tests)."""

    def register(self, addr: int, nbytes: int, read_only: bool) -> None: ...

    def unregister(self, addr: int) -> None: ...


class CudaDriver:
    """``cudaHostRegister`` / ``cudaHostUnregister`` through torch's CUDA runtime bindings."""

    def __init__(self) -> None:
        import torch

        torch.cuda.init()
        self._rt = torch.cuda.cudart()
        self._ok = self._rt.cudaError.success

    def _check(self, what: str, err: Any) -> None:
        if err != self._ok:
            raise OSError(f"{what}: {self._rt.cudaGetErrorString(err)} ({int(err)})")

    def register(self, addr: int, nbytes: int, read_only: bool) -> None:
        # Portable: usable from every device's context; Mapped: addressable from kernels
        # (LMCache's transfer kernels read host KV through the device pointer).
        flags = CUDA_HOST_REGISTER_PORTABLE | CUDA_HOST_REGISTER_MAPPED
        if read_only:
            # Sealed entries are mapped read-only; pinning them for write access would fail.
            flags |= CUDA_HOST_REGISTER_READ_ONLY
        self._check("cudaHostRegister", self._rt.cudaHostRegister(addr, nbytes, flags))

    def unregister(self, addr: int) -> None:
        self._check("cudaHostUnregister", self._rt.cudaHostUnregister(addr))


@dataclass
class _Registration:
    addr: int
    nbytes: int
    keep: Any  # what keeps the range mapped while it is registered
    whole_pool: bool


@dataclass
class RegistryStats:
    """What registering cost this process so far."""

    registered: int = 0  # registrations made
    unregistered: int = 0
    failed: int = 0  # registrations refused by the driver (the copy then goes unregistered)
    register_s: float = 0.0
    unregister_s: float = 0.0
    live: int = 0  # registrations held now
    live_bytes: int = 0

    def as_dict(self) -> Dict[str, Any]:
        return dict(self.__dict__)


class HostRegistry:
    """Pool mappings registered with the CUDA driver, kept while mapped.

    Args:
        driver: the CUDA runtime (a :class:`CudaDriver`), or a stand-in.
        capacity: bytes of entry mappings kept registered; the least recently used go first.
    """

    def __init__(self, driver: Driver, capacity: int = DEFAULT_REGISTER_BYTES) -> None:
        self._driver = driver
        self._capacity = max(0, int(capacity))
        self._lock = threading.Lock()
        self._entries: "collections.OrderedDict[int, _Registration]" = collections.OrderedDict()
        self._pools: List[_Registration] = []  # whole raw pools: few, searched by range
        self._entry_bytes = 0
        self.stats = RegistryStats()

    def _covering(self, addr: int, nbytes: int) -> bool:
        for p in self._pools:
            if p.addr <= addr and addr + nbytes <= p.addr + p.nbytes:
                return True
        return False

    def _register(self, addr: int, nbytes: int, read_only: bool) -> bool:
        t0 = time.perf_counter()
        try:
            self._driver.register(addr, nbytes, read_only)
        except OSError as e:
            self.stats.failed += 1
            if self.stats.failed == 1:
                logger.warning("maru: cannot register %d bytes at %#x with CUDA (%s); "
                               "copies from unregistered memory are slower", nbytes, addr, e)
            return False
        self.stats.register_s += time.perf_counter() - t0
        self.stats.registered += 1
        self.stats.live += 1
        self.stats.live_bytes += nbytes
        return True

    def _unregister(self, r: _Registration) -> None:
        t0 = time.perf_counter()
        try:
            self._driver.unregister(r.addr)
        except OSError as e:
            logger.warning("maru: cudaHostUnregister of %#x failed: %s", r.addr, e)
        self.stats.unregister_s += time.perf_counter() - t0
        self.stats.unregistered += 1
        self.stats.live -= 1
        self.stats.live_bytes -= r.nbytes
        r.keep = None  # only now may the mapping go

    def register_pool(self, view: Any) -> bool:
        """Register a whole raw pool's read-only view once; True if it is registered."""
        addr, nbytes = address_of(view), len(memoryview(view))
        with self._lock:
            if self._covering(addr, nbytes):
                return True
            if not self._register(addr, nbytes, read_only=True):
                return False
            self._pools.append(_Registration(addr, nbytes, view, True))
            return True

    def covers(self, buf: Any) -> bool:
        """Whether all of ``buf`` lies in a registration held now."""
        addr, nbytes = address_of(buf), len(memoryview(buf))
        with self._lock:
            r = self._entries.get(addr)
            return (r is not None and nbytes <= r.nbytes) or self._covering(addr, nbytes)

    def ensure(self, buf: Any, keep: Any, read_only: bool) -> bool:
        """Make sure ``buf`` is registered, keeping ``keep`` (what keeps it mapped) referenced
        until it is unregistered. True if it is registered now."""
        addr, nbytes = address_of(buf), len(memoryview(buf))
        if nbytes == 0:
            return True
        with self._lock:
            r = self._entries.get(addr)
            if r is not None and nbytes <= r.nbytes:
                self._entries.move_to_end(addr)
                return True
            if self._covering(addr, nbytes):
                return True
            if r is not None:  # a shorter registration at the same address: replace it
                self._drop(addr)
            if not self._register(addr, nbytes, read_only):
                return False
            self._entries[addr] = _Registration(addr, nbytes, keep, False)
            self._entry_bytes += nbytes
            # Registrations made just now stay: the caller copies from them next.
            while self._entry_bytes > self._capacity and len(self._entries) > 1:
                oldest = next(iter(self._entries))
                if oldest == addr:
                    break
                self._drop(oldest)
            return True

    def _drop(self, addr: int) -> None:
        r = self._entries.pop(addr, None)
        if r is not None:
            self._entry_bytes -= r.nbytes
            self._unregister(r)

    def release(self, buf: Any) -> None:
        """Unregister ``buf``'s registration (before its mapping is replaced or unmapped)."""
        addr = address_of(buf)
        with self._lock:
            self._drop(addr)

    def close(self) -> None:
        """Unregister everything (the mappings may go afterwards)."""
        with self._lock:
            for addr in list(self._entries):
                self._drop(addr)
            for p in self._pools:
                self._unregister(p)
            self._pools.clear()


def _torch() -> Any:
    import torch

    return torch


def tensor_bytes(t: Any) -> Any:
    """The bytes of a contiguous tensor, as a flat uint8 tensor over the same memory.

    Raises:
        ValueError: ``t`` is not a contiguous tensor.
    """
    torch = _torch()
    if not isinstance(t, torch.Tensor):
        raise TypeError(f"expected a torch.Tensor, got {type(t).__name__}")
    if not t.is_contiguous():
        raise ValueError("the tensor must be contiguous (call .contiguous() first)")
    return t.reshape(-1).view(torch.uint8)


def frombuffer(buf: Any, dtype: Any = None, count: int = -1, offset: int = 0) -> Any:
    """A CPU tensor over ``buf`` (a pool view, read-only or not), no copy: ``torch.frombuffer``
    without its warning about read-only buffers (sealed entries are read-only pages; torch
    cannot enforce that, and the views refuse writes only through the buffer protocol)."""
    torch = _torch()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", UserWarning)
        return torch.frombuffer(buf, dtype=dtype or torch.uint8, count=count, offset=offset)


def _host_tensor(buf: Any) -> Any:
    return frombuffer(buf)


class TensorIO:
    """The tensor verbs of one :class:`maru.MaruHandler`.

    Args:
        handler: the handler (connected).
        register_bytes: bound on registered memfs entry mappings (default
            ``$MARU_CUDA_REGISTER_BYTES`` or 4 GiB).
        driver: the CUDA runtime; by default :class:`CudaDriver` on first use of a CUDA tensor.
    """

    def __init__(self, handler: Any, register_bytes: Optional[int] = None,
                 driver: Optional[Driver] = None) -> None:
        self._h = handler
        if register_bytes is None:
            register_bytes = int(os.environ.get("MARU_CUDA_REGISTER_BYTES", DEFAULT_REGISTER_BYTES))
        self._register_bytes = register_bytes
        self._driver = driver
        # A driver given explicitly registers for every copy, CPU tensors too (a stand-in in
        # tests, or pool memory pinned for another DMA engine).
        self._explicit = driver is not None
        self._registry: Optional[HostRegistry] = None
        self._cuda: Optional[bool] = None
        self._lock = threading.Lock()
        # Reserved allocations, registered, by size (taken by store_from), the level
        # reserve() asked to keep of each size, and the thread that tops them up.
        self._reserve: Dict[int, List[Any]] = collections.defaultdict(list)
        self._level: Dict[int, int] = {}
        self._wanted: set = set()
        self._cv = threading.Condition(self._lock)
        self._refiller: Optional[threading.Thread] = None
        self._closed = False
        # A remote handler's buffers are pieces of its staging buffer: nothing registers them
        # with CUDA (a registration would keep its piece held), and CUDA tensors are refused.
        self._remote = bool(getattr(handler, "is_remote", False))

    def _host_only(self, tensors: Iterable[Any]) -> None:
        if self._remote and any(t.is_cuda for t in tensors):
            raise NotImplementedError(
                "a remote handler moves CPU tensors only: CUDA tensors need a staging buffer in "
                "GPU memory registered with NIXL, which is not built (doc/PYTHON.md, Remote)")

    # -- registration ----------------------------------------------------------------------

    def registry(self) -> HostRegistry:
        """The registry (created, with the CUDA driver, on first use)."""
        with self._lock:
            if self._registry is None:
                self._registry = HostRegistry(self._driver or CudaDriver(), self._register_bytes)
            return self._registry

    def register_entry(self, info: Any) -> bool:
        """Register a retrieved entry's pages for DMA: its raw pool, whole, once; or its own
        mapping (memfs), kept while the registry holds it. For code that hands pool memory to
        CUDA itself (LMCache's transfer kernels). True if registered; False without CUDA."""
        if not self._cuda_present():
            return False
        reg = self.registry()
        pool = self._h._raw_pool_view(info.region_id)
        if pool is not None and reg.register_pool(pool):
            return True
        return reg.ensure(info.view, info, read_only=True)

    def register_alloc(self, handle: Any) -> bool:
        """Register an allocation's pages writable, for a device to write them; call
        :meth:`unregister_alloc` before storing or freeing it. False without CUDA."""
        if not self._cuda_present():
            return False
        return self.registry().ensure(handle.buf, handle, read_only=False)

    def unregister_alloc(self, handle: Any) -> None:
        """Drop an allocation's registration (publication and free replace its mapping)."""
        with self._lock:
            reg = self._registry
        if reg is not None:
            reg.release(handle.buf)

    # -- pool -> tensors ---------------------------------------------------------------------

    def retrieve_into(self, keys: Sequence[Any], tensors: Sequence[Any]) -> List[bool]:
        """Copy each key's entry into its tensor (one exchange with marud for the misses);
        False where a key has no entry (its tensor is left as it was).

        Raises:
            ValueError: lengths differ, a tensor is not contiguous, or an entry's size is not
                its tensor's (checked for all before anything is copied).
        """
        if len(keys) != len(tensors):
            raise ValueError("keys and tensors must have the same length")
        dsts = [tensor_bytes(t) for t in tensors]
        self._host_only(dsts)
        infos = self._h.batch_retrieve(keys)
        for key, info, dst in zip(keys, infos, dsts):
            if info is not None and len(info.view) != dst.numel():
                raise ValueError(f"the entry of {key!r} holds {len(info.view)} bytes, "
                                 f"its tensor {dst.numel()}")
        devices = set()
        for info, dst in zip(infos, dsts):
            if info is None or dst.numel() == 0:
                continue
            if dst.is_cuda or self._explicit:
                self.register_entry(info)
            if dst.is_cuda:
                devices.add(dst.device)
            dst.copy_(_host_tensor(info.view), non_blocking=dst.is_cuda)
        self._sync(devices)  # the views (and their holds) stay referenced until here
        return [info is not None for info in infos]

    # -- tensors -> pool -----------------------------------------------------------------------

    def reserve(self, size: int, count: int) -> int:
        """Keep ``count`` allocations of ``size`` bytes ready for the store verbs, registered
        when CUDA is present: they are allocated (and registered) now, and once the store
        verbs have taken half of them a background thread tops them up again, so stores do
        not wait for allocating and registering. ``count=0`` gives them back. Returns how
        many are reserved now. Marud frees reserved allocations with the connection."""
        size, count = int(size), int(count)
        if size <= 0 or count < 0:
            raise ValueError("size must be positive and count not negative")
        with self._lock:
            if self._closed:
                raise RuntimeError("the handler is closing")
            self._level[size] = count
            spares = self._reserve[size]
            extra = spares[count:]
            del spares[count:]
        self._give_back(extra)
        self._fill(size)
        return self.reserved(size)

    def reserved(self, size: int) -> int:
        with self._lock:
            return len(self._reserve.get(int(size), ()))

    def _fill(self, size: int) -> None:
        """Allocate (and register) reserved allocations of ``size`` up to its level."""
        while True:
            with self._lock:
                if self._closed or len(self._reserve[size]) >= self._level.get(size, 0):
                    return
            a = self._h._alloc_any(size)
            self.register_alloc(a)
            with self._lock:
                keep = not self._closed and len(self._reserve[size]) < self._level.get(size, 0)
                if keep:
                    self._reserve[size].append(a)
            if not keep:
                self._give_back([a])
                return

    def _give_back(self, handles: Iterable[Any]) -> None:
        for a in handles:
            try:
                self.unregister_alloc(a)
                self._h.free(a)
            except (ValueError, RuntimeError):
                pass  # the connection is going: marud frees them with it

    def _refill_loop(self) -> None:
        while True:
            with self._cv:
                while not self._wanted and not self._closed:
                    self._cv.wait()
                if self._closed:
                    return
                size = self._wanted.pop()
            try:
                self._fill(size)
            except Exception as e:  # pools full, connection gone: stop topping this size up
                logger.debug("maru: cannot top up the reserve of %d-byte allocations: %s", size, e)
                with self._lock:
                    self._level[size] = len(self._reserve[size])

    def take(self, size: int) -> Any:
        """An allocation of ``size`` bytes for a device to write: a reserved one if any, else a
        new one, registered when CUDA is present. Unregister it (:meth:`unregister_alloc`)
        before storing or freeing it."""
        return self._take(int(size), self._cuda_present())

    def _take(self, size: int, register: bool) -> Any:
        with self._cv:
            spares = self._reserve.get(size)
            # Oldest first, as libmaru's spares: a reserve's bottom, kept for good, would
            # keep its pack's memory from ever coming back (eviction passes such packs by).
            a = spares.pop(0) if spares else None
            level = self._level.get(size, 0)
            if level and len(self._reserve[size]) * 2 < level and not self._closed:
                self._wanted.add(size)
                if self._refiller is None:
                    self._refiller = threading.Thread(
                        target=self._refill_loop, name="maru-reserve", daemon=True)
                    self._refiller.start()
                self._cv.notify()
        if a is None:
            a = self._h._alloc_any(size)
        if register:
            self.registry().ensure(a.buf, a, read_only=False)
        return a

    def store_from(self, keys: Sequence[Any], tensors: Sequence[Any]) -> List[bool]:
        """Store each tensor's bytes under its key: the device writes the allocation's pool
        pages (DMA), then every entry is published in one exchange. Results as
        :meth:`maru.MaruHandler.store` (True also when the key existed).

        Raises:
            ValueError: lengths differ, a tensor is not contiguous or is empty.
            NoSpaceError: the pools are full (nothing is published then).
        """
        if len(keys) != len(tensors):
            raise ValueError("keys and tensors must have the same length")
        srcs = [tensor_bytes(t) for t in tensors]
        self._host_only(srcs)
        for key, src in zip(keys, srcs):
            if src.numel() == 0:
                raise ValueError(f"the tensor for {key!r} is empty (entries hold at least a byte)")
        handles: List[Any] = []
        devices = set()
        try:
            for src in srcs:
                a = self._take(src.numel(), src.is_cuda or self._explicit)
                handles.append(a)
                if src.is_cuda:
                    devices.add(src.device)
                _host_tensor(a.buf).copy_(src, non_blocking=src.is_cuda)
            self._sync(devices)
        except BaseException:
            self._sync(devices)  # no copy may still be writing what is freed next
            self._unregister(handles)
            for a in handles:
                self._h.free(a)
            raise
        # Publication replaces each allocation's mapping: unregister first.
        self._unregister(handles)
        return self._h.batch_store(list(keys), handles)

    def _unregister(self, handles: Iterable[Any]) -> None:
        # Reserved allocations are registered whatever the tensor's device: always look.
        for a in handles:
            self.unregister_alloc(a)

    # -- helpers --------------------------------------------------------------------------------

    def _cuda_present(self) -> bool:
        if self._remote:
            return False
        if self._explicit:
            return True
        if self._cuda is None:
            try:
                self._cuda = bool(_torch().cuda.is_available())
            except ImportError:
                self._cuda = False
        return self._cuda

    @staticmethod
    def _sync(devices: Iterable[Any]) -> None:
        devices = list(devices)
        if devices:
            torch = _torch()
            for d in devices:
                torch.cuda.current_stream(d).synchronize()

    def stats(self) -> Dict[str, Any]:
        with self._lock:
            reserved = {size: len(v) for size, v in self._reserve.items() if v}
            reg = self._registry
        out: Dict[str, Any] = {"reserved": reserved}
        if reg is not None:
            out["registry"] = reg.stats.as_dict()
        return out

    def close(self) -> Tuple[int, int]:
        """Unregister everything and give the reserved allocations back; (registrations
        dropped, allocations freed)."""
        with self._cv:
            self._closed = True
            self._cv.notify_all()
            refiller = self._refiller
        if refiller is not None:
            refiller.join()  # it may be in the middle of an allocation
        with self._lock:
            spares = [a for v in self._reserve.values() for a in v]
            self._reserve.clear()
            reg, self._registry = self._registry, None
        live = 0
        if reg is not None:
            live = reg.stats.live
            reg.close()
        for a in spares:
            try:
                self._h.free(a)
            except (ValueError, RuntimeError):
                pass  # the connection is going: marud frees them with it
        return live, len(spares)
