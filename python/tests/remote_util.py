"""The remote tier's test fixtures: a memory node (a private marud with its remote door) and
GPU nodes (network namespaces joined to this host by veth pairs), for test_remote.py and the
vLLM connector's remote tests.

The memory node is this host's own namespace, so its mount is the tests' to read; each GPU
node is a namespace of its own whose processes reach the door through their veth, as a worker
on another machine does: ``UCX_TLS=tcp`` and ``UCX_NET_DEVICES`` set to the veth (UCX sees one
kernel otherwise and moves the bytes through shared memory).
"""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import time
from pathlib import Path
from typing import Any, Dict, List, Mapping, Optional

import pytest

import maru
from conftest import _require_privileges, marud_binary
from maru.testing import PrivateMarud, is_mounted

TOKEN = "a-token-for-the-python-tests"
MiB = 1 << 20
# Short enough for the tests, long enough for a 2-core machine under load.
TIMEOUT_MS = 2000
TRANSFER_S = 5.0
RETRY_S = 1.0
# UCX's environment for a process whose NIXL uses TCP on `devices`. Where rdma-core is
# installed, UCX's ib module crashes NIXL processes at exit: it is left out.
UCX_MODULES = "^ib"


def ucx_env(devices: str) -> Dict[str, str]:
    return {"UCX_TLS": "tcp", "UCX_NET_DEVICES": devices, "UCX_MODULES": UCX_MODULES}


def require_nixl() -> None:
    """Skip where NIXL does not load, unless MARU_REQUIRE_NIXL is set (CI): fail there."""
    _require_privileges()
    try:
        maru._native.nixl_library()
    except OSError as e:
        if os.environ.get("MARU_REQUIRE_NIXL"):
            pytest.fail(f"MARU_REQUIRE_NIXL is set and NIXL does not load: {e}")
        pytest.skip(str(e))


def free_port(host: str = "127.0.0.1") -> int:
    with socket.socket() as s:
        s.bind((host, 0))
        return s.getsockname()[1]


class MemoryNode:
    """A private marud on a 256 MiB file pool with its remote door on ``host``."""

    def __init__(self, root: Path, host: str = "127.0.0.1", env: Optional[Mapping[str, str]] = None) -> None:
        self.host = host
        self.port = free_port(host)
        self.url = f"tcp://{host}:{self.port}"
        tokens = root / "remote-tokens"
        tokens.write_text(f"# the tests\n{TOKEN} 0:0 pytest\n")
        tokens.chmod(0o600)
        self.marud = PrivateMarud(
            marud_binary(),
            pool_size="256M",
            root=root / "marud",
            pool_kind="file",
            extra_args=["--remote-bind", f"{host}:{self.port}", "--remote-tokens", str(tokens)],
            env=env,
        )

    def start(self) -> None:
        self.marud.start()
        deadline = time.monotonic() + 20
        while True:
            try:
                socket.create_connection((self.host, self.port), timeout=1).close()
                return
            except OSError:
                if time.monotonic() > deadline:
                    pytest.fail(f"the remote door did not open:\n{self.marud.log_tail()}")
                time.sleep(0.05)

    def kill(self) -> None:
        """kill -9: no clean shutdown; its mount is left to unmount, as after a crash."""
        proc = self.marud.proc
        assert proc is not None and proc.poll() is None, "marud is not running"
        proc.send_signal(signal.SIGKILL)
        proc.wait(timeout=20)
        if is_mounted(self.marud.mount):
            subprocess.run(["umount", "-l", str(self.marud.mount)], check=False)
        self.marud.pid_file.unlink(missing_ok=True)

    def config(self, namespace: str, **kw: Any) -> maru.MaruConfig:
        kw.setdefault("pool_size", 64 * MiB)
        kw.setdefault("chunk_size_bytes", 4 * MiB)
        kw.setdefault("timeout_ms", TIMEOUT_MS)
        kw.setdefault("remote_transfer_timeout_s", TRANSFER_S)
        kw.setdefault("remote_retry_s", RETRY_S)
        kw.setdefault("remote_token", TOKEN)
        kw.setdefault("remote_url", self.url)
        return maru.MaruConfig(storage_backend="remote", namespace=namespace, **kw)

    def local_handler(self, namespace: str) -> maru.MaruHandler:
        """A local client of the memory node's marud (its socket): what a process there sees."""
        h = maru.MaruHandler(self.marud.config(namespace))
        assert h.connect(), self.marud.log_tail()
        return h


class GpuNodes:
    """``count`` GPU nodes: network namespaces, each joined to this host by a veth pair
    (host side ``10.S.i.1/24``, node side ``10.S.i.2/24``, the host its default route, so
    every node reaches the host's addresses). Removed (with their veths) on exit, also when
    the setup fails half way."""

    def __init__(self, count: int) -> None:
        tag = os.getpid() % 100000
        subnet = 100 + os.getpid() % 100
        self.names = [f"maru-gpu{i}-{tag}" for i in range(1, count + 1)]
        self.host_veths = [f"mg{tag}h{i}" for i in range(1, count + 1)]
        self.node_veths = [f"mg{tag}n{i}" for i in range(1, count + 1)]
        self.host_addrs = [f"10.{subnet}.{i}.1" for i in range(1, count + 1)]
        self.node_addrs = [f"10.{subnet}.{i}.2" for i in range(1, count + 1)]
        self._made: List[str] = []

    def __enter__(self) -> "GpuNodes":
        try:
            for name, hv, nv, ha, na in zip(self.names, self.host_veths, self.node_veths, self.host_addrs,
                                            self.node_addrs):
                _ip("netns", "add", name)
                self._made.append(name)
                _ip("link", "add", hv, "type", "veth", "peer", "name", nv)
                _ip("link", "set", nv, "netns", name)
                _ip("addr", "add", f"{ha}/24", "dev", hv)
                _ip("link", "set", hv, "up")
                _ip("-n", name, "addr", "add", f"{na}/24", "dev", nv)
                _ip("-n", name, "link", "set", nv, "up")
                _ip("-n", name, "link", "set", "lo", "up")
                _ip("-n", name, "route", "add", "default", "via", ha)
        except BaseException:
            self.__exit__()
            raise
        return self

    def __exit__(self, *exc: Any) -> None:
        # Deleting a namespace deletes the veth end in it, and with it its peer here.
        for name in self._made:
            subprocess.run(["ip", "netns", "del", name], check=False)
        self._made.clear()

    @property
    def host_ucx_env(self) -> Dict[str, str]:
        """The memory node's UCX environment: TCP on its veth ends."""
        return ucx_env(",".join(self.host_veths))

    def node_ucx_env(self, i: int) -> Dict[str, str]:
        """GPU node ``i``'s (from 0) UCX environment: TCP on its veth."""
        return ucx_env(self.node_veths[i])

    def exec_prefix(self, i: int) -> List[str]:
        """A command prefix that runs a program on GPU node ``i`` (its namespace and a sysfs
        of its own, where UCX lists the network devices)."""
        return ["ip", "netns", "exec", self.names[i]]


def _ip(*args: str) -> None:
    out = subprocess.run(["ip", *args], stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    if out.returncode != 0:
        raise RuntimeError(f"ip {' '.join(args)}: {out.stdout.strip()}")
