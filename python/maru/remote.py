"""The remote backend: ``MaruConfig(storage_backend="remote")``.

A worker without a CXL attachment (a GPU node) uses a *memory node*'s pool: its marud serves
the pool on a TCP door (``remote_bind``) for control messages, and the bytes move with
one-sided NIXL READ and WRITE between the pool and the worker's registered memory, no process
on the memory node touching them (doc/REMOTE.md).

:class:`maru.MaruHandler` keeps its verbs; what differs is where the memory is:

- ``alloc`` hands out a piece of the handler's *staging buffer*, ``pool_size`` bytes
  registered with NIXL once at connect; ``store`` WRITEs that piece into the pool as it is
  (no copy) and publishes it;
- ``retrieve`` READs the entry into a new piece of the staging buffer: ``MemoryInfo.view``
  is that piece (read-only), held until the view goes (or :meth:`maru.MaruHandler.release_retrieved`);
- after a failure the handler leaves the pool alone for ``remote_retry_s``: lookups miss and
  stores return False meanwhile, and nothing raises.

This module turns a configuration into the native core (``maru._native.RemoteCore``) and
shapes its statistics; the handler dispatches to it.
"""

from __future__ import annotations

import json
import logging
from typing import Any, Dict, Optional

from . import _native
from .config import MaruConfig

logger = logging.getLogger("maru.remote")

#: The region id of the staging buffer: allocations and retrieved views are pieces of it,
#: ``page_index`` their offset in :data:`STAGING_PAGE_SIZE` pages.
STAGING_REGION: int = _native.STAGING_REGION
#: Pieces of the staging buffer start at multiples of this.
STAGING_PAGE_SIZE: int = _native.STAGING_PAGE_SIZE


def open_core(config: MaruConfig) -> Optional["_native.RemoteCore"]:
    """Connect to the memory node ``config.remote_url`` names: load NIXL, create this worker's
    agent and staging buffer, say hello with the token, make the namespace. None on failure
    (logged), as :meth:`maru.MaruHandler.connect` answers False."""
    try:
        return _native.RemoteCore(
            str(config.remote_url),
            config.remote_token,
            str(config.node_id),
            config.namespace,
            int(config.timeout_ms),
            float(config.remote_transfer_timeout_s),
            float(config.remote_retry_s),
            int(config.pool_size),
            int(config.chunk_size_bytes),
            float(config.remote_load_reserve),
            config.remote_ucx_device or None,
            True,
            int(config.namespace_mode),
        )
    except Exception as e:  # NIXL missing, marud unreachable, a refused token...
        logger.error("maru: cannot use the remote pool at %s: %s", config.remote_url, e)
        return None


def get_stats(handler: Any, core: "_native.RemoteCore", plugin_stats: Dict[str, Any]) -> Dict[str, Any]:
    """A remote handler's statistics: the original's ``remote_storage`` key (this worker's
    counters, its staging buffer, whether the pool is left alone now), plus ``plugins`` and
    maru's own under ``maru``. The memory node's own statistics are marud's there
    (``maructl stats``)."""
    raw = json.loads(core.stats_json())
    tensors = handler._tensor_io.stats() if handler._tensor_io is not None else {}
    return {
        "remote_storage": raw,
        "plugins": plugin_stats,
        "maru": {
            "namespace": raw.get("namespace"),
            "backend": "remote",
            "tensors": tensors,
        },
    }
