"""Computation-path ops: NoPE KV writes and fused-RoPE paged attention with scattered queries.

One contract (``metadata.PagedRopeMetadata``, cache ``[2, num_blocks, B, Hkv, D]``), several
implementations:

* ``reference``: torch, any device; the CPU serving path.
* ``triton``: ``cuda_fallback/`` kernels (CUDA; also runs under ``TRITON_INTERPRET=1`` and under
  triton-ascend's interpreter, see the README).
* ``npu``: torch_npu composition for Ascend, **untested on a 910B**.

``rope_paged_attention`` picks one from the device of the query and what is importable; the
environment variable ``ASCEND_MEPIC_ATTN_IMPL=reference|triton|npu`` forces one.
"""

from __future__ import annotations

import importlib.util
import os
from collections.abc import Callable

import torch

from ascend_mepic.ops.metadata import PagedRopeMetadata, SequenceSpec, build_metadata
from ascend_mepic.ops.reference import rope_paged_attention_reference, write_kv
from ascend_mepic.ops.rope import RopeSpec, UnsupportedRopeError, apply_rope

IMPL_ENV = "ASCEND_MEPIC_ATTN_IMPL"
IMPLS = ("reference", "triton", "npu")

AttentionFn = Callable[
    [torch.Tensor, torch.Tensor, PagedRopeMetadata, RopeSpec, float], torch.Tensor
]


def _triton() -> AttentionFn:
    from cuda_fallback.rope_paged_attention import rope_paged_attention_triton

    return rope_paged_attention_triton


def _npu() -> AttentionFn:
    from ascend_mepic.ops.npu import rope_paged_attention_npu

    return rope_paged_attention_npu


def select_impl(device: torch.device) -> str:
    """The implementation for ``device``, unless ``ASCEND_MEPIC_ATTN_IMPL`` forces one."""
    forced = os.environ.get(IMPL_ENV)
    if forced:
        if forced not in IMPLS:
            raise ValueError(f"{IMPL_ENV}={forced!r}; choose one of {IMPLS}")
        return forced
    if device.type == "npu":
        return "npu"
    if device.type == "cuda" and importlib.util.find_spec("triton") is not None:
        return "triton"
    return "reference"


def get_attention_fn(impl: str) -> AttentionFn:
    if impl == "reference":
        return rope_paged_attention_reference
    if impl == "triton":
        return _triton()
    if impl == "npu":
        return _npu()
    raise ValueError(f"unknown attention implementation {impl!r}; choose one of {IMPLS}")


def rope_paged_attention(
    query: torch.Tensor,
    kv_cache: torch.Tensor,
    meta: PagedRopeMetadata,
    rope: RopeSpec,
    scale: float,
) -> torch.Tensor:
    """Attention of scattered, un-rotated queries over un-rotated paged KV, RoPE fused at read."""
    hq, hkv = query.shape[1], kv_cache.shape[3]
    if hq % hkv:
        raise ValueError(f"query heads {hq} must be a multiple of KV heads {hkv}")
    if query.shape[2] != rope.head_size:
        raise UnsupportedRopeError(
            f"head size {query.shape[2]} differs from the rotary dim {rope.head_size}"
        )
    return get_attention_fn(select_impl(query.device))(query, kv_cache, meta, rope, scale)


__all__ = [
    "IMPL_ENV",
    "PagedRopeMetadata",
    "RopeSpec",
    "SequenceSpec",
    "UnsupportedRopeError",
    "apply_rope",
    "build_metadata",
    "get_attention_fn",
    "rope_paged_attention",
    "select_impl",
    "write_kv",
]
