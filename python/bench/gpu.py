"""KV between the pool and device memory, side by side in one run (issue 18's table).

    sudo python3 python/bench/gpu.py --marud target/release/marud [--pool memfs|file]
        [--total 2G] [--entry 32M] [--readers 8] [--device cuda|cpu] [--json out.json]

A private marud serves a pool (memfs: a tmpfs with 2 MiB pages; file: a raw pool in a file,
the stand-in for a CXL device). ``--total`` bytes of KV in entries of ``--entry`` bytes (2 GiB
in 32 MiB entries: 16K tokens of Llama-3.1-8B) are moved:

pool -> device
  - pinned host buffer -> device: the link's limit, measured in this run
  - maru ``batch_retrieve_into``, first time (registering the mappings), then kept
  - maru ``retrieve_into`` one entry at a time, kept
  - maru retrieve + plain copy from the unregistered (pageable) mapping
  - ``read()`` through the mount into a pinned buffer, then -> device (a file backend's way)
  - loopback TCP into a pinned buffer, then -> device (a network transfer's way)
  - N reader processes at once, each pulling all of it into its own device buffers
device -> pool
  - device -> pinned host buffer: the limit
  - maru ``batch_store_from`` into reserved (registered ahead) allocations, and one at a time
  - maru ``batch_store_from`` allocating and registering as it goes

Each figure is the best of --rounds rounds. With ``--device cpu`` (no GPU) the same paths run
against CPU tensors: the script is tested that way; its figures are only memcpy rates.
Registration costs (per registration and per GiB) are printed from the handler's registry.
"""

from __future__ import annotations

import argparse
import json
import multiprocessing as mp
import os
import socket
import sys
import threading
import time
import uuid
from typing import Any, Callable, Dict, List, Optional

os.environ.setdefault("MARU_PLUGINS", "none")

import torch  # noqa: E402

from maru import MaruConfig, MaruHandler  # noqa: E402
from maru.tensors import frombuffer  # noqa: E402
from maru.testing import PrivateMarud  # noqa: E402

GiB = 1 << 30

#: Targets of issue 18 (ratios measured in the same run).
TARGETS = {
    "pool->device vs the pinned limit": 0.9,
    "pool->device vs TCP": 15.0,
    "device->pool vs the pinned limit": 0.6,
    "readers' aggregate vs the pinned limit": 0.85,
}


def parse_size(s: str) -> int:
    units = {"K": 1 << 10, "M": 1 << 20, "G": 1 << 30}
    s = s.strip().upper().rstrip("B").rstrip("I")
    return int(float(s[:-1]) * units[s[-1]]) if s[-1] in units else int(s)


class Bench:
    def __init__(self, args: argparse.Namespace, daemon: PrivateMarud) -> None:
        self.args = args
        self.d = daemon
        self.dev = torch.device(args.device)
        self.cuda = self.dev.type == "cuda"
        self.entry = args.entry
        self.n = args.total // args.entry
        self.total = self.n * self.entry
        self.ns = f"gpu-{uuid.uuid4().hex[:8]}"
        self.rows: List[Dict[str, Any]] = []

    def config(self) -> MaruConfig:
        return self.d.config(self.ns, chunk_size_bytes=self.entry, pool_size=self.entry)

    def sync(self) -> None:
        if self.cuda:
            torch.cuda.synchronize(self.dev)

    def best(self, fn: Callable[[], Optional[float]], setup: Optional[Callable[[], None]] = None) -> float:
        """Best seconds of --rounds rounds (fn may time itself and return its seconds)."""
        best = float("inf")
        for _ in range(self.args.rounds):
            if setup is not None:
                setup()
            self.sync()
            t0 = time.perf_counter()
            own = fn()
            self.sync()
            t = own if own is not None else time.perf_counter() - t0
            best = min(best, t)
        return best

    def row(self, side: str, path: str, seconds: float, nbytes: Optional[int] = None) -> float:
        gbps = (nbytes or self.total) / seconds / 1e9
        self.rows.append({"side": side, "path": path, "ms": seconds * 1e3, "GB/s": gbps})
        print(f"  {path:<58} {seconds * 1e3:>9.1f} ms {gbps:>8.2f} GB/s", flush=True)
        return gbps

    def device_buffers(self) -> List[torch.Tensor]:
        return [torch.empty(self.entry, dtype=torch.uint8, device=self.dev) for _ in range(self.n)]

    def pinned(self) -> torch.Tensor:
        return torch.empty(self.entry, dtype=torch.uint8, pin_memory=self.cuda)


def stored_keys(b: Bench, h: MaruHandler, prefix: str) -> List[str]:
    """Store the KV once (device -> pool), so the readers have something to read."""
    keys = [f"{prefix}{i}" for i in range(b.n)]
    src = torch.randint(0, 255, (b.entry,), dtype=torch.uint8, device=b.dev)
    for k in keys:
        assert h.store_from(k, src), f"no room for {k}"
    return keys


def pool_to_device(b: Bench, h: MaruHandler, keys: List[str]) -> Dict[str, float]:
    out: Dict[str, float] = {}
    dsts = b.device_buffers()
    host = b.pinned()
    print(f"pool -> {b.dev} ({b.n} entries of {b.entry >> 20} MiB, {b.total / GiB:.2f} GiB)")

    def pinned_limit() -> None:
        for d in dsts:
            d.copy_(host, non_blocking=b.cuda)

    out["limit"] = b.row("retrieve", "pinned host buffer -> device (the limit)", b.best(pinned_limit))

    # First time: a fresh handler registers each mapping (memfs) or its pool (raw) as it goes.
    with MaruHandler(b.config()) as fresh:
        t0 = time.perf_counter()
        assert all(fresh.batch_retrieve_into(keys, dsts))
        b.sync()
        b.row("retrieve", "maru batch_retrieve_into, first (registering)", time.perf_counter() - t0)
        reg = fresh.get_stats()["maru"]["tensors"].get("registry", {})
    out["kept"] = b.row("retrieve", "maru batch_retrieve_into, registrations kept",
                        b.best(lambda: all(h.batch_retrieve_into(keys, dsts)) and None))

    def one_by_one() -> None:
        for k, d in zip(keys, dsts):
            h.retrieve_into(k, d)

    b.row("retrieve", "maru retrieve_into, one entry at a time, kept", b.best(one_by_one))

    def pageable() -> None:
        for k, d in zip(keys, dsts):
            info = h.retrieve(k)
            d.copy_(frombuffer(info.view))  # type: ignore[union-attr]

    b.row("retrieve", "maru retrieve + copy from the unregistered mapping", b.best(pageable))

    def via_read() -> None:
        view = host.numpy()
        for k, d in zip(keys, dsts):
            with open(h.path_of(k), "rb", buffering=0) as f:
                got = f.readinto(view)
                assert got == b.entry
            d.copy_(host, non_blocking=b.cuda)
            b.sync()  # the one pinned buffer is refilled next

    b.row("retrieve", "read() through the mount into pinned -> device", b.best(via_read))
    out["tcp"] = b.row("retrieve", "loopback TCP into pinned -> device", b.best(lambda: tcp_path(b, h, keys, dsts, host)))
    if reg:
        describe_registration(b, reg)
    return out


def tcp_path(b: Bench, h: MaruHandler, keys: List[str], dsts: List[torch.Tensor], host: torch.Tensor) -> float:
    """A sender thread writes every entry to a loopback socket; the receiver reads each into a
    pinned buffer and copies it to the device. Returns the receiver's seconds."""
    srv = socket.create_server(("127.0.0.1", 0))
    port = srv.getsockname()[1]
    infos = [h.retrieve(k) for k in keys]

    def send() -> None:
        conn, _ = srv.accept()
        with conn:
            for info in infos:
                conn.sendall(info.view)  # type: ignore[union-attr]

    t = threading.Thread(target=send, daemon=True)
    t.start()
    view = memoryview(host.numpy())
    with socket.create_connection(("127.0.0.1", port)) as c:
        c.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 8 << 20)
        t0 = time.perf_counter()
        for d in dsts:
            got = 0
            while got < b.entry:
                n = c.recv_into(view[got:], b.entry - got)
                if n == 0:
                    raise RuntimeError("sender closed early")
                got += n
            d.copy_(host, non_blocking=b.cuda)
            b.sync()
        elapsed = time.perf_counter() - t0
    t.join()
    srv.close()
    return elapsed


def describe_registration(b: Bench, reg: Dict[str, Any]) -> None:
    n = max(1, int(reg.get("registered", 0)))
    per = reg.get("register_s", 0.0) / n
    gib = reg.get("live_bytes", 0) / GiB
    print(f"  registration ({b.args.pool} pool): {reg.get('registered')} made, {per * 1e3:.2f} ms each, "
          f"{reg.get('register_s', 0.0) * 1e3:.1f} ms for {gib:.2f} GiB; failed {reg.get('failed')}")
    b.rows.append({"side": "registration", "pool": b.args.pool, **reg})


def device_to_pool(b: Bench, h: MaruHandler) -> Dict[str, float]:
    out: Dict[str, float] = {}
    print(f"{b.dev} -> pool")
    srcs = [torch.randint(0, 255, (b.entry,), dtype=torch.uint8, device=b.dev) for _ in range(b.n)]
    host = b.pinned()

    def pinned_limit() -> None:
        for s in srcs:
            host.copy_(s, non_blocking=b.cuda)

    out["limit"] = b.row("store", "device -> pinned host buffer (the limit)", b.best(pinned_limit))
    round_keys: List[List[str]] = []

    def fresh_keys() -> List[str]:
        keys = [f"st-{uuid.uuid4().hex[:8]}-{i}" for i in range(b.n)]
        round_keys.append(keys)
        return keys

    def clean() -> None:
        for keys in round_keys:
            h.batch_delete(keys)
        round_keys.clear()

    def reserved_batch() -> float:
        keys = fresh_keys()
        h.reserve(b.entry, b.n)  # registered ahead: not part of the store
        b.sync()
        t0 = time.perf_counter()
        assert all(h.batch_store_from(keys, srcs))
        return time.perf_counter() - t0

    out["reserved"] = b.row("store", "maru batch_store_from, reserved allocations", b.best(reserved_batch, clean))

    def reserved_single() -> float:
        keys = fresh_keys()
        h.reserve(b.entry, b.n)
        t0 = time.perf_counter()
        for k, s in zip(keys, srcs):
            assert h.store_from(k, s)
        return time.perf_counter() - t0

    b.row("store", "maru store_from one at a time, reserved", b.best(reserved_single, clean))
    before = dict(h.get_stats()["maru"]["tensors"].get("registry", {}))

    def cold() -> None:
        assert all(h.batch_store_from(fresh_keys(), srcs))

    b.row("store", "maru batch_store_from, allocating + registering", b.best(cold, clean))
    clean()
    after = h.get_stats()["maru"]["tensors"].get("registry", {})
    if after:
        made = after.get("registered", 0) - before.get("registered", 0)
        spent = after.get("register_s", 0.0) - before.get("register_s", 0.0)
        gone = after.get("unregister_s", 0.0) - before.get("unregister_s", 0.0)
        print(f"  allocations registered: {made}, {spent / max(made, 1) * 1e3:.2f} ms each "
              f"to register, {gone / max(made, 1) * 1e3:.2f} ms to unregister")
    return out


def reader(args: Dict[str, Any], keys: List[str], barrier: Any, results: Any) -> None:
    dev = torch.device(args["device"])
    with MaruHandler(MaruConfig(socket_path=args["socket"], mount_path=args["mount"],
                                namespace=args["ns"], pool_size=args["entry"],
                                chunk_size_bytes=args["entry"])) as h:
        dsts = [torch.empty(args["entry"], dtype=torch.uint8, device=dev) for _ in keys]
        assert all(h.batch_retrieve_into(keys, dsts))  # registers; not timed
        barrier.wait()
        t0 = time.perf_counter()
        assert all(h.batch_retrieve_into(keys, dsts))
        results.put((t0, time.perf_counter()))


def many_readers(b: Bench, keys: List[str]) -> float:
    ctx = mp.get_context("spawn")
    barrier = ctx.Barrier(b.args.readers)
    results = ctx.Queue()
    args = {"device": str(b.dev), "socket": str(b.d.socket), "mount": str(b.d.mount), "ns": b.ns,
            "entry": b.entry}
    procs = [ctx.Process(target=reader, args=(args, keys, barrier, results)) for _ in range(b.args.readers)]
    for p in procs:
        p.start()
    spans = [results.get(timeout=600) for _ in procs]
    for p in procs:
        p.join(timeout=60)
        if p.exitcode != 0:
            raise RuntimeError(f"a reader failed ({p.exitcode})")
    elapsed = max(e for _, e in spans) - min(s for s, _ in spans)
    print(f"{b.args.readers} reader processes at once")
    return b.row("readers", f"{b.args.readers} processes x batch_retrieve_into, aggregate", elapsed,
                 b.total * b.args.readers)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--marud", required=True)
    ap.add_argument("--pool", choices=["memfs", "file"], default="memfs")
    ap.add_argument("--total", type=parse_size, default=2 * GiB)
    ap.add_argument("--entry", type=parse_size, default=32 << 20)
    ap.add_argument("--readers", type=int, default=8)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    ap.add_argument("--json", help="write the figures here too")
    args = ap.parse_args()
    if args.total < args.entry:
        ap.error("--total must hold at least one --entry")
    pool_size = f"{(args.total * 3 + (256 << 20)) >> 20}M"
    print(f"device: {torch.cuda.get_device_name(0) if args.device.startswith('cuda') else 'cpu'}; "
          f"pool: {args.pool}, {pool_size}; torch {torch.__version__}", flush=True)
    with PrivateMarud(args.marud, pool_size=pool_size, pool_kind=args.pool) as d:
        b = Bench(args, d)
        with MaruHandler(b.config()) as h:
            keys = stored_keys(b, h, "kv")
            up = pool_to_device(b, h, keys)
            agg = many_readers(b, keys) if args.readers > 0 else None
            down = device_to_pool(b, h)
            h.batch_delete(keys)
    ratios = {
        "pool->device vs the pinned limit": up["kept"] / up["limit"],
        "pool->device vs TCP": up["kept"] / up["tcp"],
        "device->pool vs the pinned limit": down["reserved"] / down["limit"],
    }
    if agg is not None:
        ratios["readers' aggregate vs the pinned limit"] = agg / up["limit"]
    print("targets (issue 18)")
    for name, r in ratios.items():
        mark = "ok" if r >= TARGETS[name] else "SHORT"
        print(f"  {name:<44} {r:>7.2f}x  (target >= {TARGETS[name]}x) {mark}")
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"args": {k: v for k, v in vars(args).items()}, "rows": b.rows, "ratios": ratios}, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
