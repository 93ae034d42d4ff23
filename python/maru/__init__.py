"""maru: KV-cache entries in shared memory, through the /maru mount.

The client API of the original design, over the file system that marud serves:

- :class:`MaruConfig`: mount path, namespace, capacity hint, timeouts.
- :class:`MaruHandler`: ``alloc`` / ``store`` / ``retrieve`` / ``exists`` /
  ``delete`` / ``pin`` / ``unpin``, their batch forms, ``get_stats``.
- :class:`AllocHandle` (``buf``: writable pool memory) and
  :class:`MemoryInfo` (``view``: the pool's own pages, zero-copy).

The LMCache storage plugin lives in :mod:`maru.lmcache_plugin` (it needs
LMCache and torch; this package itself needs nothing but Python).
"""

from .buffers import address_of
from .config import DEFAULT_MOUNT, MaruConfig
from .errors import (
    EntryFormatError,
    InvalidKeyError,
    MaruError,
    MountError,
    NoSpaceError,
    NotFoundError,
    PermissionDeniedError,
)
from .handler import AllocHandle, MaruHandler, MemoryInfo
from .names import NAME_MAX, TEMP_PREFIX

__version__ = "0.1.0"

__all__ = [
    "AllocHandle",
    "DEFAULT_MOUNT",
    "EntryFormatError",
    "InvalidKeyError",
    "MaruConfig",
    "MaruError",
    "MaruHandler",
    "MemoryInfo",
    "MountError",
    "NAME_MAX",
    "NoSpaceError",
    "NotFoundError",
    "PermissionDeniedError",
    "TEMP_PREFIX",
    "__version__",
    "address_of",
]
