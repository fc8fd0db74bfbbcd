"""Pure parts of the benchmarks: arrivals, fidelity math, per-policy summaries, workload
statistics and the Markdown report. Nothing here starts an engine."""

from __future__ import annotations

import math
import platform
import random
import statistics
from collections.abc import Mapping, Sequence
from typing import Any

import numpy as np

from ascend_mepic.eval.outputs import check_records, positive

KL_NOTE = (
    "Fidelity: top-1 agreement is the share of requests whose first generated token equals "
    "full's. KL(full || policy) of the first token is approximated on full's top-20 support plus "
    "one tail bucket (a full top-20 token outside the policy's top-20 gets min(policy's smallest "
    "top-20 probability, remaining mass / missing count))."
)

# Keys every per-policy JSON has (more are allowed).
REQUIRED_KEYS = (
    "policy",
    "workload",
    "requests",
    "qps",
    "block_size",
    "latency_mean_s",
    "latency_p99_s",
    "ttft_mean_s",
    "throughput_tok_s",
    "peak_kv_usage",
    "mean_kv_usage",
    "peak_kv_blocks",
    "f1",
    "em",
    "top1_agreement",
    "kl_first_token",
    "recomputed_tokens_per_request",
    "reuse_fraction",
)

# MEPIC paper numbers (SQuAD), printed beside ours as ratios.
PAPER_PEAK_KV_PCT = {"mepic": 27.67, "cacheblend-15": 54.47, "epic-16": 54.13}
PAPER_QPS_RATIO = {"cacheblend-15": 5.74, "epic-16": 5.25}
PAPER_CHUNK_RATIO = (2.97, 5.21)

KL_TAIL_EPS = 1e-9


def poisson_arrivals(n: int, qps: float, seed: int = 0) -> list[float]:
    """Arrival offsets (seconds) of ``n`` requests from a Poisson process of rate ``qps``."""
    if qps <= 0:
        return [0.0] * n
    rng = random.Random(seed)
    t, out = 0.0, []
    for _ in range(n):
        t += rng.expovariate(qps)
        out.append(t)
    return out


def percentile(xs: Sequence[float], q: float) -> float:
    """numpy's linear-interpolated percentile, ``q`` in [0, 100]; NaN for no samples."""
    return float(np.percentile(xs, q)) if len(xs) else float("nan")


def kl_first_token(full: Mapping[int, float], policy: Mapping[int, float]) -> float:
    """KL(full || policy) of the first-token distribution from two top-k logprob dicts.

    Approximation: the support is full's top-k tokens plus one tail bucket holding the rest of
    the mass. A full top-k token missing from the policy's top-k gets probability min(smallest
    policy top-k probability, remaining policy mass / missing count), an upper bound on its true
    probability, so the KL is if anything underestimated for such tokens.
    """
    p = {int(t): math.exp(lp) for t, lp in full.items()}
    q_all = {int(t): math.exp(lp) for t, lp in policy.items()}
    q = {t: q_all[t] for t in p if t in q_all}
    missing = [t for t in p if t not in q_all]
    rest = max(0.0, 1.0 - sum(q_all.values()))
    if missing:
        floor = min(q_all.values()) if q_all else 1.0
        share = min(floor, rest / len(missing))
        for t in missing:
            q[t] = share
    p_tail = max(0.0, 1.0 - sum(p.values()))
    q_tail = max(KL_TAIL_EPS, 1.0 - sum(q.values()))
    kl = sum(pv * math.log(pv / max(q[t], KL_TAIL_EPS)) for t, pv in p.items() if pv > 0)
    if p_tail > KL_TAIL_EPS:
        kl += p_tail * math.log(p_tail / q_tail)
    return max(0.0, kl)


def fidelity(
    full_reqs: Sequence[Mapping[str, Any]], reqs: Sequence[Mapping[str, Any]]
) -> tuple[float | None, float | None]:
    """(top1 agreement, mean first-token KL) of a policy's requests vs full's, matched by index."""
    by_idx = {r["index"]: r for r in full_reqs}
    agree, kls = [], []
    for r in reqs:
        f = by_idx.get(r["index"])
        if f is None or f.get("first_token") is None or r.get("first_token") is None:
            continue
        agree.append(float(f["first_token"] == r["first_token"]))
        kls.append(kl_first_token(_int_keys(f["top_logprobs"]), _int_keys(r["top_logprobs"])))
    if not agree:
        return None, None
    return statistics.mean(agree), statistics.mean(kls)


def _int_keys(d: Mapping[Any, float]) -> dict[int, float]:
    return {int(k): float(v) for k, v in d.items()}


def check_raw(raw: Mapping[str, Any], label: str | None = None) -> None:
    """Refuse a runner's raw result in which a request was not served (an error or abort
    finish, or no tokens): its times would be those of the engine saying no."""
    what = f"policy {label or raw.get('policy')}"
    check_records(raw["per_request"], raw.get("max_tokens"), what)


def summarize(raw: Mapping[str, Any], full_raw: Mapping[str, Any] | None = None) -> dict[str, Any]:
    """The per-policy JSON from a runner's raw result (and full's, for fidelity). Raises
    (``ascend_mepic.eval.outputs``) on a request that was not served or a time that is not
    positive, before any number is computed."""
    from ascend_mepic.eval.squad_metrics import exact_match, f1

    check_raw(raw)
    if full_raw is not None:
        check_raw(full_raw)
    reqs = raw["per_request"]
    what = f"policy {raw['policy']}"
    lat = [
        positive(r["finish_s"] - r["arrival_s"], f"{what}: request {r['index']} latency (s)")
        for r in reqs
    ]
    ttft = [
        positive(
            None if r["first_token_s"] is None else r["first_token_s"] - r["arrival_s"],
            f"{what}: request {r['index']} TTFT (s)",
        )
        for r in reqs
    ]
    out_tokens = sum(r["output_tokens"] for r in reqs)
    span = max(r["finish_s"] for r in reqs) - min(r["arrival_s"] for r in reqs)
    throughput = positive(out_tokens / positive(span, f"{what}: run span (s)"), f"{what}: tok/s")
    prompt_tokens = sum(r["prompt_tokens"] for r in reqs)
    pool = raw["pool_blocks"]
    used = [u for _, u in raw["kv_timeline"]] or [0]
    peak = max(used)
    m = raw.get("manager_metrics") or {}
    if m.get("tokens_computed", 0) + m.get("tokens_reused", 0) > 0:
        computed, reused = m["tokens_computed"], m["tokens_reused"]
        recompute_source = "manager metrics (tokens_computed incl. chunk compiles)"
    else:
        cached = sum(r.get("num_cached_tokens") or 0 for r in reqs)
        computed, reused = prompt_tokens - cached, cached
        recompute_source = "prompt tokens minus vLLM num_cached_tokens (prefix-cache hits)"
    agree, kl = (None, None)
    if full_raw is not None:
        agree, kl = fidelity(full_raw["per_request"], reqs)
    return {
        "policy": raw["policy"],
        "workload": raw["workload"],
        "requests": len(reqs),
        "qps": raw["qps"],
        "block_size": raw["block_size"],
        "num_chunks": raw.get("num_chunks"),
        "latency_mean_s": statistics.mean(lat),
        "latency_p50_s": percentile(lat, 50),
        "latency_p90_s": percentile(lat, 90),
        "latency_p99_s": percentile(lat, 99),
        "ttft_mean_s": statistics.mean(ttft),
        "ttft_p50_s": percentile(ttft, 50),
        "ttft_p90_s": percentile(ttft, 90),
        "throughput_tok_s": throughput,
        # requests and prompt tokens (each request's whole prompt, reused or not) per second of
        # the same span
        "throughput_req_s": len(reqs) / span,
        "prompt_throughput_tok_s": prompt_tokens / span,
        "peak_kv_usage": peak / pool if pool else None,
        "mean_kv_usage": statistics.mean(used) / pool if pool else None,
        "peak_kv_blocks": peak,
        "pool_blocks": pool,
        "peak_kv_bytes": peak * raw.get("block_bytes", 0),
        "f1": statistics.mean(f1(r["text"], r["answers"]) for r in reqs),
        "em": statistics.mean(exact_match(r["text"], r["answers"]) for r in reqs),
        "top1_agreement": agree,
        "kl_first_token": kl,
        "recomputed_tokens_per_request": computed / len(reqs),
        "reuse_fraction": reused / (reused + computed) if reused + computed else 0.0,
        "recompute_source": recompute_source,
        "prompt_tokens_mean": prompt_tokens / len(reqs),
        "wall_s": raw.get("wall_s"),
        "kv_timeline": raw["kv_timeline"],
        "manager_metrics": m,
    }


def workload_stats(
    requests: Sequence[Sequence[Any]], block_size: int, policies: Sequence[str]
) -> dict[str, Any]:
    """Table 1 statistics of segmented requests, from the workload alone.

    ``reused_fraction``: prompt tokens in chunks already seen by an earlier request. Per policy,
    ``recomputed_steady``: tokens computed per request once every chunk is cached (prompt
    segments plus ``fresh_tokens`` of each chunk), and ``recomputed_first_seen``: the same with a
    chunk's first occurrence computed in full (its compile).
    """
    from ascend_mepic.core.policies import parse_policy
    from ascend_mepic.core.segments import SegmentKind, build_layout

    n = len(requests)
    seen: set[tuple[int, ...]] = set()
    total = reused = 0
    steady = {p: 0 for p in policies}
    first_seen = {p: 0 for p in policies}
    for segs in requests:
        layout = build_layout(segs, block_size)
        total += layout.num_real_tokens
        ci = 0
        for seg in segs:
            k = len(seg.token_ids)
            if seg.kind is not SegmentKind.CHUNK:
                for p in policies:
                    steady[p] += k
                    first_seen[p] += k
                continue
            was_seen = seg.token_ids in seen
            reused += k if was_seen else 0
            for p in policies:
                pol = parse_policy(p)
                fresh = len(pol.fresh_tokens(ci, k, block_size)) if pol.kind != "cachetune" else k
                steady[p] += fresh
                first_seen[p] += fresh if was_seen else k
            seen.add(seg.token_ids)
            ci += 1
    return {
        "requests": n,
        "block_size": block_size,
        "prompt_tokens_mean": total / n if n else 0.0,
        "reused_fraction": reused / total if total else 0.0,
        "recomputed_steady": {p: v / n for p, v in steady.items()},
        "recomputed_first_seen": {p: v / n for p, v in first_seen.items()},
    }


def hardware() -> str:
    from ascend_mepic.host import cpu_info

    return f"{platform.platform()}, Python {platform.python_version()}; {cpu_info().describe()}"


def _fmt(v: Any, spec: str = ".3f") -> str:
    if v is None:
        return "n/a"
    if isinstance(v, float) and math.isnan(v):
        return "n/a"
    return format(v, spec) if isinstance(v, (int, float)) else str(v)


COMPARE_COLUMNS = (
    ("policy", "policy", "s"),
    ("latency mean (s)", "latency_mean_s", ".2f"),
    ("p50 (s)", "latency_p50_s", ".2f"),
    ("p99 (s)", "latency_p99_s", ".2f"),
    ("TTFT (s)", "ttft_mean_s", ".2f"),
    ("tok/s", "throughput_tok_s", ".1f"),
    ("peak KV %", "peak_kv_usage", ".2%"),
    ("mean KV %", "mean_kv_usage", ".2%"),
    ("peak blocks", "peak_kv_blocks", "d"),
    ("F1", "f1", ".3f"),
    ("EM", "em", ".3f"),
    ("top-1 agree", "top1_agreement", ".3f"),
    ("KL 1st tok", "kl_first_token", ".4f"),
    ("recomputed tok/req", "recomputed_tokens_per_request", ".1f"),
    ("reuse frac", "reuse_fraction", ".3f"),
)


def table(rows: Sequence[Mapping[str, Any]], columns=COMPARE_COLUMNS) -> str:
    head = "| " + " | ".join(c[0] for c in columns) + " |"
    sep = "|" + "---|" * len(columns)
    body = [
        "| " + " | ".join(_fmt(r.get(key), spec) for _, key, spec in columns) + " |" for r in rows
    ]
    return "\n".join([head, sep, *body])


def paper_ratio_lines(rows: Sequence[Mapping[str, Any]]) -> list[str]:
    """Peak-KV ratios vs MEPIC beside the paper's Table 2 ratios."""
    ratios = peak_kv_ratios(rows)
    if not ratios:
        return ["(no mepic row: no peak-KV ratios)"]
    mepic_pct = PAPER_PEAK_KV_PCT["mepic"]
    return [
        f"- peak KV {p} / mepic: ours {ours:.2f}x, paper Table 2 {paper:.2f}x "
        f"({PAPER_PEAK_KV_PCT[p]}% vs {mepic_pct}%)"
        for p, (ours, paper) in ratios.items()
    ]


SUMMARY_COLUMNS = (
    ("policy", "policy", "s"),
    ("peak KV %", "peak_kv_usage", ".2%"),
    ("peak blocks", "peak_kv_blocks", "d"),
    ("latency mean (s)", "latency_mean_s", ".2f"),
    ("TTFT (s)", "ttft_mean_s", ".2f"),
    ("F1", "f1", ".3f"),
    ("top-1 agree", "top1_agreement", ".3f"),
    ("recomputed tok/req", "recomputed_tokens_per_request", ".1f"),
)

# A baseline / MEPIC peak-KV ratio at least this share of the paper's counts as reproducing it.
VERDICT_SHARE = 0.75


def peak_kv_ratios(rows: Sequence[Mapping[str, Any]]) -> dict[str, tuple[float, float]]:
    """Per Table 2 baseline that ran: (ours, paper) peak-KV ratio baseline / MEPIC.

    Peak blocks at the same block size; bytes otherwise (a baseline run at another block size
    still compares like for like).
    """
    by = {r["policy"]: r for r in rows}
    m = by.get("mepic")
    if not m or not m.get("peak_kv_blocks"):
        return {}
    out = {}
    for other, pct in PAPER_PEAK_KV_PCT.items():
        r = by.get(other)
        if other == "mepic" or r is None:
            continue
        if r.get("block_size") == m.get("block_size") or not m.get("peak_kv_bytes"):
            ours = r["peak_kv_blocks"] / m["peak_kv_blocks"]
        else:
            ours = r["peak_kv_bytes"] / m["peak_kv_bytes"]
        out[other] = (ours, pct / PAPER_PEAK_KV_PCT["mepic"])
    return out


def verdict(rows: Sequence[Mapping[str, Any]]) -> str:
    """One line: MEPIC's peak KV against the Table 2 baselines, ours beside the paper's."""
    ratios = peak_kv_ratios(rows)
    if not ratios:
        return "Verdict: no MEPIC row and Table 2 baseline ran together; nothing to compare."
    parts = ", ".join(
        f"{p} / MEPIC {ours:.2f}x (paper {paper:.2f}x)" for p, (ours, paper) in ratios.items()
    )
    worst = min(ours / paper for ours, paper in ratios.values())
    if worst >= VERDICT_SHARE:
        judged = "the paper's Table 2 memory saving is reproduced at this size"
    elif min(ours for ours, _ in ratios.values()) > 1.0:
        judged = "MEPIC uses less KV, but less than the paper's Table 2 saving"
    else:
        judged = "the paper's Table 2 memory saving is NOT reproduced"
    return f"Verdict: peak KV {parts}: {judged}."


def render_compare_summary(
    rows: Sequence[Mapping[str, Any]], report_path: str, plot_path: str | None
) -> str:
    """What a person reads in ten seconds: the key columns, the verdict, and where the rest is."""
    parts = [table(rows, SUMMARY_COLUMNS), "", verdict(rows), ""]
    if plot_path:
        parts.append(f"Plot: {plot_path}")
    parts.append(f"Full report (every column, notes, hardware): {report_path}")
    return "\n".join(parts) + "\n"


def render_compare_report(
    rows: Sequence[Mapping[str, Any]], title: str, notes: Sequence[str] = (), hw: str | None = None
) -> str:
    parts = [f"# {title}", "", f"Hardware: {hw if hw is not None else hardware()}", ""]
    if rows:
        r0 = rows[0]
        parts.append(
            f"Workload {r0.get('workload')}: {r0.get('requests')} requests, QPS {r0.get('qps')}, "
            f"block size {r0.get('block_size')}."
        )
        other = [r for r in rows if r.get("block_size") != r0.get("block_size")]
        if other:
            parts.append(
                "Ran at another block size (stock vLLM's CPU attention needs a multiple of 32): "
                + ", ".join(f"{r['policy']} at {r['block_size']}" for r in other)
                + "; compare its KV by % of the pool or bytes, not blocks."
            )
        parts.append("")
    parts += [table(rows), "", "Paper comparison (ratios, MEPIC paper Table 2, SQuAD):", ""]
    parts += paper_ratio_lines(rows)
    parts += ["", verdict(rows), "", *notes]
    return "\n".join(parts) + "\n"


SWEEP_COLUMNS = (
    ("x", "x", "g"),
    ("policy", "policy", "s"),
    ("latency mean (s)", "latency_mean_s", ".2f"),
    ("p99 (s)", "latency_p99_s", ".2f"),
    ("TTFT (s)", "ttft_mean_s", ".2f"),
    ("peak KV %", "peak_kv_usage", ".2%"),
    ("peak blocks", "peak_kv_blocks", "d"),
    ("F1", "f1", ".3f"),
)


def sweep_ratios(rows: Sequence[Mapping[str, Any]]) -> dict[str, list[float]]:
    """Per baseline, peak-KV blocks / mepic's at each sweep point where both ran."""
    by = {(r["x"], r["policy"]): r for r in rows}
    out: dict[str, list[float]] = {}
    for (x, p), r in sorted(by.items(), key=lambda kv: (kv[0][1], kv[0][0])):
        m = by.get((x, "mepic"))
        if p == "mepic" or m is None or not m.get("peak_kv_blocks"):
            continue
        out.setdefault(p, []).append(r["peak_kv_blocks"] / m["peak_kv_blocks"])
    return out


def render_sweep_report(
    rows: Sequence[Mapping[str, Any]],
    title: str,
    xname: str,
    paper: str,
    notes: Sequence[str] = (),
    hw: str | None = None,
) -> str:
    cols = ((xname, "x", "g"), *SWEEP_COLUMNS[1:])
    parts = [f"# {title}", "", f"Hardware: {hw if hw is not None else hardware()}", ""]
    parts += [table(rows, cols), "", "Peak KV vs mepic (ours, per sweep point):", ""]
    for p, rs in sweep_ratios(rows).items():
        parts.append(f"- {p} / mepic: " + ", ".join(f"{x:.2f}x" for x in rs))
    parts += ["", f"Paper: {paper}", "", *notes]
    return "\n".join(parts) + "\n"
