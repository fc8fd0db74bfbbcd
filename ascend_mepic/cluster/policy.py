"""Which replica serves a request: round robin, prefix-aware or chunk-aware, under bounded load.

All three share one load rule, so the arms differ only in what they score: a replica is a
candidate while it took no more than ``load_factor`` times its fair share of the last ``window``
decisions (consistent hashing with bounded loads, in spirit: affinity may concentrate hot
documents, the bound keeps requests per replica near even) and has at most ``queue_gap`` more
requests in flight than the least busy replica (so a hot replica's queue stays short). A bound
on in-flight shares alone is too coarse at a handful of requests in flight: with 3 replicas and
4 requests, ``ceil(1.25 * 4 / 3) = 2`` would turn a hot document away from its replica as soon
as two of its requests overlap.
Among the candidates the highest score wins, ties going to the least loaded.

* ``round_robin``: no score; the next healthy replica in turn.
* ``prefix``: the tokens of the whole prompt, from token 0, that the indexer says the replica
  holds. This is what prefix routers score (Dynamo's KV router, vllm-router's ``kv_aware``):
  under MEPIC it sees the shared system prompt and nothing of the chunks.
* ``chunk``: the tokens the replica holds over each of the request's chunks (one indexer query
  per chunk: MEPIC publishes each chunk as a chain from the root) plus its prefix. A chunk
  routed to a replica in the last ``affinity_s`` seconds counts as held there, which covers
  the time between the routing decision and the chunk's ``BlockStored`` event (a compile is
  published with the step that ran it, after the request was sent).
"""

from __future__ import annotations

import asyncio
import hashlib
import math
import struct
import time
from collections import deque
from collections.abc import Sequence
from dataclasses import dataclass, field

from ascend_mepic.cluster.indexer import DynamoIndexer, IndexerError
from ascend_mepic.cluster.request_chunks import RoutingView

POLICIES = ("round_robin", "prefix", "chunk")
# The defaults of the load rule and the affinity (``ascend-mepic route`` takes them as flags). A
# window of 64 decisions: 32 turned a request away from its chunks' replica about twice as often
# in benchmarks/bench_cluster.py, 96 let requests per replica drift (docs/results.md).
LOAD_FACTOR, LOAD_WINDOW, QUEUE_GAP, AFFINITY_S = 1.25, 64, 2, 10.0


@dataclass
class Replica:
    """One ``ascend-mepic serve`` replica as the front sees it."""

    index: int
    url: str
    events: str | None = None  # its KV event endpoint for the indexer (chunk/prefix policies)
    replay: str | None = None  # its event replay endpoint (an indexer that joins late catches up)
    healthy: bool = False
    in_flight: int = 0
    routed: int = 0
    failed: int = 0

    @property
    def worker_id(self) -> int:
        return self.index + 1  # the indexer's instance ids start at 1 in its docs


@dataclass
class Decision:
    replica: Replica
    score: int
    scores: dict[int, int] = field(default_factory=dict)  # worker id -> score
    # The load rule turned the request away from a replica that scored higher.
    diverted: bool = False


def chunk_key(tokens: Sequence[int]) -> bytes:
    return hashlib.sha256(struct.pack(f"<{len(tokens)}q", *tokens)).digest()[:16]


class BoundedLoad:
    """The load rule every policy shares: in-flight requests and the recent decisions."""

    def __init__(
        self,
        load_factor: float = LOAD_FACTOR,
        window: int = LOAD_WINDOW,
        queue_gap: int = QUEUE_GAP,
    ) -> None:
        if load_factor < 1.0:
            raise ValueError(f"load_factor must be at least 1, got {load_factor}")
        if queue_gap < 0:
            raise ValueError(f"queue_gap must be at least 0, got {queue_gap}")
        self.load_factor = load_factor
        self.queue_gap = queue_gap
        self.recent: deque[int] = deque(maxlen=window)

    def candidates(self, replicas: Sequence[Replica]) -> list[Replica]:
        n = len(replicas)
        flight_cap = min(r.in_flight for r in replicas) + self.queue_gap
        recent_cap = math.ceil(self.load_factor * (len(self.recent) + 1) / n)
        out = [
            r
            for r in replicas
            if r.in_flight <= flight_cap and self.recent.count(r.index) < recent_cap
        ]
        return out or [min(replicas, key=self.load)]

    def load(self, r: Replica) -> tuple[int, int, int]:
        return (r.in_flight, self.recent.count(r.index), r.index)

    def record(self, r: Replica) -> None:
        self.recent.append(r.index)


class Policy:
    """Chooses among healthy replicas; subclasses say what a replica scores."""

    name = "?"

    def __init__(self, indexer: DynamoIndexer | None = None, load: BoundedLoad | None = None):
        self.indexer = indexer
        self.load = load or BoundedLoad()
        self.indexer_errors = 0
        self.diverted = 0  # decisions the load rule took away from the best-scoring replica

    async def scores(self, view: RoutingView, replicas: Sequence[Replica]) -> dict[int, int]:
        return {}

    async def choose(self, view: RoutingView, replicas: Sequence[Replica]) -> Decision:
        if not replicas:
            raise LookupError("no healthy replica")
        candidates = self.load.candidates(replicas)
        try:
            scores = await self.scores(view, replicas)
        except IndexerError:
            self.indexer_errors += 1  # route on load alone while the indexer is away
            scores = {}
        best = max(candidates, key=lambda r: (scores.get(r.worker_id, 0), *_neg(self.load.load(r))))
        score = scores.get(best.worker_id, 0)
        diverted = score < max((scores.get(r.worker_id, 0) for r in replicas), default=0)
        self.diverted += diverted
        self.load.record(best)
        self.chosen(view, best)
        return Decision(best, score, scores, diverted)

    def chosen(self, view: RoutingView, replica: Replica) -> None:
        """Hook: what a policy remembers of a decision."""

    def forget(self, replica: Replica) -> None:
        """Hook: a replica went down."""


def _neg(t: tuple[int, ...]) -> tuple[int, ...]:
    return tuple(-x for x in t)


class RoundRobin(Policy):
    name = "round_robin"

    def __init__(self, indexer: DynamoIndexer | None = None, load: BoundedLoad | None = None):
        super().__init__(None, load)
        self._next = 0

    async def choose(self, view: RoutingView, replicas: Sequence[Replica]) -> Decision:
        if not replicas:
            raise LookupError("no healthy replica")
        best = replicas[self._next % len(replicas)]
        self._next += 1
        self.load.record(best)
        return Decision(best, 0)


class PrefixAware(Policy):
    name = "prefix"

    async def scores(self, view: RoutingView, replicas: Sequence[Replica]) -> dict[int, int]:
        if self.indexer is None or not view.prompt:
            return {}
        return await self.indexer.overlap(view.prompt)


class ChunkAware(Policy):
    name = "chunk"

    def __init__(
        self,
        indexer: DynamoIndexer | None = None,
        load: BoundedLoad | None = None,
        affinity_s: float = AFFINITY_S,
    ) -> None:
        super().__init__(indexer, load)
        self.affinity_s = affinity_s
        self._affinity: dict[bytes, tuple[int, float]] = {}  # chunk -> (worker id, expiry)

    async def scores(self, view: RoutingView, replicas: Sequence[Replica]) -> dict[int, int]:
        live = {r.worker_id for r in replicas}
        queries = [view.prefix, *view.chunks] if self.indexer is not None else []
        held = await asyncio.gather(*(self.indexer.overlap(q) for q in queries)) if queries else []
        total: dict[int, int] = {}
        for overlap in held:
            for w, tokens in overlap.items():
                total[w] = total.get(w, 0) + tokens
        now = time.monotonic()
        for i, chunk in enumerate(view.chunks):
            hit = self._affinity.get(chunk_key(chunk))
            if hit is None or hit[1] < now or hit[0] not in live:
                continue
            w = hit[0]
            indexed = held[i + 1].get(w, 0) if held else 0
            total[w] = total.get(w, 0) + len(chunk) - indexed  # the chunk counts once, whole
        return total

    def chosen(self, view: RoutingView, replica: Replica) -> None:
        now = time.monotonic()
        if len(self._affinity) > 65536:
            self._affinity = {k: v for k, v in self._affinity.items() if v[1] >= now}
        for chunk in view.chunks:
            key = chunk_key(chunk)
            hit = self._affinity.get(key)
            if hit is None or hit[1] < now or hit[0] == replica.worker_id:
                self._affinity[key] = (replica.worker_id, now + self.affinity_s)

    def forget(self, replica: Replica) -> None:
        self._affinity = {k: v for k, v in self._affinity.items() if v[0] != replica.worker_id}


def make_policy(
    name: str,
    indexer: DynamoIndexer | None,
    load_factor: float = LOAD_FACTOR,
    affinity_s: float = AFFINITY_S,
    queue_gap: int = QUEUE_GAP,
    window: int = LOAD_WINDOW,
) -> Policy:
    load = BoundedLoad(load_factor, window, queue_gap)
    if name == "round_robin":
        return RoundRobin(None, load)
    if indexer is None:
        raise ValueError(f"policy {name!r} needs the indexer (--indexer URL or --start-indexer)")
    if name == "prefix":
        return PrefixAware(indexer, load)
    if name == "chunk":
        return ChunkAware(indexer, load, affinity_s)
    raise ValueError(f"unknown policy {name!r}; known: {', '.join(POLICIES)}")
