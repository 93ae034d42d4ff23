"""The maru storage plugin, loaded by LMCache's storage_plugins mechanism."""

from __future__ import annotations

import asyncio
import os
from pathlib import Path
from typing import Iterator

import pytest

pytest.importorskip("torch")
pytest.importorskip("lmcache")

import torch  # noqa: E402
from lmcache.v1.memory_management import MemoryFormat  # noqa: E402
from lmcache.v1.storage_backend.abstract_backend import StoragePluginInterface  # noqa: E402

import lmcache_util as lu  # noqa: E402
import maru  # noqa: E402
from conftest import Marud  # noqa: E402
from maru.chunk import decode_header  # noqa: E402
from maru._native import encode_key
from maru.lmcache_plugin import MaruStoragePlugin  # noqa: E402
from pagemap import pfn_of, pfn_of_file  # noqa: E402



@pytest.fixture
def manager(marud: Marud, namespace: str) -> Iterator:
    sm = lu.make_manager(lu.make_config(plugin_socket=str(marud.socket), plugin_namespace=namespace))
    try:
        yield sm
    finally:
        sm.close()


def plugin_of(sm) -> MaruStoragePlugin:
    plugin = sm.storage_backends["maru"]
    assert isinstance(plugin, MaruStoragePlugin)
    return plugin


def stored(sm, ids) -> list:
    keys = lu.put_chunks(sm, ids)
    assert plugin_of(sm).wait_for_puts(30)
    return keys


def test_lmcache_loads_the_plugin(manager) -> None:
    assert list(manager.storage_backends) == ["LocalCPUBackend", "maru"]
    plugin = manager.storage_backends["maru"]
    assert isinstance(plugin, StoragePluginInterface)
    assert plugin.get_allocator_backend() is manager.storage_backends["LocalCPUBackend"]


def test_chunks_are_sealed_entries_with_their_metadata(manager, marud: Marud, namespace: str) -> None:
    keys = stored(manager, range(3))
    ns = marud.mount / namespace
    names = sorted(os.listdir(ns))
    # The shared key encoding: the entry of LMCache's key string, as every client names it.
    assert names == sorted(encode_key(k.to_string()) for k in keys)
    assert all("/" not in n and "%2F" in n for n in names)  # the model name's '/' is encoded
    with maru.MaruHandler(marud.config(namespace)) as h:
        assert sorted(h.list_keys()) == sorted(k.to_string().encode() for k in keys)
        info = h.retrieve(keys[1].to_string())
        assert info is not None
        header = decode_header(info.view, info.view.nbytes)
        assert header.meta.key == keys[1].to_string()
        assert header.meta.fmt == "KV_2LTD"
        assert header.meta.shapes == [list(lu.CHUNK_SHAPE)] and header.meta.dtypes == ["bfloat16"]
        assert header.payload_size == lu.CHUNK_BYTES and header.header_size % 4096 == 0
        payload = bytes(info.view[header.header_size:])
        del info
    assert payload == lu.chunk_tensor(1).view(torch.uint8).numpy().tobytes()


def test_get_blocking_maps_the_pool_pages(manager, marud: Marud, namespace: str) -> None:
    plugin = plugin_of(manager)
    keys = stored(manager, range(2))
    obj = plugin.get_blocking(keys[0])
    shape, dtype, t = lu.chunk_of(obj)
    assert (shape, dtype, obj.get_memory_format()) == (lu.CHUNK_SHAPE, lu.DTYPE, MemoryFormat.KV_2LTD)
    assert torch.equal(t, lu.chunk_tensor(0))
    # Zero copy: the MemoryObj's bytes are the entry's pool page.
    raw = obj.raw_data.numpy()
    with maru.MaruHandler(marud.config(namespace)) as h:
        path = h.path_of(keys[0].to_string())
        assert path == str(marud.mount / namespace / encode_key(keys[0].to_string()))
        info = h.retrieve(keys[0].to_string())
        assert info is not None
        hsize = decode_header(info.view, info.view.nbytes).header_size
        del info
    location = os.getxattr(path, "user.maru.location").decode()
    assert pfn_of(raw, 0) == pfn_of_file(location, hsize)
    assert pfn_of(raw, lu.CHUNK_BYTES - 1) == pfn_of_file(location, hsize + lu.CHUNK_BYTES - 1)
    # The pages are mapped read-only (LMCache only reads retrieved chunks): no write here.
    again = plugin.get_blocking(keys[0])
    assert torch.equal(lu.chunk_of(again)[2], lu.chunk_tensor(0))
    lu.release([obj, again])
    assert plugin._allocator.live == 0  # freeing the MemoryObjs released the mappings
    assert plugin.get_blocking(lu.key(99)) is None


def test_storage_manager_paths(manager) -> None:
    """LMCache's own lookup and retrieval paths reach the plugin."""
    plugin = plugin_of(manager)
    keys = stored(manager, range(4))
    local_cpu = manager.storage_backends["LocalCPUBackend"]
    for k in keys:
        local_cpu.remove(k)  # make the plugin the only place that has them
    hits, mapping = manager.batched_contains(keys + [lu.key(50)])
    assert hits == 4 and list(mapping) == ["maru"]
    objs = manager.batched_get(keys, location="maru")
    for i, obj in enumerate(objs):
        assert torch.equal(lu.chunk_of(obj)[2], lu.chunk_tensor(i))
    lu.release(objs)
    assert manager.contains(keys[0]) in ("LocalCPUBackend", "maru")  # LMCache wrote them back
    # Puts of chunks the namespace already holds are skipped.
    assert plugin.batched_submit_put_task(keys, [None] * len(keys)) is None  # type: ignore[list-item]
    assert manager.remove(keys[0]) >= 1
    assert not plugin.contains(keys[0])


def test_pins_hold_the_bytes_until_unpin(manager) -> None:
    plugin = plugin_of(manager)
    (k,) = stored(manager, [7])
    assert plugin.contains(k, pin=True)
    assert plugin.pin(k)
    assert plugin.remove(k)  # deleted from the namespace...
    assert not plugin.contains(k)
    obj = plugin.get_blocking(k)  # ...but the hold keeps the bytes
    assert torch.equal(lu.chunk_of(obj)[2], lu.chunk_tensor(7))
    assert plugin.unpin(k) and plugin.unpin(k)
    assert not plugin.unpin(k)
    assert plugin.get_blocking(k) is None
    assert torch.equal(lu.chunk_of(obj)[2], lu.chunk_tensor(7))  # the MemoryObj still maps it
    lu.release([obj])
    assert not plugin.pin(lu.key(1234))


def test_two_threads_pinning_one_chunk_share_one_hold(manager, monkeypatch) -> None:
    """Two pins of one chunk at once (LMCache's lookups of a shared prefix on two threads)
    both map it; the hold keeps one mapping with a reference for each, and an unpin leaves
    the other hold's bytes readable."""
    import threading

    plugin = plugin_of(manager)
    (k,) = stored(manager, [9])
    both = threading.Barrier(2)
    retrieve = plugin.handler.retrieve

    def meeting(name):  # each thread maps the chunk before either records its hold
        info = retrieve(name)
        both.wait(timeout=10)
        return info

    monkeypatch.setattr(plugin.handler, "retrieve", meeting)
    threads = [threading.Thread(target=plugin.pin, args=(k,)) for _ in range(2)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    monkeypatch.setattr(plugin.handler, "retrieve", retrieve)
    assert plugin.unpin(k)
    obj = plugin.get_blocking(k)
    assert obj is not None and torch.equal(lu.chunk_of(obj)[2], lu.chunk_tensor(9))
    lu.release([obj])
    assert plugin.unpin(k) and not plugin.unpin(k)


def test_async_lookup_and_load(manager) -> None:
    plugin = plugin_of(manager)
    keys = stored(manager, range(5))
    missing = lu.key(77)
    hits = asyncio.run(plugin.batched_async_contains("lookup-1", keys[:3] + [missing] + keys[3:], pin=True))
    assert hits == 3  # a prefix match
    assert len(plugin._holds) == 3
    objs = asyncio.run(plugin.batched_get_non_blocking("lookup-1", keys[:3] + [missing]))
    assert len(objs) == 3
    for i, obj in enumerate(objs):
        assert torch.equal(lu.chunk_of(obj)[2], lu.chunk_tensor(i))
    assert plugin._holds == {}  # the lookup's holds were released by its load
    lu.release(objs)
    fut = plugin.get_non_blocking(keys[4])
    assert fut is not None and torch.equal(lu.chunk_of(fut.result(10))[2], lu.chunk_tensor(4))
    lu.release([fut.result()])
    assert plugin.get_non_blocking(missing) is None


def test_copy_retrieve_mode(marud: Marud, namespace: str) -> None:
    config = lu.make_config(
        plugin_socket=str(marud.socket), plugin_namespace=namespace, extra={"maru.retrieve_mode": "copy"}
    )
    sm = lu.make_manager(config)
    try:
        plugin = plugin_of(sm)
        keys = stored(sm, range(2))
        obj = plugin.get_blocking(keys[1])
        assert obj is not None and obj.parent() is not plugin._allocator  # a LocalCPUBackend buffer
        assert torch.equal(lu.chunk_of(obj)[2], lu.chunk_tensor(1))
        lu.release([obj])
    finally:
        sm.close()


def test_instances_share_one_namespace(marud: Marud, namespace: str) -> None:
    config = lu.make_config(plugin_socket=str(marud.socket), plugin_namespace=namespace)
    first, second = lu.make_manager(config), lu.make_manager(config)
    try:
        keys = stored(first, range(3))
        p2 = plugin_of(second)
        assert all(p2.contains(k) for k in keys)
        futures = p2.batched_submit_put_task(keys, [None] * 3)  # type: ignore[list-item]
        assert futures is None  # already stored by the first: skipped
        assert len(os.listdir(marud.mount / namespace)) == 3
        obj = p2.get_blocking(keys[2])
        assert torch.equal(lu.chunk_of(obj)[2], lu.chunk_tensor(2))
        lu.release([obj])
    finally:
        first.close()
        second.close()


def test_full_pool_skips_the_chunk(small_marud: Marud) -> None:
    ns = "full"
    h = maru.MaruHandler(small_marud.config(ns))
    assert h.connect()
    assert h.put("filler", bytearray(small_marud.free_bytes() - 16 * 1024))  # leave less than a chunk
    assert h.pin("filler")  # held while this handler is connected: marud cannot evict it
    sm = lu.make_manager(lu.make_config(plugin_socket=str(small_marud.socket), plugin_namespace=ns))
    try:
        plugin = plugin_of(sm)
        keys = lu.put_chunks(sm, [1])
        assert plugin.wait_for_puts(30)
        assert not plugin.contains(keys[0])
        assert sorted(os.listdir(small_marud.mount / ns)) == ["filler"]
    finally:
        sm.close()
        h.close()


def test_a_scheduler_role_answers_lookups(marud: Marud, namespace: str) -> None:
    """An LMCache scheduler process has no LocalCPUBackend; the plugin needs only the mount."""
    with_data = lu.make_manager(lu.make_config(plugin_socket=str(marud.socket), plugin_namespace=namespace))
    try:
        keys = stored(with_data, range(2))
    finally:
        with_data.close()
    md = lu.metadata()
    md.role = "scheduler"
    config = lu.make_config(plugin_socket=str(marud.socket), plugin_namespace=namespace)
    from lmcache.v1.event_manager import EventManager
    from lmcache.v1.storage_backend.storage_manager import StorageManager

    sm = StorageManager(config=config, metadata=md, event_manager=EventManager())
    try:
        assert "LocalCPUBackend" not in sm.storage_backends
        hits, mapping = sm.batched_contains(keys + [lu.key(40)])
        assert hits == 2 and list(mapping) == ["maru"]
    finally:
        sm.close()


def test_bad_entries_are_misses(manager, marud: Marud, namespace: str) -> None:
    plugin = plugin_of(manager)
    k = lu.key(5)
    with maru.MaruHandler(marud.config(namespace)) as h:
        assert h.put(k.to_string(), b"not a chunk")
    assert plugin.contains(k)
    assert plugin.get_blocking(k) is None


def test_a_second_process_loads_what_the_first_stored(marud: Marud, namespace: str) -> None:
    """Two separate LMCache processes: the second, started after the first exited,
    finds the chunks through the namespace and loads byte-identical copies."""
    n = 6
    stored_digests = lu.run_child("plugin", "store", str(marud.socket), namespace, n)
    assert len(os.listdir(marud.mount / namespace)) == n
    loaded = lu.run_child("plugin", "load", str(marud.socket), namespace, n)
    assert loaded["hits"] == n and loaded["backends"] == ["maru"]
    assert loaded["digests"] == stored_digests
    assert loaded["digests"] == [lu.digest(lu.chunk_tensor(i)) for i in range(n)]
    assert loaded["shapes"] == [list(lu.CHUNK_SHAPE)] * n
    assert loaded["dtypes"] == ["torch.bfloat16"] * n


def test_no_marud_is_a_clear_error(tmp_path: Path, namespace: str) -> None:
    config = lu.make_config(plugin_socket=str(tmp_path / "none.sock"), plugin_namespace=namespace)
    with pytest.raises(RuntimeError, match="cannot connect to marud"):
        MaruStoragePlugin(config=config, metadata=lu.metadata())


def test_long_keys_use_the_shared_encoding(manager, marud: Marud, namespace: str) -> None:
    """A key string over 255 bytes is stored under the handler's key encoding (no hashing):
    the handler finds it by the same string, and the header's key matches."""
    from lmcache.utils import CacheEngineKey

    plugin = plugin_of(manager)
    k = CacheEngineKey("org/" + "m" * 400, 1, 0, 42, lu.DTYPE)
    obj = manager.allocate(lu.CHUNK_SHAPE, lu.DTYPE, fmt=MemoryFormat.KV_2LTD)
    obj.tensor.copy_(lu.chunk_tensor(42))
    try:
        plugin.batched_submit_put_task([k], [obj])
    finally:
        obj.ref_count_down()
    assert plugin.wait_for_puts(30) and plugin.contains(k)
    with maru.MaruHandler(marud.config(namespace)) as h:
        assert h.exists(k.to_string())
        assert os.path.exists(h.path_of(k.to_string()))
    got = plugin.get_blocking(k)
    assert torch.equal(lu.chunk_of(got)[2], lu.chunk_tensor(42))
    lu.release([got])
    assert plugin.remove(k) and not plugin.contains(k)
