"""``ascend-mepic bench fidelity``: does a PIC policy keep *this* model's answers?

Run it before turning MEPIC on for a new model. It sends the bundled SQuAD v2 questions (each
prompt: the gold paragraph among same-article distractors, every paragraph a chunk, in the
model's chat template) through full recompute and through each chosen policy, one engine per
policy in its own subprocess (:func:`ascend_mepic.eval.bench.runner.run_in_subprocess`, so each
engine's memory is freed before the next starts), greedy, every request submitted at once. Per
policy it prints, against ``full`` on the same questions:

* first-token top-1 agreement: the share of questions whose first generated token is full's,
  with a bootstrap 95% CI over the questions;
* KL(full || policy) of the first-token distribution, from vLLM's top-20 logprobs (the
  approximation of :func:`ascend_mepic.eval.bench.stats.kl_first_token`: full's top-20 support
  plus one tail bucket; an exact full-vocabulary KL would need the engine to return every
  logprob of every request, which vLLM caps at ``max_logprobs``);
* answer F1 (SQuAD normalization, first line of the answer) and its drop vs full, with a paired
  bootstrap 95% CI over the questions;

and one verdict line per policy from two named thresholds (:data:`MIN_TOP1_AGREEMENT`,
:data:`MAX_F1_DROP`). On random-weight models it is only a smoke test; its use is on real weights.
"""

from __future__ import annotations

import argparse
import json
import time
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

from ascend_mepic.entrypoints.streams import data_stream, log
from ascend_mepic.eval.bench import stats

DEFAULT_POLICIES = ("mepic", "epic-16", "cacheblend-15", "naive")
# A policy is "safe to turn on" when its first token is full's on at least this share of
# questions (a flipped first token usually means a different answer) ...
MIN_TOP1_AGREEMENT = 0.90
# ... and its answer F1 is at most this far below full's (F1 in [0, 1]; 0.05 = 5 points).
MAX_F1_DROP = 0.05
# Below this many questions a verdict is flagged as indicative: agreement and F1 drop carry
# sampling noise of several points.
MIN_QUESTIONS = 30
RERUN = "full (rerun)"  # the label of ``full`` listed among the policies: a determinism check
LOGPROBS = 20  # vLLM's default max_logprobs


def answer_text(text: str) -> str:
    """The answer's first line: a chat model may go on after the short answer it was asked for."""
    return text.strip().split("\n", 1)[0].strip()


def _job(args: argparse.Namespace, model: str, policy: str) -> dict[str, Any]:
    return {
        "policy": policy,
        "model": model,
        "requests": args.questions,
        "chunks": args.chunks,
        "seed": args.seed,
        "articles": args.articles,
        "block_size": args.block_size,
        "max_tokens": args.max_tokens,
        "qps": 0.0,  # every question at once: fidelity does not depend on arrival times
        "kv_gib": args.kv_gib,
        "logprobs": LOGPROBS,
        "progress": not args.no_progress,
    }


def _per_question(raw: Mapping[str, Any], full_raw: Mapping[str, Any]) -> list[dict[str, Any]]:
    """Per question: the answer, its F1, and the first token's agreement and KL vs full."""
    from ascend_mepic.eval.squad_metrics import f1

    by_idx = {r["index"]: r for r in full_raw["per_request"]}
    out = []
    for r in sorted(raw["per_request"], key=lambda r: r["index"]):
        ref = by_idx[r["index"]]
        answer = answer_text(r.get("text") or "")
        row: dict[str, Any] = {
            "index": r["index"],
            "answers": r["answers"],
            "answer": answer,
            "f1": f1(answer, r["answers"]),
            "first_token": r.get("first_token"),
            "agree": None,
            "kl": None,
        }
        if r.get("first_token") is not None and ref.get("first_token") is not None:
            full_lp = {int(k): float(v) for k, v in ref["top_logprobs"].items()}
            pol_lp = {int(k): float(v) for k, v in r["top_logprobs"].items()}
            row["agree"] = float(r["first_token"] == ref["first_token"])
            row["kl"] = stats.kl_first_token(full_lp, pol_lp)
        out.append(row)
    return out


def _mean(xs: Sequence[float | None]) -> float | None:
    vals = [x for x in xs if x is not None]
    return sum(vals) / len(vals) if vals else None


def policy_row(
    label: str, raw: Mapping[str, Any], full_raw: Mapping[str, Any], n_boot: int = 2000
) -> dict[str, Any]:
    """One policy's fidelity summary against full (same questions, matched by index)."""
    from ascend_mepic.eval.squad_metrics import bootstrap_mean, paired_bootstrap

    # A question the engine did not answer (an error finish, no tokens) is no fidelity datum:
    # refuse the run before anything is compared.
    stats.check_raw(full_raw, "full")
    stats.check_raw(raw, label)
    qs = _per_question(raw, full_raw)
    ref = _per_question(full_raw, full_raw)
    # mean(full - policy) over the same questions: the drop, positive when the policy is worse.
    drop = paired_bootstrap([q["f1"] for q in qs], [q["f1"] for q in ref], n=n_boot)
    agree = [q["agree"] for q in qs if q["agree"] is not None]
    agree_ci = bootstrap_mean(agree, n=n_boot) if agree else None
    summary = stats.summarize(raw)
    row = {
        "policy": label,
        "questions": len(qs),
        "top1_agreement": _mean(agree),
        "top1_agreement_ci": [agree_ci.low, agree_ci.high] if agree_ci else None,
        "kl_first_token": _mean([q["kl"] for q in qs]),
        "f1": _mean([q["f1"] for q in qs]),
        "f1_drop": drop.mean + 0.0,  # + 0.0: no "-0.000"
        "f1_drop_ci": [drop.low + 0.0, drop.high + 0.0],
        # In the JSON only: each manager counts differently (a chunk's first compile counts as
        # computed for MEPIC, loaded KV as reused for EPIC), so they compare no fidelity.
        "recomputed_tokens_per_request": summary["recomputed_tokens_per_request"],
        "reuse_fraction": summary["reuse_fraction"],
        "block_size": raw.get("block_size"),
        "wall_s": raw.get("wall_s"),
        "per_question": qs,
    }
    row["safe"], row["verdict"] = verdict(row)
    return row


def verdict(row: Mapping[str, Any]) -> tuple[bool, str]:
    """(safe, the plain verdict line) of one policy's row."""
    agree, drop, n = row["top1_agreement"], row["f1_drop"], row["questions"]
    if agree is None:
        return False, f"{row['policy']}: no verdict (no first tokens to compare)"
    if row["policy"] == RERUN:
        same = agree == 1.0 and row["kl_first_token"] == 0.0 and drop == 0.0
        if same:
            return True, f"{RERUN}: identical to full (the engine is deterministic here)"
        return False, (
            f"{RERUN}: differs from full (top-1 agreement {agree:.2f}, KL "
            f"{row['kl_first_token']:.4f}): run-to-run noise; read smaller policy gaps as noise"
        )
    ok_agree, ok_f1 = agree >= MIN_TOP1_AGREEMENT, drop <= MAX_F1_DROP
    safe = ok_agree and ok_f1
    why = (
        f"top-1 agreement {agree:.2f} {'>=' if ok_agree else '<'} {MIN_TOP1_AGREEMENT:.2f}, "
        f"F1 drop {drop:.2f} {'<=' if ok_f1 else '>'} {MAX_F1_DROP:.2f}"
    )
    line = f"{row['policy']}: {'safe' if safe else 'NOT safe'} to turn on ({why})"
    if n < MIN_QUESTIONS:
        line += f" [only {n} questions: indicative; use --questions >= {MIN_QUESTIONS}]"
    return safe, line


def _fmt(v: float | None, spec: str) -> str:
    return "n/a" if v is None else format(v, spec)


def render(rows: Sequence[Mapping[str, Any]], header: str) -> str:
    """The table, the verdict lines and the notes: what the command prints."""
    lines = [
        header,
        "",
        "| policy | questions | top-1 agree [95% CI] | KL 1st tok | F1 "
        "| F1 drop vs full [95% CI] |",
        "|" + "---|" * 6,
    ]
    for r in rows:
        lo, hi = r["f1_drop_ci"]
        a_lo, a_hi = r["top1_agreement_ci"] or (None, None)
        agree = f"{_fmt(r['top1_agreement'], '.3f')} [{_fmt(a_lo, '.2f')}, {_fmt(a_hi, '.2f')}]"
        lines.append(
            f"| {r['policy']} | {r['questions']} | {agree} "
            f"| {_fmt(r['kl_first_token'], '.4f')} | {_fmt(r['f1'], '.3f')} "
            f"| {r['f1_drop']:+.3f} [{lo:+.3f}, {hi:+.3f}] |"
        )
    lines.append("")
    lines += [r["verdict"] for r in rows if r["policy"] != "full"]
    lines += [
        "",
        f"Thresholds: safe = top-1 agreement >= {MIN_TOP1_AGREEMENT:.2f} and F1 drop <= "
        f"{MAX_F1_DROP:.2f} vs full (point estimates; the 95% CIs, percentile bootstrap over the "
        "questions, paired for F1, say how far to trust them). F1: SQuAD token F1 of the "
        "answer's first line.",
        stats.KL_NOTE,
    ]
    return "\n".join(lines) + "\n"


def cmd_fidelity(args: argparse.Namespace) -> int:
    from transformers import AutoTokenizer

    from ascend_mepic.eval.bench.runner import build_requests, run_in_subprocess
    from ascend_mepic.eval.bench.variants import check_variant
    from ascend_mepic.eval.prepare import resolve_model

    policies = list(dict.fromkeys(args.policies or DEFAULT_POLICIES))
    for p in policies:
        try:
            check_variant(p)  # a typo fails now, not after the reference run
        except ValueError as e:
            raise SystemExit(f"bench fidelity: {e}") from e
    model = str(resolve_model(args.model))
    # Build the prompts here first: a model without a chat template fails before any engine.
    tok = AutoTokenizer.from_pretrained(model)
    probe = {"requests": args.questions, "chunks": args.chunks, "seed": args.seed}
    try:
        n = len(build_requests(tok, {**probe, "articles": args.articles}))
    except ValueError as e:
        raise SystemExit(f"bench fidelity: cannot build chat prompts for {model}: {e}") from e
    started = time.perf_counter()
    log(f"[bench] fidelity: full (reference), {n} questions")
    full_raw = run_in_subprocess(_job(args, model, "full"))
    raws: dict[str, dict] = {}
    for p in policies:
        log(f"[bench] fidelity: {p}")
        raws[RERUN if p == "full" else p] = run_in_subprocess(_job(args, model, p))
    rows = [policy_row("full", full_raw, full_raw, args.bootstrap)]
    rows += [policy_row(label, raw, full_raw, args.bootstrap) for label, raw in raws.items()]
    header = (
        f"Fidelity vs full recompute: model {args.model}, {n} SQuAD v2 questions, "
        f"{args.chunks} paragraphs per prompt (gold among same-article distractors), block size "
        f"{args.block_size}, greedy, max_tokens {args.max_tokens}, seed {args.seed}."
    )
    if args.json:
        out = Path(args.json)
        out.parent.mkdir(parents=True, exist_ok=True)
        config = {k: v for k, v in vars(args).items() if k != "func"}
        data = {"config": {**config, "model_path": model}, "rows": rows}
        out.write_text(json.dumps(data, indent=1) + "\n", encoding="utf-8")
    data_stream().write(render(rows, header))
    log(f"[bench] fidelity: {time.perf_counter() - started:.0f} s")
    return 0


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.description = (
        "Run before turning MEPIC on for a new model: bundled SQuAD v2 questions through full "
        "recompute and each policy; per policy, first-token top-1 agreement and KL vs full, "
        "answer F1, and a verdict. On random weights only a smoke test."
    )
    p.add_argument("--model", default="smollm2", help="model folder, or smollm2 / tiny")
    p.add_argument(
        "--policies",
        nargs="+",
        help=f"policies to check against full (default: {' '.join(DEFAULT_POLICIES)}); "
        "full here reruns full, a determinism check; POLICY,OPTION=VALUE sets MEPIC options "
        "(e.g. mepic,chunk_anchor=prefix)",
    )
    p.add_argument("--questions", type=int, default=50, help="SQuAD v2 questions")
    p.add_argument("--chunks", type=int, default=4, help="paragraphs per prompt, gold included")
    p.add_argument(
        "--articles", type=int, help="draw the questions from this many articles (default: all)"
    )
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--max-tokens", type=int, default=16, help="answer tokens per question")
    p.add_argument("--block-size", type=int, default=16)
    p.add_argument("--kv-gib", type=int, default=1, help="VLLM_CPU_KVCACHE_SPACE (CPU)")
    p.add_argument("--bootstrap", type=int, default=2000, help="bootstrap resamples (F1 CI)")
    p.add_argument("--json", help="also write config, rows and per-question results here")
    p.add_argument("--no-progress", action="store_true", help="engines' logs only on failure")
    p.set_defaults(func=cmd_fidelity)
