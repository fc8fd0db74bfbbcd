"""The vLLM attention internals MEPIC's backends touch (vLLM 0.30.0), each with why.

MEPIC's attention backends subclass vLLM's (``worker/attention.py`` on CPU,
``worker/cuda_attention.py`` on CUDA; vllm-ascend's on Ascend, ``vllm_integration.ascend``). What
the subclassing does not cover is here: naming the backend in vLLM's registry, the CUDA layout
flag, and the forward context through which vLLM hands each layer the step's metadata.
"""

from __future__ import annotations

from typing import Any

from vllm.forward_context import get_forward_context, is_forward_context_available
from vllm.v1.attention.backends.registry import AttentionBackendEnum, register_backend
from vllm.v1.kv_cache_layout import KVCacheLayout

# Per block, per KV head, K rows then V rows (``ops.layout.block_view``): what MEPIC's CUDA
# backend declares in ``supported_kv_cache_layouts``.
BLOCK_HEAD_MAJOR_LAYOUT = KVCacheLayout.LBHNC


def register_attention_backend(names: tuple[str, ...], class_path: str) -> None:
    """Point vLLM's backend names (``AttentionBackendEnum`` members) at ``class_path``.

    Why: the platforms choose a backend by name (CPU always ``CPU_ATTN``; CUDA ``CUSTOM`` when
    the configuration hook selected it) and resolve the name through this registry; it is the
    documented way to supply an out-of-tree backend. Call in the worker process, before the model
    is built.
    """
    for name in names:
        register_backend(AttentionBackendEnum[name], class_path)


def is_custom_backend(backend: Any) -> bool:
    """Whether the engine's ``attention_config.backend`` is vLLM's ``CUSTOM`` member (the one
    MEPIC's CUDA backend is registered as)."""
    return backend == AttentionBackendEnum.CUSTOM


def step_attention_metadata() -> Any:
    """This forward pass's attention metadata (per layer name); vLLM's assertion outside one.

    Why: vLLM hands ``do_kv_cache_update`` and model code no metadata argument; the runner sets
    it on the forward context, where MEPIC's K/V write and CacheBlend's layer gates read it.
    """
    return get_forward_context().attn_metadata


def in_forward() -> bool:
    """Whether a forward pass is running (its context is set)."""
    return is_forward_context_available()
