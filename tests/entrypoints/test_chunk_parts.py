"""Chunks as request fields without a server: sentinels through chat templates, prompt pieces.

The templates here are rendered by transformers' Jinja (what vLLM's renderer calls), so every
way a template can drop, repeat, reorder or alter a boundary is refused with a 400 that names
the part, and the prompt a policy that ignores segments gets is the whole text tokenized once.
"""

import re

import pytest
from transformers import AutoTokenizer

from ascend_mepic.core.markers import Markers
from ascend_mepic.core.segments import SegmentKind
from ascend_mepic.entrypoints.server.chunk_parts import (
    Boundaries,
    Piece,
    completion_pieces,
    is_structured_chat,
    wrap_chunk_parts,
    wrap_marked_messages,
)
from ascend_mepic.entrypoints.server.text_segments import MepicRequestError, pieces_segments
from ascend_mepic.eval.prepare import prepare_tiny_llama

PLAIN = "{% for m in messages %}<{{ m['role'] }}>{{ m['content'] }}{% endfor %}<assistant>"


@pytest.fixture(scope="module")
def tok():
    return AutoTokenizer.from_pretrained(str(prepare_tiny_llama()))


def render(tok, template: str, messages, documents=None) -> str:
    """As vLLM renders for a "string" content-format template: text parts joined with "\n"."""
    joined = [
        {**m, "content": m["content"]}
        if isinstance(m["content"], str)
        else {
            **m,
            "content": "\n".join(p if isinstance(p, str) else p["text"] for p in m["content"]),
        }
        for m in messages
    ]
    return tok.apply_chat_template(
        joined, chat_template=template, documents=documents, tokenize=False
    )


def chunk_part(text: str) -> dict:
    return {"type": "text", "text": text, "mepic": {"chunk": True}}


def test_parts_refs_and_documents_come_back_as_pieces(tok):
    messages = [
        {
            "role": "user",
            "content": [
                {"type": "text", "text": "Docs <<<MEPIC_CHUNK>>>:"},
                chunk_part("Paris is in France."),
                {"type": "text", "text": "", "mepic": {"chunk_id": "abc"}},
                "Q?",
            ],
        }
    ]
    assert is_structured_chat(messages, {}) and not is_structured_chat([{"content": "x"}], {})
    b = Boundaries("")
    docs = b.documents([{"title": "T", "text": "Doc one."}, {"title": "U", "text": "Two."}])
    template = (
        "{% for d in documents %}[{{ loop.index }}] {{ d['title'] | upper }}: {{ d['text'] }}\n"
        "{% endfor %}" + PLAIN
    )
    pieces = b.split(render(tok, template, wrap_chunk_parts(messages, b), docs))
    assert pieces == [
        Piece("prompt", "[1] "),
        Piece("chunk", "T: Doc one."),  # the document's first value to its last, case intact
        Piece("prompt", "\n[2] "),
        Piece("chunk", "U: Two."),
        Piece("prompt", "\n<user>Docs <<<MEPIC_CHUNK>>>:\n"),  # a marker string is plain text
        Piece("chunk", "Paris is in France."),
        Piece("prompt", "\n"),
        Piece("ref", "abc"),
        Piece("prompt", "\nQ?<assistant>"),
    ]


@pytest.mark.parametrize(
    "template, needle",
    [
        ("{% for m in messages %}{{ m['content'][:-3] }}{% endfor %}", "altered a chunk boundary"),
        ("{% for m in messages %}{{ m['content'] * 2 }}{% endfor %}", "renders messages[0]"),
        ("x", "drops messages[0].content"),
        ("{{ messages[0]['content'] | reverse | join('') }}", "drops messages[0]"),
    ],
)
def test_a_template_that_mangles_a_boundary_is_refused(tok, template, needle):
    b = Boundaries("")
    messages = [{"role": "user", "content": b.chunk("doc", "messages[0].content") + " q"}]
    with pytest.raises(MepicRequestError, match=re.escape(needle)):
        b.split(render(tok, template, messages))


def test_documents_a_template_does_not_render_are_refused(tok):
    b = Boundaries("")
    docs = b.documents([{"text": "a"}])
    with pytest.raises(MepicRequestError, match="does not render documents"):
        b.split(render(tok, PLAIN, [{"role": "user", "content": "q"}], docs))
    b = Boundaries("")
    docs = b.documents([{"text": "a"}, {"text": "b"}])
    template = "{{ documents[0]['text'] }}" + PLAIN
    with pytest.raises(MepicRequestError, match=r"drops documents\[1\]"):
        b.split(render(tok, template, [{"role": "user", "content": "q"}], docs))


def test_the_nonce_avoids_every_text_of_the_request():
    b = Boundaries("")
    nonce = b._lead[1:]
    again = Boundaries(f"some text {nonce} more")
    assert again._lead[1:] != nonce


def test_marker_form_becomes_the_same_pieces(tok):
    b = Boundaries("")
    messages = [
        {"role": "user", "content": "Docs: <<<MEPIC_CHUNK>>>Paris.<<<END_MEPIC_CHUNK>>> Q?"}
    ]
    pieces = b.split(render(tok, PLAIN, wrap_marked_messages(messages, Markers(), b)))
    assert pieces == [
        Piece("prompt", "<user>Docs: "),
        Piece("chunk", "Paris."),
        Piece("prompt", " Q?<assistant>"),
    ]
    bad = [{"role": "user", "content": [{"type": "text", "text": "<<<MEPIC_CHUNK>>>x"}]}]
    with pytest.raises(ValueError, match=r"messages\[0\]\.content\[0\]: begin marker"):
        wrap_marked_messages(bad, Markers(), Boundaries(""))


def test_completion_pieces_concatenate_verbatim():
    pieces = completion_pieces(
        ["A ", {"text": "B"}, {"type": "text", "text": "doc", "mepic": {"chunk": True}}, " Q"]
    )
    assert pieces == [Piece("prompt", "A B"), Piece("chunk", "doc"), Piece("prompt", " Q")]
    ref = completion_pieces([{"mepic": {"chunk_id": "abc"}}, "Q"])
    assert ref == [Piece("ref", "abc"), Piece("prompt", "Q")]
    for bad, needle in (
        ([{"text": "x", "extra": 1}], "prompt[0]"),
        ([{"text": "x", "mepic": {"chunk": True, "chunk_id": "a"}}], "not both"),
        ([{"text": "x", "mepic": {"chunk_id": "a"}}], "text must be empty"),
        ([3, {"text": "x"}], "string or an object"),
    ):
        with pytest.raises(MepicRequestError, match=re.escape(needle)):
            completion_pieces(bad)


def test_policies_that_ignore_segments_see_the_text_tokenized_once(tok):
    """``full`` and ``prefix`` get stock vLLM's tokens: the pieces' text tokenized as one
    (references stay the registered tokens)."""
    pieces = [Piece("prompt", "Read:\n"), Piece("chunk", "the river"), Piece("prompt", "\nQ?")]

    def resolve(chunk_id: str) -> list[int]:
        return [7, 8, 9]

    whole = pieces_segments(tok, pieces, resolve, add_bos=False, keep_boundaries=False)
    assert [s.kind for s in whole] == [SegmentKind.PROMPT]
    assert list(whole[0].token_ids) == tok.encode("Read:\nthe river\nQ?", add_special_tokens=False)
    kept = pieces_segments(tok, pieces, resolve, add_bos=True)
    assert [s.kind.value for s in kept] == ["prompt", "chunk", "prompt"]
    assert kept[0].token_ids[0] == tok.bos_token_id
    with_ref = pieces_segments(
        tok, [*pieces[:2], Piece("ref", "x"), pieces[2]], resolve, False, keep_boundaries=False
    )
    assert [s.kind.value for s in with_ref] == ["prompt", "chunk", "prompt"]
    assert with_ref[1].token_ids == (7, 8, 9)


@pytest.fixture(scope="module")
def online():
    """vLLM's own chat renderer for the tiny model, as its API server builds it (no engine)."""
    from vllm.config import ModelConfig, VllmConfig
    from vllm.renderers.online_renderer import OnlineRenderer
    from vllm.renderers.registry import renderer_from_config

    model = ModelConfig(model=str(prepare_tiny_llama()), dtype="float32")
    return OnlineRenderer(
        model_config=model,
        renderer=renderer_from_config(VllmConfig(model_config=model)),
        request_logger=None,
        chat_template=None,
        chat_template_content_format="auto",
        trust_request_chat_template=True,
    )


DOCS_TEMPLATE = (
    "{% for d in documents %}{{ 'Doc ' + d['title'] + ': ' + d['text'] + '\\n' }}{% endfor %}"
    "{% for m in messages %}<{{ m['role'] }}>"
    "{% if m['content'] is string %}{{ m['content'] }}"
    "{% else %}{% for p in m['content'] %}[{{ p['text'] }}]{% endfor %}{% endif %}"
    "{% endfor %}<assistant>"
)


@pytest.mark.parametrize("content_format", ["string", "openai"])
def test_segment_ignoring_policies_get_stock_vllms_tokens(online, tok, content_format):
    """The structured request's pieces are exactly the prompt vLLM's own chat path renders
    (parts joined as vLLM joins them, for either content format; documents rendered by the
    template), and ``full`` / ``prefix`` send exactly vLLM's tokens for it."""
    import asyncio

    from ascend_mepic.entrypoints.server.service import chat_pieces
    from ascend_mepic.vllm_integration.openai_api import ChatCompletionRequest

    parts = [{"type": "text", "text": "Read:"}, chunk_part("Paris is in France."), "Q?"]
    body = {
        "messages": [
            {"role": "system", "content": "Be brief."},
            {"role": "user", "content": parts},
        ],
        "documents": [{"title": "a", "text": "Berlin is in Germany."}],
        "mepic": {"chunk_documents": True},
        "chat_template": DOCS_TEMPLATE,
    }
    request = ChatCompletionRequest.model_validate(body)
    online.chat_template_content_format = content_format
    pieces, structured = asyncio.run(chat_pieces(online, request, Markers()))
    _, (stock,) = asyncio.run(online.render_chat(request))
    assert structured and [p.kind for p in pieces].count("chunk") == 2
    text = tok.decode(stock["prompt_token_ids"])
    assert "".join(p.text for p in pieces) == text
    assert ("Read:\nParis" in text) == (content_format == "string")

    def resolve(chunk_id: str) -> list[int]:
        raise AssertionError("no references here")

    whole = pieces_segments(tok, pieces, resolve, add_bos=False, keep_boundaries=False)
    assert list(whole[0].token_ids) == stock["prompt_token_ids"]
