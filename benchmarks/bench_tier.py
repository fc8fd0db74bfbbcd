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
``ascend_mepic.tier.index.choose_load``), all sealed under a tier key, plus ``always`` without a
key (``unsealed``: the BLAKE2b digest instead) for the cost of sealing.

First, without an engine, the loads per second of one worker tier (``WorkerTier.load``: fetch,
open or verify, copy into the KV blocks) with and without the key, side by side, chunks shaped as
the model's; and where a sealed load's time goes (opening the entry vs the BLAKE2b digest).
``--loads-only`` stops there. Prints ratios; asserts nothing about time.
"""

from __future__ import annotations

import argparse
import json
import os
import secrets
import statistics
import sys
import tempfile
import time
from collections.abc import Callable, Sequence
from pathlib import Path

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

    label = f"tier {job['name']}"
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


def kv_shape(model: str, tokens: int) -> tuple[int, int, int, int]:
    """(layers, tokens, KV heads, head size) of a chunk of ``tokens`` tokens of ``model``."""
    config = json.loads((Path(model) / "config.json").read_text())
    head = config.get("head_dim") or config["hidden_size"] // config["num_attention_heads"]
    heads = config.get("num_key_value_heads", config["num_attention_heads"])
    return config["num_hidden_layers"], tokens, heads, head


def load_rate(tier_config: dict, root: Path, shape: tuple, chunks: int, seconds: float) -> dict:
    """Loads per second of one worker tier: ``chunks`` distinct chunks put once, then loaded in
    turn (each load fetches, opens or verifies, and copies into KV blocks) for ``seconds``."""
    import torch

    from ascend_mepic.tier.index import TierConfig
    from ascend_mepic.tier.worker_io import WorkerTier

    layers, tokens, heads, head = shape
    block = 32
    blocks = list(range(-(-tokens // block)))
    caches = [torch.zeros(len(blocks), 2, block, heads, head) for _ in range(layers)]
    tier = WorkerTier(TierConfig.parse(tier_config), root, "bench-tier")
    try:
        ids = [secrets.token_hex(32) for _ in range(chunks)]
        for chunk_id in ids:
            tier.put(chunk_id, torch.randn(layers, tokens, 2, heads * head), tokens)
        tier.flush()
        for chunk_id in ids:  # warm: page cache, LMCache's paths
            assert tier.load(chunk_id, caches, blocks, tokens, 0, block) == "ok"
        loads, start = 0, time.perf_counter()
        while time.perf_counter() - start < seconds or loads < chunks:
            outcome = tier.load(ids[loads % chunks], caches, blocks, tokens, 0, block)
            assert outcome == "ok", outcome
            loads += 1
        elapsed = time.perf_counter() - start
    finally:
        tier.close()
    return {"loads_per_s": loads / elapsed, "ms_per_load": elapsed / loads * 1e3, "loads": loads}


def open_cost(shape: tuple, repeats: int = 20) -> dict[str, float]:
    """Milliseconds to decode one entry (no backend, no copy into blocks): sealed (AES-256-GCM
    open) and unsealed (BLAKE2b digest)."""
    import torch

    from ascend_mepic.tier.sealing import Keyring, TierKey
    from ascend_mepic.tier.worker_io import decode_entry, encode_entry

    layers, tokens, heads, head = shape
    kv = torch.randn(layers, tokens, 2, heads * head)
    ring = Keyring((TierKey.from_hex(secrets.token_hex(32)),))
    out = {}
    for name, key, keyring in (("sealed", ring.sealer, ring), ("unsealed", None, None)):
        blob = encode_entry("ab" * 32, kv, tokens, key)
        decode_entry(blob, "ab" * 32, kv.shape, kv.dtype, keyring)
        start = time.perf_counter()
        for _ in range(repeats):
            decode_entry(blob, "ab" * 32, kv.shape, kv.dtype, keyring)
        out[name] = (time.perf_counter() - start) / repeats * 1e3
    return out


def seal_bench(model: str, args: argparse.Namespace, tmp: str, key_file: str) -> dict:
    """Loads per second with and without the key, CPU and disk tiers, side by side."""
    shape = kv_shape(model, args.load_tokens)
    entry_mb = shape[0] * shape[1] * 2 * shape[2] * shape[3] * 4 / 1e6
    results: dict = {"shape": shape, "entry_mb": entry_mb, "open_ms": open_cost(shape), "rates": {}}
    for tier_name in ("cpu", "disk"):
        for sealed in (True, False):
            config: dict = {"cpu_gib": 1.0}
            if tier_name == "disk":
                config["disk"] = os.path.join(tmp, f"rate-{'sealed' if sealed else 'plain'}")
                config["lmcache"] = {"local_cpu": False}  # every load reads the files
            config.update({"key_file": key_file} if sealed else {})
            if tier_name == "disk" and not sealed:
                config["unauthenticated"] = True
            name = f"{tier_name}/{'sealed' if sealed else 'unsealed'}"
            print(f"measuring loads per second, {name} ...", file=sys.stderr, flush=True)
            root = Path(tmp) / f"rate-root-{tier_name}-{sealed}"
            rate = load_rate(config, root, shape, args.load_chunks, args.load_seconds)
            results["rates"][name] = rate
    return results


def print_seal_bench(r: dict) -> None:
    layers, tokens, heads, head = r["shape"]
    print(
        f"loads per second of one worker tier, {tokens}-token chunks ({layers} layers, "
        f"{heads}x{head} KV heads, float32: {r['entry_mb']:.2f} MB an entry)\n"
    )
    print(
        "| tier | sealed loads/s | unsealed loads/s | sealed ms/load | unsealed ms/load | "
        "sealed/unsealed time |"
    )
    print("|---|---|---|---|---|---|")
    for tier_name in ("cpu", "disk"):
        s, u = r["rates"][f"{tier_name}/sealed"], r["rates"][f"{tier_name}/unsealed"]
        print(
            f"| {tier_name} | {s['loads_per_s']:.1f} | {u['loads_per_s']:.1f} | "
            f"{s['ms_per_load']:.2f} | {u['ms_per_load']:.2f} | "
            f"{s['ms_per_load'] / u['ms_per_load']:.3f}x |"
        )
    o = r["open_ms"]
    print(
        f"\ndecoding one entry alone: sealed (AES-256-GCM open) {o['sealed']:.2f} ms, unsealed "
        f"(BLAKE2b digest) {o['unsealed']:.2f} ms; the open is "
        + ", ".join(
            f"{o['sealed'] / r['rates'][f'{t}/sealed']['ms_per_load'] * 100:.0f}% of a sealed "
            f"{t} load" for t in ("cpu", "disk")
        )
        + "\n"
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
    p.add_argument("--load-tokens", type=int, default=128, help="tokens a chunk (loads/s)")
    p.add_argument("--load-chunks", type=int, default=16, help="distinct chunks (loads/s)")
    p.add_argument("--load-seconds", type=float, default=3.0, help="per tier and key (loads/s)")
    p.add_argument("--loads-only", action="store_true", help="only the loads/s comparison")
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
        key_file = os.path.join(tmp, "tier.key")
        with open(os.open(key_file, os.O_WRONLY | os.O_CREAT, 0o600), "w") as f:
            f.write(secrets.token_hex(32) + "\n")
        seal = seal_bench(model, args, tmp, key_file)
        print_seal_bench(seal)
        if args.loads_only:
            if args.json:
                with open(args.json, "w", encoding="utf-8") as f:
                    json.dump({"config": base, "seal": seal}, f, indent=1)
            return
        modes = args.modes.split(",")
        runs = [(t, m, True) for t in ("cpu", "disk") for m in modes]
        runs += [(t, "always", False) for t in ("cpu", "disk") if "always" in modes]
        for tier_name, mode, sealed in runs:
            tier: dict = {"cpu_gib": 1.0, "load": mode}
            name = f"{tier_name}/{mode}" + ("" if sealed else " unsealed")
            if tier_name == "disk":
                tier["disk"] = os.path.join(tmp, f"disk-{mode}-{sealed}")
                tier["lmcache"] = {"local_cpu": False}  # every load reads the files
            tier.update({"key_file": key_file} if sealed else {})
            if tier_name == "disk" and not sealed:
                tier["unauthenticated"] = True
            print(f"running {name} ...", file=sys.stderr, flush=True)
            results[name] = run_job({**base, "tier": tier, "name": name})
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
            if k.startswith(tier_name + "/") and not k.endswith("unsealed")
        }
        fixed = {k: v for k, v in runs.items() if k != "auto"}
        if "auto" in runs and fixed:
            best = min(fixed, key=fixed.get)
            print(
                f"{tier_name}: auto {runs['auto'] * 1e3:.0f} ms vs best fixed ({best}) "
                f"{fixed[best] * 1e3:.0f} ms: {runs['auto'] / fixed[best]:.2f}x"
            )
    for tier_name in ("cpu", "disk"):
        sealed = results.get(f"{tier_name}/always")
        plain = results.get(f"{tier_name}/always unsealed")
        if sealed and plain:
            s, u = sealed["ttft_s"]["tier"], plain["ttft_s"]["tier"]
            print(
                f"{tier_name}: TTFT from the tier sealed {s * 1e3:.0f} ms vs unsealed "
                f"{u * 1e3:.0f} ms: {s / u:.2f}x"
            )
    if args.json:
        with open(args.json, "w", encoding="utf-8") as f:
            json.dump({"config": base, "seal": seal, "results": results}, f, indent=1)


if __name__ == "__main__":
    main()
