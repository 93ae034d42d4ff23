"""The tensor verbs (``retrieve_into`` / ``store_from`` and their batch forms) and the CUDA
registration they keep (maru.tensors), on memfs and raw pools.

The copies run on CPU tensors here (the same code as CUDA tensors, less the DMA); the
registration rules are checked with a stand-in for the CUDA runtime that behaves as the driver
does (a range is registered once, unregistered once, and must be mapped meanwhile). The CUDA
round trip runs where a GPU is present and is skipped elsewhere.
"""

from __future__ import annotations

import uuid
from typing import Dict, List, Tuple

import pytest

torch = pytest.importorskip("torch")

import maru  # noqa: E402
from conftest import Marud  # noqa: E402
from maru.tensors import HostRegistry, TensorIO  # noqa: E402


class FakeDriver:
    """cudaHostRegister's rules: no range registered twice, no unregister of what is not
    registered; records every call."""

    def __init__(self, refuse: bool = False) -> None:
        self.live: Dict[int, Tuple[int, bool]] = {}
        self.calls: List[Tuple[str, int, int, bool]] = []
        self.refuse = refuse

    def register(self, addr: int, nbytes: int, read_only: bool) -> None:
        if self.refuse:
            raise OSError("cudaHostRegister: out of memory (2)")
        if addr in self.live:
            raise OSError("cudaHostRegister: part or all of the range is already registered (712)")
        self.live[addr] = (nbytes, read_only)
        self.calls.append(("register", addr, nbytes, read_only))

    def unregister(self, addr: int) -> None:
        if addr not in self.live:
            raise OSError("cudaHostUnregister: not registered (713)")
        nbytes, ro = self.live.pop(addr)
        self.calls.append(("unregister", addr, nbytes, ro))

    def count(self, op: str, read_only: bool) -> int:
        return sum(1 for c in self.calls if c[0] == op and c[3] == read_only)


@pytest.fixture(params=["memfs", "file"])
def any_handler(request: pytest.FixtureRequest) -> maru.MaruHandler:
    """A connected handler on the memfs marud or the raw-pool (``file:``) marud."""
    d: Marud = request.getfixturevalue("marud" if request.param == "memfs" else "raw_marud")
    h = maru.MaruHandler(d.config(f"tens-{uuid.uuid4().hex[:12]}"))
    assert h.connect(), d.log_tail()
    yield h
    h.close()


def kv(seed: int, shape=(4, 3, 512), dtype=torch.float16) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return torch.randn(shape, generator=g).to(dtype)


def test_round_trip(any_handler: maru.MaruHandler) -> None:
    h = any_handler
    src = kv(1)
    assert h.store_from("layer0", src)
    info = h.retrieve("layer0")
    assert info is not None and info.view.tobytes() == src.numpy().tobytes()
    dst = torch.zeros_like(src)
    assert h.retrieve_into("layer0", dst)
    assert torch.equal(dst, src)
    untouched = torch.full_like(src, 7)
    assert not h.retrieve_into("absent", untouched)
    assert bool((untouched == 7).all())


def test_batch_round_trip_any_dtype(any_handler: maru.MaruHandler) -> None:
    h = any_handler
    srcs = [kv(i, shape=(2, 64 + i), dtype=d) for i, d in
            enumerate([torch.float16, torch.bfloat16, torch.float32, torch.int8, torch.uint8])]
    keys = [f"model@w@0@{i:x}@x" for i in range(len(srcs))]
    assert h.batch_store_from(keys, srcs) == [True] * len(srcs)
    dsts = [torch.zeros_like(s) for s in srcs] + [torch.ones(3)]
    got = h.batch_retrieve_into(keys + ["missing"], dsts)
    assert got == [True] * len(srcs) + [False]
    for s, d in zip(srcs, dsts):
        assert torch.equal(s, d)
    assert torch.equal(dsts[-1], torch.ones(3))


def test_store_from_an_existing_key_is_true_and_the_first_writer_stays(any_handler: maru.MaruHandler) -> None:
    h = any_handler
    first, second = kv(1), kv(2)
    assert h.store_from("k", first)
    assert h.store_from("k", second)  # write-once: True, as the original's store
    out = torch.empty_like(first)
    assert h.retrieve_into("k", out) and torch.equal(out, first)


def test_bad_input_is_refused_before_anything_moves(any_handler: maru.MaruHandler) -> None:
    h = any_handler
    a, b = kv(1, shape=(8, 8)), kv(2, shape=(8, 16))
    assert h.batch_store_from(["a", "b"], [a, b]) == [True, True]
    dst_a, dst_b = torch.full((8, 8), 5, dtype=torch.float16), torch.full((8, 8), 5, dtype=torch.float16)
    with pytest.raises(ValueError, match="holds 256 bytes, its tensor 128"):
        h.batch_retrieve_into(["a", "b"], [dst_a, dst_b])  # b's tensor is half its size
    assert bool((dst_a == 5).all()) and bool((dst_b == 5).all()), "a copy was made before the error"
    with pytest.raises(ValueError, match="contiguous"):
        h.retrieve_into("a", torch.zeros(16, 8, dtype=torch.float16)[::2])
    with pytest.raises(ValueError, match="same length"):
        h.batch_retrieve_into(["a", "b"], [dst_a])
    with pytest.raises(TypeError, match="torch.Tensor"):
        h.retrieve_into("a", bytearray(128))
    with pytest.raises(ValueError, match="contiguous"):
        h.store_from("nc", kv(3, shape=(16, 8))[::2])
    with pytest.raises(ValueError, match="empty"):
        h.batch_store_from(["e1", "e2"], [kv(4), torch.zeros(0)])
    assert h.batch_exists(["nc", "e1", "e2"]) == [False, False, False]


def test_memfs_entries_are_registered_once_and_kept(handler: maru.MaruHandler) -> None:
    drv = FakeDriver()
    tio = TensorIO(handler, driver=drv)
    srcs = [kv(i) for i in range(3)]
    keys = ["r0", "r1", "r2"]
    published_while_registered = []
    store = handler.batch_store

    def checked_store(ks, handles):
        from maru.buffers import address_of

        published_while_registered.extend(address_of(a.buf) in drv.live for a in handles)
        return store(ks, handles)

    handler.batch_store = checked_store  # type: ignore[method-assign]
    assert tio.store_from(keys, srcs) == [True] * 3
    # Allocations: registered writable for the device's writes, unregistered before publishing.
    assert drv.count("register", False) == 3 and drv.count("unregister", False) == 3
    assert published_while_registered == [False] * 3
    dsts = [torch.empty_like(s) for s in srcs]
    for _ in range(3):
        assert tio.retrieve_into(keys, dsts) == [True] * 3
    assert all(torch.equal(s, d) for s, d in zip(srcs, dsts))
    # Sealed entries: one read-only registration each, kept across retrieves.
    assert drv.count("register", True) == 3 and drv.count("unregister", True) == 0
    assert tio.stats()["registry"]["live"] == 3
    live, freed = tio.close()
    assert (live, freed) == (3, 0) and drv.live == {}


def test_a_raw_pool_is_registered_once_whole(raw_handler: maru.MaruHandler) -> None:
    drv = FakeDriver()
    tio = TensorIO(raw_handler, driver=drv)
    srcs = [kv(i, shape=(1024 + i,)) for i in range(4)]
    keys = [f"e{i}" for i in range(4)]
    assert tio.store_from(keys, srcs) == [True] * 4
    dsts = [torch.empty_like(s) for s in srcs]
    assert tio.retrieve_into(keys, dsts) == [True] * 4
    assert all(torch.equal(s, d) for s, d in zip(srcs, dsts))
    pools = [(c[1], c[2]) for c in drv.calls if c[0] == "register" and c[3]]
    assert len(pools) == 1, drv.calls
    start, length = pools[0]
    pool_id = raw_handler.retrieve("e0").region_id  # type: ignore[union-attr]
    assert length == len(raw_handler._raw_pool_view(pool_id))
    from maru.buffers import address_of

    for k in keys:
        addr = address_of(raw_handler.retrieve(k).view)  # type: ignore[union-attr]
        assert start <= addr < start + length
    tio.close()
    assert drv.live == {}


def test_registry_keeps_at_most_its_capacity(handler: maru.MaruHandler) -> None:
    drv = FakeDriver()
    size = 64 << 10
    for i in range(4):
        assert handler.put(f"c{i}", bytes([i]) * size)
    infos = [handler.retrieve(f"c{i}") for i in range(4)]
    reg = HostRegistry(drv, capacity=2 * size)
    for info in infos:
        assert reg.ensure(info.view, info, read_only=True)  # type: ignore[union-attr]
    assert reg.stats.live == 2 and reg.stats.unregistered == 2  # the two oldest went
    assert reg.covers(infos[3].view) and not reg.covers(infos[0].view)  # type: ignore[union-attr]
    assert reg.ensure(infos[2].view, infos[2], read_only=True)  # type: ignore[union-attr]
    assert drv.count("register", True) == 4  # kept: not registered again
    reg.close()
    assert drv.live == {} and reg.stats.live_bytes == 0


def test_reserved_allocations_serve_stores_and_are_freed_on_close(handler: maru.MaruHandler) -> None:
    drv = FakeDriver()
    tio = TensorIO(handler, driver=drv)
    src = kv(9)
    nbytes = src.numel() * src.element_size()
    assert tio.reserve(nbytes, 4) == 4
    assert drv.count("register", False) == 4  # registered ahead, not at store time
    assert tio.store_from(["s"], [src]) == [True]
    assert tio.reserved(nbytes) == 3 and drv.count("register", False) == 4
    out = torch.empty_like(src)
    assert tio.retrieve_into(["s"], [out]) == [True] and torch.equal(out, src)
    spares = list(tio._reserve[nbytes])
    assert not any(a.done for a in spares)
    live, freed = tio.close()
    assert freed == 3 and drv.live == {}
    assert all(a.done for a in spares)  # given back to marud


def test_the_reserve_is_topped_up_in_the_background_and_given_back(handler: maru.MaruHandler) -> None:
    import time

    drv = FakeDriver()
    tio = TensorIO(handler, driver=drv)
    srcs = [kv(i) for i in range(5)]
    nbytes = srcs[0].numel() * srcs[0].element_size()
    assert tio.reserve(nbytes, 4) == 4
    assert tio.store_from([f"t{i}" for i in range(3)], srcs[:3]) == [True] * 3
    deadline = time.monotonic() + 10
    while tio.reserved(nbytes) < 4:  # 1 left of 4: below half, so the thread tops it up
        assert time.monotonic() < deadline, f"not topped up: {tio.reserved(nbytes)} reserved"
        time.sleep(0.01)
    assert drv.count("register", False) == 4 + 3  # the new ones come registered
    spares = list(tio._reserve[nbytes])
    assert tio.reserve(nbytes, 1) == 1  # lowering the level gives the rest back
    assert sum(a.done for a in spares) == 3
    assert tio.store_from(["t3", "t4"], srcs[3:]) == [True, True]
    out = [torch.empty_like(s) for s in srcs]
    assert tio.retrieve_into([f"t{i}" for i in range(5)], out) == [True] * 5
    assert all(torch.equal(a, b) for a, b in zip(srcs, out))
    refiller = tio._refiller
    tio.close()
    assert refiller is not None and not refiller.is_alive()
    assert drv.live == {}


def test_copies_work_when_the_driver_refuses_to_register(handler: maru.MaruHandler) -> None:
    drv = FakeDriver(refuse=True)
    tio = TensorIO(handler, driver=drv)
    src = kv(5)
    assert tio.store_from(["x"], [src]) == [True]
    out = torch.empty_like(src)
    assert tio.retrieve_into(["x"], [out]) == [True] and torch.equal(out, src)
    assert tio.stats()["registry"]["failed"] >= 2
    tio.close()


def test_handler_stats_report_the_tensor_verbs(handler: maru.MaruHandler) -> None:
    assert handler.store_from("st", kv(1))
    assert "reserved" in handler.get_stats()["maru"]["tensors"]


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
@pytest.mark.parametrize("pool", ["memfs", "file"])
def test_cuda_round_trip(pool: str, request: pytest.FixtureRequest) -> None:
    d: Marud = request.getfixturevalue("marud" if pool == "memfs" else "raw_marud")
    with maru.MaruHandler(d.config(f"cuda-{uuid.uuid4().hex[:12]}")) as h:
        srcs = [kv(i, shape=(2, 16, 1024)).cuda() for i in range(4)]
        keys = [f"g{i}" for i in range(4)]
        assert h.reserve(srcs[0].numel() * 2, 2) == 2
        assert h.batch_store_from(keys, srcs) == [True] * 4
        dsts = [torch.empty_like(s) for s in srcs]
        assert h.batch_retrieve_into(keys, dsts) == [True] * 4
        assert all(torch.equal(s, d) for s, d in zip(srcs, dsts))
        reg = h.get_stats()["maru"]["tensors"]["registry"]
        assert reg["failed"] == 0 and reg["live"] >= 1
