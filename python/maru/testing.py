"""A private marud for tests and benchmarks.

:class:`PrivateMarud` starts ``marud`` on a tmpfs pool and a FUSE mount of its
own, under a temporary directory, and tears everything down again (SIGTERM,
which unmounts; a lazy unmount of anything left; the directory removed)::

    with PrivateMarud("/path/to/marud", pool_size="1G") as d:
        h = MaruHandler(MaruConfig(mount_path=str(d.mount), namespace="t"))

Needs root and ``/dev/fuse`` (marud mounts tmpfs and FUSE).
"""

from __future__ import annotations

import os
import shutil
import signal
import subprocess
import tempfile
import time
from pathlib import Path
from typing import Any, List, Mapping, Optional, Sequence, Union

from .config import MaruConfig


class MarudStartError(RuntimeError):
    """marud exited or did not serve its mount in time; the message has its log's tail."""


def is_mounted(path: Union[str, Path]) -> bool:
    """Whether ``path`` is a mount point (per /proc/mounts)."""
    target = os.path.abspath(path)
    with open("/proc/mounts") as f:
        for line in f:
            fields = line.split()
            if len(fields) > 1 and fields[1] == target:
                return True
    return False


class PrivateMarud:
    """A marud serving a private pool at a private mount.

    The pool is a tmpfs (``pool_kind="memfs"``) or a raw pool in a file (``pool_kind="file"``,
    the stand-in for a CXL device: in memory, a directory of its own in ``/dev/shm`` where the
    host has one, as a device's pages are not a disk's page cache).

    Attributes:
        root: the temporary directory holding everything (but a file pool's file).
        mount: the FUSE mount (``root/mnt``).
        pool: the pool's tmpfs (``root/pool``) or file (``pool.img``).
        socket: the control socket.
        log: marud's log file.
        proc: the daemon process (only this object signals it).
        env: marud's environment (None: this process's).
    """

    def __init__(
        self,
        binary: Union[str, Path],
        pool_size: str = "1G",
        root: Optional[Union[str, Path]] = None,
        extra_args: Sequence[str] = (),
        start_timeout: float = 30.0,
        pool_kind: str = "memfs",
        env: Optional[Mapping[str, str]] = None,
    ) -> None:
        if pool_kind not in ("memfs", "file"):
            raise ValueError(f"pool_kind must be 'memfs' or 'file', not {pool_kind!r}")
        self.binary = Path(binary)
        self.pool_size = pool_size
        self.pool_kind = pool_kind
        self.root = Path(root) if root is not None else Path(tempfile.mkdtemp(prefix="maru-"))
        self.mount = self.root / "mnt"
        self._pool_dir: Optional[Path] = None
        if pool_kind == "file" and Path("/dev/shm").is_dir():
            self._pool_dir = Path(tempfile.mkdtemp(prefix="maru-pool-", dir="/dev/shm"))
        self.pool = (self._pool_dir or self.root) / ("pool" if pool_kind == "memfs" else "pool.img")
        self.socket = self.root / "marud.sock"
        self.state = self.root / "state"
        self.pid_file = self.root / "pid"
        self.log = self.root / "marud.log"
        self.extra_args: List[str] = list(extra_args)
        self.start_timeout = start_timeout
        self.env = dict(env) if env is not None else None
        self.proc: "Optional[subprocess.Popen[bytes]]" = None

    def start(self) -> "PrivateMarud":
        """Start marud and wait until the mount is served.

        Raises:
            FileNotFoundError: no marud binary at ``binary``.
            MarudStartError: marud exited, or did not mount in time (it is
                stopped and cleaned up first).
        """
        if not self.binary.exists():
            raise FileNotFoundError(f"marud not found at {self.binary}")
        self.mount.mkdir(parents=True, exist_ok=True)
        args = [
            str(self.binary),
            "--pool", f"{self.pool_kind}:{self.pool},size={self.pool_size}",
            "--mount", str(self.mount),
            "--socket", str(self.socket),
            "--state-dir", str(self.state),
            "--pid-file", str(self.pid_file),
            "--unmount-pools",
            "--eviction", "lru",
            *self.extra_args,
        ]
        with open(self.log, "wb") as logf:
            self.proc = subprocess.Popen(args, stdout=logf, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
                                         env=self.env)
        deadline = time.monotonic() + self.start_timeout
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                tail = self.log_tail()
                self.stop()
                raise MarudStartError(f"marud exited with {self.proc.returncode} at start:\n{tail}")
            if self.pid_file.exists() and is_mounted(self.mount):
                return self
            time.sleep(0.02)
        tail = self.log_tail()
        self.stop()
        raise MarudStartError(f"marud did not serve {self.mount} within {self.start_timeout}s:\n{tail}")

    def stop(self) -> None:
        """SIGTERM marud (it unmounts), wait, unmount leftovers, remove the directory."""
        proc = self.proc
        if proc is not None and proc.poll() is None:
            proc.send_signal(signal.SIGTERM)
            try:
                proc.wait(timeout=20)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait(timeout=10)
        for path in (self.mount, self.pool):
            if is_mounted(path):
                subprocess.run(["umount", "-l", str(path)], check=False)
        shutil.rmtree(self.root, ignore_errors=True)
        if self._pool_dir is not None:
            shutil.rmtree(self._pool_dir, ignore_errors=True)

    def config(self, namespace: str, **kw: Any) -> MaruConfig:
        """A :class:`MaruConfig` for a namespace of this daemon (its socket and mount)."""
        kw.setdefault("pool_size", 1 << 20)
        return MaruConfig(socket_path=str(self.socket), mount_path=str(self.mount), namespace=namespace, **kw)

    def free_bytes(self) -> int:
        """Free bytes in the pool (``df``)."""
        st = os.statvfs(self.mount)
        return st.f_bavail * st.f_frsize

    def log_tail(self, lines: int = 40) -> str:
        """The last lines of marud's log."""
        try:
            return "\n".join(self.log.read_text(errors="replace").splitlines()[-lines:])
        except OSError:
            return "(no log)"

    def __enter__(self) -> "PrivateMarud":
        return self.start()

    def __exit__(self, *exc: Any) -> None:
        self.stop()
