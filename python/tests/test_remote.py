"""The remote backend end to end: ``MaruHandler(MaruConfig(storage_backend="remote"))``
against a real marud whose remote door listens on loopback (``--remote-bind``), the bytes
moved by real NIXL over UCX's TCP transport between this process's staging buffer and the
marud's file pool.

UCX reads its environment once, when NIXL loads: ``UCX_TLS=tcp``, ``UCX_NET_DEVICES=lo`` and
``UCX_MODULES=^ib`` are set here, at import, for this process, marud and the children.
Skips where NIXL is not installed (``MARU_NIXL_LIB``, the nixl-cu12 wheel...), except where
``MARU_REQUIRE_NIXL`` is set (CI), where it fails. The test that kills marud runs last in this
file (it restarts marud on the same pool).
"""

from __future__ import annotations

import errno
import hashlib
import os
import subprocess
import sys
import tempfile
import textwrap
import time
import uuid
from pathlib import Path
from typing import Any, Iterator, List

import pytest

import maru
from conftest import child_env
from remote_util import RETRY_S, TIMEOUT_MS, TOKEN, TRANSFER_S, MemoryNode, MiB, free_port, require_nixl, ucx_env

# Before anything loads NIXL (the first remote handler does).
os.environ.update(ucx_env("lo"))


def pattern(seed: Any, size: int) -> bytes:
    block = hashlib.sha256(str(seed).encode()).digest() * 128  # 4 KiB
    return (block * (size // len(block) + 1))[:size]


@pytest.fixture(scope="module")
def node() -> Iterator[MemoryNode]:
    require_nixl()
    root = Path(tempfile.mkdtemp(prefix="maru-pytest-remote-"))
    n = MemoryNode(root)
    n.start()
    try:
        yield n
    finally:
        n.marud.stop()


@pytest.fixture
def ns() -> str:
    return f"r-{uuid.uuid4().hex[:12]}"


@pytest.fixture
def remote(node: MemoryNode, ns: str) -> Iterator[maru.MaruHandler]:
    h = maru.MaruHandler(node.config(ns))
    assert h.connect(), f"cannot reach the remote door:\n{node.marud.log_tail()}"
    try:
        yield h
    finally:
        h.close()


def store_bytes(h: maru.MaruHandler, key: Any, data: bytes) -> bool:
    a = h.alloc(len(data))
    a.buf[:] = data
    return h.store(key, a)


def test_the_configuration_checks_the_remote_fields() -> None:
    with pytest.raises(ValueError, match="remote_url"):
        maru.MaruConfig(storage_backend="remote")
    with pytest.raises(ValueError, match="remote_url"):
        maru.MaruConfig(remote_url="tcp://memnode:7860")
    with pytest.raises(ValueError, match="not built"):
        maru.MaruConfig(storage_backend="cpu")
    with pytest.raises(ValueError, match="remote_load_reserve"):
        maru.MaruConfig(storage_backend="remote", remote_url="tcp://m:1", remote_load_reserve=1.0)
    with pytest.raises(ValueError, match="remote_retry_s"):
        maru.MaruConfig(storage_backend="remote", remote_url="tcp://m:1", remote_retry_s=0)
    with pytest.raises(ValueError, match="expand_size"):
        maru.MaruConfig(storage_backend="remote", remote_url="tcp://m:1", expand_size=2 * MiB)
    with pytest.raises(ValueError, match="metadata_only"):
        maru.MaruConfig(storage_backend="remote", remote_url="tcp://m:1", metadata_only=True)
    # The original's fields of its other backends load (and do nothing).
    maru.MaruConfig(storage_backend="remote", remote_url="tcp://m:1", engine_id="e0",
                    storage_schema="opaque-bytes-v1", write_order=("cxl",), read_order=("cxl",))
    cfg = maru.MaruConfig(storage_backend="remote", remote_url="tcp://m:1", cache_namespace="llama",
                          remote_token="sekrit-token-value")
    assert cfg.namespace == "llama" and cfg.node_id and cfg.is_remote
    assert "sekrit" not in repr(cfg)
    os.environ["MARU_REMOTE_TOKEN"] = "from-the-environment"
    try:
        assert maru.MaruConfig(storage_backend="remote", remote_url="tcp://m:1").remote_token == "from-the-environment"
    finally:
        del os.environ["MARU_REMOTE_TOKEN"]


def test_unreachable_door_bad_token_and_no_nixl_device_make_connect_false(node: MemoryNode, ns: str) -> None:
    t = time.monotonic()
    assert not maru.MaruHandler(node.config(ns, remote_url=f"tcp://127.0.0.1:{free_port()}")).connect()
    assert not maru.MaruHandler(node.config(ns, remote_token="not-the-token-at-all")).connect()
    # A TCP interface is no RDMA device for NIXL's UCX backend.
    assert not maru.MaruHandler(node.config(ns, remote_ucx_device="lo")).connect()
    assert time.monotonic() - t < 10


def test_bytes_round_trip_through_the_staging_buffer(node: MemoryNode, remote: maru.MaruHandler, ns: str) -> None:
    data = pattern("round", 3 * MiB + 5)
    a = remote.alloc(len(data))
    assert a.region_id == maru.remote.STAGING_REGION and not a.done
    a.buf[:] = data
    assert remote.store("k1", a) is True
    assert a.done
    assert remote.exists("k1") and not remote.exists("nope")
    info = remote.retrieve("k1")
    assert info is not None and info.view.readonly
    assert info.view.tobytes() == data
    assert info.region_id == maru.remote.STAGING_REGION
    assert remote.retrieve("nope") is None
    # Int and str keys are one key; the entry is the memory node's own, seen by its local
    # clients and under its mount.
    assert store_bytes(remote, 42, b"forty-two")
    assert bytes(remote.retrieve("42").view) == b"forty-two"
    local = node.local_handler(ns)
    try:
        assert local.retrieve("k1").view.tobytes() == data
        assert local.store(b"from-local", _local_alloc(local, b"local bytes"))
    finally:
        local.close()
    assert (node.marud.mount / ns / "k1").read_bytes() == data
    assert bytes(remote.retrieve(b"from-local").view) == b"local bytes"
    # Held now: the stored handle's piece (over 64 KiB: kept while `a.buf` is readable) and
    # the two views'.
    again = remote.retrieve("k1")
    assert remote.get_stats()["remote_storage"]["staging"]["leases"] == 3
    again.release()  # let go now (the original's lease.release())
    assert "released" in repr(again)
    assert remote.get_stats()["remote_storage"]["staging"]["leases"] == 2
    # Every allocation gone, every view released: the staging buffer is free again.
    del info, a
    stats = remote.get_stats()["remote_storage"]
    assert stats["staging"]["leases"] == 0, stats
    assert stats["staging"]["free"] == stats["staging"]["capacity"]
    assert stats["counters"]["errors"] == 0 and stats["unavailable_for_s"] is None
    assert remote.healthcheck()


def _local_alloc(h: maru.MaruHandler, data: bytes) -> Any:
    a = h.alloc(len(data))
    a.buf[:] = data
    return a


def test_put_long_keys_and_listing(remote: maru.MaruHandler) -> None:
    assert remote.put("joined", b"abc", bytearray(b"def"), memoryview(b"ghi"))
    assert bytes(remote.retrieve("joined").view) == b"abcdefghi"
    long_key = "L" * 300 + "/with/slashes"  # cut into namespaces of its own
    assert store_bytes(remote, long_key, b"long")
    assert remote.exists(long_key)
    assert bytes(remote.retrieve(long_key).view) == b"long"
    assert remote.batch_exists([long_key, "joined", "x"]) == [True, True, False]
    assert sorted(remote.list_keys()) == sorted([b"joined", long_key.encode()])
    assert remote.delete(long_key) and not remote.exists(long_key)
    with pytest.raises(ValueError):
        remote.put("empty")
    with pytest.raises(NotImplementedError):
        remote.path_of("joined")


def test_batch_forms(remote: maru.MaruHandler) -> None:
    keys = [f"b{i}" for i in range(40)]
    values = [pattern(k, 4096 * (i % 5) + 100 + i) for i, k in enumerate(keys)]
    handles = [_local_alloc(remote, v) for v in values]
    assert remote.batch_store(keys, handles) == [True] * len(keys)
    assert all(h.done for h in handles)
    assert remote.batch_exists(keys + ["missing"]) == [True] * len(keys) + [False]
    got = remote.batch_retrieve(["missing"] + keys)
    assert got[0] is None
    assert [g.view.tobytes() for g in got[1:]] == values
    assert remote.batch_pin(keys[:3] + ["missing"]) == [True, True, True, False]
    assert remote.batch_unpin(keys[:3] + ["missing"]) == [True, True, True, False]
    assert remote.batch_delete(keys[:10] + ["missing"]) == [True] * 10 + [False]
    assert remote.batch_exists(keys[:12]) == [False] * 10 + [True, True]
    with pytest.raises(ValueError):
        remote.batch_store(["a", "b"], [_local_alloc(remote, b"x")])
    h = _local_alloc(remote, b"twice")
    with pytest.raises(ValueError):
        remote.batch_store(["a", "b"], [h, h])
    assert not h.done  # refused before anything moved: still the caller's
    remote.free(h)


def test_exists_delete_and_counted_pins(node: MemoryNode, remote: maru.MaruHandler, ns: str) -> None:
    assert store_bytes(remote, "p", b"pinned bytes")
    entry = node.marud.mount / ns / "p"

    def pinned() -> bool:
        return os.getxattr(entry, "user.maru.pinned") == b"1"

    assert not pinned()
    assert remote.pin("p") and remote.pin("p") and pinned()
    assert remote.unpin("p") and pinned()  # one of this handler's two pins is left
    assert remote.unpin("p") and not pinned()
    assert not remote.unpin("p")  # none left: nothing sent
    assert not remote.pin("missing") and not remote.unpin("missing")
    # Pins end with the handler.
    other = maru.MaruHandler(node.config(ns))
    assert other.connect()
    assert other.pin("p") and pinned()
    other.close()
    assert not pinned()
    assert remote.delete("p") and not remote.exists("p")
    assert not remote.delete("p")
    assert remote.retrieve("p") is None


def test_threads_share_one_handler(remote: maru.MaruHandler) -> None:
    import threading

    errors: List[BaseException] = []

    def work(t: int) -> None:
        try:
            for i in range(20):
                key, value = f"thread-{t}-{i}", pattern((t, i), 8192 + 17 * i)
                assert store_bytes(remote, key, value)
                assert remote.retrieve(key).view.tobytes() == value
        except BaseException as e:  # reported below
            errors.append(e)

    threads = [threading.Thread(target=work, args=(t,)) for t in range(4)]
    for th in threads:
        th.start()
    for th in threads:
        th.join()
    assert not errors, errors
    assert remote.batch_exists([f"thread-{t}-19" for t in range(4)]) == [True] * 4


def test_a_duplicate_store_keeps_the_first_value(remote: maru.MaruHandler) -> None:
    assert store_bytes(remote, "dup", b"first")
    assert store_bytes(remote, "dup", b"second") is True  # write-once: present counts as stored
    assert bytes(remote.retrieve("dup").view) == b"first"
    # The same key twice in one batch: the first handle's bytes win.
    assert remote.batch_store(["twice", "twice"], [_local_alloc(remote, b"one"), _local_alloc(remote, b"two")]) == [True, True]
    assert bytes(remote.retrieve("twice").view) == b"one"


def test_the_load_reserve_and_a_full_staging_buffer(node: MemoryNode, ns: str) -> None:
    h = maru.MaruHandler(node.config(ns, pool_size=MiB, chunk_size_bytes=256 << 10, remote_load_reserve=0.5))
    assert h.connect()
    try:
        a = h.alloc(256 << 10)
        b = h.alloc(256 << 10)
        with pytest.raises(maru.StagingFullError) as e:
            h.alloc(4096)  # would take the half kept for loads
        assert isinstance(e.value, MemoryError) and isinstance(e.value, maru.NoSpaceError)
        assert e.value.errno == errno.ENOSPC
        with pytest.raises(ValueError):
            h.alloc(257 << 10)  # over chunk_size_bytes, as the local handler
        a.buf[:] = pattern("a", 256 << 10)
        assert h.store("a", a)
        # Loads use the reserve: two views fit while the unstored allocation b holds its piece.
        got = h.batch_retrieve(["a", "a"])
        assert all(g is not None and g.view.tobytes() == pattern("a", 256 << 10) for g in got)
        # A third does not: a miss (counted), never an exception.
        assert h.retrieve("a") is None
        assert h.get_stats()["remote_storage"]["staging"]["load_refused"] == 1
        maru.MaruHandler.release_retrieved(got)
        del got
        assert h.retrieve("a") is not None
        h.free(b)
        with pytest.raises(ValueError):
            h.free(b)
        # A freed (or stored) allocation over 64 KiB keeps its piece while its buf is
        # readable: until the handle goes. One of 64 KiB or less is copied and let go at once.
        assert h.get_stats()["remote_storage"]["staging"]["free"] == 512 << 10
        del b
        c = h.alloc(256 << 10)
        h.free(c)
        del c
        small = h.alloc(64 << 10)
        small.buf[:] = pattern("s", 64 << 10)
        before = h.get_stats()["remote_storage"]["staging"]["free"]
        assert h.store("small", small)
        assert h.get_stats()["remote_storage"]["staging"]["free"] == before + (64 << 10)
        assert small.buf.tobytes() == pattern("s", 64 << 10)
    finally:
        h.close()


def test_cpu_tensors_round_trip(remote: maru.MaruHandler) -> None:
    torch = pytest.importorskip("torch")
    kv = torch.randn(2, 4, 64, 32, dtype=torch.bfloat16)
    assert remote.store_from("kv0", kv)
    out = torch.empty_like(kv)
    assert remote.retrieve_into("kv0", out)
    assert torch.equal(out, kv)
    assert not remote.retrieve_into("absent", torch.empty_like(kv))
    with pytest.raises(ValueError):
        remote.retrieve_into("kv0", torch.empty(3, dtype=torch.float32))
    keys = [f"t{i}" for i in range(8)]
    tensors = [torch.full((1024,), float(i)) for i in range(8)]
    assert remote.batch_store_from(keys, tensors) == [True] * 8
    outs = [torch.empty(1024) for _ in keys]
    assert remote.batch_retrieve_into(keys, outs) == [True] * 8
    assert all(torch.equal(o, t) for o, t in zip(outs, tensors))
    stats = remote.get_stats()
    assert stats["remote_storage"]["staging"]["leases"] == 0


CHILD = """
    import os, sys, hashlib, maru
    url, token, ns, op, key, seed, size = sys.argv[1:8]
    cfg = maru.MaruConfig(storage_backend="remote", remote_url=url, remote_token=token,
                          namespace=ns, pool_size=16 << 20, chunk_size_bytes=8 << 20)
    def pattern(seed, size):
        block = hashlib.sha256(str(seed).encode()).digest() * 128
        return (block * (size // len(block) + 1))[:size]
    with maru.MaruHandler(cfg) as h:
        assert h.connected, "no connection"
        if op == "store":
            a = h.alloc(int(size))
            a.buf[:] = pattern(seed, int(size))
            print(h.store(key, a))
        else:
            info = h.retrieve(key)
            print(info is not None and info.view.tobytes() == pattern(seed, int(size)))
"""


def run_child(node: MemoryNode, ns: str, *args: str) -> str:
    out = subprocess.run(
        [sys.executable, "-c", textwrap.dedent(CHILD), node.url, TOKEN, ns, *args],
        env=child_env(), capture_output=True, text=True, timeout=120,
    )
    assert out.returncode == 0, f"child failed ({out.returncode}):\n{out.stdout}\n{out.stderr}"
    return out.stdout.strip()


def test_another_process_retrieves_what_one_stored(node: MemoryNode, remote: maru.MaruHandler, ns: str) -> None:
    assert run_child(node, ns, "store", "from-child", "7", str(2 * MiB + 3)) == "True"
    info = remote.retrieve("from-child")
    assert info is not None and info.view.tobytes() == pattern("7", 2 * MiB + 3)
    assert store_bytes(remote, "from-parent", pattern("9", MiB))
    assert run_child(node, ns, "retrieve", "from-parent", "9", str(MiB)) == "True"


def test_timed_out_transfers_keep_their_pieces_until_they_end(node: MemoryNode, remote: maru.MaruHandler, ns: str) -> None:
    assert remote.put("big", pattern("big", 8 * MiB))
    # A transfer timeout no transfer meets (the deadline counts from the posting and is
    # strict): each WRITE or READ times out, even one UCX finishes by the first poll.
    hasty = maru.MaruHandler(node.config(ns, remote_transfer_timeout_s=1e-9, chunk_size_bytes=8 * MiB))
    assert hasty.connect()
    try:
        def stats() -> dict:
            return hasty.get_stats()["remote_storage"]

        # A WRITE that times out: a failed store, its pages quarantined in marud.
        assert store_bytes(hasty, "hasty", pattern("hasty", 8 * MiB)) is False
        assert stats()["counters"]["lingering"] == 1 and stats()["unavailable_for_s"] is not None
        time.sleep(RETRY_S + 0.1)
        # A READ that times out: a miss; the NIC may still write into its piece, which stays
        # leased (not reused) until NIXL says the transfer ended.
        assert hasty.retrieve("big") is None
        assert stats()["counters"]["lingering"] == 1  # the WRITE was settled first
        assert stats()["staging"]["leases"] == 1
        time.sleep(RETRY_S + 0.1)
        assert hasty.exists("big")  # settles the READ: its piece goes back
        assert stats()["counters"]["lingering"] == 0
        assert stats()["staging"]["leases"] == 0
        assert not remote.exists("hasty")
    finally:
        hasty.close()


def test_a_killed_marud_means_misses_and_failures_then_it_works_again(node: MemoryNode, ns: str) -> None:
    """Last in the file: marud is killed and started again on the same pool."""
    torch = pytest.importorskip("torch")
    h = maru.MaruHandler(node.config(ns))
    assert h.connect()
    try:
        assert store_bytes(h, "before", b"stored before the crash")
        assert h.pin("before")
        spare = _local_alloc(h, b"stored after the crash")
        node.kill()

        # The first call finds the connection gone (reconnecting is refused at once): a miss.
        limit = TIMEOUT_MS / 1000 + TRANSFER_S
        t = time.monotonic()
        assert h.retrieve("before") is None
        assert time.monotonic() - t < limit
        # Then the pool is left alone for remote_retry_s: answers without asking it.
        t = time.monotonic()
        assert not h.exists("before")
        assert h.batch_exists(["before", "x"]) == [False, False]
        assert h.batch_retrieve(["before", "x"]) == [None, None]
        assert h.store("after", spare) is False and spare.done
        assert h.batch_store(["a", "b"], [_local_alloc(h, b"1"), _local_alloc(h, b"2")]) == [False, False]
        assert h.put("p", b"bytes") is False
        assert not h.delete("before") and h.batch_delete(["before"]) == [False]
        assert not h.pin("before") and h.batch_pin(["before"]) == [False]
        assert not h.unpin("before")  # kept: given back when the pool answers again
        assert not h.healthcheck()
        assert list(h.list_keys()) == []
        assert h.store_from("t", torch.ones(8)) is False
        assert h.retrieve_into("t", torch.empty(8)) is False
        assert time.monotonic() - t < 0.5, "calls waited for the pool while it was left alone"
        stats = h.get_stats()["remote_storage"]
        assert stats["unavailable_for_s"] is not None and stats["counters"]["skipped"] > 0

        # Still down after the retry period: one more failure, within the timeouts.
        time.sleep(RETRY_S + 0.1)
        t = time.monotonic()
        assert h.retrieve("before") is None
        assert time.monotonic() - t < limit

        node.start()
        time.sleep(RETRY_S + 0.1)
        # Working again: a new connection to the new run, its NIXL metadata loaded afresh.
        assert store_bytes(h, "after", b"stored after the restart")
        assert bytes(h.retrieve("after").view) == b"stored after the restart"
        assert h.healthcheck()
        info = h.retrieve("before")  # the file pool's entries survive marud's crash
        assert info is not None and bytes(info.view) == b"stored before the crash"
        assert h.unpin("before")
        assert h.get_stats()["remote_storage"]["counters"]["reconnects"] >= 1
        # A handler made after the restart sees both.
        other = maru.MaruHandler(node.config(ns))
        assert other.connect()
        assert other.batch_exists(["before", "after"]) == [True, True]
        other.close()
    finally:
        h.close()
