"""The YAML configurations in doc/LMCACHE.md load in LMCache and work on a live mount."""

from __future__ import annotations

import re
import time
from pathlib import Path
from typing import List

import pytest

pytest.importorskip("torch")
pytest.importorskip("lmcache")
pytest.importorskip("yaml")

import torch  # noqa: E402
from lmcache.v1.config import LMCacheEngineConfig  # noqa: E402

import lmcache_util as lu  # noqa: E402
from conftest import REPO, Marud  # noqa: E402

DOC = REPO / "doc" / "LMCACHE.md"


def yaml_blocks() -> List[str]:
    if not DOC.exists():
        return []
    return re.findall(r"```yaml\n(.*?)```", DOC.read_text(), flags=re.S)


@pytest.mark.parametrize("block", yaml_blocks(), ids=lambda b: b.splitlines()[0].lstrip("# "))
def test_documented_yaml_works(
    block: str, marud: Marud, namespace: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    # Point the documented config at the test's private daemon, mount and namespace.
    monkeypatch.setenv("MARU_NAMESPACE", namespace)
    text = block.replace("file:///maru/lmcache-disk/", f"file://{marud.mount}/{namespace}/")
    text = text.replace('maru_path: "maru://localhost:5555"', f'maru_path: "unix://{marud.socket}"')
    text = re.sub(r"maru_pool_size: \S+", "maru_pool_size: 0.05", text)
    text = text.replace("maru.socket: /run/maru/marud.sock\n", f"maru.socket: {marud.socket}\n")
    text = re.sub(r"maru\.namespace: \S+", f"maru.namespace: {namespace}", text)
    path = tmp_path / "lmcache.yaml"
    path.write_text(text)
    config = LMCacheEngineConfig.from_file(str(path))
    if config.local_cpu:
        config.max_local_cpu_size = 0.05  # the documented sizes are for a real host
    if config.local_disk:
        config.max_local_disk_size = 0.1
    sm = lu.make_manager(config)
    try:
        name = "maru" if config.storage_plugins else "MaruBackend" if config.maru_path else "LocalDiskBackend"
        backend = sm.storage_backends[name]
        keys = lu.put_chunks(sm, [3])
        for _ in range(2000):
            if backend.contains(keys[0]) and not backend.exists_in_put_tasks(keys[0]):
                break
            time.sleep(0.005)
        assert (marud.mount / namespace).is_dir() and len(list((marud.mount / namespace).iterdir())) == 1
        obj = backend.get_blocking(keys[0])
        assert obj is not None and torch.equal(obj.tensor, lu.chunk_tensor(3))
        obj.ref_count_down()
    finally:
        sm.close()


def test_the_doc_has_every_config() -> None:
    blocks = yaml_blocks()
    assert len(blocks) == 3, "doc/LMCACHE.md should show the LocalDiskBackend, plugin and MaruBackend configs"
