"""``bench fidelity-ref --openings``: fidelity when documents are shared by requests whose
openings differ, and what each variant must store for it (issue 75).

An anchored compile (``anchor=prefix``) is only reusable by requests with the same opening
(everything before the first document); with many openings a document needs many copies, which
is the memory MEPIC exists to save. This mode serves one sequence of requests over a shared
document pool (SQuAD: the paragraphs of ``--articles`` hot articles; multidoc: its 48-document
pool) under one or more *scenarios* of openings:

* ``one``: one system prompt for every request (the prompt of ``bench fidelity-ref``);
* ``apps``: four apps, each with its own system message; request i is app i % 4's;
* ``chat``: every request opens with its own earlier chat turn (system message, then an earlier
  question and answer unique to the request) before the turn with the documents.

Per variant and scenario it prints, besides KL / top-1 / F1 against full recompute with
paired-bootstrap intervals, the chunk compiles (distinct canonical identities the variant read
over the sequence: what one engine with an unbounded pool would hold, one entry per identity),
the distinct documents, copies per document and the canonical KV held (tokens, blocks of 16).

Two variants carry state across the sequence (their anchors are planned here, before any model
work, by :func:`plan_anchors`, and reach the reference as ``chunk_anchors``):

* ``mepic+anchor=first``: a document is compiled after the opening of the first request that
  read it; later requests, whatever their opening, read that one copy;
* ``mepic+anchor=auto``: ``anchor=prefix`` until a document is first read under an opening other
  than the one it was compiled after; from that request on, every chunk unanchored (``mepic``);
* ``mepic+anchor=engine``: the engine's default (``chunk_anchor: first``): every chunk compiled
  after the opening of the sequence's first request, whatever opens the request reading it.

Anchors are the opening's first :data:`ANCHOR_MAX_TOKENS` tokens, as the engine cuts them.
Scenarios and datasets are interleaved request by request, so a run stopped early (``--jsonl``
keeps every record) covers each one equally.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import random
import time
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

from ascend_mepic.core.segments import Segment, SegmentKind
from ascend_mepic.entrypoints.streams import data_stream, log
from ascend_mepic.eval.reference_math import opening

OPENINGS = ("one", "apps", "chat")
ANCHOR_MAX_TOKENS = 256  # the engine's DEFAULT_ANCHOR_MAX_TOKENS
BLOCK = 16
DEFAULT_ARTICLES = 8
COPIES_BUDGET = 1.25  # the verdict's "about one copy per document"
APP_SYSTEMS = (
    "You are the customer-support assistant of Northwind Books, an online bookshop. Answer "
    "customers politely and only from the documents you are given.",
    "You are a research assistant for a university library. Be precise, neutral and brief, and "
    "rely strictly on the supplied sources.",
    "You are QuickFind, the question-answering bot of a company intranet search page. Give the "
    "shortest correct answer you can find in the retrieved passages.",
    "You are a friendly tutor helping secondary-school students revise. Answer from the reading "
    "material, in words a student would understand.",
)


def _digest(tokens: Sequence[int]) -> str:
    """A short stable hash of token ids (records hold identities, not the tokens)."""
    return hashlib.sha1(",".join(map(str, tokens)).encode()).hexdigest()[:16] if tokens else ""


# -- requests -------------------------------------------------------------------------------


def _squad_items(
    n: int, chunks: int, seed: int, articles: int
) -> tuple[list[tuple[str, str, tuple[str, ...], list[str]]], list[tuple[str, str]]]:
    """SQuAD requests over a hot article set, and ``n`` earlier turns: other SQuAD questions
    (outside the requests) with their first answer."""
    from ascend_mepic.eval.trace import load_squad, squad_requests

    items = [
        (q.id, q.question, q.answers, paras)
        for q, paras in squad_requests(n, chunks, seed, articles)
    ]
    used = {i for i, *_ in items}
    _, questions = load_squad()
    others = [q for q in questions if q.id not in used]
    rng = random.Random(f"chat-turns:{seed}")
    turns = [(q.question, q.answers[0]) for q in rng.sample(others, n)]
    return items, turns


def _multidoc_items(
    n: int, chunks: int, seed: int
) -> tuple[list[tuple[str, str, tuple[str, ...], list[str]]], list[tuple[str, str]]]:
    from ascend_mepic.eval.multidoc import multidoc_chat_turns, multidoc_items

    items = [(i, q, (a,), docs) for i, q, a, docs in multidoc_items(n, chunks, seed)]
    return items, multidoc_chat_turns(n, seed)


def pool_requests(
    tokenizer: Any,
    dataset: str,
    scenario: str,
    n: int,
    chunks: int,
    seed: int = 0,
    articles: int = DEFAULT_ARTICLES,
) -> list[Any]:
    """The dataset's sequence of requests (the same documents and questions in every scenario)
    with the scenario's openings, as :class:`ascend_mepic.eval.multidoc.QA`. Built through the
    chat template (:func:`ascend_mepic.eval.squad_prompts.chat_segments`, which checks that the
    pieces concatenate to the template's rendering): the opening is one PROMPT segment."""
    from ascend_mepic.eval.multidoc import QA
    from ascend_mepic.eval.squad_prompts import SYSTEM_MESSAGE, chat_segments

    if scenario not in OPENINGS:
        raise ValueError(f"unknown openings {scenario!r}; accepted: {', '.join(OPENINGS)}")
    if dataset == "squad":
        items, turns = _squad_items(n, chunks, seed, articles)
    elif dataset == "multidoc":
        items, turns = _multidoc_items(n, chunks, seed)
    else:
        raise ValueError(f"--openings serves squad and multidoc (a shared pool), not {dataset!r}")
    out = []
    for i, (qid, question, answers, docs) in enumerate(items):
        system, history = SYSTEM_MESSAGE, ()
        if scenario == "apps":
            system = APP_SYSTEMS[i % len(APP_SYSTEMS)]
        elif scenario == "chat":
            history = (turns[i],)
        segs = chat_segments(tokenizer, question, docs, system, history)
        if sum(s.kind is not SegmentKind.CHUNK for s in segs[: 1 + len(docs)]) != 1:
            raise ValueError("the opening must be one PROMPT segment before the documents")
        out.append(QA(qid, question, tuple(answers), tuple(segs)))
    return out


# -- sequence state: anchors and identities --------------------------------------------------


def reads_canonical(name: str, n_tokens: int) -> bool:
    """Whether ``name`` reads a chunk of ``n_tokens`` from its canonical entry (a MEPIC chunk
    of at most K tokens is all private and needs none)."""
    from ascend_mepic.eval.policy_reference import is_variant, parse_policy, parse_variant

    if is_variant(name):
        return n_tokens > parse_variant(name).k
    kind, arg = parse_policy(name)
    if kind == "mepic":
        return n_tokens > (16 if arg is None else arg)
    if kind == "mepic-block":
        return n_tokens > BLOCK
    return kind != "full"


def plan_anchors(
    requests: Sequence[Sequence[Segment]],
    variants: Sequence[str],
    fixed_anchor: Sequence[int] = (),
) -> tuple[list[dict[str, list[tuple[int, ...]]]], int | None]:
    """Per request, per variant, each chunk's compile anchor over the sequence, and the index
    of the request from which ``anchor=auto`` compiles unanchored (None: it never switched).

    Needs no model: the anchors follow from the openings and documents alone, so a resumed run
    replays them."""
    from ascend_mepic.eval.policy_reference import is_variant, parse_variant

    kinds = {v: parse_variant(v).anchor if is_variant(v) else None for v in variants}
    first: dict[tuple[int, ...], tuple[int, ...]] = {}
    compiled_after: dict[tuple[int, ...], tuple[int, ...]] = {}
    switched: int | None = None
    engine: tuple[int, ...] = ()  # the first opening (``chunk_anchor: first``)
    out = []
    for i, segs in enumerate(requests):
        own = opening(segs)[:ANCHOR_MAX_TOKENS]
        engine = engine or own
        docs = [s.token_ids for s in segs if s.kind is SegmentKind.CHUNK]
        if switched is None and any(compiled_after.get(d, own) != own for d in docs):
            switched = i
        if switched is None:
            for d in docs:
                compiled_after.setdefault(d, own)
        plan: dict[str, list[tuple[int, ...]]] = {}
        for v, kind in kinds.items():
            if kind == "prefix":
                plan[v] = [own] * len(docs)
            elif kind == "fixed":
                plan[v] = [tuple(fixed_anchor)] * len(docs)
            elif kind == "first":
                plan[v] = [first.setdefault(d, own) for d in docs]
            elif kind == "engine":
                plan[v] = [engine] * len(docs)
            elif kind == "auto":
                plan[v] = [() if switched is not None else own] * len(docs)
            else:
                plan[v] = [()] * len(docs)
        out.append(plan)
    return out, switched


def identities(
    segments: Sequence[Segment], plan: Mapping[str, Sequence[tuple[int, ...]]]
) -> dict[str, list[str | None]]:
    """Per variant, per chunk, the canonical identity it reads (``doc:anchor`` digests; None
    where the chunk is all private)."""
    docs = [s.token_ids for s in segments if s.kind is SegmentKind.CHUNK]
    return {
        v: [
            f"{_digest(d)}:{_digest(a)}" if reads_canonical(v, len(d)) else None
            for d, a in zip(docs, anchors, strict=True)
        ]
        for v, anchors in plan.items()
    }


# -- tables ---------------------------------------------------------------------------------


def pool_stats(records: Sequence[Mapping[str, Any]], variant: str) -> dict[str, float]:
    """Compiles (distinct identities), distinct documents, copies and reads per document and
    canonical KV (tokens, blocks of :data:`BLOCK`) over a sequence's records."""
    lengths = {d: n for r in records for d, n in r["docs"]}
    ids = {i for r in records for i in r["variants"][variant]["identities"] if i is not None}
    docs = len(lengths)
    reads = sum(len(r["docs"]) for r in records)
    tokens = sum(lengths[i.split(":")[0]] for i in ids)
    blocks = sum(-(-lengths[i.split(":")[0]] // BLOCK) for i in ids)
    return {
        "compiles": len(ids),
        "docs": docs,
        "copies": len(ids) / docs if docs else 0.0,
        "reads": reads / docs if docs else 0.0,
        "canon_tokens": tokens,
        "canon_blocks": blocks,
    }


def summarize_pool(
    records: Sequence[Mapping[str, Any]],
    variants: Sequence[str],
    baseline: str,
    reference: str | None,
    n_boot: int,
) -> list[dict[str, Any]]:
    """:func:`fidelity_ref.summarize` plus the pool columns and, with a ``reference``, the
    paired interval of KL against it."""
    from ascend_mepic.eval.bench.fidelity_ref import summarize
    from ascend_mepic.eval.squad_metrics import paired_bootstrap

    rows = summarize(records, variants, baseline, n_boot)
    for row in rows:
        v = row["variant"]
        row.update(pool_stats(records, v))
        if reference is not None:
            ref = [r["variants"][reference]["kl"] for r in records]
            d = paired_bootstrap(ref, [r["variants"][v]["kl"] for r in records], n=n_boot)
            row["kl_vs_ref"] = [d.mean + 0.0, d.low + 0.0, d.high + 0.0]
    return rows


def render_pool(
    rows: Sequence[Mapping[str, Any]], header: str, baseline: str, reference: str | None
) -> str:
    """One (dataset, scenario) table: fidelity with intervals, then what the pool holds."""
    from ascend_mepic.eval.bench.fidelity_ref import _diff, _f

    ref_kl = next((r["kl"] for r in rows if r["variant"] == reference), None)
    lines = [
        header,
        "",
        f"| variant | KL | ΔKL vs {baseline} [95% CI] | KL / {reference or 'n/a'} "
        f"| ΔKL vs {reference or 'n/a'} [95% CI] | top-1 | Δtop-1 (pts) [95% CI] | F1 "
        "| ΔF1 (pts) [95% CI] | chunk compiles | distinct docs | copies/doc | canonical KV tok "
        "| canonical blocks @16 | private blocks/req @16 |",
        "|" + "---|" * 15,
    ]
    for r in rows:
        ratio = f"{r['kl'] / ref_kl:.2f}x" if ref_kl else "n/a"
        f1 = None if r["f1"] is None else 100 * r["f1"]
        lines.append(
            f"| {r['variant']} | {r['kl']:.4f} | {_diff(r, 'kl', 1, '.4f')} | {ratio} "
            f"| {_diff({'x_diff': r.get('kl_vs_ref')}, 'x', 1, '.4f')} "
            f"| {100 * r['agree']:.1f}% | {_diff(r, 'agree', 100, '.1f')} | {_f(f1, '.1f')} "
            f"| {_diff(r, 'f1', 100, '.1f')} | {r['compiles']} | {r['docs']} "
            f"| {r['copies']:.2f} | {r['canon_tokens']} | {r['canon_blocks']} "
            f"| {r['blocks16']:.2f} |"
        )
    return "\n".join(lines) + "\n"


def pool_verdicts(
    tables: Mapping[str, Sequence[Mapping[str, Any]]], reference: str | None
) -> list[str]:
    """Variants at <= :data:`COPIES_BUDGET` copies per document in every table and, with a
    reference, at or below its KL (point estimate) in every table."""
    names = [r["variant"] for r in next(iter(tables.values()))]
    lines = []
    for v in names:
        if v == reference:
            continue
        rows = [(next(x for x in t if x["variant"] == v), t) for t in tables.values()]
        cheap = all(r["copies"] <= COPIES_BUDGET for r, _ in rows)
        at_ref = reference is not None and all(
            r["kl"] <= next(x["kl"] for x in t if x["variant"] == reference) for r, t in rows
        )
        worst = max(r["copies"] for r, _ in rows)
        kl = "" if reference is None else (
            f"; <= {reference}'s KL in every table" if at_ref
            else f"; above {reference}'s KL in some table")  # fmt: skip
        if cheap:
            lines.append(f"{v}: <= {COPIES_BUDGET} copies/doc in every table{kl}")
        else:
            lines.append(f"{v}: up to {worst:.2f} copies/doc{kl}")
    return lines


def report(
    args: argparse.Namespace,
    records: Sequence[Mapping[str, Any]],
    variants: Sequence[str],
    model_path: str | None,
) -> int:
    """Tables per (dataset, scenario), a copies/KL overview and the verdicts, to stdout."""
    reference = "cacheblend-15" if "cacheblend-15" in variants else None
    tables: dict[str, list[dict[str, Any]]] = {}
    text = []
    keys = dict.fromkeys((r["dataset"], r["scenario"]) for r in records)
    for d, s in keys:
        recs = sorted(
            (r for r in records if (r["dataset"], r["scenario"]) == (d, s)),
            key=lambda r: r["index"],
        )
        missing = [v for v in variants if v not in recs[0]["variants"]]
        if missing:
            raise SystemExit(f"bench fidelity-ref: {d}/{s} records lack {', '.join(missing)}")
        rows = summarize_pool(recs, variants, args.baseline, reference, args.bootstrap)
        tables[f"{d}/{s}"] = rows
        switch = next((r["index"] for r in recs if r.get("auto_unanchored")), None)
        n = len(recs)
        op = [r["opening_tokens"] for r in recs]
        auto = any(v.endswith("anchor=auto") or "anchor=auto+" in v for v in variants)
        header = (
            f"### {d}, openings {s}: {n} requests, {len({r['opening'] for r in recs})} distinct "
            f"openings ({min(op)}-{max(op)} tokens), mean "
            f"{sum(r['prompt_tokens'] for r in recs) / n:.0f} prompt tokens, "
            f"{rows[0]['docs']} distinct documents read {rows[0]['reads']:.2f} times each"
            + ("" if not auto else "; anchor=auto never switched" if switch is None
               else f"; anchor=auto unanchored from request {switch}")  # fmt: skip
        )
        text.append(render_pool(rows, header, args.baseline, reference))
    head = "| variant | " + " | ".join(tables) + " |"
    over = [
        "### Overview: KL / " + (reference or "n/a") + ", copies per document",
        "",
        head,
        "|" + "---|" * (len(tables) + 1),
    ]
    for v in variants:
        cells = []
        for rows in tables.values():
            r = next(x for x in rows if x["variant"] == v)
            ref_kl = next((x["kl"] for x in rows if x["variant"] == reference), None)
            ratio = f"{r['kl'] / ref_kl:.2f}x" if ref_kl else "n/a"
            cells.append(f"{ratio}, {r['copies']:.2f}")
        over.append(f"| {v} | " + " | ".join(cells) + " |")
    lines = pool_verdicts(tables, reference)
    notes = (
        "Chunk compiles: distinct canonical identities (document, compile anchor) the variant "
        "read over the sequence, i.e. the entries of one engine with an unbounded pool; copies/"
        "doc = compiles / distinct documents; canonical KV: the compiled documents' tokens (the "
        "anchor is not stored) and blocks of 16. cacheblend-15 reads unanchored entries and "
        "also copies every chunk token into each request's blocks (private blocks/req). "
        f"Δ: paired bootstrap over requests ({args.bootstrap} resamples), 95% interval."
    )
    data_stream().write("\n".join([*text, *over, "", *lines, "", notes]) + "\n")
    if args.json:
        p = Path(args.json)
        p.parent.mkdir(parents=True, exist_ok=True)
        cfg = {k: v for k, v in vars(args).items() if k != "func"}
        p.write_text(
            json.dumps({"config": {**cfg, "model_path": model_path}, "tables": tables,
                        "verdicts": lines}, indent=1) + "\n",
            encoding="utf-8",
        )  # fmt: skip
    return 0


# -- the run ---------------------------------------------------------------------------------


def run(args: argparse.Namespace, variants: Sequence[str]) -> int:
    """Serve each (dataset, scenario) sequence through one reference, interleaved by request."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from ascend_mepic.eval.bench.fidelity_ref import (
        _load_records,
        evaluate_request,
        fixed_anchor_ids,
    )
    from ascend_mepic.eval.policy_reference import PolicyReference, is_variant, parse_variant
    from ascend_mepic.eval.prepare import resolve_model

    torch.set_num_threads(args.threads)
    path = resolve_model(args.model)
    tok = AutoTokenizer.from_pretrained(str(path))
    model = AutoModelForCausalLM.from_pretrained(str(path), dtype=getattr(torch, args.dtype))
    fixed = fixed_anchor_ids(tok)
    ref = PolicyReference(
        model, BLOCK, dummy_token_id=tok.bos_token_id, cache_size=args.cache_chunks,
        fixed_anchor=fixed,
    )  # fmt: skip
    gen_eos = model.generation_config.eos_token_id
    gen_eos = gen_eos if isinstance(gen_eos, list) else [gen_eos]
    eos = sorted({int(e) for e in (tok.eos_token_id, *gen_eos) if e is not None})
    # Variants whose anchors this harness chooses (the engine's 256-token cut, sequence state).
    given = [v for v in variants if is_variant(v) and parse_variant(v).anchor
             in ("prefix", "first", "auto", "engine")]  # fmt: skip
    seqs = {}
    for d in args.datasets:
        chunks = args.docs if d == "multidoc" else args.chunks
        for s in args.openings:
            reqs = pool_requests(tok, d, s, args.questions, chunks, args.seed,
                                 args.articles or DEFAULT_ARTICLES)  # fmt: skip
            plans, switch = plan_anchors([q.segments for q in reqs], variants, fixed)
            seqs[(d, s)] = (reqs, plans, switch)
            log(f"[fidelity-pool] {d}/{s}: {len(reqs)} requests, {len(variants)} variants, "
                f"anchor=auto unanchored from request {switch}")  # fmt: skip
    out = Path(args.jsonl) if args.jsonl else None
    old = _load_records(out) if out and args.resume else []
    done = {(r["dataset"], r["scenario"], r["id"]) for r in old}
    if out and not args.resume:
        out.parent.mkdir(parents=True, exist_ok=True)
        out.write_text("", encoding="utf-8")
    records: list[dict[str, Any]] = list(old)
    started, count = time.perf_counter(), 0
    for i in range(max(len(r) for r, _, _ in seqs.values())):
        for (d, s), (reqs, plans, switch) in seqs.items():
            if i >= len(reqs) or (d, s, reqs[i].id) in done:
                continue
            qa, plan = reqs[i], plans[i]
            segs = list(qa.segments)
            op = opening(segs)
            anchors = {v: plan[v] for v in given}
            rec = {
                "dataset": d,
                "scenario": s,
                "index": i,
                "opening": _digest(op),
                "opening_tokens": len(op),
                "docs": [[_digest(x.token_ids), len(x.token_ids)] for x in segs
                         if x.kind is SegmentKind.CHUNK],  # fmt: skip
                "auto_unanchored": switch is not None and i >= switch,
                **evaluate_request(ref, tok, qa, variants, args.max_tokens, eos, anchors),
            }
            for v, ids in identities(segs, plan).items():
                rec["variants"][v]["identities"] = ids
            records.append(rec)
            if out:
                with out.open("a", encoding="utf-8") as f:
                    f.write(json.dumps(rec) + "\n")
            count += 1
        if (i + 1) % args.log_every == 0:
            per = (time.perf_counter() - started) / max(count, 1)
            log(f"[fidelity-pool] request {i + 1} of every sequence done ({per:.1f} s/request)")
    return report(args, records, variants, str(path))
