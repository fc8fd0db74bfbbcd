"""OpenAI-compatible serving with MEPIC: chunks as request fields (or markers), explicit chunks
and metrics.

MEPIC joins vLLM's OpenAI server through two documented hooks, no patching:

* a ``vllm.general_plugins`` entry (``ascend_mepic.plugin``) for every process, and
* a ``vllm.endpoint_plugins`` entry, :class:`MepicEndpointPlugin`, in the API server process. It
  replaces ``POST /v1/completions`` and ``POST /v1/chat/completions`` (vLLM lets endpoint plugins
  override routes) with handlers that turn chunk parts, prompt pieces, documents and chunk
  markers into MEPIC token-level requests and hand
  everything else to vLLM's own handlers unchanged, and adds the chunk API (``/v1/chunks``) and
  ``GET /v1/mepic/stats``. It also registers a Prometheus collector so ``/metrics`` shows the
  engine's MEPIC counters (``ascend_mepic_*``), read from the stats file the scheduler writes.

vLLM loads endpoint plugins only when ``VLLM_PLUGINS`` names them, and this one activates only when
``--additional-config`` has a ``"mepic"`` key that leaves MEPIC enabled: a plain vLLM server is
untouched. ``ascend-mepic serve`` (:func:`serve`) sets all of that up and starts the server.

The chunk registry lives in the API server process: with ``--api-server-count`` above one, each
API server has its own registry, and ``/metrics`` shows MEPIC metrics only when vLLM serves the
default Prometheus registry (a single API server).

The package, one job per module:

* ``chunk_parts``: chunks as content parts, prompt pieces and documents; their boundaries as
  sentinels through the chat template;
* ``text_segments``: pieces and marked text to MEPIC segments (chunk references, layout checks);
* ``registry``: the explicit chunks registered through the chunk API, counted by holder;
* ``responses``: JSON errors, SSE events, completion responses rewritten as chat;
* ``protocol``: request bodies of MEPIC's own endpoints;
* ``service``: :class:`MepicService`, the request path from an HTTP body to vLLM's handlers;
* ``metrics``: the engine's stats file and its Prometheus collector;
* ``routes``: the FastAPI router;
* ``endpoint_plugin``: :class:`MepicEndpointPlugin`, the ``vllm.endpoint_plugins`` entry;
* ``launch``: ``ascend-mepic serve``.

This ``__init__`` re-exports the names other code imports, and keeps the entry point
``ascend_mepic.entrypoints.server:MepicEndpointPlugin`` resolving.
"""

from ascend_mepic.entrypoints.server.endpoint_plugin import (
    MepicEndpointPlugin,
    mepic_config_from_args,
)
from ascend_mepic.entrypoints.server.launch import (
    allow_mepic_plugins,
    apply_mepic_defaults,
    endpoint_plugin_installed,
    serve,
)
from ascend_mepic.entrypoints.server.registry import (
    ChunkRegistry,
    RegisteredChunk,
    chunk_ref,
    chunk_ref_id,
)
from ascend_mepic.entrypoints.server.routes import router
from ascend_mepic.entrypoints.server.service import MepicService
from ascend_mepic.entrypoints.server.text_segments import MepicRequestError, marked_text_segments

__all__ = [
    "ChunkRegistry",
    "MepicEndpointPlugin",
    "MepicRequestError",
    "MepicService",
    "RegisteredChunk",
    "allow_mepic_plugins",
    "apply_mepic_defaults",
    "chunk_ref",
    "chunk_ref_id",
    "endpoint_plugin_installed",
    "marked_text_segments",
    "mepic_config_from_args",
    "router",
    "serve",
]
