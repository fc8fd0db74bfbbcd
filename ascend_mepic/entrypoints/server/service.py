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
from ascend_mepic.core.markers import MarkerError, Markers, split_marked_text
from ascend_mepic.core.request_limits import RequestLimits
from ascend_mepic.core.segments import (
    EXTRA_ARGS_KEY,
    PIN_KEY,
    UNPIN_KEY,
    Segment,
    SegmentKind,
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
    chat_messages,
    check_fits,
    check_refs,
    flat_segments,
    has_markup,
    marked_text_segments,
    raw_message_text,
    tokenizer_adds_bos,
)
from ascend_mepic.vllm_integration.openai_api import (
    ChatCompletionRequest,
    CompletionRequest,
    CompletionResponse,
    ErrorResponse,
    load_chat_template,
    with_sse_keep_alive,
)

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
        self.chat_template = load_chat_template(args.chat_template)
        self.trust_request_chat_template = bool(args.trust_request_chat_template)
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

        Text with markers becomes token ids plus flat ``mepic_segments``; a token-level request
        that already carries ``mepic_segments`` is validated and passes through.
        """
        xargs = dict(request.vllm_xargs or {})
        prompt = request.prompt
        texts: list[str] | None = None
        if isinstance(prompt, str):
            texts = [prompt]
        elif isinstance(prompt, list) and prompt and all(isinstance(p, str) for p in prompt):
            texts = list(prompt)
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
            tokens, flat = flat_segments(segs)
            xargs[EXTRA_ARGS_KEY] = flat
            check_fits(tokens, flat, self.limits)
            return request.model_copy(update={"prompt": tokens, "vllm_xargs": xargs})
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

    async def run_completion(
        self,
        request: CompletionRequest,
        raw_request: Request | None,
        to_chat: bool = False,
    ) -> Response:
        """Run a MEPIC completion through vLLM's serving layer; engine rejections become 400."""
        handler = self.state.openai_serving_completion
        try:
            result = await handler.create_completion(request, raw_request)
        except GenerationError:
            # Finish reason "error": MEPIC finishes requests it can never place that way.
            return error_json(ENGINE_REJECTED)
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
            return error_json(ENGINE_REJECTED)

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

    # ------------------------------------------------ chat

    def _render_chat(self, request: ChatCompletionRequest, messages: list[dict[str, Any]]) -> str:
        template = self.chat_template
        if request.chat_template is not None:
            if not self.trust_request_chat_template:
                raise MepicRequestError(
                    "chat_template in the request is not allowed; start the server with "
                    "--trust-request-chat-template"
                )
            template = request.chat_template
        text = self.tokenizer.apply_chat_template(
            messages,
            chat_template=template,
            tokenize=False,
            add_generation_prompt=request.add_generation_prompt,
            continue_final_message=request.continue_final_message,
            **(request.chat_template_kwargs or {}),
        )
        if not isinstance(text, str):
            raise MepicRequestError("the chat template did not render to text")
        return text

    async def prepare_chat(self, request: ChatCompletionRequest) -> CompletionRequest | None:
        """A marked chat request as a MEPIC completion request; None without markers.

        The template is rendered to text first and the markers split after it, so the template's
        own tokens (including any BOS it writes) stay in prompt segments.
        """
        if not any(
            isinstance(m, dict) and has_markup(raw_message_text(m.get("content")), self.markers)
            for m in request.messages
        ):
            return None
        messages = chat_messages(request)
        for i, message in enumerate(messages):
            # Checked per message first, so errors name the message and an offset the client
            # can find (the rendered template shifts offsets); chunks cannot span messages.
            try:
                split_marked_text(message["content"] or "", self.markers)
                check_refs(message["content"] or "", self.markers)
            except MarkerError as e:
                raise MarkerError(f"messages[{i}].content: {e}") from None
        _reject_unsupported_chat(request)
        text = await self._in_thread(self._render_chat, request, messages)
        segs = await self.segments(text, request.cache_salt, request.add_special_tokens)
        tokens, flat = flat_segments(segs)
        check_fits(tokens, flat, self.limits)
        fields = request.model_dump(exclude_unset=True)
        body = {k: fields[k] for k in _CHAT_TO_COMPLETION_FIELDS if k in fields}
        xargs = dict(request.vllm_xargs or {})
        if EXTRA_ARGS_KEY in xargs:
            raise MepicRequestError(
                f"send either chunk markers in the messages or vllm_xargs.{EXTRA_ARGS_KEY}"
            )
        xargs[EXTRA_ARGS_KEY] = flat
        body.update(
            prompt=tokens,
            max_tokens=fields.get("max_completion_tokens", fields.get("max_tokens")),
            vllm_xargs=xargs,
            # chat's logprobs + top_logprobs N are a completion's logprobs N (the sampled
            # token's and the N likeliest), shown in chat form by ``responses.chat_logprobs``
            logprobs=(request.top_logprobs or 0) if request.logprobs else None,
        )
        return CompletionRequest.model_validate(body)

    # ------------------------------------------------ explicit chunks

    async def _control(self, token_ids: Sequence[int], salt: str | None, key: str) -> None:
        """Send a [chunk, one-token prompt] request with a pin/unpin flag and wait for it."""
        tok = self.tokenizer
        tail = next(
            (t for t in (tok.eos_token_id, tok.bos_token_id) if t is not None), token_ids[-1]
        )
        flat: list[str | int] = [SegmentKind.CHUNK.value, len(token_ids), "prompt", 1]
        check_fits([*token_ids, tail], flat, self.limits)
        request = CompletionRequest(
            prompt=[*token_ids, tail],
            max_tokens=1,
            temperature=0.0,
            cache_salt=salt,
            vllm_xargs={EXTRA_ARGS_KEY: flat, key: 1},
        )
        try:
            result = await self.state.openai_serving_completion.create_completion(request, None)
        except GenerationError:
            raise MepicRequestError(ENGINE_REJECTED) from None
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
        vocab = getattr(self.engine_client.model_config, "get_vocab_size", lambda: None)()
        if vocab is not None and any(not 0 <= t < vocab for t in ids):
            raise MepicRequestError(f"chunk token ids must be in [0, {vocab})")
        chunk = RegisteredChunk(
            chunk_ref_id(ids, body.cache_salt), tuple(ids), body.cache_salt, time.time()
        )
        registered, _ = await self.registry.register(
            chunk, lambda c: self._control(c.token_ids, c.cache_salt, PIN_KEY)
        )
        return registered

    async def delete_chunk(self, chunk_id: str) -> int:
        """Drop a registration of the chunk; returns the holders left (0: unpinned, removed)."""
        released = await self.registry.release(
            chunk_id, lambda c: self._control(c.token_ids, c.cache_salt, UNPIN_KEY)
        )
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
            "num_private_tokens": private,
            "num_shared_tokens": shared,
            "num_shared_blocks": -(-shared // self.block_size),
            "salted": chunk.cache_salt is not None,
            "ref": chunk_ref(chunk.id),
            "holders": self.registry.holders(chunk.id),  # registrations not yet deleted
        }


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
        "documents": bool(getattr(request, "documents", None)),
    }
    _raise_unsupported(bad)


def _raise_unsupported(flags: dict[str, bool]) -> None:
    names = [name for name, on in flags.items() if on]
    if names:
        raise MepicRequestError(f"{', '.join(names)} cannot be used with chunk markers")
