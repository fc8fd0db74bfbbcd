"""TTFT of a request whose chunks are on the device, in the CPU tier, on disk, or absent.

Side by side in one run, SmolLM2-135M-Instruct on the CPU, float32, MEPIC, on SQuAD v2 requests
(chat template, K paragraphs of one article as chunks). Per question three requests run alone
with ``max_tokens=1`` (their wall time is the TTFT):

1. ``absent``: the question's paragraphs are new, so every chunk is compiled;
2. ``device``: the same paragraphs reversed, another question: chunks are resident in the pool;
3. ``tier``: every idle chunk is evicted from the pool first (``reset_prefix_cache``), then the
   paragraphs in a third order: chunks come from the tier (or are compiled, per the load mode).

Engines (one process each): the CPU tier (LMCache local CPU backend) and the disk tier (LMCache
``fs`` connector with LMCache's CPU retention off, so every load reads the files), each with the
load modes ``always`` (load), ``never`` (compile) and ``auto`` (measured per-token costs,
``ascend_mepic.tier.index.choose_load``). Prints ratios; asserts nothing about time.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
from collections.abc import Callable, Sequence

from ascend_mepic.entrypoints.streams import print_data_only
from ascend_mepic.eval.outputs import failures_reported, positive, timed_generate


def ttft(generate: Callable[[list, list], Sequence], segments: list, what: str) -> float:
    """Seconds of one segmented request alone with ``max_tokens=1`` through
    ``generate(prompts, params)`` (``LLM.generate``); its output is checked first, so a refused
    request raises with the reason instead of being timed."""
    from vllm import SamplingParams

    from ascend_mepic.offline import segment_request

    prompt, params = segment_request(segments, SamplingParams(temperature=0.0, max_tokens=1))
    return timed_generate(generate, [prompt], [params], what)[1]


def worker(job: dict) -> dict:
    from transformers import AutoTokenizer
    from vllm import LLM

    from ascend_mepic.eval.squad_prompts import chat_segments
    from ascend_mepic.eval.trace import squad_requests
    from ascend_mepic.offline import mepic_llm_kwargs

    tok = AutoTokenizer.from_pretrained(job["model"])
    llm = LLM(
        model=job["model"],
        dtype="float32",
        enforce_eager=True,
        max_model_len=4096,
        block_size=job["block_size"],
        seed=0,
        **mepic_llm_kwargs(tier=job["tier"]),
    )

    def generate(prompts, params):
        return llm.generate(prompts, params, use_tqdm=False)

    label = f"tier {'disk' if job['tier'].get('disk') else 'cpu'}/{job['tier'].get('load')}"
    other = "Which documents mention a date?"
    third = "Which names appear in these documents?"
    times: dict[str, list[float]] = {"absent": [], "device": [], "tier": []}
    for i, (q, paragraphs) in enumerate(
        squad_requests(job["requests"], job["chunks"], job["seed"])
    ):
        what = f"{label}, question {i}"
        segs = chat_segments(tok, q.question, paragraphs)
        times["absent"].append(ttft(generate, segs, f"{what}, absent"))
        segs = chat_segments(tok, other, paragraphs[::-1])
        times["device"].append(ttft(generate, segs, f"{what}, device"))
        llm.reset_prefix_cache()  # evicts every idle chunk (and the prefix cache)
        rotated = paragraphs[1:] + paragraphs[:1]
        segs = chat_segments(tok, third, rotated)
        times["tier"].append(ttft(generate, segs, f"{what}, tier"))
    core = getattr(llm.llm_engine.engine_core, "engine_core", None)
    metrics = core.scheduler.kv_cache_manager.metrics() if core is not None else {}
    return {
        "ttft_s": {k: statistics.mean(v) for k, v in times.items()},
        "metrics": {k: v for k, v in metrics.items() if k.startswith(("tier", "chunk"))},
    }


def table_row(name: str, r: dict) -> str:
    """One Markdown row of a tier / load mode's result; raises on a TTFT that is not positive
    instead of printing it."""
    t = {k: positive(v, f"{name}: mean TTFT, chunks {k} (s)") for k, v in r["ttft_s"].items()}
    m = r["metrics"]
    return (
        f"| {name} | {t['absent'] * 1e3:.0f} | {t['device'] * 1e3:.0f} | "
        f"{t['tier'] * 1e3:.0f} | {t['tier'] / t['absent']:.2f}x | "
        f"{t['device'] / t['absent']:.2f}x | {m.get('tier_loads', 0)} | "
        f"{m.get('tier_fallbacks', 0)} | {m.get('tier_decided_load', 0)} / "
        f"{m.get('tier_decided_compute', 0)} |"
    )


def run_job(job: dict) -> dict:
    from ascend_mepic.eval.bench.runner import run_job_process

    env = dict(
        os.environ,
        HF_HUB_OFFLINE="1",
        VLLM_CPU_KVCACHE_SPACE="2",
        VLLM_ENABLE_V1_MULTIPROCESSING="0",
    )
    return run_job_process(
        [sys.executable, __file__, "--job", json.dumps(job)], env, 3600, f"job {job['tier']}"
    )


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--model", default="smollm2")
    p.add_argument("--requests", type=int, default=6, help="questions (distinct paragraphs)")
    p.add_argument("--chunks", type=int, default=4, help="paragraphs per request")
    p.add_argument("--block-size", type=int, default=32)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--modes", default="always,never,auto")
    p.add_argument("--json", help="write all results here")
    p.add_argument("--job", help=argparse.SUPPRESS)
    args = p.parse_args()
    print_data_only()  # stdout: this script's data only; logs (vLLM's too) to stderr
    if args.job:
        with failures_reported(sys.stdout):  # the parent raises it again, with its reason
            result = worker(json.loads(args.job))
        print("RESULT" + json.dumps(result))
        return

    from ascend_mepic.eval.prepare import resolve_model

    model = str(resolve_model(args.model))
    base = {
        "model": model,
        "requests": args.requests,
        "chunks": args.chunks,
        "seed": args.seed,
        "block_size": args.block_size,
    }
    results: dict[str, dict] = {}
    with tempfile.TemporaryDirectory(prefix="mepic-tier-bench-") as tmp:
        for tier_name in ("cpu", "disk"):
            for mode in args.modes.split(","):
                tier: dict = {"cpu_gib": 1.0, "load": mode}
                if tier_name == "disk":
                    tier["disk"] = os.path.join(tmp, f"disk-{mode}")
                    tier["lmcache"] = {"local_cpu": False}  # every load reads the files
                name = f"{tier_name}/{mode}"
                print(f"running {name} ...", file=sys.stderr, flush=True)
                results[name] = run_job({**base, "tier": tier})
    rows = [table_row(name, r) for name, r in results.items()]  # checked before printing
    print(
        f"model {args.model}, {args.requests} SQuAD questions x {args.chunks} paragraphs, "
        f"block size {args.block_size}, mean TTFT per request (ms)\n"
    )
    print(
        "| tier / load mode | absent | device | tier | tier vs absent | device vs absent | "
        "tier loads | fallbacks | decided load / compute |"
    )
    print("|---|---|---|---|---|---|---|---|---|")
    print("\n".join(rows))
    print()
    for tier_name in ("cpu", "disk"):
        runs = {
            k.split("/")[1]: v["ttft_s"]["tier"]
            for k, v in results.items()
            if k.startswith(tier_name + "/")
        }
        fixed = {k: v for k, v in runs.items() if k != "auto"}
        if "auto" in runs and fixed:
            best = min(fixed, key=fixed.get)
            print(
                f"{tier_name}: auto {runs['auto'] * 1e3:.0f} ms vs best fixed ({best}) "
                f"{fixed[best] * 1e3:.0f} ms: {runs['auto'] / fixed[best]:.2f}x"
            )
    if args.json:
        with open(args.json, "w", encoding="utf-8") as f:
            json.dump({"config": base, "results": results}, f, indent=1)


if __name__ == "__main__":
    main()
