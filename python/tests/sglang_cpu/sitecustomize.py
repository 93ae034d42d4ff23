"""What SGLang 0.5.23 lacks to run HiCache on a CPU, for the tests' SGLang servers only
(this directory is on their ``PYTHONPATH``; doc/SGLANG.md, "SGLang itself, on CPU").

SGLang's host KV pool (the L2 tier HiCache stores to and loads from) is written for an
accelerator: it registers its memory with CUDA, moves KV between the device pool and itself
with sgl-kernel's CUDA kernels, and waits on device events. On CPU the device pool is host
memory too. Applied as each module is first imported:

- ``torch.cpu.Stream.wait_event``: a no-op (CPU work is done when it returns; torch's CPU
  stream has ``wait_stream`` but not ``wait_event``);
- the host pool's memory: a plain allocation (``ALLOC_MEMORY_FUNCS["cpu"]`` registers it with
  CUDA);
- the host pool's two transfers (``MHATokenToKVPoolHost.load_to_device_per_layer`` and
  ``backup_from_device_all_layer``), for the ``page_first`` layout: torch index copies between
  the same per-layer token views the kernels address.

Nothing here touches SGLang's cache controller, radix tree, prefetch or storage calls: the
storage backend under test is driven by SGLang's own code."""

from __future__ import annotations

import importlib.abc
import importlib.util
import sys
from typing import Callable, Dict


def _patch_torch_cpu(mod) -> None:
    mod.cpu.Stream.wait_event = lambda self, event: None


def _patch_host_alloc(common) -> None:
    def alloc_plain(dims, dtype, device, pin_memory, allocator, registration_granularity_bytes=None):
        return allocator.allocate(dims, dtype=dtype, device=device)

    common.ALLOC_MEMORY_FUNCS["cpu"] = alloc_plain


def _patch_mha_host(mha) -> None:
    import torch

    cls = mha.MHATokenToKVPoolHost

    def _check(self) -> None:
        if self.layout != "page_first":
            raise NotImplementedError(f"the CPU stand-in moves page_first host pools only, not {self.layout}")

    def load_to_device_per_layer(self, device_pool, host_indices, device_indices, layer_id, io_backend, *,
                                 is_draft=False):
        if not is_draft and not 0 <= layer_id < self.target_layer_num:
            return
        _check(self)
        hi, di = host_indices.to(torch.int64), device_indices.to(torch.int64)
        self.device_k_buffers[layer_id][di] = self.k_data_refs[layer_id][hi]
        self.device_v_buffers[layer_id][di] = self.v_data_refs[layer_id][hi]

    def backup_from_device_all_layer(self, device_pool, host_indices, device_indices, io_backend):
        _check(self)
        hi, di = host_indices.to(torch.int64), device_indices.to(torch.int64)
        for layer in range(self.layer_num):
            self.k_data_refs[layer][hi] = self.device_k_buffers[layer][di]
            self.v_data_refs[layer][hi] = self.device_v_buffers[layer][di]

    cls.load_to_device_per_layer = load_to_device_per_layer
    cls.backup_from_device_all_layer = backup_from_device_all_layer


PATCHES: Dict[str, Callable] = {
    "torch": _patch_torch_cpu,
    "sglang.srt.mem_cache.pool_host.common": _patch_host_alloc,
    "sglang.srt.mem_cache.pool_host.mha": _patch_mha_host,
}


class _Loader(importlib.abc.Loader):
    def __init__(self, inner, patch):
        self.inner, self.patch = inner, patch

    def create_module(self, spec):
        return self.inner.create_module(spec)

    def exec_module(self, module):
        self.inner.exec_module(module)
        self.patch(module)


class _Finder(importlib.abc.MetaPathFinder):
    """Finds the patched modules the usual way and patches each once it has run."""

    def find_spec(self, name, path, target=None):
        patch = PATCHES.get(name)
        if patch is None:
            return None
        sys.meta_path.remove(self)
        try:
            spec = importlib.util.find_spec(name)
        finally:
            sys.meta_path.insert(0, self)
        if spec is None or spec.loader is None:
            return None
        spec.loader = _Loader(spec.loader, patch)
        return spec


sys.meta_path.insert(0, _Finder())
