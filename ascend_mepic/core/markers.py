"""Text segmentation with chunk markers, and per-segment tokenization.

A chunk is written in the prompt text as ``<<<MEPIC_CHUNK>>>text<<<END_MEPIC_CHUNK>>>``. The default
markers use characters that neither prose, code nor the common chat templates produce. Each
segment is tokenized on its own, so a chunk's tokens never depend on its neighbours; BOS (when the
tokenizer uses one) appears only at the very start of the request.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Protocol

from ascend_mepic.core.segments import Segment, SegmentKind

DEFAULT_BEGIN = "<<<MEPIC_CHUNK>>>"
DEFAULT_END = "<<<END_MEPIC_CHUNK>>>"


class MarkerError(ValueError):
    """Unbalanced, nested or empty chunk markers; the message names the character offset."""


@dataclass(frozen=True)
class Markers:
    begin: str = DEFAULT_BEGIN
    end: str = DEFAULT_END

    def __post_init__(self) -> None:
        if not self.begin or not self.end:
            raise ValueError("chunk markers must be non-empty strings")
        if self.begin in self.end or self.end in self.begin:
            raise ValueError("one chunk marker must not contain the other")


@dataclass(frozen=True)
class TextSegment:
    kind: SegmentKind
    text: str


def split_marked_text(text: str, markers: Markers = Markers()) -> list[TextSegment]:
    """Split text into prompt and chunk pieces. Empty prompt pieces between markers are dropped."""
    out: list[TextSegment] = []
    pos = 0
    while True:
        b = text.find(markers.begin, pos)
        e = text.find(markers.end, pos)
        if b < 0:
            if e >= 0:
                raise MarkerError(f"end marker at offset {e} has no matching begin marker")
            if text[pos:] or not out:
                out.append(TextSegment(SegmentKind.PROMPT, text[pos:]))
            return out
        if 0 <= e < b:
            raise MarkerError(f"end marker at offset {e} has no matching begin marker")
        if text[pos:b]:
            out.append(TextSegment(SegmentKind.PROMPT, text[pos:b]))
        start = b + len(markers.begin)
        e = text.find(markers.end, start)
        if e < 0:
            raise MarkerError(f"begin marker at offset {b} is never closed")
        nested = text.find(markers.begin, start, e)
        if nested >= 0:
            raise MarkerError(f"nested begin marker at offset {nested} (chunks cannot nest)")
        if e == start:
            raise MarkerError(f"empty chunk at offset {b}")
        out.append(TextSegment(SegmentKind.CHUNK, text[start:e]))
        pos = e + len(markers.end)


class Tokenizer(Protocol):
    bos_token_id: int | None

    def encode(self, text: str, add_special_tokens: bool = ...) -> list[int]: ...


def tokenize_segments(
    tokenizer: Tokenizer, pieces: Sequence[TextSegment], add_bos: bool = True
) -> list[Segment]:
    """Tokenize each piece alone. BOS goes in a prompt segment at the start, never in a chunk."""
    segments: list[Segment] = []
    for piece in pieces:
        ids = tokenizer.encode(piece.text, add_special_tokens=False)
        if not ids and piece.kind is SegmentKind.CHUNK:
            raise MarkerError(f"chunk {piece.text!r} tokenizes to nothing")
        segments.append(Segment(piece.kind, tuple(ids)))
    return finish_segments(tokenizer, segments, add_bos)


def finish_segments(
    tokenizer: Tokenizer, segments: list[Segment], add_bos: bool = True
) -> list[Segment]:
    """Put BOS (if the tokenizer has one) in a leading prompt segment, drop empty segments and
    check that the request ends with prompt tokens."""
    bos = getattr(tokenizer, "bos_token_id", None)
    if add_bos and bos is not None:
        if segments and segments[0].kind is SegmentKind.PROMPT:
            segments[0] = Segment.prompt((bos, *segments[0].token_ids))
        else:
            segments.insert(0, Segment.prompt((bos,)))
    segments = [s for s in segments if s.token_ids]
    if not segments or segments[-1].kind is not SegmentKind.PROMPT:
        raise MarkerError("the text must end with prompt text after the last chunk")
    return segments


def segments_from_text(
    tokenizer: Tokenizer, text: str, markers: Markers = Markers(), add_bos: bool = True
) -> list[Segment]:
    return tokenize_segments(tokenizer, split_marked_text(text, markers), add_bos)
