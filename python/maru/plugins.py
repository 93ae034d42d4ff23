"""Handler plugins, as in the original design.

A plugin is an entry point in the group ``maru.handler_plugins`` naming a class (or any
callable) that takes no argument and returns an object with any of these hooks:

- ``on_init(handler)``: the handler connected;
- ``on_batch_retrieve(handler, keys, results)``: a ``batch_retrieve`` returned ``results``
  for ``keys``;
- ``on_close(handler)``: the handler is closing;
- ``contribute_stats(handler) -> dict``: merged into ``get_stats()["plugins"][name]``.

``MARU_PLUGINS`` selects them: unset, every installed plugin; ``none``, none; otherwise a
comma-separated list of entry-point names. Loading and every hook are soft-fail: a plugin
that fails to import, to build or in a hook is logged and skipped, and never breaks the
handler's own operation.
"""

from __future__ import annotations

import logging
import os
from importlib.metadata import entry_points
from typing import Any, Dict, List, Tuple

logger = logging.getLogger(__name__)

#: The entry-point group plugins register in.
GROUP = "maru.handler_plugins"
HOOKS = ("on_init", "on_batch_retrieve", "on_close", "contribute_stats")


def selected() -> Any:
    """The names ``MARU_PLUGINS`` selects: ``None`` for all, else a set."""
    raw = os.environ.get("MARU_PLUGINS")
    if raw is None or raw.strip() == "" or raw.strip().lower() == "all":
        return None
    if raw.strip().lower() == "none":
        return set()
    return {name.strip() for name in raw.split(",") if name.strip()}


def load() -> List[Tuple[str, Any]]:
    """Instantiate the selected plugins, skipping (and logging) the broken ones."""
    wanted = selected()
    if wanted == set():
        return []
    out: List[Tuple[str, Any]] = []
    try:
        eps = list(entry_points(group=GROUP))
    except Exception:  # a broken distribution's metadata must not stop the handler
        logger.warning("maru: cannot list handler plugins", exc_info=True)
        return []
    found = {ep.name for ep in eps}
    if wanted:
        for name in sorted(wanted - found):
            logger.warning("maru: MARU_PLUGINS names %r, which is not installed", name)
    for ep in sorted(eps, key=lambda e: e.name):
        if wanted is not None and ep.name not in wanted:
            continue
        try:
            plugin = ep.load()()
        except Exception:
            logger.warning("maru: handler plugin %r failed to load; skipped", ep.name, exc_info=True)
            continue
        out.append((ep.name, plugin))
        logger.info("maru: handler plugin %r loaded", ep.name)
    return out


def call(plugins: List[Tuple[str, Any]], hook: str, *args: Any) -> None:
    """Call ``hook`` on every plugin that has it; failures are logged, never raised."""
    for name, plugin in plugins:
        fn = getattr(plugin, hook, None)
        if fn is None:
            continue
        try:
            fn(*args)
        except Exception:
            logger.warning("maru: handler plugin %r failed in %s", name, hook, exc_info=True)


def stats(plugins: List[Tuple[str, Any]], handler: Any) -> Dict[str, Any]:
    """Each plugin's ``contribute_stats``, by plugin name."""
    out: Dict[str, Any] = {}
    for name, plugin in plugins:
        fn = getattr(plugin, "contribute_stats", None)
        if fn is None:
            out[name] = {}
            continue
        try:
            out[name] = dict(fn(handler) or {})
        except Exception:
            logger.warning("maru: handler plugin %r failed in contribute_stats", name, exc_info=True)
            out[name] = {"error": "contribute_stats failed"}
    return out
