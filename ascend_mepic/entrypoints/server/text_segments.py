"""Prompt text to MEPIC segments: chunk markers, chunk references and the layout checks.

A marked prompt (completion text or chat messages) is split at ``markers.begin``/``markers.end``
and at ``<<<MEPIC_CHUNK_REF:id>>>`` references, each piece tokenized alone, and sent to the engine
as token ids plus the flat ``mepic_segments`` form. The checks here give the client a precise 400
(:class:`MepicRequestError`, :class:`MarkerError`) before anything reaches the engine.
"""

import re
from collections.abc import Callable, Sequence
from http import HTTPStatus
from typing import Any

from ascend_mepic.core.errors import MepicCapacityError
from ascend_mepic.core.markers import MarkerError, Markers, finish_segments, split_marked_text
from ascend_mepic.core.request_limits import RequestLimits
from ascend_mepic.core.segments import (
    EXTRA_ARGS_KEY,
    LayoutError,
    Segment,
    SegmentKind,
)

CHUNK_REF_OPEN = "<<<MEPIC_CHUNK_REF:"
CHUNK_REF_CLOSE = ">>>"
CHUNK_REF_PATTERN = re.compile(re.escape(CHUNK_REF_OPEN) + r"([^<>]*)" + re.escape(CHUNK_REF_CLOSE))


class MepicRequestError(ValueError):
    """A request MEPIC cannot serve as sent; the client gets ``status`` (400 unless said)."""

    def __init__(self, message: str, status: HTTPStatus = HTTPStatus.BAD_REQUEST) -> None:
        super().__init__(message)
        self.status = status


def has_markup(text: str, markers: Markers) -> bool:
    return markers.begin in text or markers.end in text or CHUNK_REF_OPEN in text


def check_refs(text: str, markers: Markers) -> None:
    """References belong in prompt text and must be closed; MarkerError names the offset."""
    matched = {m.start() for m in CHUNK_REF_PATTERN.finditer(text)}
    pos = text.find(CHUNK_REF_OPEN)
    while pos >= 0:
        if pos not in matched:
            raise MarkerError(
                f"chunk reference at offset {pos} is not closed with {CHUNK_REF_CLOSE}"
            )
        if text.count(markers.begin, 0, pos) > text.count(markers.end, 0, pos):
            raise MarkerError(
                f"chunk reference at offset {pos} is inside chunk markers; "
                "put references in prompt text"
            )
        pos = text.find(CHUNK_REF_OPEN, pos + 1)


def marked_text_segments(
    tokenizer: Any,
    text: str,
    markers: Markers,
    resolve: Callable[[str], Sequence[int]],
    add_bos: bool,
) -> list[Segment]:
    """Segments of marked text, each tokenized alone (as ``markers.tokenize_segments`` does),
    with ``<<<MEPIC_CHUNK_REF:id>>>`` replaced by the registered chunk's tokens via ``resolve``.
    """
    check_refs(text, markers)
    pieces: list[tuple[str, str]] = []
    for piece in split_marked_text(text, markers):
        if piece.kind is SegmentKind.CHUNK:
            pieces.append(("chunk", piece.text))
            continue
        for i, part in enumerate(CHUNK_REF_PATTERN.split(piece.text)):  # text, id, text, ...
            if i % 2 or part:
                pieces.append(("ref" if i % 2 else "prompt", part))
    return pieces_segments(tokenizer, pieces, resolve, add_bos)


def pieces_segments(
    tokenizer: Any,
    pieces: Sequence[tuple[str, str]],
    resolve: Callable[[str], Sequence[int]],
    add_bos: bool,
    keep_boundaries: bool = True,
) -> list[Segment]:
    """Segments of (kind, text) pieces: ``prompt`` and ``chunk`` text tokenized each alone,
    ``ref`` (text: a chunk id) the registered chunk's tokens via ``resolve``.

    Without ``keep_boundaries`` (policies that ignore segments) the text between references is
    tokenized as one, as vLLM tokenizes a prompt, so such a policy sees stock vLLM's tokens.
    """
    if not keep_boundaries:
        merged: list[tuple[str, str]] = []
        for kind, text in pieces:
            if kind != "ref" and merged and merged[-1][0] == "prompt":
                merged[-1] = ("prompt", merged[-1][1] + text)
            else:
                merged.append(("prompt" if kind != "ref" else "ref", text))
        pieces = merged
    segments: list[Segment] = []
    for kind, item in pieces:
        if kind == "ref":
            segments.append(Segment.chunk(tuple(resolve(item))))
            continue
        ids = tokenizer.encode(item, add_special_tokens=False)
        if not ids and kind == "chunk":
            raise MarkerError(f"chunk {item!r} tokenizes to nothing")
        segments.append(Segment(SegmentKind(kind), tuple(ids)))
    return finish_segments(tokenizer, segments, add_bos)


def flat_segments(segments: Sequence[Segment]) -> tuple[list[int], list[str | int]]:
    """Prompt token ids and the flat ``mepic_segments`` form that ``vllm_xargs`` can carry."""
    tokens = [t for s in segments for t in s.token_ids]
    flat: list[str | int] = []
    for s in segments:
        flat += [s.kind.value, len(s.token_ids)]
    return tokens, flat


def check_fits(token_ids: Sequence[int], lengths: object, limits: RequestLimits) -> None:
    """Reject a prompt whose segments are malformed or that the engine could never serve.

    The same check (``RequestLimits.check_prompt``) runs in vLLM's front end and in the engine's
    intake; here it gives the client a precise 400 before the request reaches the engine.
    """
    try:
        limits.check_prompt(token_ids, lengths)
    except LayoutError as e:
        raise MepicRequestError(f"invalid {EXTRA_ARGS_KEY}: {e}") from None
    except MepicCapacityError as e:
        raise MepicRequestError(str(e)) from None


def tokenizer_adds_bos(tokenizer: Any) -> bool:
    """Whether ``encode(..., add_special_tokens=True)`` starts with BOS (as vLLM's text path)."""
    bos = getattr(tokenizer, "bos_token_id", None)
    if bos is None:
        return False
    with_special = tokenizer.encode("a", add_special_tokens=True)
    plain = tokenizer.encode("a", add_special_tokens=False)
    return bool(with_special) and with_special[0] == bos and plain[:1] != [bos]


def raw_message_text(content: Any) -> str:
    if isinstance(content, str):
        return content
    if isinstance(content, list):
        return "".join(
            p if isinstance(p, str) else str(p.get("text") or "")
            for p in content
            if isinstance(p, str | dict)
        )
    return ""
