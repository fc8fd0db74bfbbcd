"""MEPIC's HTTP routes: completions and chat completions in place of vLLM's, the chunk API and
``GET /v1/mepic/stats``.

The handlers are thin: :class:`MepicService` does the work, client errors become 400s, and a
request without MEPIC markup goes to vLLM's own handler unchanged.
"""

import inspect
import time
from http import HTTPStatus

from fastapi import APIRouter, Depends, Request
from fastapi.responses import JSONResponse, Response

from ascend_mepic.core.markers import MarkerError
from ascend_mepic.core.segments import LayoutError
from ascend_mepic.entrypoints.server.protocol import ChunkCreate, MepicCompletionRequest
from ascend_mepic.entrypoints.server.responses import error_json
from ascend_mepic.entrypoints.server.service import MepicService
from ascend_mepic.entrypoints.server.text_segments import MepicRequestError
from ascend_mepic.vllm_integration.openai_api import (
    ChatCompletionRequest,
    load_aware_call,
    validate_json_request,
    with_cancellation,
)
from ascend_mepic.vllm_integration.openai_api import chat_api as vllm_chat_api
from ascend_mepic.vllm_integration.openai_api import completion_api as vllm_completion_api
from ascend_mepic.vllm_integration.stat_logger import read_stats

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
async def mepic_create_completion(
    request: MepicCompletionRequest, raw_request: Request
) -> Response:
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
