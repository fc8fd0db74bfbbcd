"""Chunks as request fields: chat content parts, completion prompt pieces and vLLM's documents.

A structured request names its chunks beside the text, never inside it: a text part with
``"mepic": {"chunk": true}`` is one chunk, a text part with ``"mepic": {"chunk_id": ID}`` stands
for a chunk registered through ``POST /v1/chunks``, and ``"mepic": {"chunk_documents": true}`` on
a chat request makes each of vLLM's ``documents`` one chunk. Any text, the older marker strings
included, is served verbatim.

A chat request is still rendered whole by vLLM's renderer (its chat template, content format and
document handling), so the boundaries cross the template as *sentinels*: private-use characters
around a random nonce that no text of the request contains (:class:`Boundaries`). They are found
and removed in the rendered text before anything is tokenized, and a template that drops,
repeats or alters one is a clear 400, never a silently different prompt. The older marker form
(``<<<MEPIC_CHUNK>>>``) is turned into the same sentinels per message, so both forms share one
path and a marker string the template itself writes is plain text.
"""

from __future__ import annotations

import re
import secrets
from collections.abc import Sequence
from typing import Any, NamedTuple

from pydantic import BaseModel, ConfigDict, ValidationError

from ascend_mepic.core.markers import MarkerError, Markers, split_marked_text
from ascend_mepic.core.segments import SegmentKind
from ascend_mepic.entrypoints.server.text_segments import (
    CHUNK_REF_PATTERN,
    MepicRequestError,
    check_refs,
)

MEPIC_FIELD = "mepic"
SENTINEL_OPEN, SENTINEL_CLOSE = "\ue000", "\ue001"  # Unicode private-use characters
_BEGIN, _END, _REF = 0, 1, 2


class PartFlags(BaseModel):
    """``mepic`` on a text part (chat content part or completion prompt piece)."""

    model_config = ConfigDict(extra="forbid", strict=True)
    chunk: bool = False
    chunk_id: str | None = None


class RequestFlags(BaseModel):
    """``mepic`` on a request: marks it structured (marker strings are then plain text)."""

    model_config = ConfigDict(extra="forbid", strict=True)
    chunk_documents: bool = False


class Piece(NamedTuple):
    """A run of prompt text, a chunk's text, or a registered chunk (``text`` is its id)."""

    kind: str  # "prompt" | "chunk" | "ref"
    text: str


def _validation_message(e: ValidationError) -> str:
    return "; ".join(
        f"{'.'.join(str(x) for x in err['loc']) or 'value'}: {err['msg']}" for err in e.errors()
    )


def part_flags(part: dict[str, Any], label: str) -> PartFlags | None:
    """The part's MEPIC flags (None for a plain part); a chunk part must carry text, a reference
    none."""
    if MEPIC_FIELD not in part:
        return None
    try:
        flags = PartFlags.model_validate(part[MEPIC_FIELD])
    except ValidationError as e:
        raise MepicRequestError(
            f"{label}.mepic: {_validation_message(e)} (known: chunk, chunk_id)"
        ) from None
    text = part.get("text")
    if flags.chunk and flags.chunk_id is not None:
        raise MepicRequestError(f"{label}.mepic: give either chunk or chunk_id, not both")
    if flags.chunk and (not isinstance(text, str) or not text):
        raise MepicRequestError(f"{label}: a chunk part needs non-empty text")
    if flags.chunk_id is not None and text not in (None, ""):
        raise MepicRequestError(
            f"{label}: a chunk_id part stands for the registered chunk; its text must be empty"
        )
    return flags if (flags.chunk or flags.chunk_id is not None) else None


def request_flags(extra: dict[str, Any] | None) -> RequestFlags | None:
    """The request's top-level ``mepic`` object, validated; None when absent."""
    if not extra or MEPIC_FIELD not in extra:
        return None
    try:
        return RequestFlags.model_validate(extra[MEPIC_FIELD] or {})
    except ValidationError as e:
        raise MepicRequestError(
            f"mepic: {_validation_message(e)} (known: chunk_documents)"
        ) from None


def is_structured_chat(messages: Sequence[Any], extra: dict[str, Any] | None) -> bool:
    """Whether a chat request uses the structured form (a ``mepic`` field anywhere)."""
    if extra and MEPIC_FIELD in extra:
        return True
    for message in messages:
        content = message.get("content") if isinstance(message, dict) else None
        if isinstance(content, list) and any(
            isinstance(p, dict) and MEPIC_FIELD in p for p in content
        ):
            return True
    return False


class Boundaries:
    """Chunk boundaries as sentinels that survive a chat template, for one request.

    Each sentinel is ``U+E000 nonce:kind:index U+E001``: digits and private-use characters,
    which case filters, ``trim`` and JSON escaping leave alone. The nonce is drawn until no text
    of the request (``avoid``) contains it, so every sentinel in the rendered prompt is ours.
    """

    def __init__(self, avoid: str) -> None:
        nonce = ""
        while not nonce or nonce in avoid:
            nonce = f"{secrets.randbelow(10**18):018d}"
        self._lead = SENTINEL_OPEN + nonce
        self._pattern = re.compile(re.escape(self._lead) + r":(\d):(\d+)" + SENTINEL_CLOSE)
        self.labels: list[str] = []  # what boundary index i stands for, to name it in errors
        self.refs: dict[int, str] = {}  # index -> registered chunk id
        self.groups: dict[int, int] = {}  # index -> document (one chunk over several values)
        self.num_documents = 0

    def _mark(self, kind: int, index: int) -> str:
        return f"{self._lead}:{kind}:{index}{SENTINEL_CLOSE}"

    def _new(self, label: str) -> int:
        self.labels.append(label)
        return len(self.labels) - 1

    def chunk(self, text: str, label: str, document: int | None = None) -> str:
        """``text`` wrapped as one chunk (with ``document``: one value of that document's)."""
        i = self._new(label)
        if document is not None:
            self.groups[i] = document
        return self._mark(_BEGIN, i) + text + self._mark(_END, i)

    def ref(self, chunk_id: str, label: str) -> str:
        i = self._new(label)
        self.refs[i] = chunk_id
        return self._mark(_REF, i)

    def documents(self, documents: Sequence[dict[str, Any]]) -> list[dict[str, Any]]:
        """Each document's string values wrapped: the document's chunk runs from its first
        rendered value to its last (the template's text between them included)."""
        out = []
        for d, doc in enumerate(documents):
            label = f"documents[{d}]"
            out.append(
                {
                    k: self.chunk(v, label, document=d) if isinstance(v, str) and v else v
                    for k, v in doc.items()
                }
            )
        self.num_documents = max(self.num_documents, len(documents))
        return out

    def split(self, text: str) -> list[Piece]:
        """The rendered prompt as pieces, every sentinel checked and removed."""
        found = list(self._pattern.finditer(text))
        if text.count(self._lead) != len(found):
            raise MepicRequestError("the chat template altered a chunk boundary")
        counts: dict[tuple[int, int], int] = {}
        for m in found:
            key = (int(m.group(1)), int(m.group(2)))
            counts[key] = counts.get(key, 0) + 1
        self._check_counts(counts)
        # A document's values form one chunk: its first begin opens it, its last end closes it,
        # the sentinels between are dropped.
        first: dict[int, int] = {}
        last: dict[int, int] = {}
        for n, m in enumerate(found):
            group = self.groups.get(int(m.group(2)))
            if group is not None:
                first.setdefault(group, n)
                last[group] = n
        pieces: list[Piece] = []
        buf: list[str] = []
        pos, open_label, open_key = 0, None, None

        def flush(kind: str) -> None:
            piece = "".join(buf)
            buf.clear()
            if kind == "chunk" or piece:
                pieces.append(Piece(kind, piece))

        for n, m in enumerate(found):
            kind, index = int(m.group(1)), int(m.group(2))
            label = self.labels[index]
            buf.append(text[pos : m.start()])
            pos = m.end()
            group = self.groups.get(index)
            if group is not None and n not in (first[group], last[group]):
                continue
            key = ("document", group) if group is not None else ("part", index)
            if kind == _REF:
                if open_label is not None:
                    raise MepicRequestError(f"{label} is rendered inside {open_label}")
                flush("prompt")
                pieces.append(Piece("ref", self.refs[index]))
            elif kind == _BEGIN:
                if open_label is not None:
                    raise MepicRequestError(f"{label} is rendered inside {open_label}")
                flush("prompt")
                open_label, open_key = label, key
            else:
                if open_key != key:
                    raise MepicRequestError(f"the chat template reorders {label}")
                if not "".join(buf):
                    raise MepicRequestError(f"{label} renders as an empty chunk")
                flush("chunk")
                open_label = open_key = None
        buf.append(text[pos:])
        if open_label is not None:
            raise MepicRequestError(f"the chat template cuts {open_label} short")
        flush("prompt")
        return pieces

    def _check_counts(self, counts: dict[tuple[int, int], int]) -> None:
        rendered_documents = {self.groups[i] for (_, i) in counts if i in self.groups}
        if self.num_documents and not rendered_documents:
            raise MepicRequestError(
                "mepic.chunk_documents: the chat template does not render documents (use a "
                "template that does, or send each document as a chunk content part)"
            )
        for i, label in enumerate(self.labels):
            kinds = (_REF,) if i in self.refs else (_BEGIN, _END)
            for kind in kinds:
                n = counts.get((kind, i), 0)
                if n > 1:
                    raise MepicRequestError(f"the chat template renders {label} {n} times")
                if n == 0 and i not in self.groups:
                    raise MepicRequestError(f"the chat template drops {label}")
        missing = sorted(set(range(self.num_documents)) - rendered_documents)
        if missing:
            raise MepicRequestError(f"the chat template drops documents[{missing[0]}]")


def _only_text(part: Any, label: str) -> dict[str, Any]:
    """A text part as a dict (vLLM also takes a bare string as one)."""
    if isinstance(part, str):
        return {"type": "text", "text": part}
    if not isinstance(part, dict) or part.get("type") != "text":
        kind = part.get("type") if isinstance(part, dict) else type(part).__name__
        raise MepicRequestError(f"{label}: only text content can be used with chunks, got {kind}")
    return part


def _message_checks(message: Any, index: int) -> dict[str, Any]:
    msg = dict(message)
    if msg.get("tool_calls") or msg.get("role") == "tool":
        raise MepicRequestError(f"messages[{index}]: tool messages are not supported with chunks")
    return msg


def wrap_chunk_parts(messages: Sequence[Any], boundaries: Boundaries) -> list[dict[str, Any]]:
    """Structured chat: each chunk part's text wrapped in sentinels, each reference part
    replaced by one; every other part exactly as sent."""
    out = []
    for m, message in enumerate(messages):
        msg = _message_checks(message, m)
        content = msg.get("content")
        if isinstance(content, list):
            parts = []
            for p, part in enumerate(content):
                label = f"messages[{m}].content[{p}]"
                part = _only_text(part, label)
                flags = part_flags(part, label)
                if flags is None:
                    parts.append({k: v for k, v in part.items() if k != MEPIC_FIELD})
                elif flags.chunk:
                    parts.append({"type": "text", "text": boundaries.chunk(part["text"], label)})
                else:
                    assert flags.chunk_id is not None
                    parts.append({"type": "text", "text": boundaries.ref(flags.chunk_id, label)})
            msg["content"] = parts
        out.append(msg)
    return out


def _marked_to_sentinels(text: str, markers: Markers, b: Boundaries, label: str) -> str:
    try:
        pieces = split_marked_text(text, markers)
        check_refs(text, markers)
    except MarkerError as e:
        raise MarkerError(f"{label}: {e}") from None
    out = []
    for piece in pieces:
        if piece.kind is SegmentKind.CHUNK:
            out.append(b.chunk(piece.text, label))
            continue
        for i, part in enumerate(CHUNK_REF_PATTERN.split(piece.text)):  # text, id, text, ...
            out.append(b.ref(part, label) if i % 2 else part)
    return "".join(out)


def wrap_marked_messages(
    messages: Sequence[Any], markers: Markers, boundaries: Boundaries
) -> list[dict[str, Any]]:
    """The older form: markers and references in each text (a chunk cannot span content parts
    or messages) turned into sentinels, so the template never sees a marker string."""
    out = []
    for m, message in enumerate(messages):
        msg = _message_checks(message, m)
        content = msg.get("content")
        if isinstance(content, str):
            msg["content"] = _marked_to_sentinels(
                content, markers, boundaries, f"messages[{m}].content"
            )
        elif isinstance(content, list):
            parts = []
            for p, part in enumerate(content):
                label = f"messages[{m}].content[{p}]"
                part = dict(_only_text(part, label))
                part["text"] = _marked_to_sentinels(
                    part.get("text") or "", markers, boundaries, label
                )
                parts.append(part)
            msg["content"] = parts
        out.append(msg)
    return out


def is_piece_prompt(prompt: Any) -> bool:
    """A completion prompt given as pieces: a list with at least one object in it."""
    return isinstance(prompt, list) and any(isinstance(p, dict) for p in prompt)


def completion_pieces(prompt: Sequence[Any]) -> list[Piece]:
    """A completion prompt of pieces (strings, or ``{"text", "mepic"}`` objects, ``type``
    ``"text"`` optional), concatenated verbatim: adjacent prompt pieces become one text."""
    pieces: list[Piece] = []
    for i, item in enumerate(prompt):
        label = f"prompt[{i}]"
        if isinstance(item, str):
            flags, text = None, item
        elif isinstance(item, dict):
            unknown = set(item) - {"type", "text", MEPIC_FIELD}
            if unknown or item.get("type", "text") != "text":
                raise MepicRequestError(
                    f"{label}: a prompt piece has text, mepic and optionally type 'text'; got "
                    f"{sorted(item)}"
                )
            flags, text = part_flags(item, label), item.get("text")
            if flags is None and not isinstance(text, str):
                raise MepicRequestError(f"{label}: a prompt piece needs text")
        else:
            raise MepicRequestError(f"{label}: a prompt piece is a string or an object")
        if flags is not None and flags.chunk_id is not None:
            pieces.append(Piece("ref", flags.chunk_id))
        elif flags is not None:
            pieces.append(Piece("chunk", str(text)))
        elif pieces and pieces[-1].kind == "prompt":
            pieces[-1] = Piece("prompt", pieces[-1].text + str(text))
        elif text:
            pieces.append(Piece("prompt", str(text)))
    return pieces
