"""SGLang's own objects for the HiCache storage tests: its storage config, its host KV pools
(MHA and MLA, over a device pool on "cpu", nothing pinned), the backend made by its
``StorageBackendFactory``, and pages filled from a seed.

The geometry is small (pages of 4 tokens, 3 layers) so that a test moves many pages quickly;
the benchmark (python/bench/sglang_bench.py) uses an 8B model's.
"""

from __future__ import annotations

import hashlib
from typing import Any, Dict, List, Optional, Sequence

import torch
from sglang.srt.mem_cache.hicache_storage import HiCacheStorage, HiCacheStorageConfig
from sglang.srt.mem_cache.memory_pool import MHATokenToKVPool, MLATokenToKVPool
from sglang.srt.mem_cache.pool_host.mha import MHATokenToKVPoolHost
from sglang.srt.mem_cache.pool_host.mla import MLATokenToKVPoolHost
from sglang.srt.mem_cache.storage import StorageBackendFactory

PAGE = 4  # tokens per page
LAYERS = 3
DEVICE_TOKENS = 64  # the device pool; the host pool holds twice as many (host_to_device_ratio)

#: What SGLang's extra config carries to load maru (the test adds its socket and namespace).
DYNAMIC = {"backend_name": "maru", "module_path": "maru_sglang", "class_name": "MaruStorage", "interface_v1": 1}


def host_pool(kind: str, layout: str, page: int = PAGE, layers: int = LAYERS, heads: int = 2,
              head_dim: int = 8, dtype: torch.dtype = torch.float16, device_tokens: int = DEVICE_TOKENS) -> Any:
    """SGLang's host KV pool of ``kind`` ``mha`` (``heads`` x ``head_dim``) or ``mla``
    (a latent of 16 plus a rope part of 8, bf16), in ``layout``, on CPU."""
    if kind == "mha":
        dev = MHATokenToKVPool(device_tokens, page, dtype, heads, head_dim, layers, "cpu", False,
                               start_layer=0, end_layer=layers)
        return MHATokenToKVPoolHost(dev.get_device_pool_infos()[0].buffer_info, 2.0, 0, page, layout,
                                    pin_memory=False, device="cpu", device_capacity_tokens=dev.size,
                                    start_layer=dev.start_layer, end_layer=dev.end_layer)
    assert kind == "mla", kind
    dev = MLATokenToKVPool(device_tokens, page, torch.bfloat16, 16, 8, layers, "cpu", False,
                           start_layer=0, end_layer=layers)
    return MLATokenToKVPoolHost(dev.get_device_pool_infos()[0].buffer_info, 2.0, 0, page, layout,
                                pin_memory=False, device="cpu", device_capacity_tokens=dev.size,
                                start_layer=dev.start_layer, end_layer=dev.end_layer,
                                target_layer_num=dev.layer_num)


def storage_config(extra: Dict[str, Any], *, mla: bool = False, tp_rank: int = 0, tp_size: int = 1,
                   layout: str = "page_first", model: str = "test-org/tiny-model") -> HiCacheStorageConfig:
    """The HiCacheStorageConfig SGLang's cache controller would build for this rank."""
    return HiCacheStorageConfig(
        tp_rank=tp_rank, tp_size=tp_size, pp_rank=0, pp_size=1, attn_cp_rank=0, attn_cp_size=1,
        is_mla_model=mla, enable_storage_metrics=False, is_page_first_layout=layout == "page_first",
        model_name=model, extra_config=dict(extra),
    )


def maru_extra(socket: str, namespace: str, **more: Any) -> Dict[str, Any]:
    return DYNAMIC | {"maru_server_url": f"unix://{socket}", "maru_namespace": namespace} | more


def make_backend(extra: Dict[str, Any], host: Optional[Any], **config: Any) -> HiCacheStorage:
    """The backend as SGLang's controller makes it: the factory's ``dynamic`` backend, then the
    host pool registered."""
    cfg = storage_config(extra, layout=getattr(host, "layout", "page_first"), **config)
    backend = StorageBackendFactory.create_backend("dynamic", cfg, host)
    if host is not None:
        backend.register_mem_pool_host(host)
    return backend


def fill(host: Any, seed: int) -> None:
    """Fill the host pool with values drawn from ``seed``."""
    g = torch.Generator().manual_seed(seed)
    buf = host.kv_buffer
    buf.copy_(torch.randn(buf.shape, generator=g).to(buf.dtype))


def indices(pages: Sequence[int], page: int = PAGE) -> torch.Tensor:
    """The host indices of host-pool ``pages`` (their tokens, page after page)."""
    parts = [torch.arange(p * page, (p + 1) * page, dtype=torch.int64) for p in pages]
    return torch.cat(parts) if parts else torch.empty(0, dtype=torch.int64)


def page_digests(host: Any, pages: Sequence[int]) -> List[str]:
    """SHA-256 of each page's bytes, in the pool's own page layout."""
    out = []
    for p in pages:
        data = host.get_data_page(p * host.page_size, flat=True).contiguous().view(torch.uint8)
        out.append(hashlib.sha256(data.numpy().tobytes()).hexdigest())
    return out


def page_keys(prefix: str, n: int) -> List[str]:
    """SGLang-like page keys (64 hex digits)."""
    return [hashlib.sha256(f"{prefix}/{i}".encode()).hexdigest() for i in range(n)]
