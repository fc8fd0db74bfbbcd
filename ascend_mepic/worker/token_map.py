"""Where each of a request's computed tokens sits: its table-entry index and logical position.

The scheduler hands the worker a MEPIC request as its *in-context* tokens only (its private
stream: prompt tokens and each chunk's first tokens, in order) and, in the step's ``StepPlan``,
the request's ``SequencePlacement`` (the layout the scheduler placed it with); a chunk compile
arrives as the chunk's tokens with a compile placement. vLLM's runner numbers a request's
tokens 0, 1, 2, ... ; a ``TokenMap`` turns those numbers into layout indices (entry * B + slot:
the KV slot and the causal order) and logical positions (RoPE), and gives the per-entry
position table of its layout. Decode tokens continue after the prompt (``token_pool`` extends
the tables past the layout). Plain requests need no map (index = position).
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from ascend_mepic.core.plan import SequencePlacement, StepPlanError


@dataclass(frozen=True)
class TokenMap:
    block_size: int
    padded: np.ndarray  # [n] padded index of in-context token i
    position: np.ndarray  # [n] logical position of in-context token i
    padded_len: int
    real_len: int
    first_pos: np.ndarray  # [layout blocks]
    valid_start: np.ndarray
    valid_end: np.ndarray
    in_chunk: np.ndarray  # [n] True where in-context token i is a chunk token (CacheBlend)

    @classmethod
    def from_placement(cls, placement: SequencePlacement, block_size: int) -> TokenMap:
        layout = placement.layout
        if layout.block_size != block_size:
            raise StepPlanError(
                f"the step plan places a sequence at block size {layout.block_size} but this "
                f"worker's is {block_size}: scheduler and worker disagree on the block size"
            )
        if placement.compile:
            slots = layout.real_slots()
        else:
            fresh = placement.fresh_slots
            slots = list(fresh) if fresh is not None else layout.in_context_slots()
        if len(slots) != placement.num_in_context:
            raise StepPlanError(
                f"the step plan places {placement.num_in_context} in-context tokens but its "
                f"layout at block size {block_size} has {len(slots)}: scheduler and worker "
                "disagree on the block size or the layout"
            )
        positions = np.asarray(layout.slot_positions(), dtype=np.int64)
        padded = np.asarray(slots, dtype=np.int64)
        chunk_position = np.zeros(layout.num_real_tokens, dtype=bool)  # by logical position
        for span in layout.chunk_spans:
            chunk_position[span.first_position : span.first_position + span.num_tokens] = True
        valid_end = np.asarray([b.valid_end for b in layout.blocks], dtype=np.int64)
        if not placement.compile:
            valid_end[-1] = block_size  # decode continues in the last block
        return cls(
            block_size=block_size,
            padded=padded,
            position=positions[padded],
            padded_len=layout.num_padded_tokens,
            real_len=layout.num_real_tokens,
            first_pos=np.asarray([b.first_position for b in layout.blocks], dtype=np.int64),
            valid_start=np.asarray([b.valid_start for b in layout.blocks], dtype=np.int64),
            valid_end=valid_end,
            in_chunk=chunk_position[positions[padded]],
        )

    @property
    def num_in_context(self) -> int:
        return len(self.padded)
