"""Computation-path ops: NoPE KV writes and fused-RoPE paged attention with scattered queries.

One contract (``metadata.PagedRopeMetadata``, cache ``[2, num_blocks, B, Hkv, D]``), several
implementations:

* ``reference``: torch, any device; the oracle, and the CPU path when the native kernel is missing.
* ``cpu``: the native C++ kernel (``csrc/cpu/``, built by ``make setup``), the CPU default for
  float32 and bfloat16 (other dtypes use the reference).
* ``triton``: ``cuda_fallback/rope_paged_attention.py`` (CUDA; also runs under
  ``TRITON_INTERPRET=1``).
* ``triton-ascend``: ``cuda_fallback/rope_paged_attention_ascend.py``, written for triton-ascend
  (persistent grid, page-at-a-time tiles): the NPU path for shapes FIA does not take (head sizes
  other than 64 and 128, float32), **untested on a 910B** (checked under triton-ascend's
  interpreter).
* ``npu``: the torch_npu composition, the NPU default at head size 64 and 128 in
  float16/bfloat16 (``npu_default``), **untested on a 910B** (checked against a double of the
  documented ops).

``rope_paged_attention`` picks one from the query's device, head size and dtype and what is
importable; ``ASCEND_MEPIC_ATTN_IMPL=reference|cpu|triton|triton-ascend|npu`` forces one.
"""

from __future__ import annotations

import functools
import importlib.util
import os
from collections.abc import Callable

import torch

from ascend_mepic.ops.metadata import PagedRopeMetadata, SequenceSpec, build_metadata
from ascend_mepic.ops.reference import rope_paged_attention_reference
from ascend_mepic.ops.reference import write_kv as write_kv_reference
from ascend_mepic.ops.rope import RopeSpec, UnsupportedRopeError, apply_rope

IMPL_ENV = "ASCEND_MEPIC_ATTN_IMPL"
IMPLS = ("reference", "cpu", "triton", "triton-ascend", "npu")

AttentionFn = Callable[
    [torch.Tensor, torch.Tensor, PagedRopeMetadata, RopeSpec, float], torch.Tensor
]


def _triton() -> AttentionFn:
    from cuda_fallback.rope_paged_attention import rope_paged_attention_triton

    return rope_paged_attention_triton


def _cpu() -> AttentionFn:
    from ascend_mepic.ops.cpu_kernel import rope_paged_attention_cpu

    return rope_paged_attention_cpu


def _triton_ascend() -> AttentionFn:
    from cuda_fallback.rope_paged_attention_ascend import rope_paged_attention_ascend

    return rope_paged_attention_ascend


@functools.cache
def have_triton_ascend() -> bool:
    """Whether the installed ``triton`` is Ascend's (triton-ascend replaces the package). Asked
    every step on an NPU; installed packages do not change in a running process."""
    from importlib.metadata import PackageNotFoundError, distribution

    try:
        distribution("triton-ascend")
    except PackageNotFoundError:
        return False
    return importlib.util.find_spec("triton") is not None


def _npu() -> AttentionFn:
    from ascend_mepic.ops.npu import rope_paged_attention_npu

    return rope_paged_attention_npu


class NoNpuAttentionError(RuntimeError):
    """No NPU attention implementation can serve this model's attention shape here."""


def npu_default(head_size: int | None = None, dtype: torch.dtype | None = None) -> str:
    """The NPU implementation most likely to work on a first 910B, for a head size and dtype.

    The torch_npu composition calls CANN's own ops (FIA, rotary), which ship tested with the
    toolkit; the triton-ascend kernel has never been compiled. So the composition runs where
    FIA's TND paged mode takes the shape for any GQA ratio: head size 64 or 128
    (aclnnFusedInferAttentionScoreV4, CANN 9.x, Atlas A2 TND table; vllm-ascend 0.30.0rc2 makes
    this FIA call for every head size but 512), float16/bfloat16. The triton-ascend kernel runs
    the rest: float32, and head sizes FIA takes for GQA/MQA only (80, 96, 256: documented, not
    chosen here, which sees no head counts) or not at all. Without triton-ascend, a float32
    model at head 64/128 falls back to the composition, which attends in bfloat16; other shapes
    have no NPU path and raise ``NoNpuAttentionError``. Unknown shape (``None``): the kernel if
    triton-ascend is installed, else the composition.
    """
    from ascend_mepic.ops.npu import FIA_DTYPES, FIA_TND_HEAD_DIMS

    fia_shape = head_size is None or head_size in FIA_TND_HEAD_DIMS
    if fia_shape and head_size is not None and dtype in FIA_DTYPES:
        return "npu"
    if have_triton_ascend():
        return "triton-ascend"
    if fia_shape:
        return "npu"
    raise NoNpuAttentionError(
        f"no MEPIC attention path on the NPU for head size {head_size} ({dtype}): the torch_npu "
        f"composition needs head size in {FIA_TND_HEAD_DIMS} (FIA's TND paged mode on A2) and the "
        "triton-ascend kernel needs triton-ascend, which is not installed (pip install "
        "triton-ascend==3.2.2; see docs/ascend.md)"
    )


def select_impl(
    device: torch.device, head_size: int | None = None, dtype: torch.dtype | None = None
) -> str:
    """The implementation for ``device`` (and, on an NPU, the head size and dtype), unless
    ``ASCEND_MEPIC_ATTN_IMPL`` forces one."""
    forced = os.environ.get(IMPL_ENV)
    if forced:
        if forced not in IMPLS:
            raise ValueError(f"{IMPL_ENV}={forced!r}; choose one of {IMPLS}")
        return forced
    if device.type == "npu":
        return npu_default(head_size, dtype)
    if device.type == "cuda" and importlib.util.find_spec("triton") is not None:
        return "triton"
    if device.type == "cpu":
        from ascend_mepic.ops import cpu_kernel

        if cpu_kernel.available():
            return "cpu"
    return "reference"


def get_attention_fn(impl: str) -> AttentionFn:
    if impl == "reference":
        return rope_paged_attention_reference
    if impl == "cpu":
        return _cpu()
    if impl == "triton":
        return _triton()
    if impl == "triton-ascend":
        return _triton_ascend()
    if impl == "npu":
        return _npu()
    raise ValueError(f"unknown attention implementation {impl!r}; choose one of {IMPLS}")


_write_kv_fns: dict[tuple, Callable[..., None]] = {}


def write_kv(
    key: torch.Tensor, value: torch.Tensor, kv_cache: torch.Tensor, slot_mapping: torch.Tensor
) -> None:
    """Store un-rotated K and V ``[N, Hkv, D]`` at flat slots ``block * B + offset`` (< 0: skip).

    On CPU the native kernel's ``write_kv`` (one call, no index tensors) whenever the attention
    would use the kernel; else the torch reference's.
    """
    sig = (kv_cache.device.type, key.dtype, kv_cache.dtype, os.environ.get(IMPL_ENV))
    fn = _write_kv_fns.get(sig)
    if fn is None:
        fn = write_kv_reference
        if sig[0] == "cpu" and select_impl(kv_cache.device) == "cpu":
            from ascend_mepic.ops import cpu_kernel

            if cpu_kernel.supports(key.dtype, kv_cache.dtype) and cpu_kernel.load():
                fn = cpu_kernel.write_kv_cpu
        _write_kv_fns[sig] = fn
    fn(key, value, kv_cache, slot_mapping)


def rope_paged_attention(
    query: torch.Tensor,
    kv_cache: torch.Tensor,
    meta: PagedRopeMetadata,
    rope: RopeSpec,
    scale: float,
    out: torch.Tensor | None = None,
) -> torch.Tensor:
    """Attention of scattered, un-rotated queries over un-rotated paged KV, RoPE fused at read.

    ``out`` (``[T, Hq, D]``, the query's dtype): where the rows go; returned. The native CPU
    kernel writes it directly; the other implementations' result is copied in."""
    hq, hkv = query.shape[1], kv_cache.shape[3]
    if hq % hkv:
        raise ValueError(f"query heads {hq} must be a multiple of KV heads {hkv}")
    if query.shape[2] != rope.head_size:
        raise UnsupportedRopeError(
            f"head size {query.shape[2]} differs from the rotary dim {rope.head_size}"
        )
    # Chosen once per step (the metadata is shared by every layer), keyed by what decides it.
    key = ("impl", query.device.type, query.dtype, kv_cache.dtype, os.environ.get(IMPL_ENV))
    chosen = meta.memo.get(key)
    if chosen is None:
        impl = select_impl(query.device, query.shape[2], query.dtype)
        if impl == "cpu" and not os.environ.get(IMPL_ENV):
            from ascend_mepic.ops import cpu_kernel

            if not cpu_kernel.supports(query.dtype, kv_cache.dtype):
                impl = "reference"  # e.g. float16 on CPU: the kernel takes fp32 and bf16
        # The native CPU kernel writes `out` itself; the others' result is copied in.
        chosen = meta.memo[key] = (get_attention_fn(impl), impl == "cpu")
    fn, writes_out = chosen
    if out is None:
        return fn(query, kv_cache, meta, rope, scale)
    if writes_out:
        return fn(query, kv_cache, meta, rope, scale, out=out)
    return out.copy_(fn(query, kv_cache, meta, rope, scale))


__all__ = [
    "IMPL_ENV",
    "NoNpuAttentionError",
    "PagedRopeMetadata",
    "RopeSpec",
    "SequenceSpec",
    "UnsupportedRopeError",
    "apply_rope",
    "build_metadata",
    "get_attention_fn",
    "have_triton_ascend",
    "npu_default",
    "rope_paged_attention",
    "select_impl",
    "write_kv",
]
