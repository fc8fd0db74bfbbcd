"""Fused read-time RoPE attention for Ascend 910B, composed from documented torch_npu ops.

UNTESTED ON HARDWARE: this path has never run on an Ascend 910B; it is checked only against a torch
test double of the documented torch_npu semantics (``tests/ops/npu_double.py``). On the NPU the
default is the triton-ascend kernel (``cuda_fallback/rope_paged_attention_ascend.py``); this
composition is the fallback (``ASCEND_MEPIC_ATTN_IMPL=npu``), for when triton-ascend is missing
or rejects a shape.

No torch_npu op rotates paged K by position, and FIA's paged mode cannot skip MEPIC's pad slots or
give a key a position of its own. So, per step, once (``plan_step``, host-side and vectorised,
memoised on the metadata that every layer shares):

* each sequence's real keys are compacted, in causal (padded) order, into a dense per-step
  **scratch** paged cache with 128-token blocks: key ``r`` of sequence ``s`` goes to scratch slot
  ``scratch_start[s] * 128 + r``;
* each query sees a prefix of its sequence's compacted keys (``visible`` keys: those whose padded
  index is not after its own). Queries are cut into **runs**, maximal groups of consecutive rows
  of one sequence whose visible counts grow by exactly one. A run is one FIA batch with
  ``sparse_mode=3`` (causal from the bottom-right corner: query ``i`` of ``q_len`` sees keys
  ``0 .. kv_len - q_len + i``), which is exactly the run's visibility. A prefill with chunk
  compiles and fresh tokens has a few runs per sequence; decode has one per sequence.

Per layer (no host sync, no data-dependent shapes, no per-sequence loop or dense mask):
gather the real keys' K/V rows (``index`` with the step's block/slot tensors), rotate K and Q with
``npu_rotary_mul`` (cos/sin gathered once per step), write K/V into the scratch cache with
``npu_scatter_pa_kv_cache`` and call ``npu_fused_infer_attention_score`` once per group of at most
``FIA_MAX_BATCH`` runs in TND paged mode. FIA's length arguments are host integer lists: they are
per-step data computed with the plan (vllm-ascend's graph mode updates its own FIA lists per step
the same way; wiring this path into ACL graph capture is not done).

Why not ``npu_mrope``: it rotates a query and a key tensor at the same positions; MEPIC's keys have
positions and counts of their own, so it would rotate a dummy tensor each call.

Assumed torch_npu semantics (op-plugin docs, Atlas A2; the double cites each source):
``npu_rotary_mul(x, r1, r2, rotary_mode)`` = ``r1 * x + r2 * rotate(x)`` with 1S1D ``r1``/``r2``;
``npu_scatter_pa_kv_cache(key, value, key_cache, value_cache, slot_mapping, cache_mode="Norm")``
writes rows at distinct flat slots of ``[num_blocks, block_size, N, D]`` fp16/bf16 caches;
``npu_fused_infer_attention_score`` in ``TND`` with ``block_table``: ``actual_seq_lengths`` are
cumulative query ends, ``actual_seq_lengths_kv`` per-batch key lengths, cache
``(num_blocks, 128, KV_N * D)``, D = 128, fp16/bf16 only, ``num_blocks`` >= the sum of the
batches' block counts, ``sparse_mode=3`` with the 2048 x 2048 upper-triangular mask.
Float32 queries are rotated in float32 and attended in ``FIA_FALLBACK_DTYPE`` (bfloat16).
"""

from __future__ import annotations

from dataclasses import dataclass
from types import ModuleType
from typing import Any, Protocol

import torch

from ascend_mepic.ops.metadata import PagedRopeMetadata
from ascend_mepic.ops.rope import RopeSpec

# Dtypes npu_fused_infer_attention_score takes for query/key/value on Atlas A2 (910B).
FIA_DTYPES: tuple[torch.dtype, ...] = (torch.float16, torch.bfloat16)
FIA_FALLBACK_DTYPE = torch.bfloat16
FIA_MAX_GQA_RATIO = 64
FIA_MAX_HEADS = 256
FIA_TND_HEAD_DIMS = (128,)  # TND paged mode on A2 with key and value of one shape
FIA_MAX_BATCH = 4096  # runs per FIA call
SCRATCH_BLOCK = 128  # FIA's paged block size (TND, A2)
CAUSAL_MASK_SIZE = 2048  # sparse_mode=3 takes this "optimized" mask


class NpuUnavailableError(ImportError):
    """torch_npu (and the CANN toolkit behind it) is not usable in this process."""


class NpuOps(Protocol):
    """The torch_npu entry points this module calls (torch_npu itself, or a test double)."""

    def npu_rotary_mul(
        self, input: torch.Tensor, r1: torch.Tensor, r2: torch.Tensor, rotary_mode: str = ...
    ) -> torch.Tensor: ...

    def npu_scatter_pa_kv_cache(
        self,
        key: torch.Tensor,
        value: torch.Tensor,
        key_cache: torch.Tensor,
        value_cache: torch.Tensor,
        slot_mapping: torch.Tensor,
        **kwargs: Any,
    ) -> None: ...

    def npu_fused_infer_attention_score(
        self, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, **kwargs: Any
    ) -> tuple[torch.Tensor, torch.Tensor]: ...


def _torch_npu() -> ModuleType:
    """Import torch_npu lazily, so that this module imports on machines without CANN."""
    try:
        import torch_npu
    except (ImportError, OSError) as exc:
        raise NpuUnavailableError(
            "the Ascend attention path (ASCEND_MEPIC_ATTN_IMPL=npu) needs torch_npu with the CANN "
            f"toolkit on an Ascend NPU (910B); importing torch_npu failed: {type(exc).__name__}: "
            f"{exc}. Elsewhere use ASCEND_MEPIC_ATTN_IMPL=reference or triton."
        ) from exc
    return torch_npu


def get_npu_ops() -> NpuOps:
    """The torch_npu implementation; tests replace this function with one returning a double."""
    return _torch_npu()  # type: ignore[return-value]


def check_npu_supported(num_heads: int, num_kv_heads: int, head_size: int) -> None:
    """Reject shapes outside the documented limits before launching anything on the device."""
    problems = []
    if num_heads % num_kv_heads or num_heads // num_kv_heads > FIA_MAX_GQA_RATIO:
        problems.append(
            f"query heads {num_heads} must be a multiple of KV heads {num_kv_heads} "
            f"with ratio <= {FIA_MAX_GQA_RATIO}"
        )
    if num_heads > FIA_MAX_HEADS:
        problems.append(f"query heads {num_heads} > {FIA_MAX_HEADS}")
    if head_size not in FIA_TND_HEAD_DIMS:
        problems.append(
            f"head size {head_size}: FIA's TND paged mode takes {FIA_TND_HEAD_DIMS} on A2 "
            "(use the triton-ascend kernel, ASCEND_MEPIC_ATTN_IMPL=triton-ascend)"
        )
    if problems:
        raise ValueError("unsupported by the torch_npu composition: " + "; ".join(problems))


@dataclass(frozen=True)
class FiaGroup:
    """One FIA call: query rows ``[row_start, row_end)`` cut into runs (FIA batches)."""

    row_start: int
    row_end: int
    block_table: torch.Tensor  # [runs, width] int32: scratch blocks of each run's sequence
    query_ends: list[int]  # cumulative, relative to row_start
    kv_lens: list[int]  # per run


@dataclass(frozen=True)
class NpuStepPlan:
    """Everything every layer of a step reuses: gathers, rotations, scratch slots, FIA calls."""

    key_blocks: torch.Tensor  # [N] block id of each real key, in (sequence, padded) order
    key_slots: torch.Tensor  # [N] its slot in the block
    scratch_slots: torch.Tensor  # [N] its flat scratch slot
    key_cos: torch.Tensor  # [1, N, 1, D] float32, in rotary_mode's layout
    key_sin: torch.Tensor
    query_cos: torch.Tensor  # [1, T, 1, D]
    query_sin: torch.Tensor
    num_scratch_blocks: int
    groups: tuple[FiaGroup, ...]
    blind_rows: torch.Tensor | None  # [T] bool: queries that see no key (output 0)


def _cos_sin(
    cache: torch.Tensor, positions: torch.Tensor, neox: bool
) -> tuple[torch.Tensor, torch.Tensor]:
    """Full-width cos/sin ``[1, S, 1, D]`` (1S1D) in the layout ``rotary_mode`` expects."""
    cos, sin = cache.index_select(0, positions.long()).chunk(2, dim=-1)
    if neox:
        cos, sin = torch.cat((cos, cos), dim=-1), torch.cat((sin, sin), dim=-1)
    else:
        cos, sin = cos.repeat_interleave(2, dim=-1), sin.repeat_interleave(2, dim=-1)
    return cos[None, :, None, :].contiguous(), sin[None, :, None, :].contiguous()


def plan_step(meta: PagedRopeMetadata, rope: RopeSpec, device: torch.device) -> NpuStepPlan:
    """Build the step's plan on the host from the metadata (CPU copies preferred: a device copy
    costs one transfer here, once per step)."""
    bs = meta.block_size
    tables = meta.block_tables.to("cpu", torch.int64)
    num_seqs, width = tables.shape
    first = meta.block_first_pos.to("cpu", torch.int64)
    vstart = meta.block_valid_start.to("cpu", torch.int64)
    vend = meta.block_valid_end.to("cpu", torch.int64)
    nblocks = meta.num_blocks.to("cpu", torch.int64)
    slot = torch.arange(bs)
    in_table = torch.arange(width)[None, :] < nblocks[:, None]
    real = in_table[..., None] & (slot >= vstart[..., None]) & (slot < vend[..., None])
    seq_of, entry, key_slot = real.nonzero(as_tuple=True)  # (sequence, padded index) order
    key_block = tables[seq_of, entry]
    key_pos = first[seq_of, entry] + key_slot - vstart[seq_of, entry]
    padded = entry * bs + key_slot

    keys_per_seq = torch.bincount(seq_of, minlength=num_seqs)
    seq_key_start = torch.cumsum(keys_per_seq, 0) - keys_per_seq
    rank = torch.arange(seq_of.numel()) - seq_key_start[seq_of]
    blocks_per_seq = (keys_per_seq + SCRATCH_BLOCK - 1) // SCRATCH_BLOCK
    seq_block_start = torch.cumsum(blocks_per_seq, 0) - blocks_per_seq
    scratch_slot = seq_block_start[seq_of] * SCRATCH_BLOCK + rank
    sink = int(blocks_per_seq.sum())  # a block for queries that see nothing (output zeroed)

    loc = meta.query_start_loc.to("cpu", torch.int64)
    q_seq = torch.repeat_interleave(torch.arange(num_seqs), loc[1:] - loc[:-1])
    q_idx = meta.query_indices.to("cpu", torch.int64)
    span = width * bs + 1
    ordered = seq_of * span + padded  # ascending: nonzero walks (sequence, entry, slot)
    visible = torch.searchsorted(ordered, q_seq * span + q_idx, right=True) - seq_key_start[q_seq]

    t = q_seq.numel()
    blind = visible == 0
    run_start = torch.ones(t, dtype=torch.bool)
    if t > 1:
        run_start[1:] = (
            (q_seq[1:] != q_seq[:-1]) | (visible[1:] != visible[:-1] + 1) | blind[1:] | blind[:-1]
        )
    first_rows = run_start.nonzero().flatten()
    run_of = torch.cumsum(run_start.long(), 0) - 1
    last_rows = torch.cat((first_rows[1:] - 1, torch.tensor([t - 1])))
    run_kv = visible[last_rows].clamp(min=1)  # blind runs read one key of the sink block
    run_blind = blind[first_rows]
    run_blocks = (run_kv + SCRATCH_BLOCK - 1) // SCRATCH_BLOCK
    run_base = torch.where(run_blind, sink, seq_block_start[q_seq[first_rows]])

    groups = []
    num_runs = first_rows.numel()
    needed = sink + 1
    for g0 in range(0, num_runs, FIA_MAX_BATCH):
        g1 = min(g0 + FIA_MAX_BATCH, num_runs)
        row0 = int(first_rows[g0])
        row1 = int(last_rows[g1 - 1]) + 1
        blocks = run_blocks[g0:g1]
        table = run_base[g0:g1, None] + torch.arange(int(blocks.max()))[None, :]
        table = torch.where(torch.arange(table.shape[1])[None, :] < blocks[:, None], table, 0)
        ends = torch.bincount(run_of[row0:row1] - g0, minlength=g1 - g0).cumsum(0)
        groups.append(
            FiaGroup(row0, row1, table.to(device, torch.int32), ends.tolist(),
                     run_kv[g0:g1].tolist())
        )  # fmt: skip
        needed = max(needed, int(blocks.sum()))  # FIA: num_blocks >= the batches' blocks
    cache = rope.cos_sin_cache.to("cpu", torch.float32)
    neox = rope.is_neox_style
    key_cos, key_sin = _cos_sin(cache, key_pos, neox)
    query_cos, query_sin = _cos_sin(cache, meta.query_positions.to("cpu", torch.int64), neox)
    return NpuStepPlan(
        key_blocks=key_block.to(device),
        key_slots=key_slot.to(device),
        scratch_slots=scratch_slot.to(device, torch.int32),
        key_cos=key_cos.to(device),
        key_sin=key_sin.to(device),
        query_cos=query_cos.to(device),
        query_sin=query_sin.to(device),
        num_scratch_blocks=needed,
        groups=tuple(groups),
        blind_rows=blind.to(device) if bool(blind.any()) else None,
    )


_CAUSAL_MASKS: dict[str, torch.Tensor] = {}


def causal_mask(device: torch.device) -> torch.Tensor:
    """sparse_mode=3's mask: 2048 x 2048, 1 strictly above the diagonal (int8), one per device."""
    key = str(device)
    if key not in _CAUSAL_MASKS:
        ones = torch.ones(CAUSAL_MASK_SIZE, CAUSAL_MASK_SIZE, dtype=torch.int8)
        _CAUSAL_MASKS[key] = torch.triu(ones, diagonal=1).to(device)
    return _CAUSAL_MASKS[key]


def rope_paged_attention_npu(
    query: torch.Tensor,
    kv_cache: torch.Tensor,
    meta: PagedRopeMetadata,
    rope: RopeSpec,
    scale: float,
) -> torch.Tensor:
    """Attention over un-rotated paged KV with RoPE fused at read time; returns ``[T, Hq, D]``."""
    ops = get_npu_ops()
    t, hq, d = query.shape
    if t == 0:
        return torch.empty_like(query)
    _, _, _, hkv, _ = kv_cache.shape
    check_npu_supported(hq, hkv, d)
    device = kv_cache.device
    key = ("npu-plan", str(device))
    if key not in meta.memo:
        meta.memo[key] = plan_step(meta, rope, device)
    plan: NpuStepPlan = meta.memo[key]
    attn_dtype = query.dtype if query.dtype in FIA_DTYPES else FIA_FALLBACK_DTYPE
    mode = "half" if rope.is_neox_style else "interleave"

    k = kv_cache[0][plan.key_blocks, plan.key_slots].float()  # [N, Hkv, D], strides honoured
    k = ops.npu_rotary_mul(k[None].contiguous(), plan.key_cos, plan.key_sin, rotary_mode=mode)
    v = kv_cache[1][plan.key_blocks, plan.key_slots]
    scratch_k = torch.empty(plan.num_scratch_blocks, SCRATCH_BLOCK, hkv, d, dtype=attn_dtype,
                            device=device)  # fmt: skip
    scratch_v = torch.empty_like(scratch_k)
    ops.npu_scatter_pa_kv_cache(
        k[0].to(attn_dtype).contiguous(),
        v.to(attn_dtype).contiguous(),
        scratch_k,
        scratch_v,
        plan.scratch_slots,
        cache_mode="Norm",
    )
    q = ops.npu_rotary_mul(
        query.float()[None].contiguous(), plan.query_cos, plan.query_sin, rotary_mode=mode
    )[0].to(attn_dtype)
    paged_k = scratch_k.view(plan.num_scratch_blocks, SCRATCH_BLOCK, hkv * d)
    paged_v = scratch_v.view(plan.num_scratch_blocks, SCRATCH_BLOCK, hkv * d)
    out = torch.empty(t, hq, d, dtype=attn_dtype, device=device)
    for group in plan.groups:
        attn, _ = ops.npu_fused_infer_attention_score(
            q[group.row_start : group.row_end].contiguous(),
            paged_k,
            paged_v,
            atten_mask=causal_mask(device),
            block_table=group.block_table,
            block_size=SCRATCH_BLOCK,
            actual_seq_lengths=group.query_ends,
            actual_seq_lengths_kv=group.kv_lens,
            num_heads=hq,
            num_key_value_heads=hkv,
            scale=scale,
            input_layout="TND",
            sparse_mode=3,
            inner_precise=0,
        )
        out[group.row_start : group.row_end] = attn
    if plan.blind_rows is not None:
        out = torch.where(plan.blind_rows[:, None, None], 0, out)
    return out.to(query.dtype)
