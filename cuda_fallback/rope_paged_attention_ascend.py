"""Fused-RoPE paged attention written for triton-ascend (Ascend 910B): the NPU's default kernel.

UNTESTED ON HARDWARE: this kernel has never been compiled for or run on an Ascend NPU (no NPU and
no CANN toolkit on the machines it was built on). It is checked only under triton-ascend 3.2.0's
CPU interpreter and upstream Triton's (``tests/ops/test_triton_ascend.py``,
``tests/ops/test_triton.py``), against the dense oracle and the torch reference. The interpreter
does not catch UB overflow, lowering failures or silent scalarisation; the choices below follow
triton-ascend's documented constraints so that those are unlikely, not proven absent.

Same contract as ``cuda_fallback.rope_paged_attention`` (``ascend_mepic.ops.metadata``): K and V
un-rotated in ``[2, num_blocks, B, Hkv, D]`` (vllm-ascend's ``(2, num_blocks, 128, kv_heads,
head)``), scattered un-rotated queries, per-entry valid ranges and positions. What differs from
the GPU kernel, and why (triton-ascend's migration and performance guides):

* **Persistent grid.** Programs are bound to AI cores and a grid larger than the core count runs
  in batches, so the grid is the core count (``num_cores``) and each program loops over work items
  ``w = pid, pid + cores, ...``. The number of work items is read from a device tensor, so the
  launch shape depends only on the core count and the batch's sequence count (graph-capture
  friendly: no per-step scalar frozen into the grid).
* **One page per iteration.** Gathers (offsets loaded from memory) lower to scalar loops on
  Ascend. The kernel therefore walks a sequence's block table one entry at a time: the block id,
  first position and valid range are *scalars*, and the K/V tile of that entry is an affine
  ``[BLOCK_N, D]`` load (``block * stride + slot * stride + column``), as are its cos/sin rows
  (positions ``first - valid_start + slot``). Entries with an empty valid range or entirely after
  the tile's last query are skipped with a scalar branch, so a packed table's short runs cost
  nothing.
* **GQA rows.** A work item is (query tile, KV head); its rows are ``BLOCK_Q`` queries times the
  ``GROUP`` query heads that share the KV head, so each K/V page is read once per KV head and
  ``tl.dot`` gets ``BLOCK_Q * GROUP_P`` rows (the cube unit wants >= 16).
* **Masks in fp32.** Integer vector compares drop to scalar code on A2; the valid-range and causal
  masks compare float32 copies of slot and padded indices (exact below 2**24).
* **UB budget.** A2's unified buffer is 192 KB (about 96 KB usable with double buffering).
  Defaults: ``BLOCK_N = 64`` keys per sub-tile of a 128-slot block and 32 rows, i.e. bf16 K halves
  2 x 4 KB, V 16 KB, fp32 scores 8 KB, accumulator 16 KB (head 128); estimated, not measured.
* **Split-KV decode.** One query per sequence leaves cores idle when the batch is small, so the
  block table is split into ``num_splits`` ranges (from the core count), each writing a partial
  output and its log2-sum-exp; a combine kernel merges them.

Scores are ``q.k = q1.k1 + q2.k2`` on the rotated halves (neox: the two halves; GPT-J: even and odd
columns), online softmax in fp32 with exp2; dots take fp32 or the input's half dtype with fp32
accumulation (always fp32 under the interpreter, whose half-precision ``tl.dot`` is wrong).
"""

from __future__ import annotations

import logging
import math

import torch
import triton
import triton.language as tl

from ascend_mepic.ops.metadata import PagedRopeMetadata
from ascend_mepic.ops.rope import RopeSpec
from cuda_fallback.rope_paged_attention import INTERPRETED, prefill_tiles

logger = logging.getLogger(__name__)

SUPPORTED_DTYPES = (torch.float32, torch.float16, torch.bfloat16)
LOG2E = math.log2(math.e)
# Programs launched under the interpreter: fewer than the work items, so the persistent loop runs.
INTERPRETER_CORES = 3
# 910B3's AI-core count (triton-ascend's tutorials assume 20); used when the driver cannot say.
DEFAULT_NPU_CORES = 20


@triton.jit
def _rotated_halves(
    rows_ptr,
    pos,
    row_mask,
    cos_sin_ptr,
    stride_cs,
    HALF: tl.constexpr,
    HALF_P: tl.constexpr,
    IS_NEOX: tl.constexpr,
):
    """Load rows' two rotation halves ``[R, HALF_P]`` and rotate them at ``pos`` (fp32)."""
    c = tl.arange(0, HALF_P)
    if IS_NEOX:
        c1 = c
        c2 = c + HALF
    else:
        c1 = 2 * c
        c2 = 2 * c + 1
    mask = row_mask[:, None] & (c < HALF)[None, :]
    x1 = tl.load(rows_ptr[:, None] + c1[None, :], mask=mask, other=0.0).to(tl.float32)
    x2 = tl.load(rows_ptr[:, None] + c2[None, :], mask=mask, other=0.0).to(tl.float32)
    cs = cos_sin_ptr + pos.to(tl.int64)[:, None] * stride_cs + c[None, :]
    cos = tl.load(cs, mask=mask, other=0.0).to(tl.float32)
    sin = tl.load(cs + HALF, mask=mask, other=0.0).to(tl.float32)
    return x1 * cos - x2 * sin, x2 * cos + x1 * sin


@triton.jit
def _attend_entries(
    q1,
    q2,
    q_idx_f,
    m_i,
    l_i,
    acc,
    entry_lo,
    entry_hi,
    meta_row,
    k_head_ptr,
    v_head_ptr,
    stride_kb,
    stride_ks,
    stride_vb,
    stride_vs,
    block_tables_ptr,
    first_pos_ptr,
    valid_start_ptr,
    valid_end_ptr,
    cos_sin_ptr,
    stride_cs,
    B: tl.constexpr,
    BLOCK_N: tl.constexpr,
    HALF: tl.constexpr,
    HALF_P: tl.constexpr,
    D: tl.constexpr,
    D_P: tl.constexpr,
    IS_NEOX: tl.constexpr,
    DOT_FP32: tl.constexpr,
):
    """Online softmax of pre-scaled rotated queries over block-table entries [lo, hi).

    Per entry: scalar block id, first position and valid range, then ``B / BLOCK_N`` affine
    sub-tiles; a sub-tile with no valid slot, or wholly after every query, is skipped.
    """
    n = tl.arange(0, BLOCK_N)
    n_f = n.to(tl.float32)
    d = tl.arange(0, D_P)
    last_q = tl.max(q_idx_f, 0)
    for j in range(entry_lo, entry_hi):
        blk = tl.load(block_tables_ptr + meta_row + j).to(tl.int64)
        first = tl.load(first_pos_ptr + meta_row + j)
        v_start = tl.load(valid_start_ptr + meta_row + j)
        v_end = tl.load(valid_end_ptr + meta_row + j)
        for sub in tl.static_range(0, B, BLOCK_N):
            lo = tl.maximum(v_start, sub)
            hi = tl.minimum(v_end, sub + BLOCK_N)
            if (lo < hi) & ((j * B + lo).to(tl.float32) <= last_q):
                slot_f = n_f + sub
                real = (slot_f >= v_start.to(tl.float32)) & (slot_f < v_end.to(tl.float32))
                slot = (n + sub).to(tl.int64)
                k_rows = k_head_ptr + blk * stride_kb + slot * stride_ks
                k1, k2 = _rotated_halves(
                    k_rows, first - v_start + n + sub, real, cos_sin_ptr, stride_cs,
                    HALF, HALF_P, IS_NEOX,
                )  # fmt: skip
                if DOT_FP32:
                    s = tl.dot(q1, tl.trans(k1), input_precision="ieee")
                    s += tl.dot(q2, tl.trans(k2), input_precision="ieee")
                else:
                    s = tl.dot(q1, tl.trans(k1.to(q1.dtype)))
                    s += tl.dot(q2, tl.trans(k2.to(q2.dtype)))
                key_idx_f = slot_f + j * B
                allowed = real[None, :] & (key_idx_f[None, :] <= q_idx_f[:, None])
                s = tl.where(allowed, s, float("-inf"))
                m_new = tl.maximum(m_i, tl.max(s, 1))
                m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)
                alpha = tl.exp2(m_i - m_safe)
                p = tl.exp2(s - m_safe[:, None])
                l_i = l_i * alpha + tl.sum(p, 1)
                # Pad slots are never loaded: an uninitialised block may hold NaN (0 * NaN = NaN).
                v_rows = v_head_ptr + blk * stride_vb + slot * stride_vs
                v = tl.load(
                    v_rows[:, None] + d[None, :], mask=real[:, None] & (d < D)[None, :], other=0.0
                )
                acc = acc * alpha[:, None]
                if DOT_FP32:
                    acc += tl.dot(p, v.to(tl.float32), input_precision="ieee")
                else:
                    acc += tl.dot(p.to(v.dtype), v)
                m_i = m_new
    return m_i, l_i, acc


@triton.jit
def _prefill_kernel(
    q_ptr,
    out_ptr,
    k_ptr,
    v_ptr,
    cos_sin_ptr,
    num_tiles_ptr,
    tile_seq_ptr,
    tile_row_ptr,
    query_start_loc_ptr,
    query_pos_ptr,
    query_idx_ptr,
    block_tables_ptr,
    num_blocks_ptr,
    first_pos_ptr,
    valid_start_ptr,
    valid_end_ptr,
    stride_qt,
    stride_qh,
    stride_ot,
    stride_oh,
    stride_kb,
    stride_ks,
    stride_kh,
    stride_vb,
    stride_vs,
    stride_vh,
    stride_bt,
    stride_cs,
    qk_scale,
    NUM_KV_HEADS: tl.constexpr,
    GROUP: tl.constexpr,
    GROUP_P: tl.constexpr,
    BLOCK_Q: tl.constexpr,
    B: tl.constexpr,
    BLOCK_N: tl.constexpr,
    HALF: tl.constexpr,
    HALF_P: tl.constexpr,
    D: tl.constexpr,
    D_P: tl.constexpr,
    IS_NEOX: tl.constexpr,
    DOT_FP32: tl.constexpr,
):
    """Persistent: work item ``w`` = (query tile ``w // Hkv``, KV head ``w % Hkv``)."""
    ROWS: tl.constexpr = BLOCK_Q * GROUP_P
    r = tl.arange(0, ROWS)
    qi = r // GROUP_P
    g = r % GROUP_P
    d = tl.arange(0, D_P)
    num_work = tl.load(num_tiles_ptr) * NUM_KV_HEADS
    for w in range(tl.program_id(0), num_work, tl.num_programs(0)):
        tile = w // NUM_KV_HEADS
        kv_head = w % NUM_KV_HEADS
        seq = tl.load(tile_seq_ptr + tile)
        rows = tl.load(tile_row_ptr + tile) + qi
        row_mask = (rows < tl.load(query_start_loc_ptr + seq + 1)) & (g < GROUP)
        heads = kv_head * GROUP + g
        pos = tl.load(query_pos_ptr + rows, mask=row_mask, other=0)
        q_idx_f = tl.load(query_idx_ptr + rows, mask=row_mask, other=-1).to(tl.float32)
        q_rows = q_ptr + rows.to(tl.int64) * stride_qt + heads * stride_qh
        q1, q2 = _rotated_halves(
            q_rows, pos, row_mask, cos_sin_ptr, stride_cs, HALF, HALF_P, IS_NEOX
        )
        q1 = q1 * qk_scale
        q2 = q2 * qk_scale
        if not DOT_FP32:
            q1 = q1.to(q_ptr.dtype.element_ty)
            q2 = q2.to(q_ptr.dtype.element_ty)
        m_i = tl.full([ROWS], float("-inf"), tl.float32)
        l_i = tl.zeros([ROWS], tl.float32)
        acc = tl.zeros([ROWS, D_P], tl.float32)
        meta_row = seq.to(tl.int64) * stride_bt
        m_i, l_i, acc = _attend_entries(
            q1, q2, q_idx_f, m_i, l_i, acc, 0, tl.load(num_blocks_ptr + seq), meta_row,
            k_ptr + kv_head * stride_kh, v_ptr + kv_head * stride_vh,
            stride_kb, stride_ks, stride_vb, stride_vs,
            block_tables_ptr, first_pos_ptr, valid_start_ptr, valid_end_ptr,
            cos_sin_ptr, stride_cs, B, BLOCK_N, HALF, HALF_P, D, D_P, IS_NEOX, DOT_FP32,
        )  # fmt: skip
        out = acc / tl.where(l_i == 0.0, 1.0, l_i)[:, None]
        o_rows = out_ptr + rows.to(tl.int64) * stride_ot + heads * stride_oh
        tl.store(
            o_rows[:, None] + d[None, :],
            out.to(out_ptr.dtype.element_ty),
            mask=row_mask[:, None] & (d < D)[None, :],
        )


@triton.jit
def _decode_kernel(
    q_ptr,
    out_ptr,
    part_ptr,
    lse_ptr,
    k_ptr,
    v_ptr,
    cos_sin_ptr,
    num_seqs,
    query_start_loc_ptr,
    query_pos_ptr,
    query_idx_ptr,
    block_tables_ptr,
    num_blocks_ptr,
    first_pos_ptr,
    valid_start_ptr,
    valid_end_ptr,
    stride_qt,
    stride_qh,
    stride_ot,
    stride_oh,
    stride_kb,
    stride_ks,
    stride_kh,
    stride_vb,
    stride_vs,
    stride_vh,
    stride_bt,
    stride_cs,
    qk_scale,
    NUM_KV_HEADS: tl.constexpr,
    GROUP: tl.constexpr,
    GROUP_P: tl.constexpr,
    NUM_SPLITS: tl.constexpr,
    B: tl.constexpr,
    BLOCK_N: tl.constexpr,
    HALF: tl.constexpr,
    HALF_P: tl.constexpr,
    D: tl.constexpr,
    D_P: tl.constexpr,
    IS_NEOX: tl.constexpr,
    DOT_FP32: tl.constexpr,
):
    """Persistent: work item = (sequence, KV head, split); rows = the GROUP heads of its query
    (padded to ``GROUP_P`` >= 16 rows for ``tl.dot``)."""
    g = tl.arange(0, GROUP_P)
    d = tl.arange(0, D_P)
    num_work = num_seqs * NUM_KV_HEADS * NUM_SPLITS
    for w in range(tl.program_id(0), num_work, tl.num_programs(0)):
        split = w % NUM_SPLITS
        kv_head = (w // NUM_SPLITS) % NUM_KV_HEADS
        seq = w // (NUM_SPLITS * NUM_KV_HEADS)
        row = tl.load(query_start_loc_ptr + seq)
        count = tl.load(query_start_loc_ptr + seq + 1) - row
        # Vector masks only: the interpreter mishandles a scalar bool combined with a vector one.
        has_query = (count + tl.zeros([GROUP_P], tl.int32)) > 0
        row_mask = (g < GROUP) & has_query
        heads = kv_head * GROUP + g
        row_vec = row + tl.zeros([GROUP_P], tl.int32)
        pos = tl.load(query_pos_ptr + row_vec, mask=has_query, other=0)
        q_idx_f = tl.load(query_idx_ptr + row_vec, mask=row_mask, other=-1).to(tl.float32)
        q_rows = q_ptr + row.to(tl.int64) * stride_qt + heads * stride_qh
        q1, q2 = _rotated_halves(
            q_rows, pos, row_mask, cos_sin_ptr, stride_cs, HALF, HALF_P, IS_NEOX
        )
        q1 = q1 * qk_scale
        q2 = q2 * qk_scale
        if not DOT_FP32:
            q1 = q1.to(q_ptr.dtype.element_ty)
            q2 = q2.to(q_ptr.dtype.element_ty)
        nb = tl.where(count > 0, tl.load(num_blocks_ptr + seq), 0)
        per_split = tl.cdiv(nb, NUM_SPLITS)
        lo = tl.minimum(split * per_split, nb)
        hi = tl.minimum(lo + per_split, nb)
        m_i = tl.full([GROUP_P], float("-inf"), tl.float32)
        l_i = tl.zeros([GROUP_P], tl.float32)
        acc = tl.zeros([GROUP_P, D_P], tl.float32)
        m_i, l_i, acc = _attend_entries(
            q1, q2, q_idx_f, m_i, l_i, acc, lo, hi, seq.to(tl.int64) * stride_bt,
            k_ptr + kv_head * stride_kh, v_ptr + kv_head * stride_vh,
            stride_kb, stride_ks, stride_vb, stride_vs,
            block_tables_ptr, first_pos_ptr, valid_start_ptr, valid_end_ptr,
            cos_sin_ptr, stride_cs, B, BLOCK_N, HALF, HALF_P, D, D_P, IS_NEOX, DOT_FP32,
        )  # fmt: skip
        out = acc / tl.where(l_i == 0.0, 1.0, l_i)[:, None]
        mask = row_mask[:, None] & (d < D)[None, :]
        if NUM_SPLITS == 1:
            o_rows = out_ptr + row.to(tl.int64) * stride_ot + heads * stride_oh
            tl.store(o_rows[:, None] + d[None, :], out.to(out_ptr.dtype.element_ty), mask=mask)
        else:
            # Partials [T, Hq, NUM_SPLITS, D] and their log2-sum-exp [T, Hq, NUM_SPLITS] (fp32).
            part = (row.to(tl.int64) * (GROUP * NUM_KV_HEADS) + heads) * NUM_SPLITS + split
            tl.store(part_ptr + part[:, None] * D + d[None, :], out, mask=mask)
            safe_l = tl.where(l_i == 0.0, 1.0, l_i)
            lse = tl.where(l_i == 0.0, float("-inf"), m_i + tl.log2(safe_l))
            tl.store(lse_ptr + part, lse, mask=row_mask)


@triton.jit
def _combine_kernel(
    part_ptr,
    lse_ptr,
    out_ptr,
    num_rows,
    stride_ot,
    stride_oh,
    NUM_HEADS: tl.constexpr,
    NUM_SPLITS: tl.constexpr,
    D: tl.constexpr,
    D_P: tl.constexpr,
):
    """Persistent: merge the splits of each (query, head) by their log-sum-exp."""
    p = tl.arange(0, NUM_SPLITS)
    d = tl.arange(0, D_P)
    for w in range(tl.program_id(0), num_rows * NUM_HEADS, tl.num_programs(0)):
        row = w // NUM_HEADS
        head = w % NUM_HEADS
        base = (tl.zeros([], tl.int64) + w) * NUM_SPLITS
        lse = tl.load(lse_ptr + base + p)
        m = tl.max(lse, 0)
        weight = tl.exp2(lse - tl.where(m == float("-inf"), 0.0, m))
        part = tl.load(
            part_ptr + (base + p)[:, None] * D + d[None, :], mask=(d < D)[None, :], other=0.0
        )
        total = tl.sum(weight, 0)
        out = tl.sum(part * weight[:, None], 0) / tl.where(total == 0.0, 1.0, total)
        o = out_ptr + (tl.zeros([], tl.int64) + row) * stride_ot + head * stride_oh + d
        tl.store(o, out.to(out_ptr.dtype.element_ty), mask=d < D)


def _pow2_at_least(n: int, floor: int = 1) -> int:
    return max(floor, triton.next_power_of_2(n))


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
    return _pow2_at_least(want)


def check_supported(
    query: torch.Tensor, kv_cache: torch.Tensor, meta: PagedRopeMetadata, rope: RopeSpec
) -> None:
    """Shapes and dtypes this kernel takes; anything else raises before a launch."""
    if query.dim() != 3 or kv_cache.dim() != 5 or kv_cache.shape[0] != 2:
        raise ValueError(
            f"expected query [T, Hq, D] and kv_cache [2, num_blocks, B, Hkv, D], got "
            f"{tuple(query.shape)} and {tuple(kv_cache.shape)}"
        )
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
    for name, t in (("query", query), ("kv_cache", kv_cache)):
        if t.dtype not in SUPPORTED_DTYPES:
            raise TypeError(f"{name} dtype {t.dtype} not supported; use fp32, fp16 or bf16")
    if meta.query_positions.numel() != query.shape[0]:
        raise ValueError(
            f"metadata has {meta.query_positions.numel()} queries, query has {query.shape[0]}"
        )
    if kv_cache.device != query.device:
        raise ValueError(f"query on {query.device}, kv_cache on {kv_cache.device}")
    if query.device.type != "npu" and not INTERPRETED:
        raise RuntimeError(
            f"the triton-ascend kernel needs NPU tensors (got {query.device}); set "
            "TRITON_INTERPRET=1 before importing triton to run it on CPU"
        )


def _int32(t: torch.Tensor, device: torch.device) -> torch.Tensor:
    return t.to(device=device, dtype=torch.int32).contiguous()


def _step_tensors(meta: PagedRopeMetadata, device: torch.device, block_q: int):
    """The metadata as device int32 tensors plus the prefill tile list, built once per step
    (memoised on the metadata, which every layer of the step shares)."""
    key = ("ascend-triton", str(device), block_q)
    if key not in meta.memo:
        tables = tuple(
            _int32(t, device)
            for t in (
                meta.query_start_loc,
                meta.query_positions,
                meta.query_indices,
                meta.block_tables,
                meta.num_blocks,
                meta.block_first_pos,
                meta.block_valid_start,
                meta.block_valid_end,
            )
        )
        tile_seq, tile_row = prefill_tiles(meta.query_start_loc, block_q, device)
        num_tiles = torch.tensor([tile_seq.numel()], dtype=torch.int32, device=device)
        meta.memo[key] = (tables, (num_tiles, tile_seq, tile_row))
    return meta.memo[key]


def rope_paged_attention_ascend(
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
) -> torch.Tensor:
    """Fused-RoPE paged attention for Ascend; same contract and result as the torch reference.

    ``kernel`` forces ``"prefill"`` or ``"decode"`` (default: decode when every sequence has at
    most one query). ``cores``, ``block_q`` (queries per tile), ``block_n`` (keys per sub-tile)
    and ``num_splits`` override the launch choices (tests and benchmarks).
    """
    check_supported(query, kv_cache, meta, rope)
    if kernel not in (None, "prefill", "decode"):
        raise ValueError(f"kernel must be 'prefill' or 'decode', got {kernel!r}")
    device = query.device
    t, hq, d = query.shape
    bs, hkv = kv_cache.shape[2], kv_cache.shape[3]
    out = torch.empty_like(query)
    if t == 0:
        return out
    if query.stride(-1) != 1:
        query = query.contiguous()
    k, v = kv_cache[0], kv_cache[1]
    if k.stride(-1) != 1 or v.stride(-1) != 1:
        raise ValueError("the KV cache's head dimension must be contiguous")
    group = hq // hkv
    group_p = _pow2_at_least(group)
    block_n = block_n or min(bs, 64)
    if block_n < 16 or block_n & (block_n - 1) or bs % block_n:
        raise ValueError(f"block_n {block_n} must be a power of two >= 16 dividing {bs}")
    if block_q is None:
        block_q = max(1, 32 // group_p)
    if block_q & (block_q - 1):
        raise ValueError(f"block_q {block_q} must be a power of two")
    # tl.dot takes >= 16 rows (triton-ascend checks it even under its interpreter).
    block_q = max(block_q, 16 // group_p)
    cores = cores or num_cores(device)
    cos_sin = rope.cos_sin_cache.to(device).contiguous()
    tables, (num_tiles, tile_seq, tile_row) = _step_tensors(meta, device, block_q)
    loc, q_pos, q_idx, block_tables, nblocks, first, vstart, vend = tables
    half = d // 2
    common = dict(
        NUM_KV_HEADS=hkv,
        GROUP=group,
        GROUP_P=group_p,
        B=bs,
        BLOCK_N=block_n,
        HALF=half,
        HALF_P=_pow2_at_least(half, 16),
        D=d,
        D_P=_pow2_at_least(d, 16),
        IS_NEOX=bool(rope.is_neox_style),
        DOT_FP32=INTERPRETED or torch.float32 in (query.dtype, kv_cache.dtype),
    )
    strides = (
        query.stride(0),
        query.stride(1),
        out.stride(0),
        out.stride(1),
        k.stride(0),
        k.stride(1),
        k.stride(2),
        v.stride(0),
        v.stride(1),
        v.stride(2),
        block_tables.stride(0),
        cos_sin.stride(0),
    )
    metas = (loc, q_pos, q_idx, block_tables, nblocks, first, vstart, vend)
    qk_scale = float(scale) * LOG2E

    decode = kernel == "decode" or (kernel is None and meta.max_query_len <= 1)
    if decode and meta.max_query_len > 1:
        raise ValueError(
            f"the decode kernel takes <= 1 query per sequence, not {meta.max_query_len}"
        )
    if decode:
        splits = num_splits or decode_splits(cores, meta.num_seqs, hkv, meta.max_num_blocks)
        if splits & (splits - 1):
            raise ValueError(f"num_splits {splits} must be a power of two")
        part = lse = out  # placeholders when there is a single split
        if splits > 1:
            part = torch.empty(t, hq, splits, d, device=device, dtype=torch.float32)
            lse = torch.full((t, hq, splits), float("-inf"), device=device, dtype=torch.float32)
        work = meta.num_seqs * hkv * splits
        _decode_kernel[(min(cores, work),)](
            query, out, part, lse, k, v, cos_sin, meta.num_seqs, *metas, *strides, qk_scale,
            NUM_SPLITS=splits, **{**common, "GROUP_P": _pow2_at_least(group, 16)},
        )  # fmt: skip
        if splits > 1:
            _combine_kernel[(min(cores * 2, t * hq),)](
                part, lse, out, t, out.stride(0), out.stride(1),
                NUM_HEADS=hq, NUM_SPLITS=splits, D=d, D_P=common["D_P"],
            )  # fmt: skip
        return out

    _prefill_kernel[(cores,)](
        query, out, k, v, cos_sin, num_tiles, tile_seq, tile_row, *metas, *strides, qk_scale,
        BLOCK_Q=block_q, **common,
    )  # fmt: skip
    return out
