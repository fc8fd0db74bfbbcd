"""The MEPIC paper's workloads at its scale, for the simulator.

SQuAD is the bundled SQuAD v2 text (the same requests as ``bench compare``: a question with
paragraphs of one article as chunks), tokenized with the bundled SmolLM2 tokenizer (Mistral's is
not bundled; both are ~32-49k-entry BPE vocabularies) and folded into the simulated model's
vocabulary. NewsQA, NarrativeQA and emrQA are **synthetic**: token ids drawn at random, sized to
the paper's Table 1 (mean request tokens, mean reused fraction, tokens recomputed per request):

* each request has ``recomputed`` request-specific tokens (half before its chunks, half after:
  a question-specific prefix and the question), the rest are chunk tokens;
* chunks are ``CHUNK_TOKENS`` long on average (an assumption: the paper gives no chunk counts),
  so a request has ``round((tokens - recomputed) / CHUNK_TOKENS)`` chunks;
* chunks come from a pool sized so that the fraction of chunk occurrences seen for the first
  time makes the reused fraction the paper's: ``1 - reuse * tokens / (tokens - recomputed)``.
"""

from __future__ import annotations

import random
from dataclasses import dataclass
from typing import Any

from ascend_mepic.core.segments import Segment, SegmentKind

CHUNK_TOKENS = 200  # assumption: mean synthetic chunk length


@dataclass(frozen=True)
class DatasetStats:
    """The paper's Table 1 row for one dataset."""

    tokens: int
    reuse: float
    recomputed: int


PAPER_TABLE1 = {
    "squad": DatasetStats(2224, 0.849, 321),
    "newsqa": DatasetStats(1518, 0.614, 521),
    "narrativeqa": DatasetStats(1435, 0.939, 95),
    "emrqa": DatasetStats(1632, 0.982, 29),
}
# Table 2: total latency (s) and peak HBM usage (% of the KV pool), 300 requests per dataset.
PAPER_TABLE2 = {
    "squad": {"latency": (116.03, 119.41, 114.73), "peak_kv_pct": (27.67, 54.47, 54.13)},
    "newsqa": {"latency": (112.36, 117.00, 115.39), "peak_kv_pct": (36.43, 45.97, 45.43)},
    "narrativeqa": {"latency": (97.71, 104.72, 100.06), "peak_kv_pct": (29.67, 50.40, 50.40)},
    "emrqa": {"latency": (105.67, 110.97, 109.85), "peak_kv_pct": (23.20, 37.37, 37.40)},
}
PAPER_POLICIES = ("mepic", "cacheblend-15", "epic-16")  # Table 2's column order
# Fig. 7 (200 requests, QPS 2-25): peak HBM vs MEPIC and latency vs MEPIC, as the text says.
PAPER_FIG7 = {
    "qps": [2, 5, 10, 15, 20, 25],
    "peak_kv_ratio": {"cacheblend-15": 5.74, "epic-16": 5.25},
    "latency_reduction": {"cacheblend-15": 0.1148, "epic-16": 0.091},
    "total_latency_range_s": (70, 110),
}
# Fig. 8 (200 requests at QPS 15, 2-16 chunks): baselines' peak HBM / MEPIC's, MEPIC below 40%.
PAPER_FIG8 = {"chunks": [2, 4, 6, 8, 10, 12, 14, 16], "peak_kv_ratio": (2.97, 5.21)}


def synthetic_requests(
    name: str, num_requests: int, vocab: int, seed: int = 0, num_chunks: int | None = None
) -> list[list[Segment]]:
    """Requests shaped like the paper's Table 1 row for ``name`` (see the module docstring)."""
    stats = PAPER_TABLE1[name]
    rng = random.Random(f"{name}-{seed}")
    body = stats.tokens - stats.recomputed
    k = num_chunks or max(1, round(body / CHUNK_TOKENS))
    first_seen = max(0.0, 1.0 - stats.reuse * stats.tokens / body)
    pool_size = max(k, round(first_seen * num_requests * k))
    mean_len = body / k
    pool = [
        tuple(
            rng.randrange(3, vocab)
            for _ in range(max(1, round(mean_len * rng.uniform(0.75, 1.25))))
        )
        for _ in range(pool_size)
    ]
    head = stats.recomputed // 2
    out = []
    for _ in range(num_requests):
        segs = [Segment(SegmentKind.PROMPT, tuple(rng.randrange(3, vocab) for _ in range(head)))]
        segs += [Segment(SegmentKind.CHUNK, pool[i]) for i in rng.sample(range(pool_size), k)]
        tail = stats.recomputed - head
        segs.append(
            Segment(SegmentKind.PROMPT, tuple(rng.randrange(3, vocab) for _ in range(tail)))
        )
        out.append(segs)
    return out


def squad_requests(
    num_requests: int, num_chunks: int, vocab: int, seed: int = 0, articles: int | None = None
) -> list[list[Segment]]:
    """The bundled SQuAD workload (chat template, K paragraphs per request), ids folded into
    ``vocab``."""
    from transformers import AutoTokenizer

    from ascend_mepic.eval.bench.runner import build_requests
    from ascend_mepic.eval.prepare import resolve_model

    tok = AutoTokenizer.from_pretrained(str(resolve_model("smollm2")))
    job = {"requests": num_requests, "chunks": num_chunks, "seed": seed, "articles": articles}
    return [
        [Segment(s.kind, tuple(t % vocab for t in s.token_ids)) for s in segs]
        for _, segs in build_requests(tok, job)
    ]


def workload_stats(requests: list[list[Segment]]) -> dict[str, Any]:
    """Mean tokens, chunks, and reused fraction (chunk tokens of chunks seen before), as in
    the paper's Table 1."""
    seen: set[tuple[int, ...]] = set()
    total = reused = chunks = 0
    for segs in requests:
        for s in segs:
            total += len(s.token_ids)
            if s.kind is SegmentKind.CHUNK:
                chunks += 1
                if s.token_ids in seen:
                    reused += len(s.token_ids)
                seen.add(s.token_ids)
    n = max(1, len(requests))
    return {
        "requests": len(requests),
        "mean_tokens": total / n,
        "mean_chunks": chunks / n,
        "reused_fraction": reused / max(1, total),
        "distinct_chunks": len(seen),
    }
