"""Dynamo's standalone KV indexer: the residency index the chunk-aware policy asks.

``python -m dynamo.indexer`` (ai-dynamo-runtime 1.6.1, the ``cluster`` extra) subscribes to each
worker's vLLM ZMQ KV events, keeps one radix tree of token blocks per model, and answers
``POST /query`` with token ids: for each worker, how many of those tokens (whole blocks, from the
first token of the query) it holds. MEPIC's chunk events are chains from the root keyed by the
chunk's own tokens, so querying a chunk's tokens tells which replica holds the chunk, wherever
the chunk sits in the request. Workers come and go with ``POST /register`` and
``POST /unregister`` (an unregistered worker's blocks are dropped).

Checked against 1.6.1 here (verify on another release): its HTTP server binds 0.0.0.0 with no
option to change it, so run it where that address is private (a host firewall, a network
namespace, a pod); its ZMQ listener *connects* to each worker's endpoint, so each replica's
publisher must bind (``tcp://*:PORT``); it hashes tokens only, so the tenant salt and anchor
digest in MEPIC's ``extra_keys`` do not reach its scores (the engine still never shares blocks
across tenants: a wrong guess costs a compile, never a wrong answer).
"""

from __future__ import annotations

import importlib.util
import logging
import sys
from collections.abc import Sequence
from dataclasses import dataclass

import httpx

log = logging.getLogger(__name__)

MODEL_NAME = "default"


class IndexerError(RuntimeError):
    """The indexer refused a request or could not be reached."""


def indexer_available() -> bool:
    return importlib.util.find_spec("dynamo.indexer") is not None


def indexer_command(port: int, block_size: int, threads: int = 1) -> list[str]:
    """The command line of Dynamo's standalone indexer (workers are registered over HTTP)."""
    if not indexer_available():
        raise IndexerError(
            "Dynamo's standalone KV indexer is not installed: `pip install -e '.[cluster]'` "
            "(ai-dynamo-runtime 1.6.1) or run `python -m dynamo.indexer` elsewhere and pass "
            "--indexer URL"
        )
    return [
        sys.executable, "-m", "dynamo.indexer", "--port", str(port),
        "--block-size", str(block_size), "--threads", str(threads),
    ]  # fmt: skip


@dataclass(frozen=True)
class WorkerEndpoint:
    """One replica as the indexer knows it: an integer id and its KV event endpoint."""

    worker_id: int
    events: str  # the replica's ZMQ PUB endpoint, as the indexer connects to it
    block_size: int
    replay: str | None = None


class DynamoIndexer:
    """Async HTTP client of one Dynamo standalone indexer."""

    def __init__(self, url: str, timeout_s: float = 2.0, model_name: str = MODEL_NAME) -> None:
        self.url = url.rstrip("/")
        self.model_name = model_name
        self._http = httpx.AsyncClient(timeout=timeout_s)

    async def aclose(self) -> None:
        await self._http.aclose()

    async def _post(self, path: str, body: dict) -> dict:
        try:
            resp = await self._http.post(self.url + path, json=body)
        except httpx.HTTPError as e:
            raise IndexerError(f"indexer {self.url}{path}: {e!r}") from e
        if not resp.is_success:
            raise IndexerError(f"indexer {self.url}{path}: {resp.status_code} {resp.text[:200]}")
        try:
            return resp.json()
        except ValueError as e:
            raise IndexerError(f"indexer {self.url}{path}: not JSON: {resp.text[:200]}") from e

    async def overlap(self, token_ids: Sequence[int]) -> dict[int, int]:
        """Tokens of ``token_ids`` (whole blocks, from its first token) each worker holds."""
        if not token_ids:
            return {}
        body = await self._post(
            "/query", {"token_ids": list(token_ids), "model_name": self.model_name}
        )
        # {"scores": {"<worker>": {"<dp rank>": tokens}}, ...}: one DP rank per replica here.
        return {
            int(worker): max(int(v) for v in ranks.values())
            for worker, ranks in body.get("scores", {}).items()
            if ranks
        }

    async def register(self, worker: WorkerEndpoint) -> None:
        body = {
            "instance_id": worker.worker_id,
            "endpoint": worker.events,
            "model_name": self.model_name,
            "block_size": worker.block_size,
        }
        if worker.replay:
            body["replay_endpoint"] = worker.replay
        try:
            await self._post("/register", body)
        except IndexerError as e:
            if "already registered" not in str(e):
                raise

    async def unregister(self, worker_id: int) -> None:
        """Drop a worker and every block the indexer held for it."""
        await self._post("/unregister", {"instance_id": worker_id, "model_name": self.model_name})

    async def workers(self) -> list[int]:
        try:
            resp = await self._http.get(self.url + "/workers")
            resp.raise_for_status()
        except httpx.HTTPError as e:
            raise IndexerError(f"indexer {self.url}/workers: {e!r}") from e
        return sorted(int(w["instance_id"]) for w in resp.json())
