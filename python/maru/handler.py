"""The client: :class:`MaruHandler`, with the verbs of the original design, over the mount.

How each verb maps onto the file system (see doc/PYTHON.md):

- ``alloc(size)`` creates a hidden temporary entry in the namespace
  (``.maru-alloc-<uuid>``), reserves ``size`` bytes of pool memory for it
  (``fallocate``: a full pool is an ``ENOSPC`` here, never a ``SIGBUS`` later)
  and maps it writable: ``handle.buf`` is the pool's own memory.
- ``store(key, handle)`` unmaps, renames the temporary name onto the key and
  closes the descriptor: marud publishes (seals) the entry when its last
  writable handle is released. Keys are write-once: if the key exists the
  allocation is discarded and ``store`` returns ``False``.
- ``retrieve(key)`` opens the entry read-only and maps it: ``info.view`` is the
  pool's own memory (the same physical pages every reader maps).
- ``exists``, ``delete``, ``pin``, ``unpin`` are ``stat``, ``unlink`` and the
  ``user.maru.pinned`` extended attribute.
"""

from __future__ import annotations

import errno
import mmap
import os
import sys
import threading
import time
import uuid
import warnings
import weakref
from typing import Any, Dict, Iterable, Iterator, List, Optional, Sequence

from .config import MaruConfig
from .errors import (
    MaruError,
    MountError,
    NoSpaceError,
    NotFoundError,
    from_oserror,
)
from .names import TEMP_PREFIX, Key, key_bytes, namespace_path

_XATTR_PINNED = "user.maru.pinned"
_XATTR_ENTRIES = "user.maru.entries"
_XATTR_BYTES = "user.maru.bytes"
_XATTR_PREFIX = "user.maru."
_TEMP_PREFIX_B = os.fsencode(TEMP_PREFIX)
# Python >= 3.13 can map without keeping a duplicate descriptor per mapping.
_NO_FD_COPY: Dict[str, Any] = {"trackfd": False} if sys.version_info >= (3, 13) else {}

# Errors that mean "the mount is not (yet) served": keep waiting in connect().
_NOT_SERVED = (
    errno.ENOTCONN,
    errno.ENOENT,
    errno.ENODATA,
    errno.EOPNOTSUPP,
    errno.ENODEV,
    errno.ECONNABORTED,
    errno.ECANCELED,
)


def _drop_temp(path: bytes, fd: int) -> None:
    """Finalizer of an allocation that was neither stored nor freed: unlink, then close.

    Unlinking before the last close means marud publishes nothing.
    """
    try:
        os.unlink(path)
    except OSError:
        pass
    try:
        os.close(fd)
    except OSError:
        pass


def _unmap(view: memoryview, mm: mmap.mmap) -> bool:
    """Release ``view`` and unmap ``mm``; False (nothing unmapped) if either is still exported.

    ``view`` is released in any case; the caller makes a new one on failure.
    """
    try:
        view.release()
        mm.close()
    except BufferError:
        return False
    return True


class AllocHandle:
    """Pool memory allocated by :meth:`MaruHandler.alloc`, not stored under a key yet.

    Write the value into :attr:`buf`, then pass the handle to
    :meth:`MaruHandler.store` (or :meth:`MaruHandler.free` to give the memory
    back). Used as a context manager, a handle that was not stored is freed on
    exit.

    Attributes:
        buf: a writable memoryview of exactly :attr:`size` bytes of pool
            memory. ``numpy.frombuffer(handle.buf, ...)`` and
            ``torch.frombuffer(handle.buf, ...)`` wrap it without a copy; drop
            such arrays before ``store`` (a mapping cannot be unmapped while
            something still exports it).
        size: the size of the allocation in bytes.
        name: the temporary name of the allocation in the namespace.
    """

    def __init__(self, handler: "MaruHandler", name: bytes, path: bytes, fd: int, mm: mmap.mmap, size: int) -> None:
        self._handler = handler
        self._name = name
        self._path = path
        self._fd = fd
        self._mmap: Optional[mmap.mmap] = mm
        self.buf: memoryview = memoryview(mm)
        self.size = size
        self._done = False
        self._finalizer = weakref.finalize(self, _drop_temp, path, fd)

    @property
    def name(self) -> str:
        """The temporary name of this allocation in the namespace."""
        return os.fsdecode(self._name)

    @property
    def path(self) -> str:
        """The temporary path of this allocation under the mount."""
        return os.fsdecode(self._path)

    @property
    def done(self) -> bool:
        """True once the handle was stored or freed; it is unusable then."""
        return self._done

    def _unmap(self) -> None:
        """Release :attr:`buf` and unmap; raises ``BufferError`` if still exported."""
        if self._mmap is None:
            return
        if not _unmap(self.buf, self._mmap):
            self.buf = memoryview(self._mmap)
            raise BufferError(
                f"{self.name}: handle.buf is still in use (a numpy array, tensor or "
                "memoryview made from it is alive); drop it before store() or free()"
            )
        self._mmap = None

    def _finish(self) -> None:
        self._done = True
        self._finalizer.detach()

    def __enter__(self) -> "AllocHandle":
        return self

    def __exit__(self, *exc: Any) -> None:
        if not self._done:
            self._handler.free(self)

    def __repr__(self) -> str:
        state = "done" if self._done else "open"
        return f"AllocHandle(name={self.name!r}, size={self.size}, {state})"


class MemoryInfo:
    """A retrieved entry: a mapping of the pool's own pages.

    Attributes:
        view: a memoryview of the entry's bytes, read-only (mapped
            ``MAP_SHARED``, ``PROT_READ``: the very pages the writer filled),
            or writable copy-on-write when retrieved with
            ``copy_on_write=True`` (reads share the pool's pages, a write
            copies the page it touches into private memory). Wrap it without
            a copy: ``numpy.frombuffer(info.view, dtype=...)``,
            ``torch.frombuffer(info.view, dtype=...)``.
        key: the key it was retrieved under.
        size: its size in bytes.

    Release the mapping with :meth:`close` (or use the object as a context
    manager). ``close`` raises ``BufferError`` while arrays made from
    :attr:`view` are alive; drop them first. An entry deleted or evicted while
    mapped keeps its bytes until it is unmapped.
    """

    def __init__(self, handler: "MaruHandler", key: str, path: bytes, mm: Optional[mmap.mmap], size: int) -> None:
        self._handler = handler
        self.key = key
        self._path = path
        self._mmap = mm
        self.size = size
        self.view: memoryview = memoryview(mm) if mm is not None else memoryview(b"")
        self._closed = False

    @property
    def path(self) -> str:
        """The entry's path under the mount."""
        return os.fsdecode(self._path)

    @property
    def closed(self) -> bool:
        """True once :meth:`close` (or :meth:`detach`) ran."""
        return self._closed

    def close(self) -> None:
        """Unmap the entry now.

        Raises:
            BufferError: something made from :attr:`view` (a numpy array, a
                tensor, a memoryview slice) is still alive; the mapping stays
                valid and ``close`` can be called again once it is gone.
        """
        if self._closed:
            return
        if self._mmap is not None:
            if not _unmap(self.view, self._mmap):
                self.view = memoryview(self._mmap)
                raise BufferError(
                    f"{self.key}: the mapping is still in use (a numpy array, tensor or "
                    "memoryview made from info.view is alive); drop it before close()"
                )
            self._mmap = None
        self._closed = True
        self._handler._forget_mapping(self)

    def detach(self) -> None:
        """Stop owning the mapping without unmapping it now.

        Drops this object's references; the pages are unmapped when the last
        array or tensor made from :attr:`view` is freed (by Python's reference
        counting). For owners that hand the bytes to code whose lifetime they
        do not control.
        """
        if self._closed:
            return
        try:
            self.close()
            return
        except BufferError:
            pass
        self._mmap = None
        self.view = memoryview(b"")
        self._closed = True
        self._handler._forget_mapping(self)

    def __enter__(self) -> "MemoryInfo":
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()

    def __len__(self) -> int:
        return self.size

    def __repr__(self) -> str:
        state = "closed" if self._closed else "mapped"
        return f"MemoryInfo(key={self.key!r}, size={self.size}, {state})"


class MaruHandler:
    """A client of the maru store, working through the mount.

    Usage::

        from maru import MaruConfig, MaruHandler

        with MaruHandler(MaruConfig(namespace="llama3-8b")) as h:
            a = h.alloc(4096)
            a.buf[:5] = b"hello"
            h.store("greeting", a)              # sealed: immutable, visible to all
            with h.retrieve("greeting") as kv:  # the pool's own pages
                assert bytes(kv.view[:5]) == b"hello"

    All methods are thread-safe. Keys are file names in the namespace
    (:mod:`maru.names`); ``str`` keys are UTF-8.
    """

    def __init__(self, config: Optional[MaruConfig] = None) -> None:
        self.config = config if config is not None else MaruConfig()
        self._ns = namespace_path(self.config.namespace)
        self._mount = os.fsencode(os.path.abspath(self.config.mount_path))
        self._dir = os.path.join(self._mount, os.fsencode(self._ns))
        self._lock = threading.Lock()
        self._connected = False
        # Weak: a handle dropped without store/free is reclaimed by its finalizer.
        self._allocs: "weakref.WeakValueDictionary[bytes, AllocHandle]" = weakref.WeakValueDictionary()
        self._mappings: "weakref.WeakSet[MemoryInfo]" = weakref.WeakSet()
        self._ops: Dict[str, int] = {
            name: 0
            for name in (
                "alloc", "free", "store", "store_exists", "retrieve", "retrieve_miss",
                "exists", "delete", "pin", "unpin",
            )
        }
        self._stored_entries = 0
        self._stored_bytes = 0
        if self.config.auto_connect:
            self.connect()

    # -- lifecycle -----------------------------------------------------------

    def connect(self) -> bool:
        """Wait for the mount to be served, check the capacity hint, open the namespace.

        Returns:
            True (failures raise).

        Raises:
            MountError: the mount is not served by marud within ``timeout_ms``.
            NoSpaceError: the pools are smaller than ``config.pool_size``.
            NotFoundError: the namespace does not exist and
                ``create_namespace`` is off.
            PermissionDeniedError: the namespace cannot be created or entered.
        """
        if self._connected:
            return True
        deadline = time.monotonic() + self.config.timeout_ms / 1000.0
        while True:
            try:
                os.getxattr(self._mount, _XATTR_ENTRIES)
                st = os.statvfs(self._mount)
                break
            except OSError as e:
                if e.errno in _NOT_SERVED and time.monotonic() < deadline:
                    time.sleep(0.01)
                    continue
                mount = os.fsdecode(self._mount)
                if e.errno in (errno.ENODATA, errno.EOPNOTSUPP):
                    raise MountError(e.errno, "connect: not a maru mount (no user.maru.* attributes)", mount) from e
                raise MountError(e.errno or errno.EIO, f"connect: the mount is not served ({os.strerror(e.errno or errno.EIO)})", mount) from e
        total = st.f_blocks * st.f_frsize
        if self.config.pool_size is not None and total < self.config.pool_size:
            raise NoSpaceError(
                errno.ENOSPC,
                f"connect: the pools hold {total} bytes, less than pool_size={self.config.pool_size}",
                os.fsdecode(self._mount),
            )
        try:
            if self.config.create_namespace:
                os.makedirs(self._dir, mode=self.config.namespace_mode, exist_ok=True)
            elif not os.path.isdir(self._dir):
                raise NotFoundError(errno.ENOENT, "connect: no such namespace", os.fsdecode(self._dir))
        except MaruError:
            raise
        except OSError as e:
            raise from_oserror(e, "connect: namespace", os.fsdecode(self._dir)) from e
        self._connected = True
        return True

    @property
    def connected(self) -> bool:
        """True between :meth:`connect` and :meth:`close`."""
        return self._connected

    def close(self) -> None:
        """Free the allocations that were not stored and release the mappings.

        Mappings still used by arrays made from their view are detached
        instead (unmapped when those arrays are freed); a ``ResourceWarning``
        says how many.
        """
        with self._lock:
            allocs = list(self._allocs.values())
            mappings = list(self._mappings)
        for handle in allocs:
            try:
                self.free(handle)
            except BufferError:
                handle._finalizer()  # unlink the temporary name; the mapping dies with its users
                handle._finish()
                with self._lock:
                    self._allocs.pop(handle._name, None)
        busy = 0
        for info in mappings:
            try:
                info.close()
            except BufferError:
                busy += 1
                info.detach()
        if busy:
            warnings.warn(
                f"MaruHandler.close: {busy} mapping(s) still used by arrays were detached; "
                "they are unmapped when those arrays are freed",
                ResourceWarning,
                stacklevel=2,
            )
        self._connected = False

    def __enter__(self) -> "MaruHandler":
        self.connect()
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()

    def healthcheck(self) -> bool:
        """Return True if the mount is served and the namespace is reachable."""
        try:
            os.getxattr(self._mount, _XATTR_ENTRIES)
            return os.path.isdir(self._dir)
        except OSError:
            return False

    # -- paths ---------------------------------------------------------------

    @property
    def namespace_dir(self) -> str:
        """The namespace directory under the mount."""
        return os.fsdecode(self._dir)

    def path_of(self, key: Key) -> str:
        """The path of a key's entry under the mount (for tools and other languages)."""
        return os.fsdecode(os.path.join(self._dir, key_bytes(key)))

    def _require_connected(self) -> None:
        if not self._connected:
            raise MountError(errno.ENOTCONN, "the handler is not connected (call connect())", os.fsdecode(self._mount))

    def _count(self, op: str, n: int = 1) -> None:
        with self._lock:
            self._ops[op] += n

    # -- alloc / free / store --------------------------------------------------

    def alloc(self, size: int) -> AllocHandle:
        """Allocate ``size`` bytes of pool memory, mapped writable.

        Args:
            size: bytes, more than 0.

        Returns:
            A handle whose ``buf`` is the pool memory; store it with
            :meth:`store` or give it back with :meth:`free`.

        Raises:
            NoSpaceError: the pools cannot hold ``size`` more bytes.
            ValueError: ``size`` is not positive.
        """
        self._require_connected()
        if size <= 0:
            raise ValueError(f"alloc: size must be > 0, not {size}")
        name = os.fsencode(TEMP_PREFIX + uuid.uuid4().hex)
        path = os.path.join(self._dir, name)
        try:
            fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_EXCL | os.O_CLOEXEC, self.config.entry_mode)
        except OSError as e:
            raise from_oserror(e, "alloc", os.fsdecode(path)) from e
        try:
            # Reserve the pages now: writing through a mapping of a sparse file
            # in a full pool would kill the process with SIGBUS.
            os.posix_fallocate(fd, 0, size)
            mm = mmap.mmap(fd, size, mmap.MAP_SHARED, mmap.PROT_READ | mmap.PROT_WRITE)
        except OSError as e:
            _drop_temp(path, fd)
            raise from_oserror(e, f"alloc({size})", os.fsdecode(path)) from e
        except BaseException:
            _drop_temp(path, fd)
            raise
        handle = AllocHandle(self, name, path, fd, mm, size)
        with self._lock:
            self._allocs[name] = handle
            self._ops["alloc"] += 1
        return handle

    def _own(self, handle: AllocHandle) -> None:
        if handle._handler is not self:
            raise ValueError("this handle belongs to another MaruHandler")
        if handle._done:
            raise ValueError(f"{handle!r} was already stored or freed")

    def free(self, handle: AllocHandle) -> None:
        """Give an allocation that will not be stored back to the pool.

        Raises:
            BufferError: ``handle.buf`` is still exported (drop arrays made from it).
            ValueError: the handle was already stored or freed, or is another handler's.
        """
        self._own(handle)
        handle._unmap()
        handle._finish()
        _drop_temp(handle._path, handle._fd)
        with self._lock:
            self._allocs.pop(handle._name, None)
            self._ops["free"] += 1

    def store(self, key: Key, handle: AllocHandle) -> bool:
        """Publish an allocation under ``key``: sealed, immutable, visible to every process.

        The handle is consumed either way (``handle.buf`` is released).

        Args:
            key: the entry's name in the namespace.
            handle: an allocation of this handler.

        Returns:
            True if stored; False if the key already exists (write-once: the
            first writer wins, this allocation is discarded).

        Raises:
            BufferError: ``handle.buf`` is still exported (drop arrays made from
                it); the handle stays usable.
            InvalidKeyError: the key breaks the naming rules; the handle stays usable.
        """
        self._own(handle)
        raw = key_bytes(key)
        dest = os.path.join(self._dir, raw)
        handle._unmap()
        handle._finish()
        with self._lock:
            self._allocs.pop(handle._name, None)
        try:
            os.rename(handle._path, dest)
        except OSError as e:
            _drop_temp(handle._path, handle._fd)
            if e.errno == errno.EEXIST:
                self._count("store_exists")
                return False
            raise from_oserror(e, "store", os.fsdecode(dest)) from e
        # The last close of the writable descriptor publishes the entry.
        try:
            os.close(handle._fd)
        except OSError as e:
            raise from_oserror(e, "store: close", os.fsdecode(dest)) from e
        with self._lock:
            self._ops["store"] += 1
            self._stored_entries += 1
            self._stored_bytes += handle.size
        return True

    def put(self, key: Key, *buffers: Any) -> bool:
        """Store bytes the caller already has, written with ``writev`` (one kernel copy).

        The same as ``alloc`` + filling ``buf`` + ``store`` when the value already
        sits in memory, and cheaper: the pages are filled as they are
        allocated (``alloc`` reserves them zeroed, then they are written again).
        Written under a temporary name and renamed, so a failure publishes nothing.

        Args:
            key: the entry's name in the namespace.
            buffers: the value, in one or more pieces (bytes-like objects:
                bytes, memoryview, numpy arrays...), concatenated in order.

        Returns:
            True if stored; False if the key already exists (write-once).

        Raises:
            NoSpaceError: the pools cannot hold the value.
            InvalidKeyError: the key breaks the naming rules.
        """
        self._require_connected()
        raw = key_bytes(key)
        dest = os.path.join(self._dir, raw)
        views = [memoryview(b).cast("B") for b in buffers]
        size = sum(len(v) for v in views)
        name = os.fsencode(TEMP_PREFIX + uuid.uuid4().hex)
        path = os.path.join(self._dir, name)
        try:
            fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_CLOEXEC, self.config.entry_mode)
        except OSError as e:
            raise from_oserror(e, "put", os.fsdecode(path)) from e
        try:
            pending = [v for v in views if len(v)]
            while pending:
                n = os.writev(fd, pending)
                if n == 0:
                    raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))
                while n and pending:  # drop what was written (writev may write less)
                    if n >= len(pending[0]):
                        n -= len(pending.pop(0))
                    else:
                        pending[0] = pending[0][n:]
                        n = 0
            os.rename(path, dest)
        except OSError as e:
            _drop_temp(path, fd)
            if e.errno == errno.EEXIST:
                self._count("store_exists")
                return False
            raise from_oserror(e, f"put({size} bytes)", os.fsdecode(dest)) from e
        except BaseException:
            _drop_temp(path, fd)
            raise
        finally:
            for v in views:
                v.release()
        try:
            os.close(fd)  # publishes the entry
        except OSError as e:
            raise from_oserror(e, "put: close", os.fsdecode(dest)) from e
        with self._lock:
            self._ops["store"] += 1
            self._stored_entries += 1
            self._stored_bytes += size
        return True

    # -- retrieve / exists / delete / pin -------------------------------------

    def retrieve(self, key: Key, copy_on_write: bool = False) -> Optional[MemoryInfo]:
        """Map an entry: the returned ``view`` is the pool's own memory.

        Args:
            key: the entry's name.
            copy_on_write: map privately and writable: reads share the pool's
                pages, writes copy the touched pages into private memory (for
                libraries that want writable buffers). Default: read-only.

        Returns:
            A :class:`MemoryInfo` (close it, or use it as a context manager),
            or None if the key does not exist.
        """
        self._require_connected()
        raw = key_bytes(key)
        path = os.path.join(self._dir, raw)
        try:
            fd = os.open(path, os.O_RDONLY | os.O_CLOEXEC)
        except OSError as e:
            if e.errno == errno.ENOENT:
                self._count("retrieve_miss")
                return None
            raise from_oserror(e, "retrieve", os.fsdecode(path)) from e
        try:
            access = mmap.ACCESS_COPY if copy_on_write else mmap.ACCESS_READ
            try:
                mm: Optional[mmap.mmap] = mmap.mmap(fd, 0, access=access, **_NO_FD_COPY)
                size = len(mm)  # type: ignore[arg-type]
            except ValueError:  # "cannot mmap an empty file"
                mm, size = None, 0
        except OSError as e:
            raise from_oserror(e, "retrieve: mmap", os.fsdecode(path)) from e
        finally:
            os.close(fd)  # the mapping keeps its own reference to the file
        info = MemoryInfo(self, os.fsdecode(raw), path, mm, size)
        with self._lock:
            self._mappings.add(info)
            self._ops["retrieve"] += 1
        return info

    def _forget_mapping(self, info: MemoryInfo) -> None:
        with self._lock:
            self._mappings.discard(info)

    def exists(self, key: Key) -> bool:
        """Return True if ``key`` names a published entry (a ``stat``, served
        from the kernel's cache for sealed entries)."""
        self._require_connected()
        path = os.path.join(self._dir, key_bytes(key))
        self._count("exists")
        try:
            os.stat(path)
            return True
        except OSError as e:
            if e.errno == errno.ENOENT:
                return False
            raise from_oserror(e, "exists", os.fsdecode(path)) from e

    def delete(self, key: Key) -> bool:
        """Delete an entry. Processes that map it keep valid bytes until they unmap.

        Returns:
            True if it was deleted, False if it did not exist.
        """
        self._require_connected()
        path = os.path.join(self._dir, key_bytes(key))
        try:
            os.unlink(path)
        except OSError as e:
            if e.errno == errno.ENOENT:
                return False
            raise from_oserror(e, "delete", os.fsdecode(path)) from e
        self._count("delete")
        return True

    def _set_pinned(self, key: Key, value: bytes, op: str) -> bool:
        self._require_connected()
        path = os.path.join(self._dir, key_bytes(key))
        try:
            os.setxattr(path, _XATTR_PINNED, value)
        except OSError as e:
            if e.errno == errno.ENOENT:
                return False
            raise from_oserror(e, op, os.fsdecode(path)) from e
        self._count(op)
        return True

    def pin(self, key: Key) -> bool:
        """Protect an entry from eviction (``user.maru.pinned=1``).

        A pin is a flag on the entry shared by every process (not a count):
        one ``unpin`` clears it.

        Returns:
            True if pinned, False if the key does not exist.
        """
        return self._set_pinned(key, b"1", "pin")

    def unpin(self, key: Key) -> bool:
        """Let an entry be evicted again (``user.maru.pinned=0``).

        Returns:
            True if unpinned, False if the key does not exist.
        """
        return self._set_pinned(key, b"0", "unpin")

    def is_pinned(self, key: Key) -> Optional[bool]:
        """Return whether an entry is pinned, or None if it does not exist."""
        info = self.entry_info(key)
        return None if info is None else info.get("pinned") == "1"

    def entry_info(self, key: Key) -> Optional[Dict[str, str]]:
        """Return an entry's ``user.maru.*`` attributes without the prefix
        (``state``, ``pool``, ``kind``, ``location``, ``offset``, ``size``,
        ``pinned``, ``generation``, ``access``), or None if it does not exist."""
        self._require_connected()
        path = os.path.join(self._dir, key_bytes(key))
        out: Dict[str, str] = {}
        try:
            for name in os.listxattr(path):
                if name.startswith(_XATTR_PREFIX):
                    out[name[len(_XATTR_PREFIX):]] = os.fsdecode(os.getxattr(path, name))
        except OSError as e:
            if e.errno == errno.ENOENT:
                return None
            raise from_oserror(e, "entry_info", os.fsdecode(path)) from e
        return out

    def list_keys(self) -> Iterator[str]:
        """Iterate over the keys of the published entries in the namespace
        (temporary allocations and nested namespaces are left out)."""
        self._require_connected()
        try:
            with os.scandir(self._dir) as it:
                for entry in it:
                    if entry.name.startswith(_TEMP_PREFIX_B):
                        continue
                    if entry.is_file(follow_symlinks=False):
                        yield os.fsdecode(entry.name)
        except OSError as e:
            raise from_oserror(e, "list_keys", os.fsdecode(self._dir)) from e

    # -- batches ---------------------------------------------------------------

    def batch_store(self, keys: Sequence[Key], handles: Sequence[AllocHandle]) -> List[bool]:
        """:meth:`store` for each pair; returns one result per key.

        Raises what :meth:`store` raises; handles after the failing one are
        left untouched (free them).
        """
        if len(keys) != len(handles):
            raise ValueError(f"batch_store: {len(keys)} keys for {len(handles)} handles")
        return [self.store(k, h) for k, h in zip(keys, handles)]

    def batch_retrieve(self, keys: Iterable[Key], copy_on_write: bool = False) -> List[Optional[MemoryInfo]]:
        """:meth:`retrieve` for each key (None where missing)."""
        return [self.retrieve(k, copy_on_write=copy_on_write) for k in keys]

    def batch_exists(self, keys: Iterable[Key]) -> List[bool]:
        """:meth:`exists` for each key."""
        return [self.exists(k) for k in keys]

    def batch_delete(self, keys: Iterable[Key]) -> List[bool]:
        """:meth:`delete` for each key."""
        return [self.delete(k) for k in keys]

    def batch_pin(self, keys: Iterable[Key]) -> List[bool]:
        """:meth:`pin` for each key."""
        return [self.pin(k) for k in keys]

    def batch_unpin(self, keys: Iterable[Key]) -> List[bool]:
        """:meth:`unpin` for each key."""
        return [self.unpin(k) for k in keys]

    # -- statistics ------------------------------------------------------------

    def get_stats(self) -> Dict[str, Any]:
        """Return pool, namespace and client statistics.

        Returns:
            ``{"instance_id", "mount_path", "namespace",
            "pool": {"total_bytes", "free_bytes", "used_bytes"},
            "namespace_usage": {"entries", "bytes"},
            "instance": {"allocations", "allocated_bytes", "mappings",
            "mapped_bytes", "stored_entries", "stored_bytes"},
            "ops": {name: count}}``. ``pool`` covers every pool behind the
            mount (``df``); ``namespace_usage`` is the namespace's entries
            (marud's ``user.maru.entries``/``user.maru.bytes``); ``instance`` is
            this handler's.
        """
        self._require_connected()
        try:
            st = os.statvfs(self._mount)
            entries = int(os.getxattr(self._dir, _XATTR_ENTRIES))
            used = int(os.getxattr(self._dir, _XATTR_BYTES))
        except OSError as e:
            raise from_oserror(e, "get_stats", os.fsdecode(self._dir)) from e
        total = st.f_blocks * st.f_frsize
        free = st.f_bavail * st.f_frsize
        with self._lock:
            allocs = list(self._allocs.values())
            mappings = [m for m in self._mappings if not m.closed]
            ops = dict(self._ops)
            stored_entries, stored_bytes = self._stored_entries, self._stored_bytes
        return {
            "instance_id": self.config.instance_id,
            "mount_path": os.fsdecode(self._mount),
            "namespace": self._ns,
            "pool": {"total_bytes": total, "free_bytes": free, "used_bytes": total - free},
            "namespace_usage": {"entries": entries, "bytes": used},
            "instance": {
                "allocations": len(allocs),
                "allocated_bytes": sum(h.size for h in allocs),
                "mappings": len(mappings),
                "mapped_bytes": sum(m.size for m in mappings),
                "stored_entries": stored_entries,
                "stored_bytes": stored_bytes,
            },
            "ops": ops,
        }

    def __repr__(self) -> str:
        state = "connected" if self._connected else "closed"
        return f"MaruHandler(mount={os.fsdecode(self._mount)!r}, namespace={self._ns!r}, {state})"


__all__ = ["AllocHandle", "MemoryInfo", "MaruHandler"]
