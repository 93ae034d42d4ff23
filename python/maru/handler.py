"""MaruHandler: the original design's client API over libmaru (the native core).

``MaruHandler(config)`` talks to the local marud through libmaru (``maru._native``):

- ``exists`` and a repeated ``retrieve`` are answered from the namespace's shared index
  without a round trip to marud;
- ``alloc`` hands out pool memory (``AllocHandle.buf``) and ``store`` publishes it without a
  copy; ``retrieve`` returns the pool's own pages (``MemoryInfo.view``), on every pool kind;
- every ``batch_*`` verb is one exchange with marud;
- the GIL is released while a call waits for marud.

With ``MaruConfig(storage_backend="remote")`` the same verbs run against a memory node's
pool over NIXL (:mod:`maru.remote`); ``connect`` picks the core, everything else goes
through it.

Keys are ``str``, ``bytes`` or ``int``; :func:`maru.keys.encode_key` maps each to an
entry name (any key works: ``/``, NUL, unicode, long keys), the one encoding the Rust
client and the LMCache plugin use too. :meth:`MaruHandler.path_of` gives the entry's file
under the mount, for programs in other languages.
"""

from __future__ import annotations

import collections
import json
import logging
import os
import threading
from typing import Any, Callable, Dict, Iterable, Iterator, List, Optional, Sequence, Tuple

from . import _native, plugins, remote
from ._native import AllocHandle, MemoryInfo
from .config import MaruConfig
from .tensors import TensorIO

logger = logging.getLogger(__name__)

Key = Any  # str | bytes | int

#: Region ids from here on name memfs entries and allocations (files of their own).
MEMFS_REGION_BASE: int = _native.MEMFS_REGION_BASE

#: Bytes per page of a raw pool's region: the pool's allocation unit, so ``page_index`` times
#: this is an entry's exact offset in its pool.
RAW_PAGE_SIZE: int = _native.RAW_PAGE_SIZE


class MaruHandler:
    """A client of the local marud with the original design's verbs.

    The constructor does not connect: call :meth:`connect` (``False`` on failure) or use
    the handler as a context manager (``__enter__`` connects when ``config.auto_connect``).
    Thread-safe: any thread may call any verb; calls that wait for marud release the GIL.
    """

    def __init__(self, config: Optional[MaruConfig] = None) -> None:
        self._config = config or MaruConfig()
        # The local marud's core, or a memory node's (storage_backend="remote"): the same verbs.
        self._core: Any = None
        self._plugins: List[Any] = []
        self._lock = threading.Lock()
        self._on_region_added: Optional[Callable[[int, int], None]] = None
        self._regions_seen: Dict[int, int] = {}
        self._pools: List[Dict[str, Any]] = []
        self._closing = False
        # (region_id, page_index) -> (key, MemoryInfo) of recent retrievals (see remember_locations).
        self._located: Optional["collections.OrderedDict[tuple, Tuple[Key, MemoryInfo]]"] = None
        self._located_max = 0
        self._tensor_io: Optional[TensorIO] = None
        self._pool_views: Dict[int, Any] = {}

    # -- connection ---------------------------------------------------------------------

    def connect(self) -> bool:
        """Connect to marud (with ``storage_backend="remote"``: to the memory node's). True
        on success (or if connected already), False on failure (logged), as the original.

        Raises:
            ValueError: ``server_url`` names another host (a client talks to its own host's
                marud; in cluster mode every host runs one).
        """
        with self._lock:
            if self._core is not None:
                return True
            core = remote.open_core(self._config) if self.is_remote else self._open_local()
            if core is None:
                return False
            self._pools = json.loads(core.pools_json())
            self._core = core
            self._closing = False
        self._plugins = plugins.load()
        plugins.call(self._plugins, "on_init", self)
        return True

    def _open_local(self) -> Optional[_native.Core]:
        """The local marud's core, or None (logged)."""
        socket = self._config.socket  # raises ValueError for another host
        try:
            core = _native.Core(
                socket,
                self._config.namespace,
                str(self._config.instance_id),
                int(self._config.timeout_ms),
                int(self._config.chunk_size_bytes),
                True,
                int(self._config.namespace_mode),
            )
        except Exception as e:
            logger.error("maru: cannot connect to marud at %s: %s", socket, e)
            return None
        capacity = sum(int(p["capacity"]) for p in json.loads(core.pools_json()))
        if capacity < self._config.pool_size:
            logger.error("maru: the pools hold %d bytes, less than pool_size=%d", capacity, self._config.pool_size)
            core.close()
            return None
        return core

    def close(self) -> None:
        """Close the connection: marud frees what was allocated but not stored and drops
        this handler's pins. Views already handed out stay valid while referenced."""
        with self._lock:
            core = self._core
            if core is None:
                return
            self._closing = True
        plugins.call(self._plugins, "on_close", self)
        with self._lock:
            tio, self._tensor_io = self._tensor_io, None
        if tio is not None:
            tio.close()  # unregistered before anything it kept mapped may go
        with self._lock:
            self._core = None
            self._regions_seen.clear()
            self._pool_views.clear()
            if self._located is not None:
                self._located.clear()
        core.close()

    def __enter__(self) -> "MaruHandler":
        if self._config.auto_connect:
            self.connect()
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()

    def __del__(self) -> None:
        core = getattr(self, "_core", None)
        if core is not None:
            core.close()

    @property
    def connected(self) -> bool:
        return self._core is not None

    @property
    def is_remote(self) -> bool:
        """Whether this handler uses a memory node's pool (``storage_backend="remote"``)."""
        return self._config.is_remote

    @property
    def instance_id(self) -> str:
        return str(self._config.instance_id)

    @property
    def config(self) -> MaruConfig:
        return self._config

    def healthcheck(self) -> bool:
        """True if connected and marud answers."""
        core = self._core
        return core is not None and not self._closing and core.healthcheck()

    def _c(self) -> Any:
        core = self._core
        if core is None:
            raise RuntimeError("Not connected. Call connect() first.")
        if self._closing:
            raise RuntimeError("Handler is closing")
        return core

    # -- keys and paths -----------------------------------------------------------------

    def path_of(self, key: Key) -> str:
        """The file of ``key``'s entry under the mount (``config.mount_path``), for programs
        that read entries by path (``mmap`` it read-only).

        Raises:
            NotImplementedError: a remote handler's entries are files on the memory node
                (under its mount, at ``entry_path``), not on this host.
        """
        path = self._c().entry_path(key)
        if self.is_remote:
            raise NotImplementedError(f"a remote entry is a file on the memory node only (<its mount>/{path})")
        return os.path.join(self._config.mount_path, path)

    def list_keys(self) -> Iterator[bytes]:
        """The keys of this handler's namespace, as bytes (decoded entry names)."""
        return iter(self._c().list_keys())

    # -- KV verbs -----------------------------------------------------------------------

    def alloc(self, size: int) -> AllocHandle:
        """Allocate ``size`` bytes of pool memory (at most ``chunk_size_bytes``, as the
        original); write them through ``handle.buf``, then :meth:`store` the handle.

        Raises:
            ValueError: ``size`` is not positive or exceeds ``chunk_size_bytes``.
            NoSpaceError: the pools are full even after eviction.
        """
        handle = self._c().alloc(size)
        if self._on_region_added is not None:
            self._note_region(handle.region_id)
        return handle

    def alloc_many(self, size: int, count: int) -> List[AllocHandle]:
        """``count`` allocations of ``size`` bytes in one exchange with marud, with no
        ``chunk_size_bytes`` limit (``alloc`` asks for small sizes in batches by itself; this
        is for a batch of larger entries, such as SGLang's pages). All or none.

        Raises:
            ValueError: ``size`` is not positive.
            NoSpaceError: the pools cannot hold them all even after eviction.
        """
        core = self._c()
        many = getattr(core, "alloc_many", None)
        if many is not None:
            handles = many(size, count)
        else:  # a remote handler: its allocations are pieces of its staging buffer
            handles = [core.alloc(size, False) for _ in range(count)]
        if self._on_region_added is not None:
            for handle in handles:
                self._note_region(handle.region_id)
        return handles

    def free(self, handle: AllocHandle) -> None:
        """Give back an allocation that was not stored.

        Raises:
            ValueError: the handle was already stored or freed, or is not an allocation.
        """
        self._c().free(handle)

    def store(self, key: Key, handle: AllocHandle) -> bool:
        """Publish ``handle`` under ``key`` without copying.

        Returns True when stored, and when ``key`` already exists (entries are write-once;
        the handle is then freed, as the original); False when no pool or the namespace's
        quota has room. ``handle.buf`` stays readable afterwards as this process's private
        copy (writes to it no longer reach the pool).
        """
        return self._c().store(key, handle)

    def _alloc_any(self, size: int) -> AllocHandle:
        """An allocation of any size (no ``chunk_size_bytes`` limit)."""
        handle = self._c().alloc(size, False)
        if self._on_region_added is not None:
            self._note_region(handle.region_id)
        return handle

    def put(self, key: Key, *buffers: Any) -> bool:
        """Store a copy of ``buffers`` (concatenated) under ``key``: alloc + copy + store,
        with no ``chunk_size_bytes`` limit. Returns as :meth:`store`."""
        return self._c().put(key, [memoryview(b).cast("B") for b in buffers])

    def retrieve(self, key: Key) -> Optional[MemoryInfo]:
        """The entry of ``key`` (``MemoryInfo.view``: a read-only memoryview of the pool's own
        pages, valid while referenced; remote: of the bytes read into the staging buffer), or
        None."""
        info = self._c().retrieve(key)
        if self._located is not None and info is not None:
            self._remember([key], [info])
        return info

    @staticmethod
    def release_retrieved(infos: Iterable[Optional[MemoryInfo]]) -> None:
        """Let go of retrieved entries now rather than when they are collected (the original
        design's verb): each ``view`` is released, and with it the memory it held (a remote
        handler's piece of staging buffer; a local entry's mapping). A view that something
        still exports (a slice of it, a tensor over it) stays valid and keeps its memory."""
        for info in infos:
            if info is not None:
                info.release()

    # -- tensors (device memory <-> pool pages; see maru.tensors) -------------------------

    @property
    def tensors(self) -> TensorIO:
        """The tensor verbs' state: CUDA registrations and reserved allocations."""
        self._c()
        with self._lock:
            if self._tensor_io is None:
                self._tensor_io = TensorIO(self)
            return self._tensor_io

    def retrieve_into(self, key: Key, tensor: Any) -> bool:
        """Copy ``key``'s entry into ``tensor`` (contiguous, of the entry's byte size, on
        any device): DMA from the pool's pages, kept registered with CUDA. False if absent.

        Raises:
            ValueError: the tensor is not contiguous or its size is not the entry's.
        """
        return self.tensors.retrieve_into([key], [tensor])[0]

    def batch_retrieve_into(self, keys: Sequence[Key], tensors: Sequence[Any]) -> List[bool]:
        """:meth:`retrieve_into` for many keys: one exchange with marud for the entries not
        yet mapped, every copy queued, one wait. Sizes are checked before anything is copied."""
        return self.tensors.retrieve_into(keys, tensors)

    def store_from(self, key: Key, tensor: Any) -> bool:
        """Store ``tensor``'s bytes (contiguous, on any device) under ``key``: the device
        writes the pool's pages (DMA), with no staging buffer. Returns as :meth:`store`."""
        return self.tensors.store_from([key], [tensor])[0]

    def batch_store_from(self, keys: Sequence[Key], tensors: Sequence[Any]) -> List[bool]:
        """:meth:`store_from` for many tensors: every copy queued, one wait, one publication."""
        return self.tensors.store_from(keys, tensors)

    def reserve(self, size: int, count: int) -> int:
        """Allocate ``count`` allocations of ``size`` bytes ahead, registered with CUDA when it
        is present, for the store verbs to take; returns how many are reserved now."""
        return self.tensors.reserve(size, count)

    def _raw_pool_view(self, region_id: int) -> Optional[Any]:
        """The read-only view of a raw pool (one per handler), or None (memfs, or not mapped)."""
        view = self._pool_views.get(region_id)
        if view is None and self._pool(region_id) is not None:
            view = self._c().pool_view(region_id)
            if view is not None:
                self._pool_views[region_id] = view
        return view

    # -- locations (for allocator adapters) ------------------------------------------------

    def remember_locations(self, count: int) -> None:
        """Keep the :class:`MemoryInfo` of each entry retrieved, by location, until
        :meth:`retrieved_at` takes it (at most the last ``count`` retrieved; 0 forgets them).
        Allocator adapters that are handed only a ``(region_id, page_index)`` after a retrieve
        (LMCache's MaruBackend) find the entry's memory, and the hold on it the view keeps,
        again; nothing is kept past that (a view kept keeps a deleted entry's memory)."""
        with self._lock:
            self._located_max = max(0, int(count))
            self._located = collections.OrderedDict() if self._located_max else None

    def retrieved_at(self, region_id: int, page_index: int) -> Optional[Tuple[Key, MemoryInfo]]:
        """The key it was retrieved by and the remembered :class:`MemoryInfo` at
        ``(region_id, page_index)``, or None; taken: each retrieve of the entry is found once."""
        located = self._located
        if located is None:
            return None
        with self._lock:
            found = located.get((region_id, page_index))
            if found is None:
                return None
            key, info, count = found
            if count > 1:
                located[(region_id, page_index)] = (key, info, count - 1)
            else:
                del located[(region_id, page_index)]
            return key, info

    def _remember(self, keys: Iterable[Key], infos: Iterable[Optional[MemoryInfo]]) -> None:
        with self._lock:
            located = self._located
            if located is None:
                return
            for key, info in zip(keys, infos):
                if info is None:
                    continue
                where = (info.region_id, info.page_index)
                count = located[where][2] if where in located else 0
                located[where] = (key, info, count + 1)
                located.move_to_end(where)
            while len(located) > self._located_max:
                located.popitem(last=False)

    def exists(self, key: Key) -> bool:
        return self._c().exists(key)

    def delete(self, key: Key) -> bool:
        """Delete ``key``'s entry; False if there was none. Views held elsewhere stay valid."""
        return self._c().delete(key)

    def pin(self, key: Key) -> bool:
        """Take one of this handler's pins on ``key`` (a count; marud never evicts a pinned
        entry). True if the key exists. Pins end with :meth:`unpin` or when this handler's
        connection does; they are apart from an operator's persistent pin."""
        return self._c().hold(key, True)

    def unpin(self, key: Key) -> bool:
        """Give back one of this handler's pins on ``key``; False if it held none."""
        return self._c().hold(key, False)

    # -- batch verbs (one exchange with marud each) ---------------------------------------

    def batch_retrieve(self, keys: Sequence[Key]) -> List[Optional[MemoryInfo]]:
        results = self._c().batch_retrieve(keys)
        if self._located is not None:
            self._remember(keys, results)
        if self._plugins:
            plugins.call(self._plugins, "on_batch_retrieve", self, keys, results)
        return results

    def batch_store(self, keys: Sequence[Key], handles: Sequence[AllocHandle]) -> List[bool]:
        if len(keys) != len(handles):
            raise ValueError("keys and handles must have the same length")
        return self._c().batch_store(keys, handles)

    def batch_exists(self, keys: Sequence[Key]) -> List[bool]:
        return self._c().batch_exists(keys)

    def batch_delete(self, keys: Iterable[Key]) -> List[bool]:
        return self._c().batch_delete(list(keys))

    def batch_pin(self, keys: Sequence[Key]) -> List[bool]:
        return self._c().batch_hold(keys, True)

    def batch_unpin(self, keys: Sequence[Key]) -> List[bool]:
        return self._c().batch_hold(keys, False)

    # -- regions (the original's accessors) -------------------------------------------------
    #
    # A raw pool (devdax:, file:) is a region: its id is the pool's id and page_index counts
    # chunk_size_bytes pages from the pool's start. A memfs entry or allocation is a file of
    # its own, a region of its own: MEMFS_REGION_BASE + its id, page 0.

    def get_chunk_size(self) -> int:
        return int(self._config.chunk_size_bytes)

    def _pool(self, region_id: int) -> Optional[Dict[str, Any]]:
        for p in self._pools:
            if int(p["id"]) == region_id and p["kind"] != "memfs":
                return p
        return None

    def get_buffer_view(self, region_id: int, offset: int, size: int) -> Optional[memoryview]:
        """A read-only view of ``size`` bytes at ``offset`` of a raw-pool region this handler
        has used (None otherwise, or out of range)."""
        if self._pool(region_id) is None or offset < 0 or size < 0:
            return None
        view = self._c().pool_view(region_id)
        if view is None or offset + size > len(view):
            return None
        return view[offset : offset + size]

    def get_region_page_count(self, region_id: int) -> Optional[int]:
        p = self._pool(region_id)
        if p is None:
            return None
        return int(p.get("mapped_len") or p["capacity"]) // RAW_PAGE_SIZE

    def is_region_mapped(self, region_id: int) -> bool:
        return self._pool(region_id) is not None and self._c().pool_view(region_id) is not None

    def get_region_dax_path(self, region_id: int) -> Optional[str]:
        """The device or file of a raw-pool region (None for others)."""
        p = self._pool(region_id)
        return None if p is None else str(p["path"])

    def get_owned_region_ids(self) -> List[int]:
        """The raw-pool regions this handler has allocated in."""
        return sorted(r for r in self._regions_seen if r < MEMFS_REGION_BASE)

    def set_on_region_added(self, callback: Optional[Callable[[int, int], None]]) -> None:
        """Call ``callback(region_id, page_count)`` when this handler first allocates in a
        region; replayed at once for the regions it already uses (as the original)."""
        self._on_region_added = callback
        if callback is not None:
            for rid, pages in list(self._regions_seen.items()):
                callback(rid, pages)

    def _note_region(self, region_id: int) -> None:
        if region_id in self._regions_seen or region_id >= MEMFS_REGION_BASE:
            return
        pages = self.get_region_page_count(region_id) or 0
        self._regions_seen[region_id] = pages
        cb = self._on_region_added
        if cb is not None:
            cb(region_id, pages)

    # -- statistics -----------------------------------------------------------------------

    def get_stats(self) -> Dict[str, Any]:
        """The original's keys (``kv_manager``, ``allocation_manager``, ``store_regions``,
        ``allocator``, ``plugins``) from marud's statistics, plus maru's own under ``maru``;
        for a remote handler the original's ``remote_storage`` (see :func:`maru.remote.get_stats`)."""
        if self.is_remote:
            return remote.get_stats(self, self._c(), plugins.stats(self._plugins, self))
        raw = json.loads(self._c().stats_json())
        pools = raw.get("pools", [])
        entries = sum(int(p.get("entries", 0)) for p in pools)
        sealed = sum(int(p.get("sealed_bytes", 0)) for p in pools)
        clients = raw.get("clients", [])
        me = [c for c in clients if c.get("name") == self.instance_id]
        regions = [
            {
                "region_id": int(p["id"]) if p["kind"] != "memfs" else None,
                "pool": p["name"],
                "kind": p["kind"],
                "total_size": int(p["capacity"]),
                "used_size": int(p["used"]),
                "free_size": int(p["capacity"]) - int(p["used"]),
                "num_pages": int(p["capacity"]) // self.get_chunk_size(),
            }
            for p in pools
        ]
        out: Dict[str, Any] = {
            "kv_manager": {"total_entries": entries, "total_size": sealed},
            "allocation_manager": {
                "num_allocations": sum(int(c.get("allocated", 0)) > 0 for c in clients),
                "total_allocated": sum(int(c.get("allocated", 0)) for c in clients),
                "active_clients": len(clients),
            },
            "store_regions": {"num_regions": len(regions), "regions": regions},
            "allocator": regions[0] if regions else {},
            "plugins": plugins.stats(self._plugins, self),
            "maru": {
                "namespace": self._config.namespace,
                "this_client": me[0] if me else {},
                "ops": raw.get("ops", {}),
                "eviction": raw.get("eviction"),
                "uptime_s": raw.get("uptime_s"),
                "tensors": self._tensor_io.stats() if self._tensor_io is not None else {},
            },
        }
        return out

    def __repr__(self) -> str:
        state = "connected" if self._core is not None else "not connected"
        where = f", remote {self._config.remote_url}" if self.is_remote else ""
        return f"MaruHandler({self._config.namespace!r}{where}, {state})"

