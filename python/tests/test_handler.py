"""The client API (MaruConfig, MaruHandler) against a live mount."""

from __future__ import annotations

import errno
import gc
import json
import os
import subprocess
import time
import warnings
from pathlib import Path

import pytest

import maru
from conftest import Marud
from pagemap import pfn_of, pfn_of_file

np = pytest.importorskip("numpy")


def pattern(seed: int, size: int) -> bytes:
    """Deterministic bytes that differ per seed and per position."""
    block = bytes((seed * 131 + i * 7) % 251 for i in range(4096))
    return (block * (size // 4096 + 1))[:size]


def put(h: maru.MaruHandler, key: str, data: bytes) -> bool:
    a = h.alloc(len(data))
    a.buf[:] = data
    return h.store(key, a)


def test_store_then_retrieve_returns_the_bytes(handler: maru.MaruHandler) -> None:
    data = pattern(1, 3 * 4096 + 17)
    assert put(handler, "k1", data)
    info = handler.retrieve("k1")
    assert info is not None
    with info:
        assert info.size == len(data) == len(info.view)
        assert info.view.readonly
        assert info.view.tobytes() == data
    assert info.closed


def test_keys_are_write_once(handler: maru.MaruHandler, marud: Marud) -> None:
    assert put(handler, "once", b"first")
    second = handler.alloc(6)
    second.buf[:] = b"second"
    assert handler.store("once", second) is False
    assert second.done
    with handler.retrieve("once") as info:  # type: ignore[union-attr]
        assert info.view.tobytes() == b"first"
    # The losing allocation left nothing behind (its temporary name is gone).
    assert not os.path.exists(second.path)
    assert sorted(handler.list_keys()) == ["once"]
    assert handler.get_stats()["ops"]["store_exists"] == 1


def test_missing_keys(handler: maru.MaruHandler) -> None:
    assert handler.retrieve("nope") is None
    assert handler.exists("nope") is False
    assert handler.delete("nope") is False
    assert handler.pin("nope") is False
    assert handler.unpin("nope") is False
    assert handler.is_pinned("nope") is None
    assert handler.entry_info("nope") is None


def test_exists_delete_and_mapping_survives_delete(handler: maru.MaruHandler) -> None:
    data = pattern(2, 8192)
    assert put(handler, "gone", data)
    assert handler.exists("gone")
    info = handler.retrieve("gone")
    assert info is not None
    assert handler.delete("gone") is True
    assert not handler.exists("gone")
    assert handler.retrieve("gone") is None
    assert info.view.tobytes() == data  # a deleted entry keeps its bytes while mapped
    info.close()


def test_entries_are_sealed_and_immutable(handler: maru.MaruHandler) -> None:
    assert put(handler, "sealed", b"x" * 100)
    attrs = handler.entry_info("sealed")
    assert attrs is not None and attrs["state"] == "sealed" and attrs["size"] == "100"
    with pytest.raises(PermissionError):
        open(handler.path_of("sealed"), "r+b")


def test_pin_and_unpin(handler: maru.MaruHandler) -> None:
    assert put(handler, "p", b"pinned")
    assert handler.is_pinned("p") is False
    assert handler.pin("p") is True
    assert handler.is_pinned("p") is True
    assert handler.unpin("p") is True
    assert handler.is_pinned("p") is False


def test_batch_operations(handler: maru.MaruHandler) -> None:
    keys = [f"b{i}" for i in range(8)]
    handles = []
    for i, _ in enumerate(keys):
        a = handler.alloc(100 + i)
        a.buf[:] = pattern(i, 100 + i)
        handles.append(a)
    assert handler.batch_store(keys, handles) == [True] * 8
    assert handler.batch_exists(keys + ["missing"]) == [True] * 8 + [False]
    infos = handler.batch_retrieve(keys + ["missing"])
    assert infos[-1] is None
    for i, info in enumerate(infos[:-1]):
        assert info is not None and info.view.tobytes() == pattern(i, 100 + i)
        info.close()
    assert handler.batch_pin(keys[:2]) == [True, True]
    assert handler.batch_unpin(keys[:2]) == [True, True]
    assert handler.batch_delete(keys) == [True] * 8
    assert list(handler.list_keys()) == []
    with pytest.raises(ValueError):
        handler.batch_store(["a"], [])


def test_numpy_wraps_views_without_copying(handler: maru.MaruHandler) -> None:
    a = handler.alloc(4096 * 4)
    arr = np.frombuffer(a.buf, dtype=np.float32)
    assert arr.ctypes.data == maru.address_of(a.buf)  # the array *is* pool memory
    arr[:] = np.arange(arr.size, dtype=np.float32)
    with pytest.raises(BufferError):
        handler.store("np", a)  # the array still exports the mapping
    del arr
    assert handler.store("np", a)
    with handler.retrieve("np") as info:  # type: ignore[union-attr]
        view = np.frombuffer(info.view, dtype=np.float32)
        assert view.ctypes.data == maru.address_of(info.view)
        assert not view.flags.writeable
        assert np.array_equal(view, np.arange(4096, dtype=np.float32))
        with pytest.raises(BufferError):
            info.close()
        assert not info.closed
        del view
    assert info.closed


def test_torch_wraps_views_without_copying(handler: maru.MaruHandler) -> None:
    torch = pytest.importorskip("torch")
    a = handler.alloc(1024 * 2)
    t = torch.frombuffer(a.buf, dtype=torch.bfloat16)
    assert t.data_ptr() == maru.address_of(a.buf)
    t.copy_(torch.arange(1024, dtype=torch.bfloat16))
    del t
    assert handler.store("t", a)
    info = handler.retrieve("t", copy_on_write=True)
    assert info is not None
    r = torch.frombuffer(info.view, dtype=torch.bfloat16)
    assert r.data_ptr() == maru.address_of(info.view)
    assert torch.equal(r, torch.arange(1024, dtype=torch.bfloat16))
    r[0] = 42  # copy-on-write: private to this mapping
    del r
    info.close()
    with handler.retrieve("t") as again:  # type: ignore[union-attr]
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", UserWarning)  # torch: "buffer is not writable"
            r2 = torch.frombuffer(again.view, dtype=torch.bfloat16)
        assert float(r2[0]) == 0.0
        del r2


def test_retrieved_view_is_the_pool_page(handler: maru.MaruHandler) -> None:
    """Zero copy: a page of retrieve(key).view has the PFN of the entry's backing page."""
    size = 4 << 20
    a = handler.alloc(size)
    a.buf[:] = pattern(3, size)
    writer_pfns = [pfn_of(a.buf, off) for off in (0, size // 2, size - 1)]
    assert handler.store("zc", a)
    attrs = handler.entry_info("zc")
    assert attrs is not None
    assert attrs["access"] == "passthrough" and attrs["kind"] == "memfs"
    location = attrs["location"]
    with handler.retrieve("zc") as info:  # type: ignore[union-attr]
        for i, off in enumerate((0, size // 2, size - 1)):
            reader = pfn_of(info.view, off)
            assert reader == pfn_of_file(location, off), "the mapping is not the pool's page"
            assert reader == writer_pfns[i], "the reader does not map the page the writer filled"
    with handler.retrieve("zc", copy_on_write=True) as cow:  # type: ignore[union-attr]
        assert pfn_of(cow.view, 0) == writer_pfns[0]  # a private mapping shares until written


def _fuse_ops(marud: Marud) -> dict:
    """marud's counts of the requests its mount received (``maructl status --json``)."""
    maructl = Path(marud.binary).parent / "maructl"
    out = subprocess.run(
        [str(maructl), "status", "--socket", str(marud.socket), "--json"],
        check=True,
        capture_output=True,
        text=True,
    ).stdout
    return {k: v for k, v in json.loads(out)["ops"].items() if k.startswith("fuse_")}


def _smaps_kib(addr: int, field: str) -> int:
    """The ``field`` (kB) of /proc/self/smaps for the mapping that holds ``addr``."""
    inside = False
    with open("/proc/self/smaps") as f:
        for line in f:
            head = line.split()[0]
            if "-" in head and not head.endswith(":"):
                lo, hi = (int(x, 16) for x in head.split("-"))
                inside = lo <= addr < hi
            elif inside and head == field:
                return int(line.split()[1])
    raise AssertionError(f"no {field} for {addr:#x}")


def test_a_retrieve_maps_2mib_pages_with_one_open(handler: maru.MaruHandler, marud: Marud) -> None:
    """retrieve() of a hot key maps the entry at a 2 MiB boundary, the pool's 2 MiB pages
    whole, whatever its size; marud sees one OPEN per retrieve and no LOOKUP (the kernel
    caches names). (``mmap.mmap`` also calls fstat, which after a mapping of a passthrough
    file refreshes its atime with a GETATTR: doc/PYTHON.md.)"""
    size = (4 << 20) + 4096  # not a multiple of 2 MiB
    data = pattern(5, size)
    assert put(handler, "rt", data)
    with handler.retrieve("rt") as info:  # type: ignore[union-attr]
        assert info.view[size - 1] == data[-1]
    n = 5
    before = _fuse_ops(marud)
    for _ in range(n):
        with handler.retrieve("rt") as info:  # type: ignore[union-attr]
            assert bytes(info.view[:64]) == data[:64] and info.view[size - 1] == data[-1]
            addr = maru.address_of(info.view)
            assert addr % (2 << 20) == 0
            for off in range(0, size, 4096):
                _ = info.view[off]
            assert _smaps_kib(addr, "ShmemPmdMapped:") == 4 << 10
    after = _fuse_ops(marud)
    grew = {k: after.get(k, 0) - before.get(k, 0) for k in after}
    assert grew.get("fuse_open") == n, grew
    assert grew.get("fuse_lookup", 0) == 0 and grew.get("fuse_getattr", 0) <= n, grew


def test_invalid_keys_are_refused(handler: maru.MaruHandler) -> None:
    for bad in ["", ".", "..", "a/b", "a\0b", "x" * 256, maru.TEMP_PREFIX + "x", b"\xff", "\udcff"]:
        with pytest.raises(maru.InvalidKeyError):
            handler.exists(bad)
    with pytest.raises(maru.InvalidKeyError) as e:
        handler.exists("x" * 256)
    assert e.value.errno == errno.ENAMETOOLONG
    with pytest.raises(TypeError):
        handler.exists(3)  # type: ignore[arg-type]
    a = handler.alloc(1)
    with pytest.raises(maru.InvalidKeyError):
        handler.store("bad/key", a)
    assert not a.done  # a refused key leaves the handle usable
    longest = "é" * 127 + "x"  # 255 bytes of UTF-8
    assert handler.store(longest, a)
    assert handler.exists(longest)
    assert handler.store("bytes-key".encode(), handler.alloc(1))
    assert handler.exists("bytes-key")


def test_alloc_larger_than_the_pool_raises_no_space(handler: maru.MaruHandler, marud: Marud) -> None:
    before = marud.free_bytes()
    with pytest.raises(maru.NoSpaceError) as e:
        handler.alloc(before + (64 << 20))
    # More than the pool can ever hold: marud refuses the size at once (EFBIG).
    assert e.value.errno == errno.EFBIG
    assert marud.free_bytes() >= before - (4 << 20)  # nothing kept
    with pytest.raises(ValueError):
        handler.alloc(0)


def test_free_and_unstored_handles_leave_nothing(handler: maru.MaruHandler) -> None:
    a = handler.alloc(4096)
    path = a.path
    assert os.path.exists(path)  # the writer sees its own allocation
    handler.free(a)
    assert not os.path.exists(path)
    with pytest.raises(ValueError):
        handler.store("k", a)
    with handler.alloc(4096) as b:
        path = b.path
    assert b.done and not os.path.exists(path)
    c = handler.alloc(4096)
    path = c.path
    del c
    gc.collect()
    assert not os.path.exists(path)  # the finalizer unlinked it
    assert list(handler.list_keys()) == []


def test_close_releases_mappings_and_allocations(marud: Marud, namespace: str) -> None:
    h = maru.MaruHandler(marud.config(namespace))
    assert put(h, "k", b"abc")
    info = h.retrieve("k")
    pending = h.alloc(100)
    stats = h.get_stats()["instance"]
    assert stats["mappings"] == 1 and stats["allocations"] == 1 and stats["allocated_bytes"] == 100
    h.close()
    assert info is not None and info.closed
    assert pending.done and not os.path.exists(pending.path)
    assert not h.connected
    with pytest.raises(maru.MountError):
        h.exists("k")
    # A mapping still used by an array is detached, not unmapped under it.
    h2 = maru.MaruHandler(marud.config(namespace))
    info2 = h2.retrieve("k")
    assert info2 is not None
    arr = np.frombuffer(info2.view, dtype=np.uint8)
    with pytest.warns(ResourceWarning):
        h2.close()
    assert bytes(arr) == b"abc"


def test_context_manager_and_stats(marud: Marud, namespace: str) -> None:
    with maru.MaruHandler(marud.config(namespace, auto_connect=False)) as h:
        assert h.connected and h.healthcheck()
        assert put(h, "s1", b"x" * 5000)
        assert put(h, "s2", b"y" * 3000)
        with h.retrieve("s1"):
            pass
        stats = h.get_stats()
    assert stats["namespace"] == namespace
    assert stats["namespace_usage"] == {"entries": 2, "bytes": 8000}
    assert stats["instance"]["stored_entries"] == 2 and stats["instance"]["stored_bytes"] == 8000
    assert stats["pool"]["total_bytes"] == 1 << 30
    assert 0 < stats["pool"]["free_bytes"] <= stats["pool"]["total_bytes"]
    assert stats["ops"]["store"] == 2 and stats["ops"]["retrieve"] == 1
    assert not h.connected


def test_nested_namespaces(marud: Marud, namespace: str) -> None:
    with maru.MaruHandler(marud.config(f"{namespace}/inner/most")) as h:
        assert put(h, "k", b"nested")
        assert os.path.exists(marud.mount / namespace / "inner" / "most" / "k")


def test_connect_failures(marud: Marud, tmp_path: "os.PathLike[str]") -> None:
    with pytest.raises(maru.MountError):
        maru.MaruHandler(maru.MaruConfig(mount_path=str(tmp_path), namespace="x", timeout_ms=50))
    with pytest.raises(maru.NoSpaceError):
        maru.MaruHandler(marud.config("x", pool_size=2 << 30))
    with pytest.raises(maru.NotFoundError):
        maru.MaruHandler(marud.config("does-not-exist", create_namespace=False))
    with pytest.raises(maru.InvalidKeyError):
        maru.MaruHandler(marud.config("/abs"))
    h = maru.MaruHandler(marud.config("never-connected", auto_connect=False))
    with pytest.raises(maru.MountError):
        h.alloc(1)
    assert not (marud.mount / "never-connected").exists()


def test_put_writes_existing_bytes(handler: maru.MaruHandler, marud: Marud) -> None:
    head, body = b"head", np.arange(10000, dtype=np.int32)
    assert handler.put("w", head, body, memoryview(b"tail"))
    with handler.retrieve("w") as info:  # type: ignore[union-attr]
        assert info.view.tobytes() == head + body.tobytes() + b"tail"
    assert handler.put("w", b"again") is False  # write-once
    assert handler.put("empty") and handler.retrieve("empty").size == 0  # type: ignore[union-attr]
    before = marud.free_bytes()
    with pytest.raises(maru.NoSpaceError):
        handler.put("huge", bytes(1 << 20), *[memoryview(bytes(64 << 20))] * ((before >> 26) + 2))
    assert not handler.exists("huge")
    assert sorted(handler.list_keys()) == ["empty", "w"]
    deadline = time.monotonic() + 5
    while marud.free_bytes() < before - (4 << 20) and time.monotonic() < deadline:
        time.sleep(0.01)
    assert marud.free_bytes() >= before - (4 << 20)  # the partial write was given back
