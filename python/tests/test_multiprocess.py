"""Two (or more) processes sharing entries through one marud."""

from __future__ import annotations

import hashlib
import json
import os
import subprocess
import sys
import textwrap
import time
from pathlib import Path
from typing import List

import maru
from conftest import Marud, child_env
from pagemap import pfn_of

SIZE = 1 << 20  # chunk_size_bytes: the largest alloc


def pattern(seed: int, size: int = SIZE) -> bytes:
    block = hashlib.sha256(str(seed).encode()).digest() * 128  # 4 KiB
    return (block * (size // len(block) + 1))[:size]


def run_child(code: str, *args: str) -> str:
    """Run Python code in a new process; return its stdout (it must exit 0)."""
    out = subprocess.run(
        [sys.executable, "-c", textwrap.dedent(code), *args],
        env=child_env(), capture_output=True, text=True, timeout=60,
    )
    assert out.returncode == 0, f"child failed ({out.returncode}):\n{out.stdout}\n{out.stderr}"
    return out.stdout


# Every child gets: socket, mount, namespace, then its own arguments.
PRELUDE = """
    import hashlib, json, os, signal, sys, time, maru
    sock, mount, ns = sys.argv[1], sys.argv[2], sys.argv[3]
    cfg = maru.MaruConfig(socket_path=sock, mount_path=mount, namespace=ns, pool_size=1 << 20)
    def pattern(seed, size):
        block = hashlib.sha256(seed.encode()).digest() * 128
        return (block * (size // len(block) + 1))[:size]
"""

CHILD_STORE = """
    key, seed, size = sys.argv[4], sys.argv[5], int(sys.argv[6])
    with maru.MaruHandler(cfg) as h:
        a = h.alloc(size)
        a.buf[:] = pattern(seed, size)
        print(h.store(key, a))
"""

CHILD_RETRIEVE = """
    sys.path.insert(0, sys.argv[5])
    from pagemap import pfn_of
    with maru.MaruHandler(cfg) as h:
        info = h.retrieve(sys.argv[4])
        print(json.dumps({
            "sha256": hashlib.sha256(info.view).hexdigest(),
            "pfns": [pfn_of(info.view, off) for off in (0, len(info.view) - 1)],
        }))
"""


def script(body: str) -> str:
    return textwrap.dedent(PRELUDE) + textwrap.dedent(body)


def args(marud: Marud, h: maru.MaruHandler) -> List[str]:
    return [str(marud.socket), str(marud.mount), h.config.namespace]


def test_an_entry_stored_by_one_process_is_retrieved_by_another(marud: Marud, handler: maru.MaruHandler) -> None:
    assert run_child(script(CHILD_STORE), *args(marud, handler), "from-child", "7", str(SIZE)).strip() == "True"
    info = handler.retrieve("from-child")
    assert info is not None and info.view.tobytes() == pattern(7)


def test_two_processes_map_the_same_physical_pages(marud: Marud, handler: maru.MaruHandler) -> None:
    a = handler.alloc(SIZE)
    a.buf[:] = pattern(8)
    assert handler.store("shared", a)
    tests_dir = str(Path(__file__).resolve().parent)
    info = handler.retrieve("shared")
    assert info is not None
    mine = [pfn_of(info.view, 0), pfn_of(info.view, len(info.view) - 1)]
    child = json.loads(run_child(script(CHILD_RETRIEVE), *args(marud, handler), "shared", tests_dir))
    assert child["sha256"] == hashlib.sha256(pattern(8)).hexdigest()
    assert child["pfns"] == mine, "the two processes do not map the same pages"


def test_concurrent_writers_of_one_key_first_wins(marud: Marud, handler: maru.MaruHandler) -> None:
    """Every racer's store() returns True (the original's contract for an existing key), but
    exactly one racer's bytes are published and no loser leaves anything behind."""
    go = marud.root / f"go-{handler.config.namespace}"
    racer = """
        go, seed, size = sys.argv[4], sys.argv[5], int(sys.argv[6])
        with maru.MaruHandler(cfg) as h:
            a = h.alloc(size)
            a.buf[:] = pattern(seed, size)
            while not os.path.exists(go):
                time.sleep(0.001)
            print(seed, h.store("raced", a))
    """
    procs: List[subprocess.Popen] = [
        subprocess.Popen(
            [sys.executable, "-c", script(racer), *args(marud, handler), str(go), str(seed), str(SIZE)],
            env=child_env(), stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
        )
        for seed in range(4)
    ]
    time.sleep(0.5)
    go.touch()
    for p in procs:
        out, err = p.communicate(timeout=60)
        assert p.returncode == 0, err
        assert out.split()[1] == "True"
    go.unlink()
    info = handler.retrieve("raced")
    assert info is not None
    data = info.view.tobytes()
    winners = [seed for seed in range(4) if pattern(seed) == data]
    assert len(winners) == 1, "the entry is not one racer's bytes"
    assert list(handler.list_keys()) == [b"raced"]  # the losers left nothing
    assert os.listdir(marud.mount / handler.config.namespace) == ["raced"]


def test_a_writer_that_exits_without_storing_publishes_nothing(marud: Marud, handler: maru.MaruHandler) -> None:
    ns = handler.config.namespace
    baseline = handler.get_stats()["allocation_manager"]["active_clients"]
    run_child(
        script("""
        h = maru.MaruHandler(cfg)
        assert h.connect()
        a = h.alloc(1 << 20)
        a.buf[:4] = b"lost"
        # exits without store(), free() or close()
        """),
        *args(marud, handler),
    )
    killed = subprocess.Popen(
        [sys.executable, "-c", script("""
            h = maru.MaruHandler(cfg)
            assert h.connect()
            a = h.alloc(1 << 20)
            a.buf[:4] = b"dead"
            os.kill(os.getpid(), signal.SIGKILL)
            """), *args(marud, handler)],
        env=child_env(),
    )
    assert killed.wait(timeout=60) == -9
    me = handler.instance_id
    deadline = time.monotonic() + 10  # marud notices the dead connection asynchronously
    while time.monotonic() < deadline:
        clients = handler.get_stats()["allocation_manager"]
        if clients["active_clients"] == 1:
            break
        time.sleep(0.02)
    stats = handler.get_stats()
    assert stats["allocation_manager"]["active_clients"] == baseline, stats["allocation_manager"]
    assert stats["maru"]["this_client"]["name"] == me
    assert stats["allocation_manager"]["total_allocated"] == 0
    assert list(handler.list_keys()) == []
    assert os.listdir(marud.mount / ns) == []
