"""``ascend-mepic bench {compare,qps,chunks,workload}``: the MEPIC paper's serving experiments
(Table 1, Table 2, Fig. 6-8) in the real vLLM engine, one subprocess per policy and run."""

from __future__ import annotations

import argparse
import json
import textwrap
from pathlib import Path
from typing import Any

from ascend_mepic.entrypoints.streams import data_stream, log
from ascend_mepic.eval.bench import stats
from ascend_mepic.eval.bench.plots import pyplot

DEFAULT_COMPARE = ["full", "prefix", "naive", "epic-16", "cacheblend-15", "cachetune-15", "mepic"]
# make demo: Table 2's policies (MEPIC and both baselines) and full recompute for fidelity.
QUICK_COMPARE = ["full", "epic-16", "cacheblend-15", "mepic"]
SWEEP_POLICIES = ["full", "mepic", "epic-16", "cacheblend-15"]
QUICK_SWEEP_POLICIES = ["mepic", "cacheblend-15"]

KV_NOTE = (
    "KV usage = used blocks / pool blocks, sampled after every engine step. For MEPIC-manager "
    "policies, used = referenced blocks (idle cached chunk blocks are evictable and not counted); "
    "for stock vLLM (prefix), cached-but-free prefix blocks count as free."
)


def _model(name: str) -> str:
    from ascend_mepic.eval.prepare import resolve_model

    return str(resolve_model(name))


def _job(args: argparse.Namespace, policy: str, qps: float, chunks: int) -> dict[str, Any]:
    from ascend_mepic.eval.bench.runner import bench_job

    return bench_job(args, _model(args.model), policy, qps, chunks, progress=not args.no_progress)


def _run_policies(
    args: argparse.Namespace, policies: list[str], qps: float, chunks: int, out: Path, tag: str
) -> list[dict[str, Any]]:
    """Run each policy (full first, for fidelity) and write one JSON per policy."""
    from ascend_mepic.eval.bench.runner import run_in_subprocess

    order = sorted(policies, key=lambda p: p != "full")
    raws: dict[str, dict] = {}
    for p in order:
        log(f"[bench] {tag}: {p}")
        raws[p] = run_in_subprocess(_job(args, p, qps, chunks))
        (out / f"{tag}_{p}.raw.json").write_text(json.dumps(raws[p]) + "\n", encoding="utf-8")
    rows = []
    for p in policies:
        row = stats.summarize(raws[p], raws.get("full"))
        row["engine"] = raws[p].get("engine")  # what the engine resolved (dtype, platform)
        (out / f"{tag}_{p}.json").write_text(json.dumps(row, indent=1) + "\n", encoding="utf-8")
        rows.append(row)
    return rows


def _plot_timeline(rows: list[dict], path: Path) -> None:
    plt = pyplot()
    if plt is None:
        return
    fig, ax = plt.subplots(figsize=(7, 4))
    for r in rows:
        tl = r["kv_timeline"]
        ax.plot([t for t, _ in tl], [100 * u / r["pool_blocks"] for _, u in tl], label=r["policy"])
    ax.set_xlabel("time (s)")
    ax.set_ylabel("KV usage (% of pool)")
    ax.set_title("KV cache usage over time (cf. MEPIC Fig. 6)")
    ax.legend()
    fig.tight_layout()
    fig.savefig(path)
    plt.close(fig)


def _plot_compare(rows: list[dict], path: Path, title: str) -> bool:
    """Peak KV (% of pool) and mean latency per policy, side by side."""
    plt = pyplot()
    if plt is None:
        return False
    names = [r["policy"] for r in rows]
    colors = ["tab:green" if n == "mepic" else "tab:gray" for n in names]
    fig, (a1, a2) = plt.subplots(1, 2, figsize=(10, 4))
    kv = [100 * (r["peak_kv_usage"] or 0) for r in rows]
    lat = [r["latency_mean_s"] for r in rows]
    for ax, vals, label, fmt in (
        (a1, kv, "peak KV usage (% of pool)", "{:.1f}%"),
        (a2, lat, "mean request latency (s)", "{:.2f}"),
    ):
        bars = ax.bar(names, vals, color=colors)
        ax.bar_label(bars, labels=[fmt.format(v) for v in vals])
        ax.set_ylabel(label)
        ax.tick_params(axis="x", rotation=20)
    wrapped = "\n".join(textwrap.fill(line, 110) for line in title.splitlines())
    fig.suptitle(wrapped, fontsize=10)
    fig.tight_layout()
    fig.savefig(path)
    plt.close(fig)
    return True


def _plot_sweep(rows: list[dict], xname: str, path: Path, title: str) -> None:
    plt = pyplot()
    if plt is None:
        return
    fig, (a1, a2) = plt.subplots(1, 2, figsize=(10, 4))
    for p in dict.fromkeys(r["policy"] for r in rows):
        rs = sorted((r for r in rows if r["policy"] == p), key=lambda r: r["x"])
        xs = [r["x"] for r in rs]
        a1.plot(xs, [r["latency_mean_s"] for r in rs], marker="o", label=p)
        a2.plot(xs, [100 * r["peak_kv_usage"] for r in rs], marker="o", label=p)
    a1.set_xlabel(xname)
    a1.set_ylabel("mean latency (s)")
    a2.set_xlabel(xname)
    a2.set_ylabel("peak KV usage (% of pool)")
    a1.legend()
    fig.suptitle(title)
    fig.tight_layout()
    fig.savefig(path)
    plt.close(fig)


def _engine_words(rows: list[dict]) -> str:
    """``float32, CPU``: the dtype and platform the engines resolved (runner's ``engine``)."""
    engine = next((r["engine"] for r in rows if r.get("engine")), None)
    if not engine:
        return "float32, CPU"
    return f"{engine['dtype']}, {engine['device'].upper()}"


def _notes(args: argparse.Namespace, rows: list[dict] = ()) -> list[str]:
    return [
        f"Model {args.model} ({_engine_words(list(rows))}), greedy, max_tokens {args.max_tokens}, "
        f"SQuAD v2 chat prompts, {args.articles} hot articles, seed {args.seed}, "
        f"KV pool {args.kv_gib} GiB, per-step token budget "
        f"{args.max_batched_tokens or 'vLLM default (4096 on CPU)'}.",
        "",
        KV_NOTE,
        "",
        "Latency and TTFT run from each request's scheduled Poisson arrival time (so time a "
        "request waits for the driver's current engine step counts); throughput is output "
        "tokens / (last finish - first arrival). The engine step loop is driven in-process "
        "(VLLM_ENABLE_V1_MULTIPROCESSING=0), one subprocess per policy and sweep point.",
        "",
        stats.KL_NOTE,
        "",
        "Recomputed tokens: MEPIC-manager policies use the manager's tokens_computed (including "
        "chunk compiles) and tokens_reused; prefix/full use prompt tokens minus vLLM's "
        "num_cached_tokens. Counting follows each policy's manager: CacheBlend counts every "
        "chunk token as computed (all run up to its check layer); EPIC counts loaded chunk KV "
        "as reused.",
    ]


def cmd_compare(args: argparse.Namespace) -> int:
    if args.quick:
        # Table 2's workload (24 requests on one article at QPS 4): enough concurrent requests
        # that chunks are shared, the demo's point; two policies keep it to minutes.
        args.requests, args.max_tokens, args.articles, args.qps = 24, 8, 1, 4.0
        policies = args.policies or QUICK_COMPARE
    else:
        policies = args.policies or DEFAULT_COMPARE
    out = Path(args.out or "results/bench/compare")
    out.mkdir(parents=True, exist_ok=True)
    rows = _run_policies(args, policies, args.qps, args.chunks, out, "compare")
    _plot_timeline(rows, out / "fig6_kv_timeline.png")
    plot = out / "summary.png"
    verdict = stats.verdict(rows)
    plotted = _plot_compare(rows, plot, verdict)
    report = stats.render_compare_report(rows, "MEPIC bench: policy comparison", _notes(args, rows))
    (out / "report.md").write_text(report, encoding="utf-8")
    summary = stats.render_compare_summary(
        rows, str(out / "report.md"), str(plot) if plotted else None
    )
    (out / "summary.md").write_text(summary, encoding="utf-8")
    data_stream().write(summary)
    return 0


def _sweep(args: argparse.Namespace, points: list, xname: str, name: str, paper: str) -> int:
    policies = args.policies or (QUICK_SWEEP_POLICIES if args.quick else SWEEP_POLICIES)
    out = Path(args.out or f"results/bench/{name}")
    out.mkdir(parents=True, exist_ok=True)
    rows = []
    for x in points:
        qps = x if xname == "QPS" else args.qps
        chunks = x if xname == "chunks" else args.chunks
        tag = f"{name}_{x:g}"
        for r in _run_policies(args, policies, qps, chunks, out, tag):
            rows.append({**r, "x": x})
    slim = [{k: v for k, v in r.items() if k != "kv_timeline"} for r in rows]
    (out / "sweep.json").write_text(json.dumps(slim, indent=1) + "\n", encoding="utf-8")
    fig = "fig7_qps.png" if xname == "QPS" else "fig8_chunks.png"
    _plot_sweep(rows, xname, out / fig, f"latency and peak KV vs {xname}")
    report = stats.render_sweep_report(
        rows, f"MEPIC bench: {xname} sweep", xname, paper, _notes(args, rows)
    )
    (out / "report.md").write_text(report, encoding="utf-8")
    data_stream().write(report)
    log(f"wrote {out}")
    return 0


def cmd_qps(args: argparse.Namespace) -> int:
    if args.full:
        args.requests, points = 200, [2, 5, 10, 15, 20, 25]
    elif args.quick:
        args.requests, args.max_tokens, args.articles, points = 4, 8, 1, [1, 4]
    else:
        points = [1, 2, 4]
    points = args.points or points
    paper = (
        f"peak KV, CacheBlend-15 / MEPIC up to {stats.PAPER_QPS_RATIO['cacheblend-15']}x, "
        f"EPIC-16 / MEPIC up to {stats.PAPER_QPS_RATIO['epic-16']}x (QPS sweep)."
    )
    return _sweep(args, points, "QPS", "qps", paper)


def cmd_chunks(args: argparse.Namespace) -> int:
    if args.quick:
        args.requests, args.max_tokens, args.articles = 6, 8, 1
    points = args.points or ([2, 4] if args.quick else [2, 4, 8])
    lo, hi = stats.PAPER_CHUNK_RATIO
    paper = f"peak KV of the baselines / MEPIC {lo}-{hi}x over 2..16 chunks per request."
    return _sweep(args, [int(x) for x in points], "chunks", "chunks", paper)


def cmd_workload(args: argparse.Namespace) -> int:
    from transformers import AutoTokenizer

    from ascend_mepic.eval.bench.runner import build_requests

    tok = AutoTokenizer.from_pretrained(_model(args.model))
    rows = []
    for k in args.points or [2, 4, 8]:
        job = {"requests": args.requests, "chunks": int(k), "seed": args.seed}
        job["articles"] = args.articles
        segs = [s for _, s in build_requests(tok, job)]
        st = stats.workload_stats(segs, args.block_size, ["full", "mepic", "epic-16"])
        rows.append({"chunks": int(k), **st})
    out = Path(args.out or "results/bench/workload")
    out.mkdir(parents=True, exist_ok=True)
    (out / "workload.json").write_text(json.dumps(rows, indent=1) + "\n", encoding="utf-8")
    lines = [
        "# Workload statistics (cf. MEPIC Table 1)",
        "",
        f"{args.requests} SQuAD v2 chat requests, {args.articles} hot articles, "
        f"block size {args.block_size}.",
        "",
        "| chunks | mean prompt tokens | reused fraction | mepic recomputed/req (steady) | "
        "mepic recomputed/req (first seen in full) | epic-16 recomputed/req (steady) |",
        "|---|---|---|---|---|---|",
    ]
    for r in rows:
        lines.append(
            f"| {r['chunks']} | {r['prompt_tokens_mean']:.1f} | {r['reused_fraction']:.3f} | "
            f"{r['recomputed_steady']['mepic']:.1f} | {r['recomputed_first_seen']['mepic']:.1f} | "
            f"{r['recomputed_steady']['epic-16']:.1f} |"
        )
    report = "\n".join(lines) + "\n"
    (out / "report.md").write_text(report, encoding="utf-8")
    data_stream().write(report)
    log(f"wrote {out}")
    return 0


def add_parser(sub: Any) -> None:
    b = sub.add_parser("bench", help="online-style serving benchmarks in the real engine")
    bsub = b.add_subparsers(dest="bench", required=True)

    def common(p: argparse.ArgumentParser, requests: int) -> None:
        p.add_argument("--model", default="smollm2")
        p.add_argument("--requests", type=int, default=requests)
        p.add_argument("--chunks", type=int, default=4, help="paragraphs per request")
        p.add_argument("--articles", type=int, default=4, help="hot SQuAD article set size")
        p.add_argument(
            "--block-size",
            type=int,
            default=16,
            help="KV block size (the paper's 16; stock vLLM's prefix baseline runs at 32 on CPU)",
        )
        p.add_argument("--qps", type=float, default=2.0)
        p.add_argument("--max-tokens", type=int, default=32)
        p.add_argument("--seed", type=int, default=0)
        p.add_argument(
            "--kv-gib",
            type=int,
            default=1,
            help="KV pool in GiB (CPU: VLLM_CPU_KVCACHE_SPACE; CUDA: kv_cache_memory_bytes)",
        )
        p.add_argument(
            "--device",
            choices=["auto", "cpu", "cuda"],
            default="auto",
            help="the vLLM platform every engine must run on (auto: the one vLLM resolves); "
            "cuda is UNTESTED ON A GPU",
        )
        p.add_argument("--dtype", help="model dtype (default: float32 on CPU, bfloat16 on CUDA)")
        p.add_argument(
            "--graphs",
            choices=["eager", "compiled"],
            help="CUDA: eager (default) or compiled (vLLM's torch.compile and CUDA graphs, "
            "piecewise for MEPIC; compiling takes minutes on a fresh machine). CPU: eager",
        )
        p.add_argument(
            "--load-format",
            choices=["auto", "dummy"],
            help="dummy: random weights from the model's config (the default for a folder made "
            "by `ascend-mepic prepare --model mistral7b-dummy`)",
        )
        p.add_argument(
            "--gpu-memory-utilization",
            type=float,
            help="CUDA: vLLM's gpu_memory_utilization (the share of the GPU that must be free at "
            "start-up; the KV pool is --kv-gib)",
        )
        p.add_argument(
            "--max-batched-tokens",
            type=int,
            help="vLLM's per-step token budget (default: vLLM's, 4096 on CPU)",
        )
        p.add_argument("--policies", nargs="+")
        p.add_argument("--quick", action="store_true", help="demo sizes (minutes on 2 cores)")
        p.add_argument("--no-progress", action="store_true")
        p.add_argument("--out", help="output folder (default results/bench/<name>/)")

    c = bsub.add_parser("compare", help="policies side by side (Table 2, Fig. 6)")
    common(c, 40)
    c.set_defaults(func=cmd_compare)
    q = bsub.add_parser("qps", help="latency and peak KV vs QPS (Fig. 7)")
    common(q, 30)
    q.add_argument("--points", type=float, nargs="+", help="QPS values")
    q.add_argument("--full", action="store_true", help="paper sizes: 200 requests, QPS 2..25")
    q.set_defaults(func=cmd_qps)
    k = bsub.add_parser("chunks", help="latency and peak KV vs chunks per request (Fig. 8)")
    common(k, 30)
    k.add_argument("--points", type=int, nargs="+", help="chunk counts (2..16)")
    k.set_defaults(func=cmd_chunks)
    kern = bsub.add_parser(
        "kernels", help="MEPIC's CPU attention kernel vs vLLM's on the same shapes (no engine)"
    )
    from ascend_mepic.eval.bench.kernels import add_arguments as add_kernel_arguments

    add_kernel_arguments(kern)
    fid = bsub.add_parser(
        "fidelity", help="a model's answers under each policy vs full: run before turning MEPIC on"
    )
    from ascend_mepic.eval.bench.fidelity import add_arguments as add_fidelity_arguments

    add_fidelity_arguments(fid)
    fref = bsub.add_parser(
        "fidelity-ref",
        help="PIC variants on the same requests in the transformers reference (no engine): KL, "
        "top-1, F1 with paired intervals vs the default, private tokens and blocks",
    )
    from ascend_mepic.eval.bench.fidelity_ref import add_arguments as add_fidelity_ref_arguments

    add_fidelity_ref_arguments(fref)
    from ascend_mepic.eval.bench.simulate import add_parsers as add_simulate_parsers

    add_simulate_parsers(bsub)
    e = bsub.add_parser(
        "engine",
        help="stock vLLM vs MEPIC at a model's full shape, dummy weights (mistral7b-dummy): "
        "TTFT, throughput, peak KV, recomputed tokens (issue 49's GPU run; CUDA UNTESTED ON A GPU)",
    )
    common(e, 24)
    from ascend_mepic.eval.bench.engine import add_arguments as add_engine_arguments

    add_engine_arguments(e)
    w = bsub.add_parser("workload", help="Table 1 workload statistics (no engine)")
    common(w, 200)
    w.add_argument("--points", type=int, nargs="+", help="chunk counts")
    w.set_defaults(func=cmd_workload)
