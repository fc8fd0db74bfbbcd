"""Where a draft model's tokens go: the drafter's batches placed by the target's token maps.

A draft-model proposer (``vllm_integration.draft_proposer``) runs the drafter over the step's
scheduled tokens plus one token per request (the one just sampled), then one token per request
for each further draft, numbering them by token index as vLLM numbers the target's. The drafter
must attend over the same logical context as the target (chunk tokens too), so its tokens are
placed exactly as the target's: token ``i`` of a request at the padded index and logical
position its ``TokenMap`` gives (after the layout for decode and draft tokens), its attention
over the same table entries. Its KV goes to the drafter's own layer caches, at the same slots.

One difference: a chunk compile is a sequence that never decodes, but the proposer still adds
a token after it (and drafts from it). That token would sit past the chunk in the chunk arena's
shared blocks, where the next chunk's canonical tokens are; it is placed on the compile's last
token for attention (its drafts are never used) and writes nowhere.
"""

from __future__ import annotations

from typing import Any

import numpy as np
import torch

from ascend_mepic.core.plan import StepPlanError
from ascend_mepic.worker import step
from ascend_mepic.worker.token_pool import TokenMapPool


class DraftPlacement:
    """The ``DraftPlacer`` of a MEPIC runner: its token maps, and its step's token indices."""

    def __init__(self, pool: TokenMapPool) -> None:
        self.pool = pool
        self._req_ids: list[str] = []
        self._index = np.zeros(0, dtype=np.int64)

    def note_step(self, req_ids: list[str], index: np.ndarray) -> None:
        """The step's rows and its tokens' indices (vLLM's positions before MEPIC rewrote them
        into logical positions), kept for the drafter that runs after the target's forward."""
        self._req_ids = list(req_ids)
        self._index = index.copy()

    def target_indices(self, num_tokens: int) -> torch.Tensor:
        if num_tokens > len(self._index):
            raise StepPlanError(
                f"the drafter asked for {num_tokens} target tokens but the step placed "
                f"{len(self._index)}"
            )
        return torch.from_numpy(self._index[:num_tokens])

    def place(
        self, query_start_loc: np.ndarray, index: np.ndarray, block_table: np.ndarray
    ) -> tuple[np.ndarray, np.ndarray, Any]:
        pool = self.pool
        req_ids = self._req_ids[: len(query_start_loc) - 1]
        counts = np.diff(query_start_loc)
        token_rows = pool.rows(req_ids)[np.repeat(np.arange(len(req_ids)), counts)]
        n = pool.num_in_context[token_rows]
        past = (index >= n) & ~pool.decodes[token_rows]  # tokens after a compile's chunk
        placed = step.place_step(
            pool, req_ids, query_start_loc, np.where(past, n - 1, index), block_table
        )
        return placed.positions, np.where(past, -1, placed.slots), placed
