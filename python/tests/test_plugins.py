"""Handler plugins (entry points in ``maru.handler_plugins``), with the test plugin of
``plugin_pkg`` (``python/ci.sh`` installs it): ``recorder`` logs every hook call, ``broken``
fails to build, ``faulty`` raises in every hook."""

from __future__ import annotations

import json
import subprocess
import sys
import textwrap
from importlib.metadata import entry_points
from pathlib import Path
from typing import Dict, List, Optional

import pytest

from conftest import Marud, child_env

PLUGIN_PKG = Path(__file__).resolve().parent / "plugin_pkg"

if not {"recorder", "broken", "faulty"} <= {ep.name for ep in entry_points(group="maru.handler_plugins")}:
    pytest.skip(
        "the test plugin is not installed: pip install --no-deps --no-build-isolation "
        f"{PLUGIN_PKG} (python/ci.sh does)",
        allow_module_level=True,
    )

CHILD = """
    import json, logging, sys, maru
    logging.basicConfig(level=logging.WARNING, stream=sys.stderr)
    sock, mount, ns = sys.argv[1:4]
    cfg = maru.MaruConfig(socket_path=sock, mount_path=mount, namespace=ns, pool_size=1 << 20)
    with maru.MaruHandler(cfg) as h:
        assert h.connected
        a = h.alloc(3)
        a.buf[:] = b"one"
        assert h.store("k1", a)
        assert h.put("k2", b"two")
        assert h.retrieve("k1").view.tobytes() == b"one"
        got = h.batch_retrieve(["k1", "missing", "k2"])
        assert [None if r is None else r.view.tobytes() for r in got] == [b"one", None, b"two"]
        assert h.batch_exists(["k1", "k2"]) == [True, True]
        print(json.dumps(h.get_stats()["plugins"]))
"""


def run(marud: Marud, namespace: str, tmp_path: Path, plugins: Optional[str]) -> Dict:
    log = tmp_path / "hooks.jsonl"
    env = child_env()
    env["MARU_TEST_PLUGIN_LOG"] = str(log)
    env.pop("MARU_PLUGINS", None)
    if plugins is not None:
        env["MARU_PLUGINS"] = plugins
    out = subprocess.run(
        [sys.executable, "-c", textwrap.dedent(CHILD), str(marud.socket), str(marud.mount), namespace],
        env=env, capture_output=True, text=True, timeout=60,
    )
    assert out.returncode == 0, f"{out.stdout}\n{out.stderr}"
    calls: List[Dict] = [json.loads(line) for line in log.read_text().splitlines()] if log.exists() else []
    return {"stats": json.loads(out.stdout.strip().splitlines()[-1]), "calls": calls, "stderr": out.stderr}


def test_recorder_sees_every_hook(marud: Marud, namespace: str, tmp_path: Path) -> None:
    r = run(marud, namespace, tmp_path, "recorder")
    assert r["stats"] == {"recorder": {"batch_retrieves": 1}}
    hooks = [c["hook"] for c in r["calls"]]
    assert hooks == ["on_init", "on_batch_retrieve", "contribute_stats", "on_close"]
    init, batch, _, close = r["calls"]
    assert init == {"hook": "on_init", "namespace": namespace, "connected": True}
    assert batch["keys"] == ["k1", "missing", "k2"]
    assert batch["results"] == ["one", None, "two"]
    assert close["hook"] == "on_close"
    assert r["stderr"] == ""  # nothing failed


def test_no_plugins(marud: Marud, namespace: str, tmp_path: Path) -> None:
    r = run(marud, namespace, tmp_path, "none")
    assert r["stats"] == {} and r["calls"] == []


def test_all_installed_plugins_when_unset(marud: Marud, namespace: str, tmp_path: Path) -> None:
    """Unset: every installed plugin; ``broken`` fails to build and ``faulty`` raises in
    every hook, and neither breaks the handler's own operations (the child checks them)."""
    r = run(marud, namespace, tmp_path, None)
    assert r["stats"]["recorder"] == {"batch_retrieves": 1}
    assert "broken" not in r["stats"]
    assert r["stats"]["faulty"] == {"error": "contribute_stats failed"}
    assert [c["hook"] for c in r["calls"]] == ["on_init", "on_batch_retrieve", "contribute_stats", "on_close"]
    assert "'broken' failed to load" in r["stderr"]
    for hook in ("on_init", "on_batch_retrieve", "on_close", "contribute_stats"):
        assert f"'faulty' failed in {hook}" in r["stderr"], hook


def test_broken_and_faulty_plugins_never_break_the_handler(marud: Marud, namespace: str, tmp_path: Path) -> None:
    r = run(marud, namespace, tmp_path, "broken,faulty,not-installed")
    assert r["calls"] == []
    assert r["stats"] == {"faulty": {"error": "contribute_stats failed"}}
    assert "'not-installed', which is not installed" in r["stderr"]
