"""The vectorised step placement (``token_pool`` + ``step.place_step``) against the per-sequence
placement it replaced, kept here as the oracle: same positions, padded indices, KV slots, entry
tables and CacheBlend candidates, over batches that mix plain, padded, packed, compile and
CacheBlend sequences, with sequences joining and leaving and vLLM moving batch rows."""

from __future__ import annotations

import random
import types
from dataclasses import dataclass, replace

import numpy as np
import pytest
import torch

from ascend_mepic.core.plan import SequencePlacement, StepPlan
from ascend_mepic.core.segments import Segment, SegmentKind, build_layout, build_packed_layout
from ascend_mepic.worker import step
from ascend_mepic.worker.model_runner import MepicRunnerMixin
from ascend_mepic.worker.token_map import TokenMap
from ascend_mepic.worker.token_pool import TokenMapPool

BS = 16
TABLE_WIDTH = 96
CHECK_LAYER = 1


def _placement(rng: random.Random) -> SequencePlacement:
    """A random MEPIC placement: padded or packed, in context or a compile, maybe blending."""
    kind = rng.choice(["padded", "packed", "compile"])
    if kind == "compile":
        n = rng.randint(1, 70)
        return SequencePlacement(build_layout([Segment.chunk(range(n))], BS, True), n, True)
    segments = [Segment.prompt(range(rng.randint(1, 40)))]
    for _ in range(rng.randint(1, 3)):
        segments.append(Segment.chunk(range(rng.randint(1, 90))))
        if rng.random() < 0.5:
            segments.append(Segment.prompt(range(rng.randint(1, 20))))
    if segments[-1].kind is SegmentKind.CHUNK:
        segments.append(Segment.prompt(range(rng.randint(1, 20))))
    if kind == "packed":
        chunks = [s for s in segments if s.kind is SegmentKind.CHUNK]
        private = [rng.randint(1, min(len(c.token_ids), BS)) for c in chunks]
        layout = build_packed_layout(segments, BS, private, [rng.randrange(BS) for _ in chunks])
    else:
        layout = build_layout(segments, BS)
    blend = (rng.choice([0.2, 0.5, 1.0]), 1) if rng.random() < 0.3 else None
    return SequencePlacement(layout, len(layout.in_context_slots()), blend=blend)


# The per-sequence placement the pool replaced (the oracle).


def _lookup(tmap: TokenMap, index: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    n = tmap.num_in_context
    inside = index < n
    clipped = np.minimum(index, n - 1)
    extra = index - n
    padded = np.where(inside, tmap.padded[clipped], tmap.padded_len + extra)
    position = np.where(inside, tmap.position[clipped], tmap.real_len + extra)
    return padded, position


def _blocks(tmap: TokenMap, num_blocks: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    n = len(tmap.first_pos)
    if num_blocks <= n:
        return (
            tmap.first_pos[:num_blocks],
            tmap.valid_start[:num_blocks],
            tmap.valid_end[:num_blocks],
        )
    j = np.arange(n, num_blocks, dtype=np.int64)
    extra_first = tmap.real_len + j * tmap.block_size - tmap.padded_len
    return (
        np.concatenate([tmap.first_pos, extra_first]),
        np.concatenate([tmap.valid_start, np.zeros_like(j)]),
        np.concatenate([tmap.valid_end, np.full_like(j, tmap.block_size)]),
    )


@dataclass
class _Oracle:
    positions: np.ndarray
    padded: np.ndarray
    slots: dict[int, int]  # token row -> slot, for mapped sequences only
    num_blocks: np.ndarray
    first_pos: np.ndarray
    valid_start: np.ndarray
    valid_end: np.ndarray
    blending: list[tuple[int, int, list[int], float]]


def _oracle(maps, blends, req_ids, loc, index, table) -> _Oracle:
    positions, padded = index.copy(), index.copy()
    blocks, slots, blending = [], {}, []
    for i, req_id in enumerate(req_ids):
        a, b = int(loc[i]), int(loc[i + 1])
        tmap = maps.get(req_id)
        if tmap is None:
            n = int(index[b - 1]) // BS + 1 if b > a else 0
            j = np.arange(n, dtype=np.int64)
            blocks.append((j * BS, np.zeros_like(j), np.full_like(j, BS)))
            continue
        if b == a:
            blocks.append(_blocks(tmap, 0))
            continue
        pad_idx, pos = _lookup(tmap, index[a:b])
        padded[a:b], positions[a:b] = pad_idx, pos
        blocks.append(_blocks(tmap, int(pad_idx.max()) // BS + 1))
        if req_id in blends:
            n = tmap.num_in_context
            idx = index[a:b]
            chunk = (idx < n) & tmap.in_chunk[np.minimum(idx, n - 1)]
            rows = (np.nonzero(chunk)[0] + a).tolist()
            if rows:
                blending.append((a, b, rows, blends[req_id]))
        for t, p in zip(range(a, b), pad_idx, strict=True):
            slots[t] = int(table[i, p // BS]) * BS + int(p) % BS
    width = max(1, max(len(f) for f, _, _ in blocks))
    tables = np.zeros((3, len(req_ids), width), dtype=np.int64)
    for i, per_entry in enumerate(blocks):
        for k, values in enumerate(per_entry):
            tables[k, i, : len(values)] = values
    counts = np.array([len(f) for f, _, _ in blocks])
    return _Oracle(positions, padded, slots, counts, *tables, blending)


class _Batch:
    """A stand-in for vLLM's persistent batch: request per row, block-table rows that move with
    their request (condense fills holes from the end, swaps reorder)."""

    def __init__(self, rng: random.Random) -> None:
        self.rng = rng
        self.req_ids: list[str] = []
        self.table = np.zeros((0, TABLE_WIDTH), dtype=np.int32)
        self.computed: list[int] = []  # tokens already computed per row

    def add(self, req_id: str) -> None:
        self.req_ids.append(req_id)
        row = np.array(self.rng.sample(range(1, 10_000), TABLE_WIDTH), dtype=np.int32)
        self.table = np.vstack([self.table, row[None]])
        self.computed.append(0)

    def remove_and_condense(self, req_id: str) -> None:
        i = self.req_ids.index(req_id)
        last = len(self.req_ids) - 1
        for name in ("req_ids", "computed"):
            values = getattr(self, name)
            values[i] = values[last]
            values.pop()
        self.table[i] = self.table[last]
        self.table = self.table[:last]

    def swap(self, i: int, j: int) -> None:
        for values in (self.req_ids, self.computed):
            values[i], values[j] = values[j], values[i]
        self.table[[i, j]] = self.table[[j, i]]


def _check(pool, maps, blends, req_ids, loc, index, table) -> None:
    got = step.place_step(pool, req_ids, loc, index, table, CHECK_LAYER)
    want = _oracle(maps, blends, req_ids, loc, index, table)
    np.testing.assert_array_equal(got.positions, want.positions)
    np.testing.assert_array_equal(got.padded, want.padded)
    mapped_rows = sorted(want.slots)
    assert np.flatnonzero(got.mapped).tolist() == mapped_rows
    assert got.slots[mapped_rows].tolist() == [want.slots[t] for t in mapped_rows]
    np.testing.assert_array_equal(got.num_blocks, want.num_blocks)
    np.testing.assert_array_equal(got.first_pos, want.first_pos)
    np.testing.assert_array_equal(got.valid_start, want.valid_start)
    np.testing.assert_array_equal(got.valid_end, want.valid_end)
    requests = got.blend.requests if got.blend is not None else []
    blending = [(a, b, rows.tolist(), ratio) for a, b, rows, ratio in requests]
    assert blending == want.blending
    assert got.blend is None or got.blend.check_layer == CHECK_LAYER
    counts = np.diff(loc)
    assert got.max_query_len == (int(counts.max()) if len(counts) else 0)
    tables = got.tables("cpu")
    assert got.num_reqs == len(req_ids) and tables[3].dtype == torch.int32
    assert got.tables("cpu") is tables  # copied once per step and device


@pytest.mark.parametrize("seed", range(6))
def test_steps_match_the_per_sequence_placement(seed: int) -> None:
    """Many steps: sequences join (maps or plain) and leave, vLLM condenses and swaps rows,
    prefills are split across steps, some rows schedule nothing, decode runs long."""
    rng = random.Random(seed)
    pool = TokenMapPool(BS, rows=2)  # small, so rows and tables grow during the test
    maps: dict[str, TokenMap] = {}
    blends: dict[str, float] = {}
    prompt_len: dict[str, int] = {}
    batch = _Batch(rng)
    for s in range(60):
        for _ in range(rng.randint(0, 3)):
            req_id = f"s{s}r{rng.randrange(10**6)}"
            batch.add(req_id)
            if rng.random() < 0.7:
                placement = _placement(rng)
                tmap = TokenMap.from_placement(placement, BS)
                ratio = placement.blend[0] if placement.blend else None
                pool.add(req_id, tmap, ratio)
                maps[req_id] = tmap
                if ratio is not None:
                    blends[req_id] = ratio
                prompt_len[req_id] = placement.num_in_context
            else:
                prompt_len[req_id] = rng.randint(1, 120)
        for req_id in list(batch.req_ids):
            if rng.random() < 0.08:
                batch.remove_and_condense(req_id)
                pool.remove(req_id)
                maps.pop(req_id, None)
                blends.pop(req_id, None)
        for _ in range(rng.randint(0, 2)):
            if len(batch.req_ids) > 1:
                batch.swap(*rng.sample(range(len(batch.req_ids)), 2))
        if not batch.req_ids:
            continue
        counts = []
        for i, req_id in enumerate(batch.req_ids):
            left = prompt_len[req_id] - batch.computed[i]
            if rng.random() < 0.1:
                n = 0
            elif left > 0:
                n = rng.randint(1, left + 2)  # a prefill chunk, maybe into the first decode
            else:
                n = 1
            room = TABLE_WIDTH * BS - 8 * BS - batch.computed[i]
            counts.append(max(0, min(n, room)))
        loc = np.zeros(len(counts) + 1, dtype=np.int32)
        loc[1:] = np.cumsum(counts)
        index = np.concatenate(
            [np.arange(c, c + n) for c, n in zip(batch.computed, counts, strict=True)]
            + [np.zeros(0, dtype=np.int64)]
        ).astype(np.int64)
        _check(pool, maps, blends, list(batch.req_ids), loc, index, batch.table)
        batch.computed = [c + n for c, n in zip(batch.computed, counts, strict=True)]


def test_a_resumed_sequence_takes_its_new_map_and_rows_are_reused() -> None:
    rng = random.Random(7)
    pool = TokenMapPool(BS, rows=2)
    first, second = (TokenMap.from_placement(_placement(rng), BS) for _ in range(2))
    pool.add("a", first)
    pool.add("a", second)
    assert len(pool) == 1
    pool.remove("a")
    pool.add("b", first)
    assert len(pool) == 1 and pool.rows(["b", "plain"]).tolist() == [1, 0]
    table = np.arange(TABLE_WIDTH, dtype=np.int32)[None]
    index = np.arange(first.num_in_context + 3, dtype=np.int64)
    loc = np.array([0, len(index)], dtype=np.int32)
    _check(pool, {"b": first}, {}, ["b"], loc, index, table)


def test_a_block_size_mismatch_is_refused() -> None:
    tmap = TokenMap.from_placement(_placement(random.Random(1)), BS)
    with pytest.raises(ValueError, match="block-16 map"):
        TokenMapPool(32).add("a", tmap)


class _StandInRunner(MepicRunnerMixin):
    """What ``_place_tokens`` reads and writes on vLLM 0.30.0's runner."""

    def __init__(self, req_ids, loc, index, table) -> None:
        self.mepic_block_size = BS
        self.mepic_blend_layer = CHECK_LAYER
        self.device = torch.device("cpu")
        self._init_placement_state()
        block_table = types.SimpleNamespace(
            block_size=BS,
            blocks_per_kv_block=1,
            block_table=types.SimpleNamespace(np=table),
            slot_mapping=types.SimpleNamespace(gpu=torch.full((len(index) + 4,), -7)),
        )
        self.input_batch = types.SimpleNamespace(
            num_reqs=len(req_ids), req_ids=list(req_ids) + ["stale"], block_table=[block_table]
        )
        self.query_start_loc = types.SimpleNamespace(np=np.append(loc, [loc[-1]] * 2))
        self.positions = torch.from_numpy(np.append(index, [0, 0]))
        self.builder = types.SimpleNamespace(set_step_inputs=self._take)
        self.attn_groups = [[types.SimpleNamespace(metadata_builders=[self.builder])]]

    def _take(self, inputs) -> None:
        self.inputs = inputs


@pytest.mark.parametrize("plain_first", [True, False])
def test_the_runner_writes_positions_slots_and_tables(plain_first: bool) -> None:
    rng = random.Random(3)
    placements = {}
    while len(placements) < 3:
        p = _placement(rng)
        if not p.compile:
            placements[f"m{len(placements)}"] = p
    placements["m0"] = replace(placements["m0"], blend=(0.5, 1))
    req_ids = ["p0", *placements] if plain_first else [*placements, "p0"]
    counts = {"p0": 5, "m0": placements["m0"].num_in_context, "m1": 1, "m2": 2}
    starts = {"p0": 40, "m0": 0, "m1": 300, "m2": placements["m2"].num_in_context - 1}
    loc = np.concatenate([[0], np.cumsum([counts[r] for r in req_ids])]).astype(np.int32)
    index = np.concatenate([np.arange(starts[r], starts[r] + counts[r]) for r in req_ids])
    table = np.array([rng.sample(range(1, 5000), TABLE_WIDTH) for _ in req_ids], dtype=np.int32)
    runner = _StandInRunner(req_ids, loc, index.astype(np.int64), table)
    plan = StepPlan(step=1, placements=placements)
    new = [
        types.SimpleNamespace(req_id=r, prompt_token_ids=range(p.num_in_context))
        for r, p in placements.items()
    ]
    runner._take_placements(plan, new)
    slots_before = runner.input_batch.block_table[0].slot_mapping.gpu.clone()
    runner._place_tokens(len(index))

    maps = {r: TokenMap.from_placement(p, BS) for r, p in placements.items()}
    want = _oracle(maps, {"m0": 0.5}, req_ids, loc, index.astype(np.int64), table)
    assert runner.positions[: len(index)].tolist() == want.positions.tolist()
    slots = runner.input_batch.block_table[0].slot_mapping.gpu
    expected = slots_before.clone()
    for t, slot in want.slots.items():
        expected[t] = slot
    assert slots.tolist() == expected.tolist()  # plain sequences keep vLLM's slots
    _, padded, num_blocks, first_pos, _, valid_end = runner.inputs.tables("cpu")
    assert padded.tolist() == want.padded.tolist()
    assert num_blocks.tolist() == want.num_blocks.tolist()
    assert first_pos.tolist() == want.first_pos.tolist()
    assert valid_end.tolist() == want.valid_end.tolist()
    blend_state = runner.inputs.blend
    assert [(a, b, r.tolist(), x) for a, b, r, x in blend_state.requests] == want.blending
