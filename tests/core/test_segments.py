"""Layout, identity and marker properties (no vLLM state)."""

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from ascend_mepic.core.identity import chunk_identity
from ascend_mepic.core.markers import MarkerError, Markers, segments_from_text, split_marked_text
from ascend_mepic.core.segments import (
    BlockKind,
    Layout,
    LayoutError,
    Segment,
    SegmentKind,
    build_layout,
    build_packed_layout,
    layout_from_real,
)

tokens = st.lists(st.integers(1, 5000), min_size=1, max_size=80)
segment = st.builds(
    lambda kind, ids: Segment(kind, tuple(ids)), st.sampled_from(list(SegmentKind)), tokens
)
segment_lists = st.builds(
    lambda body, last: [*body, Segment.prompt(last)], st.lists(segment, max_size=6), tokens
)
block_sizes = st.sampled_from([1, 4, 16, 32, 128])


@settings(max_examples=300, deadline=None)
@given(segment_lists, block_sizes)
def test_layout_invariants(segments, bs):
    layout = build_layout(segments, bs)
    flat = [t for s in segments for t in s.token_ids]
    padded = layout.padded_token_ids(pad_token_id=-1)
    positions = layout.slot_positions()
    assert len(padded) == len(positions) == layout.num_padded_tokens
    real = [(p, t) for p, t in zip(positions, padded, strict=True) if p >= 0]
    # Every real token keeps its unsegmented position, in order, and pads have none.
    assert [p for p, _ in real] == list(range(len(flat)))
    assert [t for _, t in real] == flat
    assert all(t == -1 for p, t in zip(positions, padded, strict=True) if p < 0)
    for span in layout.spans:
        if span.kind is SegmentKind.CHUNK:
            # Chunks start on a block boundary, end on one, and only their first block has pads.
            first = layout.blocks[span.first_block]
            assert first.kind is BlockKind.CHUNK_FIRST
            assert first.valid_start == span.pad < bs and first.valid_end == bs
            for b in layout.blocks[span.first_block + 1 : span.first_block + span.num_blocks]:
                assert b.kind is BlockKind.CHUNK_SHARED
                assert (b.valid_start, b.valid_end) == (0, bs)
        elif span.segment < len(segments) - 1:
            assert (span.num_tokens + span.pad) % bs == 0
    # Round trip through vLLM's token ids plus the extra_args description.
    again = layout_from_real(flat, layout.segment_lengths(), bs)
    assert again.blocks == layout.blocks and again.segments == layout.segments


@settings(max_examples=300, deadline=None)
@given(segment_lists, block_sizes, st.data())
def test_packed_counts_match_entries(segments, bs, data):
    """The counts a packed layout computes per segment (without its entries) are the entries'."""
    sizes = [len(s.token_ids) for s in segments if s.kind is SegmentKind.CHUNK]
    private = [data.draw(st.integers(0, n)) for n in sizes]
    offsets = data.draw(st.one_of(st.none(), st.lists(st.integers(0, bs - 1), min_size=len(sizes),
                                                      max_size=len(sizes))))  # fmt: skip
    layout = build_packed_layout(segments, bs, private, offsets)
    # Built without the dataclass's __init__: the same fields as one built with it.
    same = Layout(
        layout.block_size, layout.segments, layout.spans, layout.num_blocks,
        layout.num_padded_tokens, packed=True, num_private_blocks=layout.num_private_blocks,
        num_private_tokens=layout.num_private_tokens, offsets=layout.offsets,
    )  # fmt: skip
    assert vars(layout) == vars(same) and layout == same and hash(layout) == hash(same)
    blocks = layout.blocks
    assert [b.index for b in blocks] == list(range(layout.num_blocks))
    assert layout.num_padded_tokens == blocks[-1].index * bs + blocks[-1].valid_end
    in_context = [b for b in blocks if b.kind is BlockKind.PRIVATE]
    assert layout.num_in_context() == sum(b.num_valid for b in in_context)
    assert layout.num_private_blocks == len({b.private_block for b in in_context})
    flat = [t for s in segments for t in s.token_ids]
    assert layout.private_token_ids() == [
        t for b in in_context for t in flat[b.first_position : b.first_position + b.num_valid]
    ]
    for span in layout.spans:
        # A private run that goes on in the last entry starts the span there (another segment's).
        mine = blocks[span.first_block : span.first_block + span.num_blocks]
        assert all(b.segment == span.segment for b in mine[1:])
        shared = blocks[span.shared_first : span.shared_first + span.num_shared]
        assert all(b.kind is BlockKind.CHUNK_SHARED for b in shared)


@settings(max_examples=100, deadline=None)
@given(tokens, segment_lists, segment_lists, block_sizes)
def test_chunk_blocks_identical_at_any_offset(chunk, before, after, bs):
    """The canonical blocks of a chunk hold the same tokens wherever it appears."""
    c = Segment.chunk(chunk)
    views = []
    for prefix in (before, after):
        layout = build_layout([*prefix[:-1], c, Segment.prompt([1])], bs)
        span = layout.spans[len(prefix) - 1]
        padded = layout.padded_token_ids()
        start = (span.first_block + 1) * bs
        views.append(padded[start : (span.first_block + span.num_blocks) * bs])
    assert views[0] == views[1]


@given(tokens, block_sizes)
def test_identity_position_independent_and_salted(ids, bs):
    a = chunk_identity(ids, bs, "m:float32")
    assert a == chunk_identity(list(ids), bs, "m:float32")
    assert a != chunk_identity(ids, bs, "m:float32", cache_salt="tenant-b")
    assert a != chunk_identity(ids, bs, "m:bfloat16")
    assert a != chunk_identity(ids, bs + 1, "m:float32")
    # An anchor is part of the identity; no anchor gives the digest earlier versions gave.
    assert a == chunk_identity(ids, bs, "m:float32", anchor=())
    assert a != chunk_identity(ids, bs, "m:float32", anchor=(1, 2))
    assert chunk_identity(ids, bs, "m:float32", anchor=(1, 2)) != chunk_identity(
        ids, bs, "m:float32", anchor=(1, 3)
    )


def test_identity_without_anchor_is_unchanged():
    """The digest of an unanchored chunk is the one earlier versions stored in tiers."""
    assert (
        chunk_identity([5, 6, 7], 16, "m:float32")
        == "804d3987931fd95a6f3ee27676188b0e4f51a037a6f76426943c80a7d4961908"
    )


def test_layout_errors():
    with pytest.raises(LayoutError, match="last segment must be a prompt"):
        build_layout([Segment.prompt([1]), Segment.chunk([2])], 4)
    with pytest.raises(LayoutError, match="empty"):
        build_layout([Segment.chunk([]), Segment.prompt([1])], 4)
    with pytest.raises(LayoutError, match="sum to"):
        layout_from_real([1, 2, 3], [["chunk", 2], ["prompt", 2]], 4)
    with pytest.raises(LayoutError, match="kind"):
        layout_from_real([1, 2], [["doc", 1], ["prompt", 1]], 1)
    with pytest.raises(LayoutError, match="length"):
        layout_from_real([1, 2], [["chunk", -1], ["prompt", 3]], 1)


def test_example_layout():
    layout = build_layout(
        [Segment.prompt([1, 2, 3]), Segment.chunk(range(10, 16)), Segment.prompt([7, 8])], 4
    )
    assert layout.padded_token_ids() == [1, 2, 3, 0, 0, 0, 10, 11, 12, 13, 14, 15, 7, 8]
    assert [b.kind for b in layout.blocks] == [
        BlockKind.PROMPT,
        BlockKind.CHUNK_FIRST,
        BlockKind.CHUNK_SHARED,
        BlockKind.PROMPT,
    ]
    assert layout.slot_positions() == [0, 1, 2, -1, -1, -1, 3, 4, 5, 6, 7, 8, 9, 10]


class CharTokenizer:
    bos_token_id = 1

    def encode(self, text, add_special_tokens=True):
        return ([1] if add_special_tokens else []) + [ord(c) for c in text]


def test_markers_split_and_tokenize_alone():
    m = Markers()
    text = f"sys {m.begin}doc one{m.end} mid {m.begin}doc two{m.end} q?"
    pieces = split_marked_text(text)
    assert [(p.kind.value, p.text) for p in pieces] == [
        ("prompt", "sys "),
        ("chunk", "doc one"),
        ("prompt", " mid "),
        ("chunk", "doc two"),
        ("prompt", " q?"),
    ]
    segs = segments_from_text(CharTokenizer(), text)
    assert segs[0].token_ids[0] == 1 and segs[1].token_ids == tuple(map(ord, "doc one"))
    lead = segments_from_text(CharTokenizer(), f"{m.begin}doc{m.end}q")
    assert lead[0] == Segment.prompt([1]) and lead[1].kind is SegmentKind.CHUNK


@pytest.mark.parametrize(
    "text, match",
    [
        ("a <<<MEPIC_CHUNK>>>b", "offset 2 is never closed"),
        ("a <<<END_MEPIC_CHUNK>>> b", "offset 2 has no matching begin"),
        (
            "<<<MEPIC_CHUNK>>>a<<<MEPIC_CHUNK>>>b<<<END_MEPIC_CHUNK>>>",
            "nested begin marker at offset 18",
        ),
        ("x<<<MEPIC_CHUNK>>><<<END_MEPIC_CHUNK>>>y", "empty chunk at offset 1"),
    ],
)
def test_marker_errors_name_offset(text, match):
    with pytest.raises(MarkerError, match=match):
        split_marked_text(text)


def test_trailing_chunk_rejected():
    with pytest.raises(MarkerError, match="must end with prompt"):
        segments_from_text(CharTokenizer(), "q <<<MEPIC_CHUNK>>>doc<<<END_MEPIC_CHUNK>>>")


def test_flat_segment_lengths_for_vllm_xargs():
    from ascend_mepic.core.segments import parse_segment_lengths

    assert parse_segment_lengths(["prompt", 3, "chunk", 40, "prompt", 2]) == parse_segment_lengths(
        [["prompt", 3], ["chunk", 40], ["prompt", 2]]
    )
    with pytest.raises(LayoutError, match="flat form"):
        parse_segment_lengths(["prompt", 3, "chunk"])
