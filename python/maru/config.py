"""Configuration of a :class:`maru.MaruHandler`."""

from __future__ import annotations

import os
import socket
from dataclasses import dataclass, field
from typing import Optional

#: Where marud mounts the store unless told otherwise (``marud --mount``).
DEFAULT_MOUNT = "/maru"


def _default_mount() -> str:
    return os.environ.get("MARU_MOUNT", DEFAULT_MOUNT)


def _default_instance_id() -> str:
    return f"{socket.gethostname()}-{os.getpid()}"


@dataclass(frozen=True)
class MaruConfig:
    """Where and how a :class:`maru.MaruHandler` works.

    The original design's client spoke to a metadata server
    (``server_url``); here the store *is* the mount, so the handler needs its
    path and the namespace (a directory under it) that holds its keys.

    Attributes:
        mount_path: the maru mount (``marud --mount``); default ``$MARU_MOUNT``
            or ``/maru``.
        namespace: the namespace the keys live in, relative to the mount
            (``"llama3-70b"``, nested ``"team/llama3-70b"``).
        instance_id: a name for this client in statistics; default
            ``<hostname>-<pid>``.
        pool_size: a capacity hint in bytes: :meth:`~maru.MaruHandler.connect`
            fails with ``ENOSPC`` when the pools behind the mount are smaller.
            ``None``: no check. (In the original design the client reserved a
            region of this size; marud sizes the pools, so here it is a check.)
        timeout_ms: how long :meth:`~maru.MaruHandler.connect` waits for the
            mount to be served (marud starting up), in milliseconds.
        auto_connect: connect when the handler is constructed.
        create_namespace: create the namespace directory (and its parents) if
            it does not exist.
        namespace_mode: permission bits of namespace directories it creates.
        entry_mode: permission bits of the entries it stores (marud clears the
            write bits when it seals them).
    """

    mount_path: str = field(default_factory=_default_mount)
    namespace: str = "default"
    instance_id: str = field(default_factory=_default_instance_id)
    pool_size: Optional[int] = None
    timeout_ms: int = 2000
    auto_connect: bool = True
    create_namespace: bool = True
    namespace_mode: int = 0o755
    entry_mode: int = 0o644

    def __post_init__(self) -> None:
        if self.timeout_ms < 0:
            raise ValueError("timeout_ms must be >= 0")
        if self.pool_size is not None and self.pool_size < 0:
            raise ValueError("pool_size must be >= 0")
