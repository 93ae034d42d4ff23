"""Small memfs entries packed or in files of their own, side by side through the Python door.

    sudo python3 python/bench/pack_bench.py --marud target/release/marud [--rounds 12]

Two private marud run at once on memfs pools, one packing small entries (the default,
`pack=64K`) and one with `pack=0` (every entry a file of its own). Round by round, the same
loops run on one and then the other, so the machine's noise hits both alike: 500 stores of
4 KiB (`alloc` + write + `store`, each waiting for marud), 500 `put`s of 4 KiB, and 8
first-time `batch_retrieve(64)`s by a second handler (keys it never looked at). Medians of the
rounds are printed with their ratio. Handler plugins are off unless MARU_PLUGINS says
otherwise.
"""

from __future__ import annotations

import argparse
import os
import statistics
import time
from typing import Callable, Dict, List

os.environ.setdefault("MARU_PLUGINS", "none")

from maru import MaruHandler
from maru.testing import PrivateMarud

KINDS = {"packed": "4G", "files of their own": "4G,pack=0"}


def timed(n: int, fn: Callable[[int], None]) -> float:
    """Units per second of `fn(i)` for i in range(n)."""
    t0 = time.perf_counter()
    for i in range(n):
        fn(i)
    return n / (time.perf_counter() - t0)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--marud", default=os.environ.get("MARUD", "target/release/marud"))
    ap.add_argument("--rounds", type=int, default=12)
    args = ap.parse_args()
    page = b"s" * 4096
    daemons = {k: PrivateMarud(args.marud, pool_size=spec).start() for k, spec in KINDS.items()}
    try:
        cfg = {k: d.config("bench", pool_size=64 << 20, chunk_size_bytes=64 << 20) for k, d in daemons.items()}
        writers = {k: MaruHandler(c) for k, c in cfg.items()}
        for h in writers.values():
            h.connect()
        got: Dict[str, Dict[str, List[float]]] = {k: {"store": [], "put": [], "first": []} for k in KINDS}
        for r in range(args.rounds):
            for k, h in writers.items():
                def store(i: int) -> None:
                    a = h.alloc(4096)
                    a.buf[:] = page
                    h.store(f"s{r}-{i}", a)

                got[k]["store"].append(timed(500, store))
                got[k]["put"].append(timed(500, lambda i: h.put(f"p{r}-{i}", page)))
                sets = [[f"c{r}-{j}-{i}" for i in range(64)] for j in range(8)]
                for ks in sets:
                    for key in ks:
                        h.put(key, page)
                with MaruHandler(cfg[k]) as reader:
                    got[k]["first"].append(timed(len(sets), lambda j: reader.batch_retrieve(sets[j])) * 64)
        for h in writers.values():
            h.close()
    finally:
        for d in daemons.values():
            d.stop()
    rows = [("store 4 KiB (each waits)", "store"), ("put 4 KiB", "put"),
            ("first-time batch_retrieve(64), keys", "first")]
    names = list(KINDS)
    print(f"# Small memfs entries: {args.rounds} rounds, medians per second\n")
    print(f"| operation | {names[0]} | {names[1]} | ratio |")
    print("|---|---:|---:|---:|")
    for label, key in rows:
        a, b = (statistics.median(got[n][key]) for n in names)
        print(f"| {label} | {a:,.0f} | {b:,.0f} | {a / b:.2f}x |")


if __name__ == "__main__":
    main()
