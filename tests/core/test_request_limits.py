"""The block-table width rule (``core.request_limits``): a request is admitted exactly when its
tokens fit ``max_model_len``, at every block size and policy, for up to the configured chunks."""

import random

import pytest

from ascend_mepic.core.errors import MepicCapacityError
from ascend_mepic.core.policies import POLICY_NAMES, arrival_layout, parse_policy
from ascend_mepic.core.request_limits import (
    DEFAULT_MAX_CHUNKS,
    RequestLimits,
    entries_needed,
    table_width,
)
from ascend_mepic.core.segments import Segment, SegmentKind, build_packed_layout

MAX_MODEL_LEN = 4096
POLICIES = [n.replace("-K", "-16").replace("-R", "-15") for n in POLICY_NAMES]


def random_request(rng: random.Random) -> list[Segment]:
    """1 to 64 chunks of 1 to 2,000 tokens between prompt segments; about half fit 4,096."""
    num_chunks = rng.randint(1, DEFAULT_MAX_CHUNKS)
    budget = rng.randint(num_chunks + 1, 2 * MAX_MODEL_LEN)  # total tokens aimed at
    cap = max(1, min(2000, 2 * budget // num_chunks))  # lengths average about budget / chunks
    segments = [Segment.prompt([1] * rng.randint(1, 40))] if rng.random() < 0.7 else []
    for _ in range(num_chunks):
        segments.append(Segment.chunk([2] * rng.randint(1, cap)))
        if rng.random() < 0.5:
            segments.append(Segment.prompt([3] * rng.randint(1, 30)))
    if segments[-1].kind is SegmentKind.CHUNK:
        segments.append(Segment.prompt([4] * rng.randint(1, 30)))
    return segments


@pytest.mark.parametrize("block_size", [16, 32, 128])
def test_admitted_exactly_when_tokens_fit(block_size):
    rng = random.Random(block_size)
    width = table_width(MAX_MODEL_LEN, block_size, DEFAULT_MAX_CHUNKS)
    admitted = refused = 0
    for trial in range(400):
        segments = random_request(rng)
        policy = parse_policy(POLICIES[trial % len(POLICIES)])
        limits = RequestLimits(policy, block_size, MAX_MODEL_LEN)
        layout = arrival_layout(segments, policy, block_size)
        tokens = layout.num_real_tokens
        fits = tokens < MAX_MODEL_LEN  # vLLM's rule: room for at least one output token
        keys = {s.segment: None for s in layout.chunk_spans}
        try:
            limits.check(layout, keys)
            ok = True
        except MepicCapacityError as e:
            assert "maximum model length of 4096" in str(e) and f"length {tokens})" in str(e)
            ok = False
        assert ok == fits, (policy.name, tokens, layout.num_blocks)
        if not fits:
            refused += 1
            continue
        admitted += 1
        out = MAX_MODEL_LEN - tokens  # the most output the engine lets it generate
        assert entries_needed(layout, out) <= width
        # The placed layout (any start slot per chunk) never needs more than the arrival one.
        counts = [s.private_tokens for s in layout.chunk_spans]
        offsets = [rng.randrange(block_size) if s.num_shared else 0 for s in layout.chunk_spans]
        placed = build_packed_layout(segments, block_size, counts, offsets)
        assert entries_needed(placed, out) <= entries_needed(layout, out)
    assert admitted > 100 and refused > 100


def test_width_is_tight_enough_to_matter():
    """A fitting request needs almost the whole width: 64 chunks of three tokens, one private
    (each chunk's two canonical tokens at the worst start slot take two entries, and the private
    run after them re-lists its block), so a narrower rule would refuse it."""
    bs, policy = 128, parse_policy("mepic-1")
    segments = [Segment.prompt([1])]
    for i in range(DEFAULT_MAX_CHUNKS):
        segments += [Segment.chunk([2 + i] * 3), Segment.prompt([3])]
    layout = arrival_layout(segments, policy, bs)
    need = entries_needed(layout, MAX_MODEL_LEN - layout.num_real_tokens)
    width = table_width(MAX_MODEL_LEN, bs, DEFAULT_MAX_CHUNKS)
    assert width - 2 <= need <= width, (need, width)


def test_more_chunks_than_configured_are_refused_by_name():
    policy = parse_policy("mepic")
    segments = [Segment.prompt([1])]
    for i in range(5):
        segments += [Segment.chunk([10 + i] * 20), Segment.prompt([3])]
    layout = arrival_layout(segments, policy, 128)
    keys = {s.segment: None for s in layout.chunk_spans}
    RequestLimits(policy, 128, 4096, max_chunks=5).check(layout, keys)
    with pytest.raises(MepicCapacityError, match="5 chunks; this engine serves at most 4 .*"):
        RequestLimits(policy, 128, 4096, max_chunks=4).check(layout, keys)


def test_policies_that_ignore_segments_take_any_number_of_chunks():
    """``full`` and ``prefix`` serve a segmented prompt as a plain one: no chunk limit."""
    segments = [Segment.prompt([1])]
    for i in range(100):
        segments += [Segment.chunk([10 + i] * 3), Segment.prompt([3])]
    for name in ("full", "prefix"):
        policy = parse_policy(name)
        layout = arrival_layout(segments, policy, 128)
        keys = {s.segment: None for s in layout.chunk_spans}
        RequestLimits(policy, 128, 4096, max_chunks=64).check(layout, keys)
