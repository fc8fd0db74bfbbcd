"""The MEPIC request path: from a parsed HTTP body to vLLM's serving handlers.

:class:`MepicService` (one per app, on ``app.state.mepic``) turns marked completion and chat
requests into MEPIC token-level completion requests, runs them through vLLM's
``openai_serving_completion``, and registers and releases explicit chunks via pin/unpin requests.
A request without MEPIC markup comes back as None, and the routes hand it to vLLM's handlers;
options MEPIC cannot serve with markers are refused here (``_reject_unsupported_*``).
"""

import asyncio
import time
from argparse import Namespace
from collections.abc import AsyncGenerator, Callable, Sequence
from concurrent.futures import ThreadPoolExecutor
from http import HTTPStatus
from typing import Any

from fastapi import Request
from fastapi.responses import JSONResponse, Response, StreamingResponse
from starlette.datastructures import State
from vllm.exceptions import GenerationError

from ascend_mepic.config import MepicConfig
from ascend_mepic.core.markers import Markers
from ascend_mepic.core.policies import Placement
from ascend_mepic.core.request_limits import RequestLimits
from ascend_mepic.core.segments import (
    EXTRA_ARGS_KEY,
    PIN_KEY,
    UNPIN_KEY,
    Segment,
    SegmentKind,
)
from ascend_mepic.entrypoints.server.chunk_parts import (
    Boundaries,
    Piece,
    completion_pieces,
    is_piece_prompt,
    is_structured_chat,
    request_flags,
    wrap_chunk_parts,
    wrap_marked_messages,
)
from ascend_mepic.entrypoints.server.protocol import ChunkCreate
from ascend_mepic.entrypoints.server.registry import (
    ChunkRegistry,
    RegisteredChunk,
    chunk_ref,
    chunk_ref_id,
)
from ascend_mepic.entrypoints.server.responses import (
    ENGINE_REJECTED,
    chat_response,
    chat_stream,
    ends_without_output,
    error_json,
    event_data,
    is_finished_with_error_event,
)
from ascend_mepic.entrypoints.server.text_segments import (
    MepicRequestError,
    check_fits,
    flat_segments,
    has_markup,
    marked_text_segments,
    pieces_segments,
    raw_message_text,
    tokenizer_adds_bos,
)
from ascend_mepic.vllm_integration.openai_api import (
    ChatCompletionRequest,
    CompletionRequest,
    CompletionResponse,
    ErrorResponse,
    render_chat_prompt,
    with_sse_keep_alive,
)
from ascend_mepic.vllm_integration.stat_logger import read_stats

# Chat fields that mean the same in a completion request and travel with a marked chat request.
_CHAT_TO_COMPLETION_FIELDS = (
    "allowed_token_ids",
    "bad_words",
    "cache_salt",
    "frequency_penalty",
    "ignore_eos",
    "include_stop_str_in_output",
    "length_penalty",
    "logit_bias",
    "min_p",
    "min_tokens",
    "model",
    "n",
    "presence_penalty",
    "priority",
    "repetition_penalty",
    "request_id",
    "response_format",
    "return_token_ids",
    "seed",
    "session_id",
    "skip_special_tokens",
    "spaces_between_special_tokens",
    "stop",
    "stop_token_ids",
    "stream",
    "stream_options",
    "structured_outputs",
    "temperature",
    "top_k",
    "top_p",
    "user",
    "vllm_xargs",
)


class MepicService:
    """Per-app MEPIC state: tokenizer access, chunk registry, limits and the stats file."""

    def __init__(
        self, engine_client: Any, state: State, args: Namespace, config: MepicConfig
    ) -> None:
        vllm_config = engine_client.vllm_config
        self.engine_client = engine_client
        self.state = state
        self.config = config
        self.markers = Markers(config.chunk_begin, config.chunk_end)
        self.block_size: int = vllm_config.cache_config.block_size
        self.policy = config.parsed_policy
        self._vllm_config = vllm_config
        self.sse_keep_alive = float(getattr(args, "sse_keep_alive_interval", 0) or 0)
        self.registry = ChunkRegistry()
        # One thread: template rendering and tokenizing stay off the event loop, and the
        # tokenizer is never used by two threads at once.
        self._executor = ThreadPoolExecutor(1, thread_name_prefix="mepic-tokenize")
        self._tokenizer: Any = None
        self._adds_bos: bool | None = None

    @property
    def limits(self) -> RequestLimits:
        """The engine's limits on a segmented request, as its front end and intake check them
        (read per request: the KV pool's size is known once the engine has started)."""
        return RequestLimits.from_vllm_config(self._vllm_config, self.config)

    @property
    def tokenizer(self) -> Any:
        if self._tokenizer is None:
            self._tokenizer = self.engine_client.renderer.get_tokenizer()
            self._adds_bos = tokenizer_adds_bos(self._tokenizer)
        return self._tokenizer

    async def _in_thread(self, fn: Callable[..., Any], *args: Any) -> Any:
        return await asyncio.get_running_loop().run_in_executor(self._executor, fn, *args)

    def resolver(self, cache_salt: str | None) -> Callable[[str], Sequence[int]]:
        def resolve(chunk_id: str) -> Sequence[int]:
            chunk = self.registry.get(chunk_id)
            # Another tenant's chunk is reported as unknown: ids must not leak content.
            if chunk is None or chunk.cache_salt != cache_salt:
                raise MepicRequestError(
                    f"unknown chunk id {chunk_id!r} for this cache_salt "
                    "(register chunks with POST /v1/chunks)"
                )
            return chunk.token_ids

        return resolve

    def _segments(self, text: str, cache_salt: str | None, add_special_tokens: bool) -> Any:
        tok = self.tokenizer
        add_bos = add_special_tokens and bool(self._adds_bos)
        return marked_text_segments(tok, text, self.markers, self.resolver(cache_salt), add_bos)

    async def segments(
        self, text: str, cache_salt: str | None, add_special_tokens: bool
    ) -> list[Segment]:
        return await self._in_thread(self._segments, text, cache_salt, add_special_tokens)

    # ------------------------------------------------ completions

    async def prepare_completion(self, request: CompletionRequest) -> CompletionRequest | None:
        """The MEPIC form of a completion request; None when it is not a MEPIC request.

        A prompt of pieces (``chunk_parts.completion_pieces``) or text with markers becomes token
        ids plus flat ``mepic_segments``; a token-level request that already carries
        ``mepic_segments`` is validated and passes through.
        """
        xargs = dict(request.vllm_xargs or {})
        prompt = request.prompt
        if is_piece_prompt(prompt):
            _reject_unsupported_completion(request)
            if EXTRA_ARGS_KEY in xargs:
                raise MepicRequestError(
                    f"send either a prompt of pieces or vllm_xargs.{EXTRA_ARGS_KEY}"
                )
            pieces = completion_pieces(prompt)  # type: ignore[arg-type]
            segs = await self.piece_segments(pieces, request.cache_salt, request.add_special_tokens)
            return self._with_segments(request, segs, xargs)
        texts: list[str] | None = None
        if isinstance(prompt, str):
            texts = [prompt]
        elif isinstance(prompt, list) and prompt and all(isinstance(p, str) for p in prompt):
            texts = list(prompt)  # type: ignore[arg-type]
        marked = texts is not None and any(has_markup(t, self.markers) for t in texts)
        if not marked and EXTRA_ARGS_KEY not in xargs:
            return None
        _reject_unsupported_completion(request)
        if marked:
            assert texts is not None
            if EXTRA_ARGS_KEY in xargs:
                raise MepicRequestError(
                    f"send either chunk markers in the text or vllm_xargs.{EXTRA_ARGS_KEY}"
                )
            if len(texts) != 1:
                raise MepicRequestError("send one prompt per request when it has chunk markers")
            segs = await self.segments(texts[0], request.cache_salt, request.add_special_tokens)
            return self._with_segments(request, segs, xargs)
        ids: list[int] | None = None
        if isinstance(prompt, list) and prompt and all(isinstance(t, int) for t in prompt):
            ids = list(prompt)  # type: ignore[arg-type]
        elif isinstance(prompt, list) and len(prompt) == 1 and isinstance(prompt[0], list):
            ids = list(prompt[0])
        if ids is None:
            raise MepicRequestError(
                f"vllm_xargs.{EXTRA_ARGS_KEY} needs the prompt as one list of token ids"
            )
        check_fits(ids, xargs[EXTRA_ARGS_KEY], self.limits)
        return request

    def _with_segments(
        self, request: CompletionRequest, segs: list[Segment], xargs: dict[str, Any]
    ) -> CompletionRequest:
        """The request with its prompt as token ids and the segments in ``vllm_xargs``; a
        single prompt segment (a policy that ignores segments) goes as a plain prompt."""
        tokens, flat = flat_segments(segs)
        if len(segs) > 1 or segs[0].kind is not SegmentKind.PROMPT:
            xargs[EXTRA_ARGS_KEY] = flat
            check_fits(tokens, flat, self.limits)
        return request.model_copy(update={"prompt": tokens, "vllm_xargs": xargs or None})

    @property
    def keeps_boundaries(self) -> bool:
        """False for policies that ignore segments (``full``, ``prefix``): the structured form
        then sends stock vLLM's tokens, the text between references tokenized as one."""
        return self.policy.placement is not Placement.NONE

    def _piece_segments(
        self, pieces: list[Piece], cache_salt: str | None, add_special_tokens: bool, keep: bool
    ) -> list[Segment]:
        tok = self.tokenizer
        add_bos = add_special_tokens and bool(self._adds_bos)
        return pieces_segments(tok, pieces, self.resolver(cache_salt), add_bos, keep)

    async def piece_segments(
        self,
        pieces: list[Piece],
        cache_salt: str | None,
        add_special_tokens: bool,
        keep_boundaries: bool | None = None,
    ) -> list[Segment]:
        keep = self.keeps_boundaries if keep_boundaries is None else keep_boundaries
        return await self._in_thread(
            self._piece_segments, pieces, cache_salt, add_special_tokens, keep
        )

    async def run_completion(
        self,
        request: CompletionRequest,
        raw_request: Request | None,
        to_chat: bool = False,
    ) -> Response:
        """Run a MEPIC completion through vLLM's serving layer; engine rejections become 400."""
        handler = self.state.openai_serving_completion
        header = raw_request.headers.get("X-Request-Id") if raw_request is not None else None
        base_id = header or request.request_id  # how vLLM names the engine request
        try:
            result = await handler.create_completion(request, raw_request)
        except GenerationError:
            # Finish reason "error": MEPIC finishes requests it can never place that way.
            return error_json(*self.rejection(base_id))
        if isinstance(result, ErrorResponse):
            return JSONResponse(content=result.model_dump(), status_code=result.error.code)
        if isinstance(result, CompletionResponse):
            body = chat_response(result, request.logprobs) if to_chat else result
            return JSONResponse(content=body.model_dump())
        # Streaming: wait for the first event, so a request the engine rejects at arrival
        # still gets a 400 before any 200 header goes out.
        try:
            first = await result.__anext__()
        except StopAsyncIteration:
            first = None
        if (
            first is None
            or ends_without_output(first)
            or (is_finished_with_error_event(event_data(first)))
        ):
            await result.aclose()
            return error_json(*self.rejection(base_id))

        async def replay() -> AsyncGenerator[str, None]:
            if first is not None:
                yield first
            async for event in result:
                yield event

        events = chat_stream(replay(), request.logprobs) if to_chat else replay()
        return StreamingResponse(
            content=with_sse_keep_alive(events, self.sse_keep_alive),
            media_type="text/event-stream",
        )

    def rejection(self, base_id: str) -> tuple[str, HTTPStatus]:
        """Why the engine refused the request vLLM named ``cmpl-{base_id}-...``: the reason the
        scheduler published in the stats file (``MepicScheduler.recent_rejections``), else
        the generic message (stats off, or the entry already rotated out)."""
        stats = read_stats(self.config.stats_file) or {}
        prefix = f"cmpl-{base_id}-"
        for request_id, reason, status in reversed(stats.get("rejections") or []):
            if str(request_id).startswith(prefix):
                return f"MEPIC rejected the request: {reason}", HTTPStatus(int(status))
        return ENGINE_REJECTED, HTTPStatus.BAD_REQUEST

    # ------------------------------------------------ chat

    async def prepare_chat(self, request: ChatCompletionRequest) -> CompletionRequest | None:
        """A chat request with chunks as a MEPIC completion request; None without any.

        Chunk parts, references and documents (the structured form, ``chunk_parts``) or the
        older markers become sentinels in the messages; vLLM's renderer renders the chat (its
        template, content format and documents), and the sentinels are split out of the text
        and removed before each segment is tokenized alone, so the template's own tokens
        (including any BOS it writes) stay in prompt segments.
        """
        found = await chat_pieces(self.state.online_renderer, request, self.markers)
        if found is None:
            return None
        pieces, structured = found
        xargs = dict(request.vllm_xargs or {})
        # The older form keeps its boundaries under every policy, as it always did.
        segs = await self.piece_segments(
            pieces, request.cache_salt, request.add_special_tokens, None if structured else True
        )
        fields = request.model_dump(exclude_unset=True)
        body = {k: fields[k] for k in _CHAT_TO_COMPLETION_FIELDS if k in fields}
        body.update(
            max_tokens=fields.get("max_completion_tokens", fields.get("max_tokens")),
            # chat's logprobs + top_logprobs N are a completion's logprobs N (the sampled
            # token's and the N likeliest), shown in chat form by ``responses.chat_logprobs``
            logprobs=(request.top_logprobs or 0) if request.logprobs else None,
        )
        body.pop("vllm_xargs", None)
        completion = CompletionRequest.model_validate({**body, "prompt": [0]})
        return self._with_segments(completion, segs, xargs)

    # ------------------------------------------------ explicit chunks

    async def _control(self, chunk: RegisteredChunk, key: str) -> None:
        """Send a [prefix, chunk, one-token prompt] request with a pin/unpin flag and wait for
        it (the prefix, when registered, is what anchored compiles compile the chunk after)."""
        tok, token_ids, prefix = self.tokenizer, chunk.token_ids, chunk.prefix
        salt = chunk.cache_salt
        tail = next(
            (t for t in (tok.eos_token_id, tok.bos_token_id) if t is not None), token_ids[-1]
        )
        flat: list[str | int] = [SegmentKind.CHUNK.value, len(token_ids), "prompt", 1]
        if prefix:
            flat = [SegmentKind.PROMPT.value, len(prefix), *flat]
        prompt = [*prefix, *token_ids, tail]
        check_fits(prompt, flat, self.limits)
        request = CompletionRequest(
            prompt=prompt,
            max_tokens=1,
            temperature=0.0,
            cache_salt=salt,
            vllm_xargs={EXTRA_ARGS_KEY: flat, key: 1},
        )
        try:
            result = await self.state.openai_serving_completion.create_completion(request, None)
        except GenerationError:
            raise MepicRequestError(*self.rejection(request.request_id)) from None
        if isinstance(result, ErrorResponse):
            raise MepicRequestError(result.error.message, HTTPStatus(result.error.code))

    async def register_chunk(self, body: ChunkCreate) -> RegisteredChunk:
        """Add a registration (holder) of the chunk, computing and pinning it on the first."""
        if body.token_ids is not None:
            ids = list(body.token_ids)
        else:
            assert body.text is not None
            if has_markup(body.text, self.markers):
                raise MepicRequestError("chunk text must not contain chunk markers or references")
            ids = await self._in_thread(
                lambda: self.tokenizer.encode(body.text, add_special_tokens=False)
            )
        if not ids:
            raise MepicRequestError("the chunk is empty (it tokenizes to nothing)")
        prefix = list(body.prefix_token_ids or [])
        if body.prefix is not None:
            if has_markup(body.prefix, self.markers):
                raise MepicRequestError("a prefix must not contain chunk markers or references")
            segs = await self.segments(body.prefix, body.cache_salt, body.add_special_tokens)
            prefix = [t for s in segs for t in s.token_ids]  # as a completion's text is
        vocab = getattr(self.engine_client.model_config, "get_vocab_size", lambda: None)()
        if vocab is not None and any(not 0 <= t < vocab for t in [*ids, *prefix]):
            raise MepicRequestError(f"chunk and prefix token ids must be in [0, {vocab})")
        # Only under `prefix` does the prefix name another chunk; under `first` every prefix
        # names the engine's one copy (the first pin may still fix the engine's anchor).
        keyed = prefix if self.policy.anchor == "prefix" else ()
        chunk = RegisteredChunk(
            chunk_ref_id(ids, body.cache_salt, keyed),
            tuple(ids),
            body.cache_salt,
            time.time(),
            tuple(prefix),
        )
        registered, _ = await self.registry.register(chunk, lambda c: self._control(c, PIN_KEY))
        return registered

    async def delete_chunk(self, chunk_id: str) -> int:
        """Drop a registration of the chunk; returns the holders left (0: unpinned, removed)."""
        released = await self.registry.release(chunk_id, lambda c: self._control(c, UNPIN_KEY))
        if released is None:
            raise MepicRequestError(f"unknown chunk id {chunk_id!r}", HTTPStatus.NOT_FOUND)
        return released[1]

    def chunk_json(self, chunk: RegisteredChunk) -> dict[str, Any]:
        n = len(chunk.token_ids)
        # What each request recomputes in its own context and what is stored once (canonical
        # tokens, packed back to back with other chunks' so they may touch one block more).
        private = self.policy.in_context_tokens(n, self.block_size)
        shared = n - private
        return {
            "id": chunk.id,
            "object": "mepic.chunk",
            "created": int(chunk.created),
            "num_tokens": n,
            "num_prefix_tokens": len(chunk.prefix),
            "num_private_tokens": private,
            "num_shared_tokens": shared,
            "num_shared_blocks": -(-shared // self.block_size),
            "salted": chunk.cache_salt is not None,
            "ref": chunk_ref(chunk.id),
            "holders": self.registry.holders(chunk.id),  # registrations not yet deleted
        }


async def chat_pieces(
    online_renderer: Any, request: ChatCompletionRequest, markers: Markers
) -> tuple[list[Piece], bool] | None:
    """A chat request's rendered prompt as pieces, and whether it is in the structured form;
    None when it has no chunks (neither form).

    Chunk parts, references and documents (the structured form, ``chunk_parts``) or the older
    markers become sentinels in the messages; vLLM's renderer renders the chat (its template,
    content format and documents); the sentinels are split out of the text and removed.
    """
    extra = request.model_extra or {}
    structured = is_structured_chat(request.messages, extra)
    if not structured and not any(
        isinstance(m, dict) and has_markup(raw_message_text(m.get("content")), markers)
        for m in request.messages
    ):
        return None
    flags = request_flags(extra)
    if EXTRA_ARGS_KEY in (request.vllm_xargs or {}):
        raise MepicRequestError(
            f"send either chunks in the messages or vllm_xargs.{EXTRA_ARGS_KEY}"
        )
    boundaries = Boundaries(request.model_dump_json())
    if structured:
        messages = wrap_chunk_parts(request.messages, boundaries)
    else:
        messages = wrap_marked_messages(request.messages, markers, boundaries)
    documents = request.documents
    if flags is not None and flags.chunk_documents:
        if not documents:
            raise MepicRequestError("mepic.chunk_documents needs documents in the request")
        documents = boundaries.documents(documents)
    _reject_unsupported_chat(request)
    try:
        text = await render_chat_prompt(online_renderer, request, messages, documents)
    except ValueError as e:
        raise MepicRequestError(f"the chat template failed: {e}") from None
    return boundaries.split(text), structured


def _reject_unsupported_completion(request: CompletionRequest) -> None:
    bad = {
        "use_beam_search": request.use_beam_search,
        "prompt_logprobs": request.prompt_logprobs is not None,
        "truncate_prompt_tokens": request.truncate_prompt_tokens is not None,
        "suffix": request.suffix is not None,
        "prompt_embeds": request.prompt_embeds is not None,
    }
    _raise_unsupported(bad)


def _reject_unsupported_chat(request: ChatCompletionRequest) -> None:
    bad = {
        "use_beam_search": request.use_beam_search,
        "prompt_logprobs": request.prompt_logprobs is not None,
        "truncate_prompt_tokens": request.truncate_prompt_tokens is not None,
        "echo": request.echo,
        "tools": bool(request.tools),
    }
    _raise_unsupported(bad)


def _raise_unsupported(flags: dict[str, bool]) -> None:
    names = [name for name, on in flags.items() if on]
    if names:
        raise MepicRequestError(f"{', '.join(names)} cannot be used with MEPIC chunks")
