"""kvsim: drive the real scheduling path (vLLM BlockPool + MEPIC manager, no model) over a trace.

It answers "how much KV would MEPIC save on my traffic?" with block accounting only. Each trace
request arrives at ``arrival``, is admitted in FIFO order when the pool has room (head-of-line
blocking, as vLLM's scheduler does), holds its KV (prompt plus ``output_tokens``) for ``duration``
seconds, then frees it. Placements:

* ``mepic``: the MEPIC manager (packed layout); chunks' canonical tokens shared, packed back to
  back; each chunk's first 16 tokens private, packed with the request's prompt tokens.
* ``private``: every request holds its own copy of every chunk (what EPIC and CacheBlend do on the
  device); stock vLLM manager without prefix caching on the concatenated tokens.
* ``prefix``: stock vLLM prefix caching on the concatenated tokens.

"Used" blocks are those held by live requests (and pinned chunks); reclaimable cache (vLLM's
cached free blocks, idle chunks) is not used. Usage = used blocks / num_blocks.
"""

from __future__ import annotations

import heapq
import json
from collections import deque
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from typing import Any

import torch
from vllm.sampling_params import SamplingParams
from vllm.v1.core.kv_cache_manager import KVCacheManager

from ascend_mepic.core.kv_manager import MepicCapacityError, MepicKVCacheManager
from ascend_mepic.core.markers import TextSegment, Tokenizer, tokenize_segments
from ascend_mepic.core.segments import EXTRA_ARGS_KEY, Segment, SegmentKind
from ascend_mepic.vllm_integration.block_hasher import mepic_request_block_hasher
from ascend_mepic.vllm_integration.core_types import (
    FullAttentionSpec,
    KVCacheConfig,
    KVCacheGroupSpec,
    Request,
    RequestStatus,
    get_request_block_hasher,
    init_none_hash,
    sha256_cbor,
)

PLACEMENTS = ("mepic", "private", "prefix")
OUTPUT_KEYS = (
    "placement",
    "block_size",
    "num_blocks",
    "requests",
    "rejected",
    "peak_blocks",
    "mean_blocks",
    "peak_usage",
    "mean_usage",
    "chunk_hits",
    "chunk_misses",
    "chunk_evictions",
    "tokens_total",
    "tokens_computed",
    "chunk_slot_utilisation",
    "timeline",
)
SIM_MODEL = "kvsim"
SIM_MAX_MODEL_LEN = 1 << 20


def kv_cache_config(num_blocks: int, block_size: int) -> KVCacheConfig:
    """A one-group full-attention KV config; only the block accounting matters here."""
    spec = FullAttentionSpec(
        block_size=block_size, num_kv_heads=1, head_size=1, dtype=torch.float32
    )
    return KVCacheConfig(num_blocks, [], [KVCacheGroupSpec(["layer"], spec)])


def build_manager(
    placement: str, num_blocks: int, block_size: int, max_model_len: int = SIM_MAX_MODEL_LEN
) -> KVCacheManager:
    """The real vLLM manager (or MEPIC's subclass) over a real BlockPool of ``num_blocks``."""
    init_none_hash(sha256_cbor)
    config = kv_cache_config(num_blocks, block_size)
    common: dict[str, Any] = dict(
        max_model_len=max_model_len, scheduler_block_size=block_size, hash_block_size=block_size
    )
    if placement == "mepic":
        return MepicKVCacheManager(
            config, hash_fn=sha256_cbor, model_fingerprint=SIM_MODEL, enable_caching=True, **common
        )
    if placement not in PLACEMENTS:
        raise ValueError(f"unknown placement {placement!r}; choose from {PLACEMENTS}")
    return KVCacheManager(config, enable_caching=placement == "prefix", **common)


def make_request(
    request_id: str,
    segments: Sequence[Segment],
    block_size: int,
    placement: str = "mepic",
    max_tokens: int = 16,
    cache_salt: str | None = None,
) -> Request:
    """A vLLM engine-core Request as the API layer would build it for this placement."""
    token_ids = [t for s in segments for t in s.token_ids]
    extra: dict[str, Any] | None = None
    if placement == "mepic":
        extra = {EXTRA_ARGS_KEY: [[s.kind.value, len(s.token_ids)] for s in segments]}
    params = SamplingParams(max_tokens=max(1, max_tokens), extra_args=extra)
    return Request(
        request_id,
        token_ids,
        params,
        None,
        cache_salt=cache_salt,
        # The engine core's hasher: with MEPIC's scheduler it skips segmented requests.
        block_hasher=(
            mepic_request_block_hasher if placement == "mepic" else get_request_block_hasher
        )(block_size, sha256_cbor),
    )


@dataclass
class TraceRequest:
    id: str
    arrival: float
    duration: float
    output_tokens: int
    segments: list[Segment]
    salt: str | None = None


def parse_trace(lines: Iterable[str], tokenizer: Tokenizer | None = None) -> list[TraceRequest]:
    """Parse JSONL trace lines; text segments need a tokenizer (each segment tokenized alone)."""
    out: list[TraceRequest] = []
    for lineno, line in enumerate(lines, 1):
        if not line.strip():
            continue
        try:
            obj = json.loads(line)
            pieces = []
            for seg in obj["segments"]:
                kind = SegmentKind(seg["type"])
                pieces.append((kind, seg.get("tokens"), seg.get("text")))
        except (KeyError, ValueError, TypeError) as e:
            raise ValueError(f"trace line {lineno}: {e!r}") from None
        if all(tokens is not None for _, tokens, _ in pieces):
            segments = [Segment(kind, tuple(tokens)) for kind, tokens, _ in pieces]
        else:
            if tokenizer is None:
                raise ValueError(f"trace line {lineno} has text segments: pass --tokenizer")
            segments = tokenize_segments(
                tokenizer, [TextSegment(kind, text or "") for kind, _, text in pieces]
            )
        out.append(
            TraceRequest(
                str(obj["id"]),
                float(obj["arrival"]),
                float(obj.get("duration", 0.0)),  # kvsim's hold time; the simulator's own
                int(obj.get("output_tokens", 0)),
                segments,
                obj.get("salt"),
            )
        )
    return out


class KVSim:
    """Event-driven admission/departure loop over one manager."""

    def __init__(self, placement: str, num_blocks: int, block_size: int) -> None:
        self.placement = placement
        self.num_blocks = num_blocks
        self.block_size = block_size
        self.manager = build_manager(placement, num_blocks, block_size)
        self.timeline: list[list[float]] = []
        self.rejected = 0
        self.admitted = 0
        self.tokens_total = 0
        self.tokens_computed = 0
        self.slot_utilisation: list[float] = []  # chunk cache, per step (MEPIC only)

    def used_blocks(self) -> int:
        m = self.manager
        if isinstance(m, MepicKVCacheManager):
            return m.num_used_blocks()
        return m.block_pool.num_gpu_blocks - 1 - m.block_pool.get_num_free_blocks()

    def _try_admit(self, tr: TraceRequest, req: Request) -> bool:
        m = self.manager
        blocks, num_hit, _ = m.get_computed_blocks(req)
        new = m.allocate_slots(
            req,
            req.num_tokens - num_hit,
            num_new_computed_tokens=num_hit,
            new_computed_blocks=blocks,
            num_lookahead_tokens=tr.output_tokens,
        )
        if new is None:
            return False
        req.num_computed_tokens = req.num_tokens
        real = sum(len(s.token_ids) for s in tr.segments)
        self.tokens_total += real
        if not isinstance(m, MepicKVCacheManager):
            self.tokens_computed += real - num_hit
        self.admitted += 1
        return True

    def run(self, trace: Sequence[TraceRequest]) -> dict[str, Any]:
        arrivals = sorted(trace, key=lambda r: (r.arrival, r.id))
        departures: list[tuple[float, int, Request]] = []
        waiting: deque[tuple[TraceRequest, Request]] = deque()
        seq = 0
        i = 0
        now = 0.0
        while i < len(arrivals) or departures or waiting:
            next_arrival = arrivals[i].arrival if i < len(arrivals) else float("inf")
            next_departure = departures[0][0] if departures else float("inf")
            if next_arrival == float("inf") and next_departure == float("inf"):
                # Waiting requests but nothing will ever free blocks: they can never fit.
                self.rejected += len(waiting)
                for _, req in waiting:
                    self._forget(req)
                waiting.clear()
                break
            now = min(next_arrival, next_departure)
            while departures and departures[0][0] <= now:
                _, _, req = heapq.heappop(departures)
                req.status = RequestStatus.FINISHED_STOPPED
                self.manager.free(req)
            while i < len(arrivals) and arrivals[i].arrival <= now:
                tr = arrivals[i]
                i += 1
                req = self._request(tr)
                if req is not None:
                    waiting.append((tr, req))
            while waiting and self._try_admit(*waiting[0]):
                tr, req = waiting.popleft()
                seq += 1
                heapq.heappush(departures, (now + tr.duration, seq, req))
            # The step that computed the admitted prompts ends: compiles land, scratch is freed.
            self.manager.new_step_starts()
            self.timeline.append([round(now, 6), self.used_blocks()])
            if isinstance(self.manager, MepicKVCacheManager):
                self.slot_utilisation.append(self.manager.chunk_cache.slot_utilisation())
        return self.report()

    def _request(self, tr: TraceRequest) -> Request | None:
        req = make_request(tr.id, tr.segments, self.block_size, self.placement, cache_salt=tr.salt)
        m = self.manager
        if isinstance(m, MepicKVCacheManager):
            try:
                m.track(req)
            except MepicCapacityError:
                self.rejected += 1
                return None
            return req
        needed = -(-(req.num_tokens + tr.output_tokens) // self.block_size)
        if needed > self.num_blocks - 1:
            self.rejected += 1
            return None
        return req

    def _forget(self, req: Request) -> None:
        if isinstance(self.manager, MepicKVCacheManager):
            self.manager.forget(req.request_id)

    def report(self) -> dict[str, Any]:
        m = self.manager
        used = [u for _, u in self.timeline]
        peak = max(used, default=0)
        mean = _time_weighted_mean(self.timeline)
        if isinstance(m, MepicKVCacheManager):
            metrics = m.metrics()
            hits, misses = metrics["chunk_hits"], metrics["chunk_misses"]
            evictions, computed = metrics["chunk_evictions"], metrics["tokens_computed"]
        else:
            hits = misses = evictions = 0
            computed = self.tokens_computed
        result = {
            "placement": self.placement,
            "block_size": self.block_size,
            "num_blocks": self.num_blocks,
            "requests": self.admitted,
            "rejected": self.rejected,
            "peak_blocks": peak,
            "mean_blocks": round(mean, 3),
            "peak_usage": round(peak / self.num_blocks, 6),
            "mean_usage": round(mean / self.num_blocks, 6),
            "chunk_hits": hits,
            "chunk_misses": misses,
            "chunk_evictions": evictions,
            "tokens_total": self.tokens_total,
            "tokens_computed": computed,
            # Canonical tokens / slots of the blocks holding them (1.0 = no padding, no holes),
            # the mean over steps; None for the stock-vLLM placements.
            "chunk_slot_utilisation": round(
                sum(self.slot_utilisation) / len(self.slot_utilisation), 4
            )
            if self.slot_utilisation
            else None,
            "timeline": self.timeline,
        }
        assert tuple(result) == OUTPUT_KEYS
        return result


def _time_weighted_mean(timeline: list[list[float]]) -> float:
    if len(timeline) < 2:
        return float(timeline[0][1]) if timeline else 0.0
    pairs = zip(timeline[:-1], timeline[1:], strict=True)
    area = sum((t1 - t0) * u0 for (t0, u0), (t1, _) in pairs)
    span = timeline[-1][0] - timeline[0][0]
    return area / span if span > 0 else float(timeline[-1][1])


def simulate(
    trace: Sequence[TraceRequest], placement: str, num_blocks: int, block_size: int
) -> dict[str, Any]:
    return KVSim(placement, num_blocks, block_size).run(trace)


def format_table(results: Sequence[dict[str, Any]]) -> str:
    """A side-by-side Markdown table with ratios against MEPIC."""
    base = next((r for r in results if r["placement"] == "mepic"), None)
    head = (
        "| placement | requests | rejected | peak blocks | mean blocks | peak usage | "
        "chunk hits | misses | evictions | tokens computed | chunk slot use | peak vs mepic |"
    )
    lines = [head, "|" + "---|" * 12]
    for r in results:
        ratio = r["peak_blocks"] / base["peak_blocks"] if base and base["peak_blocks"] else 0
        slot_use = r["chunk_slot_utilisation"]
        slot_use = "-" if slot_use is None else f"{slot_use:.1%}"
        lines.append(
            f"| {r['placement']} | {r['requests']} | {r['rejected']} | {r['peak_blocks']} | "
            f"{r['mean_blocks']:.1f} | {r['peak_usage']:.1%} | {r['chunk_hits']} | "
            f"{r['chunk_misses']} | {r['chunk_evictions']} | {r['tokens_computed']} | "
            f"{slot_use} | "
            f"{ratio:.2f}x |"
        )
    return "\n".join(lines)
