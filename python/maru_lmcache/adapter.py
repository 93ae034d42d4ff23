"""CxlMemoryAdapter: LMCache's ``MemoryAllocatorInterface`` over a :class:`maru.MaruHandler`.

LMCache's ``MaruBackend`` allocates its memory objects here, writes KV into them, and stores
them with ``handler.store(key, adapter.create_store_handle(obj))``; it retrieves with
``handler.retrieve`` / ``batch_retrieve`` and turns each result into a memory object with
``adapter.get_by_location(region_id=…, page_index=…, actual_size=…, single_token_size=…)``.

Every memory object's tensor is pool memory, with no copy on either side:

- an allocated object's tensor is the :class:`~maru.AllocHandle`'s ``buf``: LMCache writes
  the KV straight into the pool, and the store publishes those pages;
- a retrieved object's tensor is the entry's ``MemoryInfo.view`` (read-only pages of the
  pool), and it keeps the hold on the entry that the view carries, so the pool does not
  reuse those pages while LMCache still reads them.

Where CUDA is present, both kinds are registered with the driver (``maru.tensors``): LMCache's
GPU connector then moves KV between the GPU and the pool's pages by DMA. Allocations come
from the handler's reserve (``handler.reserve``) when it holds some, already registered;
they are unregistered before they are stored or freed. Retrieved entries stay registered
while the handler's registry keeps them (a raw pool is registered once, whole).

Lookup pins on LMCache's asynchronous load path. There ``MaruBackend.batched_async_contains``
pins the chunks it finds (``handler.batch_pin``: holds in marud, which keep them from
eviction until the load), and LMCache 0.5.6 never gives those pins back (its issue 3027): in a
long-running engine every chunk it ever loaded asynchronously would stay pinned. LMCache pins a
retrieved memory object itself (its own count) on that path only, right after the retrieve; on
that first pin the object takes over the lookup's pin: the adapter gives the handler's pin on
the key back to marud, and the object's mapping keeps the bytes from then on. An LMCache that
releases those pins itself (its fix declares ``has_external_pin_state`` on the backend) is
left to do it: the adapter then releases nothing.

Unlike the original, which carved fixed pages of ``chunk_size`` in its regions and built a
memory object per page up front, allocations here are the size LMCache asks for (a partial
last chunk takes only its bytes), and nothing is built before it is used.
"""

from __future__ import annotations

import functools
import inspect
import threading
from typing import Any, Callable, Dict, List, Optional, Union

import torch
from lmcache.logging import init_logger
from lmcache.v1.memory_management import (
    MemoryAllocatorInterface,
    MemoryFormat,
    MemoryObj,
    MemoryObjMetadata,
    TensorMemoryObj,
)

from maru import AllocHandle, MaruHandler
from maru.errors import MaruError
from maru.tensors import frombuffer

logger = init_logger(__name__)

#: How many retrieved entries the handler remembers by location for get_by_location at most
#: (each is taken by the get_by_location that follows its retrieve: only retrieves never
#: followed by one stay, the oldest forgotten first).
REMEMBERED_LOCATIONS = 8192


def lmcache_releases_async_lookup_pins() -> bool:
    """Whether this LMCache gives back the pins of its asynchronous lookups itself: its fix
    of issue 3027 has backends declare ``has_external_pin_state``; 0.5.6 has no such thing."""
    try:
        from lmcache.v1.storage_backend.maru_backend import MaruBackend
    except ImportError:
        return False
    attr = inspect.getattr_static(MaruBackend, "has_external_pin_state", None)
    if attr is None:
        return False
    if isinstance(attr, property):
        try:
            return bool(attr.fget(None))
        except Exception:  # noqa: BLE001 - a property that needs its instance: LMCache has the fix
            return True
    return bool(attr)


class RetrievedMemoryObj(TensorMemoryObj):
    """A retrieved entry's memory object. Its first pin by LMCache (taken on the asynchronous
    load path only) runs ``on_first_pin``: the adapter gives back the lookup's pin in marud."""

    def __init__(self, raw: torch.Tensor, metadata: MemoryObjMetadata, on_first_pin: Optional[Callable[[], None]]):
        super().__init__(raw, metadata, parent_allocator=None)
        self._on_first_pin = on_first_pin

    def pin(self) -> bool:
        hand_over, self._on_first_pin = self._on_first_pin, None
        if hand_over is not None:
            hand_over()
        return super().pin()


class CxlMemoryAdapter(MemoryAllocatorInterface):
    """LMCache memory objects in maru pool memory.

    Args:
        handler: a connected :class:`maru.MaruHandler`.
        shapes, dtypes, fmt: the layout of one full chunk (LMCache's metadata).
        chunk_size: bytes of one full chunk (``handler.get_chunk_size()``).
    """

    def __init__(
        self,
        handler: MaruHandler,
        shapes: List[torch.Size],
        dtypes: List[torch.dtype],
        fmt: MemoryFormat,
        chunk_size: int,
    ) -> None:
        self._handler = handler
        self._shapes = list(shapes)
        self._dtypes = list(dtypes)
        self._fmt = fmt
        self._chunk_size = int(chunk_size)
        self._lock = threading.Lock()
        # Allocations handed out and not yet stored or freed, by encoded address.
        self._allocs: Dict[int, AllocHandle] = {}
        self._hand_over_pins = not lmcache_releases_async_lookup_pins()
        handler.remember_locations(REMEMBERED_LOCATIONS)

    # -- addresses --------------------------------------------------------------------------

    @staticmethod
    def encode_address(region_id: int, page_index: int) -> int:
        """One integer for a location: ``(region_id << 32) | page_index``, as the original."""
        return (region_id << 32) | page_index

    @staticmethod
    def decode_address(address: int) -> tuple:
        """``(region_id, page_index)`` of an encoded address."""
        return (address >> 32, address & 0xFFFFFFFF)

    # -- memory objects -----------------------------------------------------------------------

    def _memory_obj(
        self,
        buf: memoryview,
        address: int,
        size: int,
        shapes: List[torch.Size],
        dtypes: List[torch.dtype],
        fmt: MemoryFormat,
        on_first_pin: Optional[Callable[[], None]] = None,
        allocated: bool = False,
    ) -> TensorMemoryObj:
        dtype = dtypes[0]
        raw = frombuffer(buf, dtype=dtype, count=size // dtype.itemsize)
        metadata = MemoryObjMetadata(
            shape=shapes[0],
            dtype=dtype,
            address=address,
            phy_size=size,
            ref_count=1,
            fmt=fmt,
            shapes=shapes if len(shapes) > 1 else None,
            dtypes=dtypes if len(dtypes) > 1 else None,
        )
        if on_first_pin is not None:
            return RetrievedMemoryObj(raw, metadata, on_first_pin)
        # An allocation's object is freed here when LMCache drops its last reference without
        # storing it (a backend that skips the put); once stored its handle is gone and the
        # free does nothing. A retrieved entry's object holds no allocation.
        return TensorMemoryObj(raw, metadata, parent_allocator=self if allocated else None)

    def allocate(
        self,
        shapes: Union[torch.Size, List[torch.Size]],
        dtypes: Union[torch.dtype, List[torch.dtype]],
        fmt: MemoryFormat = MemoryFormat.UNDEFINED,
        allocator_type: Optional[str] = None,
    ) -> Optional[MemoryObj]:
        """A memory object of the given layout in pool memory; None when the pools are full
        or the layout is empty or larger than a chunk."""
        shapes_list, dtypes_list = self._adapt_shapes_and_dtypes(shapes, dtypes)
        size = sum(s.numel() * d.itemsize for s, d in zip(shapes_list, dtypes_list, strict=True))
        if size <= 0 or size > self._chunk_size:
            logger.debug("[Maru] allocate: %d bytes is not in (0, %d]", size, self._chunk_size)
            return None
        try:
            handle = self._handler.tensors.take(size)
        except (ValueError, MaruError) as e:
            logger.debug("[Maru] alloc of %d bytes failed: %s", size, e)
            return None
        address = self.encode_address(handle.region_id, handle.page_index)
        with self._lock:
            self._allocs[address] = handle
        if fmt == MemoryFormat.UNDEFINED:
            fmt = self._fmt
        return self._memory_obj(handle.buf, address, size, shapes_list, dtypes_list, fmt, allocated=True)

    def batched_allocate(
        self,
        shapes: Union[torch.Size, List[torch.Size]],
        dtypes: Union[torch.dtype, List[torch.dtype]],
        batch_size: int,
        fmt: MemoryFormat = MemoryFormat.UNDEFINED,
        allocator_type: Optional[str] = None,
    ) -> Optional[List[MemoryObj]]:
        """``batch_size`` objects, or None (and nothing kept) if any allocation fails."""
        objs: List[MemoryObj] = []
        for _ in range(batch_size):
            obj = self.allocate(shapes, dtypes, fmt, allocator_type)
            if obj is None:
                self.batched_free(objs)
                return None
            objs.append(obj)
        return objs

    def free(self, memory_obj: MemoryObj, allocator_type: Optional[str] = None) -> None:
        """Give back an allocated object that was not stored (stored or retrieved objects
        hold nothing to give back: their memory is the entry's)."""
        # `meta`, not `metadata`: LMCache frees from ref_count_down holding the object's lock,
        # which `metadata` takes.
        with self._lock:
            handle = self._allocs.pop(memory_obj.meta.address, None)
        if handle is None:
            return
        try:
            self._handler.tensors.unregister_alloc(handle)
            self._handler.free(handle)
        except (ValueError, MaruError) as e:
            logger.debug("[Maru] free of %s failed: %s", handle, e)

    def batched_free(
        self,
        memory_objs: List[MemoryObj],
        allocator_type: Optional[str] = None,
        update_stats: bool = True,
    ) -> None:
        for obj in memory_objs:
            self.free(obj, allocator_type)

    def close(self) -> None:
        """Give back every allocation not stored, and stop remembering locations."""
        with self._lock:
            handles = list(self._allocs.values())
            self._allocs.clear()
        for h in handles:
            try:
                self._handler.tensors.unregister_alloc(h)
                self._handler.free(h)
            except (ValueError, MaruError, RuntimeError):
                pass  # already stored, or the handler is closed (marud frees them then)
        try:
            self._handler.remember_locations(0)
        except RuntimeError:
            pass

    # -- store and retrieve ---------------------------------------------------------------------

    def create_store_handle(self, memory_obj: MemoryObj) -> AllocHandle:
        """The allocation behind ``memory_obj``, for ``handler.store``.

        Raises:
            ValueError: the object was not allocated here, or was stored or freed already.
        """
        with self._lock:
            handle = self._allocs.pop(memory_obj.metadata.address, None)
        if handle is None:
            rid, pid = self.decode_address(memory_obj.metadata.address)
            raise ValueError(
                f"no allocation at region {rid} page {pid}: the memory object was not "
                "allocated by this adapter, or was stored or freed already"
            )
        self._handler.tensors.unregister_alloc(handle)  # publication replaces its mapping
        return handle

    def get_by_location(
        self,
        region_id: int,
        page_index: int,
        actual_size: int,
        single_token_size: int,
    ) -> Optional[MemoryObj]:
        """The memory object of an entry the handler just retrieved, at its location; None
        when the handler no longer remembers that location."""
        found = self._handler.retrieved_at(region_id, page_index)
        if found is None:
            logger.debug("[Maru] get_by_location: region %d page %d not remembered", region_id, page_index)
            return None
        key, info = found
        view = info.view
        self._handler.tensors.register_entry(info)  # for the GPU connector's DMA (if CUDA)
        if actual_size > len(view):
            logger.error("[Maru] get_by_location: %d bytes asked of a %d-byte entry", actual_size, len(view))
            return None
        shapes = list(self._shapes)
        if actual_size != self._chunk_size and single_token_size > 0:
            token_dim = self._fmt.token_dim()
            shape = list(shapes[0])
            if token_dim < len(shape):
                shape[token_dim] = actual_size // single_token_size
                shapes[0] = torch.Size(shape)
        address = self.encode_address(region_id, page_index)
        hand_over = functools.partial(self._release_lookup_pin, key) if self._hand_over_pins else None
        return self._memory_obj(view, address, actual_size, shapes, self._dtypes, self._fmt, hand_over)

    def _release_lookup_pin(self, key: Any) -> None:
        """Give back the handler's pin on ``key`` (if it holds one): a memory object over the
        entry keeps its bytes now."""
        try:
            self._handler.unpin(key)
        except (MaruError, RuntimeError) as e:  # unreachable or closed: marud drops its holds anyway
            logger.debug("[Maru] lookup pin of %s not given back: %s", key, e)
