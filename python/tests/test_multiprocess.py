"""Two (or more) processes sharing entries through the mount."""

from __future__ import annotations

import hashlib
import os
import json
import subprocess
import sys
import textwrap
import time
from pathlib import Path
from typing import List

import maru
from conftest import Marud, child_env
from pagemap import pfn_of

SIZE = 2 << 20


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


CHILD_STORE = """
    import hashlib, sys, maru
    mount, ns, key, seed, size = sys.argv[1], sys.argv[2], sys.argv[3], sys.argv[4], int(sys.argv[5])
    block = hashlib.sha256(seed.encode()).digest() * 128
    data = (block * (size // len(block) + 1))[:size]
    with maru.MaruHandler(maru.MaruConfig(mount_path=mount, namespace=ns)) as h:
        a = h.alloc(size)
        a.buf[:] = data
        print(h.store(key, a))
"""

CHILD_RETRIEVE = """
    import hashlib, json, sys, maru
    sys.path.insert(0, sys.argv[4])
    from pagemap import pfn_of
    mount, ns, key = sys.argv[1], sys.argv[2], sys.argv[3]
    with maru.MaruHandler(maru.MaruConfig(mount_path=mount, namespace=ns)) as h:
        with h.retrieve(key) as info:
            print(json.dumps({
                "sha256": hashlib.sha256(info.view).hexdigest(),
                "pfns": [pfn_of(info.view, off) for off in (0, info.size - 1)],
            }))
"""


def test_an_entry_stored_by_one_process_is_retrieved_by_another(marud: Marud, handler: maru.MaruHandler) -> None:
    ns = handler.config.namespace
    assert run_child(CHILD_STORE, str(marud.mount), ns, "from-child", "7", str(SIZE)).strip() == "True"
    with handler.retrieve("from-child") as info:  # type: ignore[union-attr]
        assert info.view.tobytes() == pattern(7)


def test_two_processes_map_the_same_physical_pages(marud: Marud, handler: maru.MaruHandler) -> None:
    a = handler.alloc(SIZE)
    a.buf[:] = pattern(8)
    assert handler.store("shared", a)
    tests_dir = str(Path(__file__).resolve().parent)
    with handler.retrieve("shared") as info:  # type: ignore[union-attr]
        mine = [pfn_of(info.view, 0), pfn_of(info.view, info.size - 1)]
        child = json.loads(run_child(CHILD_RETRIEVE, str(marud.mount), handler.config.namespace, "shared", tests_dir))
    assert child["sha256"] == hashlib.sha256(pattern(8)).hexdigest()
    assert child["pfns"] == mine, "the two processes do not map the same pages"


def test_concurrent_writers_of_one_key_first_wins(marud: Marud, handler: maru.MaruHandler) -> None:
    ns = handler.config.namespace
    go = marud.root / f"go-{ns}"
    racer = """
        import hashlib, os, sys, time, maru
        mount, ns, go, seed, size = sys.argv[1], sys.argv[2], sys.argv[3], sys.argv[4], int(sys.argv[5])
        block = hashlib.sha256(seed.encode()).digest() * 128
        data = (block * (size // len(block) + 1))[:size]
        with maru.MaruHandler(maru.MaruConfig(mount_path=mount, namespace=ns)) as h:
            a = h.alloc(size)
            a.buf[:] = data
            while not os.path.exists(go):
                time.sleep(0.001)
            print(seed, h.store("raced", a))
    """
    procs: List[subprocess.Popen] = [
        subprocess.Popen(
            [sys.executable, "-c", textwrap.dedent(racer), str(marud.mount), ns, str(go), str(seed), str(SIZE)],
            env=child_env(), stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
        )
        for seed in range(4)
    ]
    time.sleep(0.3)
    go.touch()
    winners = []
    for p in procs:
        out, err = p.communicate(timeout=60)
        assert p.returncode == 0, err
        seed, stored = out.split()
        if stored == "True":
            winners.append(int(seed))
    go.unlink()
    assert len(winners) == 1, f"write-once broken: {winners} all stored"
    with handler.retrieve("raced") as info:  # type: ignore[union-attr]
        assert info.view.tobytes() == pattern(winners[0])
    assert list(handler.list_keys()) == ["raced"]  # the losers left no temporary entries


def test_a_writer_that_exits_without_storing_publishes_nothing(marud: Marud, handler: maru.MaruHandler) -> None:
    ns = handler.config.namespace
    run_child(
        """
        import sys, maru
        h = maru.MaruHandler(maru.MaruConfig(mount_path=sys.argv[1], namespace=sys.argv[2]))
        a = h.alloc(1 << 20)
        a.buf[:4] = b"lost"
        # exits without store(), free() or close()
        """,
        str(marud.mount), ns,
    )
    killed = subprocess.Popen(
        [sys.executable, "-c", textwrap.dedent(
            """
            import os, signal, sys, maru
            h = maru.MaruHandler(maru.MaruConfig(mount_path=sys.argv[1], namespace=sys.argv[2]))
            a = h.alloc(1 << 20)
            a.buf[:4] = b"dead"
            os.kill(os.getpid(), signal.SIGKILL)
            """), str(marud.mount), ns],
        env=child_env(),
    )
    assert killed.wait(timeout=60) == -9
    deadline = time.monotonic() + 10  # the kernel releases the dead writer's file asynchronously
    while handler.get_stats()["namespace_usage"]["entries"] and time.monotonic() < deadline:
        time.sleep(0.01)
    assert handler.get_stats()["namespace_usage"] == {"entries": 0, "bytes": 0}
    assert os.listdir(marud.mount / ns) == []
