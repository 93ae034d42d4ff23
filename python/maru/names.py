"""Naming rules for keys and namespaces on /maru.

An entry's name is one path component: 1 to 255 bytes of valid UTF-8 (the
mount refuses other bytes with ``EINVAL``), no ``/`` and no NUL, not ``.`` or
``..``. A namespace is a directory
path of such components separated by ``/`` (nested namespaces are directories
inside directories). Names that start with :data:`TEMP_PREFIX` are reserved
for allocations that are not stored yet.
"""

from __future__ import annotations

import errno
import os
from typing import Union

from .errors import InvalidKeyError

#: Prefix of the hidden temporary names :meth:`maru.MaruHandler.alloc` creates.
TEMP_PREFIX = ".maru-alloc-"

#: Longest name of one component, in bytes (as for most Linux filesystems).
NAME_MAX = 255

Key = Union[str, bytes]


def key_bytes(key: Key) -> bytes:
    """Return a key as the bytes of its file name, checking the naming rules.

    Args:
        key: the key, ``str`` or ``bytes`` (valid UTF-8).

    Raises:
        InvalidKeyError: empty, longer than 255 bytes, not UTF-8, containing
            ``/`` or NUL, ``.``/``..``, or starting with the reserved prefix.
        TypeError: neither ``str`` nor ``bytes``.
    """
    if isinstance(key, str):
        raw = os.fsencode(key)
    elif isinstance(key, (bytes, bytearray)):
        raw = bytes(key)
    else:
        raise TypeError(f"a key is str or bytes, not {type(key).__name__}")
    _check_component(raw, "key")
    if raw.startswith(TEMP_PREFIX.encode()):
        raise InvalidKeyError(errno.EINVAL, f"key: names starting with {TEMP_PREFIX!r} are reserved", key)
    return raw


def namespace_path(namespace: str) -> str:
    """Check a namespace (``"llama"``, ``"team/llama"``) and return it normalised.

    Raises:
        InvalidKeyError: empty, absolute, or with a component that breaks the rules.
    """
    if not isinstance(namespace, str):
        raise TypeError(f"a namespace is a str, not {type(namespace).__name__}")
    if namespace.startswith("/"):
        raise InvalidKeyError(errno.EINVAL, "namespace: relative to the mount, without a leading '/'", namespace)
    parts = [p for p in namespace.split("/") if p]
    if not parts:
        raise InvalidKeyError(errno.EINVAL, "namespace: empty (entries live in namespaces, not at the mount's root)", namespace)
    for part in parts:
        _check_component(os.fsencode(part), "namespace")
    return "/".join(parts)


def _check_component(raw: bytes, what: str) -> None:
    shown = os.fsdecode(raw)
    if not raw:
        raise InvalidKeyError(errno.EINVAL, f"{what}: empty name", shown)
    if len(raw) > NAME_MAX:
        raise InvalidKeyError(errno.ENAMETOOLONG, f"{what}: {len(raw)} bytes, at most {NAME_MAX}", shown[:64] + "...")
    if b"/" in raw or b"\0" in raw:
        raise InvalidKeyError(errno.EINVAL, f"{what}: '/' and NUL are not allowed in a name", shown)
    if raw in (b".", b".."):
        raise InvalidKeyError(errno.EINVAL, f"{what}: '.' and '..' are not names", shown)
    try:
        raw.decode("utf-8")
    except UnicodeDecodeError:
        raise InvalidKeyError(errno.EINVAL, f"{what}: names are UTF-8 on /maru", shown) from None
