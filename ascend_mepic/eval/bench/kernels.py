"""``ascend-mepic bench kernels``: MEPIC's CPU attention kernel against vLLM's, on the same shapes.

Both kernels run in this process on the same threads, dtype, block size and context: vLLM's CPU
attention (``cpu_attention_with_kv_cache``, what CPU_ATTN runs, K stored rotated) and MEPIC's
native kernel (``csrc/cpu/``, K stored un-rotated in the serving backend's cache layout and
rotated at read, the op contract's plain metadata: every block full, positions = indices). Before
timing, the two outputs are compared (the same attention, RoPE applied at write for vLLM and at
read for MEPIC), so a ratio is never reported for a kernel that computes something else.

Ratios are throughputs, MEPIC over vLLM (above 1: MEPIC faster): ``decode_vs_vllm`` (one query
per sequence over ``context`` keys, ``batch`` sequences) and ``prefill_vs_vllm`` (one sequence of
``context`` queries, causal). The JSON keeps every timing, the shapes and the machine.
"""

from __future__ import annotations

import argparse
import json
import platform
import statistics
import time
from pathlib import Path
from typing import Any

import torch

from ascend_mepic.eval.outputs import positive
from ascend_mepic.host import cpu_info
from ascend_mepic.ops import cpu_kernel
from ascend_mepic.ops.layout import cache_view
from ascend_mepic.ops.metadata import PagedRopeMetadata
from ascend_mepic.ops.reference import rope_paged_attention_reference, write_kv
from ascend_mepic.ops.rope import RopeSpec, default_cos_sin_cache
from ascend_mepic.vllm_integration.cpu_attention import StockCpuAttention

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16}


def _rotate(x: torch.Tensor, pos: torch.Tensor, cos_sin: torch.Tensor) -> torch.Tensor:
    """Neox RoPE of ``x [N, H, D]`` at ``pos [N]`` (float32)."""
    cos, sin = cos_sin[pos].float().chunk(2, dim=-1)
    cos, sin = cos[:, None], sin[:, None]
    x1, x2 = x.float().chunk(2, dim=-1)
    return torch.cat((x1 * cos - x2 * sin, x2 * cos + x1 * sin), dim=-1)


class Case:
    """One shape: random K/V written to both caches, both kernels' inputs prepared."""

    def __init__(
        self,
        num_seqs: int,
        num_queries: int,
        context: int,
        heads: int,
        kv_heads: int,
        head: int,
        block: int,
        dtype: torch.dtype,
        seed: int = 0,
    ) -> None:
        gen = torch.Generator().manual_seed(seed)
        blocks_per_seq = -(-context // block)
        nb = num_seqs * blocks_per_seq + 1
        self.scale = head**-0.5
        cos_sin = default_cos_sin_cache(head, context, 10000.0)
        self.rope = RopeSpec.from_cache(cos_sin, True)
        tables = torch.arange(1, nb, dtype=torch.int32).view(num_seqs, blocks_per_seq)
        pos = torch.arange(context)
        key = torch.randn(num_seqs, context, kv_heads, head, generator=gen)
        value = torch.randn(num_seqs, context, kv_heads, head, generator=gen)
        slots = (tables.long()[:, pos // block] * block + pos % block).flatten()
        query_pos = pos[context - num_queries :]
        q = torch.randn(num_seqs * num_queries, heads, head, generator=gen)
        self.query = q.to(dtype)

        # MEPIC: un-rotated, in the backend's layout (``ops.layout.cache_view``: per block and KV
        # head, K rows then V rows), the plain op-contract metadata.
        raw = torch.zeros(nb, kv_heads * 2 * block * head, dtype=dtype)
        self.mepic_cache = cache_view(raw, kv_heads, head)
        write_kv(key.flatten(0, 1), value.flatten(0, 1), self.mepic_cache, slots)
        first = (torch.arange(blocks_per_seq, dtype=torch.int32) * block).expand(num_seqs, -1)
        loc = torch.arange(num_seqs + 1, dtype=torch.int32) * num_queries
        self.meta = PagedRopeMetadata(
            block_size=block,
            query_start_loc=loc,
            query_positions=query_pos.repeat(num_seqs).to(torch.int32),
            query_indices=query_pos.repeat(num_seqs).to(torch.int32),
            block_tables=tables,
            num_blocks=torch.full((num_seqs,), blocks_per_seq, dtype=torch.int32),
            block_first_pos=first.contiguous(),
            block_valid_start=torch.zeros_like(tables),
            block_valid_end=torch.full_like(tables, block),
            max_query_len=num_queries,
            max_num_blocks=blocks_per_seq,
        )

        # vLLM: K rotated at write time, its own cache layout and scheduler metadata.
        rotated = _rotate(key.flatten(0, 1), pos.repeat(num_seqs), cos_sin)
        self.stock = StockCpuAttention(
            rotated, value.flatten(0, 1), slots, nb, block, tables, loc,
            torch.full((num_seqs,), context, dtype=torch.int32), heads, dtype,
        )  # fmt: skip
        self.isa = self.stock.isa
        self.vllm_query = _rotate(q, query_pos.repeat(num_seqs), cos_sin).to(dtype)
        self.out = torch.empty_like(self.vllm_query)
        self.mepic_out = torch.empty_like(self.query)

    def run_vllm(self) -> torch.Tensor:
        return self.stock.run(self.vllm_query, self.out, self.scale)

    def run_mepic(self) -> torch.Tensor:
        # Into a buffer made once, as vLLM's op writes its `output` (and the engine passes the
        # attention layer's output to both).
        return cpu_kernel.rope_paged_attention_cpu(
            self.query, self.mepic_cache, self.meta, self.rope, self.scale, out=self.mepic_out
        )

    def run_reference(self) -> torch.Tensor:
        """The torch reference on the same inputs: the oracle, and the CPU path without a kernel."""
        return rope_paged_attention_reference(
            self.query, self.mepic_cache, self.meta, self.rope, self.scale
        )


def _time(fns: dict[str, Any], repeats: int) -> dict[str, float]:
    """Median seconds per call of each function, timed in turns (one call of each per round),
    so that a machine's drift (another job, frequency) falls on every kernel alike."""
    for fn in fns.values():
        fn()  # warm-up
    times: dict[str, list[float]] = {name: [] for name in fns}
    for _ in range(repeats):
        for name, fn in fns.items():
            start = time.perf_counter()
            fn()
            times[name].append(time.perf_counter() - start)
    return {name: statistics.median(t) for name, t in times.items()}


def run(
    context: int = 2048,
    batch: int = 8,
    heads: int = 9,
    kv_heads: int = 3,
    head: int = 64,
    block: int = 128,
    dtypes: tuple[str, ...] = ("float32", "bfloat16"),
    threads: int | None = None,
    repeats: int = 5,
    with_reference: bool = True,
) -> dict[str, Any]:
    if not cpu_kernel.load():
        raise RuntimeError("MEPIC's native CPU kernel is not available (see the logged error)")
    if threads:
        torch.set_num_threads(threads)
    results: dict[str, Any] = {}
    for name in dtypes:
        dtype = DTYPES[name]
        tol = 1e-3 if dtype == torch.float32 else 5e-2
        for kind, seqs, queries in (("decode", batch, 1), ("prefill", 1, context)):
            case = Case(seqs, queries, context, heads, kv_heads, head, block, dtype)
            diff = (case.run_mepic().float() - case.run_vllm().float()).abs().max().item()
            if diff > tol:
                raise AssertionError(f"{kind} {name}: MEPIC and vLLM differ by {diff:.3g}")
            # A decode call takes milliseconds: more rounds for a stable median. The reference
            # is timed apart: its large temporaries would evict the kernels' data between turns.
            rounds = repeats * 20 if kind == "decode" else repeats
            timed = _time({"vllm": case.run_vllm, "mepic": case.run_mepic}, rounds)
            vllm_s = positive(timed["vllm"], f"{kind}/{name}: vLLM kernel call (s)")
            mepic_s = positive(timed["mepic"], f"{kind}/{name}: MEPIC kernel call (s)")
            reference_s = None
            if with_reference:
                reference_s = positive(
                    _time({"reference": case.run_reference}, repeats)["reference"],
                    f"{kind}/{name}: torch reference call (s)",
                )
            results[f"{kind}/{name}"] = {
                "vllm_s": vllm_s,
                "mepic_s": mepic_s,
                "ratio": vllm_s / mepic_s,
                "reference_s": reference_s,
                "max_abs_diff": diff,
                "vllm_isa": case.isa,
                "mepic_isa": cpu_kernel.isa(),
                "sequences": seqs,
                "queries_per_sequence": queries,
            }
    return {
        "decode_vs_vllm": min(r["ratio"] for k, r in results.items() if k.startswith("decode")),
        "prefill_vs_vllm": min(r["ratio"] for k, r in results.items() if k.startswith("prefill")),
        "results": results,
        "shapes": {
            "context": context,
            "decode_batch": batch,
            "heads": heads,
            "kv_heads": kv_heads,
            "head_size": head,
            "block_size": block,
            "dtypes": list(dtypes),
        },
        "threads": torch.get_num_threads(),
        "machine": {"platform": platform.platform(), "processor": cpu_info().describe()},
        "note": "ratios are throughput, MEPIC / vLLM (above 1: MEPIC faster); min over dtypes",
    }


# The issue-31 matrix: SmolLM2-135M's attention and the 7B models' (32 query / 8 KV heads, 128).
MATRIX_SHAPES = ((9, 3, 64), (32, 8, 128))
MATRIX_CONTEXTS = (2048, 8192)


def matrix(
    block: int, threads: int | None, repeats: int, dtypes: tuple[str, ...]
) -> dict[str, Any]:
    """``run`` over ``MATRIX_SHAPES`` x ``MATRIX_CONTEXTS`` (no reference timing), one report."""
    reports = []
    for heads, kv_heads, head in MATRIX_SHAPES:
        for context in MATRIX_CONTEXTS:
            shape = {"heads": heads, "kv_heads": kv_heads, "head": head, "context": context}
            reports.append(
                run(
                    block=block,
                    dtypes=dtypes,
                    threads=threads,
                    repeats=repeats,
                    with_reference=False,
                    **shape,
                )  # fmt: skip
            )
    rows = [
        {
            "heads": f"{r['shapes']['heads']}/{r['shapes']['kv_heads']}",
            "head_size": r["shapes"]["head_size"],
            "context": r["shapes"]["context"],
            "case": k,
            "ratio": v["ratio"],
            "mepic_isa": v["mepic_isa"],
            "vllm_isa": v["vllm_isa"],
        }  # fmt: skip
        for r in reports
        for k, v in r["results"].items()
    ]
    return {"rows": rows, "reports": reports, "note": reports[0]["note"]}


def matrix_table(report: dict[str, Any]) -> str:
    lines = [
        "| heads | head | context | case | MEPIC / vLLM | mepic_isa | vllm_isa |",
        "|---|---|---|---|---|---|---|",
    ]
    for r in report["rows"]:
        lines.append(
            f"| {r['heads']} | {r['head_size']} | {r['context']} | {r['case']} | "
            f"{r['ratio']:.2f}x | {r['mepic_isa']} | {r['vllm_isa']} |"
        )
    return "\n".join(lines)


def cmd_kernels(args: argparse.Namespace) -> int:
    from ascend_mepic.entrypoints.streams import data_stream

    if args.matrix:
        report = matrix(args.block_size, args.threads, args.repeats, tuple(args.dtypes))
        if args.json:
            Path(args.json).parent.mkdir(parents=True, exist_ok=True)
            Path(args.json).write_text(json.dumps(report, indent=2) + "\n", encoding="utf-8")
        data_stream().write(matrix_table(report) + "\n")
        return 0
    report = run(
        context=args.context,
        batch=args.batch,
        heads=args.heads,
        kv_heads=args.kv_heads,
        head=args.head_size,
        block=args.block_size,
        dtypes=tuple(args.dtypes),
        threads=args.threads,
        repeats=args.repeats,
        with_reference=not args.no_reference,
    )
    text = json.dumps(report, indent=2)
    if args.json:
        Path(args.json).parent.mkdir(parents=True, exist_ok=True)
        Path(args.json).write_text(text + "\n", encoding="utf-8")
    data_stream().write(text + "\n")
    return 0


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--json", help="write the report here")
    p.add_argument("--context", type=int, default=2048, help="keys per sequence")
    p.add_argument("--batch", type=int, default=8, help="decode sequences")
    p.add_argument("--heads", type=int, default=9, help="query heads (default: SmolLM2-135M's)")
    p.add_argument("--kv-heads", type=int, default=3)
    p.add_argument("--head-size", type=int, default=64)
    p.add_argument("--block-size", type=int, default=128)
    p.add_argument("--dtypes", nargs="+", default=["float32", "bfloat16"], choices=list(DTYPES))
    p.add_argument("--threads", type=int, help="torch threads (default: torch's)")
    p.add_argument(
        "--repeats", type=int, default=5, help="timed rounds for prefill (x20 for decode)"
    )
    p.add_argument(
        "--no-reference", action="store_true", help="skip timing the torch reference (slow)"
    )
    p.add_argument(
        "--matrix",
        action="store_true",
        help="heads 9/3 x 64 and 32/8 x 128 at 2k and 8k context; prints a table (--json: all)",
    )
    p.set_defaults(func=cmd_kernels)
