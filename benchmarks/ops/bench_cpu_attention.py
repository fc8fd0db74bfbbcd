"""CPU attention: our torch reference op (read-time RoPE) vs vLLM's CPU kernel, side by side.

What it measures, per shape / phase / dtype / block size, on the same random Q, K, V:

(a) ``rope_paged_attention_reference`` (the MEPIC CPU serving path): K stays un-rotated in our
    ``kv_cache[2, num_blocks, B, Hkv, D]`` and the op rotates Q and every K at read time, then runs
    SDPA. Sequences are contiguous single segments (``block_valid_start`` 0, ``block_valid_end`` B
    except on the last block, positions = indices), i.e. exactly what a normal prefix-cached
    request looks like, so the comparison is like-for-like.
(b) vLLM's CPU attention kernel, called through ``vllm._custom_ops`` the way
    ``vllm/v1/attention/backends/cpu_attn.py`` calls it: K rotated beforehand (as the model's
    rotary embedding would) and written by ``cpu_attn_reshape_and_cache`` into vLLM's own cache
    ``[num_blocks, Hkv, B, 2 * D]`` (viewed ``[num_blocks, Hkv, 2 * B, D]``, K in the first B rows
    of each head, V in the last B), Q passed pre-rotated, and the scheduler metadata built once
    (vLLM builds it once per step and shares it across layers, so it is not in the timed call).
(c) the cost split of (a): the reference's own steps timed one by one (KV gather, RoPE of K, RoPE
    of Q, SDPA), to show how much of the gap to (b) is the read-time RoPE and how much is the
    attention itself.

Why: MEPIC moves RoPE from the KV write into every attention read, so the read path pays a
rotation of the whole context per call; this shows what that costs on CPU relative to the stock
kernel, which does no RoPE at read time. Neither side's KV write is timed. Both outputs are checked
against each other (max abs diff) before timing; timing is ``warmup`` calls then the median of
``repeat`` calls with ``time.perf_counter``, at torch's default thread count. Nothing about time
is asserted. Run ``--quick`` for a subset (< 60 s); the default grid takes several minutes.

On a shared or small machine prefer ``--threads 1``: ours issues hundreds of small parallel torch
ops per call, and when the CPUs are oversubscribed every one of them can wait a scheduler tick for
a descheduled worker thread, which inflates ours far more than vLLM's single parallel region.
Absolute times at long context also depend on the allocator: glibc returns large freed blocks to
the OS, so the reference's big per-call temporaries page-fault afresh on every call.
"""

from __future__ import annotations

import argparse
import math
import os
import statistics
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from ascend_mepic.eval.outputs import positive
from ascend_mepic.ops.metadata import PagedRopeMetadata, SequenceSpec, build_metadata
from ascend_mepic.ops.reference import (
    gather_sequence_keys,
    rope_paged_attention_reference,
    write_kv,
)
from ascend_mepic.ops.rope import RopeSpec, apply_rope, default_cos_sin_cache

DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16}
# Max abs diff between the two outputs above which a case is flagged as a mismatch.
TOLERANCE = {torch.float32: 1e-3, torch.bfloat16: 5e-2}


@dataclass(frozen=True)
class Shape:
    name: str
    num_heads: int
    num_kv_heads: int
    head_size: int


SHAPES = (
    Shape("smollm2-135m", 9, 3, 64),
    Shape("7b-like", 32, 8, 128),
)


@dataclass(frozen=True)
class Case:
    shape: Shape
    phase: str  # "prefill" (1 sequence, query length = context) or "decode" (8 x 1 query)
    context: int
    dtype_name: str
    block_size: int

    @property
    def dtype(self) -> torch.dtype:
        return DTYPES[self.dtype_name]

    @property
    def num_seqs(self) -> int:
        return 1 if self.phase == "prefill" else 8

    @property
    def query_len(self) -> int:
        return self.context if self.phase == "prefill" else 1


@dataclass
class Inputs:
    query: torch.Tensor  # [T, Hq, D] un-rotated, ours
    kv_cache: torch.Tensor  # [2, num_blocks, B, Hkv, D] un-rotated K
    meta: PagedRopeMetadata
    rope: RopeSpec
    scale: float
    vllm_query: torch.Tensor  # [T, Hq, D] rotated
    key_cache: torch.Tensor  # [num_blocks, Hkv, B, D] view, rotated K
    value_cache: torch.Tensor  # [num_blocks, Hkv, B, D] view
    query_start_loc: torch.Tensor  # [S + 1] int32
    seq_lens: torch.Tensor  # [S] int32
    block_table: torch.Tensor  # [S, max_blocks] int32


@dataclass
class Row:
    case: Case
    max_diff: float | None
    ours_ms: float
    vllm_ms: float | None
    split_ms: dict[str, float]
    note: str = ""


def grid(quick: bool) -> list[Case]:
    cases = []
    for shape in SHAPES:
        if quick:
            small = shape.head_size == 64
            phases = [("prefill", 512), ("decode", 2048)] if small else [("decode", 512)]
            blocks = (32, 128) if small else (128,)
        else:
            phases = [("prefill", 512), ("prefill", 2048)]
            phases += [("decode", c) for c in (512, 2048, 8192)]
            blocks = (32, 128)
        for phase, ctx in phases:
            for dtype_name in DTYPES:
                for block in blocks if phase == "decode" or not quick else blocks[-1:]:
                    cases.append(Case(shape, phase, ctx, dtype_name, block))
    return cases


def build_inputs(case: Case, rope: RopeSpec, isa: str, gen: torch.Generator) -> Inputs:
    """Random un-rotated Q/K/V written into both caches under one shuffled block table."""
    from vllm import _custom_ops as ops

    sh, bs, ctx, dtype = case.shape, case.block_size, case.context, case.dtype
    s, qlen = case.num_seqs, case.query_len
    per_seq = math.ceil(ctx / bs)
    num_blocks = s * per_seq
    table = torch.randperm(num_blocks, generator=gen).view(s, per_seq)

    key = torch.randn(s * ctx, sh.num_kv_heads, sh.head_size, generator=gen)
    value = torch.randn(s * ctx, sh.num_kv_heads, sh.head_size, generator=gen)
    query = torch.randn(s * qlen, sh.num_heads, sh.head_size, generator=gen)
    kpos = torch.arange(ctx).repeat(s)
    qpos = torch.arange(ctx - qlen, ctx).repeat(s)
    slots = (table.repeat_interleave(bs, dim=1)[:, :ctx] * bs + torch.arange(ctx) % bs).flatten()

    seqs = []
    for i in range(s):
        seqs.append(
            SequenceSpec(
                block_ids=table[i].tolist(),
                block_first_pos=[j * bs for j in range(per_seq)],
                block_valid_start=[0] * per_seq,
                block_valid_end=[min(bs, ctx - j * bs) for j in range(per_seq)],
                query_indices=list(range(ctx - qlen, ctx)),
                query_positions=list(range(ctx - qlen, ctx)),
            )
        )
    meta = build_metadata(seqs, bs)
    kv_cache = torch.zeros(2, num_blocks, bs, sh.num_kv_heads, sh.head_size, dtype=dtype)
    write_kv(key.to(dtype), value.to(dtype), kv_cache, slots)

    # vLLM: [num_blocks, Hkv, B, 2D] viewed [num_blocks, Hkv, 2B, D]; K rows first, then V rows.
    vcache = torch.zeros(num_blocks, sh.num_kv_heads, bs, 2 * sh.head_size, dtype=dtype)
    vview = vcache.view(num_blocks, sh.num_kv_heads, 2 * bs, sh.head_size)
    key_cache, value_cache = vview.chunk(2, dim=2)
    ops.cpu_attn_reshape_and_cache(
        apply_rope(key, kpos, rope).to(dtype),
        value.to(dtype),
        key_cache,
        value_cache,
        slots.long(),
        isa,
    )
    return Inputs(
        query=query.to(dtype),
        kv_cache=kv_cache,
        meta=meta,
        rope=rope,
        scale=1.0 / math.sqrt(sh.head_size),
        vllm_query=apply_rope(query, qpos, rope).to(dtype),
        key_cache=key_cache,
        value_cache=value_cache,
        query_start_loc=torch.arange(s + 1, dtype=torch.int32) * qlen,
        seq_lens=torch.full((s,), ctx, dtype=torch.int32),
        block_table=table.to(torch.int32),
    )


def vllm_runner(case: Case, inp: Inputs, isa: str) -> Callable[[], torch.Tensor]:
    """One attention call of vLLM's CPU backend (forward's kernel call, metadata prebuilt)."""
    from vllm import _custom_ops as ops
    from vllm import envs

    sh = case.shape
    sched = ops.cpu_attn_get_scheduler_metadata(
        num_reqs=case.num_seqs,
        num_heads=sh.num_heads,
        num_kv_heads=sh.num_kv_heads,
        head_dim=sh.head_size,
        seq_lens=inp.seq_lens,
        dtype=case.dtype,
        query_start_loc=inp.query_start_loc,
        causal=True,
        sliding_window_size=-1,
        isa=isa,
        enable_kv_split=envs.VLLM_CPU_ATTN_SPLIT_KV,
    )
    output = torch.empty_like(inp.vllm_query)

    def run() -> torch.Tensor:
        ops.cpu_attention_with_kv_cache(
            query=inp.vllm_query,
            key_cache=inp.key_cache,
            value_cache=inp.value_cache,
            output=output,
            query_start_loc=inp.query_start_loc,
            seq_lens=inp.seq_lens,
            scale=inp.scale,
            causal=True,
            alibi_slopes=None,
            sliding_window=-1,
            block_table=inp.block_table,
            softcap=0.0,
            scheduler_metadata=sched,
            s_aux=None,
        )
        return output

    return run


def staged_reference(inp: Inputs) -> dict[str, float]:
    """The reference op's steps (same calls, same order), with seconds spent in each."""
    query, kv_cache, meta, rope = inp.query, inp.kv_cache, inp.meta, inp.rope
    spent = {"gather": 0.0, "rope_k": 0.0, "rope_q": 0.0, "sdpa": 0.0}
    out = torch.empty_like(query)
    loc = meta.query_start_loc.tolist()
    nblocks = meta.num_blocks.tolist()
    for s in range(meta.num_seqs):
        q0, q1 = loc[s], loc[s + 1]
        t0 = time.perf_counter()
        k, v, kpos, kidx = gather_sequence_keys(kv_cache, meta, s, nblocks[s])
        t1 = time.perf_counter()
        k = apply_rope(k, kpos, rope)
        t2 = time.perf_counter()
        q = apply_rope(query[q0:q1], meta.query_positions[q0:q1], rope)
        t3 = time.perf_counter()
        mask = kidx[None, :] <= meta.query_indices[q0:q1, None]
        o = F.scaled_dot_product_attention(
            q.transpose(0, 1).unsqueeze(0),
            k.to(q.dtype).transpose(0, 1).unsqueeze(0),
            v.to(q.dtype).transpose(0, 1).unsqueeze(0),
            attn_mask=mask,
            scale=inp.scale,
            enable_gqa=True,
        )
        out[q0:q1] = o.squeeze(0).transpose(0, 1)
        t4 = time.perf_counter()
        spent["gather"] += t1 - t0
        spent["rope_k"] += t2 - t1
        spent["rope_q"] += t3 - t2
        spent["sdpa"] += t4 - t3
    return spent


def timed(fn: Callable[[], object]) -> float:
    t0 = time.perf_counter()
    fn()
    return time.perf_counter() - t0


def interleaved_medians(
    inp: Inputs,
    ours: Callable[[], object],
    theirs: Callable[[], object] | None,
    warmup: int,
    repeat: int,
) -> tuple[float, float | None, dict[str, float]]:
    """Medians (ms) of ours, vLLM's and the staged split, their runs interleaved.

    Interleaving spreads any background load over all three alike, so the ratios stay fair on a
    shared machine even when the absolute times move.
    """
    for _ in range(warmup):
        ours()
        if theirs is not None:
            theirs()
        staged_reference(inp)
    t_ours, t_theirs, splits = [], [], []
    for _ in range(repeat):
        t_ours.append(timed(ours))
        if theirs is not None:
            t_theirs.append(timed(theirs))
        splits.append(staged_reference(inp))
    split = {k: 1e3 * statistics.median(r[k] for r in splits) for k in splits[0]}
    theirs_ms = 1e3 * statistics.median(t_theirs) if t_theirs else None
    return 1e3 * statistics.median(t_ours), theirs_ms, split


def probe_vllm(dtype: torch.dtype, isa_for: Callable[[torch.dtype, int, int], str]) -> str | None:
    """None if vLLM's kernel runs a tiny case in ``dtype`` here, else why not."""
    case = Case(Shape("probe", 2, 1, 64), "prefill", 64, _dtype_name(dtype), 32)
    try:
        isa = isa_for(dtype, case.block_size, case.shape.head_size)
        rope = RopeSpec.from_cache(default_cos_sin_cache(64, 64), True)
        inp = build_inputs(case, rope, isa, torch.Generator().manual_seed(0))
        vllm_runner(case, inp, isa)()
    except Exception as e:  # any failure means "unsupported here"
        return f"{type(e).__name__}: {e}".splitlines()[0][:200]
    return None


def _dtype_name(dtype: torch.dtype) -> str:
    return next(k for k, v in DTYPES.items() if v == dtype)


def run_case(
    case: Case, rope: RopeSpec, isa: str, warmup: int, repeat: int, with_vllm: bool, seed: int
) -> Row:
    inp = build_inputs(case, rope, isa, torch.Generator().manual_seed(seed))

    def ours() -> torch.Tensor:
        return rope_paged_attention_reference(inp.query, inp.kv_cache, inp.meta, rope, inp.scale)

    max_diff, theirs, note = None, None, ""
    if with_vllm:
        theirs = vllm_runner(case, inp, isa)
        max_diff = (ours().float() - theirs().float()).abs().max().item()
        if max_diff > TOLERANCE[case.dtype]:
            note = f"MISMATCH (> {TOLERANCE[case.dtype]:g})"
    else:
        note = f"vLLM kernel skipped ({case.dtype_name} unsupported here)"
    ours_ms, vllm_ms, split = interleaved_medians(inp, ours, theirs, warmup, repeat)
    return checked(Row(case, max_diff, ours_ms, vllm_ms, split, note))


def checked(row: Row) -> Row:
    """``row`` if every time in it is positive; else raise instead of reporting it."""
    c = row.case
    what = f"{c.shape.name} {c.phase} ctx={c.context} {c.dtype_name} B={c.block_size}"
    positive(row.ours_ms, f"{what}: ours (ms)")
    if row.vllm_ms is not None:
        positive(row.vllm_ms, f"{what}: vLLM (ms)")
    for step, ms in row.split_ms.items():
        positive(ms, f"{what}: ours' {step} step (ms)")
    return row


def fmt(x: float | None, spec: str = ".2f") -> str:
    return "-" if x is None else format(x, spec)


def print_tables(rows: list[Row]) -> None:
    for r in rows:
        checked(r)  # all of them before anything is printed
    print(
        "\n| shape | phase | ctx | dtype | block | max abs diff | ours ms | vLLM ms "
        "| ours/vLLM | note |"
    )
    print("|---|---|---:|---|---:|---:|---:|---:|---:|---|")
    for r in rows:
        c = r.case
        ratio = None if r.vllm_ms is None else r.ours_ms / r.vllm_ms
        print(
            f"| {c.shape.name} | {c.phase} | {c.context} | {c.dtype_name} | {c.block_size} "
            f"| {fmt(r.max_diff, '.1e')} | {fmt(r.ours_ms)} | {fmt(r.vllm_ms)} "
            f"| {fmt(ratio)} | {r.note} |"
        )

    print("\nCost split of ours (each step's median over the runs, ms; share = of the sum):\n")
    print(
        "| shape | phase | ctx | dtype | block | gather | RoPE K | RoPE Q | SDPA | sum "
        "| RoPE share | SDPA/vLLM |"
    )
    print("|---|---|---:|---|---:|---:|---:|---:|---:|---:|---:|---:|")
    for r in rows:
        c, sp = r.case, r.split_ms
        total = sum(sp.values())
        rope_share = 100.0 * (sp["rope_k"] + sp["rope_q"]) / total
        sdpa_ratio = None if r.vllm_ms is None else sp["sdpa"] / r.vllm_ms
        print(
            f"| {c.shape.name} | {c.phase} | {c.context} | {c.dtype_name} | {c.block_size} "
            f"| {sp['gather']:.2f} | {sp['rope_k']:.2f} | {sp['rope_q']:.2f} "
            f"| {sp['sdpa']:.2f} | {total:.2f} | {rope_share:.0f}% | {fmt(sdpa_ratio)} |"
        )


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--quick", action="store_true", help="a subset that finishes in under 60 s")
    p.add_argument("--warmup", type=int, default=2)
    p.add_argument("--repeat", type=int, default=5)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--threads", type=int, default=0, help="torch threads (0: torch's default)")
    args = p.parse_args()
    if args.threads > 0:
        torch.set_num_threads(args.threads)

    if hasattr(torch.cpu, "_init_amx"):
        torch.cpu._init_amx()  # AMX tile permission, needed by vLLM's bf16 AMX path
    from vllm.v1.attention.backends.cpu_attn import _get_attn_isa

    print(
        f"torch {torch.__version__}, {torch.get_num_threads()} threads, "
        f"AMX {torch.cpu._is_amx_tile_supported()}, AVX-512 {torch.cpu._is_avx512_supported()}, "
        f"load average {os.getloadavg()[0]:.1f} on {os.cpu_count()} CPUs"
    )
    supported = {}
    for name, dtype in DTYPES.items():
        why = probe_vllm(dtype, _get_attn_isa)
        supported[dtype] = why is None
        if why is not None:
            print(f"note: vLLM's CPU kernel fails in {name} here ({why}); timing ours only")

    cases = grid(args.quick)
    max_ctx = max(c.context for c in cases)
    rows = []
    t_start = time.perf_counter()
    for i, case in enumerate(cases):
        sh = case.shape
        rope = RopeSpec.from_cache(default_cos_sin_cache(sh.head_size, max_ctx), True)
        isa = _get_attn_isa(case.dtype, case.block_size, sh.head_size)
        row = run_case(
            case, rope, isa, args.warmup, args.repeat, supported[case.dtype], args.seed + i
        )
        rows.append(row)
        print(
            f"[{i + 1}/{len(cases)}] {sh.name} {case.phase} ctx={case.context} "
            f"{case.dtype_name} B={case.block_size} isa={isa}: ours {row.ours_ms:.2f} ms, "
            f"vLLM {fmt(row.vllm_ms)} ms, diff {fmt(row.max_diff, '.1e')} {row.note}",
            flush=True,
        )
    print(
        f"\n{len(cases)} cases in {time.perf_counter() - t_start:.0f} s; "
        f"load average now {os.getloadavg()[0]:.1f} (background load makes absolute times noisy)"
    )
    print_tables(rows)
    if any(r.note.startswith("MISMATCH") for r in rows):
        sys.exit("outputs disagree beyond tolerance in some cases (see the note column)")


if __name__ == "__main__":
    main()
