"""The Python door side by side: the native MaruHandler, by-path access through the mount,
and the original design's client (its figures from ../shared/REFERENCE.md, measured on this
machine kind), in one run against a private marud.

    sudo python3 python/bench/handler_bench.py --marud target/release/marud [--seconds 1]

Each figure is the best of three rounds of about --seconds each. Cold figures (first-time
retrieves) use keys this handler never looked at. Targets (issue 16) are printed beside them.
"""

from __future__ import annotations

import argparse
import mmap
import os
import sys
import time
from typing import Callable, List

from maru import MaruHandler
from maru.testing import PrivateMarud

#: The original design's client on this machine kind (REFERENCE.md), operations per second.
ORIGINAL = {"exists": 9_200, "retrieve": 7_900, "store 4 KiB": 3_900, "batch_retrieve(64) keys": 77_000}


def rate(fn: Callable[[], int], seconds: float) -> float:
    """Best of three rounds: units done per second (fn returns the units it did)."""
    best = 0.0
    for _ in range(3):
        n, t0 = 0, time.perf_counter()
        while True:
            n += fn()
            dt = time.perf_counter() - t0
            if dt >= seconds / 3:
                break
        best = max(best, n / dt)
    return best


def fmt(x: float) -> str:
    return f"{x:>14,.0f}"


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--marud", default=os.environ.get("MARUD", "target/release/marud"))
    ap.add_argument("--seconds", type=float, default=1.5)
    ap.add_argument("--pool-size", default="4G")
    args = ap.parse_args()
    rows: List[tuple] = []
    with PrivateMarud(args.marud, pool_size=args.pool_size) as d:
        cfg = d.config("bench", pool_size=64 << 20, chunk_size_bytes=64 << 20)
        with MaruHandler(cfg) as h:
            h.put("hot", b"x" * 4096)
            rows.append(("exists", rate(lambda: (h.exists("hot"), 1)[1], args.seconds), None, 1_000_000))
            path = h.path_of("hot")
            rows[-1] = rows[-1][:2] + (rate(lambda: (os.path.exists(path), 1)[1], args.seconds),) + rows[-1][3:]

            h.retrieve("hot")

            def by_path_retrieve() -> int:
                with open(path, "rb") as f:
                    m = mmap.mmap(f.fileno(), 0, prot=mmap.PROT_READ)
                    memoryview(m).release()
                    m.close()
                return 1

            rows.append(("retrieve", rate(lambda: (h.retrieve("hot"), 1)[1], args.seconds),
                         rate(by_path_retrieve, args.seconds), 300_000))

            seq = iter(range(10**9))
            page = b"s" * 4096

            def store() -> int:
                a = h.alloc(4096)
                a.buf[:] = page
                h.store(f"s{next(seq)}", a)
                return 1

            def by_path_store() -> int:
                with open(os.path.join(os.path.dirname(path), f"p{next(seq)}"), "wb") as f:
                    f.write(page)
                return 1

            rows.append(("store 4 KiB", rate(store, args.seconds), rate(by_path_store, args.seconds), 30_000))

            keys = [f"b{i}" for i in range(64)]
            for k in keys:
                h.put(k, page)
            h.batch_retrieve(keys)
            rows.append(("batch_retrieve(64) keys", rate(lambda: len(h.batch_retrieve(keys)), args.seconds), None, 2_000_000))

            # Cold: keys this handler never retrieved (stored by it, so no mapping held).
            cold_sets = []
            for j in range(60):
                ks = [f"c{j}-{i}" for i in range(64)]
                for k in ks:
                    h.put(k, page)
                cold_sets.append(ks)
            it = iter(cold_sets)
            t0 = time.perf_counter()
            n = 0
            for ks in it:
                n += len(h.batch_retrieve(ks))
            rows.append(("first batch_retrieve(64) keys", n / (time.perf_counter() - t0), None, 200_000))

            # First retrieve of a 32 MiB entry against mapping its pool file directly.
            big = 32 << 20
            a = h.alloc(big)
            a.buf[:] = b"b" * big
            h.store("big", a)
            loc = os.getxattr(h.path_of("big"), "user.maru.location").decode()
            t0 = time.perf_counter()
            info = h.retrieve("big")
            _ = info.view[::4096].tobytes()
            t_maru = time.perf_counter() - t0
            with open(loc, "rb") as f:
                t0 = time.perf_counter()
                m = mmap.mmap(f.fileno(), 0, prot=mmap.PROT_READ, flags=mmap.MAP_SHARED | getattr(mmap, "MAP_POPULATE", 0))
                _ = memoryview(m)[::4096].tobytes()
                t_direct = time.perf_counter() - t0
            print(f"first retrieve of 32 MiB (touching every page): {t_maru * 1e3:.2f} ms; "
                  f"mapping the pool file directly: {t_direct * 1e3:.2f} ms; ratio {t_maru / t_direct:.2f} (target <= 1.5)")

    print(f"{'operation (per second)':32}{'MaruHandler':>14}{'by path':>14}{'original':>14}{'target':>14}{'x original':>12}")
    for name, native, by_path, target in rows:
        orig = ORIGINAL.get(name)
        print(f"{name:32}{fmt(native)}{fmt(by_path) if by_path else ' ' * 14}"
              f"{fmt(orig) if orig else ' ' * 14}{fmt(target)}"
              f"{(native / orig if orig else float('nan')):>12.1f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
