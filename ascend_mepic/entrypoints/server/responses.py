"""HTTP responses of MEPIC requests: JSON errors, SSE events and completions shown as chat.

A marked chat request runs as a completion in the engine; its response and its stream events are
rewritten here into ``chat.completion`` and ``chat.completion.chunk`` form.
"""

import json
from collections.abc import AsyncGenerator
from http import HTTPStatus
from typing import Any

from fastapi.responses import JSONResponse
from vllm.exceptions import GenerationError

from ascend_mepic.vllm_integration.openai_api import (
    ChatCompletionLogProb,
    ChatCompletionLogProbs,
    ChatCompletionLogProbsContent,
    ChatCompletionResponse,
    ChatCompletionResponseChoice,
    ChatCompletionResponseStreamChoice,
    ChatCompletionStreamResponse,
    ChatMessage,
    CompletionLogProbs,
    CompletionResponse,
    CompletionStreamResponse,
    DeltaMessage,
    create_error_response,
)


def error_json(message: str, status: HTTPStatus = HTTPStatus.BAD_REQUEST) -> JSONResponse:
    err_type = "NotFoundError" if status == HTTPStatus.NOT_FOUND else "BadRequestError"
    if status == HTTPStatus.TOO_MANY_REQUESTS:
        err_type = "RateLimitError"  # what the openai client raises for 429
    if status >= 500:
        err_type = "ServiceUnavailableError"
    err = create_error_response(message, err_type=err_type, status_code=status)
    return JSONResponse(content=err.model_dump(), status_code=err.error.code)


GENERATION_ERROR_MESSAGE = GenerationError().args[0]
ENGINE_REJECTED = (
    "MEPIC rejected the request: its layout cannot be placed in the KV cache pool (less the "
    "blocks pinned chunks hold) or in one step's chunk compile budget; the server log names "
    "the exact reason"
)


def event_data(event: str) -> Any:
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


def is_finished_with_error_event(data: Any) -> bool:
    """Whether a stream event is vLLM's report of a request the engine finished with an error.

    vLLM turns finish reason "error" into ``GenerationError`` with this exact 500 message;
    other server errors (a dead engine, say) keep their own message and stay 5xx.
    """
    if not isinstance(data, dict) or not isinstance(data.get("error"), dict):
        return False
    err = data["error"]
    return err.get("code") == HTTPStatus.INTERNAL_SERVER_ERROR and (
        err.get("message") == GENERATION_ERROR_MESSAGE
    )


def ends_without_output(event: str) -> bool:
    """Whether a stream's first event already ends it with nothing generated.

    vLLM 0.30.0's completion stream skips an output with no text and no tokens *before* checking
    its finish reason, so a request the engine finished with an error at arrival streams only
    ``[DONE]`` (or, with usage reporting, a usage chunk without choices). A request that ran
    always streams at least one choice (its first token or its finish reason).
    """
    line = event.strip()
    if line == "data: [DONE]":
        return True
    data = event_data(event)
    return isinstance(data, dict) and data.get("choices") == [] and "error" not in data


def chat_id(completion_id: str) -> str:
    return "chatcmpl-" + completion_id.removeprefix("cmpl-")


def chat_logprobs(
    logprobs: CompletionLogProbs | None, top: int | None
) -> ChatCompletionLogProbs | None:
    """A completion's logprobs in chat form: per token, its logprob and the ``top`` likeliest.

    The completion's ``top_logprobs`` maps each candidate's text to its logprob (the sampled
    token included); chat lists the ``top`` best, likeliest first, with each token's bytes.
    """
    if logprobs is None or top is None:
        return None
    content = []
    for token, logprob, candidates in zip(
        logprobs.tokens, logprobs.token_logprobs, logprobs.top_logprobs, strict=True
    ):
        best = sorted((candidates or {}).items(), key=lambda kv: kv[1], reverse=True)[:top]
        content.append(
            ChatCompletionLogProbsContent(
                token=token,
                logprob=max(logprob if logprob is not None else -9999.0, -9999.0),
                bytes=list(token.encode("utf-8", errors="replace")),
                top_logprobs=[
                    ChatCompletionLogProb(
                        token=t, logprob=max(lp, -9999.0), bytes=list(t.encode("utf-8", "replace"))
                    )
                    for t, lp in best
                ],
            )
        )
    return ChatCompletionLogProbs(content=content)


def chat_response(resp: CompletionResponse, top_logprobs: int | None) -> ChatCompletionResponse:
    """A MEPIC completion as the chat response (``top_logprobs``: the request's, None: off)."""
    return ChatCompletionResponse(
        id=chat_id(resp.id),
        created=resp.created,
        model=resp.model,
        choices=[
            ChatCompletionResponseChoice(
                index=c.index,
                message=ChatMessage(role="assistant", content=c.text),
                logprobs=chat_logprobs(c.logprobs, top_logprobs),
                finish_reason=c.finish_reason,
                stop_reason=c.stop_reason,
                token_ids=c.token_ids,
            )
            for c in resp.choices
        ],
        usage=resp.usage,
        system_fingerprint=resp.system_fingerprint,
        # with return_token_ids: the prompt the model saw (every choice shares it)
        prompt_token_ids=resp.choices[0].prompt_token_ids if resp.choices else None,
    )


async def chat_stream(
    events: AsyncGenerator[str, None], top_logprobs: int | None
) -> AsyncGenerator[str, None]:
    """Completion SSE events as vLLM's ``chat.completion.chunk`` events (its own models)."""
    started: set[int] = set()
    async for event in events:
        data = event_data(event)
        if not isinstance(data, dict) or "error" in data:
            yield event
            continue
        completion = CompletionStreamResponse.model_validate(data)
        choices = []
        for c in completion.choices:
            first = c.index not in started
            started.add(c.index)
            choices.append(
                ChatCompletionResponseStreamChoice(
                    index=c.index,
                    delta=DeltaMessage(role="assistant" if first else None, content=c.text),
                    logprobs=chat_logprobs(c.logprobs, top_logprobs),
                    finish_reason=c.finish_reason,
                    stop_reason=c.stop_reason,
                )
            )
        chunk = ChatCompletionStreamResponse(
            id=chat_id(completion.id),
            object="chat.completion.chunk",  # set, so that exclude_unset keeps it (as vLLM does)
            created=completion.created,
            model=completion.model,
            choices=choices,
            usage=completion.usage,
        )
        yield f"data: {chunk.model_dump_json(exclude_unset=True)}\n\n"
