"""vLLM's OpenAI front end as MEPIC's server uses it: its request and response types, its route
handlers and their decorators, its error response and SSE keep-alive (vLLM 0.30.0's paths).

The server package (``entrypoints/server/``) imports these from here, never from
``vllm.entrypoints``: when vLLM moves one, this file changes and the server does not
(``tests/vllm_integration/test_vllm_boundary.py`` holds the line).
"""

from __future__ import annotations

from typing import Any

from vllm.entrypoints.generate.base.protocol import DeltaMessage, validate_cache_salt
from vllm.entrypoints.openai.chat_completion import api_router as chat_api
from vllm.entrypoints.openai.chat_completion.protocol import (
    ChatCompletionLogProb,
    ChatCompletionLogProbs,
    ChatCompletionLogProbsContent,
    ChatCompletionRequest,
    ChatCompletionResponse,
    ChatCompletionResponseChoice,
    ChatCompletionResponseStreamChoice,
    ChatCompletionStreamResponse,
    ChatMessage,
)
from vllm.entrypoints.openai.completion import api_router as completion_api
from vllm.entrypoints.openai.completion.protocol import (
    CompletionLogProbs,
    CompletionRequest,
    CompletionResponse,
    CompletionStreamResponse,
)
from vllm.entrypoints.serve.engine.protocol import ErrorResponse
from vllm.entrypoints.serve.exception_handling.error_response import create_error_response
from vllm.entrypoints.serve.utils.api_utils import (
    load_aware_call,
    validate_json_request,
    with_cancellation,
)
from vllm.entrypoints.serve.utils.sse_keep_alive import with_sse_keep_alive

__all__ = [
    "ChatCompletionLogProb",
    "ChatCompletionLogProbs",
    "ChatCompletionLogProbsContent",
    "ChatCompletionRequest",
    "ChatCompletionResponse",
    "ChatCompletionResponseChoice",
    "ChatCompletionResponseStreamChoice",
    "ChatCompletionStreamResponse",
    "ChatMessage",
    "CompletionLogProbs",
    "CompletionRequest",
    "CompletionResponse",
    "CompletionStreamResponse",
    "DeltaMessage",
    "ErrorResponse",
    "chat_api",
    "completion_api",
    "create_error_response",
    "load_aware_call",
    "load_chat_template",
    "render_chat_prompt",
    "validate_cache_salt",
    "validate_json_request",
    "with_cancellation",
    "with_sse_keep_alive",
]


def load_chat_template(chat_template: Any) -> Any:
    """vLLM's ``--chat-template`` loader (imported on first use, as vLLM's server does)."""
    from vllm.entrypoints.chat_utils import load_chat_template as load

    return load(chat_template)


async def render_chat_prompt(
    online_renderer: Any,
    request: ChatCompletionRequest,
    messages: list[dict[str, Any]],
    documents: list[dict[str, Any]] | None,
) -> str:
    """The prompt text vLLM's chat path renders for ``request`` with these messages and
    documents: its renderer, chat template (the server's, or the request's where trusted),
    content format and default template arguments, as ``OnlineRenderer.preprocess_chat`` uses
    them, stopping before tokenization. Raises ValueError with vLLM's reason."""
    from vllm.renderers import merge_kwargs

    error = online_renderer.validate_chat_template(
        request_chat_template=request.chat_template,
        chat_template_kwargs=request.chat_template_kwargs,
        trust_request_chat_template=online_renderer.trust_request_chat_template,
    )
    if error is not None:
        raise ValueError(error.error.message)
    shown = request.model_copy(update={"messages": messages, "documents": documents})
    params = shown.build_chat_params(
        online_renderer.chat_template, online_renderer.chat_template_content_format
    ).with_defaults(
        merge_kwargs(
            online_renderer.default_chat_template_kwargs, {"tools": None, "tokenize": False}
        )
    )
    _, prompt = await online_renderer.renderer.render_messages_async(messages, params)
    text = prompt.get("prompt") if isinstance(prompt, dict) else None
    if not isinstance(text, str):
        raise ValueError("the chat template did not render to text")
    return text
