"""maru for LMCache's built-in ``MaruBackend`` (LMCache >= 0.4.3, ``maru_path`` in its config).

LMCache imports ``MaruConfig`` and ``MaruHandler`` from :mod:`maru` and
:class:`CxlMemoryAdapter` from here; with them its backend runs on maru unchanged::

    from maru_lmcache import CxlMemoryAdapter

The adapter needs torch and LMCache; importing this package does not.
"""

__all__ = ["CxlMemoryAdapter"]


def __getattr__(name: str):
    if name in ("CxlMemoryAdapter", "CxlMemoryAllocator"):  # the original's old name too
        from maru_lmcache.adapter import CxlMemoryAdapter

        return CxlMemoryAdapter
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
