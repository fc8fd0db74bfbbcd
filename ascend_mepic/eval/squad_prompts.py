"""SQuAD v2 questions as chat-template requests split into PIC segments.

A request is the model's chat template applied to a system message and one user turn holding an
instruction, K paragraphs and the question, then the assistant header. It is cut into segments:

* PROMPT: everything before the first paragraph (template opening, system message, user turn
  opening with the instruction; BOS exactly as the template writes it);
* CHUNK per paragraph, ``"\\n\\n" + paragraph.strip()``;
* PROMPT: ``"\\n\\nQuestion: ..."``, end of the user turn, assistant header.

The paragraph separator leads each chunk rather than trailing it. Pieces are tokenized alone,
and byte-level BPE tokenizers such as SmolLM2's encode a trailing ``"\\n\\n"`` as one token that
whole-text tokenization never produces before a word (it gives ``"\\n"``, ``"\\n"``); with the
separator in front, every piece boundary falls where whole-text tokenization also splits, so the
segments' concatenation equals the template's token ids (:func:`template_ids` gives those, for
checking). Paragraphs are stripped: a few SQuAD paragraphs end in spaces, which would merge with
the next separator in whole-text tokenization. Every occurrence of a paragraph has identical
tokens, so chunk reuse is unaffected.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from ascend_mepic.core.segments import Segment, SegmentKind
from ascend_mepic.eval.trace import SquadQuestion, squad_requests

SYSTEM_MESSAGE = "You are a helpful assistant that answers questions about documents."
INSTRUCTION = (
    "Answer the question with a short phrase copied from the documents. "
    "Do not explain.\n\nDocuments:"
)
SEPARATOR = "\n\n"
_SENTINEL = "\x00PIC{}\x00"


def _messages(
    question: str, paragraphs: Sequence[str], system: str, history: Sequence[tuple[str, str]]
) -> list[dict[str, str]]:
    body = "".join(SEPARATOR + p.strip() for p in paragraphs)
    user = f"{INSTRUCTION}{body}{SEPARATOR}Question: {question}"
    earlier = [
        {"role": role, "content": text}
        for q, a in history
        for role, text in (("user", q), ("assistant", a))
    ]
    return [{"role": "system", "content": system}, *earlier, {"role": "user", "content": user}]


def _render(tokenizer: Any, messages: list[dict[str, str]]) -> str:
    return tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)


def chat_pieces(
    tokenizer: Any,
    question: str,
    paragraphs: Sequence[str],
    system: str = SYSTEM_MESSAGE,
    history: Sequence[tuple[str, str]] = (),
) -> list[tuple[SegmentKind, str]]:
    """The rendered chat prompt as (kind, text) pieces whose concatenation is the rendering.

    The template is rendered once with sentinels in place of the paragraphs to find where the
    prompt text around them starts and ends, whatever the template adds. ``system`` and the
    earlier (user, assistant) turns of ``history`` end up in the leading PROMPT piece.
    """
    marks = [_SENTINEL.format(i) for i in range(len(paragraphs))]
    shaped = _render(tokenizer, _messages(question, marks, system, history))
    cut = shaped.split(SEPARATOR + marks[0], 1)
    if len(cut) != 2:
        raise ValueError("the chat template altered the user message; cannot locate documents")
    prefix, rest = cut
    for m in marks[1:]:
        between, rest = rest.split(SEPARATOR + m, 1)
        if between:
            raise ValueError("the chat template inserted text between documents")
    pieces = [(SegmentKind.PROMPT, prefix)]
    pieces += [(SegmentKind.CHUNK, SEPARATOR + p.strip()) for p in paragraphs]
    pieces.append((SegmentKind.PROMPT, rest))
    whole = _render(tokenizer, _messages(question, paragraphs, system, history))
    if "".join(t for _, t in pieces) != whole:
        raise ValueError("the chat template rendered the documents differently from sentinels")
    return pieces


def chat_segments(
    tokenizer: Any,
    question: str,
    paragraphs: Sequence[str],
    system: str = SYSTEM_MESSAGE,
    history: Sequence[tuple[str, str]] = (),
) -> list[Segment]:
    """Segments of one request, each piece tokenized alone without special-token insertion."""
    return [
        Segment(kind, tuple(tokenizer.encode(text, add_special_tokens=False)))
        for kind, text in chat_pieces(tokenizer, question, paragraphs, system, history)
    ]


def template_ids(
    tokenizer: Any,
    question: str,
    paragraphs: Sequence[str],
    system: str = SYSTEM_MESSAGE,
    history: Sequence[tuple[str, str]] = (),
) -> list[int]:
    """The token ids of the template applied to the whole text (what a plain chat request sends)."""
    text = _render(tokenizer, _messages(question, paragraphs, system, history))
    return list(tokenizer.encode(text, add_special_tokens=False))


def squad_chat_requests(
    tokenizer: Any, num_questions: int, num_paragraphs: int = 4, seed: int = 0
) -> list[tuple[SquadQuestion, list[Segment]]]:
    """Answerable SQuAD v2 questions, each with its gold paragraph and same-article distractors
    (shuffled, :func:`ascend_mepic.eval.trace.squad_requests`), as chat-template segments."""
    return [
        (q, chat_segments(tokenizer, q.question, paragraphs))
        for q, paragraphs in squad_requests(num_questions, num_paragraphs, seed)
    ]
