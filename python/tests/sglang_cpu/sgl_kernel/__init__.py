"""Stands in for ``sgl-kernel`` when SGLang serves on CPU in the tests (doc/SGLANG.md).

SGLang's CPU engine imports a few of sgl-kernel's CPU ops at module level; their library is
built from SGLang's git repository and is not on PyPI (the PyPI wheels are CUDA builds). This
package gives the one op a plain generation runs, in torch, and names the others so that the
imports succeed; those raise if called (speculative decoding and KV moves, which the tests do
not use). It registers no ``torch.ops.sgl_kernel`` op, so SGLang finds no AMX kernels and takes
its torch-native layers (``sglang.srt.utils.common.is_host_cpu_amx_supported``)."""

from __future__ import annotations

import torch


def assign_req_to_token_pool_cpu(req_pool_indices: torch.Tensor, req_to_token: torch.Tensor,
                                 start_offset: torch.Tensor, end_offset: torch.Tensor,
                                 out_cache_loc: torch.Tensor, pool_len: int) -> None:
    """Request i's token slots ``start_offset[i]:end_offset[i]`` get the next
    ``end - start`` entries of ``out_cache_loc`` (what the Triton kernel of
    ``sglang.srt.mem_cache.allocation.assign_req_to_token_pool`` does)."""
    del pool_len
    at = 0
    for req, start, end in zip(req_pool_indices.tolist(), start_offset.tolist(), end_offset.tolist()):
        n = end - start
        req_to_token[req, start:end] = out_cache_loc[at:at + n].to(req_to_token.dtype)
        at += n


def _missing(name: str):
    def op(*args, **kwargs):
        raise NotImplementedError(f"sgl_kernel.{name} is not available in the tests' CPU stand-in")

    op.__name__ = name
    return op


for _name in ("copy_all_layer_kv_cache_cpu", "rotate_input_ids_cpu", "fill_accept_out_cache_loc_cpu",
              "fill_bonus_tokens_cpu", "build_tree_kernel_efficient_cpu", "verify_tree_greedy_cpu",
              "build_draft_decode_metadata_cpu", "assign_draft_cache_locs_contiguous_cpu",
              "assign_extend_cache_locs_cpu"):
    globals()[_name] = _missing(_name)
del _name
