"""TTFT and decode speed in the real vLLM engine: MEPIC vs full recompute vs prefix caching.

Side by side in one run, on the same SQuAD v2 requests (a system prompt, K paragraphs of one
article as chunks, the question), SmolLM2-135M-Instruct on the CPU, float32 (``--dtype
bfloat16``: weights, activations and KV cache in bfloat16, the dtype models are served in):

* TTFT: each request alone with ``max_tokens=1`` (prefill latency), after a warm-up pass over
  requests with the same paragraphs in another order and another question (RAG traffic: the same
  passages retrieved for different questions, at different positions). MEPIC can reuse every
  paragraph, prefix caching only the shared system prompt, full recompute nothing.
* Warm-up TTFT: the same over the warm-up pass, whose requests compile the chunks (MEPIC) the
  first time each paragraph is seen: what a chunk's first use costs.
* Speculation (``mepic-ngram``, ``mepic-draft``): vLLM's n-gram drafting, or a draft model (the
  served model drafting for itself, ``--draft-model`` another), on MEPIC; the acceptance rate
  is printed under the table (``--configs mepic mepic-ngram mepic-draft`` puts decode with and
  without it side by side).
* Decode: tokens/s of a warm batch, (time for ``--decode-tokens`` tokens - time for 1 token),
  the median of ``--decode-rounds`` rounds,
  MEPIC (RoPE applied to K at read time, its native CPU kernel by default) vs stock vLLM
  (pre-rotated K, vLLM's CPU kernel).

Each configuration runs in its own process; ``--configs`` picks them (ratios against the first)
and ``--repeats N`` runs them N times alternated, to show the spread. Prints ratios; asserts
nothing about time.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
from collections.abc import Callable, Sequence

from ascend_mepic.entrypoints.streams import print_data_only
from ascend_mepic.eval.outputs import failures_reported, positive, timed_generate

NGRAM = {"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_max": 4,
         "prompt_lookup_min": 2}  # fmt: skip
# A draft model: the served model itself unless ``--draft-model`` names another (its tokenizer
# and KV geometry must be the served model's).
DRAFT = {"method": "draft_model", "num_speculative_tokens": 3}
CONFIGS = {
    "full": {"mepic": False, "prefix": False},
    "prefix": {"mepic": False, "prefix": True},
    "mepic": {"mepic": True, "prefix": True},
    # the compile without an anchor (issue 65's earlier default): what the anchor costs
    "mepic-unanchored": {"mepic": True, "prefix": True, "options": {"chunk_anchor": "none"}},
    # n-gram (prompt lookup) speculation on MEPIC: answers copy spans of the cached paragraphs
    "mepic-ngram": {"mepic": True, "prefix": True, "speculative": NGRAM},
    # a draft model on MEPIC: its batches placed by the target's token maps
    "mepic-draft": {"mepic": True, "prefix": True, "speculative": DRAFT},
}


def worker(job: dict) -> dict:
    from transformers import AutoTokenizer
    from vllm import LLM

    from ascend_mepic.core.markers import TextSegment, tokenize_segments
    from ascend_mepic.core.segments import SegmentKind
    from ascend_mepic.eval.trace import squad_trace
    from ascend_mepic.offline import mepic_llm_kwargs

    tok = AutoTokenizer.from_pretrained(job["model"])
    lines = list(
        squad_trace(job["requests"], 1.0, job["chunks"], job["seed"], None, 1, job["articles"])
    )

    def tokenize(pieces):
        return tokenize_segments(tok, [TextSegment(SegmentKind(k), x) for k, x in pieces])

    reqs, warm = [], []
    for line in lines:
        pieces = [(s["type"], s["text"]) for s in line["segments"]]
        system, paragraphs = pieces[0], pieces[1:-1]
        reqs.append(tokenize(pieces))
        other = ("prompt", "Question: Which documents mention a date?\nAnswer:")
        warm.append(tokenize([system, *reversed(paragraphs), other]))
    options = job.get("options", {})
    kwargs = (
        mepic_llm_kwargs(**options) if job["mepic"] else {"enable_prefix_caching": job["prefix"]}
    )
    if job.get("speculative"):  # vLLM's counters of drafted and accepted tokens need its stats
        spec = dict(job["speculative"])
        if spec["method"] == "draft_model":
            spec.setdefault("model", job.get("draft_model") or job["model"])
        kwargs.update(speculative_config=spec, disable_log_stats=False)
    llm = LLM(
        model=job["model"],
        dtype=job.get("dtype", "float32"),
        enforce_eager=True,
        max_model_len=4096,
        block_size=job["block_size"],
        seed=0,
        **kwargs,
    )

    def generate(prompts, params):
        return llm.generate(prompts, params, use_tqdm=False)

    result = measure(generate, reqs, warm, job)
    if job.get("speculative"):
        result["spec_decode"] = spec_counts(llm)
    return result


def spec_counts(llm) -> dict[str, float]:
    """vLLM's speculative-decoding counters over the whole run (TTFT, warm-up, decode)."""
    return {
        m.name.removeprefix("vllm:spec_decode_"): m.value
        for m in llm.get_metrics()
        if m.name.startswith("vllm:spec_decode_num") and hasattr(m, "value")
    }


def spec_line(k: int, rep: int, name: str, counts: dict[str, float]) -> str:
    """Acceptance of a speculative configuration: the share of drafted tokens accepted and the
    tokens each verification step produced (1 + accepted per draft)."""
    drafted, accepted = counts.get("num_draft_tokens", 0), counts.get("num_accepted_tokens", 0)
    drafts = counts.get("num_drafts", 0)
    rate = accepted / drafted if drafted else 0.0
    per_step = 1 + accepted / drafts if drafts else 1.0
    return (
        f"{k} paragraphs, repeat {rep + 1}, {name}: {drafts:.0f} verification steps, "
        f"{drafted:.0f} draft tokens, {accepted:.0f} accepted: acceptance rate {rate:.2f}, "
        f"{per_step:.2f} tokens per verification step"
    )


def measure(generate: Callable[[list, list], Sequence], reqs: list, warm: list, job: dict) -> dict:
    """TTFT and decode rate of one configuration through ``generate(prompts, params)``
    (``LLM.generate``). Every call's outputs are checked (``ascend_mepic.eval.outputs``) before
    its time counts: a refused request ends the job with the reason, never with a number."""
    from vllm import SamplingParams

    from ascend_mepic.offline import segment_request

    label = f"{job.get('config', 'mepic' if job['mepic'] else 'stock')}, {job['chunks']} paragraphs"
    one = SamplingParams(temperature=0.0, max_tokens=1)

    def prompt_of(segs, params):
        if job["mepic"]:
            return segment_request(segs, params)
        return {"prompt_token_ids": [t for s in segs for t in s.token_ids]}, params

    def run(segs, params, what):
        prompt, sp = prompt_of(segs, params)
        return timed_generate(generate, [prompt], [sp], f"{label}: {what}")[1]

    # warm-up: same paragraphs, other order and question; its first requests compile the chunks
    cold = [run(segs, one, f"warm-up request {i}") for i, segs in enumerate(warm)]
    ttft = [run(segs, one, f"TTFT request {i}") for i, segs in enumerate(reqs)]
    decode_params = SamplingParams(
        temperature=0.0, max_tokens=job["decode_tokens"], ignore_eos=True
    )
    first = decode_params.clone()
    first.max_tokens = 1
    pairs = [prompt_of(s, decode_params) for s in reqs[: job["decode_batch"]]]
    prompts, params = [p for p, _ in pairs], [sp for _, sp in pairs]
    firsts = [prompt_of(s, first)[1] for s in reqs[: job["decode_batch"]]]
    timed_generate(generate, prompts, params, f"{label}: decode warm-up")  # warm every cache
    rates = []
    for r in range(job["decode_rounds"]):  # the median of a few: one round is noisy
        what = f"{label}: decode round {r}"
        _, t_first = timed_generate(generate, prompts, firsts, f"{what}, first token")
        outs, t_all = timed_generate(generate, prompts, params, what)
        elapsed = positive(t_all - t_first, f"{what}: time for all tokens minus the first (s)")
        tokens = sum(len(o.outputs[0].token_ids) - 1 for o in outs)
        rates.append(positive(tokens / elapsed, f"{what}: decode tok/s ({tokens} tokens)"))
    return {
        "ttft_mean_s": statistics.mean(ttft),
        "cold_ttft_mean_s": statistics.mean(cold),
        "ttft_p50_s": statistics.median(ttft),
        "prompt_tokens_mean": statistics.mean(sum(len(s.token_ids) for s in r) for r in reqs),
        "decode_tok_s": statistics.median(rates),
        "decode_tok_s_rounds": rates,
    }


def table_row(k: int, rep: int, name: str, r: dict, ref: dict) -> str:
    """One Markdown row of ``name``'s result ``r`` against the base configuration's ``ref``;
    raises on a time or rate that is not positive instead of printing it."""
    what = f"{k} paragraphs, repeat {rep + 1}"
    ttft_mean = positive(r["ttft_mean_s"], f"{what}, {name}: TTFT mean (s)")
    ttft_p50 = positive(r["ttft_p50_s"], f"{what}, {name}: TTFT p50 (s)")
    cold = positive(r["cold_ttft_mean_s"], f"{what}, {name}: warm-up TTFT mean (s)")
    ref_cold = positive(ref["cold_ttft_mean_s"], f"{what}, base: warm-up TTFT mean (s)")
    decode = positive(r["decode_tok_s"], f"{what}, {name}: decode tok/s")
    ref_ttft = positive(ref["ttft_mean_s"], f"{what}, base: TTFT mean (s)")
    ref_decode = positive(ref["decode_tok_s"], f"{what}, base: decode tok/s")
    return (
        f"| {k} | {rep + 1} | {name} | {r['prompt_tokens_mean']:.0f} | "
        f"{ttft_mean * 1e3:.1f} | {ttft_p50 * 1e3:.1f} | {ttft_mean / ref_ttft:.2f}x | "
        f"{cold * 1e3:.1f} | {cold / ref_cold:.2f}x | "
        f"{decode:.1f} | {decode / ref_decode:.2f}x |"
    )


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__)
    p.add_argument("--model", default="smollm2")
    p.add_argument("--requests", type=int, default=24)
    p.add_argument("--chunks", type=int, nargs="+", default=[4, 8])
    p.add_argument("--articles", type=int, default=1)
    p.add_argument("--block-size", type=int, default=32)
    p.add_argument("--decode-tokens", type=int, default=64)
    p.add_argument("--decode-batch", type=int, default=8)
    p.add_argument("--decode-rounds", type=int, default=3, help="decode timed N times, median")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--dtype", choices=["float32", "bfloat16"], default="float32")
    p.add_argument("--draft-model", help="mepic-draft's drafter (default: the model itself)")
    p.add_argument(
        "--configs", nargs="+", choices=list(CONFIGS), default=list(CONFIGS),
        help="configurations to run (ratios are against the first listed)",
    )  # fmt: skip
    p.add_argument(
        "--repeats", type=int, default=1,
        help="run the configurations N times, alternated (a process each), to see the spread",
    )  # fmt: skip
    p.add_argument("--job", help=argparse.SUPPRESS)
    args = p.parse_args()
    print_data_only()  # stdout: this script's data only; logs (vLLM's too) to stderr
    if args.job:
        with failures_reported(sys.stdout):  # the parent raises it again, with its reason
            result = worker(json.loads(args.job))
        print("RESULT" + json.dumps(result))
        return

    from ascend_mepic.eval.bench.runner import run_job_process
    from ascend_mepic.eval.prepare import resolve_model

    model = str(resolve_model(args.model))
    env = dict(os.environ, HF_HUB_OFFLINE="1", VLLM_CPU_KVCACHE_SPACE="4")
    print(
        f"model {args.model} ({args.dtype}), {args.requests} SQuAD requests, "
        f"block size {args.block_size}"
    )
    base = args.configs[0]
    print(
        "| paragraphs | repeat | config | prompt tokens | TTFT mean (ms) | TTFT p50 (ms) | "
        f"TTFT vs {base} | warm-up TTFT mean (ms) | warm-up vs {base} | decode tok/s | "
        f"decode vs {base} |"
    )
    print("|---|---|---|---|---|---|---|---|---|---|---|")
    for k in args.chunks:
        ratios: dict[str, list[float]] = {name: [] for name in args.configs}
        for rep in range(args.repeats):
            results = {}
            for name in args.configs:
                job = {
                    "model": model,
                    "requests": args.requests,
                    "chunks": k,
                    "seed": args.seed,
                    "articles": args.articles,
                    "block_size": args.block_size,
                    "decode_tokens": args.decode_tokens,
                    "decode_batch": args.decode_batch,
                    "decode_rounds": args.decode_rounds,
                    "dtype": args.dtype,
                    "draft_model": args.draft_model and str(resolve_model(args.draft_model)),
                    "config": name,
                    **CONFIGS[name],
                }
                argv = [sys.executable, __file__, "--job", json.dumps(job)]
                results[name] = run_job_process(argv, env, 1800, f"bench_serving job {name}")
            ref = results[base]
            for name, r in results.items():
                print(table_row(k, rep, name, r, ref), flush=True)
                ratios[name].append(r["decode_tok_s"] / ref["decode_tok_s"])
            for name, r in results.items():
                if "spec_decode" in r:
                    print(spec_line(k, rep, name, r["spec_decode"]), flush=True)
        if args.repeats > 1:
            for name in args.configs[1:]:
                got = ", ".join(f"{x:.2f}" for x in ratios[name])
                print(
                    f"{k} paragraphs: decode {name} / {base} per repeat {got}; "
                    f"median {statistics.median(ratios[name]):.2f}x"
                )


if __name__ == "__main__":
    main()
