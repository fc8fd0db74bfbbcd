"""MEPIC's attention backend on vLLM's CUDA platform, selected as vLLM's ``CUSTOM`` backend.

UNTESTED ON A GPU: its selection and checks run here with vLLM's CUDA platform code and a faked
device capability (``tests/cuda``); its kernels (``cuda_fallback/``, Triton) only under Triton's
CPU interpreter. The impl, metadata builder and common capabilities are the CPU path's
(``worker/attention.py``, tested in the real engine); what differs is what the backend
declares to vLLM's selector, so that a model, dtype or GPU the Triton kernels do not serve is
refused by vLLM's own ``validate_configuration`` at start-up
(``engine_config.check_backend_serves_model`` calls it before any process starts).

Why ``CUSTOM`` rather than registering over FLASH_ATTN/TRITON_ATTN: vLLM's CUDA selector ranks
backends per GPU generation (FLASHINFER first on SM100) and honours ``--attention-backend``; a
name MEPIC did not take would then run stock attention on MEPIC's un-rotated KV. With the
configuration's backend set to ``CUSTOM``, the selector asks for exactly this class.
"""

from __future__ import annotations

from typing import ClassVar

import torch
from vllm.v1.attention.backend import AttentionBackend

from ascend_mepic.vllm_integration.attention_internals import (
    BLOCK_HEAD_MAJOR_LAYOUT,
    register_attention_backend,
)
from ascend_mepic.worker.attention import MepicBackendCapabilities

# Even head sizes the Triton kernels' tiles were written for (D padded to a power of two; above
# 256 the tiles of one program no longer fit a GPU's registers and shared memory).
CUDA_HEAD_SIZES = (32, 64, 80, 96, 112, 128, 160, 192, 224, 256)
# Ampere and later: the kernels' half-precision tl.dot paths (bf16 needs SM80).
MIN_CAPABILITY = (8, 0)


class MepicCudaAttentionBackend(MepicBackendCapabilities, AttentionBackend):
    supported_dtypes: ClassVar[list[torch.dtype]] = [torch.float16, torch.bfloat16, torch.float32]
    # Chunk KV is stored once and read by every request: no quantized KV cache.
    supported_kv_cache_dtypes: ClassVar[list] = ["auto"]
    # K/V are written by ``do_kv_cache_update`` (CacheBlend selects there, before the write).
    forward_includes_kv_cache_update: bool = False

    @staticmethod
    def get_name() -> str:
        return "CUSTOM"

    @classmethod
    def get_supported_head_sizes(cls) -> list[int]:
        return list(CUDA_HEAD_SIZES)

    @classmethod
    def supported_kv_cache_layouts(cls) -> tuple:
        """Per block, per KV head, K rows then V rows (``ops.layout.block_view``)."""
        return (BLOCK_HEAD_MAJOR_LAYOUT,)

    @classmethod
    def supports_compute_capability(cls, capability) -> bool:
        return (capability.major, capability.minor) >= MIN_CAPABILITY

    @staticmethod
    def use_cascade_attention(*args, **kwargs) -> bool:
        return False


def register_cuda_backend() -> None:
    """Register this class as vLLM's ``CUSTOM`` backend (worker process, before the model is
    built; the configuration hook selected ``CUSTOM``)."""
    register_attention_backend(("CUSTOM",), f"{__name__}.MepicCudaAttentionBackend")
