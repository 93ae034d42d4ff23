"""Exceptions raised by the maru client.

Every failure of a system call on the mount is raised as a :class:`MaruError`
(a subclass of :class:`OSError`, so ``errno``, ``strerror`` and ``filename``
are set) or one of its subclasses, chosen from the errno:

==================  ==========================================  ============================
errno               meaning on /maru                             exception
==================  ==========================================  ============================
ENOENT              no such entry or namespace                   (``None``/``False`` results,
                                                                 or :class:`NotFoundError`)
EEXIST              the key is taken (entries are write-once)    ``store`` returns ``False``
ENOSPC, EDQUOT,     no space left in the pools, the namespace's  :class:`NoSpaceError`
EFBIG               quota, or an entry larger than a pool
EACCES, EPERM       namespace permissions; sealed entries are    :class:`PermissionDeniedError`
                    immutable
ENAMETOOLONG,       the name breaks the naming rules             :class:`InvalidKeyError`
EINVAL
ENOTCONN, ENODEV,   marud is not serving the mount (crashed or   :class:`MountError`
ESTALE,             never started; a request caught by a crash
ECONNABORTED,       gets ECONNABORTED or ECANCELED)
ECANCELED
==================  ==========================================  ============================

Keys refused before any system call (``/`` or NUL in a key, more than 255 bytes)
raise :class:`InvalidKeyError` as well; it is also a :class:`ValueError`.
"""

from __future__ import annotations

import errno
import os
from typing import Optional


class MaruError(OSError):
    """Base class of the errors raised by the maru client.

    A subclass of :class:`OSError`: ``errno`` carries the error number the mount
    returned (or the one that best describes a failure detected in Python).
    """


class MountError(MaruError):
    """The mount is missing or marud is not serving it (``ENOTCONN`` after a crash)."""


class NotFoundError(MaruError, KeyError):
    """No such entry or namespace, where a missing key is an error rather than a result."""

    def __str__(self) -> str:  # KeyError would quote the whole message otherwise
        return OSError.__str__(self)


class NoSpaceError(MaruError):
    """The pools are full (``ENOSPC``), the namespace is at its quota (``EDQUOT``), or the
    entry is larger than a pool can hold (``EFBIG``)."""


class PermissionDeniedError(MaruError, PermissionError):
    """Namespace permissions refuse the operation, or the entry is sealed (``EACCES``, ``EPERM``)."""


class InvalidKeyError(MaruError, ValueError):
    """A key or namespace name breaks the naming rules (``EINVAL``, ``ENAMETOOLONG``)."""


class StagingFullError(NoSpaceError, MemoryError):
    """A remote handler's staging buffer (``pool_size`` bytes) has no room for an allocation
    outside the share kept for loads (``remote_load_reserve``). Also a :class:`MemoryError`,
    what the original design's remote backend raised."""


class EntryFormatError(MaruError):
    """An entry does not hold what the reader expects (for example a bad chunk header)."""


_BY_ERRNO = {
    errno.ENOENT: NotFoundError,
    errno.ENOSPC: NoSpaceError,
    errno.EDQUOT: NoSpaceError,
    errno.EFBIG: NoSpaceError,
    errno.EACCES: PermissionDeniedError,
    errno.EPERM: PermissionDeniedError,
    errno.ENAMETOOLONG: InvalidKeyError,
    errno.EINVAL: InvalidKeyError,
    errno.ENOTCONN: MountError,
    errno.ENODEV: MountError,
    errno.ESTALE: MountError,
    errno.ECONNABORTED: MountError,
    errno.ECANCELED: MountError,
}


def from_oserror(err: OSError, what: str, path: Optional[str] = None) -> MaruError:
    """Translate an :class:`OSError` from a call on the mount into a :class:`MaruError`.

    Args:
        err: the error the system call raised.
        what: a short description of the operation, used in the message
            (``"store"``, ``"retrieve"``...).
        path: the path involved; defaults to the error's own ``filename``.

    Returns:
        The exception to raise (``raise from_oserror(e, ...) from e``).
    """
    code = err.errno if err.errno is not None else errno.EIO
    cls = _BY_ERRNO.get(code, MaruError)
    message = f"{what}: {os.strerror(code)}"
    return cls(code, message, path if path is not None else err.filename)


def from_native(code: int, message: str) -> MaruError:
    """The exception for an error of the native core (libmaru's errno and message)."""
    cls = _BY_ERRNO.get(code, MaruError)
    return cls(code, message)
