"""An LMCache storage plugin that keeps KV chunks in the maru pool.

Configure it in LMCache's YAML (see doc/LMCACHE.md)::

    chunk_size: 256
    local_cpu: true
    max_local_cpu_size: 5
    storage_plugins: ["maru"]
    extra_config:
      storage_plugin.maru.module_path: maru.lmcache_plugin
      storage_plugin.maru.class_name: MaruStoragePlugin
      maru.socket: /run/maru/marud.sock
      maru.namespace: lmcache

What it does beyond LMCache's LocalDiskBackend on /maru:

- A chunk is written once into pool memory (one copy from LMCache's CPU
  buffer into the entry, then sealed) and read back by retrieving the entry:
  the MemoryObj handed to LMCache wraps the pool's own pages (no read, no
  copy). Those pages are mapped read-only: the MemoryObj must not be written
  (``maru.retrieve_mode: copy`` gives a private, writable copy).
- Shape, dtype, format and cached positions travel in a header inside the
  entry (:mod:`maru.chunk`), and the key is LMCache's key string (stored under
  maru's shared key encoding, the one the Rust client uses too), so the index
  *is* the namespace: any LMCache instance, in any process, that points at the
  same namespace finds and loads the chunks the others stored.
  (LocalDiskBackend's index lives in one process's memory: another process
  cannot find its files.)
- Pins are holds: ``contains(key, pin=True)`` and ``pin(key)`` retrieve the
  entry and keep its view, so its bytes stay valid until ``unpin`` even if the
  pool evicts or another instance deletes it; ``get_blocking`` then reuses
  that view.

Options (``extra_config``):

- ``maru.socket``: marud's control socket (default ``$MARU_SOCKET`` or
  ``/run/maru/marud.sock``).
- ``maru.namespace``: the namespace shared by the instances (default ``lmcache``).
- ``maru.retrieve_mode``: ``map`` (default: zero-copy) or ``copy`` (copy into
  a buffer of the LocalCPUBackend, which is pinned memory on GPU hosts).
- ``maru.put_workers``: threads that write chunks (default 2).
- ``maru.timeout_ms``: how long a call waits for marud (default 2000).
"""

from __future__ import annotations

import asyncio
import dataclasses
import errno
import threading
import time
import warnings
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Any, Callable, Dict, List, Optional, Sequence, Tuple

import torch

from lmcache.logging import init_logger
from lmcache.utils import CacheEngineKey
from lmcache.v1.memory_management import (
    BytesBufferMemoryObj,
    MemoryAllocatorInterface,
    MemoryFormat,
    MemoryObj,
    MemoryObjMetadata,
    TensorMemoryObj,
)
from lmcache.v1.storage_backend.abstract_backend import StoragePluginInterface

from .chunk import ChunkHeader, ChunkMeta, decode_header, encode_header
from .config import MaruConfig, _default_socket
from .errors import EntryFormatError, MaruError, NoSpaceError
from .handler import MaruHandler, MemoryInfo
from .tensors import frombuffer

logger = init_logger(__name__)

_EMPTY = torch.empty(0, dtype=torch.uint8)


def _dtype_name(dtype: Optional[torch.dtype]) -> str:
    return str(dtype).replace("torch.", "")


def _dtype_from_name(name: str) -> torch.dtype:
    dtype = getattr(torch, name, None)
    if not isinstance(dtype, torch.dtype):
        raise EntryFormatError(errno.EBADMSG, f"chunk header: unknown dtype {name!r}")
    return dtype


class _MappedChunk:
    """A retrieved chunk entry and its parsed header, shared by the users of one view.

    The chunk drops its reference to the view when the last user (a hold, a
    MemoryObj) goes; the mapping is released once nothing references the view
    (tensors LMCache still keeps keep it alive until they die).
    """

    def __init__(self, info: MemoryInfo, header: ChunkHeader) -> None:
        self.info: Optional[MemoryInfo] = info
        self.view: Optional[memoryview] = info.view
        self.header = header
        self._refs = 0
        self._lock = threading.Lock()

    def acquire(self) -> None:
        with self._lock:
            self._refs += 1

    def release(self) -> None:
        with self._lock:
            self._refs -= 1
            last = self._refs == 0
        if last:
            self.info = None
            self.view = None


class _MappedChunkAllocator(MemoryAllocatorInterface):
    """The "allocator" of MemoryObjs that wrap mapped chunks: freeing one releases its mapping."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._chunks: Dict[int, _MappedChunk] = {}

    def adopt(self, obj: MemoryObj, chunk: _MappedChunk) -> None:
        chunk.acquire()
        with self._lock:
            self._chunks[id(obj)] = chunk

    def allocate(self, shapes: Any, dtypes: Any, fmt: MemoryFormat = MemoryFormat.UNDEFINED,
                 allocator_type: Optional[str] = None) -> Optional[MemoryObj]:
        raise NotImplementedError("mapped chunks are made by MaruStoragePlugin.get_blocking")

    def batched_allocate(self, shapes: Any, dtypes: Any, batch_size: int,
                         fmt: MemoryFormat = MemoryFormat.UNDEFINED,
                         allocator_type: Optional[str] = None) -> Optional[List[MemoryObj]]:
        raise NotImplementedError("mapped chunks are made by MaruStoragePlugin.get_blocking")

    def free(self, memory_obj: MemoryObj, allocator_type: Optional[str] = None) -> None:
        with self._lock:
            chunk = self._chunks.pop(id(memory_obj), None)
        if chunk is None:
            return
        memory_obj.invalidate()
        if isinstance(memory_obj, TensorMemoryObj):
            memory_obj.raw_data = _EMPTY
        chunk.release()

    def batched_free(self, memory_objs: List[MemoryObj], allocator_type: Optional[str] = None,
                     update_stats: bool = True) -> None:
        for obj in memory_objs:
            self.free(obj)

    @property
    def live(self) -> int:
        """MemoryObjs handed out and not freed yet."""
        with self._lock:
            return len(self._chunks)


class MaruStoragePlugin(StoragePluginInterface):
    """LMCache storage plugin: KV chunks as sealed entries of a maru namespace.

    Constructed by LMCache's ``storage_plugin_launcher`` with the keyword
    arguments below; see the module documentation for the configuration.
    """

    def __init__(
        self,
        config: Any = None,
        metadata: Any = None,
        local_cpu_backend: Any = None,
        loop: Optional[asyncio.AbstractEventLoop] = None,
        dst_device: str = "cpu",
    ) -> None:
        super().__init__(
            dst_device=dst_device,
            config=config,
            metadata=metadata,
            local_cpu_backend=local_cpu_backend,
            loop=loop,
        )
        extra: Dict[str, Any] = dict(getattr(config, "extra_config", None) or {})
        self.retrieve_mode = str(extra.get("maru.retrieve_mode", "map"))
        if self.retrieve_mode not in ("map", "copy"):
            raise ValueError(f"maru.retrieve_mode must be 'map' or 'copy', not {self.retrieve_mode!r}")
        workers = int(extra.get("maru.put_workers", 2))
        maru_config = MaruConfig(
            socket_path=str(extra.get("maru.socket", _default_socket())),
            namespace=str(extra.get("maru.namespace", "lmcache")),
            timeout_ms=int(extra.get("maru.timeout_ms", 2000)),
            pool_size=1 << 20,  # no minimum: any pool will do
            chunk_size_bytes=1 << 20,
        )
        instance = getattr(config, "lmcache_instance_id", None)
        if instance:
            maru_config = dataclasses.replace(maru_config, instance_id=str(instance))
        self.handler = MaruHandler(maru_config)
        if not self.handler.connect():
            raise RuntimeError(
                f"maru storage plugin: cannot connect to marud at {maru_config.socket_path} "
                f"(namespace {maru_config.namespace!r}); is marud running? (see the log above)"
            )
        self._lock = threading.Lock()
        self._put_tasks: set = set()
        self._holds: Dict[CacheEngineKey, Tuple[_MappedChunk, int]] = {}
        self._lookup_holds: Dict[str, List[CacheEngineKey]] = {}
        self._allocator = _MappedChunkAllocator()
        self._put_pool = ThreadPoolExecutor(max_workers=max(1, workers), thread_name_prefix="maru-put")
        self._io_pool = ThreadPoolExecutor(max_workers=2, thread_name_prefix="maru-io")
        self._closed = False
        logger.info(
            "maru storage plugin: namespace %s, retrieve mode %s",
            maru_config.namespace, self.retrieve_mode,
        )

    def __str__(self) -> str:
        return "MaruStoragePlugin"

    # -- keys and views ----------------------------------------------------------

    @staticmethod
    def _name(key: CacheEngineKey) -> str:
        """The maru key of a chunk: LMCache's key string (the handler encodes it)."""
        return key.to_string()

    def _open_chunk(self, key: CacheEngineKey) -> Optional[_MappedChunk]:
        """Map a key's entry (or reuse the mapping of a hold); the result is acquired."""
        with self._lock:
            held = self._holds.get(key)
            if held is not None:
                held[0].acquire()
                return held[0]
        info = self.handler.retrieve(self._name(key))
        if info is None:
            return None
        try:
            header = decode_header(info.view, info.view.nbytes)
            if header.meta.key != key.to_string():
                raise EntryFormatError(errno.EBADMSG, f"chunk header names key {header.meta.key!r}")
        except EntryFormatError as e:
            logger.warning("maru: ignoring entry %s: %s", key.to_string(), e)
            return None
        chunk = _MappedChunk(info, header)
        chunk.acquire()
        return chunk

    def _memory_obj(self, chunk: _MappedChunk) -> Optional[MemoryObj]:
        """A MemoryObj for a mapped chunk: wrapping the mapping, or a copy in CPU memory."""
        header = chunk.header
        meta = header.meta
        start, size = header.header_size, header.payload_size
        fmt = MemoryFormat[meta.fmt]
        if not meta.dtypes:  # a byte buffer (serialized or compressed chunk)
            return BytesBufferMemoryObj(bytes(chunk.view[start:start + size]))
        shapes = [torch.Size(s) for s in meta.shapes]
        dtypes = [_dtype_from_name(d) for d in meta.dtypes]
        positions = (
            torch.tensor(meta.cached_positions, dtype=torch.long)
            if meta.cached_positions is not None else None
        )
        if self.retrieve_mode == "copy":
            if self.local_cpu_backend is None:
                raise RuntimeError("maru.retrieve_mode=copy needs the LocalCPUBackend")
            obj = self.local_cpu_backend.allocate(shapes, dtypes, fmt)
            if obj is None:
                return None
            try:
                with memoryview(obj.byte_array) as dst, dst.cast("B") as out:
                    out[:] = chunk.view[start:start + size]
            except BaseException:
                obj.ref_count_down()
                raise
            obj.metadata.cached_positions = positions
            return obj
        # Read-only pages: LMCache reads retrieved chunks (to the GPU, into other backends).
        # Where CUDA is present they are registered for DMA (once per mapping, kept).
        if chunk.info is not None:
            self.handler.tensors.register_entry(chunk.info)
        raw = frombuffer(chunk.view, count=size, offset=start)
        obj = TensorMemoryObj(
            raw_data=raw,
            metadata=MemoryObjMetadata(
                shape=shapes[0],
                dtype=dtypes[0],
                address=0,
                phy_size=size,
                ref_count=1,
                pin_count=0,
                fmt=fmt,
                cached_positions=positions,
                shapes=shapes,
                dtypes=dtypes,
            ),
            parent_allocator=self._allocator,
        )
        self._allocator.adopt(obj, chunk)
        return obj

    # -- lookups and holds -------------------------------------------------------

    def contains(self, key: CacheEngineKey, pin: bool = False) -> bool:
        """Whether the namespace holds a chunk for ``key`` (any instance may have stored it).

        With ``pin``, the chunk is also held (its view kept) until :meth:`unpin`: a
        later ``get_blocking`` returns its bytes even if the entry was evicted
        or removed meanwhile (``contains`` itself reports the namespace).
        """
        if pin:
            return self.pin(key)
        return self.handler.exists(self._name(key))

    def exists_in_put_tasks(self, key: CacheEngineKey) -> bool:
        """Whether a put of ``key`` by this instance is still being written."""
        with self._lock:
            return key in self._put_tasks

    def pin(self, key: CacheEngineKey) -> bool:
        """Hold the chunk: keep its view so its bytes stay valid until :meth:`unpin`
        (even if the pool evicts it or someone deletes it). Holds are counted."""
        chunk = self._open_chunk(key)  # acquired: that reference is the hold's
        if chunk is None:
            return False
        spare = None
        with self._lock:
            held = self._holds.get(key)
            if held is None:
                self._holds[key] = (chunk, 1)
            else:
                if held[0] is not chunk:
                    # Another thread's pin mapped it meanwhile: its chunk holds for both.
                    held[0].acquire()
                    spare = chunk
                self._holds[key] = (held[0], held[1] + 1)
        if spare is not None:
            spare.release()
        return True

    def unpin(self, key: CacheEngineKey) -> bool:
        """Drop one hold of ``key``; False if this instance holds none."""
        with self._lock:
            held = self._holds.get(key)
            if held is None:
                return False
            chunk, count = held
            if count <= 1:
                del self._holds[key]
            else:
                self._holds[key] = (chunk, count - 1)
        chunk.release()
        return True

    def _prefix_hits(self, keys: Sequence[CacheEngineKey], pin: bool) -> int:
        hits = 0
        for key in keys:
            if not self.contains(key, pin):
                break
            hits += 1
        return hits

    async def batched_async_contains(
        self, lookup_id: str, keys: List[CacheEngineKey], pin: bool = False
    ) -> int:
        """How many of ``keys``, from the first, the namespace holds (prefix match).

        With ``pin`` the hits are held until :meth:`batched_get_non_blocking`
        for the same ``lookup_id`` loads them (or :meth:`unpin`).
        """
        loop = asyncio.get_running_loop()
        hits = await loop.run_in_executor(self._io_pool, self._prefix_hits, keys, pin)
        if pin and hits:
            with self._lock:
                self._lookup_holds.setdefault(lookup_id, []).extend(keys[:hits])
        return hits

    # -- puts ------------------------------------------------------------------

    def batched_submit_put_task(
        self,
        keys: Sequence[CacheEngineKey],
        objs: List[MemoryObj],
        transfer_spec: Any = None,
        on_complete_callback: Optional[Callable[[CacheEngineKey], None]] = None,
    ) -> Optional[List[Future]]:
        """Write chunks into the pool in the background; one future per chunk written.

        Keys already stored (by any instance) or being written are skipped.
        ``on_complete_callback(key)`` runs once a chunk is sealed (or was
        found stored by someone else meanwhile).
        """
        futures: List[Future] = []
        for key, obj in zip(keys, objs):
            with self._lock:
                if key in self._put_tasks:
                    continue
            if self.handler.exists(self._name(key)):
                continue
            with self._lock:
                if key in self._put_tasks:
                    continue
                self._put_tasks.add(key)
            obj.ref_count_up()
            try:
                futures.append(self._put_pool.submit(self._put_one, key, obj, on_complete_callback))
            except RuntimeError:  # closed
                obj.ref_count_down()
                with self._lock:
                    self._put_tasks.discard(key)
                raise
        return futures or None

    def _put_one(
        self,
        key: CacheEngineKey,
        obj: MemoryObj,
        on_complete_callback: Optional[Callable[[CacheEngineKey], None]],
    ) -> bool:
        """Write one chunk, header + payload, into a new entry and seal it
        (``MaruHandler.put``: the one copy into the pool)."""
        done = False
        try:
            meta = obj.metadata
            if isinstance(obj, BytesBufferMemoryObj) or meta.dtype is None:
                shapes: List[List[int]] = [list(meta.shape)]
                dtypes: List[str] = []
            else:
                shapes = [list(s) for s in (meta.shapes or [meta.shape])]
                dtypes = [_dtype_name(d) for d in (meta.dtypes or [meta.dtype])]
            positions = meta.cached_positions
            payload = memoryview(obj.byte_array).cast("B")
            header = encode_header(
                ChunkMeta(
                    key=key.to_string(),
                    fmt=meta.fmt.name,
                    shapes=shapes,
                    dtypes=dtypes,
                    cached_positions=positions.tolist() if positions is not None else None,
                ),
                len(payload),
            )
            try:
                # True also when another instance stored it first (write-once): as good.
                done = self.handler.put(self._name(key), header, payload)
            finally:
                payload.release()
            if not done:
                logger.warning("maru: no room in the pools or the namespace's quota, chunk %s not stored",
                               key.to_string())
        except NoSpaceError:
            logger.warning("maru: pool full, chunk %s not stored", key.to_string())
        except MaruError as e:
            logger.warning("maru: chunk %s not stored: %s", key.to_string(), e)
        except Exception:  # a put runs on a worker thread: say why it failed
            logger.exception("maru: chunk %s not stored", key.to_string())
        finally:
            obj.ref_count_down()
            with self._lock:
                self._put_tasks.discard(key)
        if done and on_complete_callback is not None:
            try:
                on_complete_callback(key)
            except Exception as e:  # LMCache's backends log callback failures too
                logger.warning("maru: on_complete_callback failed for %s: %s", key.to_string(), e)
        return done

    def wait_for_puts(self, timeout: Optional[float] = None) -> bool:
        """Wait until the chunks submitted so far are sealed (for tests and tools).

        Returns:
            True if none is pending any more, False on timeout.
        """
        end = None if timeout is None else time.monotonic() + timeout
        while True:
            with self._lock:
                if not self._put_tasks:
                    return True
            if end is not None and time.monotonic() > end:
                return False
            time.sleep(0.001)

    # -- gets ------------------------------------------------------------------

    def get_blocking(self, key: CacheEngineKey) -> Optional[MemoryObj]:
        """Load a chunk: a MemoryObj on the pool's read-only pages (``map``) or a CPU copy (``copy``).

        Returns:
            The chunk, or None if the namespace has none for ``key``.
        """
        chunk = self._open_chunk(key)
        if chunk is None:
            return None
        try:
            return self._memory_obj(chunk)
        finally:
            chunk.release()

    def get_non_blocking(self, key: CacheEngineKey, location: Optional[str] = None) -> Optional[Future]:
        """:meth:`get_blocking` on a worker thread; None if the key is not stored."""
        if not self.contains(key):
            return None
        return self._io_pool.submit(self.get_blocking, key)

    def _get_prefix(self, keys: Sequence[CacheEngineKey]) -> List[MemoryObj]:
        objs: List[MemoryObj] = []
        for key in keys:
            obj = self.get_blocking(key)
            if obj is None:
                break
            objs.append(obj)
        return objs

    async def batched_get_non_blocking(
        self, lookup_id: str, keys: List[CacheEngineKey], transfer_spec: Any = None
    ) -> List[MemoryObj]:
        """Load ``keys`` in order, stopping at the first missing one.

        The holds :meth:`batched_async_contains` took for ``lookup_id`` are
        released once the chunks are loaded (the MemoryObjs keep the mappings).
        """
        loop = asyncio.get_running_loop()
        try:
            return await loop.run_in_executor(self._io_pool, self._get_prefix, keys)
        finally:
            with self._lock:
                held = self._lookup_holds.pop(lookup_id, [])
            for key in held:
                self.unpin(key)

    # -- removal and lifecycle ---------------------------------------------------

    def remove(self, key: CacheEngineKey, force: bool = True) -> bool:
        """Delete the chunk from the namespace (for every instance); its pool
        memory is freed once nobody maps it. False if it was not stored."""
        return self.handler.delete(self._name(key))

    def touch_cache(self) -> None:
        """Nothing to do: marud keeps the LRU order (retrievals count)."""

    def get_allocator_backend(self) -> Any:
        """LMCache's LocalCPUBackend: puts arrive in its buffers."""
        if self.local_cpu_backend is None:
            raise RuntimeError("MaruStoragePlugin needs the LocalCPUBackend (max_local_cpu_size > 0)")
        return self.local_cpu_backend

    def close(self) -> None:
        """Finish pending puts, drop holds, close the handler.

        MemoryObjs LMCache still uses stay valid (their views are released
        when LMCache frees them).
        """
        if self._closed:
            return
        self._closed = True
        self._put_pool.shutdown(wait=True)
        self._io_pool.shutdown(wait=True)
        with self._lock:
            holds = list(self._holds.values())
            self._holds.clear()
            self._lookup_holds.clear()
        for chunk, count in holds:
            for _ in range(count):
                chunk.release()
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", ResourceWarning)
            self.handler.close()
