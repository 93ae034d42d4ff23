"""LMCache's built-in MaruBackend (``maru_path``), unmodified, on maru.

LMCache 0.5.6 imports ``MaruConfig``/``MaruHandler`` from ``maru`` and ``CxlMemoryAdapter``
from ``maru_lmcache``; nothing of LMCache is patched or wrapped here. Without a
LocalCPUBackend, LMCache allocates its chunks from the adapter: the KV is written into pool
memory and stored without a copy.
"""

from __future__ import annotations

import asyncio
import os
import threading
from typing import Iterator, List

import pytest

pytest.importorskip("torch")
pytest.importorskip("lmcache")

import torch  # noqa: E402
from lmcache.v1.event_manager import EventManager, EventStatus, EventType  # noqa: E402
from lmcache.v1.memory_management import MemoryFormat  # noqa: E402
from lmcache.v1.pin_monitor import PinMonitor  # noqa: E402
from lmcache.v1.storage_backend.maru_backend import MaruBackend  # noqa: E402
from lmcache.v1.storage_backend.storage_manager import StorageManager  # noqa: E402

import lmcache_util as lu  # noqa: E402
import maru  # noqa: E402
from conftest import Marud  # noqa: E402
from maru_lmcache import CxlMemoryAdapter  # noqa: E402
from pagemap import pfn_of, pfn_of_file  # noqa: E402



@pytest.fixture
def manager(marud: Marud, namespace: str, monkeypatch: pytest.MonkeyPatch) -> Iterator:
    monkeypatch.setenv("MARU_NAMESPACE", namespace)
    sm = lu.make_manager(lu.make_builtin_config(str(marud.socket)))
    try:
        yield sm
    finally:
        sm.close()


def backend_of(sm):
    return sm.storage_backends["MaruBackend"]


def stored(sm, ids) -> list:
    keys = lu.put_chunks(sm, ids)
    lu.wait_for_backend_puts(backend_of(sm), keys)
    return keys


def entry_file(marud: Marud, namespace: str, key) -> str:
    """The pool file of a key's entry (memfs pools: a file of its own)."""
    with maru.MaruHandler(marud.config(namespace)) as h:
        return os.getxattr(h.path_of(key.to_string()), "user.maru.location").decode()


def test_lmcache_builds_its_maru_backend_over_maru(manager) -> None:
    assert list(manager.storage_backends) == ["MaruBackend"]
    backend = backend_of(manager)
    assert manager.allocator_backend is backend
    assert isinstance(backend.get_memory_allocator(), CxlMemoryAdapter)


def test_chunks_are_written_in_pool_memory_and_read_back_from_it(manager, marud: Marud, namespace: str) -> None:
    obj = manager.allocate(lu.CHUNK_SHAPE, lu.DTYPE, fmt=MemoryFormat.KV_2LTD)
    assert obj is not None and obj.tensor is not None
    obj.tensor.copy_(lu.chunk_tensor(7))
    key = lu.key(7)
    written = pfn_of(obj.tensor.view(torch.uint8).flatten().numpy())
    manager.batched_put([key], [obj])
    lu.wait_for_backend_puts(backend_of(manager), [key])
    path = entry_file(marud, namespace, key)
    # LMCache wrote the KV into the page that is now the entry's: no copy on store.
    assert written == pfn_of_file(path)

    assert manager.contains(key) is not None
    got = manager.get(key, location="MaruBackend")
    assert got is not None and got.tensor is not None
    assert got.tensor.shape == lu.CHUNK_SHAPE and got.tensor.dtype == lu.DTYPE
    assert torch.equal(got.tensor, lu.chunk_tensor(7))
    # The memory object read back is the entry's page itself: no copy on retrieve.
    assert pfn_of(got.tensor.view(torch.uint8).flatten().numpy()) == pfn_of_file(path)
    lu.release([got])


def test_an_allocation_lmcache_drops_unstored_is_freed(manager, marud: Marud, namespace: str) -> None:
    """LMCache lets go of an object it allocated and never stored (a put its backend skipped):
    the allocation goes back to marud then, not at the end of the connection."""
    adapter = backend_of(manager).get_memory_allocator()
    before = len(adapter._allocs)
    obj = manager.allocate(lu.CHUNK_SHAPE, lu.DTYPE, fmt=MemoryFormat.KV_2LTD)
    assert obj is not None and len(adapter._allocs) == before + 1
    obj.ref_count_down()
    assert len(adapter._allocs) == before
    # A stored one frees nothing more when LMCache lets go of it.
    keys = stored(manager, [31])
    assert manager.contains(keys[0]) is not None and len(adapter._allocs) == before


def test_a_retrieved_entry_is_remembered_until_lmcache_takes_it(manager) -> None:
    """The handler keeps a retrieved entry's view by location only until LMCache's backend
    takes it (get_by_location): none is left to keep a deleted entry's memory."""
    keys = stored(manager, range(40, 44))
    handler = backend_of(manager)._handler
    objs = manager.batched_get(keys, location="MaruBackend")
    assert all(o is not None for o in objs)
    assert len(handler._located) == 0
    lu.release(objs)


def test_batched_get_and_prefix_lookup(manager) -> None:
    keys = stored(manager, range(5))
    hits, _ = manager.batched_contains(keys + [lu.key(99)])
    assert hits == 5
    objs = manager.batched_get(keys, location="MaruBackend")
    assert all(o is not None for o in objs)
    for i, o in enumerate(objs):
        assert torch.equal(o.tensor, lu.chunk_tensor(i))
    lu.release(objs)
    # A missing chunk ends the prefix.
    assert backend_of(manager).batched_contains([keys[0], lu.key(98), keys[2]]) == 1


def test_a_duplicate_put_keeps_the_first(manager, marud: Marud, namespace: str) -> None:
    key = stored(manager, [3])[0]
    obj = manager.allocate(lu.CHUNK_SHAPE, lu.DTYPE, fmt=MemoryFormat.KV_2LTD)
    obj.tensor.fill_(1)
    backend = backend_of(manager)
    backend.batched_submit_put_task([key], [obj])[0].result(timeout=30)
    got = manager.get(key, location="MaruBackend")
    assert torch.equal(got.tensor, lu.chunk_tensor(3))
    lu.release([got])
    with maru.MaruHandler(marud.config(namespace)) as h:
        assert list(h.list_keys()) == [key.to_string().encode()]


def test_pins_are_counted_and_keep_entries_from_eviction(marud: Marud, namespace: str, monkeypatch) -> None:
    monkeypatch.setenv("MARU_NAMESPACE", namespace)
    sm = lu.make_manager(lu.make_builtin_config(str(marud.socket)))
    try:
        backend = backend_of(sm)
        # 64 KiB chunks are packed, 32 to a pack: a pack goes whole, once nothing pins it.
        keys = stored(sm, range(100))
        path = None
        with maru.MaruHandler(marud.config(namespace)) as h:
            path = h.path_of(keys[0].to_string())
        assert backend.contains(keys[0], pin=True)  # LMCache's lookup pin
        assert backend.pin(keys[0])
        assert os.getxattr(path, "user.maru.holds") == b"2"
        assert backend.unpin(keys[0])
        assert os.getxattr(path, "user.maru.holds") == b"1"
        assert backend.batched_contains(keys[1:3], pin=True) == 2
        backend.batched_unpin(keys[1:3])
        # Fill the pool from another client: unpinned chunks are evicted (the packs nothing
        # pins, whole), the pinned one stays.
        filler = maru.MaruConfig(socket_path=str(marud.socket), namespace=namespace + "-fill",
                                 pool_size=64 << 20, chunk_size_bytes=64 << 20)
        with maru.MaruHandler(filler) as f:
            big = b"f" * (32 << 20)
            for i in range(2 * (1 << 30) // len(big)):
                f.put(f"fill{i}", big)
            assert backend.contains(keys[0])
            assert not all(backend.contains(k) for k in keys[1:]), "nothing was evicted"
            got = sm.get(keys[0], location="MaruBackend")
            assert torch.equal(got.tensor, lu.chunk_tensor(0))
            lu.release([got])
            for i in range(2 * (1 << 30) // len(big)):
                f.delete(f"fill{i}")
        assert backend.unpin(keys[0])
        assert backend.remove(keys[0])
        assert not backend.contains(keys[0])
    finally:
        sm.close()


class Scheduler:
    """Where LMCache's StorageManager sends the answer of an asynchronous lookup (its
    ``LMCacheAsyncLookupServer`` passes it to vLLM's scheduler over ZMQ): tokens to load, by
    lookup id."""

    def __init__(self) -> None:
        self.answers: dict = {}
        self._cond = threading.Condition()

    def send_response_to_scheduler(self, lookup_id: str, retrieved_length: int) -> None:
        with self._cond:
            self.answers[lookup_id] = retrieved_length
            self._cond.notify_all()

    def wait(self, lookup_id: str, timeout: float = 30.0) -> int:
        with self._cond:
            assert self._cond.wait_for(lambda: lookup_id in self.answers, timeout), "no answer"
            return self.answers[lookup_id]


def async_manager(socket: str, scheduler: Scheduler) -> StorageManager:
    """LMCache's storage layer with its asynchronous loading on (``enable_async_loading``)."""
    config = lu.make_builtin_config(socket)
    config.enable_async_loading = True
    PinMonitor.GetOrCreate(config)  # as LMCacheEngine makes it: pinned objects report to it
    return StorageManager(config=config, metadata=lu.metadata(), event_manager=EventManager(),
                          async_lookup_server=scheduler)


def load_async(sm: StorageManager, scheduler: Scheduler, lookup_id: str, keys: list) -> List[torch.Tensor]:
    """LMCache 0.5.6's asynchronous load: ``async_lookup_and_prefetch`` with pins (the
    lookup pins each chunk in marud and prefetches it), then what ``LMCacheEngine.retrieve``
    does with the prefetched chunks (``_async_process_tokens_internal`` takes them from the
    event; after the copy each is unpinned if pinned and its reference dropped). The chunks'
    contents come back as copies."""
    cum = [i * lu.CHUNK_TOKENS for i in range(len(keys) + 1)]
    asyncio.run_coroutine_threadsafe(
        sm.async_lookup_and_prefetch(lookup_id, keys, cum, pin=True), sm.loop).result(timeout=30)
    assert scheduler.wait(lookup_id) == cum[-1]
    assert sm.event_manager.get_event_status(EventType.LOADING, lookup_id) == EventStatus.DONE
    pairs = [p for tier in sm.event_manager.pop_event(EventType.LOADING, lookup_id).result() for p in tier]
    assert [k for k, _ in pairs] == keys
    out = []
    for _, obj in pairs:
        out.append(obj.tensor.clone())
        if obj.is_pinned:
            obj.unpin()
        obj.ref_count_down()
    return out


def holds(marud: Marud, namespace: str, keys: list) -> List[bytes]:
    """marud's count of holds (pins) on each key's entry, from every client."""
    with maru.MaruHandler(marud.config(namespace)) as h:
        return [os.getxattr(h.path_of(k.to_string()), "user.maru.holds") for k in keys]


def test_asynchronous_loads_leave_no_pin_in_marud(marud: Marud, namespace: str, monkeypatch) -> None:
    """LMCache 0.5.6 never gives back the pins of its asynchronous lookups (its issue 3027):
    the adapter does, once the chunk is mapped. Loading the same chunks again and again leaves
    no hold; the synchronous path's pins stay LMCache's (held until it unpins them)."""
    monkeypatch.setenv("MARU_NAMESPACE", namespace)
    scheduler = Scheduler()
    sm = async_manager(str(marud.socket), scheduler)
    try:
        keys = stored(sm, range(3))
        for round in range(3):
            got = load_async(sm, scheduler, f"lookup-{round}", keys)
            assert all(torch.equal(t, lu.chunk_tensor(i)) for i, t in enumerate(got))
            assert holds(marud, namespace, keys) == [b"0"] * 3
        backend = backend_of(sm)
        assert backend.batched_contains(keys, pin=True) == 3
        objs = sm.batched_get(keys, location="MaruBackend")
        lu.release(objs)
        assert holds(marud, namespace, keys) == [b"1"] * 3, "a blocking get took the lookup's pins"
        backend.batched_unpin(keys)
        assert holds(marud, namespace, keys) == [b"0"] * 3
    finally:
        sm.close()


def test_an_lmcache_that_gives_back_asynchronous_pins_itself_is_left_to(
    marud: Marud, namespace: str, monkeypatch
) -> None:
    """With LMCache's fix (the backend declares ``has_external_pin_state``), LMCache unpins
    what its asynchronous lookups pinned: the adapter gives nothing back itself, so nothing is
    unpinned twice."""
    monkeypatch.setenv("MARU_NAMESPACE", namespace)
    monkeypatch.setattr(MaruBackend, "has_external_pin_state", property(lambda self: True), raising=False)
    scheduler = Scheduler()
    sm = async_manager(str(marud.socket), scheduler)
    try:
        keys = stored(sm, range(2))
        got = load_async(sm, scheduler, "lookup", keys)
        assert all(torch.equal(t, lu.chunk_tensor(i)) for i, t in enumerate(got))
        assert holds(marud, namespace, keys) == [b"1"] * 2
        sm.batched_unpin(keys, ["MaruBackend"])  # what the fixed LMCacheEngine.lookup_unpin does
        assert holds(marud, namespace, keys) == [b"0"] * 2
    finally:
        sm.close()


def test_a_partial_last_chunk_keeps_its_size(manager) -> None:
    tokens = 100
    shape = torch.Size([2, lu.LAYERS, tokens, lu.HEADS * lu.HEAD_DIM])
    obj = manager.allocate(shape, lu.DTYPE, fmt=MemoryFormat.KV_2LTD)
    data = torch.randn(shape, dtype=torch.float32).to(lu.DTYPE)
    obj.tensor.copy_(data)
    key = lu.key(500)
    manager.batched_put([key], [obj])
    lu.wait_for_backend_puts(backend_of(manager), [key])
    got = manager.get(key, location="MaruBackend")
    assert got.tensor.shape == shape
    assert torch.equal(got.tensor, data)
    lu.release([got])


def test_a_second_process_loads_what_the_first_stored(marud: Marud, namespace: str) -> None:
    """Two LMCache processes with the built-in backend: the second, started after the first
    exited, finds and loads every chunk with equal bytes."""
    digests = lu.run_child("builtin", "store", str(marud.socket), namespace, 6)
    loaded = lu.run_child("builtin", "load", str(marud.socket), namespace, 6)
    assert loaded["hits"] == 6
    assert loaded["digests"] == digests
    assert loaded["shapes"] == [list(lu.CHUNK_SHAPE)] * 6
    assert loaded["dtypes"] == [str(lu.DTYPE)] * 6
