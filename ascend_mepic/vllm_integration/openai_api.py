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
    "validate_cache_salt",
    "validate_json_request",
    "with_cancellation",
    "with_sse_keep_alive",
]


def load_chat_template(chat_template: Any) -> Any:
    """vLLM's ``--chat-template`` loader (imported on first use, as vLLM's server does)."""
    from vllm.entrypoints.chat_utils import load_chat_template as load

    return load(chat_template)
