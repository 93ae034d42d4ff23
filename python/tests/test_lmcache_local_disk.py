"""LMCache's LocalDiskBackend, unmodified, with ``local_disk: file:///<mount>/<ns>/``."""

from __future__ import annotations

import os
import time
from typing import Iterator, List

import pytest

pytest.importorskip("torch")
pytest.importorskip("lmcache")

import torch  # noqa: E402

import lmcache_util as lu  # noqa: E402
from conftest import Marud  # noqa: E402
from pagemap import pfn_of_file  # noqa: E402


def wait_on_disk(disk, keys: List, timeout: float = 20.0) -> None:
    """LocalDiskBackend writes on worker threads: wait until every key is indexed."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if all(disk.contains(k) and not disk.exists_in_put_tasks(k) for k in keys):
            return
        time.sleep(0.01)
    raise AssertionError("LocalDiskBackend did not finish its writes")


@pytest.fixture(params=[False, True], ids=["buffered", "odirect"])
def disk_manager(request, marud: Marud, namespace: str) -> Iterator:
    extra = {"use_odirect": True} if request.param else {}
    config = lu.make_config(
        local_disk=f"file://{marud.mount}/{namespace}/", max_local_disk_gb=0.5, extra=extra
    )
    sm = lu.make_manager(config)
    try:
        yield sm
    finally:
        sm.close()


def test_put_get_is_byte_identical_and_files_are_pool_entries(disk_manager, marud: Marud, namespace: str) -> None:
    sm = disk_manager
    disk = sm.storage_backends["LocalDiskBackend"]
    if sm.config.extra_config and sm.config.extra_config.get("use_odirect"):
        assert disk.use_odirect and lu.CHUNK_BYTES % disk.os_disk_bs == 0  # the O_DIRECT path is taken
    keys = lu.put_chunks(sm, range(4))
    wait_on_disk(disk, keys)
    ns = marud.mount / namespace
    for k in keys:
        path = ns / (k.to_string().replace("/", "-") + ".pt")  # LMCache's own naming
        assert path.stat().st_size == lu.CHUNK_BYTES
        assert os.getxattr(path, "user.maru.state") == b"sealed"
        assert os.getxattr(path, "user.maru.access") == b"passthrough"
    # Read back through LMCache's read path (readinto a CPU buffer), one by one and batched.
    for i, k in enumerate(keys):
        obj = disk.get_blocking(k)
        shape, dtype, t = lu.chunk_of(obj)
        assert shape == lu.CHUNK_SHAPE and dtype == lu.DTYPE
        assert torch.equal(t, lu.chunk_tensor(i))
        lu.release([obj])
    objs = disk.batched_get_blocking(keys)
    for i, obj in enumerate(objs):
        assert torch.equal(lu.chunk_of(obj)[2], lu.chunk_tensor(i))
    lu.release(objs)
    # The bytes are in pool memory: the entry's page is its backing file's page.
    path = ns / (keys[0].to_string().replace("/", "-") + ".pt")
    location = os.getxattr(path, "user.maru.location").decode()
    assert pfn_of_file(str(path)) == pfn_of_file(location)


def test_remove_frees_pool_memory(disk_manager, marud: Marud, namespace: str) -> None:
    sm = disk_manager
    disk = sm.storage_backends["LocalDiskBackend"]
    keys = lu.put_chunks(sm, range(8))
    wait_on_disk(disk, keys)
    ns = marud.mount / namespace
    assert int(os.getxattr(ns, "user.maru.entries")) == 8
    before = marud.free_bytes()
    for k in keys:
        assert disk.remove(k)
    assert int(os.getxattr(ns, "user.maru.entries")) == 0
    assert int(os.getxattr(ns, "user.maru.bytes")) == 0
    deadline = time.monotonic() + 5
    while marud.free_bytes() < before + 8 * lu.CHUNK_BYTES and time.monotonic() < deadline:
        time.sleep(0.01)
    assert marud.free_bytes() >= before + 8 * lu.CHUNK_BYTES
    assert disk.get_blocking(keys[0]) is None


def test_lmcache_eviction_unlinks_and_bounds_pool_use(marud: Marud, namespace: str) -> None:
    """LocalDiskBackend's own LRU (max_local_disk_size) evicts by unlinking: the namespace
    never holds more than the configured size."""
    limit_chunks = 6
    config = lu.make_config(
        local_disk=f"file://{marud.mount}/{namespace}/",
        max_local_disk_gb=limit_chunks * lu.CHUNK_BYTES / 1024**3,
    )
    sm = lu.make_manager(config)
    try:
        disk = sm.storage_backends["LocalDiskBackend"]
        keys = []
        for start in range(0, 20, 2):  # small batches so evictions interleave with writes
            batch = lu.put_chunks(sm, range(start, start + 2))
            wait_on_disk(disk, batch)
            keys += batch
            assert int(os.getxattr(marud.mount / namespace, "user.maru.bytes")) <= limit_chunks * lu.CHUNK_BYTES
        present = [k for k in keys if disk.contains(k)]
        assert len(present) <= limit_chunks
        assert present == keys[-len(present):]  # the oldest went first
        assert len(os.listdir(marud.mount / namespace)) == len(present)
    finally:
        sm.close()


def test_a_second_process_cannot_find_local_disk_chunks(marud: Marud, namespace: str) -> None:
    """Why the plugin exists: LocalDiskBackend's index is in its process's memory."""
    url = f"file://{marud.mount}/{namespace}/"
    first = lu.make_manager(lu.make_config(local_disk=url, max_local_disk_gb=0.5))
    try:
        keys = lu.put_chunks(first, range(2))
        wait_on_disk(first.storage_backends["LocalDiskBackend"], keys)
    finally:
        first.close()
    second = lu.make_manager(lu.make_config(local_disk=url, max_local_disk_gb=0.5))
    try:
        assert len(os.listdir(marud.mount / namespace)) == 2  # the files are there...
        assert not second.storage_backends["LocalDiskBackend"].contains(keys[0])  # ...unknown to it
    finally:
        second.close()


def test_a_restarted_local_disk_backend_cannot_rewrite_old_entries(marud: Marud, namespace: str) -> None:
    """Documented limit (doc/LMCACHE.md): entries are write-once, so a new LocalDiskBackend on a
    namespace that still holds a previous run's files cannot write those keys again
    (``open(path, "wb")`` gets EPERM on its worker thread) and never indexes them. Give
    LocalDiskBackend an empty namespace at start."""
    url = f"file://{marud.mount}/{namespace}/"
    first = lu.make_manager(lu.make_config(local_disk=url, max_local_disk_gb=0.5))
    try:
        keys = lu.put_chunks(first, [0])
        wait_on_disk(first.storage_backends["LocalDiskBackend"], keys)
    finally:
        first.close()
    with pytest.raises(PermissionError):
        open(marud.mount / namespace / os.listdir(marud.mount / namespace)[0], "wb")
    second = lu.make_manager(lu.make_config(local_disk=url, max_local_disk_gb=0.5))
    try:
        disk = second.storage_backends["LocalDiskBackend"]
        lu.put_chunks(second, [0])
        deadline = time.monotonic() + 2
        while disk.exists_in_put_tasks(keys[0]) and time.monotonic() < deadline:
            time.sleep(0.01)
        assert not disk.contains(keys[0])
    finally:
        second.close()
