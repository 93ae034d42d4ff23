"""Fixtures: a private marud (tmpfs pool + FUSE mount) started for the test session.

The daemon binary comes from ``$MARUD`` (default: the repository's
``target/debug/marud``, else ``target/release/marud``). The tests need root
and ``/dev/fuse`` (marud mounts the pool's tmpfs and the FUSE file system, and
the zero-copy tests read ``/proc/self/pagemap``); they fail, not skip, when
either is missing. Everything is torn down on exit, on failure too: the
daemon gets SIGTERM (it unmounts), and any mount left behind is lazily
unmounted.
"""

from __future__ import annotations

import os
import shutil
import sys
import tempfile
import uuid
from pathlib import Path
from typing import Iterator

import pytest

REPO = Path(__file__).resolve().parents[2]
PACKAGE_ROOT = Path(__file__).resolve().parents[1]

# The tests use the installed package (pip install ./python); from a bare source tree,
# the tree's own.
try:
    import maru
except ImportError:
    sys.path.insert(0, str(PACKAGE_ROOT))
    import maru
from maru.testing import MarudStartError, PrivateMarud  # noqa: E402

# LMCache logs every backend it creates at INFO (here and in child processes).
os.environ.setdefault("LMCACHE_LOG_LEVEL", "WARNING")
# python/ci.sh installs the handler-plugin tests' plugins (tests/plugin_pkg), two of them
# failing on purpose: handlers load none unless a test asks (test_plugins.py sets its own).
os.environ.setdefault("MARU_PLUGINS", "none")


def marud_binary() -> Path:
    """The marud under test: ``$MARUD`` or the repository's build."""
    env = os.environ.get("MARUD")
    if env:
        return Path(env)
    for profile in ("debug", "release"):
        candidate = REPO / "target" / profile / "marud"
        if candidate.exists():
            return candidate
    return REPO / "target" / "debug" / "marud"


Marud = PrivateMarud


def start_marud(root: Path, pool_size: str = "1G", pool_kind: str = "memfs") -> PrivateMarud:
    """Start a private marud under ``root``; fail the test (with its log) if it cannot."""
    binary = marud_binary()
    if not binary.exists():
        pytest.fail(f"marud not found at {binary}: build it (cargo build) or set MARUD=/path/to/marud")
    try:
        return PrivateMarud(binary, pool_size=pool_size, root=root, pool_kind=pool_kind).start()
    except MarudStartError as e:
        pytest.fail(str(e))
        raise


def _require_privileges() -> None:
    if os.geteuid() != 0:
        pytest.fail("these tests need root: marud mounts tmpfs and FUSE, and pagemap PFNs need CAP_SYS_ADMIN")
    if not os.path.exists("/dev/fuse"):
        pytest.fail("/dev/fuse is missing: the tests mount FUSE for real")


@pytest.fixture(scope="session")
def marud() -> Iterator[Marud]:
    """A private marud with a 1 GiB tmpfs pool, for the whole session."""
    _require_privileges()
    root = Path(tempfile.mkdtemp(prefix="maru-pytest-"))
    d = start_marud(root)
    try:
        yield d
    finally:
        d.stop()


@pytest.fixture(scope="session")
def raw_marud() -> Iterator[Marud]:
    """A private marud on a 256 MiB raw pool in a file (the stand-in for a CXL device)."""
    _require_privileges()
    root = Path(tempfile.mkdtemp(prefix="maru-pytest-raw-"))
    d = start_marud(root, pool_size="256M", pool_kind="file")
    try:
        yield d
    finally:
        d.stop()


@pytest.fixture
def raw_handler(raw_marud: Marud) -> Iterator[maru.MaruHandler]:
    """A connected MaruHandler on a fresh namespace of the raw-pool marud."""
    h = maru.MaruHandler(raw_marud.config(f"raw-{uuid.uuid4().hex[:12]}"))
    assert h.connect(), f"cannot connect to the test marud:\n{raw_marud.log_tail()}"
    try:
        yield h
    finally:
        h.close()


@pytest.fixture
def small_marud() -> Iterator[Marud]:
    """A private marud with a 64 MiB pool, for tests that fill it."""
    _require_privileges()
    root = Path(tempfile.mkdtemp(prefix="maru-pytest-small-"))
    d = start_marud(root, pool_size="64M")
    try:
        yield d
    finally:
        d.stop()


@pytest.fixture
def namespace(marud: Marud) -> Iterator[str]:
    """A fresh namespace name; its entries are removed after the test."""
    name = f"t-{uuid.uuid4().hex[:12]}"
    yield name
    shutil.rmtree(marud.mount / name, ignore_errors=True)


@pytest.fixture
def handler(marud: Marud, namespace: str) -> Iterator[maru.MaruHandler]:
    """A connected MaruHandler on a fresh namespace of the session's marud."""
    h = maru.MaruHandler(marud.config(namespace))
    assert h.connect(), f"cannot connect to the test marud:\n{marud.log_tail()}"
    try:
        yield h
    finally:
        h.close()


@pytest.fixture(scope="session", autouse=True)
def _libraries_scratch() -> Iterator[None]:
    """LMCache keeps every process's Prometheus files in /tmp/lmcache_prometheus unless told
    otherwise: the tests' (and their children's) go to a directory removed at the end."""
    with tempfile.TemporaryDirectory(prefix="maru-tests-prometheus-") as d:
        old = os.environ.get("PROMETHEUS_MULTIPROC_DIR")
        os.environ["PROMETHEUS_MULTIPROC_DIR"] = d
        try:
            yield
        finally:
            if old is None:
                os.environ.pop("PROMETHEUS_MULTIPROC_DIR", None)
            else:
                os.environ["PROMETHEUS_MULTIPROC_DIR"] = old


def child_env() -> dict:
    """Environment for child Python processes: they import the same ``maru`` as the tests."""
    env = dict(os.environ)
    where = str(Path(maru.__file__).resolve().parents[1])
    env["PYTHONPATH"] = os.pathsep.join(p for p in (where, env.get("PYTHONPATH", "")) if p)
    return env
