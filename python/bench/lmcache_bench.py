#!/usr/bin/env python3
"""Benchmark: LMCache chunk retrieval through the maru plugin vs LocalDiskBackend.

One run measures, with LMCache's own backends built by its StorageManager on
CPU, for chunks of a Llama-3.1-8B-shaped model (32 layers x 8 KV heads x 128
dims x K,V x bf16 = 128 KiB per token; 256-token chunks = 32 MiB):

- the maru storage plugin, ``retrieve_mode: map`` (the chunk is mapped, zero-copy)
  and ``retrieve_mode: copy`` (copied from the mapping into a LocalCPUBackend buffer);
- LocalDiskBackend with ``local_disk`` on /maru (a private marud, tmpfs pool);
- LocalDiskBackend on the machine's local disk, buffered (reads hit the page
  cache, which still holds what was just written) and with O_DIRECT (reads go
  to the device).

Each round, for each case: the time to store N chunks (``batched_put`` until
written), then per chunk the time of ``get_blocking`` (the backend hands LMCache a MemoryObj) and
of ``get_blocking`` + one copy of the chunk into a preallocated tensor (what
an engine does next: its copy into the paged KV cache; on a GPU host that is
the host-to-device copy; here one memcpy on one thread), then ``batched_get_blocking`` of all N chunks (+ the
copies), then the chunks are removed. The cases are set up together and measured
in interleaved rounds
(rotating order), so machine noise hits them alike. Medians and 90th
percentiles; GB/s = 10^9 bytes per second of chunk payload.

Usage (root; a built marud)::

    python3 python/bench/lmcache_bench.py --marud target/release/marud
    python3 python/bench/lmcache_bench.py --chunks 8 --rounds 3 --layers 4   # quick
"""

from __future__ import annotations

import argparse
import hashlib
import os
import platform
import shutil
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any, Callable, List, Optional, Tuple

os.environ.setdefault("LMCACHE_LOG_LEVEL", "WARNING")

HERE = Path(__file__).resolve().parent
REPO = HERE.parents[1]
sys.path.insert(0, str(HERE.parent))  # the maru package from this tree when not installed

import torch  # noqa: E402

from lmcache.utils import CacheEngineKey  # noqa: E402
from lmcache.v1.config import LMCacheEngineConfig  # noqa: E402
from lmcache.v1.event_manager import EventManager  # noqa: E402
from lmcache.v1.memory_management import MemoryFormat, MemoryObj  # noqa: E402
from lmcache.v1.metadata import LMCacheMetadata  # noqa: E402
from lmcache.v1.storage_backend.storage_manager import StorageManager  # noqa: E402

from maru.testing import PrivateMarud  # noqa: E402

MODEL = "meta-llama/Llama-3.1-8B"
DTYPE = torch.bfloat16


class Shape:
    """The model's KV geometry."""

    def __init__(self, layers: int, heads: int, head_dim: int, tokens: int) -> None:
        self.layers, self.heads, self.head_dim, self.tokens = layers, heads, head_dim, tokens
        self.chunk = torch.Size([2, layers, tokens, heads * head_dim])  # KV_2LTD
        self.bytes = self.chunk.numel() * DTYPE.itemsize

    def metadata(self) -> LMCacheMetadata:
        return LMCacheMetadata(
            model_name=MODEL, world_size=1, local_world_size=1, worker_id=0, local_worker_id=0,
            kv_dtype=DTYPE, kv_shape=(self.layers, 2, self.tokens, self.heads, self.head_dim),
        )


def key(i: int) -> CacheEngineKey:
    h = int.from_bytes(hashlib.sha256(f"bench-{i}".encode()).digest()[:8], "little")
    return CacheEngineKey(MODEL, 1, 0, h, DTYPE)


def make_config(shape: Shape, cpu_gb: float, **kw: Any) -> LMCacheEngineConfig:
    extra = kw.pop("extra_config", None)
    plugins = kw.pop("storage_plugins", None)
    config = LMCacheEngineConfig.from_defaults(
        chunk_size=shape.tokens, local_cpu=False, max_local_cpu_size=cpu_gb,
        lmcache_instance_id=f"bench-{os.getpid()}", **kw,
    )
    if extra:
        config.extra_config = extra
    if plugins:
        config.storage_plugins = plugins
    return config


def wait_until(pred: Callable[[], bool], timeout: float = 300.0) -> None:
    deadline = time.monotonic() + timeout
    while not pred():
        if time.monotonic() > deadline:
            raise TimeoutError("writes did not finish")
        time.sleep(0.0005)


def median_ms(xs: List[float]) -> float:
    return statistics.median(xs) * 1e3


class Case:
    """One backend configuration: its StorageManager, its chunks, its timings."""

    def __init__(self, label: str, config: LMCacheEngineConfig, backend_name: str, shape: Shape) -> None:
        self.label = label
        self.shape = shape
        self.sm = StorageManager(config=config, metadata=shape.metadata(), event_manager=EventManager())
        self.backend = self.sm.storage_backends[backend_name]
        self.put_s: List[float] = []
        self.get_s: List[float] = []
        self.get_copy_s: List[float] = []
        self.batch_s: List[float] = []
        self.batch_copy_s: List[float] = []

    def cycle(self, r: int, data: List[torch.Tensor], dst: torch.Tensor) -> None:
        """One timed round: store the chunks (fresh keys), get each one (then copy it out),
        get them all in one batched get, remove them."""
        n = len(data)
        backend = self.backend
        keys = [key(r * n + i) for i in range(n)]
        objs = []
        for i in range(n):
            obj = self.sm.allocate(self.shape.chunk, DTYPE, fmt=MemoryFormat.KV_2LTD)
            assert obj is not None and obj.tensor is not None, "LocalCPUBackend too small"
            obj.tensor.copy_(data[i])
            objs.append(obj)
        t0 = time.perf_counter()
        self.sm.batched_put(keys, objs)
        # Both backends register a key in their put tasks before batched_put returns and drop
        # it once the chunk is written and indexed.
        wait_until(lambda: not any(backend.exists_in_put_tasks(k) for k in keys))
        self.put_s.append(time.perf_counter() - t0)
        assert all(backend.contains(k) for k in keys), f"{self.label}: chunks missing after put"
        for i in (0, n - 1):  # correctness, outside the timings
            got = backend.get_blocking(keys[i])
            assert got is not None and torch.equal(got.tensor, data[i]), f"{self.label}: wrong bytes"
            got.ref_count_down()

        for k in keys:
            t0 = time.perf_counter()
            obj = backend.get_blocking(k)
            t1 = time.perf_counter()
            assert obj is not None
            dst.copy_(obj.tensor)
            t2 = time.perf_counter()
            obj.ref_count_down()
            self.get_s.append(t1 - t0)
            self.get_copy_s.append(t2 - t0)
        t0 = time.perf_counter()
        got_all: List[Optional[MemoryObj]] = backend.batched_get_blocking(keys)
        t1 = time.perf_counter()
        for obj in got_all:
            assert obj is not None
            dst.copy_(obj.tensor)
        t2 = time.perf_counter()
        for obj in got_all:
            obj.ref_count_down()  # type: ignore[union-attr]
        self.batch_s.append(t1 - t0)
        self.batch_copy_s.append(t2 - t0)
        for k in keys:
            assert backend.remove(k)

    def close(self) -> None:
        self.sm.close()


def pct_ms(xs: List[float], q: float) -> float:
    ys = sorted(xs)
    return ys[min(len(ys) - 1, int(q * len(ys)))] * 1e3


def gbps(nbytes: float, ms: float) -> float:
    return nbytes / (ms / 1e3) / 1e9


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--marud", default=os.environ.get("MARUD"), help="marud binary (default: $MARUD, target/release, target/debug)")
    ap.add_argument("--chunks", type=int, default=16, help="chunks per backend (default 16)")
    ap.add_argument("--rounds", type=int, default=5, help="timed rounds over all chunks (default 5)")
    ap.add_argument("--layers", type=int, default=32)
    ap.add_argument("--kv-heads", type=int, default=8)
    ap.add_argument("--head-dim", type=int, default=128)
    ap.add_argument("--tokens", type=int, default=256, help="tokens per chunk (default 256)")
    ap.add_argument("--disk-dir", default="/var/tmp", help="where the local-disk runs write (default /var/tmp)")
    args = ap.parse_args()

    binary = args.marud
    if not binary:
        for profile in ("release", "debug"):
            if (REPO / "target" / profile / "marud").exists():
                binary = str(REPO / "target" / profile / "marud")
                break
    if not binary or not Path(binary).exists():
        print("no marud binary: pass --marud or build it", file=sys.stderr)
        return 2
    # One thread for torch's copies: with two, a busy 2-vCPU machine makes them 2-3x slower
    # (threads wait for each other), and an engine's copy-out is one DMA, not a thread pool.
    torch.set_num_threads(1)
    shape = Shape(args.layers, args.kv_heads, args.head_dim, args.tokens)
    n = args.chunks
    total = n * shape.bytes
    cpu_gb = 1.2 * total / 1024**3 + 0.05
    pool = f"{(total + (256 << 20)) >> 20}M"  # one case at a time holds its chunks
    # LocalDiskBackend.remove() does not give the bytes back to its size accounting (only its
    # own evictions do): leave room for every round's chunks.
    disk_gb = (args.rounds + 1) * total / 1024**3
    g = torch.Generator().manual_seed(0)
    data = [torch.randn(shape.chunk, generator=g, dtype=torch.float32).to(DTYPE) for _ in range(n)]

    disk_root = Path(tempfile.mkdtemp(prefix="maru-bench-", dir=args.disk_dir))
    try:
        with PrivateMarud(binary, pool_size=pool) as d:
            mnt = d.mount
            plugin_extra = {
                "storage_plugin.maru.module_path": "maru.lmcache_plugin",
                "storage_plugin.maru.class_name": "MaruStoragePlugin",
                "maru.socket": str(d.socket),
            }
            runs: List[Tuple[str, LMCacheEngineConfig, str]] = [
                ("maru plugin, map (zero-copy)",
                 make_config(shape, cpu_gb, storage_plugins=["maru"],
                             extra_config={**plugin_extra, "maru.namespace": "plugin-map"}), "maru"),
                ("maru plugin, copy to CPU buffer",
                 make_config(shape, cpu_gb, storage_plugins=["maru"],
                             extra_config={**plugin_extra, "maru.namespace": "plugin-copy",
                                           "maru.retrieve_mode": "copy"}), "maru"),
                ("LocalDiskBackend on /maru",
                 make_config(shape, cpu_gb, local_disk=f"file://{mnt}/localdisk/",
                             max_local_disk_size=disk_gb), "LocalDiskBackend"),
                (f"LocalDiskBackend on local disk ({args.disk_dir}), buffered",
                 make_config(shape, cpu_gb, local_disk=f"file://{disk_root}/buffered/",
                             max_local_disk_size=disk_gb), "LocalDiskBackend"),
                (f"LocalDiskBackend on local disk ({args.disk_dir}), O_DIRECT",
                 make_config(shape, cpu_gb, local_disk=f"file://{disk_root}/odirect/",
                             max_local_disk_size=disk_gb,
                             extra_config={"use_odirect": True}), "LocalDiskBackend"),
            ]
            cases: List[Case] = []
            try:
                for label, config, name in runs:
                    cases.append(Case(label, config, name, shape))
                dst = torch.empty(shape.chunk, dtype=DTYPE)
                for r in range(args.rounds):
                    print(f"... round {r + 1}/{args.rounds}", file=sys.stderr, flush=True)
                    # Interleaved, in a rotating order: machine noise hits every case alike.
                    for case in cases[r % len(cases):] + cases[: r % len(cases)]:
                        case.cycle(r, data, dst)
            finally:
                for case in cases:
                    case.close()
    finally:
        shutil.rmtree(disk_root, ignore_errors=True)

    mib = shape.bytes / 2**20
    import lmcache

    print(f"\nLMCache {getattr(lmcache, '__version__', '?')} chunk retrieval: {n} chunks of "
          f"{shape.tokens} tokens x {shape.layers} layers x {shape.heads} KV heads x {shape.head_dim} dims "
          f"x 2 (K,V) x bf16 = {mib:.0f} MiB each; {args.rounds} interleaved rounds; "
          f"{os.cpu_count()} CPUs, Linux {platform.release()}, torch {torch.__version__}\n")
    print(f"| backend | batched_put {n} chunks, ms (GB/s) | get_blocking, ms: median (p90) "
          f"| get + copy out, ms: median (p90) | GB/s | batched get {n} + copy out, ms (GB/s) |")
    print("|---|---:|---:|---:|---:|---:|")
    for c in cases:
        gc_med = median_ms(c.get_copy_s)
        b_med = median_ms(c.batch_copy_s)
        put_med = statistics.median(c.put_s) * 1e3
        print(f"| {c.label} | {put_med:.0f} ({gbps(total, put_med):.2f}) "
              f"| {median_ms(c.get_s):.3f} ({pct_ms(c.get_s, 0.9):.3f}) "
              f"| {gc_med:.2f} ({pct_ms(c.get_copy_s, 0.9):.2f}) | {gbps(shape.bytes, gc_med):.2f} "
              f"| {b_med:.1f} ({gbps(total, b_med):.2f}) |")
    return 0


if __name__ == "__main__":
    # LMCache keeps every process's Prometheus files in /tmp/lmcache_prometheus unless told
    # otherwise: this run's go to a directory removed at the end.
    with tempfile.TemporaryDirectory(prefix="maru-bench-prometheus-") as prometheus:
        os.environ.setdefault("PROMETHEUS_MULTIPROC_DIR", prometheus)
        sys.exit(main())
