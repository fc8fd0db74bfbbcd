"""What MEPIC's two Triton kernels share: the CUDA kernel (``cuda_fallback.rope_paged_attention``)
and the triton-ascend kernel (``ascend_mepic.ops.triton_ascend``).

Both implement the contract of ``ascend_mepic.ops.metadata`` (the torch reference is the ground
truth) with the same arithmetic: queries and K rotated in fp32 (``rotate``), the score as the sum
of the two rotated halves' dots (``half_scores``), a flash-style online softmax in base 2
(``softmax_step``; scores are pre-scaled by ``LOG2E``), and split-KV decode merged by the
log2-sum-exp of each split (``log2_sum_exp``, ``combine_kernel``). How they walk the paged cache
differs (tiles of padded key indices on a GPU, persistent programs over block-table entries on an
NPU), so the kernels themselves stay in their own modules. Host side: input checks both make with
the same messages, the launch strides and the split-decode buffers.

Only Triton kernels import this module (it imports ``triton``). Every ``@triton.jit`` function
here is compiled by upstream Triton (CUDA, and its interpreter) and by triton-ascend
(``tests/ops/test_ascend_compile.py`` runs its ``ttir`` and ``ttadapter`` stages over the
combine kernel and every helper the NPU kernels call).
"""

from __future__ import annotations

import math
import os

import torch
import triton
import triton.language as tl

from ascend_mepic.ops.metadata import PagedRopeMetadata

SUPPORTED_DTYPES = (torch.float32, torch.float16, torch.bfloat16)
LOG2E = math.log2(math.e)


def _interpreting() -> bool:
    """Whether ``triton.jit`` made interpreted kernels when this module was imported."""
    knobs = getattr(triton, "knobs", None)
    if knobs is not None:
        return bool(knobs.runtime.interpret)
    return os.environ.get("TRITON_INTERPRET", "0").lower() in ("1", "true", "on", "yes")


INTERPRETED = _interpreting()


def pow2_at_least(n: int, floor: int) -> int:
    """The smallest power of two >= ``n`` and >= ``floor`` (``tl.arange`` and ``tl.dot`` sizes:
    ``tl.dot`` takes >= 16 rows and columns, a plain ``tl.arange`` any power of two)."""
    return max(floor, triton.next_power_of_2(n))


def int32(t: torch.Tensor, device: torch.device) -> torch.Tensor:
    """``t`` as a contiguous int32 tensor on ``device`` (the kernels' index type)."""
    return t.to(device=device, dtype=torch.int32).contiguous()


def check_layout(query: torch.Tensor, kv_cache: torch.Tensor) -> None:
    """``query [T, Hq, D]`` and ``kv_cache [2, num_blocks, B, Hkv, D]``, else ``ValueError``."""
    if query.dim() != 3 or kv_cache.dim() != 5 or kv_cache.shape[0] != 2:
        raise ValueError(
            f"expected query [T, Hq, D] and kv_cache [2, num_blocks, B, Hkv, D], got "
            f"{tuple(query.shape)} and {tuple(kv_cache.shape)}"
        )


def check_tensors(query: torch.Tensor, kv_cache: torch.Tensor, meta: PagedRopeMetadata) -> None:
    """Dtypes both kernels take, one metadata row per query, query and cache on one device."""
    for name, t in (("query", query), ("kv_cache", kv_cache)):
        if t.dtype not in SUPPORTED_DTYPES:
            raise TypeError(f"{name} dtype {t.dtype} not supported; use fp32, fp16 or bf16")
    if meta.query_positions.numel() != query.shape[0]:
        raise ValueError(
            f"metadata has {meta.query_positions.numel()} queries, query has {query.shape[0]}"
        )
    if kv_cache.device != query.device:
        raise ValueError(f"query on {query.device}, kv_cache on {kv_cache.device}")


def launch_strides(
    query: torch.Tensor,
    out: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    block_tables: torch.Tensor,
    cos_sin: torch.Tensor,
) -> tuple[int, ...]:
    """The element strides the kernels take, in their parameter order: ``stride_qt, stride_qh,
    stride_ot, stride_oh, stride_kb, stride_ks, stride_kh, stride_vb, stride_vs, stride_vh,
    stride_bt, stride_cs`` (K and V: ``[num_blocks, B, Hkv, D]``)."""
    return (
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


def split_buffers(out: torch.Tensor, splits: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Split decode's partial outputs ``[T, Hq, splits, D]`` and their log2-sum-exp
    ``[T, Hq, splits]`` (fp32; -inf: a split that saw no key), which ``combine_kernel`` merges.
    One split writes ``out`` directly: ``out`` stands in for both (never read)."""
    if splits <= 1:
        return out, out
    t, hq, d = out.shape
    part = torch.empty(t, hq, splits, d, device=out.device, dtype=torch.float32)
    lse = torch.full((t, hq, splits), float("-inf"), device=out.device, dtype=torch.float32)
    return part, lse


@triton.jit
def rotate(x1, x2, cos, sin):
    """RoPE on the rotation pairs ``(x1, x2)`` (fp32 tiles): the two rotated halves."""
    return x1 * cos - x2 * sin, x2 * cos + x1 * sin


@triton.jit
def half_scores(q1, q2, k1, k2, DOT_FP32: tl.constexpr):
    """Scores ``q.k = q1.k1 + q2.k2`` of the rotated halves, rows of ``q`` by rows of ``k``:
    fp32 operands (``DOT_FP32``, ``ieee`` precision) or K cast to the queries' dtype, fp32
    accumulation either way."""
    if DOT_FP32:
        s = tl.dot(q1, tl.trans(k1), input_precision="ieee")
        s += tl.dot(q2, tl.trans(k2), input_precision="ieee")
    else:
        s = tl.dot(q1, tl.trans(k1.to(q1.dtype)))
        s += tl.dot(q2, tl.trans(k2.to(q2.dtype)))
    return s


@triton.jit
def softmax_step(s, allowed, m_i, l_i):
    """One tile of an online softmax in base 2 (scores pre-scaled by ``LOG2E``): masks ``s`` to
    ``allowed``, and returns the tile's weights ``p``, the factor ``alpha`` that rescales what
    was accumulated so far, and the new running max and sum. A row that has seen no allowed key
    yet keeps max -inf and gets ``p = 0``, ``alpha = 1`` (no NaN)."""
    s = tl.where(allowed, s, float("-inf"))
    m_new = tl.maximum(m_i, tl.max(s, 1))
    m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)
    alpha = tl.exp2(m_i - m_safe)
    p = tl.exp2(s - m_safe[:, None])
    return p, alpha, m_new, l_i * alpha + tl.sum(p, 1)


@triton.jit
def normalize(acc, l_i):
    """The attention output of the accumulated rows; a row that saw no key stays 0."""
    return acc / tl.where(l_i == 0.0, 1.0, l_i)[:, None]


@triton.jit
def log2_sum_exp(m_i, l_i):
    """A split's log2-sum-exp of its scores (-inf where it saw no key), for ``combine_kernel``."""
    return tl.where(l_i == 0.0, float("-inf"), m_i + tl.log2(tl.where(l_i == 0.0, 1.0, l_i)))


@triton.jit
def combine_kernel(
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
    """Merge the splits of each (query, head) by their log2-sum-exp (``split_buffers``' layout).

    Persistent: program ``i`` of ``n`` merges (query, head) pairs ``i, i + n, ...`` of
    ``num_rows * NUM_HEADS``. The CUDA launcher starts one program per pair, the triton-ascend
    one about twice the AI-core count (a larger grid runs in batches there).
    """
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
