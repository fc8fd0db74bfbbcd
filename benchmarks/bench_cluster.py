"""Routing a RAG workload over MEPIC replicas: round robin vs prefix-aware vs chunk-aware.

Side by side in one run, on one machine (loopback): ``--replicas`` replicas of ``ascend-mepic
serve`` with the bundled SmolLM2-135M, each KV pool sized to hold about ``--pool-fraction`` of
the documents' chunk blocks, behind ``ascend-mepic route`` with each policy in turn, each arm
with and without a shared LMCache tier on Redis (``--tiers``). Every arm starts from fresh
replicas (empty pools, an empty Redis) and sends the same requests.

The workload: ``--articles`` SQuAD v2 articles, ``--paragraphs`` paragraphs each (the
documents' chunks). A request picks an article by a Zipf law (``--zipf``), then ``--chunks`` of
its paragraphs in a shuffled order, and asks one of the article's questions: retrieval returns
passages of one topic together, which is what lets a router keep a topic on one replica. (With
each chunk drawn independently of the others the partition has no structure to find;
docs/results.md gives the simulated numbers for that case.) Requests are sent by
``--concurrency`` closed-loop clients, streaming, ``--max-tokens`` tokens each.

Printed (stdout, a table and one JSON line per arm): the cluster's chunk-hit rate (hits over
hits + misses, summed over replicas' ``/v1/mepic/stats``), tokens computed, TTFT p50 / p95,
throughput, requests per replica and their max/min, the decisions the router's load rule took
away from the best-scoring replica (``diverted``), and ratios against round robin. Asserts
nothing about time.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import math
import random
import secrets
import shutil
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import httpx

from ascend_mepic.cluster.local import LocalCluster, free_port
from ascend_mepic.entrypoints.streams import data_stream
from ascend_mepic.eval.prepare import resolve_model
from ascend_mepic.eval.trace import SYSTEM_PROMPT, load_squad


def log(msg: str) -> None:
    print(msg, file=sys.stderr, flush=True)


def workload(args: argparse.Namespace, tokenizer) -> tuple[list[dict], int]:
    """The requests (completion bodies without the model) and the documents' chunk blocks."""
    articles, questions = load_squad()
    by_article: dict[int, list[str]] = {}
    for q in questions:
        by_article.setdefault(q.article, []).append(q.question)
    chosen = [
        i for i, paras in enumerate(articles) if len(paras) >= args.paragraphs and by_article.get(i)
    ][: args.articles]
    if len(chosen) < args.articles:
        raise SystemExit(f"only {len(chosen)} articles have {args.paragraphs} paragraphs")
    docs = {a: articles[a][: args.paragraphs] for a in chosen}
    blocks = sum(
        len(tokenizer.encode(p, add_special_tokens=False)) // args.block_size
        for paras in docs.values()
        for p in paras
    )
    rnd = random.Random(args.seed)
    order = list(chosen)
    rnd.shuffle(order)  # which article is the most popular
    weights = [1 / (rank + 1) ** args.zipf for rank in range(len(order))]
    requests = []
    for _ in range(args.requests):
        a = rnd.choices(order, weights)[0]
        picked = rnd.sample(docs[a], args.chunks)
        prompt: list = [SYSTEM_PROMPT + "\n\nDocuments:\n"]
        for i, p in enumerate(picked):
            prompt += [{"text": p, "mepic": {"chunk": True}}, "\n\n" if i + 1 < len(picked) else ""]
        prompt[-1] = f"\n\nQuestion: {rnd.choice(by_article[a])}\nAnswer:"
        requests.append({"prompt": prompt, "max_tokens": args.max_tokens, "temperature": 0})
    return requests, blocks


async def drive(url: str, model: str, requests: list[dict], concurrency: int) -> dict:
    """Closed-loop clients; TTFT is the time to the first streamed token event."""
    queue = list(enumerate(requests))
    ttft: list[float] = []
    failed = 0
    async with httpx.AsyncClient(timeout=600) as http:

        async def client() -> None:
            nonlocal failed
            while queue:
                _, body = queue.pop(0)
                t0 = time.perf_counter()
                first = None
                try:
                    async with http.stream(
                        "POST", url + "/v1/completions",
                        json={**body, "model": model, "stream": True},
                    ) as resp:  # fmt: skip
                        if resp.status_code != 200:
                            failed += 1
                            await resp.aread()
                            continue
                        async for line in resp.aiter_lines():
                            if line.startswith("data: ") and first is None and '"text"' in line:
                                first = time.perf_counter() - t0
                except httpx.HTTPError:
                    failed += 1
                    continue
                if first is None:
                    failed += 1
                else:
                    ttft.append(first)

        t0 = time.perf_counter()
        await asyncio.gather(*(client() for _ in range(concurrency)))
        wall = time.perf_counter() - t0
    return {"ttft": ttft, "failed": failed, "wall_s": wall}


def replica_metrics(cluster: LocalCluster) -> list[dict]:
    return [
        httpx.get(r.url + "/v1/mepic/stats", timeout=10).json()["metrics"] for r in cluster.replicas
    ]


def pct(values: list[float], q: float) -> float:
    s = sorted(values)
    return s[min(len(s) - 1, math.ceil(q * len(s)) - 1)] if s else float("nan")


def run_arm(args, model, requests, pool_bytes, policy, tier, workdir) -> dict:
    redis = None
    mepic: dict = {}
    if tier == "redis":
        port = free_port()
        redis = subprocess.Popen(
            ["redis-server", "--port", str(port), "--bind", "127.0.0.1", "--save", ""],
            stdout=subprocess.DEVNULL,
        )  # fmt: skip
        key_file = workdir / f"{policy}-tier.key"  # the replicas share the tier's key
        key_file.write_text(secrets.token_hex(32) + "\n")
        key_file.chmod(0o600)
        mepic["tier"] = {
            "remote": f"redis://127.0.0.1:{port}",
            "cpu_gib": args.tier_cpu_gib,
            "key_file": str(key_file),
        }
    serve = [
        "--dtype", "float32", "--enforce-eager", "--block-size", str(args.block_size),
        "--max-model-len", "2048", "--kv-cache-memory-bytes", str(pool_bytes),
        "--additional-config", json.dumps({"mepic": mepic}),
        # the worker inside the engine core: two processes per replica instead of three (an
        # idle multiprocess worker polls its queue). vLLM's CPU platform turns `uni` back into
        # `mp` unless VLLM_ENABLE_V1_MULTIPROCESSING=0, which the API server's AsyncLLM ignores
        # (its engine core is always a process of its own).
        "--distributed-executor-backend", "uni",
    ]  # fmt: skip
    env = {"VLLM_ENABLE_V1_MULTIPROCESSING": "0"}
    cluster = LocalCluster(model, args.replicas, workdir / f"{policy}-{tier}", serve, env)
    try:
        t0 = time.monotonic()
        cluster.start()
        url = cluster.start_front(policy, model, args.block_size, args.front_args)
        log(f"[{policy}/{tier}] cluster up in {time.monotonic() - t0:.0f} s")
        # one plain request per replica first: the first forward pass of a process is slow
        for r in cluster.replicas:
            hello = {"model": model, "prompt": "Hello", "max_tokens": 1}
            httpx.post(r.url + "/v1/completions", json=hello, timeout=120)
        before = replica_metrics(cluster)
        run = asyncio.run(drive(url, model, requests, args.concurrency))
        after = replica_metrics(cluster)
        front = httpx.get(url + "/cluster/stats", timeout=10).json()
    finally:
        cluster.stop()
        if redis is not None:
            redis.terminate()
            redis.wait()

    def delta(key: str) -> int:
        return sum(a.get(key, 0) - b.get(key, 0) for a, b in zip(after, before, strict=True))

    hits, misses = delta("chunk_hits"), delta("chunk_misses")
    per_replica = [r["routed"] for r in front["replicas"]]
    return {
        "policy": policy,
        "tier": tier,
        "hit_rate": hits / max(1, hits + misses),
        "chunk_hits": hits,
        "chunk_misses": misses,
        "tier_loads": delta("tier_loads"),
        "tokens_computed": delta("tokens_computed"),
        "ttft_p50_ms": 1e3 * statistics.median(run["ttft"]) if run["ttft"] else float("nan"),
        "ttft_p95_ms": 1e3 * pct(run["ttft"], 0.95),
        "throughput_rps": len(run["ttft"]) / run["wall_s"],
        "requests_per_replica": per_replica,
        "imbalance": max(per_replica) / max(1, min(per_replica)),
        "diverted": front["diverted"],
        "failed": run["failed"] + front["failed"],
    }


def main() -> int:
    p = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    p.add_argument("--replicas", type=int, default=3)
    p.add_argument("--policies", nargs="+", default=["round_robin", "prefix", "chunk"])
    p.add_argument("--tiers", nargs="+", default=["none", "redis"], choices=["none", "redis"])
    p.add_argument("--articles", type=int, default=12)
    p.add_argument("--paragraphs", type=int, default=8)
    p.add_argument("--chunks", type=int, default=3)
    p.add_argument("--requests", type=int, default=240)
    p.add_argument("--zipf", type=float, default=0.5)
    p.add_argument("--concurrency", type=int, default=4)
    p.add_argument("--max-tokens", type=int, default=4)
    p.add_argument("--block-size", type=int, default=32)
    p.add_argument("--pool-fraction", type=float, default=0.5)
    p.add_argument(
        "--tier-cpu-gib",
        type=float,
        default=0.05,
        help="each replica's LMCache CPU tier beside Redis (small: Redis is what is shared)",
    )
    p.add_argument("--seed", type=int, default=0)
    p.add_argument(
        "--front-args", nargs=argparse.REMAINDER, default=[],
        help="the rest goes to `ascend-mepic route` (e.g. --queue-gap 3 --load-factor 1.5)",
    )  # fmt: skip
    p.add_argument("--out", type=Path, help="write the JSON results and a plot here")
    args = p.parse_args()
    # SIGTERM unwinds like Ctrl-C, so every arm's replicas and Redis are stopped
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))

    from transformers import AutoTokenizer

    if "redis" in args.tiers and shutil.which("redis-server") is None:
        raise SystemExit("--tiers redis needs redis-server (Debian: apt-get install redis-server)")
    model = str(resolve_model("smollm2"))
    tok = AutoTokenizer.from_pretrained(model)
    requests, doc_blocks = workload(args, tok)
    from transformers import AutoConfig

    cfg = AutoConfig.from_pretrained(model)
    head_dim = getattr(cfg, "head_dim", None) or cfg.hidden_size // cfg.num_attention_heads
    block_bytes = (
        2 * cfg.num_hidden_layers * cfg.num_key_value_heads * head_dim * 4 * args.block_size
    )
    # the chunks' share, plus the private blocks of the requests in flight (prompt, question,
    # each chunk's recomputed first tokens: about one block each)
    private = args.concurrency * (2 + args.chunks)
    pool_blocks = int(args.pool_fraction * doc_blocks) + private
    log(
        f"workload: {len(requests)} requests, {args.articles}x{args.paragraphs} paragraphs = "
        f"{doc_blocks} chunk blocks; pool {pool_blocks} blocks per replica "
        f"({args.pool_fraction:.0%} of the chunks + {private} for requests in flight)"
    )
    results = []
    workdir = Path(tempfile.mkdtemp(prefix="bench-cluster-"))
    for tier in args.tiers:
        for policy in args.policies:
            res = run_arm(args, model, requests, pool_blocks * block_bytes, policy, tier, workdir)
            log(f"[{policy}/{tier}] {json.dumps(res)}")
            results.append(res)
    out = data_stream()
    out.write(
        "| policy | tier | chunk-hit rate | x RR | tokens computed | TTFT p50 ms | x RR | "
        "TTFT p95 ms | req/s | requests per replica | max/min | diverted | failed |\n"
        "| --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- |\n"
    )
    for r in results:
        rr = next(
            x for x in results if x["tier"] == r["tier"] and x["policy"] == results[0]["policy"]
        )
        out.write(
            f"| {r['policy']} | {r['tier']} | {r['hit_rate']:.3f} | "
            f"{r['hit_rate'] / max(rr['hit_rate'], 1e-9):.2f} | {r['tokens_computed']} | "
            f"{r['ttft_p50_ms']:.0f} | {r['ttft_p50_ms'] / rr['ttft_p50_ms']:.2f} | "
            f"{r['ttft_p95_ms']:.0f} | {r['throughput_rps']:.2f} | {r['requests_per_replica']} | "
            f"{r['imbalance']:.2f} | {r['diverted']} | {r['failed']} |\n"
        )  # fmt: skip
    for r in results:
        out.write(json.dumps(r) + "\n")
    if args.out:
        args.out.mkdir(parents=True, exist_ok=True)
        meta = vars(args) | {"out": str(args.out)}
        text = json.dumps({"args": meta, "results": results}, indent=1)
        (args.out / "bench_cluster.json").write_text(text)
        plot(results, args.out / "bench_cluster.png")
    return 0


def plot(results: list[dict], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, 3, figsize=(12, 3.6))
    labels = [f"{r['policy']}\n{r['tier']}" for r in results]
    for ax, key, title in zip(
        axes,
        ("hit_rate", "ttft_p50_ms", "imbalance"),
        ("cluster chunk-hit rate", "TTFT p50 (ms)", "requests max/min per replica"),
        strict=True,
    ):
        ax.bar(labels, [r[key] for r in results], color=["#888", "#59a", "#d62"] * 2)
        ax.set_title(title)
        ax.tick_params(axis="x", labelsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    log(f"plot: {path}")


if __name__ == "__main__":
    sys.exit(main())
