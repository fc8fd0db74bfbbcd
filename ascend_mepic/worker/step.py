"""One step's token placement: made by the runner, read by its attention builders.

vLLM's builders see only ``CommonAttentionMetadata``, which has no request identities, while a
MEPIC request's tokens need their padded indices and each request's per-block position table.
Right after vLLM prepares a step's inputs the runner places the step's tokens (``place_step``,
from its ``TokenMapPool``), rewrites vLLM's positions and slots from the ``PlacedStep`` and
hands it to its own builders (``vllm_integration.runner_internals.hand_step_tables``); a builder
checks it describes the batch it is building for, refuses the step otherwise, and turns it into
the ops' ``PagedRopeMetadata``. The worker's per-step types are this one, CacheBlend's
``blend.BlendStep`` (which rides on it) and the backend's ``MepicAttentionMetadata``.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np
import torch

from ascend_mepic.core.plan import StepPlanError
from ascend_mepic.ops import PagedRopeMetadata
from ascend_mepic.worker.blend import BlendStep
from ascend_mepic.worker.token_pool import PLAIN_ROW, TokenMapPool


@dataclass(frozen=True)
class PlacedStep:
    """Where the step's tokens go, computed once per step (host arrays) for every layer."""

    positions: np.ndarray  # [T] logical positions
    padded: np.ndarray  # [T] padded indices
    mapped: np.ndarray  # [T] bool: tokens of sequences with a token map (vLLM's values differ)
    slots: np.ndarray  # [T] KV slot of each token
    num_blocks: np.ndarray  # [R] table entries of each sequence
    first_pos: np.ndarray  # [R, max_blocks] per-entry position tables, zero past num_blocks
    valid_start: np.ndarray
    valid_end: np.ndarray
    max_query_len: int
    blend: BlendStep | None = None  # CacheBlend's selection, when a sequence of the step blends
    _on_device: dict = field(default_factory=dict, compare=False, repr=False)

    @property
    def num_reqs(self) -> int:
        return len(self.num_blocks)

    @property
    def num_tokens(self) -> int:
        return len(self.positions)

    @property
    def any_mapped(self) -> bool:
        return bool(self.mapped.any())

    def check_matches(self, num_reqs: int, num_tokens: int) -> None:
        if self.num_reqs != num_reqs or self.num_tokens != num_tokens:
            raise StepPlanError(
                f"MEPIC's step tables describe {self.num_reqs} sequences / {self.num_tokens} "
                f"tokens but the attention batch has {num_reqs} / {num_tokens}; refusing to "
                "build attention metadata that would not match the batch"
            )

    def tables(self, device: torch.device | str) -> tuple[torch.Tensor, ...]:
        """The int32 tables on ``device`` (copied once per step and device, whatever the number
        of builders): positions, padded indices, num_blocks, first_pos, valid_start, valid_end."""
        key = str(device)
        if key not in self._on_device:
            arrays = (self.positions, self.padded, self.num_blocks, self.first_pos,
                      self.valid_start, self.valid_end)  # fmt: skip
            self._on_device[key] = tuple(
                torch.from_numpy(np.ascontiguousarray(a, dtype=np.int32)).to(device) for a in arrays
            )
        return self._on_device[key]

    def to_metadata(
        self, block_size: int, query_start_loc: torch.Tensor, block_table: torch.Tensor
    ) -> PagedRopeMetadata:
        positions, padded, num_blocks, first, start, end = self.tables(query_start_loc.device)
        max_blocks = first.shape[1]
        return PagedRopeMetadata(
            block_size=block_size,
            query_start_loc=query_start_loc.to(torch.int32),
            query_positions=positions,
            query_indices=padded,
            block_tables=block_table[: self.num_reqs, :max_blocks].to(torch.int32),
            num_blocks=num_blocks,
            block_first_pos=first,
            block_valid_start=start,
            block_valid_end=end,
            max_query_len=self.max_query_len,
            max_num_blocks=max_blocks,
        )


def place_step(
    pool: TokenMapPool,
    req_ids: list[str],
    query_start_loc: np.ndarray,
    index: np.ndarray,
    block_table: np.ndarray,
    check_layer: int | None = None,
) -> PlacedStep:
    """Place a step's tokens: ``index`` numbers each token within its sequence (vLLM's
    positions), sequence ``i`` owns rows ``query_start_loc[i]:query_start_loc[i + 1]`` and has
    block-table row ``block_table[i]``; ``check_layer`` is CacheBlend's (None without it).
    Array operations only: its cost is a few gathers whatever the number of sequences (only
    CacheBlend's prefilling sequences are listed one by one)."""
    bs = pool.block_size
    rows = pool.rows(req_ids)
    counts = np.diff(query_start_loc)
    token_req = np.repeat(np.arange(len(req_ids)), counts)
    token_rows = rows[token_req]
    padded, position, candidate = pool.place(token_rows, index)
    num_blocks = np.zeros(len(req_ids), dtype=np.int64)
    scheduled = counts > 0
    if scheduled.any():
        starts = query_start_loc[:-1][scheduled]
        num_blocks[scheduled] = np.maximum.reduceat(padded, starts) // bs + 1
    slots = block_table[token_req, padded // bs].astype(np.int64) * bs + padded % bs
    blending: list[tuple[int, int, torch.Tensor, float]] = []
    if candidate is not None and candidate.any():
        candidates = np.flatnonzero(candidate)
        owners = token_req[candidates]
        firsts = np.flatnonzero(np.r_[True, owners[1:] != owners[:-1]])
        for group, first in zip(np.split(candidates, firsts[1:]), firsts, strict=True):
            i = int(owners[first])
            a, b = int(query_start_loc[i]), int(query_start_loc[i + 1])
            blending.append((a, b, torch.from_numpy(group), float(pool.blend_ratio[rows[i]])))
    if blending and check_layer is None:
        raise StepPlanError("the step has CacheBlend sequences but the runner has no check layer")
    first, valid_start, valid_end = pool.entries(rows, num_blocks)
    return PlacedStep(
        positions=position,
        padded=padded,
        mapped=token_rows != PLAIN_ROW,
        slots=slots,
        num_blocks=num_blocks,
        first_pos=first,
        valid_start=valid_start,
        valid_end=valid_end,
        max_query_len=int(counts.max()) if len(counts) else 0,
        blend=BlendStep(check_layer, len(index), blending) if blending else None,
    )


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
