"""MaruHandler on a raw pool (``file:``, the stand-in for a CXL device): the verbs, and
zero copy (a retrieved view is the pool's own page, at the entry's offset in the device).

The rest of the suite runs on memfs pools; these tests use the session's raw-pool marud
(``raw_marud`` in conftest).
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Tuple

import pytest

import maru
from maru.testing import PrivateMarud
from pagemap import PAGE, pfn_of, pfn_of_file

KiB = 1 << 10


def pattern(seed: int, size: int) -> bytes:
    """Deterministic bytes that differ per seed and per position."""
    block = bytes((seed * 131 + i * 7) % 251 for i in range(4096))
    return (block * (size // 4096 + 1))[:size]


def xattr(path: str, name: str) -> str:
    return os.getxattr(path, f"user.maru.{name}").decode()


def location(path: str) -> Tuple[str, int]:
    """The pool file and byte offset of an entry of a raw pool (``PATH@0xOFFSET``)."""
    where, _, offset = xattr(path, "location").rpartition("@")
    assert where and offset.startswith("0x"), xattr(path, "location")
    return where, int(offset, 16)




def test_the_daemon_serves_a_raw_pool(raw_marud: PrivateMarud) -> None:
    assert raw_marud.pool.is_file() and raw_marud.pool.stat().st_size >= 256 << 20
    st = os.statvfs(raw_marud.mount)
    assert 200 << 20 <= st.f_blocks * st.f_frsize <= 256 << 20


def test_retrieved_view_is_the_pool_page_at_the_entry_offset(
    raw_handler: maru.MaruHandler, raw_marud: PrivateMarud
) -> None:
    """Zero copy on a raw pool: the pages of retrieve(key).view are the pool file's pages at
    the entry's offset, and the very pages the writer filled through alloc().buf."""
    size = 64 * KiB
    data = pattern(5, size)
    a = raw_handler.alloc(size)
    assert a.region_id < maru.handler.MEMFS_REGION_BASE  # a raw pool is a region: the pool's id
    a.buf[:] = data
    offsets = (0, PAGE, size // 2 + 123, size - 1)
    writer_pfns = [pfn_of(a.buf, off) for off in offsets]
    assert raw_handler.store("zc", a)
    path = raw_handler.path_of("zc")
    assert xattr(path, "kind") == "file" and xattr(path, "access") == "copy"
    pool_file, base = location(path)
    assert Path(pool_file) == raw_marud.pool
    assert base == int(xattr(path, "offset")) and base % PAGE == 0 and base > 0
    info = raw_handler.retrieve("zc")
    assert info is not None and info.view.tobytes() == data
    assert info.region_id == a.region_id and info.page_index == base // maru.handler.RAW_PAGE_SIZE
    for i, off in enumerate(offsets):
        reader = pfn_of(info.view, off)
        assert reader == pfn_of_file(pool_file, base + off), f"byte {off}: the view is not the pool's page"
        assert reader == writer_pfns[i], f"byte {off}: the reader does not map the page the writer filled"
    # The first and a later page are different pages of the pool (not one page mapped twice).
    assert pfn_of(info.view, 0) != pfn_of(info.view, PAGE)
    # The region accessors see the same bytes at the same offset of the pool.
    assert raw_handler.get_region_dax_path(a.region_id) == pool_file
    view = raw_handler.get_buffer_view(a.region_id, base, size)
    assert view is not None and view.tobytes() == data
    assert pfn_of(view, 0) == pfn_of(info.view, 0)
    # The mount (which serves raw entries by copying) reads the same bytes.
    with open(path, "rb") as f:
        assert f.read() == data


def test_verbs_on_a_raw_pool(raw_handler: maru.MaruHandler) -> None:
    h = raw_handler
    entries = {f"k{i}": pattern(i, 4096 * i + 17) for i in range(1, 6)}
    for key, data in entries.items():
        assert h.put(key, data)
    assert all(h.exists(k) for k in entries)
    assert h.batch_exists([*entries, "missing"]) == [True] * len(entries) + [False]
    assert not h.exists("missing") and h.retrieve("missing") is None
    for key, data in entries.items():
        info = h.retrieve(key)
        assert info is not None and info.view.readonly and info.view.tobytes() == data
    got = h.batch_retrieve(["k2", "missing", "k5"])
    assert got[1] is None
    assert got[0].view.tobytes() == entries["k2"] and got[2].view.tobytes() == entries["k5"]  # type: ignore[union-attr]
    assert sorted(h.list_keys()) == sorted(k.encode() for k in entries)
    # Through the mount too.
    with open(h.path_of("k3"), "rb") as f:
        assert f.read() == entries["k3"]
    # Delete: gone for both doors, a view held before keeps its bytes, the key is free again.
    held = h.retrieve("k1")
    assert held is not None
    assert h.delete("k1") is True
    assert h.delete("k1") is False
    assert not h.exists("k1") and h.retrieve("k1") is None
    assert not os.path.exists(h.path_of("k1"))
    assert held.view.tobytes() == entries["k1"]
    assert h.put("k1", b"again")
    assert h.retrieve("k1").view.tobytes() == b"again"  # type: ignore[union-attr]
    assert h.batch_delete(["k2", "k3", "missing"]) == [True, True, False]
    assert h.batch_exists(["k2", "k3", "k4"]) == [False, False, True]
    # An allocation given back is not published; one stored is.
    a = h.alloc(8192)
    h.free(a)
    assert a.done
    b = h.alloc(100)
    b.buf[:] = pattern(9, 100)
    assert h.batch_store(["b"], [b]) == [True]
    assert h.retrieve("b").view.tobytes() == pattern(9, 100)  # type: ignore[union-attr]
