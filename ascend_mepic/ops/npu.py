"""Fused read-time RoPE attention for Ascend 910B, composed from documented torch_npu ops.

UNTESTED ON HARDWARE: this path has never run on an Ascend 910B; it is checked only against a torch
test double of the documented torch_npu semantics (``tests/ops/npu_double.py``). On the NPU it is
the default for head sizes FIA's TND paged mode takes (64 and 128) in float16/bfloat16; the
triton-ascend kernel (``ascend_mepic/ops/triton_ascend.py``) takes the rest
(``ops.npu_default``); ``ASCEND_MEPIC_ATTN_IMPL=npu`` forces this one.

No torch_npu op rotates paged K by position, and FIA's paged mode cannot skip MEPIC's pad slots or
give a key a position of its own. So, per step, once (``plan_step``, host-side and vectorised,
memoised on the metadata that every layer shares):

* each sequence's real keys are compacted, in causal (padded) order, into a **scratch** paged
  cache with 128-token blocks; a sequence's keys start at a block boundary;
* each query sees a prefix of its sequence's compacted keys (``visible`` keys: those whose padded
  index is not after its own). Queries are cut into **runs**, maximal groups of consecutive rows
  of one sequence whose visible counts grow by exactly one. A run is one FIA batch with
  ``sparse_mode=3`` (causal from the bottom-right corner: query ``i`` of ``q_len`` sees keys
  ``0 .. kv_len - q_len + i``), which is exactly the run's visibility;
* sequences are packed into **passes** whose keys fit the scratch, and each pass's runs into FIA
  calls (at most ``FIA_MAX_BATCH`` runs, ``FIA_TND_MAX_TOKENS`` query rows, and blocks the pass
  holds). The step uploads one int32 ``[3, slots]`` table (each scratch slot's K row, V row and
  RoPE position) plus the calls' block tables; cos/sin never leave the device.

Per layer and pass (no host sync, no per-sequence loop or dense mask): ``index_select`` the
pass's K and V rows from a contiguous ``[rows, Hkv, D]`` view of the layer's cache straight into
the scratch, cos/sin rows from a device table into the scratch, rotate K with
``npu_rotary_mul`` and call ``npu_fused_infer_attention_score`` in TND paged mode.

Memory (why: vLLM's profiling run skips attention, so whatever attention allocates is invisible
to the KV-cache sizing). The scratch (``NpuScratch``) is allocated once per device at start-up,
before vLLM's profiling run (``reserve_scratch``, called by the NPU model runner), and reused by
every layer and step. With ``P`` scratch keys (``SCRATCH_KEYS_ENV``, default
``DEFAULT_SCRATCH_KEYS`` = 65,536, never fewer than ``max_model_len``), ``e`` the cache's element
size, and a ``max_position``-row RoPE table:

    persistent  P*(2*Hkv*D*e + 2*D*e + 12) + 2*max_position*D*e
    per pass    + P*Hkv*D*e (npu_rotary_mul's output, also touched at reservation)
    per step    + about 16*T*Hq*D (query rotation, output) + int tables O(N) and O(T) bytes

independent of the number of keys N a step reads. Qwen2.5-7B (28/4 heads, D 128, bf16,
max_position 32,768): P = 65,536 gives 168.6 MB + 16.8 MB persistent and 67.1 MB per pass; the
former whole-batch path needed about 18*N*Hkv*D bytes, 4.8 GB per layer at 128 sequences of 4k
tokens. ``tests/ops/test_npu_memory.py`` measures it with the allocator.

FIA's length arguments are host integer lists: per-step data computed with the plan (vllm-ascend's
graph mode updates its own FIA lists per step the same way; wiring this path into ACL graph
capture is not done).

Why not ``npu_mrope``: it rotates a query and a key tensor at the same positions; MEPIC's keys have
positions and counts of their own, so it would rotate a dummy tensor each call.

Assumed torch_npu semantics (op-plugin docs, CANN aclnn docs, Atlas A2; the double cites each):
``npu_rotary_mul(x, r1, r2, rotary_mode)`` = ``r1 * x + r2 * rotate(x)`` with 1S1D ``r1``/``r2``
of ``x``'s dtype; ``npu_fused_infer_attention_score`` in ``TND`` with ``block_table``:
``actual_seq_lengths`` are cumulative query ends, ``actual_seq_lengths_kv`` per-batch key
lengths, cache ``(num_blocks, 128, KV_N * D)``, fp16/bf16 only, ``num_blocks`` >= the sum of the
batches' block counts, ``sparse_mode=3`` with the 2048 x 2048 upper-triangular mask, head size 64
or 128 (any head size <= 256 for GQA/MQA with ``inner_precise=0``: aclnnFusedInferAttentionScoreV4,
CANN 9.x, Atlas A2 TND table). Float32 queries are rotated in float32 and attended in
``FIA_FALLBACK_DTYPE`` (bfloat16).
"""

from __future__ import annotations

import logging
import os
from dataclasses import dataclass
from types import ModuleType
from typing import Any, Protocol

import torch

from ascend_mepic.ops.metadata import PagedRopeMetadata
from ascend_mepic.ops.rope import RopeSpec

logger = logging.getLogger(__name__)

# Dtypes npu_fused_infer_attention_score takes for query/key/value on Atlas A2 (910B).
FIA_DTYPES: tuple[torch.dtype, ...] = (torch.float16, torch.bfloat16)
FIA_FALLBACK_DTYPE = torch.bfloat16
FIA_MAX_GQA_RATIO = 64
FIA_MAX_HEADS = 256
# TND paged mode on A2, key and value of one shape, any GQA ratio (MHA included):
# aclnnFusedInferAttentionScoreV4.md (CANN 9.1.0, Atlas A2 TND table), "Q_D、K_D、V_D都等于64
# 或Q_D、K_D、V_D都等于128"; and, for GQA/MQA with inner_precise=0 only, "Q_D=K_D=V_D且小于等于256".
FIA_TND_HEAD_DIMS: tuple[int, ...] = (64, 128)
FIA_TND_GQA_MAX_HEAD_DIM = 256
FIA_MAX_BATCH = 4096  # runs per FIA call
FIA_TND_MAX_TOKENS = 65536  # query rows per TND call (torch_npu 2.10 docstring: "T小于等于65536")
SCRATCH_BLOCK = 128  # FIA's paged block size (TND, A2)
CAUSAL_MASK_SIZE = 2048  # sparse_mode=3 takes this "optimized" mask
SCRATCH_KEYS_ENV = "ASCEND_MEPIC_NPU_SCRATCH_KEYS"
DEFAULT_SCRATCH_KEYS = 65536


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


def fia_takes(head_size: int, group: int | None) -> bool:
    """FIA's TND paged mode on A2 takes this head size at this GQA ratio (None: unknown, taken
    as MHA): 64 or 128 at any ratio up to ``FIA_MAX_GQA_RATIO``; with GQA/MQA also any multiple
    of 16 up to ``FIA_TND_GQA_MAX_HEAD_DIM``."""
    if group is not None and not 1 <= group <= FIA_MAX_GQA_RATIO:
        return False
    if head_size in FIA_TND_HEAD_DIMS:
        return True
    gqa = group is not None and group > 1
    return gqa and head_size <= FIA_TND_GQA_MAX_HEAD_DIM and head_size % 16 == 0


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
    group = num_heads // num_kv_heads if num_heads % num_kv_heads == 0 else 1
    if not fia_takes(head_size, min(group, FIA_MAX_GQA_RATIO)):
        problems.append(
            f"head size {head_size}: FIA's TND paged mode takes {FIA_TND_HEAD_DIMS} on A2 "
            f"(GQA/MQA also multiples of 16 up to {FIA_TND_GQA_MAX_HEAD_DIM}; use the "
            "triton-ascend kernel, ASCEND_MEPIC_ATTN_IMPL=triton-ascend)"
        )
    if problems:
        raise ValueError("unsupported by the torch_npu composition: " + "; ".join(problems))


def scratch_keys(max_model_len: int | None = None) -> int:
    """The scratch's size in keys: ``SCRATCH_KEYS_ENV`` or ``DEFAULT_SCRATCH_KEYS``, raised to
    ``max_model_len`` (one FIA call needs all of a run's visible keys in the scratch, and a run
    sees at most its sequence's keys), in whole 128-key blocks."""
    keys = int(os.environ.get(SCRATCH_KEYS_ENV) or DEFAULT_SCRATCH_KEYS)
    if keys <= 0:
        raise ValueError(f"{SCRATCH_KEYS_ENV}={keys}: the scratch needs at least one block")
    keys = max(keys, max_model_len or 0)
    return -(-keys // SCRATCH_BLOCK) * SCRATCH_BLOCK


class NpuScratch:
    """The fixed device memory the composition works in, one per device, shared by all layers
    (they run one after another).

    Holds, for ``keys`` keys: FIA's paged key and value caches in the attention dtype (``k``:
    the gathered K rows, rotated in place through ``npu_rotary_mul``'s output; ``v``), per-key
    cos/sin (``r1``/``r2``), and the full-width cos/sin tables in the cache dtype, built on the
    device from the model's ``cos_sin_cache``. A float32 cache attended in bfloat16 also keeps a
    float32 ``stage`` its rows are gathered into. FIA always sees the whole ``k``/``v`` as its
    cache, so a call's runs may need up to ``keys`` keys' blocks together (FIA: ``num_blocks`` >=
    the batches' blocks) although a pass loads fewer.
    """

    def __init__(
        self,
        device: torch.device,
        num_kv_heads: int,
        head_size: int,
        kv_dtype: torch.dtype,
        keys: int,
    ) -> None:
        if keys % SCRATCH_BLOCK:
            raise ValueError(f"scratch keys {keys} must be a multiple of {SCRATCH_BLOCK}")
        self.device = device
        self.num_kv_heads, self.head_size, self.kv_dtype = num_kv_heads, head_size, kv_dtype
        self.attn_dtype = kv_dtype if kv_dtype in FIA_DTYPES else FIA_FALLBACK_DTYPE
        self.keys = keys
        rows = (keys, num_kv_heads, head_size)
        self.k = torch.empty(rows, dtype=self.attn_dtype, device=device)
        self.v = torch.empty(rows, dtype=self.attn_dtype, device=device)
        self.stage = (
            None
            if kv_dtype == self.attn_dtype
            else torch.empty(rows, dtype=kv_dtype, device=device)
        )
        self.r1 = torch.empty(keys, head_size, dtype=kv_dtype, device=device)
        self.r2 = torch.empty_like(self.r1)
        self._tables: tuple[Any, torch.Tensor, torch.Tensor] | None = None
        self.rope_gain = 1.0  # what the tables were divided by (YaRN's mscale), see tables()
        self.reserved = False  # made by reserve_scratch (counted by vLLM's memory profile)

    def fits(self, num_kv_heads: int, head_size: int, kv_dtype: torch.dtype) -> bool:
        attn = kv_dtype if kv_dtype in FIA_DTYPES else FIA_FALLBACK_DTYPE
        have = (self.num_kv_heads, self.head_size, self.kv_dtype, self.attn_dtype)
        return have == (num_kv_heads, head_size, kv_dtype, attn)

    @property
    def nbytes(self) -> int:
        parts = [self.k, self.v, self.r1, self.r2, self.stage]
        if self._tables is not None:
            parts += list(self._tables[1:])
        return sum(t.numel() * t.element_size() for t in parts if t is not None)

    def rotation_bytes(self) -> int:
        """The most ``npu_rotary_mul`` allocates for one pass's keys (its output)."""
        return self.r1.shape[0] * self.num_kv_heads * self.head_size * self.r1.element_size()

    def tables(self, rope: RopeSpec) -> tuple[torch.Tensor, torch.Tensor]:
        """Full-width cos/sin ``[max_position, D]`` in the cache dtype, in ``rotary_mode``'s
        layout, built on the device once per RoPE (no host copy)."""
        cache = rope.cos_sin_cache
        key = (cache, cache._version, rope.is_neox_style)  # the tensor itself: ids get reused
        have = self._tables[0] if self._tables is not None else None
        if have is None or have[0] is not cache or have[1:] != key[1:]:
            self._tables = None  # free the old tables before building new ones
            cos, sin = cache.to(self.device).chunk(2, dim=-1)
            # npu_rotary_mul takes r1/r2 in [-1, 1] only (torch_npu 2.10's docstring); YaRN's
            # cos/sin carry an attention factor (mscale > 1). Rotation is linear, so the tables
            # are divided by it and the factor, squared (on q and on k), goes into FIA's scale.
            # Read once per RoPE (one device sync), never per step.
            gain = max(1.0, float(cache.abs().amax()))
            if gain > 1.0:
                cos, sin = cos / gain, sin / gain
            if rope.is_neox_style:
                cos, sin = torch.cat((cos, cos), dim=-1), torch.cat((sin, sin), dim=-1)
            else:
                cos, sin = cos.repeat_interleave(2, dim=-1), sin.repeat_interleave(2, dim=-1)
            self._tables = (
                key,
                cos.to(self.kv_dtype).contiguous(),
                sin.to(self.kv_dtype).contiguous(),
            )
            self.rope_gain = gain
        return self._tables[1], self._tables[2]


_SCRATCH: dict[str, NpuScratch] = {}


def reserve_scratch(
    device: torch.device,
    num_kv_heads: int,
    head_size: int,
    kv_dtype: torch.dtype,
    max_model_len: int | None = None,
    rope: RopeSpec | None = None,
    keys: int | None = None,
) -> NpuScratch:
    """Allocate this device's scratch now, for the model's geometry; the one place it is sized.

    Why here and now: vLLM sizes the KV cache from the memory its profiling run leaves, and that
    run skips attention. Called before the profiling run (``MepicNPUModelRunner.profile_run``),
    the scratch and its tables are counted as the model's memory; the pass's rotation output,
    allocated and freed per pass, is allocated once here too, so that the profile's peak holds it.
    """
    keys = keys if keys is not None else scratch_keys(max_model_len)
    scratch = _SCRATCH.get(str(device))
    if (
        scratch is None
        or not scratch.fits(num_kv_heads, head_size, kv_dtype)
        or scratch.keys != keys
    ):
        _SCRATCH.pop(str(device), None)
        scratch = _SCRATCH[str(device)] = NpuScratch(
            device, num_kv_heads, head_size, kv_dtype, keys
        )
    scratch.reserved = True
    if rope is not None:
        scratch.tables(rope)
    peak = torch.empty(scratch.rotation_bytes(), dtype=torch.uint8, device=device)
    del peak
    logger.info(
        "MEPIC torch_npu attention scratch (untested on hardware): %d keys, %.1f MB on %s "
        "(+%.1f MB per pass)",
        keys, scratch.nbytes / 1e6, device, scratch.rotation_bytes() / 1e6,
    )  # fmt: skip
    return scratch


def get_scratch(
    device: torch.device, num_kv_heads: int, head_size: int, kv_dtype: torch.dtype
) -> NpuScratch:
    """The device's reserved scratch; one of the default size where none fits (tests, or a path
    forced without the MEPIC runner), with a warning: then vLLM's profile did not count it."""
    scratch = _SCRATCH.get(str(device))
    if scratch is None or not scratch.fits(num_kv_heads, head_size, kv_dtype):
        keys = scratch_keys()
        logger.warning(
            "MEPIC torch_npu attention: no scratch reserved for %d KV heads x %d (%s) on %s; "
            "allocating %d keys now, outside vLLM's memory profile",
            num_kv_heads, head_size, kv_dtype, device, keys,
        )  # fmt: skip
        _SCRATCH.pop(str(device), None)
        scratch = _SCRATCH[str(device)] = NpuScratch(
            device, num_kv_heads, head_size, kv_dtype, keys
        )
    return scratch


def release_scratch(device: torch.device | None = None) -> None:
    """Drop the scratch of ``device`` (all devices: None)."""
    if device is None:
        _SCRATCH.clear()
    else:
        _SCRATCH.pop(str(device), None)


@dataclass(frozen=True)
class FiaGroup:
    """One FIA call: query rows ``[row_start, row_end)`` cut into runs (FIA batches)."""

    row_start: int
    row_end: int
    block_table: torch.Tensor  # [runs, width] int32: the runs' blocks in the pass's scratch
    query_ends: list[int]  # cumulative, relative to row_start
    kv_lens: list[int]  # per run


@dataclass(frozen=True)
class ScratchPass:
    """Scratch slots ``[slot_start, slot_start + num_slots)`` of the step's slot table, loaded
    into the scratch at once, and the FIA calls that read them."""

    slot_start: int
    num_slots: int  # a multiple of SCRATCH_BLOCK
    groups: tuple[FiaGroup, ...]


@dataclass(frozen=True)
class NpuStepPlan:
    """Everything every layer of a step reuses: per scratch slot its K/V rows and position, the
    passes and their FIA calls, and the query rotation."""

    slots: torch.Tensor  # [3, S] int32 on the device: K row, V row, RoPE position per slot
    passes: tuple[ScratchPass, ...]
    query_cos: torch.Tensor  # [1, T, 1, D] in the query's rotation dtype
    query_sin: torch.Tensor
    blind_rows: torch.Tensor | None  # [T] bool: queries that see no key (output 0)


def cache_rows(kv_cache: torch.Tensor) -> tuple[torch.Tensor, int, int]:
    """``(rows, block_rows, v_offset)``: a contiguous ``[R, Hkv, D]`` view of the cache's memory
    in which K of ``(block, slot)`` is row ``block * block_rows + slot`` and its V
    ``v_offset`` rows later. Why: gathering from it with flat ids is one ``index_select`` on a
    contiguous tensor, so no implicit copy of the layer's cache can happen (advanced indexing of
    the strided ``kv_cache[0]`` on two dims might). Takes the contiguous ``[2, nb, B, Hkv, D]``
    layout and vllm-ascend's block-major one (``vllm_integration.ascend.kv_pair_view``)."""
    _, _, bs, hkv, d = kv_cache.shape
    row = hkv * d
    for base in (kv_cache, kv_cache.transpose(0, 1)):
        if base.is_contiguous():
            s0, s1 = kv_cache.stride(0), kv_cache.stride(1)
            return base.reshape(-1, hkv, d), s1 // row, s0 // row
    raise ValueError(
        "the torch_npu composition needs a [2, num_blocks, B, Hkv, D] cache that is contiguous "
        f"or block-major (each block's K then V); got strides {kv_cache.stride()}"
    )


def plan_step(
    meta: PagedRopeMetadata,
    rope: RopeSpec,
    device: torch.device,
    *,
    capacity: int,
    block_rows: int,
    v_offset: int,
    tables: tuple[torch.Tensor, torch.Tensor],
    query_dtype: torch.dtype,
) -> NpuStepPlan:
    """Build the step's plan on the host from the metadata (one device-to-host copy of its small
    int tables, one upload of the slot table). ``capacity``: scratch keys per pass."""
    bs = meta.block_size
    tables_ = meta.block_tables.to("cpu", torch.int64)
    num_seqs, width = tables_.shape
    first = meta.block_first_pos.to("cpu", torch.int64)
    vstart = meta.block_valid_start.to("cpu", torch.int64)
    vend = meta.block_valid_end.to("cpu", torch.int64)
    nblocks = meta.num_blocks.to("cpu", torch.int64)
    slot = torch.arange(bs)
    in_table = torch.arange(width)[None, :] < nblocks[:, None]
    real = in_table[..., None] & (slot >= vstart[..., None]) & (slot < vend[..., None])
    seq_of, entry, key_slot = real.nonzero(as_tuple=True)  # (sequence, padded index) order
    key_row = tables_[seq_of, entry] * block_rows + key_slot
    key_pos = first[seq_of, entry] + key_slot - vstart[seq_of, entry]
    padded = entry * bs + key_slot
    del real, in_table

    keys_per_seq = torch.bincount(seq_of, minlength=num_seqs)
    seq_key_start = torch.cumsum(keys_per_seq, 0) - keys_per_seq

    loc = meta.query_start_loc.to("cpu", torch.int64)
    q_seq = torch.repeat_interleave(torch.arange(num_seqs), loc[1:] - loc[:-1])
    q_idx = meta.query_indices.to("cpu", torch.int64)
    span = width * bs + 1
    ordered = seq_of * span + padded  # ascending: nonzero walks (sequence, entry, slot)
    visible = torch.searchsorted(ordered, q_seq * span + q_idx, right=True) - seq_key_start[q_seq]
    del ordered, padded

    t = q_seq.numel()
    blind = visible == 0
    run_start = torch.ones(t, dtype=torch.bool)
    if t > 1:
        run_start[1:] = (
            (q_seq[1:] != q_seq[:-1]) | (visible[1:] != visible[:-1] + 1) | blind[1:] | blind[:-1]
        )
    first_rows = run_start.nonzero().flatten()
    last_rows = torch.cat((first_rows[1:] - 1, torch.tensor([t - 1])))
    run_seq = q_seq[first_rows]
    run_kv = visible[last_rows]
    run_blind = blind[first_rows]

    # Keys each sequence's runs read (a prefix of its compacted keys), in whole blocks.
    needed = torch.zeros(num_seqs, dtype=torch.int64)
    needed.scatter_reduce_(0, run_seq, run_kv, reduce="amax")
    seq_blocks = (needed + SCRATCH_BLOCK - 1) // SCRATCH_BLOCK
    cap_blocks = capacity // SCRATCH_BLOCK
    if int(seq_blocks.max()) > cap_blocks:
        raise ValueError(
            f"a sequence reads {int(needed.max())} keys, more than the attention scratch holds "
            f"({capacity}); raise {SCRATCH_KEYS_ENV} (the scratch is sized for max_model_len)"
        )
    # Greedy packing of consecutive sequences into passes of at most cap_blocks blocks.
    blocks_list = seq_blocks.tolist()
    pass_of, base_block, pass_blocks = [], [], []
    used = 0
    for b in blocks_list:
        if not pass_blocks or used + b > cap_blocks:
            pass_blocks.append(0)
            used = 0
        pass_of.append(len(pass_blocks) - 1)
        base_block.append(used)
        used += b
        pass_blocks[-1] = used
    pass_blocks = [max(1, b) for b in pass_blocks]  # a pass of blind runs reads one sink block
    pass_slot_start = [0]
    for b in pass_blocks[:-1]:
        pass_slot_start.append(pass_slot_start[-1] + b * SCRATCH_BLOCK)
    total = pass_slot_start[-1] + pass_blocks[-1] * SCRATCH_BLOCK

    # The slot table: each slot's source key (the sequence's key at that offset; slots past its
    # needed keys repeat its last one, so every slot holds a finite, real key).
    pass_of_t = torch.tensor(pass_of)
    seq_slot0 = torch.tensor(pass_slot_start)[pass_of_t] + torch.tensor(base_block) * SCRATCH_BLOCK
    slot_seq = torch.repeat_interleave(torch.arange(num_seqs), seq_blocks * SCRATCH_BLOCK)
    seq_start = (torch.cumsum(seq_blocks, 0) - seq_blocks) * SCRATCH_BLOCK
    offset = torch.arange(slot_seq.numel()) - seq_start[slot_seq]
    src = seq_key_start[slot_seq] + torch.minimum(offset, needed[slot_seq] - 1)
    dest = seq_slot0[slot_seq] + offset
    table = torch.zeros(3, total, dtype=torch.int64)
    if key_row.numel():
        table[0], table[2] = key_row[0], key_pos[0]  # sink slots: any real key
    table[0, dest] = key_row[src]
    table[2, dest] = key_pos[src]
    table[1] = table[0] + v_offset
    if int(table[1].max()) >= 2**31:
        raise ValueError("cache rows exceed int32 indices")
    max_pos = tables[0].shape[0]
    if key_pos.numel() and int(key_pos.max()) >= max_pos:
        raise ValueError(f"key position {int(key_pos.max())} beyond the RoPE table ({max_pos})")

    # FIA calls per pass: runs in order, at most FIA_MAX_BATCH runs, FIA_TND_MAX_TOKENS rows and
    # the scratch's blocks (FIA: num_blocks >= the batches' blocks) per call.
    run_kv_eff = run_kv.clamp(min=1)  # blind runs read one key of the pass's block 0
    run_blocks = (run_kv_eff + SCRATCH_BLOCK - 1) // SCRATCH_BLOCK
    run_base = torch.where(run_blind, 0, torch.tensor(base_block)[run_seq])
    run_pass = pass_of_t[run_seq].tolist()
    run_rows = (last_rows - first_rows + 1).tolist()
    run_blocks_l = run_blocks.tolist()
    groups: list[list[FiaGroup]] = [[] for _ in pass_blocks]
    g0 = 0
    num_runs = first_rows.numel()
    while g0 < num_runs:
        p = run_pass[g0]
        g1, rows, blocks = g0, 0, 0
        while (
            g1 < num_runs
            and run_pass[g1] == p
            and g1 - g0 < FIA_MAX_BATCH
            and rows + run_rows[g1] <= FIA_TND_MAX_TOKENS
            and blocks + run_blocks_l[g1] <= cap_blocks
        ):
            rows += run_rows[g1]
            blocks += run_blocks_l[g1]
            g1 += 1
        if g1 == g0:
            raise ValueError(f"a run of {run_rows[g0]} queries exceeds one FIA call's limits")
        blk = run_blocks[g0:g1]
        ids = run_base[g0:g1, None] + torch.arange(int(blk.max()))[None, :]
        ids = torch.where(torch.arange(ids.shape[1])[None, :] < blk[:, None], ids, 0)
        row0, row1 = int(first_rows[g0]), int(last_rows[g1 - 1]) + 1
        ends = torch.tensor(run_rows[g0:g1]).cumsum(0)
        groups[p].append(
            FiaGroup(row0, row1, ids.to(device, torch.int32), ends.tolist(),
                     run_kv_eff[g0:g1].tolist())
        )  # fmt: skip
        g0 = g1
    passes = tuple(
        ScratchPass(start, b * SCRATCH_BLOCK, tuple(g))
        for start, b, g in zip(pass_slot_start, pass_blocks, groups, strict=True)
        if g
    )
    qpos = meta.query_positions.to(device, torch.int64)
    cos, sin = (x.index_select(0, qpos).to(query_dtype) for x in tables)
    return NpuStepPlan(
        slots=table.to(torch.int32).to(device),
        passes=passes,
        query_cos=cos[None, :, None, :].contiguous(),
        query_sin=sin[None, :, None, :].contiguous(),
        blind_rows=blind.to(device) if bool(blind.any()) else None,
    )


_CAUSAL_MASKS: dict[str, torch.Tensor] = {}


def causal_mask(device: torch.device) -> torch.Tensor:
    """sparse_mode=3's mask: 2048 x 2048, 1 strictly above the diagonal (int8), one per device."""
    key = str(device)
    if key not in _CAUSAL_MASKS:
        ones = torch.ones(CAUSAL_MASK_SIZE, CAUSAL_MASK_SIZE, dtype=torch.int8, device=device)
        _CAUSAL_MASKS[key] = torch.triu(ones, diagonal=1)
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
    scratch = get_scratch(device, hkv, d, kv_cache.dtype)
    rows, block_rows, v_offset = cache_rows(kv_cache)
    tables = scratch.tables(rope)
    rot_dtype = query.dtype if query.dtype in FIA_DTYPES else torch.float32
    key = ("npu-plan", str(device), scratch.keys, block_rows, v_offset, rot_dtype)
    if key not in meta.memo:
        meta.memo[key] = plan_step(
            meta, rope, device, capacity=scratch.keys, block_rows=block_rows,
            v_offset=v_offset, tables=tables, query_dtype=rot_dtype,
        )  # fmt: skip
    plan: NpuStepPlan = meta.memo[key]
    attn_dtype = scratch.attn_dtype
    mode = "half" if rope.is_neox_style else "interleave"

    q = ops.npu_rotary_mul(
        query.to(rot_dtype)[None].contiguous(), plan.query_cos, plan.query_sin, rotary_mode=mode
    )[0].to(attn_dtype)
    out = torch.empty(t, hq, d, dtype=attn_dtype, device=device)
    cos_table, sin_table = tables
    paged_k = scratch.k.view(-1, SCRATCH_BLOCK, hkv * d)  # FIA sees the whole scratch
    paged_v = scratch.v.view(-1, SCRATCH_BLOCK, hkv * d)
    for p in plan.passes:
        n, s0 = p.num_slots, p.slot_start
        k_ids, v_ids, pos = (
            plan.slots[0, s0 : s0 + n],
            plan.slots[1, s0 : s0 + n],
            plan.slots[2, s0 : s0 + n],
        )
        stage = scratch.k[:n] if scratch.stage is None else scratch.stage[:n]
        torch.index_select(rows, 0, k_ids, out=stage)
        torch.index_select(cos_table, 0, pos, out=scratch.r1[:n])
        torch.index_select(sin_table, 0, pos, out=scratch.r2[:n])
        k_rot = ops.npu_rotary_mul(
            stage[None], scratch.r1[None, :n, None], scratch.r2[None, :n, None], rotary_mode=mode
        )
        scratch.k[:n].copy_(k_rot[0])
        del k_rot
        if scratch.stage is None:
            torch.index_select(rows, 0, v_ids, out=scratch.v[:n])
        else:  # a float32 cache attended in bfloat16
            torch.index_select(rows, 0, v_ids, out=scratch.stage[:n])
            scratch.v[:n].copy_(scratch.stage[:n])
        for group in p.groups:
            attn, _ = ops.npu_fused_infer_attention_score(
                q[group.row_start : group.row_end],
                paged_k,
                paged_v,
                atten_mask=causal_mask(device),
                block_table=group.block_table,
                block_size=SCRATCH_BLOCK,
                actual_seq_lengths=group.query_ends,
                actual_seq_lengths_kv=group.kv_lens,
                num_heads=hq,
                num_key_value_heads=hkv,
                scale=scale * scratch.rope_gain**2,
                input_layout="TND",
                sparse_mode=3,
                inner_precise=0,
            )
            out[group.row_start : group.row_end] = attn
    if plan.blind_rows is not None:
        out.masked_fill_(plan.blind_rows[:, None, None], 0)
    return out.to(query.dtype)
