"""MEPIC's Triton kernels (``cuda_fallback/rope_paged_attention.py``) on a CUDA GPU against the
float64 oracle of ``tests/ops/oracle.py``. Run on one H100 (2026-11-26, without vLLM: these tests
need only CUDA torch and Triton); docs/results.md.

On CPU the kernels run only under Triton's interpreter (``tests/ops/test_triton.py``,
``tests/ops/test_triton_half.py``); here they are compiled for the GPU: fp16/bf16 dots on tensor
cores in their own dtype, fp32 dots in IEEE fp32, real masked loads from a real paged cache. The
grid: head sizes 64 and 128, block sizes 16 (vLLM's CUDA
default; a KV tile gathers four blocks) and 128 (part of a block per tile), GQA ratios 1, 4 and 8,
prefill (scattered queries over padded and packed MEPIC layouts), decode (one query per sequence,
the decode kernel) and mixed batches (decode-like and prefill sequences together: the prefill
kernel), fp16, bf16 and fp32, called the way serving calls it (``ascend_mepic.ops``, which must
pick ``triton`` on CUDA). Beside that: flash-decoding splits over long contexts, tile-size
variants, GPT-J rotation, the GPU worker's cache layout, pad slots holding NaN, the no-RoPE
variant the benchmark uses as its baseline, the KV write op, and a short run of
``benchmarks/ops/bench_triton_gpu.py``.

Tolerances (``assert_close`` with ``atol = rtol = TOL[dtype]``; the oracle starts from the very
fp16/bf16 inputs, so only the kernel's internal rounding counts): fp16 and bf16 8 eps (7.8e-3,
6.3e-2), the bound ``tests/ops/test_triton_half.py`` justifies for the same half-precision dots
(rotated Q/K and the softmax weights rounded to the dtype before their dots, fp32 accumulation);
this file's cases, run on CPU through that GPU dot path (``half_dots=True`` under the
interpreter), stayed within 1.1 eps (fp16) and 1.6 eps (bf16). fp32 1e-4: far above fp32 rounding
over a few hundred keys (~1e-6) yet ~10x below what TF32 dots would leave (~1e-3), so a silent
TF32 path fails.
"""

from __future__ import annotations

import subprocess
import sys
from dataclasses import replace
from pathlib import Path

import pytest
import torch

from ascend_mepic import ops
from ascend_mepic.ops import RopeSpec, SequenceSpec, build_metadata
from ascend_mepic.ops.metadata import PagedRopeMetadata
from tests.gpu.conftest import sync
from tests.ops.oracle import Batch, dense_oracle, nan_outside_real_slots, random_batch

pytestmark = pytest.mark.gpu

ROOT = Path(__file__).resolve().parents[2]
TOL = {torch.float32: 1e-4} | {t: 8 * torch.finfo(t).eps for t in (torch.float16, torch.bfloat16)}
DTYPES = {"fp32": torch.float32, "fp16": torch.float16, "bf16": torch.bfloat16}
# GQA ratio -> (query heads, KV heads).
GQA = {1: (4, 4), 4: (8, 2), 8: (16, 2)}


def specs_of(meta: PagedRopeMetadata) -> list[SequenceSpec]:
    """The plain-Python sequences a (CPU) metadata was built from."""
    loc = meta.query_start_loc.tolist()
    out = []
    for s in range(meta.num_seqs):
        n = int(meta.num_blocks[s])
        rows = slice(loc[s], loc[s + 1])
        out.append(
            SequenceSpec(
                block_ids=meta.block_tables[s, :n].tolist(),
                block_first_pos=meta.block_first_pos[s, :n].tolist(),
                block_valid_start=meta.block_valid_start[s, :n].tolist(),
                block_valid_end=meta.block_valid_end[s, :n].tolist(),
                query_indices=meta.query_indices[rows].tolist(),
                query_positions=meta.query_positions[rows].tolist(),
            )
        )
    return out


def mixed_batch(seed: int, block: int, hq: int, hkv: int, head: int, dtype) -> Batch:
    """Four sequences: 0 and 2 decode (one query at their last key, which sees every key), 1 and
    3 prefill (scattered queries, at least one with two or more), as in a vLLM mixed step."""
    for attempt in range(100):
        b = random_batch(seed + attempt, block, hq, hkv, head=head, dtype=dtype, num_seqs=4)
        loc = b.meta.query_start_loc.tolist()
        if max(loc[s + 1] - loc[s] for s in (1, 3)) > 1:
            break
    specs, rows = [], []
    for s, spec in enumerate(specs_of(b.meta)):
        if s % 2 == 0:
            j = len(spec.block_ids) - 1
            t = spec.block_valid_end[j] - 1
            pos = spec.block_first_pos[j] + t - spec.block_valid_start[j]
            spec = replace(spec, query_indices=[j * block + t], query_positions=[pos])
            rows.append(loc[s])
        else:
            rows.extend(range(loc[s], loc[s + 1]))
        specs.append(spec)
    meta = build_metadata(specs, block)
    assert meta.max_query_len > 1
    return replace(b, query=b.query[rows].contiguous(), meta=meta)


def make_batch(phase: str, seed: int, block: int, gqa: int, head: int, dtype) -> Batch:
    hq, hkv = GQA[gqa]
    if phase == "mixed":
        return mixed_batch(seed, block, hq, hkv, head, dtype)
    return random_batch(seed, block, hq, hkv, head=head, dtype=dtype, decode=phase == "decode")


def oracle(b: Batch) -> torch.Tensor:
    return dense_oracle(b.query, b.kv_cache, b.meta, b.base, b.rope.is_neox_style, b.scale)


def check(out: torch.Tensor, b: Batch, want: torch.Tensor | None = None) -> None:
    assert out.device.type == "cuda" and out.dtype == b.query.dtype and out.shape == b.query.shape
    tol = TOL[b.query.dtype]
    want = oracle(b) if want is None else want
    torch.testing.assert_close(out.cpu().double(), want, atol=tol, rtol=tol)


def on_gpu(b: Batch, device: torch.device, kv_cache: torch.Tensor | None = None):
    """The batch's query, cache, metadata and RoPE on the GPU."""
    rope = RopeSpec(b.rope.cos_sin_cache.to(device), b.rope.is_neox_style)
    cache = b.kv_cache.to(device) if kv_cache is None else kv_cache
    return b.query.to(device), cache, b.meta.to(device), rope


def via_ops(b: Batch, device: torch.device, kv_cache: torch.Tensor | None = None) -> torch.Tensor:
    """What serving runs: ``ascend_mepic.ops.rope_paged_attention`` (dispatch on the device)."""
    out = ops.rope_paged_attention(*on_gpu(b, device, kv_cache), b.scale)
    sync()
    return out


def via_triton(b: Batch, device: torch.device, **kwargs) -> torch.Tensor:
    """The Triton wrapper directly, for its tile, split and kernel overrides."""
    from cuda_fallback.rope_paged_attention import rope_paged_attention_triton

    out = rope_paged_attention_triton(*on_gpu(b, device), b.scale, **kwargs)
    sync()
    return out


@pytest.fixture(autouse=True)
def _no_forced_impl(monkeypatch):
    monkeypatch.delenv(ops.IMPL_ENV, raising=False)


def test_cuda_selects_the_triton_kernels(gpu_device):
    for dtype in DTYPES.values():
        for head in (64, 128):
            assert ops.select_impl(gpu_device, head, dtype) == "triton"


@pytest.mark.parametrize("phase", ["prefill", "decode", "mixed"])
@pytest.mark.parametrize("gqa", sorted(GQA))
@pytest.mark.parametrize("block", [16, 128])
@pytest.mark.parametrize("head", [64, 128])
@pytest.mark.parametrize("dtype", DTYPES.values(), ids=DTYPES.keys())
def test_matches_oracle(dtype, head, block, gqa, phase, gpu_device):
    for seed in range(2):
        b = make_batch(phase, 1000 * seed + head + block + gqa, block, gqa, head, dtype)
        assert (b.meta.max_query_len <= 1) == (phase == "decode")
        check(via_ops(b, gpu_device), b)


@pytest.mark.parametrize("num_splits", [None, 1, 4, 16])
@pytest.mark.parametrize("dtype", DTYPES.values(), ids=DTYPES.keys())
def test_long_context_decode_splits(dtype, num_splits, gpu_device):
    """Contexts of up to ~4k keys: the wrapper's own split count (from the SM count; > 1 here),
    no split, and forced ones; the combine kernel merges the partials by log-sum-exp."""
    from cuda_fallback import rope_paged_attention as tri

    b = random_batch(0, 16, 8, 2, head=128, dtype=dtype, decode=True, max_segment=1000)
    if num_splits is None:
        tiles = -(-b.meta.max_num_blocks * 16 // 64)
        assert tri._num_splits(gpu_device, b.meta.num_seqs * 2, tiles) > 1
    check(via_triton(b, gpu_device, num_splits=num_splits), b)


@pytest.mark.parametrize("block_n", [16, 32, 64, 128])
@pytest.mark.parametrize("block_m", [16, 64, 128])
def test_tile_sizes(block_m, block_n, gpu_device):
    b = make_batch("mixed", 3, 16, 4, 128, torch.bfloat16)
    check(via_triton(b, gpu_device, block_m=block_m, block_n=block_n), b)


@pytest.mark.parametrize("phase", ["prefill", "decode"])
@pytest.mark.parametrize("num_stages", [1, 2, 3, 4])
@pytest.mark.parametrize("num_warps", [2, 4, 8])
def test_launch_configurations(num_warps, num_stages, phase, gpu_device):
    """Every warps and stages value ``bench_triton_gpu.py --sweep`` tries (and stages 1 and 4),
    at the default tiles, gives the oracle's result; other tiles: ``test_tile_sizes``."""
    b = make_batch(phase, 10, 128, 4, 128, torch.bfloat16)
    check(via_triton(b, gpu_device, num_warps=num_warps, num_stages=num_stages), b)


@pytest.mark.parametrize("dtype", DTYPES.values(), ids=DTYPES.keys())
def test_long_prefill_takes_the_wide_tile(dtype, gpu_device):
    """A 1.1k-query prefill at block size 128: ``launch_config`` picks 128 x 32 tiles there."""
    from cuda_fallback import rope_paged_attention as tri

    b = random_batch(11, 128, 8, 2, head=128, dtype=dtype, num_seqs=1, max_segment=1100)
    assert b.meta.max_query_len >= 1024, b.meta.max_query_len
    assert tri.launch_config(False, 128, b.meta.max_query_len).block_m == 128
    check(via_ops(b, gpu_device), b)


@pytest.mark.parametrize("dtype", DTYPES.values(), ids=DTYPES.keys())
def test_prefill_kernel_on_a_decode_batch(dtype, gpu_device):
    b = make_batch("decode", 4, 128, 8, 64, dtype)
    check(via_triton(b, gpu_device, kernel="prefill"), b)


@pytest.mark.parametrize("phase", ["prefill", "decode"])
@pytest.mark.parametrize("head", [64, 128])
def test_gptj_rotation(head, phase, gpu_device):
    hq, hkv = GQA[4]
    b = random_batch(6, 16, hq, hkv, head=head, dtype=torch.bfloat16, neox=False,
                     decode=phase == "decode")  # fmt: skip
    check(via_ops(b, gpu_device), b)


@pytest.mark.parametrize("phase", ["prefill", "decode", "mixed"])
def test_pad_slots_are_never_read(phase, gpu_device):
    """vLLM's blocks are not zeroed: pad slots may hold anything, NaN included."""
    b = nan_outside_real_slots(make_batch(phase, 7, 16, 4, 128, torch.float16))
    out = via_triton(b, gpu_device, num_splits=4) if phase == "decode" else via_ops(b, gpu_device)
    assert torch.isfinite(out).all()
    check(out, b)


@pytest.mark.parametrize("phase", ["prefill", "decode"])
def test_no_rope_variant_is_attention_without_rotation(phase, gpu_device):
    """``apply_rope=False`` (the RoPE-overhead benchmark's baseline) is attention without any
    rotation: the torch reference with an identity cos/sin cache, and the kernel itself with that
    cache. So the benchmark's two variants differ by the rotation only."""
    from ascend_mepic.ops.reference import rope_paged_attention_reference

    b = make_batch(phase, 8, 16, 4, 128, torch.float32)
    cache = b.rope.cos_sin_cache
    half = cache.shape[1] // 2
    ones, zeros = torch.ones(cache.shape[0], half), torch.zeros(cache.shape[0], half)
    identity = replace(b, rope=RopeSpec.from_cache(torch.cat((ones, zeros), 1), True))
    out = via_triton(b, gpu_device, apply_rope=False)
    want = rope_paged_attention_reference(b.query, b.kv_cache, b.meta, identity.rope, b.scale)
    torch.testing.assert_close(out.cpu(), want, atol=TOL[torch.float32], rtol=TOL[torch.float32])
    torch.testing.assert_close(out, via_triton(identity, gpu_device), atol=1e-6, rtol=1e-6)
    assert not torch.allclose(out.cpu().double(), oracle(b), atol=1e-3)  # RoPE matters here


def worker_cache(shape: torch.Size, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    """A cache ``[2, blocks, B, Hkv, D]`` as MEPIC's GPU worker passes it to the op:
    ``ops.layout.cache_view`` of a contiguous per-layer buffer whose blocks hold, per KV
    head, K rows then V rows (a strided view)."""
    from ascend_mepic.ops.layout import cache_view

    _, nb, bs, hkv, d = shape
    buffer = torch.empty(nb, 2 * bs * hkv * d, dtype=dtype, device=device)
    view = cache_view(buffer, hkv, d)
    assert view.shape == shape and not view.is_contiguous()
    return view


@pytest.mark.parametrize("phase", ["prefill", "decode", "mixed"])
@pytest.mark.parametrize("dtype", DTYPES.values(), ids=DTYPES.keys())
def test_worker_cache_layout_written_by_write_kv(dtype, phase, gpu_device):
    """The serving path on CUDA end to end at the op level: every real key's un-rotated K and V
    written through ``ops.write_kv`` into the worker's cache view, then read by the kernel."""
    b = make_batch(phase, 9, 16, 4, 128, dtype)
    view = worker_cache(b.kv_cache.shape, dtype, gpu_device)
    view.fill_(float("nan"))  # unwritten slots must stay unread
    flat = b.kv_cache.flatten(1, 2)  # [2, blocks * B, Hkv, D]
    slots = torch.arange(flat.shape[1])
    m = b.meta
    real = torch.zeros(flat.shape[1], dtype=torch.bool)
    for s in range(m.num_seqs):
        for j in range(int(m.num_blocks[s])):
            blk = int(m.block_tables[s, j])
            lo, hi = int(m.block_valid_start[s, j]), int(m.block_valid_end[s, j])
            real[blk * m.block_size + lo : blk * m.block_size + hi] = True
    mapping = torch.where(real, slots, -1).to(gpu_device)
    ops.write_kv(flat[0].to(gpu_device), flat[1].to(gpu_device), view, mapping)
    check(via_ops(b, gpu_device, kv_cache=view), b)


@pytest.mark.parametrize("layout", ["contiguous", "worker"])
@pytest.mark.parametrize("dtype", DTYPES.values(), ids=DTYPES.keys())
def test_write_kv(dtype, layout, gpu_device):
    """``ops.write_kv`` on CUDA stores K and V bit for bit at their slots, skips slot -1 and
    touches nothing else, on a contiguous cache and on the worker's strided view."""
    gen = torch.Generator().manual_seed(0)
    nb, bs, hkv, d, n = 12, 16, 2, 128, 70
    before = torch.randn(2, nb, bs, hkv, d, generator=gen).to(dtype)
    key = torch.randn(n, hkv, d, generator=gen).to(dtype)
    value = torch.randn(n, hkv, d, generator=gen).to(dtype)
    mapping = torch.randperm(nb * bs, generator=gen)[:n]
    mapping[::7] = -1
    want = before.clone()
    for i, slot in enumerate(mapping.tolist()):
        if slot >= 0:
            want[0, slot // bs, slot % bs] = key[i]
            want[1, slot // bs, slot % bs] = value[i]
    if layout == "contiguous":
        cache = before.to(gpu_device)
    else:
        cache = worker_cache(before.shape, dtype, gpu_device)
        cache.copy_(before)
    ops.write_kv(key.to(gpu_device), value.to(gpu_device), cache, mapping.to(gpu_device))
    sync()
    assert torch.equal(cache.cpu(), want)


def test_rope_overhead_benchmark_prints_ratios(gpu_device):
    """``benchmarks/ops/bench_triton_gpu.py`` at a tiny size: it runs, its fused kernel agrees
    with SDPA, and it prints the with/without-RoPE ratio per row (nothing about time is
    asserted)."""
    script = ROOT / "benchmarks" / "ops" / "bench_triton_gpu.py"
    quick = ["--contexts", "512", "--decode-batch", "4", "--warmup", "1", "--repeat", "3"]
    cmd = [sys.executable, str(script), *quick]
    done = subprocess.run(cmd, capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stderr[-4000:]
    table = [line for line in done.stdout.splitlines() if line.startswith("| ")]
    header = [c.strip() for c in table[0].strip("|").split("|")]
    rows = [[c.strip() for c in line.strip("|").split("|")] for line in table[1:]]
    assert len(rows) == 4, done.stdout  # prefill and decode, block 16 and 128
    ratio, diff = header.index("fused/no RoPE"), header.index("max abs diff")
    for row in rows:
        assert float(row[ratio]) > 0 and "MISMATCH" not in row[diff], row
