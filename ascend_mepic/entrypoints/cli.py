"""``ascend-mepic``: prepare models, make traces, plan KV capacity with kvsim, serve, and check
a machine (doctor)."""

from __future__ import annotations

import argparse
import json
import os
import sys
from pathlib import Path
from typing import Any

from ascend_mepic.entrypoints.streams import (
    data_stream,
    isolate_stdout,
    log,
    open_output,
    route_logs_to_stderr,
)


def _tokenizer(name: str | None) -> Any:
    if name is None:
        return None
    from transformers import AutoTokenizer

    from ascend_mepic.eval.prepare import resolve_model

    return AutoTokenizer.from_pretrained(str(resolve_model(name)))


def cmd_prepare(args: argparse.Namespace) -> int:
    from ascend_mepic.eval.prepare import (
        DUMMY_MODELS,
        prepare_dummy,
        prepare_smollm2,
        prepare_tiny_llama,
    )

    dummy = args.model in DUMMY_MODELS
    if args.layers is not None and not dummy:
        raise ValueError(f"--layers is for the dummy models ({', '.join(DUMMY_MODELS)})")
    if args.out and args.model == "all":
        raise ValueError("--out names one model's folder: give --model too")
    out = data_stream()
    if dummy:
        dest = Path(args.out) if args.out else None
        path = prepare_dummy(args.model, dest, force=args.force, layers=args.layers)
        out.write(f"{args.model}: {path}\n")
        return 0
    targets = {"smollm2": prepare_smollm2, "tiny": prepare_tiny_llama}
    names = list(targets) if args.model == "all" else [args.model]
    for name in names:
        dest = Path(args.out) if args.out else None
        out.write(f"{name}: {targets[name](dest, force=args.force)}\n")
    return 0


def cmd_trace(args: argparse.Namespace) -> int:
    from ascend_mepic.eval.trace import squad_trace

    tok = _tokenizer(args.tokenizer)
    lines = squad_trace(
        args.requests,
        args.qps,
        args.chunks,
        args.seed,
        tok,
        args.output_tokens,
        args.articles or None,
    )
    out = open_output(args.out)
    n = 0
    for line in lines:
        out.write(json.dumps(line) + "\n")
        n += 1
    out.flush()
    if args.out not in (None, "-"):
        out.close()
        log(f"wrote {n} requests to {args.out}")
    return 0


def cmd_kvsim(args: argparse.Namespace) -> int:
    from ascend_mepic.eval.kvsim import PLACEMENTS, format_table, parse_trace, simulate

    tok = _tokenizer(args.tokenizer)
    with open(args.trace, encoding="utf-8") as f:
        trace = parse_trace(f, tok)
    placements = PLACEMENTS if args.placement == "all" else (args.placement,)
    results = [simulate(trace, p, args.num_blocks, args.block_size) for p in placements]
    data_stream().write(format_table(results) + "\n")
    if args.json:
        data: Any = results[0] if len(results) == 1 else results
        Path(args.json).parent.mkdir(parents=True, exist_ok=True)
        Path(args.json).write_text(json.dumps(data, indent=1) + "\n", encoding="utf-8")
        log(f"wrote {args.json}")
    return 0


def cmd_plugins(args: argparse.Namespace) -> int:
    from ascend_mepic.entrypoints.plugins import allow_mepic_plugins

    environ = {} if args.all_installed else dict(os.environ)
    data_stream().write(allow_mepic_plugins(environ) + "\n")
    return 0


def cmd_serve(vllm_args: list[str]) -> int:
    from ascend_mepic.entrypoints.server import serve

    serve(vllm_args)
    return 0


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="ascend-mepic", description=__doc__)
    sub = p.add_subparsers(dest="command", required=True)

    pre = sub.add_parser("prepare", help="build the bundled model folders (idempotent)")
    pre.add_argument(
        "--model",
        choices=["smollm2", "tiny", "mistral7b-dummy", "all"],
        default="all",
        help="all: smollm2 and tiny. mistral7b-dummy: Mistral-7B-Instruct-v0.3's published "
        "config with SmolLM2's tokenizer and no weights (vLLM's load_format=dummy), a few MB",
    )
    pre.add_argument("--force", action="store_true", help="rebuild even if present")
    pre.add_argument("--out", help="the model's folder (default: under the cache folder)")
    pre.add_argument(
        "--layers",
        type=int,
        help="dummy models only: this many decoder layers, each of the published shape "
        "(a shallower copy for a CPU rehearsal)",
    )
    pre.set_defaults(func=cmd_prepare)

    tr = sub.add_parser("trace", help="write a workload trace (JSONL) to --out or stdout")
    tr_sub = tr.add_subparsers(dest="dataset", required=True)
    sq = tr_sub.add_parser("squad", help="SQuAD v2: K paragraphs per request as chunks")
    sq.add_argument("--requests", type=int, default=200)
    sq.add_argument("--qps", type=float, default=4.0)
    sq.add_argument("--chunks", type=int, default=4)
    sq.add_argument("--seed", type=int, default=0)
    sq.add_argument("--output-tokens", type=int, default=16)
    sq.add_argument(
        "--articles", type=int, default=4, help="hot article set size (0: all 35 articles)"
    )
    sq.add_argument("--tokenizer", help="smollm2, tiny or a model folder (else text segments)")
    sq.add_argument("-o", "--out", help="write the JSONL here (default or '-': stdout)")
    sq.set_defaults(func=cmd_trace)

    ks = sub.add_parser("kvsim", help="trace-driven KV planner over the real block pool")
    ks.add_argument("trace", help="JSONL trace")
    ks.add_argument("--block-size", type=int, default=16)
    ks.add_argument("--num-blocks", type=int, default=4096)
    ks.add_argument("--placement", choices=["mepic", "private", "prefix", "all"], default="all")
    ks.add_argument("--tokenizer", help="needed when the trace has text segments")
    ks.add_argument("--json", help="write the result JSON here (a list for --placement all)")
    ks.set_defaults(func=cmd_kvsim)

    pl = sub.add_parser(
        "plugins",
        help="print the VLLM_PLUGINS value that lets a plain `vllm serve` load MEPIC's endpoint",
        description="vLLM loads endpoint plugins only when VLLM_PLUGINS names them, and a set "
        "VLLM_PLUGINS also filters the platform and general plugins (vllm-ascend's included). "
        "This prints every installed vLLM plugin plus ascend_mepic (or, when VLLM_PLUGINS is "
        "set, its names plus ascend_mepic). "
        "Use: VLLM_PLUGINS=$(ascend-mepic plugins) vllm serve ...",
    )
    pl.add_argument("--all-installed", action="store_true", help="ignore the current VLLM_PLUGINS")
    pl.set_defaults(func=cmd_plugins)

    from ascend_mepic.eval.bench.main import add_parser as add_bench_parser

    add_bench_parser(sub)

    from ascend_mepic.entrypoints.doctor import add_parser as add_doctor_parser

    add_doctor_parser(sub)

    from ascend_mepic.cluster.cli import add_parser as add_route_parser

    add_route_parser(sub)

    # Listed for --help only: main() hands everything after "serve" to vLLM's own parser.
    sub.add_parser(
        "serve",
        help="vLLM's OpenAI server with MEPIC on: serve MODEL [vLLM server options]",
        add_help=False,
    )
    return p


def main(argv: list[str] | None = None) -> int:
    # Before anything imports vLLM: its logs (stdout by default) and ours go to stderr, and
    # stdout carries only the data a command writes (see streams.py).
    # Only a real process entry (argv from the command line) re-points file descriptor 1; a
    # call from Python (tests, notebooks) writes the data to its current sys.stdout.
    entry, argv = argv is None, (sys.argv[1:] if argv is None else argv)
    if argv[:1] == ["serve"]:
        route_logs_to_stderr()
        try:
            return cmd_serve(argv[1:])
        except (ValueError, RuntimeError) as e:
            print(f"ascend-mepic serve: error: {e}", file=sys.stderr)
            return 2
    route_logs_to_stderr()
    if argv[:1] == ["doctor"]:
        # Its own parser: the full one imports the benchmarks and through them vLLM's model stack,
        # which is slow and, on a machine being brought up, may be what is broken.
        from ascend_mepic.entrypoints.doctor import doctor_parser

        args = doctor_parser().parse_args(argv[1:])
    else:
        args = build_parser().parse_args(argv)  # --help is data: printed before the switch below
    if entry:
        isolate_stdout()
    from ascend_mepic.eval.outputs import ResultError

    try:
        return args.func(args)
    except (ValueError, FileNotFoundError) as e:
        print(f"ascend-mepic: error: {e}", file=sys.stderr)
        return 2
    except ResultError as e:  # a failed request or a non-positive time: no result to report
        print(f"ascend-mepic: error: {e}", file=sys.stderr)
        return 1


if __name__ == "__main__":
    sys.exit(main())
