"""Computation-path ops: NoPE KV writes and fused-RoPE paged attention with scattered queries.

One contract (``metadata.PagedRopeMetadata``, cache ``[2, num_blocks, B, Hkv, D]``), several
implementations, each one entry of ``IMPL_TABLE``:

* ``reference``: torch, any device (not chosen on the NPU unless forced); the oracle, and the
  CPU path when the native kernel is missing.
* ``cpu``: the native C++ kernel (``csrc/cpu/``, built by ``make setup``), the CPU default for
  float32 and bfloat16 (other dtypes use the reference).
* ``triton``: ``cuda_fallback/rope_paged_attention.py`` (CUDA; also runs under
  ``TRITON_INTERPRET=1``).
* ``triton-ascend``: ``ops/triton_ascend.py``, written for triton-ascend (persistent grid,
  page-at-a-time tiles): the NPU path for shapes FIA does not take (head sizes other than 64 and
  128, float32), **untested on a 910B** (checked under triton-ascend's interpreter and its
  compiler's first stages).
* ``npu``: ``ops/npu.py``, the torch_npu composition, the NPU default at head size 64 and 128 in
  float16/bfloat16 (``npu_default``), **untested on a 910B** (checked against a double of the
  documented ops).

The two Triton kernels share their common pieces (``ops/triton_common.py``).
``rope_paged_attention`` picks one from the query's device, head size and dtype and what is
importable (``select_impl``); ``ASCEND_MEPIC_ATTN_IMPL=reference|cpu|triton|triton-ascend|npu``
forces one.
"""

from __future__ import annotations

import functools
import importlib.util
import os
from collections.abc import Callable
from dataclasses import dataclass

import torch

from ascend_mepic.ops.metadata import PagedRopeMetadata, SequenceSpec, build_metadata
from ascend_mepic.ops.reference import rope_paged_attention_reference
from ascend_mepic.ops.reference import write_kv as write_kv_reference
from ascend_mepic.ops.rope import RopeSpec, UnsupportedRopeError, apply_rope

IMPL_ENV = "ASCEND_MEPIC_ATTN_IMPL"

AttentionFn = Callable[
    [torch.Tensor, torch.Tensor, PagedRopeMetadata, RopeSpec, float], torch.Tensor
]
WriteKvFn = Callable[[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor], None]
# (head size, query dtype, GQA ratio: query heads per KV head) -> bool; any may be None (not
# known at the call: any).
ShapeRule = Callable[[int | None, torch.dtype | None, int | None], bool]
ANY_DEVICE = "*"


def _always(*_args) -> bool:
    return True


def _never(*_args) -> bool:
    return False


@dataclass(frozen=True)
class AttentionImpl:
    """One attention implementation and when ``select_impl`` picks it.

    On a device, the implementations that serve its type (``devices``; ``ANY_DEVICE`` but
    ``not_on``) are ranked: those that ``prefer`` the call's head size and dtype first, then by
    ``priority`` (highest first); the first that ``takes`` the shape and is ``available`` runs.
    A forced one (``ASCEND_MEPIC_ATTN_IMPL``) runs without these checks. Every callable here
    imports what it needs when called: nothing is imported to build the table, and what tests
    patch (``have_triton_ascend``, ``cpu_kernel.available``, ``npu.FIA_DTYPES``) is read at
    each choice.
    """

    name: str
    load: Callable[[], AttentionFn]  # imports the implementation (may raise ImportError)
    devices: tuple[str, ...]  # device types it is a default for
    priority: int
    available: Callable[[], bool] = _always  # installed / built here
    takes: ShapeRule = _always  # head sizes and dtypes it can serve
    prefer: ShapeRule = _never  # ... and those for which it outranks every priority
    not_on: tuple[str, ...] = ()  # device types ``ANY_DEVICE`` leaves out
    # (query dtype, cache dtype) its kernel takes at the call; outside them a default choice
    # (not a forced one) runs the reference instead. None: any.
    call_dtypes: Callable[[torch.dtype, torch.dtype], bool] | None = None
    writes_out: bool = False  # fills the caller's ``out`` itself (else the result is copied in)
    # Its own KV write for the devices it serves, or None where it cannot load there (then the
    # reference's); None: it has none.
    write_kv: Callable[[], WriteKvFn | None] | None = None

    def serves(self, device_type: str) -> bool:
        if device_type in self.not_on:
            return False
        return device_type in self.devices or ANY_DEVICE in self.devices


# Loaders import their implementation when called (an ImportError then, e.g. without triton).
def _load_cpu() -> AttentionFn:
    from ascend_mepic.ops.cpu_kernel import rope_paged_attention_cpu

    return rope_paged_attention_cpu


def _load_triton() -> AttentionFn:
    from cuda_fallback.rope_paged_attention import rope_paged_attention_triton

    return rope_paged_attention_triton


def _load_triton_ascend() -> AttentionFn:
    from ascend_mepic.ops.triton_ascend import rope_paged_attention_ascend

    return rope_paged_attention_ascend


def _load_npu() -> AttentionFn:
    from ascend_mepic.ops.npu import rope_paged_attention_npu

    return rope_paged_attention_npu


def _cpu_kernel():
    from ascend_mepic.ops import cpu_kernel

    return cpu_kernel


def _cpu_write_kv() -> WriteKvFn | None:
    kernel = _cpu_kernel()
    return kernel.write_kv_cpu if kernel.load() else None


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


def _fia_head(head_size: int | None, dtype: torch.dtype | None, group: int | None = None) -> bool:
    """A head size FIA's TND paged mode takes on A2 at this GQA ratio, or an unknown one: 64 and
    128 at any ratio; with GQA/MQA (ratio > 1, at most ``FIA_MAX_GQA_RATIO``) any multiple of 16
    up to 256 (``ops.npu.fia_takes``)."""
    from ascend_mepic.ops.npu import fia_takes

    return head_size is None or fia_takes(head_size, group)


def _fia_head_and_dtype(
    head_size: int | None, dtype: torch.dtype | None, group: int | None = None
) -> bool:
    """A known shape FIA takes (``_fia_head``) in a dtype it takes (float16, bfloat16)."""
    from ascend_mepic.ops.npu import FIA_DTYPES

    return head_size is not None and _fia_head(head_size, dtype, group) and dtype in FIA_DTYPES


# Order: how ``IMPLS`` lists them (error messages, the doctor's report). The lambdas look names
# up at each call (tests patch ``have_triton_ascend``, the doctor ``cpu_kernel.available``).
IMPL_TABLE: tuple[AttentionImpl, ...] = (
    # Any device but the NPU: there, a shape no NPU path takes is refused (NoNpuAttentionError)
    # rather than run by torch ops one at a time.
    AttentionImpl(
        "reference", lambda: rope_paged_attention_reference,
        devices=(ANY_DEVICE,), not_on=("npu",), priority=0,
    ),
    AttentionImpl(
        "cpu", _load_cpu,
        devices=("cpu",), priority=10, available=lambda: _cpu_kernel().available(),
        call_dtypes=lambda q, kv: _cpu_kernel().supports(q, kv),
        writes_out=True, write_kv=_cpu_write_kv,
    ),
    AttentionImpl(
        "triton", _load_triton,
        devices=("cuda",), priority=10,
        available=lambda: importlib.util.find_spec("triton") is not None,
    ),
    # The NPU (``npu_default``): the composition where FIA takes the head size and dtype, else
    # the triton-ascend kernel if installed, else the composition where FIA takes the head size
    # (float32 then attends in bfloat16).
    AttentionImpl(
        "triton-ascend", _load_triton_ascend,
        devices=("npu",), priority=20, available=lambda: have_triton_ascend(),
    ),
    AttentionImpl(
        "npu", _load_npu,
        devices=("npu",), priority=10, takes=_fia_head, prefer=_fia_head_and_dtype,
    ),
)  # fmt: skip
IMPLS = tuple(impl.name for impl in IMPL_TABLE)
_BY_NAME = {impl.name: impl for impl in IMPL_TABLE}


def _choose(
    device_type: str, head_size: int | None, dtype: torch.dtype | None, group: int | None = None
) -> str | None:
    """The default implementation for a device type, head size, dtype and GQA ratio (None: none
    takes it). Availability is asked only of the candidates reached, in rank order."""
    candidates = [impl for impl in IMPL_TABLE if impl.serves(device_type)]
    candidates.sort(key=lambda impl: (not impl.prefer(head_size, dtype, group), -impl.priority))
    for impl in candidates:
        if impl.takes(head_size, dtype, group) and impl.available():
            return impl.name
    return None


class NoNpuAttentionError(RuntimeError):
    """No NPU attention implementation can serve this model's attention shape here."""


def npu_default(
    head_size: int | None = None, dtype: torch.dtype | None = None, group: int | None = None
) -> str:
    """The NPU implementation most likely to work on a first 910B, for a head size, dtype and
    GQA ratio (``group``: query heads per KV head).

    The torch_npu composition calls CANN's own ops (FIA, rotary), which ship tested with the
    toolkit; the triton-ascend kernel has never been compiled. So the composition runs where
    FIA's TND paged mode takes the shape (aclnnFusedInferAttentionScoreV4, CANN 9.x, Atlas A2 TND
    table; vllm-ascend 0.30.0rc2 makes this FIA call for every head size but 512), in
    float16/bfloat16: head size 64 or 128 at any GQA ratio, and for GQA/MQA (ratio 2 to 64) any
    multiple of 16 up to 256 (80, 96, 256, ...). The triton-ascend kernel runs the rest: float32,
    MHA at other head sizes, and head sizes FIA does not take; an unknown ratio counts as MHA
    (the composition only at 64/128). Without triton-ascend, a float32
    model at head 64/128 falls back to the composition, which attends in bfloat16; other shapes
    have no NPU path and raise ``NoNpuAttentionError``. Unknown shape (``None``): the kernel if
    triton-ascend is installed, else the composition. (The ``npu`` and ``triton-ascend`` entries
    of ``IMPL_TABLE``.)
    """
    chosen = _choose("npu", head_size, dtype, group)
    if chosen is not None:
        return chosen
    from ascend_mepic.ops.npu import FIA_TND_HEAD_DIMS

    raise NoNpuAttentionError(
        f"no MEPIC attention path on the NPU for head size {head_size} ({dtype}): the torch_npu "
        f"composition needs head size in {FIA_TND_HEAD_DIMS} (FIA's TND paged mode on A2) and the "
        "triton-ascend kernel needs triton-ascend, which is not installed (pip install "
        "triton-ascend==3.2.2; see docs/ascend.md)"
    )


def select_impl(
    device: torch.device,
    head_size: int | None = None,
    dtype: torch.dtype | None = None,
    group: int | None = None,
) -> str:
    """The implementation for ``device`` (and, on an NPU, the head size, dtype and GQA ratio
    ``group``), unless ``ASCEND_MEPIC_ATTN_IMPL`` forces one."""
    forced = os.environ.get(IMPL_ENV)
    if forced:
        if forced not in IMPLS:
            raise ValueError(f"{IMPL_ENV}={forced!r}; choose one of {IMPLS}")
        return forced
    if device.type == "npu":
        return npu_default(head_size, dtype, group)
    chosen = _choose(device.type, head_size, dtype, group)
    assert chosen is not None, f"the reference serves {device.type}"
    return chosen


def get_attention_fn(impl: str) -> AttentionFn:
    entry = _BY_NAME.get(impl)
    if entry is None:
        raise ValueError(f"unknown attention implementation {impl!r}; choose one of {IMPLS}")
    return entry.load()


_write_kv_fns: dict[tuple, Callable[..., None]] = {}


def _own_write_kv(device: torch.device, key_dtype: torch.dtype, cache_dtype: torch.dtype):
    """The KV write of the implementation attention uses on ``device``, where that has one of its
    own for this device type and these dtypes and it loads; else None."""
    if not any(i.write_kv is not None and device.type in i.devices for i in IMPL_TABLE):
        return None
    impl = _BY_NAME[select_impl(device)]
    if impl.write_kv is None or device.type not in impl.devices:
        return None
    if impl.call_dtypes is not None and not impl.call_dtypes(key_dtype, cache_dtype):
        return None
    return impl.write_kv()


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
        fn = _own_write_kv(kv_cache.device, key.dtype, kv_cache.dtype) or write_kv_reference
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
    key = ("impl", query.device.type, query.dtype, kv_cache.dtype, hq // hkv, query.shape[2],
           os.environ.get(IMPL_ENV))  # fmt: skip
    chosen = meta.memo.get(key)
    if chosen is None:
        impl = _BY_NAME[select_impl(query.device, query.shape[2], query.dtype, hq // hkv)]
        if impl.call_dtypes is not None and not os.environ.get(IMPL_ENV):
            if not impl.call_dtypes(query.dtype, kv_cache.dtype):
                impl = _BY_NAME["reference"]  # e.g. float16 on CPU: the kernel takes fp32, bf16
        # The native CPU kernel writes `out` itself; the others' result is copied in.
        chosen = meta.memo[key] = (impl.load(), impl.writes_out)
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
