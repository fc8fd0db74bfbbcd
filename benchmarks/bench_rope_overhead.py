"""GPU: what applying RoPE at read time costs MEPIC's fused Triton attention kernel.

UNTESTED ON A GPU: written on a machine without one (``tests/gpu/test_gpu_kernels.py`` runs it
at a tiny size under ``make test-gpu`` and checks only that it prints its ratios).

MEPIC keeps chunk K un-rotated in the paged cache, so its kernel rotates Q and every K tile in
registers at each key's position. This times ``rope_paged_attention_triton`` twice on the same
inputs: with RoPE (``apply_rope=True``) and without (``apply_rope=False``: the kernel's
``APPLY_ROPE`` constexpr compiles every rotation out; the paged loads through the block table,
the online softmax, the tiles and the decode splits are the same). ``ratio`` = with / without:
the price of position independence inside the kernel itself (not against another kernel:
``benchmarks/ops/bench_triton_gpu.py`` compares with SDPA).

Shapes: 32 query / 8 KV heads, head 128 (a 7B-class layer), bf16, block sizes 16 and 128,
contexts 2k and 8k; decode (one query per sequence, ``--decode-batch`` sequences) and prefill
(every token of one sequence queries, causal). Block ids are shuffled; the cos/sin cache is in
the model dtype, as vLLM's rotary embedding keeps it.

Timing: ``--warmup`` calls of each variant (compiling both), then ``--repeat`` rounds, each
timing both variants back to back with ``torch.cuda.Event`` in alternating order (with first on
even rounds, without first on odd ones), so drift in clocks or temperature hits both alike; the
L2 cache is flushed (a 256 MiB write, outside the timed span) before every timed call unless
``--no-flush``. Reported: the median time of each variant and the median of the per-round
ratios. Prefill's tile map is built once outside the timed calls, as a runner does once per
step. Nothing about time is asserted.

Output: the table (markdown) on stdout; the device line and progress on stderr.
Exit status: 0 after the table; 77 without a CUDA GPU (automake's "skipped": nothing was
measured, which a script should not mistake for a result), with the reason on stderr; 2 for
bad arguments.
"""

from __future__ import annotations

import argparse
import statistics
import sys
from collections.abc import Callable
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # cuda_fallback is not installed

from ascend_mepic.entrypoints.streams import isolate_stdout  # noqa: E402

EXIT_NO_GPU = 77
DTYPES = ("bf16", "fp16")


def make_inputs(
    args: argparse.Namespace, phase: str, context: int, block_size: int
) -> Callable[[bool], object]:
    """Random un-rotated paged KV and queries for one shape; a call ``fn(apply_rope)``."""
    import torch

    from ascend_mepic.ops.metadata import SequenceSpec, build_metadata
    from ascend_mepic.ops.rope import RopeSpec, default_cos_sin_cache
    from cuda_fallback.rope_paged_attention import prefill_tiles, rope_paged_attention_triton

    device = torch.device("cuda")
    dtype = torch.bfloat16 if args.dtype == "bf16" else torch.float16
    hq, hkv, d = args.heads, args.kv_heads, args.head_size
    batch = 1 if phase == "prefill" else args.decode_batch
    nb = -(-context // block_size)
    ids = (torch.randperm(batch * nb, generator=torch.Generator().manual_seed(0)) + 1).view(
        batch, nb
    )
    gen = torch.Generator(device=device).manual_seed(0)
    kv_cache = torch.randn(
        2, batch * nb + 1, block_size, hkv, d, generator=gen, dtype=dtype, device=device
    )
    queries = list(range(context)) if phase == "prefill" else [context - 1]
    specs = [
        SequenceSpec(
            block_ids=ids[s].tolist(),
            block_first_pos=[j * block_size for j in range(nb)],
            block_valid_start=[0] * nb,
            block_valid_end=[min(block_size, context - j * block_size) for j in range(nb)],
            query_indices=queries,
            query_positions=queries,
        )
        for s in range(batch)
    ]
    meta = build_metadata(specs, block_size, device)
    rope = RopeSpec.from_cache(
        default_cos_sin_cache(d, context, args.rope_base, device=device).to(dtype), True
    )
    query = torch.randn(batch * len(queries), hq, d, generator=gen, dtype=dtype, device=device)
    tiles = prefill_tiles(meta.query_start_loc, 64, device) if phase == "prefill" else None

    def call(apply_rope: bool) -> object:
        return rope_paged_attention_triton(
            query, kv_cache, meta, rope, d**-0.5, apply_rope=apply_rope, tiles=tiles
        )

    return call


def time_pair(
    call: Callable[[bool], object], warmup: int, repeat: int, flush: bool
) -> tuple[float, float, float]:
    """Median ms with RoPE, without, and the median per-round ratio (alternated order)."""
    import torch

    scratch = torch.empty(256 << 20, dtype=torch.uint8, device="cuda") if flush else None
    for _ in range(warmup):
        call(True)
        call(False)
    torch.cuda.synchronize()
    events = {
        v: [(torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True))
            for _ in range(repeat)]
        for v in (True, False)
    }  # fmt: skip
    for r in range(repeat):
        for variant in (True, False) if r % 2 == 0 else (False, True):
            if scratch is not None:
                scratch.zero_()
            start, end = events[variant][r]
            start.record()
            call(variant)
            end.record()
    torch.cuda.synchronize()
    ms = {v: [s.elapsed_time(e) for s, e in events[v]] for v in events}
    ratios = [a / b for a, b in zip(ms[True], ms[False], strict=True)]
    return statistics.median(ms[True]), statistics.median(ms[False]), statistics.median(ratios)


def markdown(rows: list[dict[str, str]]) -> str:
    cols = list(rows[0])
    lines = ["| " + " | ".join(cols) + " |", "|" + "---|" * len(cols)]
    lines += ["| " + " | ".join(r[c] for c in cols) + " |" for r in rows]
    return "\n".join(lines)


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    p.add_argument(
        "--phases", nargs="+", choices=["prefill", "decode"], default=["prefill", "decode"]
    )
    p.add_argument("--contexts", type=int, nargs="+", default=[2048, 8192])
    p.add_argument("--block-sizes", type=int, nargs="+", default=[16, 128])
    p.add_argument("--decode-batch", type=int, default=16, help="sequences in a decode step")
    p.add_argument("--heads", type=int, default=32)
    p.add_argument("--kv-heads", type=int, default=8)
    p.add_argument("--head-size", type=int, default=128)
    p.add_argument("--dtype", choices=DTYPES, default="bf16")
    p.add_argument("--rope-base", type=float, default=10000.0)
    p.add_argument("--warmup", type=int, default=5)
    p.add_argument("--repeat", type=int, default=30, help="rounds, each timing both variants")
    p.add_argument("--no-flush", action="store_true", help="do not flush L2 before each call")
    args = p.parse_args(argv)
    if args.repeat < 1 or args.warmup < 0:
        p.error("--repeat must be >= 1 and --warmup >= 0")
    return args


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    out = isolate_stdout()
    import torch

    if not torch.cuda.is_available():
        print(
            "bench_rope_overhead.py: needs a CUDA GPU (torch.cuda.is_available() is False, torch "
            f"{torch.__version__}); nothing measured, exit status {EXIT_NO_GPU}. The kernels' CPU "
            "check is tests/ops/test_triton.py under TRITON_INTERPRET=1.",
            file=sys.stderr,
        )
        return EXIT_NO_GPU
    print(
        f"# {torch.cuda.get_device_name()}, {args.dtype}, Hq {args.heads}, Hkv {args.kv_heads}, "
        f"D {args.head_size}; {args.repeat} alternated rounds, L2 "
        f"{'kept' if args.no_flush else 'flushed'}",
        file=sys.stderr,
        flush=True,
    )
    rows = []
    for phase in args.phases:
        for context in args.contexts:
            for block_size in args.block_sizes:
                call = make_inputs(args, phase, context, block_size)
                with_ms, without_ms, ratio = time_pair(
                    call, args.warmup, args.repeat, not args.no_flush
                )
                batch = 1 if phase == "prefill" else args.decode_batch
                rows.append(
                    {
                        "phase": phase,
                        "context": str(context),
                        "block": str(block_size),
                        "batch": str(batch),
                        "RoPE ms": f"{with_ms:.3f}",
                        "no-RoPE ms": f"{without_ms:.3f}",
                        "ratio": f"{ratio:.3f}",
                    }
                )
                print(" ".join(f"{k}={v}" for k, v in rows[-1].items()), file=sys.stderr)
                del call
                torch.cuda.empty_cache()
    out.write(markdown(rows) + "\n")
    out.flush()
    return 0


if __name__ == "__main__":
    sys.exit(main())
