"""MEPIC's attention backend for vLLM: un-rotated KV in the paged cache, RoPE applied at read time.

Registered over vLLM's ``CPU_ATTN`` (on CPU the platform always picks that name, so re-registering
its path is the documented way in). The per-layer cache buffer vLLM allocates for a block holds
``num_kv_heads * block_size * 2 * head_size`` elements; this backend owns their meaning: per
block, per KV head, K rows then V rows (``ops.layout.block_view``), passed to the ops as the
strided logical view ``[2, num_blocks, B, Hkv, D]``.

The builder turns vLLM's ``CommonAttentionMetadata`` plus the ``step.PlacedStep`` its runner
handed it (logical positions, padded indices, per-block position tables) into the ops'
``PagedRopeMetadata``; tables that do not describe the batch raise ``StepPlanError``. In a step,
plain requests have identity rows in those tables (ordinary causal attention with RoPE at each
token's position); outside a step (vLLM's profiling runs) the builder builds identity tables.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from vllm.v1.attention.backend import (
    AttentionImpl,
    AttentionMetadataBuilder,
    AttentionType,
    MultipleOf,
)
from vllm.v1.attention.backends.cpu_attn import CPUAttentionBackend

from ascend_mepic.core.plan import StepPlanError
from ascend_mepic.ops import PagedRopeMetadata, rope_paged_attention, write_kv
from ascend_mepic.ops.layout import cache_view
from ascend_mepic.ops.rope import RopeSpec
from ascend_mepic.vllm_integration.attention_internals import (
    register_attention_backend,
    step_attention_metadata,
)
from ascend_mepic.vllm_integration.runner_internals import STEP_NOT_PLACED
from ascend_mepic.worker import blend, step
from ascend_mepic.worker.nope_rotary import registered_rope
from ascend_mepic.worker.step import PlacedStep


@dataclass
class MepicAttentionMetadata:
    num_actual_tokens: int
    paged: PagedRopeMetadata
    blend: blend.BlendStep | None = None  # CacheBlend's selection state for this step
    # The step's KV slots, for backends that write K/V inside ``forward`` (vllm-ascend's runner
    # never calls ``do_kv_cache_update``); None where vLLM hands them to ``do_kv_cache_update``.
    slot_mapping: torch.Tensor | None = None


class MepicAttentionMetadataBuilder(AttentionMetadataBuilder[MepicAttentionMetadata]):
    def __init__(self, kv_cache_spec, layer_names, vllm_config, device) -> None:
        super().__init__(kv_cache_spec, layer_names, vllm_config, device)
        self.block_size = kv_cache_spec.block_size
        self._inputs: PlacedStep | object | None = None

    def set_step_inputs(self, inputs: PlacedStep | object | None) -> None:
        """The runner's tables for the step being built (None outside a step)."""
        self._inputs = inputs

    def build(
        self, common_prefix_len: int, common_attn_metadata, fast_build: bool = False
    ) -> MepicAttentionMetadata:
        cm = common_attn_metadata
        num_reqs, num_tokens = cm.num_reqs, cm.num_actual_tokens
        inputs = self._inputs
        if inputs is STEP_NOT_PLACED:
            raise StepPlanError(
                "MEPIC attention metadata requested for a step whose tokens the runner did not "
                "place (the runner's _prepare_inputs did not run MEPIC's placement)"
            )
        if isinstance(inputs, PlacedStep):
            inputs.check_matches(num_reqs, num_tokens)
            paged = inputs.to_metadata(
                self.block_size, cm.query_start_loc[: num_reqs + 1], cm.block_table_tensor
            )
            return MepicAttentionMetadata(num_tokens, paged, inputs.blend)
        # Outside a step (vLLM's profiling and warm-up runs): plain sequences only, every slot
        # real and position = index.
        paged = step.plain_metadata(
            self.block_size,
            cm.query_start_loc[: num_reqs + 1],
            cm.positions[:num_tokens],
            cm.seq_lens[:num_reqs],
            cm.block_table_tensor[:num_reqs],
        )
        return MepicAttentionMetadata(num_tokens, paged)


class MepicAttentionImpl(AttentionImpl):
    def __init__(
        self,
        num_heads: int,
        head_size: int,
        scale: float,
        num_kv_heads: int,
        alibi_slopes: list[float] | None,
        sliding_window: int | None,
        kv_cache_dtype: str,
        logits_soft_cap: float | None = None,
        attn_type: str = AttentionType.DECODER,
        kv_sharing_target_layer_name: str | None = None,
        sinks: torch.Tensor | None = None,
    ) -> None:
        unsupported = {
            "ALiBi": alibi_slopes is not None,
            "sliding window": sliding_window is not None,
            "logits soft cap": bool(logits_soft_cap),
            "attention sinks": sinks is not None,
            "a quantized KV cache": kv_cache_dtype not in ("auto", None),
            "non-decoder attention": attn_type != AttentionType.DECODER,
            "cross-layer KV sharing": kv_sharing_target_layer_name is not None,
        }
        found = [name for name, bad in unsupported.items() if bad]
        if found:
            raise ValueError(f"MEPIC attention does not support {', '.join(found)}")
        self.num_heads = num_heads
        self.head_size = head_size
        self.scale = float(scale)
        self.num_kv_heads = num_kv_heads
        self.kv_sharing_target_layer_name = None
        self._rope: RopeSpec | None = None
        self._layer_index: int | None = None
        self._view: tuple[object, torch.Tensor] | None = None  # (per-layer cache, its op view)

    def rope(self) -> RopeSpec:
        if self._rope is None:
            self._rope = registered_rope()
        return self._rope

    def _layer(self, layer) -> int:
        if self._layer_index is None:
            self._layer_index = blend.layer_index(layer.layer_name)
        return self._layer_index

    def cache_view(self, kv_cache) -> torch.Tensor:
        """The op's ``[2, num_blocks, B, Hkv, D]`` view of this platform's per-layer cache.

        Kept for the layer's cache tensor (the same object every step; a new one, e.g. after
        vLLM re-allocates its caches, gets a new view): two views per layer per step add up.
        """
        if self._view is None or self._view[0] is not kv_cache:
            self._view = (kv_cache, cache_view(kv_cache, self.num_kv_heads, self.head_size))
        return self._view[1]

    def write_kv(
        self, key: torch.Tensor, value: torch.Tensor, view: torch.Tensor, slots: torch.Tensor
    ) -> None:
        """Write un-rotated K/V rows ``[n, Hkv, D]`` at flat slots of the op's view."""
        write_kv(key, value, view, slots)

    def do_kv_cache_update(self, layer, key, value, kv_cache, slot_mapping) -> None:
        """Store K and V un-rotated (vLLM calls this for every layer before its attention)."""
        metadata = step_attention_metadata()
        step = metadata[layer.layer_name] if isinstance(metadata, dict) else None
        self.store_kv(layer, key, value, kv_cache, slot_mapping, step)

    def store_kv(
        self,
        layer,
        key: torch.Tensor,
        value: torch.Tensor,
        kv_cache,
        slot_mapping: torch.Tensor,
        step: MepicAttentionMetadata | None,
    ) -> None:
        """Write the step's K/V rows un-rotated; CacheBlend's selection happens here, before
        the check layer's fresh K overwrites the cached K it is compared with."""
        view = self.cache_view(kv_cache)
        state = step.blend if step is not None else None
        if state is not None:  # CacheBlend: select at the check layer, subset after it
            index = self._layer(layer)
            if index == state.check_layer:
                meta = step.paged
                k = key[: state.num_rows].view(state.num_rows, self.num_kv_heads, self.head_size)
                blend.select(state, k, view, slot_mapping, meta)
            elif state.active(index):
                slot_mapping = state.slot_mapping
        n = slot_mapping.shape[0]
        self.write_kv(
            key[:n].view(n, self.num_kv_heads, self.head_size),
            value[:n].view(n, self.num_kv_heads, self.head_size),
            view,
            slot_mapping,
        )

    def forward(
        self,
        layer,
        query: torch.Tensor,
        key: torch.Tensor,
        value: torch.Tensor,
        kv_cache: torch.Tensor,
        attn_metadata: MepicAttentionMetadata | None,
        output: torch.Tensor,
        output_scale: torch.Tensor | None = None,
        output_block_scale: torch.Tensor | None = None,
    ) -> torch.Tensor:
        if output_scale is not None or output_block_scale is not None:
            raise NotImplementedError("fused output quantization is not supported by MEPIC")
        if attn_metadata is None:  # profiling run
            return output
        n, paged = attn_metadata.num_actual_tokens, attn_metadata.paged
        state = attn_metadata.blend
        if state is not None and state.active(self._layer(layer)):
            n, paged = len(state.keep), state.metadata
        q = query[:n].view(n, self.num_heads, self.head_size)
        view = self.cache_view(kv_cache)
        rope_paged_attention(
            q, view, paged, self.rope(), self.scale,
            out=output[:n].view(n, self.num_heads, self.head_size),
        )  # fmt: skip
        return output


class MepicBackendCapabilities:
    """What MEPIC's backend serves on every platform, declared once for vLLM's selector: its
    impl and builder, decoder attention only, no sliding window, blocks of any multiple of 16
    (the paper's GPU block size; the ops gather any block). Mixed in before the platform's base
    backend (``MepicAttentionBackend``, ``cuda_attention.MepicCudaAttentionBackend``)."""

    @staticmethod
    def get_supported_kernel_block_sizes(kv_cache_spec=None) -> list[int | MultipleOf]:
        return [MultipleOf(16)]

    @classmethod
    def supports_sliding_window(cls) -> bool:
        return False

    @classmethod
    def supports_attn_type(cls, attn_type: str) -> bool:
        return attn_type == AttentionType.DECODER

    @staticmethod
    def get_impl_cls() -> type[MepicAttentionImpl]:
        return MepicAttentionImpl

    @staticmethod
    def get_builder_cls() -> type[MepicAttentionMetadataBuilder]:
        return MepicAttentionMetadataBuilder


class MepicAttentionBackend(MepicBackendCapabilities, CPUAttentionBackend):
    """CPU_ATTN's head sizes and layout with MEPIC's capabilities (CPU_ATTN's own C++ kernel
    needs blocks of multiples of 32, which stock vLLM on CPU keeps; MEPIC's ops take 16)."""

    @staticmethod
    def get_name() -> str:
        return "CPU_ATTN"


def register_backend(names: tuple[str, ...] = ("CPU_ATTN",)) -> None:
    """Point vLLM's backend names at this backend (worker process, before the model is built).

    On CPU the platform always picks CPU_ATTN. (CUDA selects ``cuda_attention``'s backend as
    vLLM's CUSTOM backend; Ascend wraps the NPU platform's choice.)
    """
    register_attention_backend(names, f"{__name__}.MepicAttentionBackend")
