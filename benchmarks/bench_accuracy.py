"""Answer accuracy of the PIC policy family on SQuAD v2, side by side on the same questions.

Every policy runs through :class:`ascend_mepic.eval.policy_reference.PolicyReference` (dense
transformers reference, float64 attention), so the numbers measure what each policy's reuse does
to the model's answers, independent of the engine. Per question the full-recompute reference
(prefill, greedy answer, teacher-forced distributions) is computed once and every policy is
compared with it:

* F1 / EM of the greedy answer (first line, SQuAD normalization) and their change vs full with a
  paired-bootstrap 95% CI (resampling questions keeps each question's difficulty in both arms);
* first-token agreement and KL(full || policy) of the first-token distribution;
* mean KL over full's greedy answer, both teacher-forced on that answer (isolates the prompt
  KV's effect from the policy's own sampling path);
* identical-answer rate, and the change in mean per-token NLL of the first gold answer;
* chunk tokens recomputed per request and the reuse fraction (canonical chunk tokens / prompt).
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path
from typing import Any

import torch

from ascend_mepic.entrypoints.streams import print_data_only
from ascend_mepic.eval.outputs import check_token_lists, positive
from ascend_mepic.eval.policy_reference import PolicyReference, PromptState, parse_policy
from ascend_mepic.eval.squad_metrics import bootstrap_mean, exact_match, f1, paired_bootstrap

DEFAULT_POLICIES = "full,naive,epic-16,legolink-0,cacheblend-15,cachetune-15,mepic,mepic-block"


def _kl(ref: torch.Tensor, lp: torch.Tensor) -> torch.Tensor:
    """KL(ref || lp) per row, from log-probs."""
    return (ref.exp() * (ref - lp)).sum(dim=-1)


def _answer(tokenizer: Any, ids: list[int]) -> str:
    """Decoded answer without special tokens, first line only (the model may go on after it)."""
    text = tokenizer.decode(ids, skip_special_tokens=True).strip()
    return text.split("\n", 1)[0].strip()


def _teacher(ref: PolicyReference, state: PromptState, target: list[int]) -> torch.Tensor:
    """Rows predicting each token of ``target`` after the prompt, teacher-forced."""
    return ref.score(state, target[:-1])[: len(target)]


def evaluate_question(
    ref: PolicyReference,
    tokenizer: Any,
    segments: list,
    golds: tuple[str, ...],
    policies: list[str],
    max_new_tokens: int,
    eos: list[int],
    question_id: str = "?",
) -> dict[str, dict[str, Any]]:
    states = {p: ref.prefill(segments, p) for p in policies}
    gens = dict(
        zip(
            policies,
            ref.greedy_batch([states[p] for p in policies], max_new_tokens, eos),
            strict=True,
        )
    )
    # An empty answer where tokens were asked is a broken generation, not a wrong answer.
    answers = {f"policy {p}": g for p, g in gens.items()}
    check_token_lists(answers, max_new_tokens, f"bench_accuracy, question {question_id}")
    full, full_gen = states["full"], gens["full"]
    gold = list(tokenizer.encode(golds[0], add_special_tokens=False))
    full_tf = _teacher(ref, full, full_gen)
    full_gold = _teacher(ref, full, gold)
    idx = torch.arange(len(gold))
    full_nll = float(-full_gold[idx, gold].mean())
    first_full = full.next_logprobs
    out: dict[str, dict[str, Any]] = {}
    for p in policies:
        st = states[p]
        answer = _answer(tokenizer, gens[p])
        if p == "full":
            kl_answer, dnll = 0.0, 0.0
        else:
            kl_answer = float(_kl(full_tf, _teacher(ref, st, full_gen)).mean())
            dnll = float(-_teacher(ref, st, gold)[idx, gold].mean()) - full_nll
        out[p] = {
            "answer": answer,
            "f1": f1(answer, golds),
            "em": exact_match(answer, golds),
            "first_agree": float(int(st.next_logprobs.argmax()) == int(first_full.argmax())),
            "kl_first": float(_kl(first_full, st.next_logprobs)),
            "kl_answer": kl_answer,
            "same_answer": float(gens[p] == full_gen),
            "dnll_gold": dnll,
            "recomputed": st.recomputed,
            "reuse": st.reuse_fraction,
        }
    return out


def summarize(
    records: list[dict[str, Any]], policies: list[str], n_boot: int, seed: int
) -> dict[str, dict[str, Any]]:
    def col(p: str, key: str) -> list[float]:
        return [r["policies"][p][key] for r in records]

    summary = {}
    for p in policies:
        s: dict[str, Any] = {}
        for key in ("f1", "em"):
            s[key] = bootstrap_mean(col(p, key), n_boot, seed).__dict__
            s[f"d{key}"] = paired_bootstrap(col("full", key), col(p, key), n_boot, seed).__dict__
        for key in ("first_agree", "kl_first", "kl_answer", "same_answer", "dnll_gold"):
            s[key] = bootstrap_mean(col(p, key), n_boot, seed).__dict__
        s["recomputed"] = sum(col(p, "recomputed")) / len(records)
        s["reuse"] = sum(col(p, "reuse")) / len(records)
        summary[p] = s
    return summary


def _ci(d: dict[str, float], scale: float = 100.0, digits: int = 1) -> str:
    return (
        f"{d['mean'] * scale:+.{digits}f} "
        f"[{d['low'] * scale:+.{digits}f}, {d['high'] * scale:+.{digits}f}]"
    )


def markdown(summary: dict[str, dict[str, Any]], n: int) -> str:
    head = (
        f"| policy (n={n}) | F1 | ΔF1 vs full [95% CI] | EM | ΔEM [95% CI] | 1st-token agree | "
        "KL 1st | KL answer | same answer | ΔNLL gold | recomputed/req | reuse |"
    )
    lines = [head, "|" + "---|" * 12]
    for p, s in summary.items():
        lines.append(
            f"| {p} | {s['f1']['mean'] * 100:.1f} | {_ci(s['df1'])} | {s['em']['mean'] * 100:.1f} "
            f"| {_ci(s['dem'])} | {s['first_agree']['mean'] * 100:.0f}% "
            f"| {s['kl_first']['mean']:.3f} | {s['kl_answer']['mean']:.3f} "
            f"| {s['same_answer']['mean'] * 100:.0f}% | {s['dnll_gold']['mean']:+.3f} "
            f"| {s['recomputed']:.0f} | {s['reuse'] * 100:.1f}% |"
        )
    return "\n".join(lines)


_SAME_SETTINGS = ("model", "block_size", "check_layer", "paragraphs", "max_new_tokens", "seed")


def _resumed(path: Path, config: dict[str, Any], requests: list) -> list[dict[str, Any]]:
    """Per-question records of an earlier run that match this one's settings and question order.

    Refuses (rather than silently mixing) a run with other settings or other policies.
    """
    old = json.loads(path.read_text())
    for key in _SAME_SETTINGS:
        if old["config"].get(key) != config[key]:
            raise SystemExit(f"--resume {path}: {key} differs ({old['config'].get(key)!r})")
    if old["config"]["policies"] != config["policies"]:
        raise SystemExit(f"--resume {path}: policies differ ({old['config']['policies']})")
    records = []
    for rec, (q, _) in zip(old["questions"], requests, strict=False):
        if rec["id"] != q.id:
            break
        records.append(rec)
    print(f"resumed {len(records)} questions from {path}", flush=True)
    return records


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument("--model", default="smollm2")
    ap.add_argument("--policies", default=DEFAULT_POLICIES, help="comma-separated")
    ap.add_argument("--block-size", type=int, default=16)
    ap.add_argument("--check-layer", type=int, default=1, help="CacheBlend's selection layer")
    ap.add_argument("--questions", type=int, default=300)
    ap.add_argument("--paragraphs", type=int, default=4)
    ap.add_argument("--max-new-tokens", type=int, default=24)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--bootstrap", type=int, default=2000)
    ap.add_argument("--threads", type=int, default=1, help="torch.set_num_threads")
    ap.add_argument("--quick", action="store_true", help="20 questions (smoke run)")
    ap.add_argument("--json", type=Path, help="write config, summary and per-question results")
    ap.add_argument("--save-every", type=int, default=25, help="rewrite --json every N questions")
    ap.add_argument(
        "--resume",
        type=Path,
        help="reuse per-question results from an earlier --json run with the same settings "
        "(the question list is prefix-stable in --questions, so a 50-question run seeds a 300 one)",
    )
    args = ap.parse_args(argv)
    print_data_only()  # stdout: this script's data only; logs (vLLM's too) to stderr
    if args.quick:
        args.questions = min(args.questions, 20)
    policies = [p.strip() for p in args.policies.split(",") if p.strip()]
    for p in policies:
        parse_policy(p)
    if "full" not in policies:
        policies.insert(0, "full")
    torch.set_num_threads(args.threads)

    from transformers import AutoModelForCausalLM, AutoTokenizer

    from ascend_mepic.eval.prepare import resolve_model
    from ascend_mepic.eval.squad_prompts import squad_chat_requests

    path = resolve_model(args.model)
    tokenizer = AutoTokenizer.from_pretrained(str(path))
    model = AutoModelForCausalLM.from_pretrained(str(path), dtype=torch.float32)
    ref = PolicyReference(
        model, args.block_size, dummy_token_id=tokenizer.bos_token_id, check_layer=args.check_layer
    )
    gen_eos = model.generation_config.eos_token_id
    gen_eos = gen_eos if isinstance(gen_eos, list) else [gen_eos]
    eos_ids = sorted({int(e) for e in (tokenizer.eos_token_id, *gen_eos) if e is not None})
    requests = squad_chat_requests(tokenizer, args.questions, args.paragraphs, args.seed)
    config = {
        **vars(args),
        "json": str(args.json) if args.json else None,
        "resume": str(args.resume) if args.resume else None,
        "policies": policies,
        "model_path": str(path),
        "eos": eos_ids,
        "questions_run": len(requests),
    }
    print(
        f"{len(requests)} SQuAD v2 questions, {args.paragraphs} paragraphs, model {args.model}, "
        f"block {args.block_size}, policies {', '.join(policies)}",
        flush=True,
    )

    records = _resumed(args.resume, config, requests) if args.resume else []
    resumed = len(records)
    start = time.perf_counter()

    def dump(final: bool) -> None:
        if not args.json or not records:
            return
        data = {
            "config": config,
            "complete": final,
            "summary": summarize(records, policies, args.bootstrap, args.seed),
            "questions": records,
        }
        args.json.parent.mkdir(parents=True, exist_ok=True)
        tmp = args.json.with_suffix(".tmp")
        tmp.write_text(json.dumps(data, indent=1))
        tmp.replace(args.json)

    for i, (q, segments) in enumerate(requests):
        if i < len(records):
            continue
        res = evaluate_question(
            ref, tokenizer, segments, q.answers, policies, args.max_new_tokens, eos_ids, q.id
        )
        num_tokens = sum(len(s.token_ids) for s in segments)
        records.append(
            {
                "id": q.id,
                "question": q.question,
                "golds": list(q.answers),
                "prompt_tokens": num_tokens,
                "policies": res,
            }
        )
        elapsed = time.perf_counter() - start
        eta = elapsed / (i + 1 - resumed) * (len(requests) - i - 1)
        f1s = " ".join(f"{p}={res[p]['f1']:.2f}" for p in policies)
        print(
            f"[{i + 1}/{len(requests)}] {num_tokens} tok, {elapsed:.0f}s elapsed, "
            f"ETA {eta / 60:.1f} min | F1 {f1s}",
            file=sys.stderr,
            flush=True,
        )
        if args.save_every and (i + 1) % args.save_every == 0:
            dump(final=False)
    summary = summarize(records, policies, args.bootstrap, args.seed)
    seconds = positive(time.perf_counter() - start, "bench_accuracy: wall time (s)")
    print(markdown(summary, len(records)))
    print(f"\n{seconds:.0f} s, {args.threads} thread(s)")
    dump(final=True)


if __name__ == "__main__":
    main()
