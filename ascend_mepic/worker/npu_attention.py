"""MEPIC's attention backend on vllm-ascend: un-rotated K/V at MEPIC's slots, fused-RoPE attention.

UNTESTED ON HARDWARE: never run on an Ascend NPU. Checked on x86 (``make test-ascend``) with
vllm-ascend 0.30.0rc2's real classes, the torch_npu double and triton-ascend's interpreter.

``MepicAscendAttentionBackend`` subclasses vllm-ascend's ``AscendAttentionBackend`` and keeps
what vllm-ascend derives from it: the KV cache shape ``(2, num_blocks, 128, kv_heads, head)``,
the 128-token kernel block and ``forward_includes_kv_cache_update`` (vllm-ascend's runner never
calls ``do_kv_cache_update``, so ``forward`` writes K/V first). The impl and builder are MEPIC's
(``worker/attention.py``); what differs on the NPU:

* the per-layer cache is vllm-ascend's ``(K, V)`` pair of strided views, viewed as the ops'
  ``[2, num_blocks, B, Hkv, D]`` (``vllm_integration.ascend.kv_pair_view``);
* K/V are written with ``torch_npu.npu_scatter_pa_kv_cache`` (``cache_mode="Norm"``) into
  vllm-ascend's strided K and V views with int32 slots, as vllm-ascend's own
  ``DeviceOperator.reshape_and_cache`` does; float32 caches (which the op does not take) are
  written by indexing;
* attention dispatches to the triton-ascend kernel, or the torch_npu composition without
  triton-ascend (``ascend_mepic.ops.select_impl``).
"""

from __future__ import annotations

from dataclasses import replace

import torch
from vllm_ascend.attention.attention_v1 import AscendAttentionBackend

from ascend_mepic.ops.npu import get_npu_ops
from ascend_mepic.vllm_integration.ascend import (
    kv_pair_view,
    refuse_head_major_layout,
)
from ascend_mepic.worker.attention import (
    MepicAttentionImpl,
    MepicAttentionMetadata,
    MepicAttentionMetadataBuilder,
)

# Dtypes npu_scatter_pa_kv_cache writes on A2 (op-plugin docs); others are written by indexing.
SCATTER_DTYPES = (torch.float16, torch.bfloat16)


class MepicNPUAttentionMetadataBuilder(MepicAttentionMetadataBuilder):
    """MEPIC's metadata plus the step's KV slots: vllm-ascend's runner never calls
    ``do_kv_cache_update``, so ``forward`` writes K/V from these."""

    def build(
        self, common_prefix_len: int, common_attn_metadata, fast_build: bool = False
    ) -> MepicAttentionMetadata:
        meta = super().build(common_prefix_len, common_attn_metadata, fast_build)
        slots = common_attn_metadata.slot_mapping[: meta.num_actual_tokens].long()
        return replace(meta, slot_mapping=slots)


class MepicNPUAttentionImpl(MepicAttentionImpl):
    def cache_view(self, kv_cache) -> torch.Tensor:
        return kv_pair_view(kv_cache)

    def write_kv(
        self, key: torch.Tensor, value: torch.Tensor, view: torch.Tensor, slots: torch.Tensor
    ) -> None:
        if view.dtype not in SCATTER_DTYPES:
            super().write_kv(key, value, view, slots)
            return
        get_npu_ops().npu_scatter_pa_kv_cache(
            key.to(view.dtype).contiguous(),
            value.to(view.dtype).contiguous(),
            view[0],  # vllm-ascend's K view [num_blocks, B, Hkv, D] (block-strided)
            view[1],
            slots.to(torch.int32),
            cache_mode="Norm",
        )

    def forward(
        self,
        layer,
        query: torch.Tensor,
        key: torch.Tensor,
        value: torch.Tensor,
        kv_cache,
        attn_metadata: MepicAttentionMetadata | None,
        output: torch.Tensor,
        output_scale: torch.Tensor | None = None,
        output_block_scale: torch.Tensor | None = None,
    ) -> torch.Tensor:
        if attn_metadata is None:  # profiling run: nothing to write or attend
            return output.fill_(0)
        if attn_metadata.slot_mapping is None:
            raise RuntimeError("MEPIC's NPU attention needs the step's slot mapping")
        self.store_kv(layer, key, value, kv_cache, attn_metadata.slot_mapping, attn_metadata)
        return super().forward(
            layer, query, key, value, kv_cache, attn_metadata, output, output_scale,
            output_block_scale,
        )  # fmt: skip


class MepicAscendAttentionBackend(AscendAttentionBackend):
    """vllm-ascend's standard backend (cache shape, block size 128) with MEPIC's impl/builder."""

    @classmethod
    def supports_sliding_window(cls) -> bool:
        return False

    @staticmethod
    def get_kv_cache_shape(
        num_blocks: int,
        block_size: int,
        num_kv_heads: int,
        head_size: int,
        cache_dtype_str: str = "",
    ) -> tuple[int, ...]:
        refuse_head_major_layout()  # before anything is allocated
        return AscendAttentionBackend.get_kv_cache_shape(
            num_blocks, block_size, num_kv_heads, head_size, cache_dtype_str
        )

    @staticmethod
    def get_impl_cls() -> type[MepicNPUAttentionImpl]:
        return MepicNPUAttentionImpl

    @staticmethod
    def get_builder_cls() -> type[MepicNPUAttentionMetadataBuilder]:
        return MepicNPUAttentionMetadataBuilder
