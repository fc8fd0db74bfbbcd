"""Per-step position tables, handed from the model runner to its attention metadata builders.

vLLM's builders see only ``CommonAttentionMetadata``, which has no request identities, while a
MEPIC request's tokens need their padded indices and each request's per-block position table.
The runner computes those right after preparing the step's inputs and hands them to its own
builders (``vllm_integration.runner.hand_step_tables``); a builder checks they describe the
batch it is building for and refuses the step otherwise.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import numpy as np
import torch

from ascend_mepic.ops import PagedRopeMetadata
from ascend_mepic.vllm_integration.channel import StepPlanError


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
        counts = query_start_loc[1:] - query_start_loc[:-1]
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
            max_query_len=int(counts.max()) if len(counts) else 0,
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


def build_tables(
    num_tokens: int,
    positions: np.ndarray,
    padded: np.ndarray,
    per_request_blocks: list[tuple[np.ndarray, np.ndarray, np.ndarray]],
    device: torch.device,
) -> StepTables:
    """Pack per-request block tables (ragged) into padded tensors."""
    num_reqs = len(per_request_blocks)
    max_blocks = max(1, max(len(f) for f, _, _ in per_request_blocks))
    first = np.zeros((num_reqs, max_blocks), dtype=np.int32)
    vstart = np.zeros_like(first)
    vend = np.zeros_like(first)
    nblocks = np.zeros(num_reqs, dtype=np.int32)
    for i, (f, s, e) in enumerate(per_request_blocks):
        n = len(f)
        first[i, :n], vstart[i, :n], vend[i, :n], nblocks[i] = f, s, e, n

    def t(a: np.ndarray) -> torch.Tensor:
        return torch.from_numpy(np.ascontiguousarray(a, dtype=np.int32)).to(device)

    return StepTables(
        num_reqs,
        num_tokens,
        t(positions),
        t(padded),
        t(nblocks),
        t(first),
        t(vstart),
        t(vend),
    )
