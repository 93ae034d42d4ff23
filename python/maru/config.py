"""Configuration of a :class:`maru.MaruHandler`: the original design's ``MaruConfig``.

Every field of the original keeps its name, default and environment variable
(``MARU_EAGER_MAP``, ``MARU_STAT``), so code written for it runs unchanged. maru adds
where its daemon listens (``socket_path``), the namespace the keys live in, and the mount
that shows entries as files (for :meth:`~maru.MaruHandler.path_of`).

``storage_backend="remote"`` selects the original's remote backend: the handler then talks
to a memory node's marud (``remote_url``) and moves bytes with NIXL (:mod:`maru.remote`).
"""

from __future__ import annotations

import os
import uuid
from dataclasses import dataclass, field
from typing import Optional
from urllib.parse import urlsplit

#: Where marud mounts the store unless told otherwise (``marud --mount``).
DEFAULT_MOUNT = "/maru"
#: Where marud listens unless told otherwise (``marud --socket``).
DEFAULT_SOCKET = "/run/maru/marud.sock"

_LOCAL_HOSTS = {"", "localhost", "127.0.0.1", "::1", "0.0.0.0", "ip6-localhost"}

#: ``storage_backend`` values: the local marud's pools (the original's CXL backend) and a
#: memory node's pool over NIXL. The original's ``"cpu"`` and ``"mixed"`` are not built.
STORAGE_BACKENDS = ("cxl", "remote")


def _default_mount() -> str:
    return os.environ.get("MARU_MOUNT", DEFAULT_MOUNT)


def _default_namespace() -> str:
    return os.environ.get("MARU_NAMESPACE", "default")


def _default_socket() -> str:
    return os.environ.get("MARU_SOCKET", DEFAULT_SOCKET)


def _default_remote_token() -> str:
    return os.environ.get("MARU_REMOTE_TOKEN", "")


def _positive_number(value: object) -> bool:
    return not isinstance(value, bool) and isinstance(value, (int, float)) and value > 0


def _parse_env_bool(name: str) -> Optional[bool]:
    raw = os.environ.get(name)
    if raw is None:
        return None
    value = raw.strip().lower()
    if value in {"1", "true", "yes", "on"}:
        return True
    if value in {"0", "false", "no", "off"}:
        return False
    raise ValueError(f"{name} must be one of: 1/0, true/false, yes/no, on/off (got {raw!r})")


def _this_host_names() -> set:
    import socket

    names = set(_LOCAL_HOSTS)
    try:
        names.add(socket.gethostname())
        names.add(socket.getfqdn())
    except OSError:
        pass
    return names


def resolve_server_url(server_url: str, socket_path: Optional[str]) -> str:
    """The control socket a ``server_url`` means.

    ``tcp://localhost:5555`` (the original's default), ``maru://127.0.0.1:…``, or any URL
    naming this host means the local marud, at ``socket_path`` (default ``$MARU_SOCKET`` or
    ``/run/maru/marud.sock``); ``unix:///path/marud.sock`` names the socket itself. A URL
    naming another host is refused: a client talks to the marud of its own host (in cluster
    mode every host runs one, and they share the pool: doc/CLUSTER.md).

    Raises:
        ValueError: a URL of another host, or one this client cannot read.
    """
    url = urlsplit(server_url if "://" in server_url else f"tcp://{server_url}")
    if url.scheme == "unix":
        path = url.path or url.netloc
        if not path:
            raise ValueError(f"server_url {server_url!r}: unix:// needs a socket path")
        return path
    if url.scheme not in ("tcp", "maru", "ipc"):
        raise ValueError(f"server_url {server_url!r}: the scheme must be tcp://, maru:// or unix://")
    host = url.hostname or ""
    if host not in _this_host_names():
        raise ValueError(
            f"server_url {server_url!r} names another host ({host}): a maru client talks to the "
            "marud of its own host (in cluster mode each host runs one, sharing the pool); "
            "use tcp://localhost or unix://"
        )
    return socket_path or _default_socket()


@dataclass
class MaruConfig:
    """How a :class:`maru.MaruHandler` connects, with the original design's fields.

    Attributes:
        server_url: the store to use. A URL naming this host (``tcp://localhost:5555``, the
            original's default, ``maru://127.0.0.1``) means the local marud at
            ``socket_path``; ``unix:///path/to/marud.sock`` names the socket.
        instance_id: this client's name in marud's statistics (default: a new UUID).
        pool_size: the original reserved a region of this size at connect; marud sizes the
            pools itself, so here it is a check: ``connect()`` fails when the pools are smaller.
        chunk_size_bytes: the largest ``alloc`` (as the original); also the page size of
            ``page_index`` and the region accessors.
        auto_connect: the context manager connects on ``__enter__``.
        timeout_ms: how long a call waits for marud.
        use_async_rpc, max_inflight: accepted for compatibility; libmaru pipelines batch
            requests on one connection and never has more than one batch in flight.
        eager_map: accepted (``MARU_EAGER_MAP``); libmaru maps each entry at its first
            retrieval and reuses the mapping.
        auto_expand, expand_size: accepted; marud places allocations in its pools, there are
            no per-client regions to grow.
        rm_address: accepted; marud is the resource manager.
        enable_stats: accepted (``MARU_STAT``); marud counts every operation anyway
            (``maructl stats``, ``marutop``).
        socket_path: marud's control socket (default ``$MARU_SOCKET`` or
            ``/run/maru/marud.sock``).
        namespace: the namespace (directory under the mount) the keys live in (default
            ``$MARU_NAMESPACE`` or ``default``); created at connect (with its parents) when
            missing.
        mount_path: the maru mount, for :meth:`~maru.MaruHandler.path_of` (default
            ``$MARU_MOUNT`` or ``/maru``).
        namespace_mode: permission bits of namespaces the handler creates.
        storage_backend: ``"cxl"`` (the default: the local marud's pools) or ``"remote"`` (a
            memory node's pool, reached over NIXL: doc/PYTHON.md, "Remote"). The original's
            ``"cpu"`` and ``"mixed"`` backends are refused (``ValueError``): not built.
        remote_url: the memory node's marud, ``tcp://HOST:PORT`` (its ``remote_bind``);
            required by, and only accepted with, the remote backend.
        remote_ucx_device: the RDMA device NIXL's UCX backend uses (``mlx5_0`` or
            ``mlx5_0:1``); empty: UCX's own choice (``UCX_NET_DEVICES``). For TCP leave it
            empty and set ``UCX_NET_DEVICES``/``UCX_TLS`` in the environment.
        remote_transfer_timeout_s: how long one NIXL READ or WRITE list may take.
        remote_retry_s: how long the handler leaves the pool alone after a failure (lookups
            miss, stores return False meanwhile).
        remote_load_reserve: the share of the staging buffer (``pool_size``) that
            allocations for stores leave free for loads, in [0, 1): an ``alloc`` that would
            take it raises :class:`~maru.StagingFullError`.
        remote_token: the token marud's ``remote_tokens`` file maps to a uid/gid (default
            ``$MARU_REMOTE_TOKEN``; never shown by ``repr``).
        cache_namespace: the original's name for the namespace of the remote backend; when
            given it sets ``namespace``.
        node_id: this worker's name, sent to marud and in its NIXL agent's name (default:
            the host's name).
        engine_id, storage_schema, write_order, read_order: the original's fields for its
            cpu and mixed backends: accepted, not used (entries are opaque bytes here).
        metadata_only, cxl_pool_size: refused (``ValueError``) when set: a handler without
            memory and the mixed backend are not built.

    With ``storage_backend="remote"``, ``pool_size`` is the staging buffer's size (the
    original's meaning), ``timeout_ms`` the control connection's timeout, and ``server_url``,
    ``socket_path`` and ``mount_path`` are not used (the local marud is not contacted).
    """

    server_url: str = "tcp://localhost:5555"
    instance_id: Optional[str] = None
    pool_size: int = 1024 * 1024 * 100
    chunk_size_bytes: int = 1024 * 1024
    auto_connect: bool = True
    timeout_ms: int = 2000
    use_async_rpc: bool = True
    max_inflight: int = 64
    eager_map: bool = True
    auto_expand: bool = True
    expand_size: Optional[int] = None
    rm_address: str = "127.0.0.1:9850"
    enable_stats: bool = False
    socket_path: Optional[str] = None
    namespace: str = field(default_factory=_default_namespace)
    mount_path: str = field(default_factory=_default_mount)
    namespace_mode: int = 0o755
    storage_backend: str = "cxl"
    remote_url: Optional[str] = None
    remote_ucx_device: str = ""
    remote_transfer_timeout_s: float = 30.0
    remote_retry_s: float = 30.0
    remote_load_reserve: float = 0.5
    remote_token: str = field(default_factory=_default_remote_token, repr=False)
    cache_namespace: Optional[str] = None
    node_id: Optional[str] = None
    # The original's fields of its cpu and mixed backends (not built here): accepted so that
    # configurations written for it load; see __post_init__ for what each means here.
    metadata_only: bool = False
    engine_id: Optional[str] = None
    storage_schema: str = "opaque-bytes-v1"
    cxl_pool_size: Optional[int] = None
    write_order: tuple = ("cpu", "cxl")
    read_order: tuple = ("cpu", "cxl")

    def __post_init__(self) -> None:
        if self.instance_id is None:
            self.instance_id = str(uuid.uuid4())
        if self.storage_backend not in STORAGE_BACKENDS:
            raise ValueError(
                f"storage_backend must be one of {', '.join(map(repr, STORAGE_BACKENDS))} "
                f"(got {self.storage_backend!r}; the original's cpu and mixed backends are not built)"
            )
        if self.storage_backend == "remote":
            self._validate_remote()
        elif self.remote_url is not None:
            raise ValueError("remote_url is only used by storage_backend='remote'")
        if self.metadata_only:
            raise ValueError("metadata_only (a handler without memory, for exists only) is not built")
        if self.cxl_pool_size is not None:
            raise ValueError("cxl_pool_size is only used by the original's mixed backend, not built")
        if self.cache_namespace:
            self.namespace = self.cache_namespace
        if self.node_id is None:
            import socket

            self.node_id = socket.gethostname() or "worker"
        eager = _parse_env_bool("MARU_EAGER_MAP")
        if eager is not None:
            self.eager_map = eager
        stats = _parse_env_bool("MARU_STAT")
        if stats is not None:
            self.enable_stats = stats
        if self.chunk_size_bytes <= 0:
            raise ValueError(f"chunk_size_bytes must be positive, got {self.chunk_size_bytes}")
        if self.pool_size < self.chunk_size_bytes:
            raise ValueError(
                f"pool_size ({self.pool_size}) must be >= chunk_size_bytes ({self.chunk_size_bytes})"
            )
        if self.expand_size is not None:
            if not self.auto_expand:
                raise ValueError("expand_size requires auto_expand=True")
            if self.expand_size < self.chunk_size_bytes:
                raise ValueError(
                    f"expand_size ({self.expand_size}) must be >= chunk_size_bytes ({self.chunk_size_bytes})"
                )
        if self.timeout_ms < 0:
            raise ValueError("timeout_ms must be >= 0")

    def _validate_remote(self) -> None:
        if not self.remote_url:
            raise ValueError("storage_backend='remote' requires remote_url (tcp://HOST:PORT)")
        for name in ("remote_transfer_timeout_s", "remote_retry_s"):
            if not _positive_number(getattr(self, name)):
                raise ValueError(f"{name} must be a positive number")
        reserve = self.remote_load_reserve
        if isinstance(reserve, bool) or not isinstance(reserve, (int, float)) or not 0 <= reserve < 1:
            raise ValueError("remote_load_reserve must be in [0, 1)")
        if self.expand_size is not None:
            raise ValueError("storage_backend='remote' uses a fixed staging buffer: expand_size is not used")

    @property
    def is_remote(self) -> bool:
        """Whether this configuration names a memory node's pool (``storage_backend="remote"``)."""
        return self.storage_backend == "remote"

    @property
    def socket(self) -> str:
        """The control socket this configuration means (see :func:`resolve_server_url`)."""
        return resolve_server_url(self.server_url, self.socket_path)
