#!/usr/bin/env python3
"""Benchmark: SGLang HiCache storage, maru (``MaruStorage``) vs SGLang's own ``file`` backend.

One run, side by side, with SGLang's own objects on CPU: a host KV pool
(``MHATokenToKVPoolHost``, ``page_first`` by default) for a Llama-3-8B-shaped model (32 layers
x 8 KV heads x 128 dims x K,V x bf16 = 128 KiB per token; 64-token pages = 8 MiB), and both
backends made by SGLang's ``StorageBackendFactory``:

- maru: ``dynamic`` with ``interface_v1: 1``; the controller's zero-copy path, which calls
  ``batch_set_v1`` / ``batch_get_v1`` with host indices (a private marud, tmpfs pool);
- file: ``HiCacheFile`` on a directory of a tmpfs (``/dev/shm``); it has no v1 interface, so
  the controller takes its generic path, reproduced here line for line
  (``HiCacheController._generic_page_set``: ``get_data_page`` of each page, ``batch_set``;
  ``_generic_page_get``: a dummy flat page per key, ``batch_get`` into them,
  ``set_from_flat_data_page`` of each).

Each round, with fresh keys, for each backend in turn (the order rotates): store N pages from
one half of the host pool (``set``), load them into the other half (``get``: the first load
after the store), load them again (``get again``); the first round checks the loaded pages
are byte-equal to the stored ones; then the round's pages are removed (``clear``, untimed).
Medians over the rounds; GB/s = 10^9 bytes of page payload per second.

Usage (root; a built marud; SGLang installed, e.g. python/ci.sh's SGLang environment)::

    python python/bench/sglang_bench.py --marud target/release/marud
    python python/bench/sglang_bench.py --pages 8 --rounds 3     # quick
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
from typing import Any, Callable, Dict, List

HERE = Path(__file__).resolve().parent
REPO = HERE.parents[1]

_cache = tempfile.TemporaryDirectory(prefix="maru-bench-sglang-cache-")
os.environ.setdefault("SGLANG_CACHE_DIR", _cache.name)  # SGLang's compile caches, removed at exit

import torch  # noqa: E402
from sglang.srt.mem_cache.hicache_storage import HiCacheStorageConfig  # noqa: E402
from sglang.srt.mem_cache.memory_pool import MHATokenToKVPool  # noqa: E402
from sglang.srt.mem_cache.pool_host.mha import MHATokenToKVPoolHost  # noqa: E402
from sglang.srt.mem_cache.storage import StorageBackendFactory  # noqa: E402

from maru.testing import PrivateMarud  # noqa: E402

DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16}


def storage_config(extra: Dict[str, Any], layout: str) -> HiCacheStorageConfig:
    return HiCacheStorageConfig(
        tp_rank=0, tp_size=1, pp_rank=0, pp_size=1, attn_cp_rank=0, attn_cp_size=1, is_mla_model=False,
        enable_storage_metrics=False, is_page_first_layout=layout == "page_first",
        model_name="meta-llama/Meta-Llama-3-8B", extra_config=extra,
    )


def host_pool(args: argparse.Namespace) -> Any:
    """SGLang's host pool with room for 2 x pages pages (the device pool holds half)."""
    tokens = args.pages * args.page_size
    dev = MHATokenToKVPool(tokens, args.page_size, DTYPES[args.dtype], args.kv_heads, args.head_dim,
                           args.layers, "cpu", False, start_layer=0, end_layer=args.layers)
    host = MHATokenToKVPoolHost(dev.get_device_pool_infos()[0].buffer_info, 2.0, 0, args.page_size,
                                args.layout, pin_memory=False, device="cpu", device_capacity_tokens=dev.size,
                                start_layer=0, end_layer=args.layers)
    del dev
    g = torch.Generator().manual_seed(1)
    for i in range(host.kv_buffer.shape[0]):  # random bytes, filled a slice at a time
        part = host.kv_buffer[i]
        part.copy_(torch.randn(part.shape, generator=g).to(part.dtype))
    return host


def page_indices(first_page: int, pages: int, page_size: int) -> torch.Tensor:
    return torch.arange(first_page * page_size, (first_page + pages) * page_size, dtype=torch.int64)


def digests(host: Any, indices: torch.Tensor) -> List[str]:
    ps = host.page_size
    return [hashlib.sha256(host.get_data_page(int(indices[i]), flat=True).contiguous().view(torch.uint8).numpy()
                           .tobytes()).hexdigest() for i in range(0, len(indices), ps)]


class Case:
    def __init__(self, name: str, backend: Any, set_fn: Callable, get_fn: Callable) -> None:
        self.name, self.backend, self.set_fn, self.get_fn = name, backend, set_fn, get_fn
        self.set_s: List[float] = []
        self.get_s: List[float] = []
        self.again_s: List[float] = []


def file_set(backend: Any, host: Any, keys: List[str], host_indices: torch.Tensor) -> bool:
    """HiCacheController._generic_page_set."""
    data = [host.get_data_page(host_indices[i * host.page_size]) for i in range(len(keys))]
    return backend.batch_set(keys, data)


def file_get(backend: Any, host: Any, keys: List[str], host_indices: torch.Tensor) -> int:
    """HiCacheController._generic_page_get (without its logging): pages loaded."""
    dummy_page_dst = [host.get_dummy_flat_data_page() for _ in keys]
    page_data = backend.batch_get(keys, dummy_page_dst)
    count = 0
    for i in range(len(keys)):
        if page_data[i] is None:
            break
        host.set_from_flat_data_page(host_indices[i * host.page_size], page_data[i])
        count += 1
    return count


def maru_set(backend: Any, host: Any, keys: List[str], host_indices: torch.Tensor) -> bool:
    """HiCacheController._page_set_zero_copy."""
    return all(backend.batch_set_v1(keys, host_indices))


def maru_get(backend: Any, host: Any, keys: List[str], host_indices: torch.Tensor) -> int:
    """HiCacheController._page_get_zero_copy (without its logging): pages loaded."""
    results = backend.batch_get_v1(keys, host_indices)
    return next((i for i, ok in enumerate(results) if not ok), len(results))


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--marud", default=os.environ.get("MARUD"), help="marud binary (default: $MARUD, target/release, target/debug)")
    ap.add_argument("--pages", type=int, default=64, help="pages per call (default 64)")
    ap.add_argument("--rounds", type=int, default=7, help="timed rounds (default 7)")
    ap.add_argument("--page-size", type=int, default=64, help="tokens per page (default 64)")
    ap.add_argument("--layers", type=int, default=32)
    ap.add_argument("--kv-heads", type=int, default=8)
    ap.add_argument("--head-dim", type=int, default=128)
    ap.add_argument("--dtype", choices=sorted(DTYPES), default="bf16")
    ap.add_argument("--layout", choices=("page_first", "page_first_direct"), default="page_first")
    ap.add_argument("--file-dir", default="/dev/shm", help="the tmpfs the file backend writes under (default /dev/shm)")
    args = ap.parse_args()

    binary = args.marud
    if not binary:
        binary = next((str(REPO / "target" / p / "marud") for p in ("release", "debug")
                       if (REPO / "target" / p / "marud").exists()), None)
    if not binary or not Path(binary).exists():
        print("no marud: build it (cargo build --release) or pass --marud", file=sys.stderr)
        return 2

    host = host_pool(args)
    page_bytes = host.get_data_page(0, flat=False).numel() * host.kv_buffer.element_size()
    total = page_bytes * args.pages
    src = page_indices(0, args.pages, args.page_size)
    dst = page_indices(args.pages, args.pages, args.page_size)
    pool = f"{max(1, (total * 2) >> 30) + 1}G"
    file_dir = tempfile.mkdtemp(prefix="maru-bench-hicache-", dir=args.file_dir)
    print(f"# {platform.node()}: {os.cpu_count()} CPUs, torch {torch.__version__} ({torch.get_num_threads()} threads), "
          f"marud {binary}")
    print(f"# {args.pages} pages of {args.page_size} tokens ({page_bytes / 2**20:.1f} MiB each, "
          f"{total / 2**20:.0f} MiB a call), {args.layers} layers x {args.kv_heads} KV heads x {args.head_dim} "
          f"x {args.dtype}, layout {args.layout}; {args.rounds} rounds; file backend in {file_dir}")
    try:
        with PrivateMarud(binary, pool_size=pool) as d:
            dyn = {"backend_name": "maru", "module_path": "maru_sglang", "class_name": "MaruStorage",
                   "interface_v1": 1, "maru_server_url": f"unix://{d.socket}", "maru_namespace": "bench",
                   "maru_pool_size": "64M"}
            maru = StorageBackendFactory.create_backend("dynamic", storage_config(dyn, args.layout), host)
            maru.register_mem_pool_host(host)
            fileb = StorageBackendFactory.create_backend(
                "file", storage_config({"file_storage_path": file_dir}, args.layout), host)
            fileb.register_mem_pool_host(host)
            cases = [Case("maru (batch_set_v1 / batch_get_v1)", maru, maru_set, maru_get),
                     Case("file on tmpfs (generic path: batch_set / batch_get)", fileb, file_set, file_get)]
            want = digests(host, src)
            for r in range(args.rounds):
                keys = [hashlib.sha256(f"round {r} page {i}".encode()).hexdigest() for i in range(args.pages)]
                order = cases if r % 2 == 0 else cases[::-1]
                for c in order:
                    if r == 0:  # what the check below reads was loaded, not left over
                        for i in range(0, len(dst), args.page_size):
                            host.get_data_page(int(dst[i]), flat=False).zero_()
                    t0 = time.perf_counter()
                    ok = c.set_fn(c.backend, host, keys, src)
                    t1 = time.perf_counter()
                    n = c.get_fn(c.backend, host, keys, dst)
                    t2 = time.perf_counter()
                    again = c.get_fn(c.backend, host, keys, dst)
                    t3 = time.perf_counter()
                    if not ok or n != args.pages or again != args.pages:
                        raise SystemExit(f"{c.name}: stored {ok}, loaded {n} then {again} of {args.pages} pages")
                    if r == 0 and digests(host, dst) != want:
                        raise SystemExit(f"{c.name}: the loaded pages differ from the stored ones")
                    c.set_s.append(t1 - t0)
                    c.get_s.append(t2 - t1)
                    c.again_s.append(t3 - t2)
                    c.backend.clear()
            maru.close()
    finally:
        shutil.rmtree(file_dir, ignore_errors=True)

    def cell(xs: List[float]) -> str:
        m = statistics.median(xs)
        return f"{m * 1e3:.1f} ({total / m / 1e9:.2f})"

    print()
    print(f"| backend | set {args.pages} pages, ms (GB/s) | get {args.pages} pages, ms (GB/s) | get again, ms (GB/s) |")
    print("|---|---|---|---|")
    for c in cases:
        print(f"| {c.name} | {cell(c.set_s)} | {cell(c.get_s)} | {cell(c.again_s)} |")
    m, f = cases
    print()
    print(f"maru / file, medians: get {statistics.median(f.get_s) / statistics.median(m.get_s):.1f}x, "
          f"get again {statistics.median(f.again_s) / statistics.median(m.again_s):.1f}x, "
          f"set {statistics.median(f.set_s) / statistics.median(m.set_s):.1f}x")
    return 0


if __name__ == "__main__":
    sys.exit(main())
