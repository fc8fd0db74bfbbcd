"""OpenAI-compatible serving with MEPIC: chunk markers, explicit chunks and metrics.

MEPIC joins vLLM's OpenAI server through two documented hooks, no patching:

* a ``vllm.general_plugins`` entry (``ascend_mepic.plugin``) for every process, and
* a ``vllm.endpoint_plugins`` entry, :class:`MepicEndpointPlugin`, in the API server process. It
  replaces ``POST /v1/completions`` and ``POST /v1/chat/completions`` (vLLM lets endpoint plugins
  override routes) with handlers that turn chunk markers into MEPIC token-level requests and hand
  everything else to vLLM's own handlers unchanged, and adds the chunk API (``/v1/chunks``) and
  ``GET /v1/mepic/stats``. It also registers a Prometheus collector so ``/metrics`` shows the
  engine's MEPIC counters (``ascend_mepic_*``), read from the stats file the scheduler writes.

vLLM loads endpoint plugins only when ``VLLM_PLUGINS`` names them, and this one activates only when
``--additional-config`` has a ``"mepic"`` key that leaves MEPIC enabled: a plain vLLM server is
untouched. ``ascend-mepic serve`` (:func:`serve`) sets all of that up and starts the server.

The chunk registry lives in the API server process: with ``--api-server-count`` above one, each
API server has its own registry, and ``/metrics`` shows MEPIC metrics only when vLLM serves the
default Prometheus registry (a single API server).
"""

import asyncio
import atexit
import contextlib
import hashlib
import inspect
import json
import logging
import os
import re
import shutil
import tempfile
import time
from argparse import Namespace
from collections.abc import (
    AsyncGenerator,
    AsyncIterator,
    Awaitable,
    Callable,
    Iterator,
    MutableMapping,
    Sequence,
)
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from http import HTTPStatus
from importlib.metadata import distributions, entry_points
from typing import Any

from fastapi import APIRouter, Depends, FastAPI, Request
from fastapi.responses import JSONResponse, Response, StreamingResponse
from prometheus_client import REGISTRY
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.registry import Collector
from pydantic import BaseModel, Field, model_validator
from starlette.datastructures import State
from vllm.entrypoints.generate.base.protocol import validate_cache_salt
from vllm.entrypoints.openai.chat_completion import api_router as vllm_chat_api
from vllm.entrypoints.openai.chat_completion.protocol import (
    ChatCompletionRequest,
    ChatCompletionResponse,
    ChatCompletionResponseChoice,
    ChatMessage,
)
from vllm.entrypoints.openai.completion import api_router as vllm_completion_api
from vllm.entrypoints.openai.completion.protocol import CompletionRequest, CompletionResponse
from vllm.entrypoints.serve.engine.protocol import ErrorResponse
from vllm.entrypoints.serve.exception_handling.error_response import create_error_response
from vllm.entrypoints.serve.utils.api_utils import (
    load_aware_call,
    validate_json_request,
    with_cancellation,
)
from vllm.entrypoints.serve.utils.sse_keep_alive import with_sse_keep_alive
from vllm.exceptions import GenerationError

from ascend_mepic.config import MepicConfig
from ascend_mepic.core.markers import MarkerError, Markers, finish_segments, split_marked_text
from ascend_mepic.core.segments import (
    EXTRA_ARGS_KEY,
    PIN_KEY,
    UNPIN_KEY,
    LayoutError,
    Segment,
    SegmentKind,
    layout_from_lengths,
    layout_from_real,
)
from ascend_mepic.entrypoints.offline import CPU_WORKER_CLS, SCHEDULER_CLS, worker_cls_for_platform
from ascend_mepic.vllm_integration.routes import include_router_replacing
from ascend_mepic.vllm_integration.version import check_vllm_version

logger = logging.getLogger(__name__)

# One name for both entry points, so VLLM_PLUGINS=ascend_mepic allows the pair.
PLUGIN_NAME = "ascend_mepic"
ENDPOINT_PLUGINS_GROUP = "vllm.endpoint_plugins"
ENDPOINT_ENTRY_POINT = "ascend_mepic.entrypoints.server:MepicEndpointPlugin"
CPU_BLOCK_SIZE = 32

CHUNK_REF_OPEN = "<<<MEPIC_CHUNK_REF:"
CHUNK_REF_CLOSE = ">>>"
_CHUNK_REF = re.compile(re.escape(CHUNK_REF_OPEN) + r"([^<>]*)" + re.escape(CHUNK_REF_CLOSE))

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


class MepicRequestError(ValueError):
    """A request MEPIC cannot serve as sent; the client gets ``status`` (400 unless said)."""

    def __init__(self, message: str, status: HTTPStatus = HTTPStatus.BAD_REQUEST) -> None:
        super().__init__(message)
        self.status = status


# ---------------------------------------------------------------- text -> segments


@dataclass(frozen=True)
class RegisteredChunk:
    id: str
    token_ids: tuple[int, ...]
    cache_salt: str | None
    created: float


def chunk_ref_id(token_ids: Sequence[int], cache_salt: str | None) -> str:
    """Registry id of a chunk: a hash of (salt, tokens), so tenants' ids never collide."""
    h = hashlib.sha256(b"ascend-mepic-chunk-ref-v1\0")
    h.update(b"\0" if cache_salt is None else b"\1" + cache_salt.encode() + b"\0")
    h.update(",".join(map(str, token_ids)).encode())
    return h.hexdigest()[:32]


def chunk_ref(chunk_id: str) -> str:
    """The text that stands for a registered chunk inside a prompt."""
    return f"{CHUNK_REF_OPEN}{chunk_id}{CHUNK_REF_CLOSE}"


class ChunkRegistry:
    """Registered chunks by id, each with a count of its registrations (holders).

    A chunk's id comes from its content, so clients registering the same document share one
    entry: every registration adds a holder and every delete drops one; the entry leaves the
    registry (and the engine unpins the chunk) only when the last holder deletes it. Register and
    release of one id are serialized by a per-id lock held across the engine's pin/unpin call, so
    the engine's pin state always matches the registry; other ids are not held up.
    """

    def __init__(self) -> None:
        self._chunks: dict[str, RegisteredChunk] = {}
        self._holders: dict[str, int] = {}
        self._locks: dict[str, tuple[asyncio.Lock, list[int]]] = {}  # lock, [users]

    def get(self, chunk_id: str) -> RegisteredChunk | None:
        return self._chunks.get(chunk_id)

    def values(self) -> list[RegisteredChunk]:
        return list(self._chunks.values())

    def holders(self, chunk_id: str) -> int:
        return self._holders.get(chunk_id, 0)

    def __contains__(self, chunk_id: object) -> bool:
        return chunk_id in self._chunks

    def __len__(self) -> int:
        return len(self._chunks)

    @contextlib.asynccontextmanager
    async def _locked(self, chunk_id: str) -> AsyncIterator[None]:
        lock, users = self._locks.setdefault(chunk_id, (asyncio.Lock(), [0]))
        users[0] += 1
        try:
            async with lock:
                yield
        finally:
            users[0] -= 1
            if users[0] == 0:
                del self._locks[chunk_id]

    async def register(
        self, chunk: RegisteredChunk, pin: Callable[[RegisteredChunk], Awaitable[None]]
    ) -> tuple[RegisteredChunk, int]:
        """Add a holder of ``chunk``, pinning it first when it has none; (entry, holders).

        Only the first holder pins (the chunk stays pinned while held); if pinning fails
        nothing is registered.
        """
        async with self._locked(chunk.id):
            current = self._chunks.get(chunk.id)
            if current is None:
                await pin(chunk)
                current = self._chunks[chunk.id] = chunk
            self._holders[chunk.id] = self._holders.get(chunk.id, 0) + 1
            return current, self._holders[chunk.id]

    async def release(
        self, chunk_id: str, unpin: Callable[[RegisteredChunk], Awaitable[None]]
    ) -> tuple[RegisteredChunk, int] | None:
        """Drop a holder of ``chunk_id``; (entry, holders left), or None if it is not registered.

        The last holder's release unpins the chunk and only then removes it: if unpinning fails
        the chunk stays registered with its holder, so the delete can be retried.
        """
        async with self._locked(chunk_id):
            chunk = self._chunks.get(chunk_id)
            if chunk is None:
                return None
            left = self._holders[chunk_id] - 1
            if left == 0:
                await unpin(chunk)
                del self._chunks[chunk_id], self._holders[chunk_id]
            else:
                self._holders[chunk_id] = left
            return chunk, left


def has_markup(text: str, markers: Markers) -> bool:
    return markers.begin in text or markers.end in text or CHUNK_REF_OPEN in text


def _check_refs(text: str, markers: Markers) -> None:
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
    _check_refs(text, markers)
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


def check_fits(lengths: object, block_size: int, max_model_len: int) -> int:
    """Reject a layout that is malformed or whose padded prompt leaves no room to generate.

    Returns the padded prompt length. The engine checks the same (and the KV pool size) and
    finishes such requests with an error; checking here gives the client a precise 400.
    """
    try:
        layout = layout_from_lengths(lengths, block_size)
    except LayoutError as e:
        raise MepicRequestError(f"invalid {EXTRA_ARGS_KEY}: {e}") from None
    padded = layout.num_padded_tokens
    if padded >= max_model_len:
        raise MepicRequestError(
            f"the MEPIC layout pads this prompt of {layout.num_real_tokens} tokens to {padded} "
            f"(every segment but the last takes whole blocks of {block_size}); it must be "
            f"shorter than max_model_len {max_model_len} to leave room for output"
        )
    return padded


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


# ---------------------------------------------------------------- responses


def error_json(message: str, status: HTTPStatus = HTTPStatus.BAD_REQUEST) -> JSONResponse:
    err_type = "NotFoundError" if status == HTTPStatus.NOT_FOUND else "BadRequestError"
    if status >= 500:
        err_type = "ServiceUnavailableError"
    err = create_error_response(message, err_type=err_type, status_code=status)
    return JSONResponse(content=err.model_dump(), status_code=err.error.code)


GENERATION_ERROR_MESSAGE = GenerationError().args[0]
ENGINE_REJECTED = (
    "MEPIC rejected the request: its layout can never fit the KV cache pool or one step's "
    "chunk compile budget (raise --max-num-batched-tokens or shorten the chunks); the server "
    "log names the exact reason"
)


def _event_data(event: str) -> Any:
    """The JSON payload of one SSE ``data:`` event, None for keep-alives and ``[DONE]``."""
    line = event.strip()
    if not line.startswith("data:"):
        return None
    body = line[len("data:") :].strip()
    if body == "[DONE]":
        return None
    try:
        return json.loads(body)
    except ValueError:
        return None


def _is_finished_with_error_event(data: Any) -> bool:
    """Whether a stream event is vLLM's report of a request the engine finished with an error.

    vLLM 0.32 turns finish reason "error" into ``GenerationError`` with this exact 500 message;
    other server errors (a dead engine, say) keep their own message and stay 5xx.
    """
    if not isinstance(data, dict) or not isinstance(data.get("error"), dict):
        return False
    err = data["error"]
    return err.get("code") == HTTPStatus.INTERNAL_SERVER_ERROR and (
        err.get("message") == GENERATION_ERROR_MESSAGE
    )


def chat_id(completion_id: str) -> str:
    return "chatcmpl-" + completion_id.removeprefix("cmpl-")


def chat_response(resp: CompletionResponse) -> ChatCompletionResponse:
    return ChatCompletionResponse(
        id=chat_id(resp.id),
        created=resp.created,
        model=resp.model,
        choices=[
            ChatCompletionResponseChoice(
                index=c.index,
                message=ChatMessage(role="assistant", content=c.text),
                finish_reason=c.finish_reason,
                stop_reason=c.stop_reason,
            )
            for c in resp.choices
        ],
        usage=resp.usage,
        system_fingerprint=resp.system_fingerprint,
    )


async def chat_stream(events: AsyncGenerator[str, None]) -> AsyncGenerator[str, None]:
    """Completion SSE events rewritten as ``chat.completion.chunk`` events."""
    started: set[int] = set()
    async for event in events:
        data = _event_data(event)
        if not isinstance(data, dict) or "error" in data:
            yield event
            continue
        choices = []
        for c in data.get("choices", []):
            delta: dict[str, Any] = {"content": c.get("text", "")}
            if c.get("index", 0) not in started:
                started.add(c.get("index", 0))
                delta = {"role": "assistant", **delta}
            choices.append(
                {
                    "index": c.get("index", 0),
                    "delta": delta,
                    "logprobs": None,
                    "finish_reason": c.get("finish_reason"),
                    "stop_reason": c.get("stop_reason"),
                }
            )
        chunk = {
            "id": chat_id(data.get("id", "")),
            "object": "chat.completion.chunk",
            "created": data.get("created"),
            "model": data.get("model"),
            "choices": choices,
        }
        if data.get("usage") is not None:
            chunk["usage"] = data["usage"]
        yield f"data: {json.dumps(chunk)}\n\n"


# ---------------------------------------------------------------- the service


class MepicService:
    """Per-app MEPIC state: tokenizer access, chunk registry, limits and the stats file."""

    def __init__(
        self, engine_client: Any, state: State, args: Namespace, config: MepicConfig
    ) -> None:
        from vllm.entrypoints.chat_utils import load_chat_template

        vllm_config = engine_client.vllm_config
        self.engine_client = engine_client
        self.state = state
        self.config = config
        self.markers = Markers(config.chunk_begin, config.chunk_end)
        self.block_size: int = vllm_config.cache_config.block_size
        self.max_model_len: int = vllm_config.model_config.max_model_len
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
            check_fits(flat, self.block_size, self.max_model_len)
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
        try:
            layout_from_real(ids, xargs[EXTRA_ARGS_KEY], self.block_size)
        except LayoutError as e:
            raise MepicRequestError(f"invalid {EXTRA_ARGS_KEY}: {e}") from None
        check_fits(xargs[EXTRA_ARGS_KEY], self.block_size, self.max_model_len)
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
            body = chat_response(result) if to_chat else result
            return JSONResponse(content=body.model_dump())
        # Streaming: wait for the first event, so a request the engine rejects at arrival
        # still gets a 400 before any 200 header goes out.
        try:
            first = await result.__anext__()
        except StopAsyncIteration:
            first = None
        if first is not None and _is_finished_with_error_event(_event_data(first)):
            await result.aclose()
            return error_json(ENGINE_REJECTED)

        async def replay() -> AsyncGenerator[str, None]:
            if first is not None:
                yield first
            async for event in result:
                yield event

        events = chat_stream(replay()) if to_chat else replay()
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
            isinstance(m, dict) and has_markup(_raw_text(m.get("content")), self.markers)
            for m in request.messages
        ):
            return None
        messages = chat_messages(request)
        for i, message in enumerate(messages):
            # Checked per message first, so errors name the message and an offset the client
            # can find (the rendered template shifts offsets); chunks cannot span messages.
            try:
                split_marked_text(message["content"] or "", self.markers)
                _check_refs(message["content"] or "", self.markers)
            except MarkerError as e:
                raise MarkerError(f"messages[{i}].content: {e}") from None
        _reject_unsupported_chat(request)
        text = await self._in_thread(self._render_chat, request, messages)
        segs = await self.segments(text, request.cache_salt, request.add_special_tokens)
        tokens, flat = flat_segments(segs)
        check_fits(flat, self.block_size, self.max_model_len)
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
        check_fits(flat, self.block_size, self.max_model_len)
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

    async def register_chunk(self, body: "ChunkCreate") -> RegisteredChunk:
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
        blocks = -(-len(chunk.token_ids) // self.block_size)
        return {
            "id": chunk.id,
            "object": "mepic.chunk",
            "created": int(chunk.created),
            "num_tokens": len(chunk.token_ids),
            "num_blocks": blocks,
            # Only blocks after a chunk's first are shared; a one-block chunk has none.
            "num_shared_blocks": max(0, blocks - 1),
            "salted": chunk.cache_salt is not None,
            "ref": chunk_ref(chunk.id),
            "holders": self.registry.holders(chunk.id),  # registrations not yet deleted
        }


def _raw_text(content: Any) -> str:
    if isinstance(content, str):
        return content
    if isinstance(content, list):
        return "".join(p.get("text", "") for p in content if isinstance(p, dict))
    return ""


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
        "logprobs": bool(request.logprobs),
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


# ---------------------------------------------------------------- metrics


def read_stats(path: str) -> dict[str, Any] | None:
    """The scheduler's last stats snapshot, or None before it wrote one."""
    if not path:
        return None
    try:
        with open(path, encoding="utf-8") as f:
            data = json.load(f)
    except (OSError, ValueError):
        return None
    return data if isinstance(data, dict) else None


_COUNTERS = {
    "chunk_hits": "Chunk lookups that found the chunk's shared blocks resident",
    "chunk_misses": "Chunk lookups that had to compile the chunk",
    "chunk_evictions": "Idle chunks evicted from the KV pool",
    "tokens_reused": "Prompt tokens served from shared chunk blocks",
    "tokens_computed": "Prompt tokens computed (in context or in chunk compiles)",
    "requests_admitted": "MEPIC requests admitted by the scheduler",
    "admissions_deferred": "MEPIC admissions deferred for lack of free blocks",
    "tier_loads": "Chunks loaded from the off-device tier and verified",
    "tier_fallbacks": "Tier loads that failed (miss, corruption, backend error) and were compiled",
    "tier_decided_load": "Chunks found in the tier that the scheduler chose to load",
    "tier_decided_compute": "Chunks found in the tier that the scheduler chose to recompute",
    "tier_worker_puts": "Chunks offloaded to the tier",
    "tier_worker_bytes_stored": "Bytes offloaded to the tier",
    "tier_worker_bytes_loaded": "Bytes loaded from the tier",
}
_GAUGES = {
    "resident_chunks": "Chunks with KV resident in the pool",
    "pinned_chunks": "Chunks pinned through the chunk API",
}


class MepicStatsCollector(Collector):
    """Exposes the engine's MEPIC stats file as ``ascend_mepic_*`` Prometheus metrics.

    The engine core runs in another process; the scheduler publishes its metrics to a JSON file
    and this collector reads it on every scrape.
    """

    def __init__(self, path: str) -> None:
        self.path = path

    def collect(self) -> Iterator[Metric]:
        stats = read_stats(self.path)
        up = GaugeMetricFamily(
            "ascend_mepic_stats_available", "1 once the engine published MEPIC stats"
        )
        up.add_metric([], 0.0 if stats is None else 1.0)
        yield up
        if stats is None:
            return
        metrics = stats.get("metrics", {})
        for key, doc in _COUNTERS.items():
            if key in metrics:
                yield CounterMetricFamily(f"ascend_mepic_{key}", doc, value=metrics[key])
        for key, doc in _GAUGES.items():
            if key in metrics:
                yield GaugeMetricFamily(f"ascend_mepic_{key}", doc, value=metrics[key])
        blocks = GaugeMetricFamily(
            "ascend_mepic_kv_blocks",
            "KV blocks by MEPIC category (they add up to the usable pool)",
            labels=["category"],
        )
        for key, value in sorted(metrics.items()):
            if key.startswith("blocks_"):
                blocks.add_metric([key[len("blocks_") :]], value)
        yield blocks
        for key, doc in (("num_blocks", "Usable KV blocks"), ("block_size", "Tokens per block")):
            if key in stats:
                yield GaugeMetricFamily(f"ascend_mepic_{key}", doc, value=stats[key])
        if "time" in stats:
            yield GaugeMetricFamily(
                "ascend_mepic_stats_age_seconds",
                "Seconds since the engine last published MEPIC stats (it does while scheduling)",
                value=max(0.0, time.time() - float(stats["time"])),
            )


_collectors: dict[str, MepicStatsCollector] = {}


def register_stats_collector(path: str) -> None:
    """Register the collector once per process and stats file."""
    if not path or path in _collectors:
        return
    collector = MepicStatsCollector(path)
    REGISTRY.register(collector)
    _collectors[path] = collector


# ---------------------------------------------------------------- routes

router = APIRouter()

# vLLM's own handlers, undecorated: requests without MEPIC markup go to them unchanged.
_vllm_create_completion = inspect.unwrap(vllm_completion_api.create_completion)
_vllm_create_chat_completion = inspect.unwrap(vllm_chat_api.create_chat_completion)


def _service(raw_request: Request) -> MepicService:
    return raw_request.app.state.mepic


def _client_error(e: Exception) -> JSONResponse:
    status = e.status if isinstance(e, MepicRequestError) else HTTPStatus.BAD_REQUEST
    return error_json(str(e), status)


_CLIENT_ERRORS = (MepicRequestError, MarkerError, LayoutError)


@router.post("/v1/completions", dependencies=[Depends(validate_json_request)])
@with_cancellation
@load_aware_call
async def mepic_create_completion(request: CompletionRequest, raw_request: Request) -> Response:
    try:
        mepic_request = await _service(raw_request).prepare_completion(request)
    except _CLIENT_ERRORS as e:
        return _client_error(e)
    if mepic_request is None:
        return await _vllm_create_completion(request, raw_request)
    return await _service(raw_request).run_completion(mepic_request, raw_request)


@router.post("/v1/chat/completions", dependencies=[Depends(validate_json_request)])
@with_cancellation
@load_aware_call
async def mepic_create_chat_completion(
    request: ChatCompletionRequest, raw_request: Request
) -> Response:
    try:
        mepic_request = await _service(raw_request).prepare_chat(request)
    except _CLIENT_ERRORS as e:
        return _client_error(e)
    if mepic_request is None:
        return await _vllm_create_chat_completion(request, raw_request)
    return await _service(raw_request).run_completion(mepic_request, raw_request, to_chat=True)


class ChunkCreate(BaseModel):
    """``POST /v1/chunks``: a chunk as text (tokenized alone) or as token ids."""

    text: str | None = None
    token_ids: list[int] | None = Field(default=None, min_length=1)
    cache_salt: str | None = None

    @model_validator(mode="after")
    def _one_source(self) -> "ChunkCreate":
        if (self.text is None) == (self.token_ids is None):
            raise ValueError("give exactly one of 'text' and 'token_ids'")
        validate_cache_salt(self.cache_salt)
        return self


@router.post("/v1/chunks", dependencies=[Depends(validate_json_request)])
async def mepic_create_chunk(body: ChunkCreate, raw_request: Request) -> Response:
    """Compute a chunk's KV once and pin it, so it survives until deleted.

    The same chunk registered again (by any client) adds a holder: ``holders`` in the response
    counts them, and the chunk stays until as many deletes have come.
    """
    service = _service(raw_request)
    try:
        chunk = await service.register_chunk(body)
    except _CLIENT_ERRORS as e:
        return _client_error(e)
    return JSONResponse(content=service.chunk_json(chunk))


@router.get("/v1/chunks")
async def mepic_list_chunks(raw_request: Request) -> Response:
    service = _service(raw_request)
    data = [service.chunk_json(c) for c in service.registry.values()]
    return JSONResponse(content={"object": "list", "data": data})


@router.delete("/v1/chunks/{chunk_id}")
async def mepic_delete_chunk(chunk_id: str, raw_request: Request) -> Response:
    """Drop one registration of a chunk; the last one unpins it and removes it from the registry.

    An unpinned chunk stays cached as an ordinary idle chunk until evicted. ``deleted`` says this
    registration is gone, ``removed`` whether the chunk left the registry, ``holders`` how many
    registrations remain.
    """
    try:
        left = await _service(raw_request).delete_chunk(chunk_id)
    except _CLIENT_ERRORS as e:
        return _client_error(e)
    return JSONResponse(
        content={
            "id": chunk_id,
            "object": "mepic.chunk",
            "deleted": True,
            "removed": left == 0,
            "holders": left,
        }
    )


@router.get("/v1/mepic/stats")
async def mepic_stats(raw_request: Request) -> Response:
    """The engine's last MEPIC stats snapshot (metrics and recent chunk block ids)."""
    path = _service(raw_request).config.stats_file
    if not path:
        return error_json("MEPIC stats are off: no stats_file in the MEPIC config")
    stats = read_stats(path)
    if stats is None:
        return error_json(
            "no MEPIC stats yet: the engine publishes them once it schedules a request",
            HTTPStatus.SERVICE_UNAVAILABLE,
        )
    age = max(0.0, time.time() - float(stats.get("time", 0.0)))
    return JSONResponse(content={**stats, "age_s": age})


# ---------------------------------------------------------------- the plugin


def mepic_config_from_args(args: Namespace | None) -> MepicConfig:
    """MEPIC's config from the server's ``--additional-config`` (disabled when absent)."""
    additional = getattr(args, "additional_config", None)
    if isinstance(additional, str):
        additional = json.loads(additional) if additional.strip() else {}
    return MepicConfig.from_additional_config(additional or {})


class MepicEndpointPlugin:
    """The ``vllm.endpoint_plugins`` entry: MEPIC's HTTP surface, only when MEPIC is on."""

    name = PLUGIN_NAME
    required_tasks = ("generate",)

    def attach_router(self, app: FastAPI) -> None:
        config = mepic_config_from_args(getattr(app.state, "args", None))
        if not config.enabled:
            logger.info("MEPIC is off (no 'mepic' in --additional-config): no MEPIC routes")
            return
        app.state.mepic_config = config
        replaced = include_router_replacing(app, router)
        logger.info("MEPIC routes in place of vLLM's: %s", ", ".join(replaced) or "none")

    async def init_state(self, engine_client: Any, state: State, args: Namespace) -> None:
        config = getattr(state, "mepic_config", None)
        if config is None or engine_client is None:
            return
        state.mepic = MepicService(engine_client, state, args, config)
        register_stats_collector(config.stats_file)
        logger.info(
            "MEPIC serving on: markers %r/%r, block size %d, stats %s",
            config.chunk_begin,
            config.chunk_end,
            state.mepic.block_size,
            config.stats_file or "off",
        )


# ---------------------------------------------------------------- ascend-mepic serve


def endpoint_plugin_installed() -> bool:
    return any(
        ep.name == PLUGIN_NAME and ep.value == ENDPOINT_ENTRY_POINT
        for ep in entry_points(group=ENDPOINT_PLUGINS_GROUP)
    )


def allow_mepic_plugins(environ: MutableMapping[str, str] = os.environ) -> str:
    """Add ``ascend_mepic`` to ``VLLM_PLUGINS`` (endpoint plugins load only when named).

    When unset, vLLM loads every general/platform/stat-logger plugin; setting the variable
    would turn that into an allowlist, so it lists all of them to keep that behaviour.
    """
    current = environ.get("VLLM_PLUGINS")
    if current is None:
        names = {
            ep.name
            for dist in distributions()
            for ep in dist.entry_points
            if ep.group.startswith("vllm.") and ep.group != ENDPOINT_PLUGINS_GROUP
        }
    else:
        names = {n for n in current.split(",") if n}
    names.add(PLUGIN_NAME)
    environ["VLLM_PLUGINS"] = ",".join(sorted(names))
    return environ["VLLM_PLUGINS"]


def apply_mepic_defaults(args: Namespace, is_cpu: bool) -> str | None:
    """Fill in MEPIC's server options the user left unset; returns a temp dir to remove.

    User-given values win, except those MEPIC cannot work with (an error says which).
    """
    if args.scheduler_cls is None:
        args.scheduler_cls = SCHEDULER_CLS
    elif args.scheduler_cls != SCHEDULER_CLS:
        logger.warning("--scheduler-cls %s: it must subclass MepicScheduler", args.scheduler_cls)
    if args.worker_cls in (None, "auto"):
        args.worker_cls = CPU_WORKER_CLS if is_cpu else worker_cls_for_platform()
    if args.enable_prefix_caching is False:
        raise ValueError("MEPIC needs prefix caching; drop --no-enable-prefix-caching")
    args.enable_prefix_caching = True
    if is_cpu and args.block_size is None:
        args.block_size = CPU_BLOCK_SIZE
    additional = args.additional_config or {}
    if isinstance(additional, str):
        additional = json.loads(additional)
    additional = dict(additional)
    mepic = additional.get("mepic") or {}
    if not isinstance(mepic, dict):
        raise ValueError(f'additional_config["mepic"] must be an object, got {mepic!r}')
    mepic = dict(mepic)
    temp_dir = None
    if not mepic.get("stats_file"):
        temp_dir = tempfile.mkdtemp(prefix="ascend-mepic-")
        mepic["stats_file"] = os.path.join(temp_dir, "stats.json")
    additional["mepic"] = mepic
    MepicConfig.from_additional_config(additional)  # unknown options fail now, not later
    args.additional_config = additional
    return temp_dir


def serve(argv: Sequence[str]) -> None:
    """``ascend-mepic serve MODEL [vLLM server options]``: vLLM's OpenAI server, MEPIC on."""
    check_vllm_version()
    allow_mepic_plugins()  # before vLLM reads it anywhere
    import uvloop
    from vllm.entrypoints.launchers.api_server.entry import run_server
    from vllm.entrypoints.launchers.cli_args import make_arg_parser, validate_parsed_serve_args
    from vllm.entrypoints.serve.utils.api_utils import cli_env_setup
    from vllm.platforms import current_platform
    from vllm.utils.argparse_utils import FlexibleArgumentParser

    cli_env_setup()
    parser = make_arg_parser(
        FlexibleArgumentParser(
            prog="ascend-mepic serve", description="vLLM's OpenAI server with MEPIC on"
        )
    )
    args = parser.parse_args(list(argv))
    if args.model_tag is not None:
        args.model = args.model_tag
    if not endpoint_plugin_installed():
        raise RuntimeError(
            f"the {ENDPOINT_PLUGINS_GROUP} entry point {PLUGIN_NAME} = {ENDPOINT_ENTRY_POINT} "
            "is not installed; reinstall the package (pip install -e .)"
        )
    temp_dir = apply_mepic_defaults(args, is_cpu=current_platform.is_cpu())
    if temp_dir is not None:
        atexit.register(shutil.rmtree, temp_dir, True)
    logger.info("MEPIC config: %s", json.dumps(args.additional_config["mepic"]))
    validate_parsed_serve_args(args)
    uvloop.run(run_server(args))
