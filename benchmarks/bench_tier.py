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


class LoadLoop:
    """One worker tier holding ``chunks`` distinct chunks, loaded in turn into KV blocks (each
    load fetches, opens or verifies, and copies)."""

    def __init__(self, tier_config: dict, root: Path, shape: tuple, chunks: int) -> None:
        import torch

        from ascend_mepic.tier.index import TierConfig
        from ascend_mepic.tier.worker_io import WorkerTier

        layers, self.tokens, heads, head = shape
        self.blocks = list(range(-(-self.tokens // 32)))
        self.caches = [torch.zeros(len(self.blocks), 2, 32, heads, head) for _ in range(layers)]
        self.tier = WorkerTier(TierConfig.parse(tier_config), root, "bench-tier")
        self.ids = [secrets.token_hex(32) for _ in range(chunks)]
        for chunk_id in self.ids:
            self.tier.put(chunk_id, torch.randn(layers, self.tokens, 2, heads * head), self.tokens)
        self.tier.flush()
        self.window(0.0)  # warm: page cache, LMCache's paths

    def window(self, seconds: float) -> float:
        """Milliseconds per load over at least ``seconds`` (and every chunk once)."""
        loads, start = 0, time.perf_counter()
        while time.perf_counter() - start < seconds or loads < len(self.ids):
            chunk_id = self.ids[loads % len(self.ids)]
            outcome = self.tier.load(chunk_id, self.caches, self.blocks, self.tokens, 0, 32)
            assert outcome == "ok", outcome
            loads += 1
        return (time.perf_counter() - start) / loads * 1e3


def decode_costs(shape: tuple, repeats: int = 20) -> dict[str, float]:
    """Milliseconds of a load's parts without a backend: decoding an entry sealed (AES-256-GCM
    open) and unsealed (BLAKE2b digest), and copying the KV into blocks."""
    import torch

    from ascend_mepic.tier.sealing import Keyring, TierKey
    from ascend_mepic.tier.transfer import load_tokens
    from ascend_mepic.tier.worker_io import decode_entry, encode_entry

    layers, tokens, heads, head = shape
    kv = torch.randn(layers, tokens, 2, heads * head)
    ring = Keyring((TierKey.from_hex(secrets.token_hex(32)),))
    blocks = list(range(-(-tokens // 32)))
    caches = [torch.zeros(len(blocks), 2, 32, heads, head) for _ in range(layers)]
    parts: dict[str, Callable[[], object]] = {}
    for name, key, keyring in (("sealed", ring.sealer, ring), ("unsealed", None, None)):
        blob = encode_entry("ab" * 32, kv, tokens, key)
        parts[name] = lambda b=blob, r=keyring: decode_entry(b, "ab" * 32, kv.shape, kv.dtype, r)
    parts["copy"] = lambda: load_tokens(caches, kv, blocks, 0, 32)
    out = {}
    for name, part in parts.items():
        part()
        start = time.perf_counter()
        for _ in range(repeats):
            part()
        out[name] = (time.perf_counter() - start) / repeats * 1e3
    return out


def seal_bench(model: str, args: argparse.Namespace, tmp: str, key_file: str) -> dict:
    """Milliseconds per load with and without the key, CPU and disk tiers, side by side: the
    four tiers' windows interleaved over ``--load-rounds`` rounds (a shared machine's load
    drifts), the median kept."""
    shape = kv_shape(model, args.load_tokens)
    loops: dict[str, LoadLoop] = {}
    try:
        for tier_name in ("cpu", "disk"):
            for sealed in (True, False):
                name = f"{tier_name}/{'sealed' if sealed else 'unsealed'}"
                config: dict = {"cpu_gib": 1.0}
                if tier_name == "disk":
                    config["disk"] = os.path.join(tmp, f"rate-{'sealed' if sealed else 'plain'}")
                    config["lmcache"] = {"local_cpu": False}  # every load reads the files
                config.update({"key_file": key_file} if sealed else {})
                if tier_name == "disk" and not sealed:
                    config["unauthenticated"] = True
                root = Path(tmp) / f"rate-root-{tier_name}-{sealed}"
                loops[name] = LoadLoop(config, root, shape, args.load_chunks)
        print("measuring loads per second ...", file=sys.stderr, flush=True)
        windows: dict[str, list[float]] = {name: [] for name in loops}
        for _ in range(args.load_rounds):
            for name, loop in loops.items():
                windows[name].append(loop.window(args.load_seconds))
    finally:
        for loop in loops.values():
            loop.tier.close()
    return {
        "shape": shape,
        "entry_mb": shape[0] * shape[1] * 2 * shape[2] * shape[3] * 4 / 1e6,
        "parts_ms": decode_costs(shape),
        "ms_per_load": {name: statistics.median(w) for name, w in windows.items()},
        "windows_ms": windows,
    }


def print_seal_bench(r: dict) -> None:
    layers, tokens, heads, head = r["shape"]
    ms = r["ms_per_load"]
    print(
        f"loads per second of one worker tier, {tokens}-token chunks ({layers} layers, "
        f"{heads}x{head} KV heads, float32: {r['entry_mb']:.2f} MB an entry), median of "
        f"{len(next(iter(r['windows_ms'].values())))} interleaved windows\n"
    )
    print(
        "| tier | sealed loads/s | unsealed loads/s | sealed ms/load | unsealed ms/load | "
        "sealed/unsealed time |"
    )
    print("|---|---|---|---|---|---|")
    for t in ("cpu", "disk"):
        sealed, plain = ms[f"{t}/sealed"], ms[f"{t}/unsealed"]
        print(
            f"| {t} | {1e3 / sealed:.1f} | {1e3 / plain:.1f} | {sealed:.2f} | {plain:.2f} | "
            f"{sealed / plain:.3f}x |"
        )
    p = r["parts_ms"]
    shares = ", ".join(
        f"{p['sealed'] / ms[f'{t}/sealed'] * 100:.0f}% of a sealed {t} load"
        for t in ("cpu", "disk")
    )
    print(
        f"\nparts of a load, alone: AES-256-GCM open {p['sealed']:.2f} ms, BLAKE2b digest "
        f"{p['unsealed']:.2f} ms, copy into blocks {p['copy']:.2f} ms; the open is {shares}\n"
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
    p.add_argument("--load-seconds", type=float, default=1.0, help="a window (loads/s)")
    p.add_argument("--load-rounds", type=int, default=5, help="windows per tier (loads/s)")
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
            backend = "RemoteBackend" if tier_name == "disk" else "LocalCPUBackend"
            cost = f"tier_load_us_per_token_{backend}"  # the worker's measured loads (EMA)
            ls, lu = sealed["metrics"].get(cost), plain["metrics"].get(cost)
            per_token = f"; load cost {ls} vs {lu} us/token" if ls and lu else ""
            print(
                f"{tier_name}: TTFT from the tier sealed {s * 1e3:.0f} ms vs unsealed "
                f"{u * 1e3:.0f} ms: {s / u:.2f}x{per_token}"
            )
    if args.json:
        with open(args.json, "w", encoding="utf-8") as f:
            json.dump({"config": base, "seal": seal, "results": results}, f, indent=1)


if __name__ == "__main__":
    main()
