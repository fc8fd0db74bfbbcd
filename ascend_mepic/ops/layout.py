"""The per-layer KV buffer's layout on CPU and CUDA, and the op's logical view of it.

vLLM allocates one flat buffer per layer; MEPIC's CPU and CUDA backends own the meaning of its
bytes. Kept here, apart from the backends (which import vLLM), so that everything that reads the
cache (the kernels' tests on a GPU machine without vLLM, the tier's copies) uses one definition.
"""

from __future__ import annotations

import torch


def block_view(kv_cache: torch.Tensor, num_kv_heads: int, head_size: int) -> torch.Tensor:
    """The logical ``[num_blocks, 2, B, Hkv, D]`` view of vLLM's per-layer buffer.

    The bytes of a block are laid out ``[Hkv, 2, B, D]``: per KV head, its K rows then its V rows,
    each contiguous. A decode work item (one sequence, one KV head) then streams one contiguous
    ``2 * B * D`` run per block, where a token-major block (``[2, B, Hkv, D]``) makes it read
    ``D``-element rows ``Hkv * D`` apart: on CPU beyond L3 that cost the kernel a third of its
    decode speed (``ascend-mepic bench kernels``, README). The layout stays block-major, so vLLM's
    block-granular bookkeeping (allocation, zeroing new blocks) still maps to whole blocks.
    """
    num_blocks = kv_cache.shape[0]
    if not kv_cache.is_contiguous():
        raise RuntimeError("MEPIC attention needs a contiguous per-layer KV buffer (LBHNC layout)")
    block_size = kv_cache.numel() // (num_blocks * 2 * num_kv_heads * head_size)
    physical = kv_cache.view(num_blocks, num_kv_heads, 2, block_size, head_size)
    return physical.permute(0, 2, 3, 1, 4)


def cache_view(kv_cache: torch.Tensor, num_kv_heads: int, head_size: int) -> torch.Tensor:
    """The op's logical ``[2, num_blocks, B, Hkv, D]`` view of vLLM's per-layer buffer."""
    return block_view(kv_cache, num_kv_heads, head_size).transpose(0, 1)
