"""MaruStorage: SGLang's HiCache storage tier (L3) in maru pool memory, one entry per page.

SGLang's cache controller keeps KV pages in a host pool (L2, CPU memory) and backs them up to,
and prefetches them from, a storage backend, keyed by a hash chained over the page's prefix.
Here each page is one maru entry; every instance on the host (and every host of a cluster)
that asks for the same prefix finds the same entries.

- Zero-copy interface (``interface_v1: 1`` in the extra config, what SGLang uses for its
  built-in shared-memory backends): ``batch_set_v1`` / ``batch_get_v1`` name pages by their
  host-pool indices. A store allocates pool memory for every page of the call in one
  exchange with marud (``alloc_many``), copies each page from the host pool into its
  allocation, and publishes them all in one more (``batch_store``). A load
  looks every key up in one exchange (``batch_retrieve``: the entries' own pages, mapped) and
  copies each into its place in the host pool. One copy each way, no staging buffer.
- ``batch_exists`` (the prefetch's lookup): answered from the namespace's shared index,
  without a round trip to marud; the count of leading pages stored.
- The plain interface (``get``, ``set``, ``batch_get``, ``batch_set``, ``exists``): SGLang's
  generic path without ``interface_v1``, flat page tensors in and out (one allocation, copy
  and publication per page, the batch published in one exchange).

Keys: SGLang's page hash, then the model, the tensor-parallel rank and size (and the
pipeline and context-parallel shard) as SGLang's own ``file`` backend names its files (an MLA
model's pages are the same on every rank: one entry, no rank), then the page's format in the
host pool (layout, dtype, shape): instances whose pages are laid out differently never read
each other's bytes as their own.

Entries are write-once: a page stored already is not copied again. A marud that cannot be
reached, or fails a call, is a miss (``False``, ``None``, ``0``), logged, never an exception
into SGLang's controller; the next attempt to connect comes after ``maru_retry_s``.
Configuration errors (a ``maru_*`` key this backend does not know, a value it cannot use)
raise ``ValueError`` when SGLang creates the backend, so the server does not start on a
configuration that would be silently ignored.
"""

from __future__ import annotations

import logging
import re
import threading
import time
from dataclasses import dataclass
from typing import Any, Dict, List, Optional, Sequence, Tuple

import torch
from sglang.srt.mem_cache.hicache_storage import HiCacheStorage, HiCacheStorageConfig

from maru import MaruConfig, MaruHandler, NoSpaceError
from maru.tensors import frombuffer

logger = logging.getLogger(__name__)

DEFAULT_NAMESPACE = "sglang"
DEFAULT_SERVER_URL = "maru://localhost:5555"
DEFAULT_POOL_SIZE = "1G"
DEFAULT_TIMEOUT_MS = 5000
DEFAULT_RETRY_S = 5.0

#: Host-pool layouts whose pages this backend moves (``--hicache-mem-layout``).
LAYOUTS = ("page_first", "page_first_direct", "layer_first")

#: The ``maru_*`` keys of the extra config this backend reads, and what each means. The
#: original's ``maru_sglang`` keys keep their names; a ``maru_*`` key not listed is refused.
KEYS: Dict[str, str] = {
    "maru_server_url": "the marud to use: a URL naming this host (maru://localhost:5555, the "
                       "default) means the local marud at $MARU_SOCKET or /run/maru/marud.sock; "
                       "unix:///path names the socket",
    "maru_pool_size": "a check: the pools must hold at least this much (default 1G)",
    "maru_chunk_size_bytes": "the largest allocation; raised to a page's size when smaller",
    "maru_instance_id": "this server's name in marud's client list",
    "maru_timeout_ms": "how long a call waits for marud (default 5000)",
    "maru_use_async_rpc": "accepted, unused: libmaru pipelines a batch on one connection",
    "maru_max_inflight": "accepted, unused: one batch is in flight at a time",
    "maru_eager_map": "accepted, unused: entries are mapped when retrieved",
    "maru_namespace": "the namespace (directory under the mount) of the pages (default sglang)",
    "maru_cache_namespace": "the original's name for maru_namespace",
    "maru_retry_s": "how long an unreachable marud is left alone (default 5)",
    "maru_storage_backend": "cxl (the default) or cpu: this host's marud, whatever its pools are",
}


def parse_size(value: Any) -> int:
    """Bytes of ``4G``, ``500M``, ``1.5G`` or an integer."""
    if isinstance(value, int) and not isinstance(value, bool):
        return value
    m = re.fullmatch(r"\s*(\d+(?:\.\d+)?)\s*([KMGT]?)i?B?\s*", str(value).upper())
    if not m:
        raise ValueError(f"not a size: {value!r} (an integer, or like 4G, 500M)")
    return int(float(m.group(1)) * 1024 ** " KMGT".index(m.group(2) or " "))


def _flag(value: Any) -> bool:
    if isinstance(value, str):
        return value.strip().lower() in ("1", "true", "yes", "on")
    return bool(value)


def _number(extra: Dict[str, Any], key: str, default: Any, kind: type) -> Any:
    raw = extra.get(key, default)
    try:
        value = kind(raw)
    except (TypeError, ValueError):
        raise ValueError(f"MaruStorage: {key} must be a number, got {raw!r}") from None
    if value < 0:
        raise ValueError(f"MaruStorage: {key} must not be negative, got {raw!r}")
    return value


def handler_config(extra: Optional[Dict[str, Any]]) -> Tuple[MaruConfig, float]:
    """The handler configuration and retry interval an extra config describes.

    Raises:
        ValueError: a ``maru_*`` key this backend does not know, or a value it cannot use
            (named in the message).
    """
    extra = dict(extra or {})
    unknown = sorted(k for k in extra if k.startswith("maru_") and k not in KEYS)
    if unknown:
        raise ValueError(
            f"MaruStorage: unknown key(s) {', '.join(unknown)} in the extra config; the keys it "
            f"reads are {', '.join(KEYS)} (doc/SGLANG.md)"
        )
    backend = str(extra.get("maru_storage_backend", "cxl"))
    if backend not in ("cxl", "cpu"):
        raise ValueError(
            f"MaruStorage: maru_storage_backend {backend!r} is not built for SGLang: 'cxl' and "
            "'cpu' (this host's marud) are; a memory node's pool ('remote') is served to vLLM "
            "and LMCache only"
        )
    ns = extra.get("maru_namespace")
    cache_ns = extra.get("maru_cache_namespace")
    if ns is not None and cache_ns is not None and str(ns) != str(cache_ns):
        raise ValueError(
            f"MaruStorage: maru_namespace {ns!r} and maru_cache_namespace {cache_ns!r} name two "
            "namespaces; give one"
        )
    namespace = str(cache_ns if cache_ns is not None else ns if ns is not None else DEFAULT_NAMESPACE)
    pool_size = parse_size(extra.get("maru_pool_size", DEFAULT_POOL_SIZE))
    chunk = parse_size(extra.get("maru_chunk_size_bytes", 1 << 20))
    if chunk <= 0:
        raise ValueError(f"MaruStorage: maru_chunk_size_bytes must be positive, got {chunk}")
    instance = extra.get("maru_instance_id")
    config = MaruConfig(
        server_url=str(extra.get("maru_server_url", DEFAULT_SERVER_URL)),
        instance_id=None if instance is None else str(instance),
        pool_size=max(pool_size, chunk),
        chunk_size_bytes=chunk,
        auto_connect=False,
        timeout_ms=_number(extra, "maru_timeout_ms", DEFAULT_TIMEOUT_MS, int),
        use_async_rpc=_flag(extra.get("maru_use_async_rpc", True)),
        max_inflight=_number(extra, "maru_max_inflight", 64, int),
        eager_map=_flag(extra.get("maru_eager_map", True)),
        namespace=namespace,
    )
    config.socket  # raises ValueError for a server_url naming another host
    return config, _number(extra, "maru_retry_s", DEFAULT_RETRY_S, float)


def key_suffix(config: HiCacheStorageConfig) -> str:
    """What follows SGLang's page hash in an entry's key: the model, then the rank and size
    of tensor parallelism (not for MLA: its pages are the same on every rank) and the
    pipeline and context-parallel shard, as SGLang's ``file`` backend names its files.

    Raises:
        ValueError: decode context parallelism (DCP), whose shards this backend does not key.
    """
    if config.dcp_size > 1:
        raise ValueError("MaruStorage: decode context parallelism (dcp_size > 1) is not supported")
    if config.should_split_heads:
        raise ValueError("MaruStorage: split heads (tp_lcm_size with the page_head layout) are not supported")
    model = "-".join((config.model_name or "").split("/"))
    shard = f"_{config.pp_size}_{config.pp_rank}" if config.pp_size > 1 else ""
    if config.attn_cp_size > 1:
        shard += f"_cp{config.attn_cp_rank}_{config.attn_cp_size}"
    if config.is_mla_model:
        return f"_{model}{shard}"
    return f"_{model}_{config.tp_rank}_{config.tp_size}{shard}"


@dataclass(frozen=True)
class PageFormat:
    """One page of a host pool, as ``get_data_page(index, flat=False)`` shows it."""

    layout: str
    dtype: torch.dtype
    shape: Tuple[int, ...]
    tokens: int  # the pool's page size, in tokens
    nbytes: int

    @staticmethod
    def of(host: Any) -> "PageFormat":
        """The page format of SGLang host pool ``host``.

        Raises:
            ValueError: a layout this backend does not move, or a pool without pages.
        """
        layout = getattr(host, "layout", None)
        if layout not in LAYOUTS:
            raise ValueError(f"MaruStorage: host pool layout {layout!r} is not supported (only {', '.join(LAYOUTS)})")
        if getattr(host, "kv_buffer", None) is None:
            raise ValueError("MaruStorage: the host pool has no KV buffer (an allocator-only pool)")
        page = host.get_data_page(0, flat=False)
        return PageFormat(layout, page.dtype, tuple(page.shape), int(host.page_size),
                          page.numel() * page.element_size())

    @property
    def tag(self) -> str:
        """The format's part of a key: ``page_first-bfloat16-2x64x32x8x128``."""
        dtype = str(self.dtype).removeprefix("torch.")
        return f"{self.layout}-{dtype}-{'x'.join(map(str, self.shape))}"


class _Store:
    """The backend's handler, connected on first use. One that cannot connect, or whose
    calls fail, is dropped: every call is a miss until ``retry_s`` has passed."""

    def __init__(self, config: MaruConfig, retry_s: float) -> None:
        self.config = config
        self._retry_s = retry_s
        self._h: Optional[MaruHandler] = None
        self._next_try = 0.0
        self._lock = threading.Lock()

    def get(self) -> Optional[MaruHandler]:
        h = self._h
        if h is not None:
            return h
        with self._lock:
            if self._h is None and time.monotonic() >= self._next_try:
                h = MaruHandler(self.config)
                if h.connect():
                    self._h = h
                else:
                    logger.warning("MaruStorage: cannot reach marud at %s; pages miss, next try in %.0f s",
                                   self.config.socket, self._retry_s)
                    self._next_try = time.monotonic() + self._retry_s
            return self._h

    def failed(self, h: MaruHandler, what: str, e: BaseException) -> None:
        """A call on ``h`` raised ``e``: log it; drop ``h`` if marud no longer answers."""
        try:
            alive = h.healthcheck()
        except Exception:  # a handler closed meanwhile
            alive = False
        logger.warning("MaruStorage: %s failed (%s: %s)%s", what, type(e).__name__, e,
                       "" if alive else f"; marud does not answer, next try in {self._retry_s:.0f} s")
        if alive:
            return
        with self._lock:
            if self._h is h:
                self._h = None
                self._next_try = time.monotonic() + self._retry_s
        h.close()

    def close(self) -> None:
        with self._lock:
            h, self._h = self._h, None
        if h is not None:
            h.close()


class MaruStorage(HiCacheStorage):
    """SGLang's HiCache storage backend on maru (see the module's documentation).

    Created by SGLang's ``StorageBackendFactory`` as ``MaruStorage(storage_config, kwargs)``;
    the host pool arrives afterwards through :meth:`register_mem_pool_host`.

    Raises:
        ValueError: the extra config names a ``maru_*`` key this backend does not know, or a
            value it cannot use; or SGLang's parallelism is one it cannot key (DCP, split heads).
    """

    def __init__(self, storage_config: HiCacheStorageConfig, kwargs: Optional[Dict[str, Any]] = None) -> None:
        self.storage_config = storage_config
        config, retry_s = handler_config(storage_config.extra_config)
        self._suffix = key_suffix(storage_config)
        self._store = _Store(config, retry_s)
        self._format: Optional[PageFormat] = None
        self._tag = ""
        self.mem_pool_host = None
        # Connect now, so a marud that is missing is said at start (a miss either way).
        self._store.get()

    # -- the host pool ----------------------------------------------------------------------

    def register_mem_pool_host(self, mem_pool_host: Any) -> None:
        """Attach SGLang's host pool: the pages ``batch_get_v1`` / ``batch_set_v1`` move.

        Raises:
            ValueError: a layout this backend does not move.
        """
        fmt = PageFormat.of(mem_pool_host)
        super().register_mem_pool_host(mem_pool_host)
        self._format = fmt
        self._tag = f"_{fmt.tag}"
        config = self._store.config
        if config.chunk_size_bytes < fmt.nbytes:  # a page is one allocation
            self._store.close()  # a handler connected before keeps its limit: connect anew
            config.chunk_size_bytes = fmt.nbytes
            config.pool_size = max(config.pool_size, fmt.nbytes)
        logger.info("MaruStorage: %s pages of %d bytes, keys *%s%s, namespace %s", fmt.layout,
                    fmt.nbytes, self._suffix, self._tag, config.namespace)

    def register_mem_host_pool_v2(self, host_pool: Any, host_pool_name: Any) -> None:
        """SGLang registers each of its host pools here too: the KV pool, and for hybrid
        models (Mamba state, sliding-window, DSA indexer, ...) the pools beside it, which
        move through the v2 interface (``batch_get_v2``...) this backend does not have.

        Raises:
            ValueError: a pool other than the KV pool (refused when SGLang attaches the
                backend, rather than pages that would silently never load).
        """
        if str(host_pool_name) != "kv":
            raise ValueError(
                f"MaruStorage: SGLang's {host_pool_name!s} host pool (a hybrid model's) is not "
                "supported: it moves through the v2 interface, which is not built; maru stores "
                "the KV pages of MHA and MLA models"
            )
        super().register_mem_host_pool_v2(host_pool, host_pool_name)

    def key(self, key: str) -> str:
        """The maru key of SGLang's page key ``key``."""
        return f"{key}{self._suffix}{self._tag}"

    def _host_page(self, index: int) -> torch.Tensor:
        return self.mem_pool_host.get_data_page(index, flat=False)

    def _page_starts(self, host_indices: torch.Tensor, count: int) -> List[int]:
        """The host-pool index of each page's first token."""
        tokens = self._format.tokens
        if host_indices.numel() != count * tokens:
            raise ValueError(f"{host_indices.numel()} host indices for {count} pages of {tokens} tokens")
        return host_indices[::tokens].tolist()

    # -- zero-copy interface ------------------------------------------------------------------

    def batch_set_v1(self, keys: List[str], host_indices: torch.Tensor, extra_info: Any = None) -> List[bool]:
        """Store the pages at ``host_indices`` under ``keys``: each copied from the host pool
        into pool memory once, all published in one exchange. True where the page is stored
        (already, or now)."""
        n = len(keys)
        h = self._store.get()
        if h is None or self._format is None or n == 0:
            return [False] * n
        try:
            starts = self._page_starts(host_indices, n)
            names = [self.key(k) for k in keys]
            results = list(h.batch_exists(names))  # entries are write-once: skip those stored
            todo = [i for i in range(n) if not results[i]]
            stored = self._store_pages(h, [names[i] for i in todo], [self._host_page(starts[i]) for i in todo])
            for i, ok in zip(todo, stored):
                results[i] = ok
            return results
        except Exception as e:
            self._store.failed(h, "batch_set_v1", e)
            return [False] * n

    def batch_get_v1(self, keys: List[str], host_indices: torch.Tensor, extra_info: Any = None) -> List[bool]:
        """Load the pages of ``keys`` into the host pool at ``host_indices``: one exchange to
        find them all (the entries' own pages), one copy each. True where a page was loaded."""
        n = len(keys)
        h = self._store.get()
        fmt = self._format
        if h is None or fmt is None or n == 0:
            return [False] * n
        infos: List[Any] = []
        try:
            starts = self._page_starts(host_indices, n)
            infos = h.batch_retrieve([self.key(k) for k in keys])
            results = []
            for start, info in zip(starts, infos):
                if info is None or not self._fits(info, fmt.nbytes):
                    results.append(False)
                    continue
                self._host_page(start).copy_(frombuffer(info.view, dtype=fmt.dtype).view(fmt.shape))
                results.append(True)
            return results
        except Exception as e:
            self._store.failed(h, "batch_get_v1", e)
            return [False] * n
        finally:
            h.release_retrieved(infos)

    def batch_exists(self, keys: List[str], extra_info: Any = None) -> int:
        """How many of ``keys``, from the first, are stored (the namespace's shared index)."""
        h = self._store.get()
        if h is None or not keys:
            return 0
        try:
            found = h.batch_exists([self.key(k) for k in keys])
        except Exception as e:
            self._store.failed(h, "batch_exists", e)
            return 0
        return next((i for i, ok in enumerate(found) if not ok), len(found))

    # -- plain interface (SGLang's generic path: flat page tensors) ---------------------------

    def exists(self, key: str) -> bool:
        h = self._store.get()
        if h is None:
            return False
        try:
            return h.exists(self.key(key))
        except Exception as e:
            self._store.failed(h, "exists", e)
            return False

    def get(self, key: str, target_location: Optional[Any] = None, target_sizes: Optional[Any] = None) -> Optional[torch.Tensor]:
        """The page of ``key`` copied into ``target_location`` (a contiguous tensor of the
        page's size; returned), or into a new uint8 tensor when none is given; None if absent."""
        got = self.batch_get([key], None if target_location is None else [target_location])
        return got[0]

    def batch_get(self, keys: List[str], target_locations: Optional[Any] = None, target_sizes: Optional[Any] = None) -> List[Optional[torch.Tensor]]:
        n = len(keys)
        h = self._store.get()
        if h is None or n == 0:
            return [None] * n
        targets = list(target_locations) if target_locations is not None else [None] * n
        infos: List[Any] = []
        try:
            infos = h.batch_retrieve([self.key(k) for k in keys])
            out: List[Optional[torch.Tensor]] = []
            for info, target in zip(infos, targets):
                if info is None:
                    out.append(None)
                elif target is None:
                    out.append(frombuffer(info.view).clone())
                elif not self._fits(info, target.numel() * target.element_size()):
                    out.append(None)
                else:
                    target.view(-1).view(torch.uint8).copy_(frombuffer(info.view))
                    out.append(target)
            return out
        except Exception as e:
            self._store.failed(h, "batch_get", e)
            return [None] * n
        finally:
            h.release_retrieved(infos)

    def set(self, key: str, value: Optional[Any] = None, target_location: Optional[Any] = None, target_sizes: Optional[Any] = None) -> bool:
        if value is None:
            return False
        return self.batch_set([key], [value])

    def batch_set(self, keys: List[str], values: Optional[Any] = None, target_locations: Optional[Any] = None, target_sizes: Optional[Any] = None) -> bool:
        """Store each flat tensor of ``values`` under its key; True if every one is stored."""
        n = len(keys)
        h = self._store.get()
        if h is None or values is None or n == 0 or len(values) != n:
            return False
        try:
            names = [self.key(k) for k in keys]
            stored = h.batch_exists(names)
            todo = [i for i in range(n) if not stored[i]]
            return all(self._store_pages(h, [names[i] for i in todo], [values[i] for i in todo]))
        except Exception as e:
            self._store.failed(h, "batch_set", e)
            return False

    # -- the rest of SGLang's interface -------------------------------------------------------

    def clear(self) -> None:
        """Delete this backend's pages (its model, rank and page format) from the namespace."""
        h = self._store.get()
        if h is None:
            return
        try:
            tail = f"{self._suffix}{self._tag}".encode()
            mine = [k for k in h.list_keys() if k.endswith(tail)]
            if mine:
                h.batch_delete(mine)
        except Exception as e:
            self._store.failed(h, "clear", e)

    def close(self) -> None:
        """Close the connection to marud (pages stay stored)."""
        self._store.close()

    # -- helpers ----------------------------------------------------------------------------

    @staticmethod
    def _fits(info: Any, nbytes: int) -> bool:
        if len(info.view) == nbytes:
            return True
        logger.warning("MaruStorage: an entry of %d bytes where a page has %d: read as a miss", len(info.view), nbytes)
        return False

    @staticmethod
    def _store_pages(h: MaruHandler, names: Sequence[str], pages: Sequence[torch.Tensor]) -> List[bool]:
        """Copy each page into pool memory allocated for it and publish them all: one
        exchange with marud for the allocations, one for the publication. When the pools
        cannot hold them all, the pages that fit are stored (allocated one by one until the
        pools are full) and the rest are not (False)."""
        if not pages:
            return []
        sizes = {page.numel() * page.element_size() for page in pages}
        handles: List[Any] = []
        try:
            if len(sizes) == 1:
                try:
                    handles = h.alloc_many(sizes.pop(), len(pages))
                except NoSpaceError:
                    handles = []
            if not handles:
                for page in pages:
                    try:
                        handles.append(h.alloc(page.numel() * page.element_size()))
                    except NoSpaceError as e:
                        logger.warning("MaruStorage: the pools are full: %d of %d pages not stored (%s)",
                                       len(pages) - len(handles), len(pages), e)
                        break
            for a, page in zip(handles, pages):
                frombuffer(a.buf, dtype=page.dtype).view(page.shape).copy_(page)
        except BaseException:
            for a in handles:
                h.free(a)
            raise
        stored = h.batch_store(list(names[: len(handles)]), handles) if handles else []
        return list(stored) + [False] * (len(pages) - len(handles))
