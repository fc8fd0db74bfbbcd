"""``ascend-mepic bench fidelity-ref``: PIC variants side by side on the same requests, in the
dense transformers reference (no engine), with intervals tight enough to tell them apart.

Per request, full recompute runs once and every chunk's canonical KV is compiled once per
identity (chunk tokens and compile anchor) and shared by every variant and request
(:class:`ascend_mepic.eval.policy_reference.PolicyReference`'s cache). Per variant and dataset it
prints, against full recompute:

* KL(full || variant) of the first token over the full vocabulary (float64), and the top-20
  approximation ``bench fidelity`` reports from the engine (:func:`stats.kl_first_token`);
* first-token top-1 agreement, and answer F1 (greedy, first line) if ``--max-tokens`` > 0;
* each as the paired-bootstrap 95% interval of the difference to ``--baseline`` (today's
  default, ``mepic``: the first 16 tokens of each chunk), resampling requests;
* recomputed chunk tokens, the private stream (prompt tokens plus recomputed chunk tokens; for
  private-placement baselines every prompt token, since they copy each chunk into the request's
  blocks) in tokens and in blocks of 16 and 128, probe tokens, canonical runs (block-table
  entries of chunk KV), and the reference's wall time per request (probe pass included; the
  shared canonical compiles reported apart).

``--openings one apps chat`` serves one sequence of requests over a shared document pool
with openings that differ per scenario and adds what each variant must store (chunk compiles,
copies per document) and the sequence-state variants ``anchor=first|auto``
(:mod:`ascend_mepic.eval.bench.fidelity_pool`).

Per-request records go to ``--jsonl`` as they finish (``--resume`` skips the ones there), so a
long run can be read while it goes; ``--from-jsonl`` renders the table from records alone.
"""

from __future__ import annotations

import argparse
import json
import time
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

from ascend_mepic.core.segments import SegmentKind
from ascend_mepic.entrypoints.streams import data_stream, log

DEFAULT_VARIANTS = (
    "mepic",
    "cacheblend-15",
    "naive",
    "epic-16",
    "mepic+anchor=prefix",
    "mepic+anchor=fixed",
    "naive+anchor=prefix",
    "mepic+pick=q",
    "mepic+pick=q4",
    "mepic+anchor=prefix+pick=q",
    "mepic+anchor=prefix+pick=q4",
    "mepic+anchor=fixed+pick=q4",
)
BLOCK_SIZES = (16, 128)
# The default changes only for a variant within this many more private blocks per request.
MAX_BLOCK_INCREASE = 0.10
FIXED_SYSTEM = "You are a helpful assistant."
METRICS = ("kl", "kl20", "agree", "f1")
_SHARED = ("naive", "mepic", "mepic-block")  # the engine's shared placement (canonical in pool)


def fixed_anchor_ids(tokenizer: Any) -> list[int]:
    """The per-model fixed anchor: the chat template's opening with :data:`FIXED_SYSTEM` as the
    system message, up to where the user's text starts (for SmolLM2: ``<|im_start|>system ...
    <|im_end|>\\n<|im_start|>user\\n``). The same for every deployment of the model."""
    mark = "\x00ANCHOR\x00"
    msgs = [{"role": "system", "content": FIXED_SYSTEM}, {"role": "user", "content": mark}]
    text = tokenizer.apply_chat_template(msgs, tokenize=False, add_generation_prompt=False)
    if mark not in text:
        raise ValueError("the chat template altered the user message; no fixed anchor")
    return list(tokenizer.encode(text.split(mark, 1)[0], add_special_tokens=False))


def check_variants(names: Sequence[str]) -> list[str]:
    """Validate policy / variant names (ValueError naming the bad one); drop duplicates."""
    from ascend_mepic.eval.policy_reference import is_variant, parse_policy, parse_variant

    out = list(dict.fromkeys(n.strip() for n in names))
    for n in out:
        if n == "full":
            raise ValueError("full is the reference every variant is compared with, not a variant")
        parse_variant(n) if is_variant(n) else parse_policy(n)
    return out


def private_stream(name: str, prompt_tokens: int, chunk_tokens: int, recomputed: int) -> int:
    """Tokens in the request's own blocks at prefill: shared placement (MEPIC and its variants)
    holds prompt tokens and private chunk tokens; private placement copies every chunk token."""
    from ascend_mepic.eval.policy_reference import is_variant, parse_policy

    if is_variant(name) or parse_policy(name)[0] in _SHARED:
        return prompt_tokens - chunk_tokens + recomputed
    return prompt_tokens


def _kl_full(p: Any, q: Any) -> float:
    """KL(p || q) from float64 log-prob vectors over the vocabulary."""
    return float((p.exp() * (p - q)).sum())


def _top20(lp: Any) -> dict[int, float]:
    vals, idx = lp.topk(20)
    return {int(i): float(v) for i, v in zip(idx, vals, strict=True)}


def evaluate_request(
    ref: Any,
    tokenizer: Any,
    qa: Any,
    variants: Sequence[str],
    max_tokens: int,
    eos: Sequence[int],
    chunk_anchors: Mapping[str, Sequence[Sequence[int]]] | None = None,
) -> dict[str, Any]:
    """One request under full and every variant: the per-variant record (see module doc).
    ``chunk_anchors``: per variant, each chunk's compile anchor chosen by the caller (anchors
    that depend on the sequence of requests, :mod:`.fidelity_pool`)."""
    from ascend_mepic.eval.bench import stats
    from ascend_mepic.eval.bench.fidelity import answer_text
    from ascend_mepic.eval.policy_reference import is_variant, parse_variant
    from ascend_mepic.eval.squad_metrics import f1

    segs = list(qa.segments)
    t0 = time.perf_counter()
    full = ref.prefill(segs, "full")
    full_s = time.perf_counter() - t0
    # Canonical compiles first (shared by every variant; timed apart), then the probe passes.
    t0 = time.perf_counter()
    given = dict(chunk_anchors or {})
    anchors = {parse_variant(v).anchor for v in variants if is_variant(v) and v not in given}
    plain = any(not is_variant(v) for v in variants) or None in anchors
    chunks = [seg.token_ids for seg in segs if seg.kind is SegmentKind.CHUNK]
    for c, toks in enumerate(chunks):
        if plain:
            ref.canonical_kv(toks)
        for a in anchors - {None}:
            ref.canonical_kv(toks, anchor=ref.anchor_tokens(segs, a))
        for a in dict.fromkeys(tuple(per[c]) for per in given.values()):
            ref.canonical_kv(toks, anchor=a)
    compile_s = time.perf_counter() - t0
    probe_s: dict[str | None, float] = {}
    states, walls = {}, {}
    for v in variants:
        spec = parse_variant(v) if is_variant(v) else None
        extra = 0.0
        if spec is not None and spec.pick is not None:
            if spec.anchor not in probe_s:
                t0 = time.perf_counter()
                ref.question_attention(segs, spec.anchor)
                probe_s[spec.anchor] = time.perf_counter() - t0
            extra = probe_s[spec.anchor]
        t0 = time.perf_counter()
        states[v] = ref.prefill(segs, v, given.get(v))
        walls[v] = time.perf_counter() - t0 + extra
    answers: dict[str, str] = {}
    if max_tokens > 0:
        names = ["full", *variants]
        gens = ref.greedy_batch([full, *(states[v] for v in variants)], max_tokens, list(eos))
        for name, ids in zip(names, gens, strict=True):
            answers[name] = answer_text(tokenizer.decode(ids, skip_special_tokens=True))
    full_lp = full.next_logprobs
    full_top = _top20(full_lp)
    out: dict[str, Any] = {
        "id": qa.id,
        "prompt_tokens": full.prompt_tokens,
        "chunk_tokens": full.chunk_tokens,
        "full_s": full_s,
        "compile_s": compile_s,
        "full_f1": f1(answers["full"], qa.answers) if answers else None,
        "variants": {},
    }
    for v in variants:
        st = states[v]
        lp = st.next_logprobs
        priv = private_stream(v, st.prompt_tokens, st.chunk_tokens, st.recomputed)
        out["variants"][v] = {
            "kl": _kl_full(full_lp, lp),
            "kl20": stats.kl_first_token(full_top, _top20(lp)),
            "agree": float(int(lp.argmax()) == int(full_lp.argmax())),
            "f1": f1(answers[v], qa.answers) if answers else None,
            "answer": answers.get(v),
            "recomputed": st.recomputed,
            "private_tokens": priv,
            **{f"blocks{b}": -(-priv // b) for b in BLOCK_SIZES},
            "probe_tokens": st.probe_tokens,
            "canonical_runs": st.canonical_runs,
            "wall_s": walls[v],
        }
    return out


def summarize(
    records: Sequence[Mapping[str, Any]], variants: Sequence[str], baseline: str, n_boot: int
) -> list[dict[str, Any]]:
    """Per variant: means and the paired-bootstrap 95% interval of (variant - baseline)."""
    from ascend_mepic.eval.squad_metrics import paired_bootstrap

    def col(v: str, key: str) -> list[float]:
        return [r["variants"][v][key] for r in records]

    rows = []
    for v in variants:
        row: dict[str, Any] = {"variant": v, "requests": len(records)}
        for key in (*METRICS, "recomputed", "private_tokens", "probe_tokens", "wall_s",
                    *(f"blocks{b}" for b in BLOCK_SIZES)):  # fmt: skip
            xs = col(v, key)
            if any(x is None for x in xs):
                row[key] = None
                continue
            row[key] = sum(xs) / len(xs)
            if key in METRICS:
                d = paired_bootstrap(col(baseline, key), xs, n=n_boot)
                row[f"{key}_diff"] = [d.mean + 0.0, d.low + 0.0, d.high + 0.0]
        runs = col(v, "canonical_runs")
        row["canonical_runs"] = None if None in runs else sum(runs) / len(runs)
        rows.append(row)
    return rows


def _f(x: float | None, spec: str) -> str:
    return "n/a" if x is None else format(x, spec)


def _diff(row: Mapping[str, Any], key: str, scale: float, spec: str) -> str:
    d = row.get(f"{key}_diff")
    if d is None:
        return "n/a"
    m, lo, hi = (scale * x for x in d)
    return f"{m:+{spec}} [{lo:+{spec}}, {hi:+{spec}}]"


def render(
    rows: Sequence[Mapping[str, Any]], header: str, baseline: str, reference: str | None
) -> str:
    """One dataset's table: metric means, differences to the baseline with 95% intervals."""
    base = next(r for r in rows if r["variant"] == baseline)
    ref_kl = next((r["kl"] for r in rows if r["variant"] == reference), None)
    lines = [
        header,
        "",
        f"| variant | KL | ΔKL vs {baseline} [95% CI] | KL / {reference or 'n/a'} | KL top-20 "
        f"| ΔKL top-20 [95% CI] | top-1 | Δtop-1 (pts) [95% CI] | F1 | ΔF1 (pts) [95% CI] "
        "| recomputed/req | private tok/req | blocks/req @16 (x) | blocks/req @128 (x) "
        "| probe tok/req | canon runs/req | ms/req |",
        "|" + "---|" * 17,
    ]
    for r in rows:
        ratio = f"{r['kl'] / ref_kl:.2f}x" if ref_kl else "n/a"
        blocks = [
            f"{r[f'blocks{b}']:.2f} ({r[f'blocks{b}'] / base[f'blocks{b}']:.2f})"
            for b in BLOCK_SIZES
        ]
        f1 = None if r["f1"] is None else 100 * r["f1"]
        lines.append(
            f"| {r['variant']} | {r['kl']:.4f} | {_diff(r, 'kl', 1, '.4f')} | {ratio} "
            f"| {r['kl20']:.4f} | {_diff(r, 'kl20', 1, '.4f')} | {100 * r['agree']:.1f}% "
            f"| {_diff(r, 'agree', 100, '.1f')} | {_f(f1, '.1f')} | {_diff(r, 'f1', 100, '.1f')} "
            f"| {r['recomputed']:.1f} | {r['private_tokens']:.1f} | {blocks[0]} | {blocks[1]} "
            f"| {r['probe_tokens']:.1f} | {_f(r['canonical_runs'], '.1f')} "
            f"| {1000 * r['wall_s']:.0f} |"
        )
    return "\n".join(lines) + "\n"


def verdicts(
    by_dataset: Mapping[str, Sequence[Mapping[str, Any]]], baseline: str, reference: str | None
) -> list[str]:
    """Which variants beat the baseline's KL on every dataset (interval below 0) within
    :data:`MAX_BLOCK_INCREASE` more private blocks at every block size, and whether they reach
    ``reference``'s KL (point estimate)."""
    names = [r["variant"] for r in next(iter(by_dataset.values()))]
    lines = []
    for v in names:
        if v == baseline:
            continue
        beats, cheap, reaches = True, True, True
        for rows in by_dataset.values():
            r = next(x for x in rows if x["variant"] == v)
            base = next(x for x in rows if x["variant"] == baseline)
            beats &= r["kl_diff"][2] < 0
            cheap &= all(
                r[f"blocks{b}"] <= (1 + MAX_BLOCK_INCREASE) * base[f"blocks{b}"]
                for b in BLOCK_SIZES
            )
            ref = next((x for x in rows if x["variant"] == reference), None)
            reaches &= ref is not None and r["kl"] <= ref["kl"]
        if beats and cheap:
            tail = f"; reaches {reference}'s KL on every set" if reaches else (
                f"; above {reference}'s KL on some set" if reference else "")  # fmt: skip
            lines.append(
                f"{v}: beats {baseline} (KL interval below 0 on every set) at <= "
                f"{MAX_BLOCK_INCREASE:.0%} more private blocks{tail}"
            )
    if not lines:
        lines.append(f"no variant beats {baseline} on every set within the block budget")
    return lines


def _load_records(path: Path) -> list[dict[str, Any]]:
    if not path.is_file():
        return []
    return [json.loads(x) for x in path.read_text(encoding="utf-8").splitlines() if x.strip()]


def cmd_fidelity_ref(args: argparse.Namespace) -> int:
    try:
        variants = check_variants(args.variants or DEFAULT_VARIANTS)
        if args.baseline not in variants:
            variants.insert(0, check_variants([args.baseline])[0])
    except ValueError as e:
        raise SystemExit(f"bench fidelity-ref: {e}") from e
    for d in args.datasets:
        from ascend_mepic.eval.multidoc import DATASETS

        if d not in DATASETS:
            raise SystemExit(f"bench fidelity-ref: unknown dataset {d!r}; accepted: {DATASETS}")
    if args.questions < 1:
        raise SystemExit("bench fidelity-ref: --questions must be >= 1")
    from ascend_mepic.eval.bench import fidelity_pool
    from ascend_mepic.eval.policy_reference import SEQUENCE_ANCHORS, is_variant, parse_variant

    stateful = [v for v in variants if is_variant(v) and parse_variant(v).anchor in
                SEQUENCE_ANCHORS]  # fmt: skip
    if stateful and not args.openings and not args.from_jsonl:
        raise SystemExit(f"bench fidelity-ref: {stateful[0]} needs a sequence (--openings)")
    if args.from_jsonl:
        records = _load_records(Path(args.from_jsonl))
        if not records:
            raise SystemExit(f"bench fidelity-ref: no records in {args.from_jsonl}")
        if "scenario" in records[0]:
            return fidelity_pool.report(args, records, variants, model_path=None)
        return _report(args, records, variants, model_path=None)
    if args.openings:
        bad = [d for d in args.datasets if d not in ("squad", "multidoc")]
        if bad:
            raise SystemExit(f"bench fidelity-ref: --openings serves squad, multidoc: not {bad[0]}")
        return fidelity_pool.run(args, variants)

    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from ascend_mepic.eval.multidoc import build
    from ascend_mepic.eval.policy_reference import PolicyReference
    from ascend_mepic.eval.prepare import resolve_model

    torch.set_num_threads(args.threads)
    path = resolve_model(args.model)
    tok = AutoTokenizer.from_pretrained(str(path))
    model = AutoModelForCausalLM.from_pretrained(str(path), dtype=getattr(torch, args.dtype))
    ref = PolicyReference(
        model, 16, dummy_token_id=tok.bos_token_id, cache_size=args.cache_chunks,
        fixed_anchor=fixed_anchor_ids(tok),
    )  # fmt: skip
    gen_eos = model.generation_config.eos_token_id
    gen_eos = gen_eos if isinstance(gen_eos, list) else [gen_eos]
    eos = sorted({int(e) for e in (tok.eos_token_id, *gen_eos) if e is not None})
    out = Path(args.jsonl) if args.jsonl else None
    done = {(r["dataset"], r["id"]) for r in _load_records(out)} if out and args.resume else set()
    if out and not args.resume:
        out.parent.mkdir(parents=True, exist_ok=True)
        out.write_text("", encoding="utf-8")
    records: list[dict[str, Any]] = [r for r in _load_records(out) if args.resume] if out else []
    for d in args.datasets:
        chunks = args.docs if d == "multidoc" else args.chunks
        reqs = build(d, tok, args.questions, chunks, args.seed, args.articles)
        log(f"[fidelity-ref] {d}: {len(reqs)} requests, {len(variants)} variants")
        started = time.perf_counter()
        for i, qa in enumerate(reqs):
            if (d, qa.id) in done:
                continue
            rec = {"dataset": d, **evaluate_request(ref, tok, qa, variants, args.max_tokens, eos)}
            records.append(rec)
            if out:
                with out.open("a", encoding="utf-8") as f:
                    f.write(json.dumps(rec) + "\n")
            if (i + 1) % args.log_every == 0 or i + 1 == len(reqs):
                per = (time.perf_counter() - started) / (i + 1)
                log(f"[fidelity-ref] {d}: {i + 1}/{len(reqs)} ({per:.1f} s/request)")
    return _report(args, records, variants, model_path=str(path))


def _report(
    args: argparse.Namespace,
    records: Sequence[Mapping[str, Any]],
    variants: Sequence[str],
    model_path: str | None,
) -> int:
    reference = "cacheblend-15" if "cacheblend-15" in variants else None
    by_dataset: dict[str, list[dict[str, Any]]] = {}
    text = []
    for d in dict.fromkeys(r["dataset"] for r in records):
        recs = [r for r in records if r["dataset"] == d]
        missing = [v for v in variants if v not in recs[0]["variants"]]
        if missing:
            raise SystemExit(f"bench fidelity-ref: {d} records lack {', '.join(missing)}")
        rows = summarize(recs, variants, args.baseline, args.bootstrap)
        by_dataset[d] = rows

        def mean(k: str, recs: Sequence[Mapping[str, Any]] = recs) -> float:
            return sum(r[k] for r in recs) / len(recs)

        full_f1 = [r["full_f1"] for r in recs if r["full_f1"] is not None]
        header = (
            f"### {d}: {len(recs)} requests, mean {mean('prompt_tokens'):.0f} prompt tokens "
            f"({mean('chunk_tokens'):.0f} in chunks); full recompute "
            f"{1000 * mean('full_s'):.0f} ms/req, canonical compiles {1000 * mean('compile_s'):.0f}"
            f" ms/req (shared by all variants)"
            + (f", full F1 {100 * sum(full_f1) / len(full_f1):.1f}" if full_f1 else "")
        )
        text.append(render(rows, header, args.baseline, reference))
    lines = verdicts(by_dataset, args.baseline, reference) if len(by_dataset) else []
    notes = (
        "KL: KL(full || variant) of the first token over the full vocabulary (float64); KL "
        "top-20: bench fidelity's approximation. Δ: variant - baseline, paired bootstrap over "
        f"requests ({args.bootstrap} resamples), 95% percentile interval. Private tokens: the "
        "request's own blocks at prefill (prompt + recomputed chunk tokens; private placement: "
        "all prompt tokens); (x): ratio to the baseline. ms/req: this reference's prefill "
        "(probe included), float64 attention on CPU; not the engine's TTFT."
    )
    data_stream().write("\n".join([*text, *lines, "", notes]) + "\n")
    if args.json:
        p = Path(args.json)
        p.parent.mkdir(parents=True, exist_ok=True)
        cfg = {k: v for k, v in vars(args).items() if k != "func"}
        p.write_text(
            json.dumps({"config": {**cfg, "model_path": model_path}, "tables": by_dataset,
                        "verdicts": lines}, indent=1) + "\n",
            encoding="utf-8",
        )  # fmt: skip
    return 0


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.description = (
        "PIC variants (policies and issue 65's anchor / question-attention / APE options) on the "
        "same requests in the transformers reference: KL to full recompute, top-1, F1 with "
        "paired-bootstrap intervals against the baseline, private tokens and blocks per request."
    )
    p.add_argument("--model", default="smollm2", help="model folder, or smollm2 / tiny")
    p.add_argument(
        "--variants",
        nargs="+",
        help=f"policies or variants (default: {' '.join(DEFAULT_VARIANTS)})",
    )
    p.add_argument("--baseline", default="mepic", help="the variant differences are taken to")
    p.add_argument(
        "--datasets", nargs="+", default=["squad", "multidoc"],
        help="squad, multidoc (synthetic), hotpot (independent check only)",
    )  # fmt: skip
    p.add_argument("--questions", type=int, default=200, help="requests per dataset")
    p.add_argument("--chunks", type=int, default=4, help="paragraphs per request (squad, hotpot)")
    p.add_argument("--docs", type=int, default=6, help="documents per request (multidoc)")
    p.add_argument("--articles", type=int, help="squad: a hot set of this many articles (all; "
                   "with --openings 8)")  # fmt: skip
    p.add_argument(
        "--openings", nargs="+", choices=["one", "apps", "chat"],
        help="shared-pool mode: documents shared by requests whose openings differ (one system "
        "prompt; 4 apps; a chat turn per request); adds compiles and copies per document, and "
        "the variants anchor=first and anchor=auto",
    )  # fmt: skip
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--max-tokens", type=int, default=16, help="greedy answer tokens (0: no F1)")
    p.add_argument("--bootstrap", type=int, default=2000, help="bootstrap resamples")
    p.add_argument("--threads", type=int, default=1, help="torch threads")
    p.add_argument("--dtype", choices=["float32", "float64"], default="float32")
    p.add_argument("--cache-chunks", type=int, default=4096, help="canonical chunk cache size")
    p.add_argument("--jsonl", help="append per-request records here as they finish")
    p.add_argument("--resume", action="store_true", help="skip requests already in --jsonl")
    p.add_argument("--from-jsonl", help="render the tables from these records only (no model)")
    p.add_argument("--json", help="write config, tables and verdicts here")
    p.add_argument("--log-every", type=int, default=10)
    p.set_defaults(func=cmd_fidelity_ref)
