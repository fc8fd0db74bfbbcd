"""A draft model's batches placed by the target's token maps (``worker.draft_placement``).

The drafter's tokens of a decoding sequence go exactly where the target's would (same padded
slots and logical positions, past the layout for the bonus and draft tokens); a chunk compile's
extra token (the proposer adds one per row) writes nowhere and is read on the chunk's last token,
so it never touches the slot after the chunk in the shared arena block."""

from __future__ import annotations

import numpy as np
import pytest

from ascend_mepic.core.plan import SequencePlacement, StepPlanError
from ascend_mepic.core.segments import Segment, build_layout, build_packed_layout
from ascend_mepic.worker import step
from ascend_mepic.worker.draft_placement import DraftPlacement
from ascend_mepic.worker.token_map import TokenMap
from ascend_mepic.worker.token_pool import TokenMapPool

BS = 16


def _pool() -> tuple[TokenMapPool, int, int]:
    """A pool with a packed request (prompt, chunk, prompt) and the chunk's compile."""
    chunk = Segment.chunk(range(100, 140))
    segments = [Segment.prompt(range(5)), chunk, Segment.prompt(range(7))]
    layout = build_packed_layout(segments, BS, [BS], [3])
    request = SequencePlacement(layout, len(layout.in_context_slots()))
    compile_ = SequencePlacement(build_layout([chunk], BS, True), 40, True)
    pool = TokenMapPool(BS)
    pool.add("req", TokenMap.from_placement(request, BS))
    pool.add("compile", TokenMap.from_placement(compile_, BS), decodes=False)
    return pool, request.num_in_context, compile_.num_in_context


def test_a_first_pass_places_decoding_rows_as_the_target_and_compile_extras_nowhere():
    pool, n_req, n_chunk = _pool()
    table = np.arange(1, 1 + 2 * 8, dtype=np.int32).reshape(2, 8)
    req_ids = ["req", "compile"]
    # The target's prefill step: every in-context token of both rows.
    target_index = np.r_[np.arange(n_req), np.arange(n_chunk)]
    placement = DraftPlacement(pool)
    placement.note_step(req_ids, target_index)
    assert placement.target_indices(n_req).tolist() == list(range(n_req))
    # The drafter's first pass: each row's tokens plus one (the sampled token).
    index = np.r_[np.arange(n_req + 1), np.arange(n_chunk + 1)]
    loc = np.array([0, n_req + 1, n_req + n_chunk + 2])
    positions, slots, placed = placement.place(loc, index, table)
    target = step.place_step(pool, req_ids, loc, index, table)
    request = slice(0, n_req + 1)
    np.testing.assert_array_equal(positions[request], target.positions[request])
    np.testing.assert_array_equal(slots[request], target.slots[request])
    assert positions[n_req] == pool.real_len[pool.rows(["req"])[0]]  # past the layout
    compile_ = slice(n_req + 1, n_req + n_chunk + 1)
    np.testing.assert_array_equal(slots[compile_], target.slots[compile_])
    assert slots[-1] == -1  # the compile's extra token writes nowhere
    assert placed.padded[-1] == placed.padded[-2]  # and reads on the chunk's last token
    assert placed.num_blocks[1] == -(-n_chunk // BS)  # within the chunk's own blocks


def test_a_later_draft_step_places_one_token_per_row():
    pool, n_req, n_chunk = _pool()
    table = np.arange(1, 1 + 2 * 8, dtype=np.int32).reshape(2, 8)
    placement = DraftPlacement(pool)
    placement.note_step(["req", "compile"], np.r_[np.arange(n_req), np.arange(n_chunk)])
    index = np.array([n_req + 1, n_chunk + 1])
    positions, slots, _ = placement.place(np.array([0, 1, 2]), index, table)
    target = step.place_step(pool, ["req", "compile"], np.array([0, 1, 2]), index, table)
    assert positions[0] == target.positions[0] and slots[0] == target.slots[0]
    assert slots[1] == -1


def test_more_target_tokens_than_the_step_placed_are_refused():
    pool, n_req, _ = _pool()
    placement = DraftPlacement(pool)
    placement.note_step(["req"], np.arange(n_req))
    with pytest.raises(StepPlanError, match="the drafter asked for"):
        placement.target_indices(n_req + 1)
