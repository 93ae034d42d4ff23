"""The client API (the original design's MaruConfig and MaruHandler) against a private marud."""

from __future__ import annotations

import os
import subprocess
import sys
import time
import uuid
import warnings
from pathlib import Path

import pytest

import maru
from maru import _native
from conftest import Marud, child_env
from pagemap import pfn_of, pfn_of_file

np = pytest.importorskip("numpy")

MiB = 1 << 20


def pattern(seed: int, size: int) -> bytes:
    """Deterministic bytes that differ per seed and per position."""
    block = bytes((seed * 131 + i * 7) % 251 for i in range(4096))
    return (block * (size // 4096 + 1))[:size]


def put(h: maru.MaruHandler, key, data: bytes) -> bool:
    a = h.alloc(len(data))
    a.buf[:] = data
    return h.store(key, a)


def xattr(path: str, name: str) -> str:
    return os.getxattr(path, f"user.maru.{name}").decode()


# -- MaruConfig -----------------------------------------------------------------------------


def test_config_defaults_are_the_originals(monkeypatch: pytest.MonkeyPatch) -> None:
    for var in ("MARU_EAGER_MAP", "MARU_STAT", "MARU_SOCKET", "MARU_MOUNT"):
        monkeypatch.delenv(var, raising=False)
    c = maru.MaruConfig()
    assert c.server_url == "tcp://localhost:5555"
    assert c.pool_size == 100 * MiB and c.chunk_size_bytes == MiB
    assert c.auto_connect is True and c.timeout_ms == 2000
    assert c.use_async_rpc is True and c.max_inflight == 64
    assert c.eager_map is True and c.auto_expand is True and c.expand_size is None
    assert c.rm_address == "127.0.0.1:9850" and c.enable_stats is False
    assert c.namespace == "default" and c.mount_path == maru.DEFAULT_MOUNT == "/maru"
    assert c.socket_path is None and c.socket == maru.DEFAULT_SOCKET
    uuid.UUID(c.instance_id)  # a fresh UUID
    assert maru.MaruConfig().instance_id != c.instance_id
    assert maru.MaruConfig(instance_id="me").instance_id == "me"


def test_config_environment(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("MARU_EAGER_MAP", "0")
    monkeypatch.setenv("MARU_STAT", "yes")
    monkeypatch.setenv("MARU_SOCKET", "/tmp/x.sock")
    monkeypatch.setenv("MARU_MOUNT", "/tmp/mnt")
    c = maru.MaruConfig()
    assert c.eager_map is False and c.enable_stats is True
    assert c.socket == "/tmp/x.sock" and c.mount_path == "/tmp/mnt"
    monkeypatch.setenv("MARU_EAGER_MAP", "on")
    monkeypatch.setenv("MARU_STAT", "false")
    c = maru.MaruConfig(eager_map=False, enable_stats=True)
    assert c.eager_map is True and c.enable_stats is False  # the environment wins, as the original
    monkeypatch.setenv("MARU_STAT", "maybe")
    with pytest.raises(ValueError):
        maru.MaruConfig()


def test_config_validation() -> None:
    with pytest.raises(ValueError):
        maru.MaruConfig(chunk_size_bytes=0)
    with pytest.raises(ValueError):
        maru.MaruConfig(pool_size=MiB - 1)
    with pytest.raises(ValueError):
        maru.MaruConfig(expand_size=2 * MiB, auto_expand=False)
    with pytest.raises(ValueError):
        maru.MaruConfig(expand_size=MiB - 1)
    with pytest.raises(ValueError):
        maru.MaruConfig(timeout_ms=-1)
    assert maru.MaruConfig(expand_size=2 * MiB).expand_size == 2 * MiB


def test_server_urls(marud: Marud) -> None:
    sock = str(marud.socket)
    for url in ("tcp://localhost:5555", "maru://127.0.0.1:1", "localhost:5555", "tcp://0.0.0.0:5555"):
        assert maru.MaruConfig(server_url=url, socket_path=sock).socket == sock
    assert maru.MaruConfig(server_url=f"unix://{sock}").socket == sock
    with pytest.raises(ValueError):
        maru.MaruConfig(server_url="unix://").socket
    with pytest.raises(ValueError):
        maru.MaruConfig(server_url="http://localhost:1").socket
    # A remote server is refused at connect() with ValueError (clients use their own host's marud).
    h = maru.MaruHandler(maru.MaruConfig(server_url="tcp://10.255.255.1:5555", socket_path=sock))
    with pytest.raises(ValueError, match="another host"):
        h.connect()
    assert not h.connected
    # unix:// names the daemon's socket: connects.
    cfg = marud.config("url-ns", server_url=f"unix://{sock}")
    cfg.socket_path = None
    with maru.MaruHandler(cfg) as h2:
        assert h2.connected and h2.healthcheck()


# -- connection -------------------------------------------------------------------------------


def test_constructor_does_not_connect_and_connect_returns_bool(marud: Marud, namespace: str) -> None:
    h = maru.MaruHandler(marud.config(namespace))
    assert not h.connected and not h.healthcheck()
    with pytest.raises(RuntimeError):
        h.alloc(1)
    assert h.connect() is True
    assert h.connect() is True  # already connected
    assert h.connected and h.healthcheck()
    assert "connected" in repr(h)
    h.close()
    assert not h.connected
    h.close()  # twice is fine
    with pytest.raises(RuntimeError):
        h.exists("k")


def test_connect_is_false_without_marud(tmp_path: Path, marud: Marud) -> None:
    h = maru.MaruHandler(maru.MaruConfig(socket_path=str(tmp_path / "none.sock"), timeout_ms=100))
    assert h.connect() is False
    assert not h.connected
    with maru.MaruHandler(maru.MaruConfig(socket_path=str(tmp_path / "none.sock"), timeout_ms=100)) as h2:
        assert not h2.connected
    # The pools are smaller than pool_size: connect() fails too.
    big = maru.MaruHandler(marud.config("x", pool_size=4 << 30))
    assert big.connect() is False


def test_context_manager(marud: Marud, namespace: str) -> None:
    with maru.MaruHandler(marud.config(namespace)) as h:
        assert h.connected
        assert put(h, "cm", b"context")
    assert not h.connected
    with maru.MaruHandler(marud.config(namespace, auto_connect=False)) as h:
        assert not h.connected
        assert h.connect()
        assert h.retrieve("cm").view.tobytes() == b"context"  # type: ignore[union-attr]
    assert not h.connected


def test_nested_namespaces(marud: Marud, namespace: str) -> None:
    with maru.MaruHandler(marud.config(f"{namespace}/inner/most")) as h:
        assert put(h, "k", b"nested")
        assert os.path.exists(marud.mount / namespace / "inner" / "most" / "k")
        assert h.path_of("k") == str(marud.mount / namespace / "inner" / "most" / "k")


# -- alloc / store / retrieve -------------------------------------------------------------


def test_alloc_handle(handler: maru.MaruHandler) -> None:
    a = handler.alloc(3 * 4096 + 17)
    assert isinstance(a, maru.AllocHandle)
    assert a.size == a._size == 3 * 4096 + 17
    assert len(a.buf) == a.size and not memoryview(a.buf).readonly
    assert a.region_id == a._region_id and a.page_index == a._page_index
    assert a.region_id >= maru.handler.MEMFS_REGION_BASE and a.page_index == 0  # memfs: a region per file
    assert not a.done
    handler.free(a)
    assert a.done
    with pytest.raises(ValueError):
        handler.free(a)  # a second free
    with pytest.raises(ValueError):
        handler.alloc(0)
    with pytest.raises(ValueError):
        handler.alloc(handler.get_chunk_size() + 1)  # at most chunk_size_bytes, as the original
    handler.free(handler.alloc(handler.get_chunk_size()))
    # The original's dataclass can be built by hand (it holds no pool memory).
    h = maru.AllocHandle(buf=memoryview(bytearray(3)), _region_id=0, _page_index=0, _size=3)
    assert h.size == 3 and h.region_id == 0 and h.page_index == 0
    with pytest.raises(ValueError):
        handler.store("hand", h)
    assert not handler.exists("hand")


def test_alloc_many_allocates_large_entries_together(handler: maru.MaruHandler, small_marud: Marud) -> None:
    size = 3 * handler.get_chunk_size() + 5  # above chunk_size_bytes: no limit here
    handles = handler.alloc_many(size, 5)
    assert len(handles) == 5 and len({(a.region_id, a.page_index) for a in handles}) == 5
    for i, a in enumerate(handles):
        assert a.size == size and not a.done
        a.buf[:] = bytes([i]) * size
    keys = [f"many-{i}" for i in range(5)]
    assert handler.batch_store(keys, handles) == [True] * 5
    for i, info in enumerate(handler.batch_retrieve(keys)):
        assert bytes(info.view) == bytes([i]) * size
    assert handler.alloc_many(size, 0) == []
    with pytest.raises(ValueError):
        handler.alloc_many(0, 2)
    # All or none: more than a 64 MiB pool holds is refused, and nothing stays allocated.
    h = maru.MaruHandler(small_marud.config("many"))
    assert h.connect()
    try:
        with pytest.raises(maru.NoSpaceError):
            h.alloc_many(8 * MiB, 16)
        for a in h.alloc_many(8 * MiB, 6):  # what the refused call took is back
            h.free(a)
    finally:
        h.close()


def test_store_then_retrieve_returns_the_bytes(handler: maru.MaruHandler) -> None:
    data = pattern(1, 3 * 4096 + 17)
    a = handler.alloc(len(data))
    a.buf[:] = data
    assert handler.store("k1", a) is True
    assert a.done
    assert bytes(a.buf) == data  # still readable: a private copy
    assert isinstance(a.buf.obj, bytearray)  # nothing else viewed it: a copy, no remapping
    a.buf[0] = (data[0] + 1) % 256  # writes no longer reach the pool
    info = handler.retrieve("k1")
    assert isinstance(info, maru.MemoryInfo)
    assert len(info.view) == len(data)
    assert info.view.readonly
    assert info.view.tobytes() == data
    assert info.region_id >= maru.handler.MEMFS_REGION_BASE and info.page_index == 0
    with pytest.raises(TypeError):
        info.view[0] = 1
    # The original's dataclass can be built by hand.
    m = maru.MemoryInfo(view=memoryview(b"x"))
    assert bytes(m.view) == b"x" and m.region_id == 0 and m.page_index == 0
    assert m == maru.MemoryInfo(view=memoryview(b"x"))


def test_the_object_a_stored_handle_s_view_was_made_of_keeps_its_bytes(
    handler: maru.MaruHandler,
) -> None:
    # The object behind the handle's view (`buf.obj`), kept past the store with no view of
    # it alive, can be viewed again after: it must see the bytes stored, not pool pages the
    # store let go of (unmapped: the new view's first read faulted).
    data = pattern(4, 4096)
    a = handler.alloc(len(data))
    a.buf[:] = data
    exporter = a.buf.obj
    assert handler.store("behind", a) is True
    again = memoryview(exporter)
    assert bytes(again) == data and bytes(a.buf) == data
    again[0] = (data[0] + 1) % 256  # a private copy: writes never reach the pool
    assert handler.retrieve("behind").view.tobytes() == data  # type: ignore[union-attr]


def test_views_of_a_stored_handle_keep_its_bytes(handler: maru.MaruHandler) -> None:
    # Views kept past the store (the whole buffer, a slice of it, a memoryview built on it)
    # read the bytes stored; writes through them never reach the pool.
    data = pattern(2, 4096)
    a = handler.alloc(len(data))
    a.buf[:] = data
    whole, part, built = a.buf, a.buf[100:200], memoryview(a.buf)
    assert handler.store("viewed", a) is True
    assert bytes(whole) == data and bytes(part) == data[100:200] and bytes(built) == data
    assert bytes(a.buf) == data and not isinstance(a.buf.obj, bytearray)
    whole[0] = (data[0] + 1) % 256
    part[0] = (data[100] + 1) % 256
    assert handler.retrieve("viewed").view.tobytes() == data  # type: ignore[union-attr]
    # A slice alone kept alive (the handle's own view unreferenced elsewhere).
    b = handler.alloc(len(data))
    b.buf[:] = data
    tail = b.buf[-10:]
    assert handler.store("sliced", b) is True
    assert bytes(tail) == data[-10:] and bytes(b.buf) == data
    tail[0] = (data[-10] + 1) % 256
    assert handler.retrieve("sliced").view.tobytes() == data  # type: ignore[union-attr]


def test_views_kept_past_a_store_that_moves_the_entry_or_a_free_keep_its_bytes(
    handler: maru.MaruHandler,
) -> None:
    # A key too long for one name nests in namespaces of its own: the entry leaves the pack
    # its allocation was carved from, whose pages marud then frees; a freed allocation's too.
    data = pattern(4, 8192)
    a = handler.alloc(len(data))
    a.buf[:] = data
    view = a.buf
    key = "L" * 600
    assert handler.store(key, a) is True
    assert bytes(view) == data
    assert handler.retrieve(key).view.tobytes() == data  # type: ignore[union-attr]
    b = handler.alloc(len(data))
    b.buf[:] = data
    view = b.buf
    handler.free(b)
    assert bytes(view) == data and bytes(b.buf) == data


def test_a_store_refused_before_publication_leaves_the_handle_usable(
    handler: maru.MaruHandler,
) -> None:
    a = handler.alloc(4096)
    a.buf[:] = pattern(3, 4096)
    with pytest.raises(OSError):
        handler._c().store("too-long", a, 4097)  # a length beyond the allocation
    assert not a.done and not handler.exists("too-long")
    a.buf[:10] = b"0123456789"  # still the pool's memory
    assert handler.store("fixed", a) is True
    assert handler.retrieve("fixed").view.tobytes() == b"0123456789" + pattern(3, 4096)[10:]  # type: ignore[union-attr]


def test_store_is_true_on_an_existing_key(handler: maru.MaruHandler) -> None:
    assert put(handler, "once", b"first")
    second = handler.alloc(6)
    second.buf[:] = b"second"
    assert handler.store("once", second) is True  # as the original; the handle is freed
    assert second.done
    assert handler.retrieve("once").view.tobytes() == b"first"  # type: ignore[union-attr]
    assert sorted(handler.list_keys()) == [b"once"]


def test_int_str_and_bytes_keys(handler: maru.MaruHandler) -> None:
    assert put(handler, 42, b"int")
    assert handler.exists("42") and handler.exists(b"42") and handler.exists(42)
    assert handler.retrieve("42").view.tobytes() == b"int"  # type: ignore[union-attr]
    assert put(handler, b"bk", b"bytes")
    assert handler.retrieve("bk").view.tobytes() == b"bytes"  # type: ignore[union-attr]
    assert put(handler, 2**80, b"big")
    assert handler.exists(str(2**80))
    assert put(handler, -7, b"neg") and handler.exists("-7")
    with pytest.raises(TypeError):
        handler.exists(1.5)
    with pytest.raises(TypeError):
        handler.exists(None)


def test_missing_keys(handler: maru.MaruHandler) -> None:
    assert handler.retrieve("nope") is None
    assert handler.exists("nope") is False
    assert handler.delete("nope") is False
    assert handler.pin("nope") is False
    assert handler.unpin("nope") is False


def test_exists_delete_and_mapping_survives_delete(handler: maru.MaruHandler) -> None:
    data = pattern(2, 8192)
    assert put(handler, "gone", data)
    assert handler.exists("gone")
    info = handler.retrieve("gone")
    assert info is not None
    assert handler.delete("gone") is True
    assert handler.delete("gone") is False
    assert not handler.exists("gone")
    assert handler.retrieve("gone") is None
    assert info.view.tobytes() == data  # a deleted entry keeps its bytes while mapped
    assert put(handler, "gone", b"again")  # the key can be stored anew
    assert handler.retrieve("gone").view.tobytes() == b"again"  # type: ignore[union-attr]
    assert info.view.tobytes() == data


def test_entries_are_sealed_and_immutable(handler: maru.MaruHandler) -> None:
    assert put(handler, "sealed", b"x" * 100)
    path = handler.path_of("sealed")
    assert xattr(path, "state") == "sealed" and xattr(path, "size") == "100"
    with pytest.raises(PermissionError):
        open(path, "r+b")
    with open(path, "rb") as f:
        assert f.read() == b"x" * 100


def test_put_writes_existing_bytes(handler: maru.MaruHandler) -> None:
    head, body = b"head", np.arange(10000, dtype=np.int32)
    assert handler.put("w", head, body, memoryview(b"tail"))
    assert handler.retrieve("w").view.tobytes() == head + body.tobytes() + b"tail"  # type: ignore[union-attr]
    assert handler.put("w", b"again") is True  # existing key: True, first bytes stay
    assert handler.retrieve("w").view.tobytes()[:4] == b"head"  # type: ignore[union-attr]
    assert handler.put("empty") and len(handler.retrieve("empty").view) == 0  # type: ignore[union-attr]
    big = bytes(3 * MiB)  # put has no chunk_size_bytes limit
    assert handler.put("big", big) and len(handler.retrieve("big").view) == 3 * MiB  # type: ignore[union-attr]


def test_free_and_unstored_handles_leave_nothing(handler: maru.MaruHandler, marud: Marud) -> None:
    a = handler.alloc(4096)
    handler.free(a)
    with pytest.raises(ValueError):
        handler.store("k", a)
    assert not handler.exists("k")
    assert list(handler.list_keys()) == []
    assert os.listdir(marud.mount / handler.config.namespace) == []


def test_close_frees_allocations_and_views_stay_valid(marud: Marud, namespace: str) -> None:
    h = maru.MaruHandler(marud.config(namespace))
    assert h.connect()
    assert put(h, "k", b"abc")
    info = h.retrieve("k")
    pending = h.alloc(100)
    pending.buf[:3] = b"xyz"
    arr = np.frombuffer(info.view, dtype=np.uint8)  # type: ignore[union-attr]
    h.close()
    assert bytes(arr) == b"abc" and info.view.tobytes() == b"abc"  # type: ignore[union-attr]
    with maru.MaruHandler(marud.config(namespace)) as h2:
        assert sorted(h2.list_keys()) == [b"k"]  # the unstored allocation was not published


# -- pins ------------------------------------------------------------------------------------


def test_pin_and_unpin_are_counted_per_handler(handler: maru.MaruHandler, marud: Marud) -> None:
    assert put(handler, "p", b"pinned")
    path = handler.path_of("p")
    assert xattr(path, "holds") == "0"
    assert handler.unpin("p") is False  # no pin to give back
    assert handler.pin("p") is True
    assert handler.pin("p") is True
    assert xattr(path, "holds") == "2"
    with maru.MaruHandler(marud.config(handler.config.namespace)) as other:
        assert other.unpin("p") is False  # other holds none
        assert other.pin("p") is True
        assert xattr(path, "holds") == "3"
        assert handler.unpin("p") and handler.unpin("p")
        assert handler.unpin("p") is False
        assert xattr(path, "holds") == "1"  # still held by the other handler
        assert xattr(path, "pinned") == "0"  # apart from the operator's persistent pin
    # Released when the other handler closed (marud notices the closed connection).
    deadline = time.monotonic() + 5
    while xattr(path, "holds") != "0" and time.monotonic() < deadline:
        time.sleep(0.01)
    assert xattr(path, "holds") == "0"
    assert handler.pin("p")
    assert xattr(path, "holds") == "1"


# -- batches -----------------------------------------------------------------------------------


def test_batch_operations(handler: maru.MaruHandler) -> None:
    keys = [f"b{i}" for i in range(8)]
    handles = []
    for i in range(len(keys)):
        a = handler.alloc(100 + i)
        a.buf[:] = pattern(i, 100 + i)
        handles.append(a)
    assert handler.batch_store(keys, handles) == [True] * 8
    assert all(h.done for h in handles)
    assert handler.batch_exists(keys + ["missing"]) == [True] * 8 + [False]
    infos = handler.batch_retrieve(keys + ["missing"])
    assert infos[-1] is None
    for i, info in enumerate(infos[:-1]):
        assert info is not None and info.view.tobytes() == pattern(i, 100 + i)
    dup = handler.alloc(1)
    assert handler.batch_store(["b0"], [dup]) == [True] and dup.done
    twice = handler.alloc(8)
    with pytest.raises(ValueError):
        handler.batch_store(["t0", "t1"], [twice, twice])
    assert not twice.done and handler.batch_exists(["t0", "t1"]) == [False, False]
    handler.free(twice)
    assert handler.batch_pin(keys[:2] + ["missing"]) == [True, True, False]
    assert xattr(handler.path_of("b0"), "holds") == "1"
    assert handler.batch_unpin(keys[:2] + ["missing"]) == [True, True, False]
    assert handler.batch_unpin(keys[:1]) == [False]
    assert handler.batch_delete(keys + ["missing"]) == [True] * 8 + [False]
    assert handler.batch_delete(iter(["b0"])) == [False]
    assert list(handler.list_keys()) == []
    assert infos[3].view.tobytes() == pattern(3, 103)  # mappings survive the delete
    with pytest.raises(ValueError):
        handler.batch_store(["a"], [])
    assert handler.batch_retrieve([]) == [] and handler.batch_exists([]) == []
    mixed = [1, "two", b"three"]
    assert handler.batch_store(mixed, [handler.alloc(1) for _ in mixed]) == [True] * 3
    assert handler.batch_exists(["1", b"two", "three"]) == [True] * 3


# -- zero copy ---------------------------------------------------------------------------------


def test_numpy_wraps_views_without_copying(handler: maru.MaruHandler) -> None:
    a = handler.alloc(4096 * 4)
    arr = np.frombuffer(a.buf, dtype=np.float32)
    assert arr.ctypes.data == maru.address_of(a.buf)  # the array *is* pool memory
    arr[:] = np.arange(arr.size, dtype=np.float32)
    del arr
    assert handler.store("np", a)
    info = handler.retrieve("np")
    assert info is not None
    view = np.frombuffer(info.view, dtype=np.float32)
    assert view.ctypes.data == maru.address_of(info.view)
    assert not view.flags.writeable
    assert np.array_equal(view, np.arange(4096, dtype=np.float32))


def test_torch_wraps_views_without_copying(handler: maru.MaruHandler) -> None:
    torch = pytest.importorskip("torch")
    a = handler.alloc(1024 * 2)
    t = torch.frombuffer(a.buf, dtype=torch.bfloat16)
    assert t.data_ptr() == maru.address_of(a.buf)
    t.copy_(torch.arange(1024, dtype=torch.bfloat16))
    del t
    assert handler.store("t", a)
    info = handler.retrieve("t")
    assert info is not None
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", UserWarning)  # torch: "buffer is not writable"
        r = torch.frombuffer(info.view, dtype=torch.bfloat16)
    assert r.data_ptr() == maru.address_of(info.view)
    assert torch.equal(r, torch.arange(1024, dtype=torch.bfloat16))


def test_retrieved_view_is_the_pool_page(handler: maru.MaruHandler) -> None:
    """Zero copy: a page of retrieve(key).view has the PFN of the entry's backing page."""
    size = handler.get_chunk_size()
    a = handler.alloc(size)
    a.buf[:] = pattern(3, size)
    offsets = (0, size // 2, size - 1)
    writer_pfns = [pfn_of(a.buf, off) for off in offsets]
    assert handler.store("zc", a)
    path = handler.path_of("zc")
    assert xattr(path, "access") == "passthrough" and xattr(path, "kind") == "memfs"
    location, base = xattr(path, "location"), int(xattr(path, "offset"))
    info = handler.retrieve("zc")
    assert info is not None
    for i, off in enumerate(offsets):
        reader = pfn_of(info.view, off)
        assert reader == pfn_of_file(location, base + off), "the mapping is not the pool's page"
        assert reader == writer_pfns[i], "the reader does not map the page the writer filled"
    again = handler.retrieve("zc")
    assert pfn_of(again.view, 0) == writer_pfns[0]  # type: ignore[union-attr]


# -- regions and statistics ----------------------------------------------------------------------


def test_region_accessors_on_a_memfs_pool(handler: maru.MaruHandler) -> None:
    assert handler.get_chunk_size() == handler.config.chunk_size_bytes == MiB
    calls = []
    handler.set_on_region_added(lambda rid, pages: calls.append((rid, pages)))
    a = handler.alloc(4096)
    assert put(handler, "r", b"region")
    assert calls == []  # memfs entries are files of their own, not regions of a pool
    assert handler.get_owned_region_ids() == []
    for rid in (0, a.region_id, 12345):
        assert handler.get_region_page_count(rid) is None
        assert handler.get_buffer_view(rid, 0, 1) is None
        assert handler.is_region_mapped(rid) is False
        assert handler.get_region_dax_path(rid) is None
    handler.set_on_region_added(None)
    handler.free(a)


def test_get_stats(handler: maru.MaruHandler) -> None:
    assert put(handler, "s1", b"x" * 5000)
    assert put(handler, "s2", b"y" * 3000)
    pending = handler.alloc(100)
    stats = handler.get_stats()
    assert {"kv_manager", "allocation_manager", "store_regions", "allocator", "plugins", "maru"} <= stats.keys()
    assert stats["kv_manager"]["total_entries"] >= 2
    assert stats["kv_manager"]["total_size"] >= 8000
    am = stats["allocation_manager"]
    assert {"num_allocations", "total_allocated", "active_clients"} <= am.keys()
    assert am["active_clients"] >= 1 and am["total_allocated"] >= 100 and am["num_allocations"] >= 1
    assert stats["store_regions"]["num_regions"] == len(stats["store_regions"]["regions"]) >= 1
    region = stats["store_regions"]["regions"][0]
    assert region["kind"] == "memfs" and region["total_size"] == 1 << 30
    assert 0 <= region["used_size"] <= region["total_size"]
    assert stats["allocator"] == region
    assert isinstance(stats["plugins"], dict)
    assert stats["maru"]["namespace"] == handler.config.namespace
    assert stats["maru"]["this_client"].get("name") == handler.instance_id
    handler.free(pending)


# -- keys across the doors ---------------------------------------------------------------------


KEYS = [
    "a/b/c",
    "with%percent",
    ".hidden",
    "..",
    b"\xfe\xffab",
    "unicode-é-鍵-🔑",
    "k" * 1024,
    b"/" * 300,
]


@pytest.mark.parametrize("key", KEYS, ids=lambda k: repr(k)[:24])
def test_any_key_is_a_file_under_the_mount(handler: maru.MaruHandler, marud: Marud, key) -> None:
    data = pattern(9, 5000) + repr(key).encode()
    assert put(handler, key, data)
    raw = key.encode() if isinstance(key, str) else key
    path = handler.path_of(key)
    ns_dir = marud.mount / handler.config.namespace
    assert path.startswith(str(ns_dir) + "/")
    with open(path, "rb") as f:  # (a) the file holds the bytes
        assert f.read() == data
    rel = os.path.relpath(path, ns_dir)
    assert rel == maru.encode_key(key)
    assert all(len(part.encode()) <= 255 for part in rel.split("/"))
    assert _native.decode_key(rel) == raw  # (b) the name gives back the key
    assert raw in list(handler.list_keys())  # (c)
    assert handler.exists(raw) and handler.retrieve(key).view.tobytes() == data  # type: ignore[union-attr]
    assert handler.delete(key)
    # marud invalidates the kernel's cached name after the delete returns (asynchronously).
    deadline = time.monotonic() + 2
    while os.path.exists(path) and time.monotonic() < deadline:
        time.sleep(0.01)
    assert not os.path.exists(path)


# -- the original README -------------------------------------------------------------------------


README_BASIC_USAGE = '''
from maru import MaruConfig, MaruHandler

config = MaruConfig(
    server_url="tcp://localhost:5555",
    pool_size=1024 * 1024 * 100,  # 100MB
)

with MaruHandler(config) as handler:
    data = b"A" * (1024 * 1024)  # 1MB KV chunk

    # 1. Allocate a page in CXL shared memory
    handle = handler.alloc(size=len(data))

    # 2. Write directly to CXL memory (mmap — no intermediate buffer)
    handle.buf[:] = data

    # 3. Register the key — only metadata (key → region, offset) is sent
    handler.store(key=42, handle=handle)

    # Retrieve: returns a memoryview pointing into CXL memory
    result = handler.retrieve(key=42)
    assert result is not None
    assert bytes(result.view[:5]) == b"AAAAA"
'''

README_CHECK = """
from maru import MaruConfig, MaruHandler
with MaruHandler(MaruConfig()) as handler:
    result = handler.retrieve(key=42)
    assert result is not None
    assert result.view.tobytes() == b"A" * (1024 * 1024)
    print("ok")
"""


def test_the_original_readme_basic_usage(marud: Marud) -> None:
    env = child_env()
    env["MARU_SOCKET"] = str(marud.socket)
    env.pop("MARU_MOUNT", None)
    for code in (README_BASIC_USAGE, README_CHECK):
        out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=60)
        assert out.returncode == 0, f"{out.stdout}\n{out.stderr}"
    assert out.stdout.strip() == "ok"
    with maru.MaruHandler(marud.config("default")) as h:
        assert h.delete(42)
