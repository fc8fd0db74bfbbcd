"""Per-step position tables, handed from the model runner to its attention metadata builders.

vLLM's builders see only ``CommonAttentionMetadata``, which has no request identities, while a
MEPIC request's tokens need their padded indices and each request's per-block position table.
The runner computes those right after preparing the step's inputs and hands them to its own
builders (``vllm_integration.runner_internals.hand_step_tables``); a builder checks they
describe the batch it is building for and refuses the step otherwise.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import numpy as np
import torch

from ascend_mepic.core.plan import StepPlanError
from ascend_mepic.ops import PagedRopeMetadata
from ascend_mepic.worker.token_pool import PLAIN_ROW, EntryTables, TokenMapPool


@dataclass(frozen=True)
class StepTables:
    num_reqs: int
    num_tokens: int
    query_positions: torch.Tensor  # [T] logical positions
    query_indices: torch.Tensor  # [T] padded indices
    num_blocks: torch.Tensor  # [R]
    first_pos: torch.Tensor  # [R, max_blocks]
    valid_start: torch.Tensor
    valid_end: torch.Tensor
    max_query_len: int  # from the runner's host copy: the builders never read it off a device

    def check_matches(self, num_reqs: int, num_tokens: int) -> None:
        if self.num_reqs != num_reqs or self.num_tokens != num_tokens:
            raise StepPlanError(
                f"MEPIC's step tables describe {self.num_reqs} sequences / {self.num_tokens} "
                f"tokens but the attention batch has {num_reqs} / {num_tokens}; refusing to "
                "build attention metadata that would not match the batch"
            )

    def to_metadata(
        self, block_size: int, query_start_loc: torch.Tensor, block_table: torch.Tensor
    ) -> PagedRopeMetadata:
        max_blocks = self.first_pos.shape[1]
        return PagedRopeMetadata(
            block_size=block_size,
            query_start_loc=query_start_loc.to(torch.int32),
            query_positions=self.query_positions,
            query_indices=self.query_indices,
            block_tables=block_table[: self.num_reqs, :max_blocks].to(torch.int32),
            num_blocks=self.num_blocks,
            block_first_pos=self.first_pos,
            block_valid_start=self.valid_start,
            block_valid_end=self.valid_end,
            max_query_len=self.max_query_len,
            max_num_blocks=max_blocks,
        )


@dataclass(frozen=True)
class StepInputs:
    """What the runner hands its MEPIC builders for one step."""

    tables: StepTables
    blend: Any = None  # worker.blend.BlendStep of a CacheBlend step


def plain_metadata(
    block_size: int,
    query_start_loc: torch.Tensor,
    positions: torch.Tensor,
    seq_lens: torch.Tensor,
    block_table: torch.Tensor,
) -> PagedRopeMetadata:
    """Identity tables: every slot real, position = index (ordinary requests, dummy runs)."""
    num_blocks = (seq_lens + block_size - 1) // block_size
    max_blocks = max(1, int(num_blocks.max())) if len(num_blocks) else 1
    j = torch.arange(max_blocks, dtype=torch.int32, device=positions.device)
    first = (j * block_size).expand(len(seq_lens), max_blocks).contiguous()
    counts = query_start_loc[1:] - query_start_loc[:-1]
    return PagedRopeMetadata(
        block_size=block_size,
        query_start_loc=query_start_loc.to(torch.int32),
        query_positions=positions.to(torch.int32),
        query_indices=positions.to(torch.int32),
        block_tables=block_table[:, :max_blocks].to(torch.int32),
        num_blocks=num_blocks.to(torch.int32),
        block_first_pos=first,
        block_valid_start=torch.zeros_like(first),
        block_valid_end=torch.full_like(first, block_size),
        max_query_len=int(counts.max()) if len(counts) else 0,
        max_num_blocks=max_blocks,
    )


@dataclass(frozen=True)
class PlacedStep:
    """Where the step's tokens go, computed once per step for every layer."""

    positions: np.ndarray  # [T] logical positions
    padded: np.ndarray  # [T] padded indices
    mapped: np.ndarray  # [T] bool: tokens of sequences with a token map (vLLM's values differ)
    slots: np.ndarray  # [T] KV slot of each token
    entries: EntryTables
    max_query_len: int
    # CacheBlend: per sequence with chunk tokens in the step, (first row, last row + 1,
    # candidate rows, ratio).
    blending: list[tuple[int, int, np.ndarray, float]]

    @property
    def any_mapped(self) -> bool:
        return bool(self.mapped.any())


def place_step(
    pool: TokenMapPool,
    req_ids: list[str],
    query_start_loc: np.ndarray,
    index: np.ndarray,
    block_table: np.ndarray,
) -> PlacedStep:
    """Place a step's tokens: ``index`` numbers each token within its sequence (vLLM's
    positions), sequence ``i`` owns rows ``query_start_loc[i]:query_start_loc[i + 1]`` and has
    block-table row ``block_table[i]``. Array operations only: its cost is a few gathers whatever
    the number of sequences (only CacheBlend's prefilling sequences are listed one by one)."""
    bs = pool.block_size
    rows = pool.rows(req_ids)
    counts = np.diff(query_start_loc)
    token_req = np.repeat(np.arange(len(req_ids)), counts)
    token_rows = rows[token_req]
    places = pool.place(token_rows, index)
    padded = places.padded
    num_blocks = np.zeros(len(req_ids), dtype=np.int64)
    scheduled = counts > 0
    if scheduled.any():
        starts = query_start_loc[:-1][scheduled]
        num_blocks[scheduled] = np.maximum.reduceat(padded, starts) // bs + 1
    slots = block_table[token_req, padded // bs].astype(np.int64) * bs + padded % bs
    blending: list[tuple[int, int, np.ndarray, float]] = []
    if places.blend_candidate is not None and places.blend_candidate.any():
        candidates = np.flatnonzero(places.blend_candidate)
        owners = token_req[candidates]
        firsts = np.flatnonzero(np.r_[True, owners[1:] != owners[:-1]])
        for group, first in zip(np.split(candidates, firsts[1:]), firsts, strict=True):
            i = int(owners[first])
            a, b = int(query_start_loc[i]), int(query_start_loc[i + 1])
            blending.append((a, b, group, float(pool.blend_ratio[rows[i]])))
    return PlacedStep(
        positions=places.position,
        padded=padded,
        mapped=token_rows != PLAIN_ROW,
        slots=slots,
        entries=pool.entries(rows, num_blocks),
        max_query_len=int(counts.max()) if len(counts) else 0,
        blending=blending,
    )


def build_tables(
    num_tokens: int,
    positions: np.ndarray,
    padded: np.ndarray,
    entries: EntryTables,
    max_query_len: int,
    device: torch.device,
) -> StepTables:
    """The step's tables as the attention builders take them."""

    def t(a: np.ndarray) -> torch.Tensor:
        return torch.from_numpy(np.ascontiguousarray(a, dtype=np.int32)).to(device)

    return StepTables(
        len(entries.num_blocks),
        num_tokens,
        t(positions),
        t(padded),
        t(entries.num_blocks),
        t(entries.first_pos),
        t(entries.valid_start),
        t(entries.valid_end),
        max_query_len,
    )
