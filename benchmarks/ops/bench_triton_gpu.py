"""GPU: the Triton fused-RoPE paged attention vs itself without RoPE vs torch SDPA (flash).

What it measures, for a 7B-like layer (32 query heads, 8 KV heads, head 128, bf16 by default) at
several contexts and block sizes, in prefill (every token of a sequence queries, causal) and decode
(one query per sequence, a batch of sequences):

(a) ``rope_paged_attention_triton``: K un-rotated in the paged cache ``[2, blocks, B, Hkv, D]``
    (block ids shuffled), rotated in registers at read time, Q rotated in the kernel;
(b) the same kernel with ``apply_rope=False``: no rotation at all, so (a)/(b) is the price of
    read-time RoPE inside our own kernel;
(c) ``scaled_dot_product_attention`` restricted to the flash backend, over contiguous,
    pre-rotated Q and K (what a stock engine would read): the distance to a production kernel.
    If the flash backend refuses GQA here, K/V are expanded to all query heads first (noted).

The cos/sin cache is in the model dtype, as vLLM's rotary forward uses it. Before timing, (a) is
checked against (c) (max abs diff; both are bf16 results of the same math). Timing: ``warmup``
calls, then the median of ``repeat`` calls timed with ``torch.cuda.Event``; the L2 cache is flushed
(a 256 MiB write) before each timed call unless ``--no-flush``. Prefill's tile map is built once
outside the timed calls (kept with the metadata), as in serving once per step. Decode reports
achieved bandwidth: bytes of K and V read (``batch * context * Hkv * D * 2 * itemsize``) over
time, as a fraction of ``--peak-gbps`` (default from the card's name: H200 4800 GB/s, H100 SXM
3350; else 3350). Nothing about time is
asserted. Calls of ~0.1 ms include the wrapper's host work (the GPU waits for the launch).

Beside them, on the same card and in the same run:

(d) prefill: ``rotate``, the cost of rotating the sequences' K once into a contiguous scratch
    buffer (gathered from the pages, torch ops), and ``scratch/SDPA = (rotate + SDPA) / SDPA``:
    what stock vLLM's way (rotated K, then a flash kernel) would cost MEPIC for a long contiguous
    run, against the fused kernel's ``fused/SDPA``;
(e) decode: FlashInfer's batch decode with ``pos_encoding_mode="ROPE_LLAMA"`` (RoPE applied to
    Q and K inside the kernel, like ours) when ``flashinfer`` imports: the reference for what
    fused RoPE costs on this card. Its JIT build is timed once, before the timed calls.

The kernels' targets (decode >= 85% of HBM peak; fused/no RoPE <= 1.05; fused/SDPA <= 1.10
in prefill at 8k-32k keys and <= 1.05 in decode) are checked per row in ``targets``.
``--profile`` runs each kernel of each case once inside an NVTX range instead of timing, for
``scripts/gpu_ncu.sh`` (Nsight Compute: DRAM throughput, local-memory loads, tensor pipe).

``--sweep`` times (a) alone over tile sizes, warps and pipeline stages (``SWEEP``, or the default
and ``--config`` ones) and ranks them by the geometric mean of their speed-up over the default;
the wrapper's defaults (``launch_config``) were chosen so. Needs a CUDA GPU; exits with a message
otherwise. Measured on an H100: docs/results.md.
"""

from __future__ import annotations

import argparse
import statistics
import sys
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.nn.functional as F
from torch.nn.attention import SDPBackend, sdpa_kernel

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))  # cuda_fallback is not installed

from ascend_mepic.eval.outputs import positive  # noqa: E402
from ascend_mepic.ops.metadata import SequenceSpec, build_metadata  # noqa: E402
from ascend_mepic.ops.rope import RopeSpec, apply_rope, default_cos_sin_cache  # noqa: E402

DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16}
# Max abs diff between (a) and (c) above which a row is flagged (bf16 outputs of softmax @ V).
TOLERANCE = 3e-2

Timer = Callable[[Callable[[], object]], float]


@dataclass
class Case:
    phase: str
    context: int
    block_size: int
    batch: int
    fused: Callable[[], torch.Tensor]
    no_rope: Callable[[], torch.Tensor]
    sdpa: Callable[[], torch.Tensor]
    sdpa_note: str
    kv_bytes: int
    flops: float
    call_args: tuple  # (query, kv_cache, meta, rope, scale): the wrapper's positional arguments
    rotate: Callable[[], torch.Tensor] | None = None  # prefill: K rotated once into a scratch
    flashinfer: Callable[[], torch.Tensor] | None = None  # decode: FlashInfer ROPE_LLAMA
    flashinfer_note: str = "-"


def make_case(
    args: argparse.Namespace, phase: str, context: int, block_size: int, device: torch.device
) -> Case:
    """Random Q/K/V laid out twice: paged un-rotated (ours) and contiguous pre-rotated (SDPA)."""
    from cuda_fallback.rope_paged_attention import rope_paged_attention_triton

    dtype = DTYPES[args.dtype]
    hq, hkv, d = args.heads, args.kv_heads, args.head_size
    batch = args.prefill_batch if phase == "prefill" else args.decode_batch
    gen = torch.Generator(device=device).manual_seed(0)
    nb = -(-context // block_size)
    ids = (torch.randperm(batch * nb, generator=torch.Generator().manual_seed(0)) + 1).view(
        batch, nb
    )
    kv_cache = torch.randn(
        2, batch * nb + 1, block_size, hkv, d, generator=gen, dtype=dtype, device=device
    )
    queries = range(context) if phase == "prefill" else [context - 1]
    specs = [
        SequenceSpec(
            block_ids=ids[s].tolist(),
            block_first_pos=[j * block_size for j in range(nb)],
            block_valid_start=[0] * nb,
            block_valid_end=[min(block_size, context - j * block_size) for j in range(nb)],
            query_indices=list(queries),
            query_positions=list(queries),
        )
        for s in range(batch)
    ]
    meta = build_metadata(specs, block_size, device)
    cos_sin = default_cos_sin_cache(d, context, args.rope_base, device=device).to(dtype)
    rope = RopeSpec.from_cache(cos_sin, is_neox_style=True)
    lq = len(queries)
    query = torch.randn(batch * lq, hq, d, generator=gen, dtype=dtype, device=device)
    scale = d**-0.5

    # Contiguous pre-rotated copies [batch, H, L, D] for SDPA (built outside any timing).
    flat = ids.to(device).reshape(-1)
    k = kv_cache[0, flat].reshape(batch, nb * block_size, hkv, d)[:, :context]
    v = kv_cache[1, flat].reshape(batch, nb * block_size, hkv, d)[:, :context]
    pos = torch.arange(context, device=device)
    k_rot = torch.stack([apply_rope(k[s], pos, rope) for s in range(batch)])
    q_rot = apply_rope(query, meta.query_positions, rope).view(batch, lq, hq, d)
    q_sd, k_sd = q_rot.transpose(1, 2).contiguous(), k_rot.transpose(1, 2).contiguous()
    v_sd = v.transpose(1, 2).contiguous()
    del k, v, k_rot, q_rot

    # Prefill's tile map is built by the first call (before timing) and kept in ``meta.memo``.
    def fused() -> torch.Tensor:
        return rope_paged_attention_triton(query, kv_cache, meta, rope, scale)

    def no_rope() -> torch.Tensor:
        return rope_paged_attention_triton(query, kv_cache, meta, rope, scale, apply_rope=False)

    def rotate() -> torch.Tensor:  # stock's way for a contiguous run: rotated K in a scratch
        k_pages = kv_cache[0, flat].reshape(batch, nb * block_size, hkv, d)[:, :context]
        return apply_rope(k_pages.reshape(-1, hkv, d), pos.repeat(batch), rope)

    causal = phase == "prefill"

    def sdpa_gqa() -> torch.Tensor:
        with sdpa_kernel(SDPBackend.FLASH_ATTENTION):
            return F.scaled_dot_product_attention(
                q_sd, k_sd, v_sd, is_causal=causal, scale=scale, enable_gqa=True
            )

    note = "flash, native GQA"
    sdpa = sdpa_gqa
    try:
        sdpa_gqa()
    except RuntimeError:
        k_x, v_x = (t.repeat_interleave(hq // hkv, dim=1) for t in (k_sd, v_sd))

        def sdpa_expanded() -> torch.Tensor:
            with sdpa_kernel(SDPBackend.FLASH_ATTENTION):
                return F.scaled_dot_product_attention(q_sd, k_x, v_x, is_causal=causal, scale=scale)

        note, sdpa = "flash, K/V expanded to Hq", sdpa_expanded

    def sdpa_rows() -> torch.Tensor:  # [T, Hq, D] like ours
        return sdpa().transpose(1, 2).reshape(batch * lq, hq, d)

    kv_bytes = batch * context * hkv * d * 2 * kv_cache.element_size()
    flops = 4.0 * batch * hq * d * (context * (context + 1) / 2 if causal else context)
    fi, fi_note = (
        (None, "-")
        if causal
        else flashinfer_decode(args, query, kv_cache, ids, context, block_size, dtype)
    )
    return Case(
        phase, context, block_size, batch, fused, no_rope, sdpa_rows, note, kv_bytes, flops,
        (query, kv_cache, meta, rope, scale), rotate if causal else None, fi, fi_note,
    )  # fmt: skip


def flashinfer_decode(
    args: argparse.Namespace,
    query: torch.Tensor,
    kv_cache: torch.Tensor,
    ids: torch.Tensor,
    context: int,
    block_size: int,
    dtype: torch.dtype,
) -> tuple[Callable[[], torch.Tensor] | None, str]:
    """FlashInfer's paged batch decode with RoPE fused (``ROPE_LLAMA``: rotate-half at each
    key's index in its sequence, as ours with neox style), on the same cache and queries; None
    and the reason when FlashInfer is missing or refuses. Its first call JIT-builds the kernel:
    that time is in the note, outside the timed calls."""
    import time

    try:
        import flashinfer
    except Exception as exc:  # not installed: the row says so
        return None, f"not available: {type(exc).__name__}"
    batch, nb = ids.shape
    device = query.device
    try:
        ws = torch.empty(256 << 20, dtype=torch.uint8, device=device)
        wrapper = flashinfer.BatchDecodeWithPagedKVCacheWrapper(ws, "NHD")
        wrapper.plan(
            torch.arange(batch + 1, dtype=torch.int32, device=device) * nb,
            ids.reshape(-1).to(device, torch.int32),
            torch.full((batch,), context - (nb - 1) * block_size, dtype=torch.int32,
                       device=device),
            args.heads, args.kv_heads, args.head_size, block_size,
            pos_encoding_mode="ROPE_LLAMA", rope_theta=args.rope_base,
            q_data_type=dtype, kv_data_type=dtype,
        )  # fmt: skip
        paged = (kv_cache[0], kv_cache[1])

        def call() -> torch.Tensor:
            return wrapper.run(query, paged)

        start = time.perf_counter()
        call()
        torch.cuda.synchronize()
        built = time.perf_counter() - start
    except Exception as exc:  # an API or build failure: reported, not fatal
        print(f"FlashInfer decode: {exc!r}"[:400], file=sys.stderr)
        return None, f"failed: {type(exc).__name__}"
    return call, f"flashinfer {getattr(flashinfer, '__version__', '?')}, first call {built:.1f} s"


def cuda_timer(warmup: int, repeat: int, flush: bool) -> Timer:
    scratch = torch.empty(256 << 20, dtype=torch.uint8, device="cuda") if flush else None

    def time_ms(fn: Callable[[], object]) -> float:
        for _ in range(warmup):
            fn()
        torch.cuda.synchronize()
        starts = [torch.cuda.Event(enable_timing=True) for _ in range(repeat)]
        ends = [torch.cuda.Event(enable_timing=True) for _ in range(repeat)]
        for start, end in zip(starts, ends, strict=True):
            if scratch is not None:
                scratch.zero_()
            start.record()
            fn()
            end.record()
        torch.cuda.synchronize()
        return statistics.median(s.elapsed_time(e) for s, e in zip(starts, ends, strict=True))

    return time_ms


def run_case(case: Case, timer: Timer, peak_gbps: float) -> dict[str, str]:
    want = case.sdpa().float()
    diff = (case.fused().float() - want).abs().max().item()
    what = f"{case.phase} context {case.context} B={case.block_size}"
    t_fused = positive(timer(case.fused), f"{what}: fused RoPE (ms)")
    t_plain = positive(timer(case.no_rope), f"{what}: no RoPE (ms)")
    t_sdpa = positive(timer(case.sdpa), f"{what}: SDPA (ms)")
    t_rot = None if case.rotate is None else positive(timer(case.rotate), f"{what}: rotate (ms)")
    t_fi, fi_diff = None, None
    if case.flashinfer is not None:
        fi_diff = (case.flashinfer().float() - want).abs().max().item()
        t_fi = positive(timer(case.flashinfer), f"{what}: FlashInfer ROPE_LLAMA (ms)")

    def perf(ms: float) -> str:
        if case.phase == "decode":
            gbps = case.kv_bytes / (ms * 1e-3) / 1e9
            return f"{gbps:.0f} GB/s ({gbps / peak_gbps:.0%})"
        return f"{case.flops / (ms * 1e-3) / 1e12:.0f} TFLOP/s"

    def ms(t: float | None) -> str:
        return "-" if t is None else f"{t:.3f}"

    def flagged(d: float | None) -> str:
        return "-" if d is None else f"{d:.1e}" + (" MISMATCH" if not d <= TOLERANCE else "")

    return {
        "phase": case.phase,
        "context": str(case.context),
        "B": str(case.block_size),
        "batch": str(case.batch),
        "fused RoPE ms": f"{t_fused:.3f}",
        "no RoPE ms": f"{t_plain:.3f}",
        "SDPA ms": f"{t_sdpa:.3f}",
        "fused/no RoPE": f"{t_fused / t_plain:.2f}",
        "fused/SDPA": f"{t_fused / t_sdpa:.2f}",
        "rotate ms": ms(t_rot),
        "scratch/SDPA": "-" if t_rot is None else f"{(t_rot + t_sdpa) / t_sdpa:.2f}",
        "FlashInfer ms": ms(t_fi),
        "fused/FlashInfer": "-" if t_fi is None else f"{t_fused / t_fi:.2f}",
        "fused perf": perf(t_fused),
        "no-RoPE perf": perf(t_plain),
        "SDPA perf": perf(t_sdpa),
        "SDPA": case.sdpa_note,
        "FlashInfer": case.flashinfer_note,
        "max abs diff": flagged(diff),
        "FlashInfer diff": flagged(fi_diff),
        "targets": targets(case, t_fused, t_plain, t_sdpa, peak_gbps),
    }


def targets(case: Case, fused: float, plain: float, sdpa: float, peak_gbps: float) -> str:
    """The kernels' targets for this row: each ``name ok`` or ``name MISS (value)``."""
    checks = [("fused/no-RoPE<=1.05", fused / plain, 1.05)]
    if case.phase == "decode":
        checks.append(("fused/SDPA<=1.05", fused / sdpa, 1.05))
        bw = case.kv_bytes / (fused * 1e-3) / 1e9 / peak_gbps
        return ", ".join(
            [f"{n} {'ok' if v <= lim else f'MISS ({v:.2f})'}" for n, v, lim in checks]
            + [f"HBM>=85% {'ok' if bw >= 0.85 else f'MISS ({bw:.0%})'}"]
        )
    if 8192 <= case.context <= 32768:
        checks.append(("fused/SDPA<=1.10", fused / sdpa, 1.10))
    return ", ".join(f"{n} {'ok' if v <= lim else f'MISS ({v:.2f})'}" for n, v, lim in checks)


def profile_case(case: Case) -> None:
    """Each kernel of ``case`` called twice: once to build it, then once between
    ``cudaProfilerStart``/``Stop`` inside an NVTX range named after it (``--profile``, for Nsight
    Compute with ``--profile-from-start off`` and ``--print-nvtx-rename kernel``). The labels go
    to stderr in launch order, for a report whose kernels could not be renamed."""
    calls = {"fused": case.fused, "no_rope": case.no_rope, "sdpa": case.sdpa}
    calls.update(rotate=case.rotate, flashinfer=case.flashinfer)
    for name, fn in calls.items():
        if fn is None:
            continue
        fn()
        torch.cuda.synchronize()
        label = f"{case.phase}-{case.context}-B{case.block_size}-{name}"
        print(f"profile: {label}", file=sys.stderr)
        torch.cuda.profiler.start()
        torch.cuda.nvtx.range_push(label)
        fn()
        torch.cuda.synchronize()
        torch.cuda.nvtx.range_pop()
        torch.cuda.profiler.stop()


PEAK_GBPS = {"H200": 4800.0, "H100": 3350.0}  # HBM peak by card name (H100: SXM)


# Launch configurations --sweep tries per phase (the wrapper's overrides); {} = its default.
SWEEP = {
    "prefill": [{}]
    + [
        dict(block_m=m, block_n=n, num_warps=w, num_stages=st)
        for m in (64, 128)
        for n in (32, 64)
        for w in (4, 8)
        for st in (2, 3)
    ],
    "decode": [{}]
    + [
        dict(block_n=n, num_warps=w, num_stages=st)
        for n in (32, 64, 128)
        for w in (2, 4, 8)
        for st in (2, 3)
    ],
}


def parse_config(text: str) -> dict[str, int]:
    """``block_m=64,block_n=64,num_warps=4,num_stages=2`` -> the wrapper's keyword overrides."""
    keys = {"block_m", "block_n", "num_warps", "num_stages", "num_splits"}
    config = {}
    for item in text.split(","):
        key, _, value = item.partition("=")
        if key.strip() not in keys or not value.strip().isdigit():
            raise argparse.ArgumentTypeError(f"{item!r}: expected KEY=INT with KEY in {keys}")
        config[key.strip()] = int(value)
    return config


def sweep_case(
    case: Case, timer: Timer, configs: list[dict[str, int]] | None = None
) -> list[dict[str, str]]:
    """The fused kernel of ``case`` under every launch configuration of its phase, each checked
    against SDPA first; a configuration Triton cannot build (shared memory) is reported, not
    fatal."""
    from cuda_fallback.rope_paged_attention import rope_paged_attention_triton

    want = case.sdpa().float()
    rows, base = [], None
    for config in configs or SWEEP[case.phase]:

        def call(config=config) -> torch.Tensor:
            return rope_paged_attention_triton(*case.call_args, **config)

        label = " ".join(f"{k}={v}" for k, v in config.items()) or "default"
        try:
            diff = (call().float() - want).abs().max().item()
            ms = timer(call)
        except Exception as exc:  # e.g. triton's OutOfResources for a large tile
            print(f"{case.phase} {case.context} B={case.block_size} {label}: {exc!r}"[:300],
                  file=sys.stderr)  # fmt: skip
            rows.append(sweep_row(case, label, None, None, f"failed: {type(exc).__name__}"))
            continue
        ms = positive(ms, f"{case.phase} context {case.context} B={case.block_size} {label} (ms)")
        base = ms if base is None else base
        note = f"{diff:.1e}" + (" MISMATCH" if not diff <= TOLERANCE else "")
        rows.append(sweep_row(case, label, ms, base / ms, note))
        print(" ".join(f"{k}={v}" for k, v in rows[-1].items()), file=sys.stderr)
    return rows


def sweep_row(
    case: Case, label: str, ms: float | None, gain: float | None, note: str
) -> dict[str, str]:
    return {
        "phase": case.phase,
        "context": str(case.context),
        "B": str(case.block_size),
        "config": label,
        "fused ms": "-" if ms is None else f"{ms:.3f}",
        "vs default": "-" if gain is None else f"{gain:.2f}",
        "max abs diff": note,
    }


def sweep_summary(rows: list[dict[str, str]]) -> list[dict[str, str]]:
    """Per phase and configuration: the geometric mean of 'vs default' over the cases, best
    first (a configuration that failed in any case is left out)."""
    out = []
    for phase in dict.fromkeys(r["phase"] for r in rows):
        cases = {(r["context"], r["B"]) for r in rows if r["phase"] == phase}
        by_config: dict[str, list[float]] = {}
        for r in rows:
            if r["phase"] == phase and r["vs default"] != "-":
                by_config.setdefault(r["config"], []).append(float(r["vs default"]))
        scored = [
            (statistics.geometric_mean(g), min(g), c)
            for c, g in by_config.items()
            if len(g) == len(cases)
        ]
        for mean, worst, config in sorted(scored, reverse=True):
            out.append(
                {
                    "phase": phase,
                    "config": config,
                    "cases": str(len(cases)),
                    "geomean vs default": f"{mean:.2f}",
                    "worst case": f"{worst:.2f}",
                }
            )
    return out


def markdown(rows: list[dict[str, str]]) -> str:
    cols = list(rows[0])
    lines = ["| " + " | ".join(cols) + " |", "|" + "---|" * len(cols)]
    lines += ["| " + " | ".join(r[c] for c in cols) + " |" for r in rows]
    return "\n".join(lines)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument(
        "--phases", nargs="+", choices=["prefill", "decode"], default=["prefill", "decode"]
    )
    p.add_argument("--contexts", type=int, nargs="+", default=[2048, 8192, 32768])
    p.add_argument("--block-sizes", type=int, nargs="+", default=[16, 128])
    p.add_argument("--prefill-batch", type=int, default=1)
    p.add_argument("--decode-batch", type=int, default=16)
    p.add_argument("--heads", type=int, default=32)
    p.add_argument("--kv-heads", type=int, default=8)
    p.add_argument("--head-size", type=int, default=128)
    p.add_argument("--dtype", choices=sorted(DTYPES), default="bf16")
    p.add_argument("--rope-base", type=float, default=10000.0)
    p.add_argument("--warmup", type=int, default=5)
    p.add_argument("--repeat", type=int, default=20)
    p.add_argument("--no-flush", action="store_true", help="do not flush L2 between calls")
    p.add_argument(
        "--peak-gbps", type=float, help="HBM peak in GB/s (default by card: H200 4800, H100 3350)"
    )
    p.add_argument(
        "--profile",
        action="store_true",
        help="run each kernel once per case inside NVTX ranges, no timing (scripts/gpu_ncu.sh)",
    )
    p.add_argument(
        "--sweep",
        action="store_true",
        help="time the fused kernel over tile sizes, warps and pipeline stages instead",
    )
    p.add_argument(
        "--config",
        type=parse_config,
        action="append",
        help="with --sweep: time only the default and these (KEY=INT,...; repeatable)",
    )
    args = p.parse_args()

    if not torch.cuda.is_available():
        sys.exit(
            "bench_triton_gpu.py needs a CUDA GPU (torch.cuda.is_available() is False); the "
            "kernels' CPU check is tests/ops/test_triton.py under TRITON_INTERPRET=1"
        )
    device = torch.device("cuda")
    timer = cuda_timer(args.warmup, args.repeat, not args.no_flush)
    name = torch.cuda.get_device_name(device)
    if args.peak_gbps is None:
        args.peak_gbps = next((v for k, v in PEAK_GBPS.items() if k in name), 3350.0)
    print(
        f"# {name}, {args.dtype}, Hq {args.heads}, Hkv {args.kv_heads}, D {args.head_size}; "
        f"median of {args.repeat} calls; HBM peak taken as {args.peak_gbps:.0f} GB/s",
        flush=True,
    )
    if args.sweep:
        print("# --sweep: the fused kernel per launch configuration; vs default = default ms / ms")
    rows = []
    for phase in args.phases:
        for context in args.contexts:
            for block_size in args.block_sizes:
                case = make_case(args, phase, context, block_size, device)
                if args.profile:
                    profile_case(case)
                elif args.sweep:
                    configs = [{}] + args.config if args.config else None
                    rows.extend(sweep_case(case, timer, configs))
                else:
                    rows.append(run_case(case, timer, args.peak_gbps))
                    print(" ".join(f"{k}={v}" for k, v in rows[-1].items()), file=sys.stderr)
                del case
                torch.cuda.empty_cache()
    if args.profile:
        return
    print()
    print(markdown(rows))
    if args.sweep:
        print()
        print(markdown(sweep_summary(rows)))


if __name__ == "__main__":
    main()
