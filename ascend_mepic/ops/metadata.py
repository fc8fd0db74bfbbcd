"""The op contract's batch description: scattered queries over paged, un-rotated KV.

Cache layout (every implementation): one tensor ``kv_cache[2, num_blocks, block_size, Hkv, D]``,
``kv_cache[0]`` holding K and ``kv_cache[1]`` V, both without RoPE. This matches vllm-ascend's
``(2, num_blocks, block_size, kv_heads, head)``. The tensor may be a strided view: on CPU and CUDA
the integration passes a view of a buffer laid out ``[num_blocks, Hkv, 2, B, D]``
(``ops.layout.cache_view``: each block's K and V stay in that block's bytes, and one KV head's
rows of a block are contiguous); implementations must index through strides, never
``.contiguous()`` the cache.

Queries ``[T, Hq, D]`` are un-rotated and grouped by sequence: sequence ``s`` owns rows
``query_start_loc[s]:query_start_loc[s+1]``. Each query carries its logical position (where it is
rotated) and its index in the sequence's padded layout (causal order).

Key ``(s, j, t)`` (sequence, block-table entry, slot) has padded index ``j * B + t``; it is real
when ``j < num_blocks[s]`` and ``block_valid_start[s, j] <= t < block_valid_end[s, j]``; it is then
rotated at position ``block_first_pos[s, j] + t - block_valid_start[s, j]``. A query attends to the
real keys of its own sequence whose padded index is not after its own.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field

import torch


@dataclass(frozen=True)
class PagedRopeMetadata:
    block_size: int
    query_start_loc: torch.Tensor  # [S + 1] int32
    query_positions: torch.Tensor  # [T] int32, logical (RoPE) position
    query_indices: torch.Tensor  # [T] int32, padded-layout index (causal order)
    block_tables: torch.Tensor  # [S, max_blocks] int32
    num_blocks: torch.Tensor  # [S] int32
    block_first_pos: torch.Tensor  # [S, max_blocks] int32
    block_valid_start: torch.Tensor  # [S, max_blocks] int32
    block_valid_end: torch.Tensor  # [S, max_blocks] int32
    max_query_len: int
    max_num_blocks: int
    # Derived data an implementation may memoize for this batch (the same metadata object is
    # used by every layer of a step, so per-layer work is paid once per step).
    memo: dict = field(default_factory=dict, compare=False, repr=False)

    @property
    def num_seqs(self) -> int:
        return self.block_tables.shape[0]

    @property
    def num_queries(self) -> int:
        return self.query_positions.shape[0]

    def query_seq(self) -> torch.Tensor:
        """Sequence of each query, ``[T]``."""
        counts = self.query_start_loc[1:] - self.query_start_loc[:-1]
        return torch.repeat_interleave(
            torch.arange(self.num_seqs, device=counts.device), counts.long()
        )

    def tensors(self) -> tuple[torch.Tensor, ...]:
        """The eight index tensors, in field order (the kernels' argument order)."""
        return (
            self.query_start_loc,
            self.query_positions,
            self.query_indices,
            self.block_tables,
            self.num_blocks,
            self.block_first_pos,
            self.block_valid_start,
            self.block_valid_end,
        )

    def to(self, device: torch.device | str) -> PagedRopeMetadata:
        return PagedRopeMetadata(
            self.block_size,
            *(t.to(device) for t in self.tensors()),
            self.max_query_len,
            self.max_num_blocks,
        )


@dataclass(frozen=True)
class SequenceSpec:
    """One sequence of a batch, in plain Python (what the runner or a test knows)."""

    block_ids: Sequence[int]
    block_first_pos: Sequence[int]
    block_valid_start: Sequence[int]
    block_valid_end: Sequence[int]
    query_indices: Sequence[int]
    query_positions: Sequence[int]


def build_metadata(
    seqs: Sequence[SequenceSpec], block_size: int, device: torch.device | str = "cpu"
) -> PagedRopeMetadata:
    """Pack sequences into the op's tensors (block tables padded with block 0)."""
    if not seqs:
        raise ValueError("a batch needs at least one sequence")
    max_blocks = max(1, max(len(s.block_ids) for s in seqs))

    def padded(rows: list[Sequence[int]]) -> torch.Tensor:
        out = torch.zeros(len(rows), max_blocks, dtype=torch.int32)
        for i, r in enumerate(rows):
            out[i, : len(r)] = torch.tensor(list(r), dtype=torch.int32)
        return out

    for i, s in enumerate(seqs):
        n = len(s.block_ids)
        if not (len(s.block_first_pos) == len(s.block_valid_start) == len(s.block_valid_end) == n):
            raise ValueError(f"sequence {i}: per-block lists must match its block table")
        if len(s.query_indices) != len(s.query_positions):
            raise ValueError(f"sequence {i}: query indices and positions differ in length")
    counts = [len(s.query_indices) for s in seqs]
    loc = torch.zeros(len(seqs) + 1, dtype=torch.int32)
    loc[1:] = torch.cumsum(torch.tensor(counts), 0)
    meta = PagedRopeMetadata(
        block_size=block_size,
        query_start_loc=loc,
        query_positions=torch.tensor(
            [p for s in seqs for p in s.query_positions], dtype=torch.int32
        ),
        query_indices=torch.tensor([q for s in seqs for q in s.query_indices], dtype=torch.int32),
        block_tables=padded([s.block_ids for s in seqs]),
        num_blocks=torch.tensor([len(s.block_ids) for s in seqs], dtype=torch.int32),
        block_first_pos=padded([s.block_first_pos for s in seqs]),
        block_valid_start=padded([s.block_valid_start for s in seqs]),
        block_valid_end=padded([s.block_valid_end for s in seqs]),
        max_query_len=max(counts),
        max_num_blocks=max_blocks,
    )
    return meta.to(device)
