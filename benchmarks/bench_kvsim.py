"""kvsim on SQuAD v2 traces: MEPIC vs private chunk copies vs prefix caching, side by side.

Same trace for every placement; prints peak and mean blocks per placement and the ratios to MEPIC
for each block size and arrival rate. Block accounting only (no model runs).
"""

from __future__ import annotations

import argparse

from ascend_mepic.core.markers import TextSegment, tokenize_segments
from ascend_mepic.core.segments import SegmentKind
from ascend_mepic.entrypoints.streams import print_data_only
from ascend_mepic.eval.kvsim import PLACEMENTS, TraceRequest, simulate
from ascend_mepic.eval.trace import squad_trace


def load_trace(args: argparse.Namespace, qps: float, tokenizer) -> list[TraceRequest]:
    out = []
    lines = squad_trace(
        args.requests, qps, args.chunks, args.seed, None, args.output_tokens, args.articles or None
    )
    for line in lines:
        pieces = [TextSegment(SegmentKind(s["type"]), s["text"]) for s in line["segments"]]
        segs = tokenize_segments(tokenizer, pieces)
        num_tokens = sum(len(s.token_ids) for s in segs)
        duration = 0.0002 * num_tokens + 0.02 * line["output_tokens"]
        out.append(TraceRequest(line["id"], line["arrival"], duration, line["output_tokens"], segs))
    return out


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__)
    p.add_argument("--requests", type=int, default=200)
    p.add_argument("--chunks", type=int, default=4)
    p.add_argument("--qps", type=float, nargs="+", default=[2.0, 10.0, 25.0])
    p.add_argument("--block-sizes", type=int, nargs="+", default=[16, 32, 128])
    p.add_argument("--num-blocks", type=int, default=1 << 16)
    p.add_argument("--output-tokens", type=int, default=16)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--articles", type=int, default=4, help="hot article set (0: all)")
    p.add_argument("--tokenizer", default="smollm2")
    args = p.parse_args()
    print_data_only()  # stdout: this script's data only; logs (vLLM's too) to stderr

    from transformers import AutoTokenizer

    from ascend_mepic.eval.prepare import resolve_model

    tokenizer = AutoTokenizer.from_pretrained(str(resolve_model(args.tokenizer)))
    print(
        f"SQuAD v2, {args.requests} requests, {args.chunks} paragraphs each from "
        f"{args.articles or 'all'} articles, "
        f"pool {args.num_blocks} blocks (peak blocks; ratio = placement / mepic)"
    )
    print(
        "| block size | QPS | mepic peak | mepic mean | private peak | prefix peak | "
        "private/mepic peak | prefix/mepic peak | private/mepic mean | mepic chunk slot use |"
    )
    print("|---|---|---|---|---|---|---|---|---|---|")
    for qps in args.qps:
        trace = load_trace(args, qps, tokenizer)
        for bs in args.block_sizes:
            r = {pl: simulate(trace, pl, args.num_blocks, bs) for pl in PLACEMENTS}
            m = r["mepic"]
            print(
                f"| {bs} | {qps:g} | {m['peak_blocks']} | {m['mean_blocks']:.0f} | "
                f"{r['private']['peak_blocks']} | {r['prefix']['peak_blocks']} | "
                f"{r['private']['peak_blocks'] / m['peak_blocks']:.2f}x | "
                f"{r['prefix']['peak_blocks'] / m['peak_blocks']:.2f}x | "
                f"{r['private']['mean_blocks'] / m['mean_blocks']:.2f}x | "
                f"{m['chunk_slot_utilisation']:.1%} |"
            )


if __name__ == "__main__":
    main()
