"""Segments and the two MEPIC layouts of a request's block table.

A request is an ordered list of segments: ``prompt`` (request-specific) or ``chunk`` (reusable,
immutable). A layout lists the request's block-table *entries* in logical order; each is one
contiguous slot range of one physical block with the logical position of its first token, so the
attention op can read any arrangement (``ops/metadata.py``).

* ``build_packed_layout`` (shared placement, and private placement's copies): the request's
  *private stream* (prompt tokens and each chunk's first ``k`` tokens) is packed densely into its
  private blocks, and each chunk's other (canonical) tokens are entries into the chunk cache's
  blocks, packed back to back with other chunks'. No padding anywhere; a private block is listed
  once per run of the stream that a chunk's canonical tokens interrupt.
* ``build_layout`` (the paper's first design, kept for host-store compiles and tests): every chunk
  is padded at the *front* to whole blocks and every prompt segment but the last at the *back*.

Logical positions count real tokens only: a real token's position (used for RoPE) equals its
position in the unsegmented prompt. Pads have no position and are never attended to.

This module holds no tensors and no vLLM state: it is pure scheduling-path metadata.
"""

from __future__ import annotations

import enum
from collections.abc import Sequence
from dataclasses import dataclass, field
from functools import cached_property

# Stored in pad slots of vLLM's token ids. Its value never matters: pads are masked everywhere.
DEFAULT_PAD_TOKEN_ID = 0

# SamplingParams.extra_args keys a client sends with a request (``vllm_xargs`` on the server):
# [[kind, num_real_tokens], ...] for a prompt sent as its real tokens,
EXTRA_ARGS_KEY = "mepic_segments"
# and the explicit-chunk controls: pin the request's chunks once computed / unpin them.
PIN_KEY = "mepic_pin"
UNPIN_KEY = "mepic_unpin"
# What the scheduler tells the worker travels in a ``core.plan.StepPlan``, not in extra_args.


class LayoutError(ValueError):
    """A segment list or padded prompt that cannot form a valid MEPIC layout."""


class SegmentKind(str, enum.Enum):
    PROMPT = "prompt"
    CHUNK = "chunk"


class BlockKind(str, enum.Enum):
    PROMPT = "prompt"
    CHUNK_FIRST = "chunk-first"
    CHUNK_SHARED = "chunk-shared"
    PRIVATE = "private"  # packed layout: a run of the request's private stream in one block


@dataclass(frozen=True)
class Segment:
    kind: SegmentKind
    token_ids: tuple[int, ...]

    @classmethod
    def prompt(cls, token_ids: Sequence[int]) -> Segment:
        return cls(SegmentKind.PROMPT, tuple(token_ids))

    @classmethod
    def chunk(cls, token_ids: Sequence[int]) -> Segment:
        return cls(SegmentKind.CHUNK, tuple(token_ids))


# Layout specs are built by the dozen for every admitted request. They are slotted and not frozen
# because a frozen dataclass costs ~4 us to build (one object.__setattr__ per field) against
# ~0.7 us; nothing mutates them once a layout is built.
@dataclass(slots=True, unsafe_hash=True)
class BlockSpec:
    """One block of the padded layout.

    Real tokens occupy slots ``[valid_start, valid_end)``; ``first_position`` is the logical
    position of the token in slot ``valid_start``.
    """

    index: int
    kind: BlockKind
    segment: int
    valid_start: int
    valid_end: int
    first_position: int
    # Packed layout: which private block holds this entry (-1: a shared entry), and for a shared
    # entry which of its chunk's canonical blocks it reads (-1: a private entry).
    private_block: int = -1
    shared_index: int = -1

    @property
    def num_valid(self) -> int:
        return self.valid_end - self.valid_start


@dataclass(slots=True, unsafe_hash=True)
class SegmentSpan:
    """Where one segment sits in the padded layout."""

    segment: int
    kind: SegmentKind
    first_block: int
    num_blocks: int
    pad: int
    first_position: int
    num_tokens: int
    # Packed layout, chunks: tokens computed in context (the private stream), and the table
    # entries of the chunk's canonical tokens (``shared_first`` .. ``+ num_shared``).
    private_tokens: int = 0
    shared_first: int = -1
    num_shared: int = 0


@dataclass(frozen=True)
class Layout:
    """One request's prompt laid out as block-table entries (padded or packed).

    The counts a scheduler needs (spans, ``num_blocks``, ``num_padded_tokens``, the private
    stream) are computed per segment when the layout is built; the entries themselves
    (``blocks``, one object per table entry) are built on first use, because most layouts
    built on the scheduling path (at a request's arrival, before its chunks are placed) are
    only ever asked for those counts.
    """

    block_size: int
    segments: tuple[Segment, ...]
    spans: tuple[SegmentSpan, ...]
    num_blocks: int
    num_padded_tokens: int  # length of the padded prompt (the last block may be partial)
    packed: bool = False
    num_private_blocks: int = 0  # packed: physical blocks of the private stream
    num_private_tokens: int = 0  # packed: length of the private stream
    offsets: tuple[int, ...] = ()  # packed: start slot of each chunk's canonical tokens
    chunk_spans: tuple[SegmentSpan, ...] = field(init=False, compare=False, repr=False)

    def __post_init__(self) -> None:
        # Set here, not a cached_property: that one takes a lock on first use (Python 3.11),
        # and every request's layouts are asked for their chunks.
        chunks = tuple(s for s in self.spans if s.kind is SegmentKind.CHUNK)
        object.__setattr__(self, "chunk_spans", chunks)

    @cached_property
    def blocks(self) -> tuple[BlockSpec, ...]:
        return _packed_entries(self) if self.packed else _padded_entries(self)

    @property
    def num_real_tokens(self) -> int:
        return sum(len(s.token_ids) for s in self.segments)

    def chunk_tokens(self, span: SegmentSpan) -> tuple[int, ...]:
        return self.segments[span.segment].token_ids

    def _width(self, spec: BlockSpec) -> int:
        """Slots entry ``spec`` spans in the padded index (the last entry ends at its tokens)."""
        return self.block_size if spec.index < len(self.blocks) - 1 else spec.valid_end

    def real_token_ids(self) -> list[int]:
        """The real tokens in logical order (the unsegmented prompt)."""
        return [t for seg in self.segments for t in seg.token_ids]

    def padded_token_ids(self, pad_token_id: int = DEFAULT_PAD_TOKEN_ID) -> list[int]:
        """The token of every slot of the layout (its table entries in order), pads as given."""
        tokens = self.real_token_ids()
        out: list[int] = []
        for spec in self.blocks:  # per entry, never per slot: slices of the real tokens
            out += [pad_token_id] * spec.valid_start
            out += tokens[spec.first_position : spec.first_position + spec.num_valid]
            out += [pad_token_id] * (self._width(spec) - spec.valid_end)
        return out

    def private_token_ids(self) -> list[int]:
        """The tokens computed in the request's context, in order (packed: the private stream)."""
        if self.packed:  # per segment: prompt tokens, each chunk's first private tokens
            out = []
            for span in self.spans:
                ids = self.segments[span.segment].token_ids
                out += ids if span.kind is SegmentKind.PROMPT else ids[: span.private_tokens]
            return out
        tokens = self.real_token_ids()
        out: list[int] = []
        for spec in self.blocks:
            if spec.kind is not BlockKind.CHUNK_SHARED:
                out += tokens[spec.first_position : spec.first_position + spec.num_valid]
        return out

    def slot_positions(self) -> list[int]:
        """Logical position per padded slot, -1 for pads (for tests, oracles and the runner)."""
        out: list[int] = []
        for spec in self.blocks:
            out += [-1] * spec.valid_start
            out += range(spec.first_position, spec.first_position + spec.num_valid)
            out += [-1] * (self._width(spec) - spec.valid_end)
        return out

    def in_context_slots(self) -> list[int]:
        """Padded indices of the real tokens computed in the request's context, in order.

        Those are the tokens of prompt blocks and of every chunk's first block; a chunk's later
        blocks are never computed in context (they are shared, or compiled alone).
        """
        bs = self.block_size
        out: list[int] = []
        for spec in self.blocks:
            if spec.kind is not BlockKind.CHUNK_SHARED:
                out += range(spec.index * bs + spec.valid_start, spec.index * bs + spec.valid_end)
        return out

    def num_in_context(self) -> int:
        """How many real tokens are computed in the request's context."""
        if self.packed:
            return self.num_private_tokens
        return sum(s.num_valid for s in self.blocks if s.kind is not BlockKind.CHUNK_SHARED)

    def real_slots(self) -> list[int]:
        """Padded indices of every real token, in order."""
        bs = self.block_size
        out: list[int] = []
        for spec in self.blocks:
            out += range(spec.index * bs + spec.valid_start, spec.index * bs + spec.valid_end)
        return out

    def segment_lengths(self) -> list[list]:
        """The compact description that travels in ``extra_args[EXTRA_ARGS_KEY]``."""
        return [[KIND_VALUES[s.kind], len(s.token_ids)] for s in self.segments]


def _check_segments(
    segments: Sequence[Segment], block_size: int, allow_trailing_chunk: bool
) -> int:
    """Checks both layouts share; returns the last segment's index."""
    if block_size <= 0:
        raise LayoutError(f"block size must be positive, got {block_size}")
    if not segments:
        raise LayoutError("a request needs at least one segment")
    last = len(segments) - 1
    if segments[last].kind is not SegmentKind.PROMPT and not allow_trailing_chunk:
        raise LayoutError(
            "the last segment must be a prompt segment (the request-specific question); "
            "a trailing chunk would have to be recomputed anyway"
        )
    return last


def build_layout(
    segments: Sequence[Segment], block_size: int, allow_trailing_chunk: bool = False
) -> Layout:
    """The padded layout for ``block_size``; raises LayoutError on invalid input.

    ``allow_trailing_chunk`` is only for a chunk's compile (the chunk alone, no question).
    """
    last = _check_segments(segments, block_size, allow_trailing_chunk)
    spans: list[SegmentSpan] = []
    num_blocks = position = 0
    for i, seg in enumerate(segments):
        n = len(seg.token_ids)
        if n == 0:
            raise LayoutError(f"segment {i} ({seg.kind.value}) is empty")
        nb = -(-n // block_size)
        pad = nb * block_size - n if seg.kind is SegmentKind.CHUNK or i < last else 0
        spans.append(SegmentSpan(i, seg.kind, num_blocks, nb, pad, position, n))
        num_blocks += nb
        position += n
    # Chunk blocks end full; a prompt's last block ends at its last token.
    final = spans[-1]
    tail = (
        block_size
        if final.kind is SegmentKind.CHUNK
        else final.num_tokens - ((final.num_blocks - 1) * block_size)
    )
    return Layout(
        block_size, tuple(segments), tuple(spans), num_blocks, (num_blocks - 1) * block_size + tail
    )


def _padded_entries(layout: Layout) -> tuple[BlockSpec, ...]:
    """The padded layout's blocks, from its spans."""
    bs = layout.block_size
    blocks: list[BlockSpec] = []
    for span in layout.spans:
        first, i, position = span.first_block, span.segment, span.first_position
        if span.kind is SegmentKind.CHUNK:
            blocks.append(BlockSpec(first, BlockKind.CHUNK_FIRST, i, span.pad, bs, position))
            pos = position + bs - span.pad
            blocks += [
                BlockSpec(first + b, BlockKind.CHUNK_SHARED, i, 0, bs, pos + (b - 1) * bs)
                for b in range(1, span.num_blocks)
            ]
        else:
            n = span.num_tokens
            blocks += [
                BlockSpec(first + b, BlockKind.PROMPT, i, 0, min(bs, n - b * bs), position + b * bs)
                for b in range(span.num_blocks)
            ]
    return tuple(blocks)


def shared_entries(num_shared_tokens: int, block_size: int) -> int:
    """Table entries a chunk's canonical tokens span at the worst start slot (``B - 1``)."""
    if num_shared_tokens <= 0:
        return 0
    return -(-(num_shared_tokens + block_size - 1) // block_size)


def build_packed_layout(
    segments: Sequence[Segment],
    block_size: int,
    private_tokens: Sequence[int],
    offsets: Sequence[int] | None = None,
    allow_trailing_chunk: bool = False,
) -> Layout:
    """The packed layout (block-size independent recompute, no padding anywhere).

    ``private_tokens[c]``: how many leading tokens of chunk ``c`` (chunk segments in order) are
    computed in the request's context; its other tokens are the chunk's canonical tokens, stored
    once in the chunk cache starting at slot ``offsets[c]`` of the chunk's first canonical block
    and packed back to back with other chunks'. Without ``offsets`` (before the chunk cache has
    placed the chunks) every chunk gets the entries of its worst start slot (``shared_entries``),
    the trailing ones empty: the table size a request is admitted against. Prompt tokens and
    private chunk tokens form the request's *private stream*, packed densely into its private
    blocks: in-context token ``i`` sits in private block ``i // B``, slot ``i % B``.

    Table entries follow logical order; each is one contiguous slot range of one physical block,
    so a private block appears once per run of the stream that a chunk's canonical tokens
    interrupt, and every chunk contributes one entry per block its canonical tokens touch.

    Only the counts are computed here, per segment; the entries are built on first use
    (``_packed_entries``).
    """
    bs = block_size
    _check_segments(segments, bs, allow_trailing_chunk)
    CHUNK, PROMPT = SegmentKind.CHUNK, SegmentKind.PROMPT
    kinds = [seg.kind for seg in segments]
    num_chunks = kinds.count(CHUNK)
    placed = offsets is not None
    offsets = tuple(offsets) if offsets is not None else (0,) * num_chunks
    if len(private_tokens) != num_chunks or len(offsets) != num_chunks:
        raise LayoutError(
            f"{num_chunks} chunks but {len(private_tokens)} private counts / {len(offsets)} offsets"
        )
    spans: list[SegmentSpan] = []
    chunk_spans: list[SegmentSpan] = []
    stream = 0  # tokens of the private stream placed so far
    entries = 0  # table entries so far
    last_private = False  # is the last entry a private run (that the stream may extend)?
    tail = 0  # valid_end of the last entry
    position = 0
    chunk = 0
    for i, seg in enumerate(segments):
        n = len(seg.token_ids)
        if n == 0:
            raise LayoutError(f"segment {i} ({seg.kind.value}) is empty")
        kind = kinds[i]
        k = n
        if kind is CHUNK:
            k, offset = private_tokens[chunk], offsets[chunk]
            chunk += 1
            if not 0 <= k <= n:
                raise LayoutError(f"chunk segment {i}: {k} private tokens of {n}")
            if not 0 <= offset < bs:
                raise LayoutError(f"chunk segment {i}: start slot {offset} outside a block of {bs}")
        first_entry = entries
        if k:  # k private tokens: a run goes on in the last entry if that one ends at the stream
            touched = (stream + k - 1) // bs - stream // bs + 1
            if last_private and stream % bs:
                first_entry, touched = entries - 1, touched - 1
            entries += touched
            stream += k
            last_private, tail = True, (stream - 1) % bs + 1
        if kind is PROMPT:
            spans.append(SegmentSpan(i, kind, first_entry, entries - first_entry, 0, position, n))
            position += n
            continue
        m = n - k
        # Placed: the entries its canonical tokens touch from ``offset``; else the worst case.
        count = -(-(offset + m) // bs) if placed else (-(-(m + bs - 1) // bs) if m > 0 else 0)
        if count:
            end = min(bs, offset + m - (count - 1) * bs)
            last_private, tail = False, end if end > (offset if count == 1 else 0) else 0
        span = SegmentSpan(
            i, kind, first_entry, entries + count - first_entry, 0, position, n, k, entries, count
        )
        spans.append(span)
        chunk_spans.append(span)
        entries += count
        position += n
    return _new_layout(
        bs, tuple(segments), tuple(spans), tuple(chunk_spans), entries, (entries - 1) * bs + tail,
        True, -(-stream // bs), stream, offsets,
    )  # fmt: skip


def _new_layout(
    block_size: int,
    segments: tuple[Segment, ...],
    spans: tuple[SegmentSpan, ...],
    chunk_spans: tuple[SegmentSpan, ...],
    num_blocks: int,
    num_padded_tokens: int,
    packed: bool,
    num_private_blocks: int,
    num_private_tokens: int,
    offsets: tuple[int, ...],
) -> Layout:
    """``Layout(...)`` without the frozen dataclass's ``__init__`` (one ``object.__setattr__``
    per field, ~7 us, twice per request on the scheduling path): the same fields, set at once.
    ``chunk_spans`` must be the chunk segments' spans, in order."""
    layout = object.__new__(Layout)
    layout.__dict__.update(
        block_size=block_size,
        segments=segments,
        spans=spans,
        num_blocks=num_blocks,
        num_padded_tokens=num_padded_tokens,
        packed=packed,
        num_private_blocks=num_private_blocks,
        num_private_tokens=num_private_tokens,
        offsets=offsets,
        chunk_spans=chunk_spans,
    )
    return layout


def _packed_entries(layout: Layout) -> tuple[BlockSpec, ...]:
    """The packed layout's table entries, from its spans and chunk offsets."""
    bs = layout.block_size
    entries: list[BlockSpec] = []
    stream = 0
    chunk = 0
    for span in layout.spans:
        i, pos = span.segment, span.first_position
        count = span.num_tokens if span.kind is SegmentKind.PROMPT else span.private_tokens
        while count > 0:  # the private run, one entry per private block it touches
            p, slot = divmod(stream, bs)
            take = min(count, bs - slot)
            prev = entries[-1] if entries else None
            if prev is not None and prev.private_block == p and prev.valid_end == slot:
                prev.valid_end = slot + take  # the run goes on in the same block
            else:
                entries.append(
                    BlockSpec(len(entries), BlockKind.PRIVATE, i, slot, slot + take, pos, p)
                )
            stream, pos, count = stream + take, pos + take, count - take
        if span.kind is SegmentKind.PROMPT:
            continue
        offset, m = layout.offsets[chunk], span.num_tokens - span.private_tokens
        chunk += 1
        base = span.first_position + span.private_tokens - offset
        for j in range(span.num_shared):
            start = offset if j == 0 else 0
            end = min(bs, offset + m - j * bs)
            if end <= start:  # the chunk ends before this entry: an empty one
                start = end = 0
            entries.append(
                BlockSpec(
                    len(entries), BlockKind.CHUNK_SHARED, i, start, end, base + j * bs + start,
                    -1, j,
                )
            )  # fmt: skip
    return tuple(entries)


# A dict lookup: calling the enum (``SegmentKind(kind)``) costs several times more, per segment.
_KINDS: dict[object, SegmentKind] = {k.value: k for k in SegmentKind}
# The other way: an enum's ``.value`` is a descriptor, several times a dict lookup.
KIND_VALUES: dict[SegmentKind, str] = {k: k.value for k in SegmentKind}


def parse_segment_lengths(raw: object) -> list[tuple[SegmentKind, int]]:
    """Validate the ``extra_args`` description ``[[kind, num_real_tokens], ...]``.

    The flat form ``[kind, n, kind, n, ...]`` is accepted too: it is what the OpenAI API's
    ``vllm_xargs`` can carry (its values cannot nest).
    """
    if not isinstance(raw, (list, tuple)) or not raw:
        raise LayoutError(f"{EXTRA_ARGS_KEY} must be a non-empty list of [kind, length] pairs")
    if all(not isinstance(x, (list, tuple)) for x in raw):
        if len(raw) % 2:
            raise LayoutError(f"{EXTRA_ARGS_KEY} flat form needs kind, length pairs: {raw!r}")
        raw = [raw[i : i + 2] for i in range(0, len(raw), 2)]
    out: list[tuple[SegmentKind, int]] = []
    for i, item in enumerate(raw):
        if not isinstance(item, (list, tuple)) or len(item) != 2:
            raise LayoutError(f"{EXTRA_ARGS_KEY}[{i}] must be a [kind, length] pair, got {item!r}")
        kind, length = item
        try:
            seg_kind = _KINDS.get(kind)
        except TypeError:  # unhashable
            seg_kind = None
        if seg_kind is None:
            raise LayoutError(
                f"{EXTRA_ARGS_KEY}[{i}] kind must be 'prompt' or 'chunk', got {kind!r}"
            )
        if not isinstance(length, int) or isinstance(length, bool) or length < 0:
            raise LayoutError(f"{EXTRA_ARGS_KEY}[{i}] length must be an int >= 0, got {length!r}")
        out.append((seg_kind, length))
    return out


def layout_from_real(token_ids: Sequence[int], segment_lengths: object, block_size: int) -> Layout:
    """Split a request's real (unpadded) prompt tokens by segment lengths and lay them out."""
    return build_layout(segments_from_real(token_ids, segment_lengths), block_size)


def segments_from_real(token_ids: Sequence[int], segment_lengths: object) -> list[Segment]:
    """Split a request's real (unpadded) prompt tokens by segment lengths."""
    lengths = parse_segment_lengths(segment_lengths)
    total = sum(n for _, n in lengths)
    if total != len(token_ids):
        raise LayoutError(
            f"prompt has {len(token_ids)} tokens but segments {segment_lengths!r} sum to {total}"
        )
    segments: list[Segment] = []
    offset = 0
    for kind, n in lengths:
        segments.append(Segment(kind, tuple(token_ids[offset : offset + n])))
        offset += n
    return segments
