"""Fused-RoPE paged attention written for triton-ascend (Ascend 910B): the NPU's default kernel
for the shapes torch_npu's fused attention does not take.

UNTESTED ON HARDWARE: this kernel has never run on an Ascend NPU (no NPU and no CANN toolkit on
the machines it was built on). What is checked (``tests/ops/test_ascend_compile.py``): every
launch the worker can make goes through triton-ascend 3.2's own compiler stages ``ttir`` and
``ttadapter`` (``triton-adapter-opt``), then BiSheng IR's ``bishengir-compile`` (package
``ascendnpu-ir``) to the final HIVM IR for 910B2 and 910B3, with the unified buffer and L1
planned and checked; only ``hivmc`` (HIVM to an NPU binary, CANN's) is not run
(``tests/ops/ascend_compile.CANN_ONLY_CHECKS`` lists what remains). Numerics are checked under
triton-ascend's CPU interpreter (``tests/ops/test_ascend_kernel.py``) against the dense float64
oracle. The kernel needs triton-ascend: its tiles are block pointers, which upstream Triton
removed (there the module imports, for the launch planning and the UB model, but
``rope_paged_attention_ascend`` refuses to run).

Same contract as the CUDA kernel ``cuda_fallback.rope_paged_attention``
(``ascend_mepic.ops.metadata``): K and V un-rotated in ``[2, num_blocks, B, Hkv, D]``
(vllm-ascend's ``(2, num_blocks, 128, kv_heads, head)``), scattered un-rotated queries, per-entry
valid ranges and positions. The arithmetic both kernels share (rotation, scores, online softmax,
the split-KV combine kernel) and their common input checks are written once, in
``ascend_mepic.ops.triton_common``. The kernels and how they differ from the GPU kernel are in
``ascend_mepic.ops.triton_ascend_kernels``; this module plans their launches (tiles, grid, work
items, scratch) and runs them.

* **UB budget.** A2's unified buffer is 192 KiB per vector core. ``ub_bytes`` is what BiSheng
  IR's compiler (``bishengir-compile`` 1.2.0, the stage after ``ttadapter``) places in it for one
  attention launch, fitted to its final HIVM and stated as an upper bound over the fit's tiles;
  ``choose_tiles`` picks the most rows, then the widest ``BLOCK_N``, under ``UB_BUDGET`` (85%:
  room for a later compiler's extra temporary). ``tests/ops/test_ascend_compile.py`` holds every
  launch to that budget on the compiler's own figure.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
import triton

from ascend_mepic import ops
from ascend_mepic.ops.metadata import PagedRopeMetadata
from ascend_mepic.ops.rope import RopeSpec
from ascend_mepic.ops.triton_ascend_kernels import _decode_kernel, _prefill_kernel, _rope_q_kernel
from ascend_mepic.ops.triton_common import (
    INTERPRETED,
    LOG2E,
    check_layout,
    check_tensors,
    combine_kernel,
    int32,
    launch_strides,
    pow2_at_least,
    split_buffers,
)

logger = logging.getLogger(__name__)

# Programs launched under the interpreter: fewer than the work items, so the persistent loop runs.
INTERPRETER_CORES = 3
# 910B3's AI-core count (triton-ascend's tutorials assume 20); used when the driver cannot say.
DEFAULT_NPU_CORES = 20


# A2 (910B) unified buffer per vector core, and the share a launch may fill in the compiler's
# plan (the rest: what another CANN build or a later pass may add).
UB_BYTES = 192 * 1024
UB_FRACTION = 0.85
UB_BUDGET = int(UB_BYTES * UB_FRACTION)
# Candidate tile sizes, preferred first (rows: BLOCK_Q * GROUP_P; keys per sub-tile).
ROW_CHOICES = (32, 16)
BLOCK_N_CHOICES = (64, 32, 16)
# bishengir-compile 1.2.0's UB plan of an attention launch (final HIVM, highest placed end), per
# (decode, NeoX rotation): bytes = a * rows * D_P + b * BLOCK_N * D_P + c * rows * BLOCK_N + d.
# Least squares (tests/ops/fit_ascend_ub.py) over a tile grid (heads 64/128/256, float16 and
# float32, cos/sin in the model dtype, rows 16/32, BLOCK_N 16/32/64; the points placed under 86%
# of UB: above that the compiler drops multi-buffering and its figure saturates), each fit then
# scaled by its largest under-statement (1.01-1.14), so it bounds its points from above (within
# 8% for prefill, 26% for decode). Prefill's ``a`` then lowered by 4: one fp32 accumulator less
# since the accumulator's zero is no longer a constant the compiler hoists and keeps live (-16 KiB
# at head 256; decode keeps its fit, which the lowered one under-stated by 2.5% at head 64).
# Element dtypes barely move it (the compiler keeps fp32 copies of the half tiles): not terms.
# The compile test checks that it bounds every shipped launch's plan.
UB_FIT: dict[tuple[bool, bool], tuple[float, float, float, int]] = {
    (False, True): (17.64, 16.75, 21.96, 3974),  # prefill, NeoX
    (False, False): (17.2, 19.47, 21.12, 3529),  # prefill, GPT-J
    (True, True): (16.19, 7.65, 6.7, 6962),  # decode, NeoX
    (True, False): (1.35, 35.09, -60.6, 58952),  # decode, GPT-J (rows are 16: not separable)
}


def ub_bytes(rows: int, block_n: int, head: int, *, decode: bool, neox: bool) -> int:
    """UB bytes the compiler plans for one attention launch with these tiles (``UB_FIT``)."""
    a, b, c, d = UB_FIT[(decode, neox)]
    d_p = pow2_at_least(head, 16)
    return int(a * rows * d_p + b * block_n * d_p + c * rows * block_n + d)


def dots_in_fp32(q_dtype: torch.dtype, kv_dtype: torch.dtype, half_dots: bool | None) -> bool:
    """fp32 dots when an input is fp32, or (unless forced) bf16 under an interpreter."""
    if torch.float32 in (q_dtype, kv_dtype):
        return True
    if half_dots is None:
        return INTERPRETED and torch.bfloat16 in (q_dtype, kv_dtype)
    return not half_dots


def choose_tiles(
    head: int, group: int, block_size: int, decode: bool = False, neox: bool = True
) -> tuple[int, int]:
    """``(block_q, block_n)`` the launcher uses: the most rows, then the widest sub-tile, whose
    ``ub_bytes`` fits ``UB_BUDGET`` (smallest tiles if nothing does). Decode has one query:
    ``block_q`` is 1 and its rows are the group padded to 16."""
    group_p = pow2_at_least(group, 1)
    if decode:
        row_choices = (pow2_at_least(group, 16),)
    else:
        row_choices = tuple(r for r in ROW_CHOICES if r >= group_p) or (group_p,)
    widths = [n for n in BLOCK_N_CHOICES if n <= block_size and block_size % n == 0] or [16]
    for rows in row_choices:
        for block_n in widths:
            if ub_bytes(rows, block_n, head, decode=decode, neox=neox) <= UB_BUDGET:
                return (1 if decode else max(1, rows // group_p)), block_n
    rows = row_choices[-1]
    return (1 if decode else max(1, rows // group_p)), widths[-1]


def prefill_items(
    query_start_loc: torch.Tensor, block_q: int, cores: int, num_kv_heads: int
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Prefill work items (sequence, first row, end row): runs of consecutive query tiles.

    A run rotates each page it reaches once, so runs are as long as possible: one per sequence
    when ``sequences * num_kv_heads`` covers the cores, else sequences are cut into runs of equal
    tile counts until it does. Longest sequences' last runs (the most keys) come first. Built on
    the host from a CPU ``query_start_loc`` (this syncs on a device one).
    """
    loc = query_start_loc.to("cpu", torch.int64).tolist()
    tiles = [-(-(hi - lo) // block_q) for lo, hi in zip(loc, loc[1:], strict=False)]
    want = -(-cores // max(num_kv_heads, 1))
    busy = sum(1 for t in tiles if t)
    per_run = max(tiles, default=0) if busy >= want else max(1, -(-sum(tiles) // want))
    items = []
    for s, (lo, hi) in enumerate(zip(loc, loc[1:], strict=False)):
        for first in range(lo, hi, per_run * block_q):
            items.append((hi - lo, first, s, min(hi, first + per_run * block_q)))
    items.sort(reverse=True)
    cols = list(zip(*items, strict=True)) if items else [(), (), (), ()]
    return tuple(torch.tensor(c, dtype=torch.int32) for c in (cols[2], cols[1], cols[3]))


_CORES: dict[tuple[str, int], int] = {}


def num_cores(device: torch.device, kind: str = "num_aicore") -> int:
    """Programs to launch: the NPU's AI-core count (``tl.dot`` kernels run on the cube cores).

    Read from triton-ascend's driver (the property names vllm-ascend's ``triton_utils`` reads,
    UNVERIFIED here); interpreted kernels use ``INTERPRETER_CORES``.
    """
    if INTERPRETED or device.type != "npu":
        return INTERPRETER_CORES
    key = (kind, device.index or 0)
    if key not in _CORES:
        try:
            props = triton.runtime.driver.active.utils.get_device_properties(device.index or 0)
            _CORES[key] = int(props[kind])
        except (AttributeError, KeyError, TypeError, RuntimeError) as exc:
            logger.warning(
                "triton-ascend did not report %s (%s); assuming %d cores", kind, exc,
                DEFAULT_NPU_CORES,
            )  # fmt: skip
            _CORES[key] = DEFAULT_NPU_CORES
    return _CORES[key]


def decode_splits(cores: int, num_seqs: int, num_kv_heads: int, max_entries: int) -> int:
    """Splits per (sequence, KV head): enough work items to cover the cores, >= 2 entries each."""
    want = min(-(-cores // max(num_seqs * num_kv_heads, 1)), max(1, max_entries // 2), 32)
    return pow2_at_least(want, 1)


def check_supported(
    query: torch.Tensor, kv_cache: torch.Tensor, meta: PagedRopeMetadata, rope: RopeSpec
) -> None:
    """Shapes and dtypes this kernel takes, and triton-ascend (the kernel's block pointers are
    not in upstream Triton); anything else raises before a launch."""
    check_layout(query, kv_cache)
    _, _, bs, hkv, d = kv_cache.shape
    if query.shape[2] != d or rope.cos_sin_cache.shape[-1] != d or d % 2:
        raise ValueError(
            f"head dims must agree and be even: query {query.shape[2]}, cache {d}, "
            f"cos_sin_cache {rope.cos_sin_cache.shape[-1]}"
        )
    if query.shape[1] % hkv:
        raise ValueError(f"query heads {query.shape[1]} must be a multiple of KV heads {hkv}")
    if bs != meta.block_size or bs < 16 or bs & (bs - 1) and bs % 64:
        raise ValueError(
            f"block size {bs} (metadata {meta.block_size}) must be a power of two >= 16 or a "
            "multiple of 64 (Ascend: 128)"
        )
    check_tensors(query, kv_cache, meta)
    if not ops.have_triton_ascend():
        raise RuntimeError(
            "the triton-ascend kernel needs triton-ascend (pip install triton-ascend==3.2.2; see "
            f"docs/ascend.md), not upstream Triton (triton {triton.__version__} here): its tiles "
            "are block pointers (tl.make_block_ptr), which upstream Triton removed"
        )
    if query.device.type != "npu" and not INTERPRETED:
        raise RuntimeError(
            f"the triton-ascend kernel needs NPU tensors (got {query.device}); set "
            "TRITON_INTERPRET=1 before importing triton to run it on CPU"
        )


@dataclass(frozen=True)
class Launch:
    """One kernel launch: ``kernel[grid](*args, **kwargs)``."""

    kernel: Any  # a triton JITFunction
    grid: tuple[int, ...]
    args: tuple
    kwargs: dict[str, Any]


@dataclass(frozen=True)
class LaunchPlan:
    """A call's launches, in order, the tensor they fill and what to run after them."""

    out: torch.Tensor
    launches: list[Launch]
    finish: Callable[[], None] | None = None


def _step_tensors(meta: PagedRopeMetadata, device: torch.device):
    """The metadata as device int32 tensors, built once per step (memoised on the metadata,
    which every layer of the step shares)."""
    key = ("ascend-triton", str(device))
    if key not in meta.memo:
        meta.memo[key] = tuple(int32(t, device) for t in meta.tensors())
    return meta.memo[key]


_PREFILL_SCRATCH: dict[tuple[str, int, torch.dtype], torch.Tensor] = {}


def reserve_prefill_scratch(
    device: torch.device, cores: int, max_keys: int, head: int, dtype: torch.dtype
) -> torch.Tensor:
    """Allocate the prefill kernel's rotated-K scratch (``[cores, max_keys, head]``) now.

    Why: vLLM sizes the KV cache from what its profiling run leaves, and that run skips
    attention, so a scratch allocated at the first prefill would be memory vLLM never counted
    (20 cores x 32k keys x head 128 in bfloat16 is 168 MB). The NPU runner calls this before the
    profiling run (``MepicNPUModelRunner.profile_run``) with ``max_keys`` covering a whole
    block-table row (``core.request_limits.table_width``); every step then takes views of it."""
    key = (str(device), head, dtype)
    have = _PREFILL_SCRATCH.get(key)
    if have is None or have.shape[0] < cores or have.shape[1] < max_keys:
        _PREFILL_SCRATCH.pop(key, None)
        have = _PREFILL_SCRATCH[key] = torch.empty(
            cores, max_keys, head, device=device, dtype=dtype
        )
        logger.info(
            "MEPIC triton-ascend prefill scratch (untested on hardware): %d cores x %d keys x "
            "%d (%s), %.1f MB on %s",
            cores, max_keys, head, dtype, have.numel() * have.element_size() / 1e6, device,
        )  # fmt: skip
    return have


def prefill_scratch(
    device: torch.device, cores: int, max_keys: int, head: int, dtype: torch.dtype
) -> torch.Tensor:
    """A ``[cores, max_keys, head]`` view of the reserved scratch; where none was reserved or it
    is too small (a table wider than the reserved row), a new one, with a warning on an NPU
    (then vLLM's memory profile did not count it)."""
    have = _PREFILL_SCRATCH.get((str(device), head, dtype))
    if have is None or have.shape[0] < cores or have.shape[1] < max_keys:
        if device.type == "npu":
            logger.warning(
                "MEPIC triton-ascend prefill: no reserved scratch for %d cores x %d keys x %d "
                "(%s); allocating one outside vLLM's memory profile", cores, max_keys, head, dtype,
            )  # fmt: skip
        have = reserve_prefill_scratch(device, cores, max_keys, head, dtype)
    return have[:cores, :max_keys]


def _prefill_step(
    meta: PagedRopeMetadata,
    device: torch.device,
    block_q: int,
    cores: int,
    hkv: int,
    group: int,
    head: int,
    dtype: torch.dtype,
):
    """The prefill work items, each row's query index (``[T * group]``: rows are (query, head)
    pairs) and the per-program rotated-K scratch, once per step."""
    key = ("ascend-triton-prefill", str(device), block_q, cores, hkv, group, head, dtype)
    if key not in meta.memo:
        seqs, lo, hi = prefill_items(meta.query_start_loc, block_q, cores, hkv)
        num_items = torch.tensor([seqs.numel()], dtype=torch.int32, device=device)
        row_q_idx = int32(meta.query_indices, device).repeat_interleave(group)
        max_keys = max(1, meta.max_num_blocks * meta.block_size)
        scratch = prefill_scratch(device, cores, max_keys, head, dtype)
        meta.memo[key] = (
            num_items, seqs.to(device), lo.to(device), hi.to(device), row_q_idx, scratch
        )  # fmt: skip
    return meta.memo[key]


def plan_launches(
    query: torch.Tensor,
    kv_cache: torch.Tensor,
    meta: PagedRopeMetadata,
    rope: RopeSpec,
    scale: float,
    *,
    kernel: str | None = None,
    cores: int | None = None,
    block_q: int | None = None,
    block_n: int | None = None,
    num_splits: int | None = None,
    half_dots: bool | None = None,
) -> LaunchPlan:
    """The launches ``rope_paged_attention_ascend`` makes for these inputs, without running them:
    the compile test (``tests/ops/test_ascend_compile.py``) compiles exactly these, and the UB
    test reads their tiles.

    ``kernel`` forces ``"prefill"`` or ``"decode"`` (default: decode when every sequence has at
    most one query). ``cores``, ``block_q`` (queries per tile), ``block_n`` (keys per sub-tile)
    and ``num_splits`` override the launch choices (tests and benchmarks; the defaults come from
    ``choose_tiles``, within ``UB_BUDGET``). ``half_dots`` forces half-precision (True) or fp32
    (False) dots for fp16/bf16 inputs (default: see ``dots_in_fp32``).
    """
    if kernel not in (None, "prefill", "decode"):
        raise ValueError(f"kernel must be 'prefill' or 'decode', got {kernel!r}")
    device = query.device
    t, hq, d = query.shape
    bs, hkv = kv_cache.shape[2], kv_cache.shape[3]
    out = torch.empty_like(query)
    if t == 0:
        return LaunchPlan(out, [])
    if query.stride(-1) != 1:
        query = query.contiguous()
    k, v = kv_cache[0], kv_cache[1]
    if k.stride(-1) != 1 or v.stride(-1) != 1:
        raise ValueError("the KV cache's head dimension must be contiguous")
    decode = kernel == "decode" or (kernel is None and meta.max_query_len <= 1)
    if decode and meta.max_query_len > 1:
        raise ValueError(
            f"the decode kernel takes <= 1 query per sequence, not {meta.max_query_len}"
        )
    group = hq // hkv
    group_p = pow2_at_least(group, 1)
    dot_fp32 = dots_in_fp32(query.dtype, kv_cache.dtype, half_dots)
    cos_sin = rope.cos_sin_cache.to(device).contiguous()
    auto_q, auto_n = choose_tiles(d, group, bs, decode, bool(rope.is_neox_style))
    block_n = block_n or auto_n
    if block_n < 16 or block_n & (block_n - 1) or bs % block_n:
        raise ValueError(f"block_n {block_n} must be a power of two >= 16 dividing {bs}")
    block_q = block_q or auto_q
    if block_q & (block_q - 1):
        raise ValueError(f"block_q {block_q} must be a power of two")
    # tl.dot takes >= 16 rows (triton-ascend checks it even under its interpreter).
    block_q = max(block_q, 16 // group_p)
    cores = cores or num_cores(device)
    tables = _step_tensors(meta, device)
    half = d // 2
    common = dict(
        NUM_KV_HEADS=hkv,
        GROUP=group,
        GROUP_P=group_p,
        B=bs,
        BLOCK_N=block_n,
        HALF=half,
        HALF_P=pow2_at_least(half, 16),
        D=d,
        D_P=pow2_at_least(d, 16),
        IS_NEOX=bool(rope.is_neox_style),
        DOT_FP32=dot_fp32,
    )
    strides = launch_strides(query, out, k, v, tables[3], cos_sin)
    qk_scale = float(scale) * LOG2E

    if decode:
        splits = num_splits or decode_splits(cores, meta.num_seqs, hkv, meta.max_num_blocks)
        if splits & (splits - 1):
            raise ValueError(f"num_splits {splits} must be a power of two")
        part, lse = split_buffers(out, splits)
        work = meta.num_seqs * hkv * splits
        launches = [Launch(
            _decode_kernel, (min(cores, work),),
            (query, out, part, lse, k, v, cos_sin, meta.num_seqs, *tables, *strides, qk_scale),
            dict(NUM_SPLITS=splits, **{**common, "GROUP_P": pow2_at_least(group, 16)}),
        )]  # fmt: skip
        if splits > 1:
            launches.append(Launch(
                combine_kernel, (min(cores * 2, t * hq),),
                (part, lse, out, t, out.stride(0), out.stride(1)),
                dict(NUM_HEADS=hq, NUM_SPLITS=splits, D=d, D_P=common["D_P"]),
            ))  # fmt: skip
        return LaunchPlan(out, launches)

    dot_dtype = torch.float32 if dot_fp32 else query.dtype
    num_items, seqs, lo, hi, row_q_idx, scratch = _prefill_step(
        meta, device, block_q, cores, hkv, group, d, dot_dtype
    )
    # Rotated, pre-scaled queries and the output in (KV head, query, head) row order.
    q_rot = torch.empty(hkv, t * group, d, device=device, dtype=dot_dtype)
    out_rows = torch.empty(hkv, t * group, d, device=device, dtype=query.dtype)
    rope_q = {k: common[k] for k in ("NUM_KV_HEADS", "GROUP", "HALF", "HALF_P", "D", "D_P",
                                     "IS_NEOX")}  # fmt: skip
    launches = [
        Launch(
            _rope_q_kernel, (min(cores * 2, t * hkv),),
            (query, q_rot, cos_sin, tables[1], t, query.stride(0), query.stride(1),
             cos_sin.stride(0), qk_scale),
            dict(GROUP_P=pow2_at_least(group, 1), **rope_q),
        ),
        Launch(
            _prefill_kernel, (cores,),
            (q_rot, out_rows, k, v, cos_sin, scratch, num_items, seqs, lo, hi, row_q_idx,
             *tables[3:], t, *strides[4:], scratch.stride(0)),
            dict(ROWS=block_q * group_p, **{k: v for k, v in common.items() if k != "GROUP_P"}),
        ),
    ]  # fmt: skip

    def finish() -> None:
        out.copy_(out_rows.view(hkv, t, group, d).transpose(0, 1).reshape(t, hq, d))

    return LaunchPlan(out, launches, finish)


def rope_paged_attention_ascend(
    query: torch.Tensor,
    kv_cache: torch.Tensor,
    meta: PagedRopeMetadata,
    rope: RopeSpec,
    scale: float,
    **launch_options,
) -> torch.Tensor:
    """Fused-RoPE paged attention for Ascend; same contract and result as the torch reference.

    ``launch_options`` (``kernel``, ``cores``, ``block_q``, ``block_n``, ``num_splits``,
    ``half_dots``) override the launch choices: see ``plan_launches``.
    """
    check_supported(query, kv_cache, meta, rope)
    plan = plan_launches(query, kv_cache, meta, rope, scale, **launch_options)
    for launch in plan.launches:
        launch.kernel[launch.grid](*launch.args, **launch.kwargs)
    if plan.finish is not None:
        plan.finish()
    return plan.out
