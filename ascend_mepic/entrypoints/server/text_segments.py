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
from ascend_mepic.vllm_integration.openai_api import ChatCompletionRequest

CHUNK_REF_OPEN = "<<<MEPIC_CHUNK_REF:"
CHUNK_REF_CLOSE = ">>>"
_CHUNK_REF = re.compile(re.escape(CHUNK_REF_OPEN) + r"([^<>]*)" + re.escape(CHUNK_REF_CLOSE))


class MepicRequestError(ValueError):
    """A request MEPIC cannot serve as sent; the client gets ``status`` (400 unless said)."""

    def __init__(self, message: str, status: HTTPStatus = HTTPStatus.BAD_REQUEST) -> None:
        super().__init__(message)
        self.status = status


def has_markup(text: str, markers: Markers) -> bool:
    return markers.begin in text or markers.end in text or CHUNK_REF_OPEN in text


def check_refs(text: str, markers: Markers) -> None:
    """References belong in prompt text and must be closed; MarkerError names the offset."""
    matched = {m.start() for m in _CHUNK_REF.finditer(text)}
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
    pieces = split_marked_text(text, markers)
    check_refs(text, markers)
    items: list[tuple[SegmentKind, str | Sequence[int]]] = []
    for piece in pieces:
        if piece.kind is SegmentKind.CHUNK:
            items.append((piece.kind, piece.text))
            continue
        parts = _CHUNK_REF.split(piece.text)  # text, id, text, id, ..., text
        for i, part in enumerate(parts):
            if i % 2:
                items.append((SegmentKind.CHUNK, resolve(part)))
            elif part:
                items.append((SegmentKind.PROMPT, part))
    segments: list[Segment] = []
    for kind, item in items:
        if isinstance(item, str):
            ids = tokenizer.encode(item, add_special_tokens=False)
            if not ids and kind is SegmentKind.CHUNK:
                raise MarkerError(f"chunk {item!r} tokenizes to nothing")
        else:
            ids = list(item)
        segments.append(Segment(kind, tuple(ids)))
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


def _message_text(content: Any, index: int) -> str | None:
    if content is None or isinstance(content, str):
        return content
    texts = []
    for part in content:
        if not isinstance(part, dict) or part.get("type") != "text":
            kind = part.get("type") if isinstance(part, dict) else type(part).__name__
            raise MepicRequestError(
                f"messages[{index}]: only text content can be used with chunk markers, got {kind}"
            )
        texts.append(part.get("text", ""))
    return "".join(texts)


def chat_messages(request: ChatCompletionRequest) -> list[dict[str, Any]]:
    """Messages as plain role/content dicts (text parts joined) for ``apply_chat_template``."""
    out = []
    for i, message in enumerate(request.messages):
        msg = dict(message)
        if msg.get("tool_calls") or msg.get("role") == "tool":
            raise MepicRequestError(f"messages[{i}]: tool messages are not supported with markers")
        clean = {"role": msg.get("role"), "content": _message_text(msg.get("content"), i)}
        if msg.get("name"):
            clean["name"] = msg["name"]
        out.append(clean)
    return out


def raw_message_text(content: Any) -> str:
    if isinstance(content, str):
        return content
    if isinstance(content, list):
        return "".join(p.get("text", "") for p in content if isinstance(p, dict))
    return ""
