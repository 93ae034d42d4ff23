"""maru: KV-cache entries in shared memory, with the original design's client API.

- :class:`MaruConfig`: the original's fields (``server_url``, ``pool_size``,
  ``chunk_size_bytes``...) plus marud's socket, the namespace and the mount.
- :class:`MaruHandler`: ``alloc`` / ``store`` / ``retrieve`` / ``exists`` / ``delete`` /
  ``pin`` / ``unpin``, their batch forms, the region accessors, ``get_stats``; over libmaru
  (the native core ``maru._native``), zero-copy on every pool kind.
- :class:`AllocHandle` (``buf``: writable pool memory) and :class:`MemoryInfo` (``view``:
  the pool's own pages).
- Any ``str``, ``bytes`` or ``int`` key: :func:`encode_key` / :func:`decode_key` give its
  entry name (the encoding every maru client shares); ``MaruHandler.path_of`` its file
  under the mount.
- Handler plugins: entry points in ``maru.handler_plugins`` (:mod:`maru.plugins`).
- ``MaruConfig(storage_backend="remote", remote_url="tcp://memnode:PORT", ...)``: the same
  handler over a memory node's pool, its bytes moved by NIXL (:mod:`maru.remote`).

The LMCache storage plugin lives in :mod:`maru.lmcache_plugin` (it needs LMCache and torch).
"""

from .buffers import address_of
from ._native import decode_key, encode_key
from .config import DEFAULT_MOUNT, DEFAULT_SOCKET, MaruConfig
from .errors import (
    EntryFormatError,
    InvalidKeyError,
    MaruError,
    MountError,
    NoSpaceError,
    NotFoundError,
    PermissionDeniedError,
    StagingFullError,
)
from .handler import AllocHandle, MaruHandler, MemoryInfo

__version__ = "0.1.0"

__all__ = [
    "AllocHandle",
    "DEFAULT_MOUNT",
    "DEFAULT_SOCKET",
    "EntryFormatError",
    "InvalidKeyError",
    "MaruConfig",
    "MaruError",
    "MaruHandler",
    "MemoryInfo",
    "MountError",
    "NoSpaceError",
    "NotFoundError",
    "PermissionDeniedError",
    "StagingFullError",
    "__version__",
    "address_of",
    "decode_key",
    "encode_key",
]
