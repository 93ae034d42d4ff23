"""Building LMCache's storage stack on CPU, as LMCache's own tests do.

A ``StorageManager`` built from an ``LMCacheEngineConfig`` and an
``LMCacheMetadata`` creates the LocalCPUBackend, the LocalDiskBackend (when
``local_disk`` is set) and the storage plugins (``storage_plugins`` +
``extra_config``) exactly as an LMCache engine does. Chunks are allocated from
its LocalCPUBackend and stored with ``batched_put``: LMCache's own write path.

The model shape is tiny (2 layers x 2 KV heads x 16 dims, bf16): a 256-token
chunk in the KV_2LTD format is [2, 2, 256, 32] bf16 = 64 KiB.
"""

from __future__ import annotations

import hashlib
import os
from typing import Any, Dict, List, Optional, Sequence, Tuple

import torch

from lmcache.utils import CacheEngineKey
from lmcache.v1.config import LMCacheEngineConfig
from lmcache.v1.event_manager import EventManager
from lmcache.v1.memory_management import MemoryFormat, MemoryObj
from lmcache.v1.metadata import LMCacheMetadata
from lmcache.v1.storage_backend.storage_manager import StorageManager

MODEL = "test-org/tiny-llama"  # a '/' in the model name, as in real ones
LAYERS, HEADS, HEAD_DIM, CHUNK_TOKENS = 2, 2, 16, 256
DTYPE = torch.bfloat16
CHUNK_SHAPE = torch.Size([2, LAYERS, CHUNK_TOKENS, HEADS * HEAD_DIM])  # KV_2LTD
CHUNK_BYTES = CHUNK_SHAPE.numel() * DTYPE.itemsize  # 64 KiB

PLUGIN_EXTRA = {
    "storage_plugin.maru.module_path": "maru.lmcache_plugin",
    "storage_plugin.maru.class_name": "MaruStoragePlugin",
}


def metadata() -> LMCacheMetadata:
    """LMCache metadata of the tiny model (worker 0 of 1)."""
    return LMCacheMetadata(
        model_name=MODEL,
        world_size=1,
        local_world_size=1,
        worker_id=0,
        local_worker_id=0,
        kv_dtype=DTYPE,
        kv_shape=(LAYERS, 2, CHUNK_TOKENS, HEADS, HEAD_DIM),
    )


def make_config(
    *,
    local_disk: Optional[str] = None,
    max_local_disk_gb: float = 0.0,
    plugin_socket: Optional[str] = None,
    plugin_namespace: str = "lmcache",
    extra: Optional[Dict[str, Any]] = None,
    max_local_cpu_gb: float = 0.05,
) -> LMCacheEngineConfig:
    """An LMCache config: LocalCPU staging, plus LocalDiskBackend and/or the maru plugin."""
    kwargs: Dict[str, Any] = dict(
        chunk_size=CHUNK_TOKENS,
        local_cpu=True,
        max_local_cpu_size=max_local_cpu_gb,
        lmcache_instance_id=f"test-{os.getpid()}",
    )
    if local_disk is not None:
        kwargs.update(local_disk=local_disk, max_local_disk_size=max_local_disk_gb)
    config = LMCacheEngineConfig.from_defaults(**kwargs)
    extra_config: Dict[str, Any] = dict(extra or {})
    if plugin_socket is not None:
        config.storage_plugins = ["maru"]
        extra_config.update(PLUGIN_EXTRA)
        extra_config.update({"maru.socket": plugin_socket, "maru.namespace": plugin_namespace})
    if extra_config:
        config.extra_config = extra_config
    return config


def make_manager(config: LMCacheEngineConfig) -> StorageManager:
    """A StorageManager (LMCache's storage layer) on CPU."""
    return StorageManager(config=config, metadata=metadata(), event_manager=EventManager())


def key(i: int) -> CacheEngineKey:
    """The key of chunk ``i`` of the tiny model."""
    chunk_hash = int.from_bytes(hashlib.sha256(f"chunk-{i}".encode()).digest()[:8], "little")
    return CacheEngineKey(MODEL, 1, 0, chunk_hash, DTYPE)


def chunk_tensor(i: int) -> torch.Tensor:
    """Deterministic contents of chunk ``i`` (the same in every process)."""
    g = torch.Generator().manual_seed(1000 + i)
    return torch.randn(CHUNK_SHAPE, generator=g, dtype=torch.float32).to(DTYPE)


def digest(t: torch.Tensor) -> str:
    """SHA-256 of a tensor's bytes."""
    return hashlib.sha256(t.contiguous().view(torch.uint8).numpy().tobytes()).hexdigest()


def put_chunks(sm: StorageManager, ids: Sequence[int]) -> List[CacheEngineKey]:
    """Allocate chunks from the LocalCPUBackend, fill them, ``batched_put`` them."""
    keys, objs = [], []
    for i in ids:
        obj = sm.allocate(CHUNK_SHAPE, DTYPE, fmt=MemoryFormat.KV_2LTD)
        assert obj is not None, "LocalCPUBackend is full"
        assert obj.tensor is not None
        obj.tensor.copy_(chunk_tensor(i))
        keys.append(key(i))
        objs.append(obj)
    sm.batched_put(keys, objs)
    return keys


def release(objs: Sequence[Optional[MemoryObj]]) -> None:
    """Drop the references a caller of get/batched_get holds."""
    for obj in objs:
        if obj is not None:
            obj.ref_count_down()


def chunk_of(obj: Optional[MemoryObj]) -> Tuple[torch.Size, torch.dtype, torch.Tensor]:
    """Shape, dtype and tensor of a retrieved chunk."""
    assert obj is not None
    t = obj.tensor
    assert t is not None
    return t.shape, t.dtype, t


def make_builtin_config(socket: str, *, local_cpu: bool = False, pool_gb: float = 0.05) -> LMCacheEngineConfig:
    """An LMCache config for its built-in MaruBackend (``maru_path``), as users write it:
    ``unix://SOCKET`` names the local marud (``maru://host:port`` on this host does too,
    with ``$MARU_SOCKET``). Without ``local_cpu`` (and with ``max_local_cpu_size: 0``, as the
    original's docs configure it) LMCache allocates its chunks in the pool."""
    kwargs: Dict[str, Any] = dict(
        chunk_size=CHUNK_TOKENS,
        local_cpu=local_cpu,
        max_local_cpu_size=0.05 if local_cpu else 0,
        lmcache_instance_id=f"test-{os.getpid()}",
        maru_path=f"unix://{socket}",
        maru_pool_size=pool_gb,
    )
    return LMCacheEngineConfig.from_defaults(**kwargs)


def wait_for_backend_puts(backend: Any, keys: Sequence[CacheEngineKey], timeout: float = 30.0) -> None:
    """Wait until a backend has no put task left for ``keys``."""
    import time

    deadline = time.monotonic() + timeout
    while any(backend.exists_in_put_tasks(k) for k in keys):
        if time.monotonic() > deadline:
            raise TimeoutError("puts still pending")
        time.sleep(0.01)


def run_child(backend: str, mode: str, socket: str, namespace: str, n: int) -> Any:
    """Runs lmcache_child.py (``backend`` ``plugin`` or ``builtin``, ``mode`` ``store`` or
    ``load``) in a process of its own; returns its RESULT."""
    import json
    import subprocess
    import sys
    from pathlib import Path

    from conftest import child_env

    tests = Path(__file__).resolve().parent
    env = child_env()
    env["PYTHONPATH"] = os.pathsep.join([str(tests), env["PYTHONPATH"]])
    out = subprocess.run(
        [sys.executable, str(tests / "lmcache_child.py"), backend, mode, socket, namespace, str(n)],
        env=env, capture_output=True, text=True, timeout=300,
    )
    assert out.returncode == 0, f"{mode} child failed:\n{out.stdout[-4000:]}\n{out.stderr[-4000:]}"
    lines = [line for line in out.stdout.splitlines() if line.startswith("RESULT ")]
    assert lines, f"no result from the {mode} child:\n{out.stdout[-4000:]}\n{out.stderr[-4000:]}"
    return json.loads(lines[-1][len("RESULT "):])
