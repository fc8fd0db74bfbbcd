"""The HTTP front of a MEPIC cluster: asks the policy, forwards, watches replica health.

A request is read once (``RequestReader``: its prefix and chunk tokens), the policy picks a
healthy replica, and the body goes to that replica unchanged; the response comes back as the
replica sent it (streams too), with ``x-mepic-replica`` naming the replica. Nothing here
balances load beyond the policy's bounded-load rule, retries a request that reached a replica,
or rewrites one.

Faults: a replica that refuses the connection is marked down at once and the request goes to
another replica (it never started); a replica that fails while serving a request (the
connection drops mid-response) fails that request with a 502, or, in a stream already under
way, a final error event, and the request is counted in ``failed``. The health loop polls
``/health`` of every replica; a replica that goes down is unregistered from the indexer (its
blocks are dropped there) and forgotten by the policy (a refused connection or an error status
is down at once; a probe without an answer in 2 s counts only three times in a row, as a busy
replica can be slow to answer); when it answers again it is registered
afresh, so a restarted replica starts with no residency and publishes its own.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import AsyncIterator, Sequence
from typing import Any

import httpx
from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response, StreamingResponse

from ascend_mepic.cluster.indexer import DynamoIndexer, IndexerError, WorkerEndpoint
from ascend_mepic.cluster.policy import Policy, Replica
from ascend_mepic.cluster.request_chunks import RequestReader, RoutingView

log = logging.getLogger("ascend_mepic.cluster")

_STREAM_FAILED = (
    b'data: {"error": {"message": "the replica failed while serving the request", '
    b'"type": "replica_failed", "code": 502}}\n\n'
)
_HOP_HEADERS = {"content-length", "transfer-encoding", "connection", "host", "keep-alive"}


def _error(status: int, message: str, kind: str) -> JSONResponse:
    return JSONResponse({"error": {"message": message, "type": kind, "code": status}}, status)


class ClusterFront:
    """The replicas, the policy and the indexer's view of which replicas exist."""

    def __init__(
        self,
        replicas: Sequence[Replica],
        policy: Policy,
        reader: RequestReader,
        indexer: DynamoIndexer | None = None,
        block_size: int = 32,
        health_interval_s: float = 0.5,
        request_timeout_s: float = 600.0,
    ) -> None:
        if not replicas:
            raise ValueError("a cluster needs at least one replica")
        self.replicas = list(replicas)
        self.policy = policy
        self.reader = reader
        self.indexer = indexer
        self.block_size = block_size
        self.health_interval_s = health_interval_s
        self.http = httpx.AsyncClient(timeout=httpx.Timeout(request_timeout_s, connect=2.0))
        self.requests = 0
        self.failed = 0  # requests that reached a replica that failed while serving them
        self.rejected = 0  # requests no healthy replica could take (503)
        self.rerouted = 0  # requests sent elsewhere after a replica refused the connection
        self.probe_timeout_s = 2.0
        self.slow_probes_down = 3
        self._slow: dict[int, int] = {}  # replica -> probes in a row without an answer in time
        self._health_task: asyncio.Task | None = None
        self._health_lock = asyncio.Lock()

    # -- health ---------------------------------------------------------------------------

    def healthy(self) -> list[Replica]:
        return [r for r in self.replicas if r.healthy]

    async def _probe(self, r: Replica) -> bool | None:
        """True: healthy; False: down (refused, or an error status); None: no answer in time.

        A busy replica can miss a probe's deadline (an engine step holds its event loop), so
        only ``slow_probes_down`` missed probes in a row count as down; a refused connection
        is down at once."""
        try:
            resp = await self.http.get(r.url + "/health", timeout=self.probe_timeout_s)
        except httpx.TimeoutException:
            return None
        except httpx.HTTPError:
            return False
        return resp.status_code == 200

    async def _set_health(self, r: Replica, up: bool) -> None:
        async with self._health_lock:
            if up == r.healthy:
                return
            if up and self.indexer is not None and r.events:
                try:  # register first: a replica the indexer cannot follow is not routed by it
                    await self.indexer.register(
                        WorkerEndpoint(r.worker_id, r.events, self.block_size, r.replay)
                    )
                except IndexerError as e:
                    log.warning("replica %s: indexer registration failed: %s", r.url, e)
                    return
            r.healthy = up
            log.warning("replica %d (%s) is %s", r.index, r.url, "up" if up else "down")
            if not up:
                self.policy.forget(r)
                if self.indexer is not None and r.events:
                    with contextlib.suppress(IndexerError):
                        await self.indexer.unregister(r.worker_id)

    async def check_health(self) -> None:
        ups = await asyncio.gather(*(self._probe(r) for r in self.replicas))
        for r, up in zip(self.replicas, ups, strict=True):
            if up is None:
                self._slow[r.index] = self._slow.get(r.index, 0) + 1
                if self._slow[r.index] < self.slow_probes_down:
                    continue
                up = False
            self._slow[r.index] = 0
            await self._set_health(r, up)

    async def _health_loop(self) -> None:
        while True:
            try:
                await self.check_health()
            except Exception:  # the loop must outlive any one probe
                log.exception("health check failed")
            await asyncio.sleep(self.health_interval_s)

    async def start(self) -> None:
        if self.indexer is not None:
            # A front restarted beside a running indexer: drop what it knew of these ids.
            for r in self.replicas:
                with contextlib.suppress(IndexerError):
                    await self.indexer.unregister(r.worker_id)
        await self.check_health()
        self._health_task = asyncio.create_task(self._health_loop())

    async def stop(self) -> None:
        if self._health_task is not None:
            self._health_task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._health_task
        await self.http.aclose()
        if self.indexer is not None:
            await self.indexer.aclose()

    # -- forwarding -----------------------------------------------------------------------

    def stats(self) -> dict[str, Any]:
        return {
            "policy": self.policy.name,
            "requests": self.requests,
            "failed": self.failed,
            "rejected": self.rejected,
            "rerouted": self.rerouted,
            "indexer_errors": self.policy.indexer_errors,
            "diverted": self.policy.diverted,
            "replicas": [
                {
                    "index": r.index,
                    "url": r.url,
                    "healthy": r.healthy,
                    "routed": r.routed,
                    "in_flight": r.in_flight,
                    "failed": r.failed,
                }
                for r in self.replicas
            ],
        }

    async def route(self, path: str, body: dict[str, Any], headers: dict[str, str]) -> Response:
        self.requests += 1
        completion = path == "/v1/completions"
        view = self.reader.completion(body) if completion else RoutingView()
        tried: set[int] = set()
        while True:
            live = [r for r in self.healthy() if r.index not in tried]
            if not live:
                self.rejected += 1
                return _error(503, "no healthy MEPIC replica", "service_unavailable")
            decision = await self.policy.choose(view, live)
            r = decision.replica
            log.debug(
                "route %s: %d chunks (%d tokens) -> replica %d, score %d, scores %s",
                path, len(view.chunks), view.chunk_tokens, r.index, decision.score, decision.scores,
            )  # fmt: skip
            tried.add(r.index)
            try:
                return await self._forward(r, path, body, headers)
            except httpx.ConnectError:
                # Refused before the request started: the replica is down, try another one.
                self.rerouted += 1
                await self._set_health(r, False)

    async def _forward(
        self, r: Replica, path: str, body: dict[str, Any], headers: dict[str, str]
    ) -> Response:
        # no accept-encoding: a non-streamed body is read decoded and sent on as it came
        fwd = {
            k: v
            for k, v in headers.items()
            if k.lower() not in _HOP_HEADERS and k.lower() != "accept-encoding"
        }
        req = self.http.build_request("POST", r.url + path, json=body, headers=fwd)
        r.in_flight += 1
        r.routed += 1
        started = time.monotonic()
        try:
            resp = await self.http.send(req, stream=True)
        except httpx.ConnectError:
            r.in_flight -= 1
            r.routed -= 1
            raise
        except httpx.HTTPError as e:
            r.in_flight -= 1
            return self._failed(r, e)
        out_headers = {k: v for k, v in resp.headers.items() if k.lower() not in _HOP_HEADERS} | {
            "x-mepic-replica": str(r.index)
        }
        if not resp.headers.get("content-type", "").startswith("text/event-stream"):
            try:
                content = await resp.aread()
            except httpx.HTTPError as e:
                return self._failed(r, e)
            finally:
                r.in_flight -= 1
                await resp.aclose()
            log.debug("%s -> replica %d in %.3f s", path, r.index, time.monotonic() - started)
            return Response(content, resp.status_code, out_headers)

        async def relay() -> AsyncIterator[bytes]:
            try:
                async for piece in resp.aiter_raw():
                    yield piece
            except httpx.HTTPError as e:
                self.failed += 1
                r.failed += 1
                log.warning("replica %d failed mid-stream: %r", r.index, e)
                yield _STREAM_FAILED
            finally:
                r.in_flight -= 1
                await resp.aclose()

        return StreamingResponse(relay(), resp.status_code, out_headers)

    def _failed(self, r: Replica, e: Exception) -> JSONResponse:
        self.failed += 1
        r.failed += 1
        log.warning("replica %d failed while serving a request: %r", r.index, e)
        return _error(502, f"replica {r.index} failed while serving the request", "replica_failed")

    async def forward_get(self, path: str) -> Response:
        for r in self.healthy():
            try:
                resp = await self.http.get(r.url + path)
            except httpx.HTTPError:
                continue
            kind = resp.headers.get("content-type", "application/json")
            return Response(resp.content, resp.status_code, {"content-type": kind})
        return _error(503, "no healthy MEPIC replica", "service_unavailable")


def build_app(front: ClusterFront) -> FastAPI:
    @contextlib.asynccontextmanager
    async def lifespan(app: FastAPI):
        await front.start()
        yield
        await front.stop()

    app = FastAPI(title="ascend-mepic route", lifespan=lifespan)

    @app.get("/health")
    async def health() -> Response:
        if front.healthy():
            return Response(status_code=200)
        return _error(503, "no healthy MEPIC replica", "service_unavailable")

    @app.get("/cluster/stats")
    async def stats() -> JSONResponse:
        return JSONResponse(front.stats())

    @app.get("/v1/models")
    async def models() -> Response:
        return await front.forward_get("/v1/models")

    async def _post(path: str, request: Request) -> Response:
        try:
            body = await request.json()
        except ValueError:
            return _error(400, "the body is not JSON", "invalid_request_error")
        if not isinstance(body, dict):
            return _error(400, "the body is not a JSON object", "invalid_request_error")
        return await front.route(path, body, dict(request.headers))

    @app.post("/v1/completions")
    async def completions(request: Request) -> Response:
        return await _post("/v1/completions", request)

    @app.post("/v1/chat/completions")
    async def chat(request: Request) -> Response:
        return await _post("/v1/chat/completions", request)

    return app
