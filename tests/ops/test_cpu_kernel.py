"""The native CPU kernel (``csrc/cpu/``) against the dense oracle and the torch reference.

``make setup`` builds the kernel; a machine where it does not build fails here loudly (the
serving path would fall back to the reference, see ``ascend_mepic.ops.cpu_kernel``).
"""

from __future__ import annotations

from dataclasses import replace

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from ascend_mepic.ops import cpu_kernel, rope_paged_attention, select_impl
from ascend_mepic.ops.reference import rope_paged_attention_reference
from tests.ops.oracle import Batch, dense_oracle, nan_outside_real_slots, random_batch

heads = st.sampled_from([(4, 4), (8, 2), (6, 3), (4, 1), (9, 3)])


@pytest.fixture(autouse=True, scope="module")
def two_threads():
    """The kernel splits its work by torch's thread count: these cases run on two threads (a
    2-core machine's default) also where ``make test`` caps each process at one."""
    before = torch.get_num_threads()
    torch.set_num_threads(2)
    yield
    torch.set_num_threads(before)


def test_kernel_builds_and_is_the_cpu_default(monkeypatch):
    assert cpu_kernel.load(), "the native CPU kernel did not build; see the logged error"
    monkeypatch.delenv("ASCEND_MEPIC_ATTN_IMPL", raising=False)
    assert select_impl(torch.device("cpu")) == "cpu"


def run(b: Batch, **kwargs) -> torch.Tensor:
    return cpu_kernel.rope_paged_attention_cpu(
        b.query, b.kv_cache, b.meta, b.rope, b.scale, **kwargs
    )


def check(out: torch.Tensor, b: Batch, tol: float) -> None:
    assert out.dtype == b.query.dtype and out.shape == b.query.shape
    want = dense_oracle(b.query, b.kv_cache, b.meta, b.base, b.rope.is_neox_style, b.scale)
    torch.testing.assert_close(out.double(), want, atol=tol, rtol=tol)
    ref = rope_paged_attention_reference(b.query, b.kv_cache, b.meta, b.rope, b.scale)
    torch.testing.assert_close(out.double(), ref.double(), atol=tol, rtol=tol)


@settings(max_examples=25, deadline=None)
@given(
    seed=st.integers(0, 10**6),
    block_size=st.sampled_from([16, 32, 128, 24]),
    heads=heads,
    neox=st.booleans(),
    decode=st.booleans(),
    splits=st.sampled_from([1, 2, 3, 8]),
)
def test_matches_oracle_fp32(seed, block_size, heads, neox, decode, splits):
    b = random_batch(seed, block_size, *heads, neox=neox, decode=decode)
    check(run(b, num_splits=splits), b, 1e-5)


@pytest.mark.parametrize("decode", [False, True])
@pytest.mark.parametrize("heads", [(8, 2), (9, 3)])
@pytest.mark.parametrize("head", [32, 64])
def test_bf16_cache_and_query(decode, heads, head):
    """(9, 3) decode takes the fused path (keys rotated in registers, values widened there)."""
    b = random_batch(4, 128, *heads, head=head, dtype=torch.bfloat16, decode=decode)
    check(run(b), b, 2e-2)


@pytest.mark.parametrize("amx_path", [False], indirect=True)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("decode", [False, True])
@pytest.mark.parametrize("head", [64, 128])
@pytest.mark.parametrize("block_size", [16, 128])
def test_scores_far_above_the_running_maximum(amx_path, dtype, decode, head, block_size):
    """The vector softmax rescales lazily: it exponentiates against a row's running maximum
    until a score passes it by more than 8, then takes the exact step. Queries scaled by 100
    (scores of standard deviation 100) make later chunks pass the running maximum by more than
    88, where exp overflows float32 unless the exact step is taken (with the bound raised to
    1000, every case here fails), so both steps and the switches between them meet the float64
    oracle. (Not the torch reference: in bfloat16 its SDPA is off by up to 0.24 at such scores.)"""
    b = random_batch(5, block_size, 8, 2, head=head, dtype=dtype, decode=decode)
    b = replace(b, query=(b.query.float() * 100).to(dtype))
    want = dense_oracle(b.query, b.kv_cache, b.meta, b.base, b.rope.is_neox_style, b.scale)
    tol = 1e-3 if dtype == torch.float32 else 2e-2
    torch.testing.assert_close(run(b).double(), want, atol=tol, rtol=tol)


@pytest.mark.parametrize("amx_path", [True], indirect=True)
@pytest.mark.parametrize("decode", [False, True])
@pytest.mark.parametrize("head", [64, 128])
@pytest.mark.parametrize("block_size", [16, 128])
def test_amx_scores_far_above_the_running_maximum(amx_path, decode, head, block_size):
    """The AMX paths' softmaxes (their own headroom steps) at scores of standard deviation 100.
    With a GQA group of 8 every sequence is on the tiles: one query takes the AMX decode
    (groups wider than the vector tile's 4 rows), more queries the packed AMX prefill (16 rows
    or more), whose softmax steps take 256 keys each: sequences of up to 1600 keys, so that
    rows leave the first step. The tiles multiply the rotated, scaled queries and the rotated
    keys rounded to bfloat16, which alone moves such outputs by up to 0.8 from the float64
    oracle of the test above (as bfloat16 SDPA is moved), so here the oracle takes the same
    rounded inputs. One bfloat16 step in a rounded input still moves an output by tenths at
    such scores: rotating in float32 instead of float64 before rounding moves the oracle by up
    to 0.16 (12 seeds), hence the tolerance of 0.25. A broken step is far outside it: without
    the rescale of earlier steps (alpha = 1) the outputs are off by 2.8-6.2; with the headroom
    raised to 1000 they overflow. Found by the AMX emulation build
    (test_cpu_kernel_amx_emulated.py) on a CPU without AMX: the test above had asked the
    float64 oracle's tolerance of the AMX paths too."""
    b = random_batch(5, block_size, 16, 2, head=head, dtype=torch.bfloat16, decode=decode,
                     max_segment=400)  # fmt: skip
    b = replace(b, query=(b.query.float() * 100).to(torch.bfloat16))
    want = dense_oracle(b.query, b.kv_cache, b.meta, b.base, b.rope.is_neox_style, b.scale,
                        tile_rows=8)  # fmt: skip
    torch.testing.assert_close(run(b).double(), want, atol=0.25, rtol=0)


@pytest.mark.parametrize("cache_dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("heads", [(8, 2), (9, 3)])
@pytest.mark.parametrize("head", [64, 128])
@pytest.mark.parametrize("splits", [1, 3])
def test_fp32_decode_16_lane_tile(cache_dtype, heads, head, splits):
    """float32 queries in decode at heads of 64 and 128 (the 16-lane fused tile; GQA groups of
    4 and of 3, which skip the padding row), over a float32 or bfloat16 cache (bfloat16 keys
    in split order), split or not, against the float64 oracle at float32 tolerance."""
    b = random_batch(21, 24, *heads, head=head, decode=True)
    cache = b.kv_cache.to(cache_dtype)
    out = run(replace(b, kv_cache=cache), num_splits=splits)
    want = dense_oracle(b.query, cache.float(), b.meta, b.base, b.rope.is_neox_style, b.scale)
    torch.testing.assert_close(out.double(), want, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("query_dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("head", [80, 96, 160])
@pytest.mark.parametrize("decode", [False, True])
def test_bf16_values_at_heads_not_multiples_of_64(query_dtype, head, decode):
    """Values from a bfloat16 cache are widened in split order where the head is whole groups
    of 32 (96, 160: a 32-element slice after the 64s), in head order otherwise (80): each way
    the rows come back in head order."""
    b = random_batch(13, 32, 8, 2, head=head, dtype=query_dtype, decode=decode)
    cache = b.kv_cache.bfloat16()
    out = run(replace(b, kv_cache=cache))
    want = dense_oracle(b.query, cache.to(query_dtype), b.meta, b.base, True, b.scale)
    tol = 1e-5 if query_dtype == torch.float32 else 2e-2
    torch.testing.assert_close(out.double(), want, atol=tol, rtol=tol)


@pytest.fixture(params=[True, False], ids=["amx", "vector"])
def amx_path(request):
    """Each bfloat16 case on the AMX tiles and on the vector path (AMX where the CPU, the
    build and Linux offer it; the AMX case is skipped, with the reason, elsewhere)."""
    if request.param and not cpu_kernel.set_amx(True):
        pytest.skip(f"no AMX path on this machine (kernel paths: {cpu_kernel.isa()})")
    cpu_kernel.set_amx(request.param)
    yield request.param
    cpu_kernel.set_amx(True)


@pytest.mark.parametrize("decode", [False, True])
@pytest.mark.parametrize("heads", [(8, 2), (9, 3), (16, 2), (16, 1)])
@pytest.mark.parametrize("head", [64, 128])
@pytest.mark.parametrize("block_size", [16, 24, 128])
def test_bf16_paths_match_oracle(amx_path, decode, heads, head, block_size):
    """bfloat16 prefill (AMX: keys rotated and packed per sequence) and decode (AMX for GQA
    groups wider than the vector tile, 8 and 16 here) against the float64 oracle, on layouts
    with holes and partial blocks."""
    b = random_batch(11, block_size, *heads, head=head, dtype=torch.bfloat16, decode=decode)
    check(run(b), b, 2e-2)


@pytest.mark.parametrize("decode", [False, True])
def test_bf16_pad_slots_may_hold_nan(amx_path, decode):
    """No path reads a slot outside a block's valid range (AMX packs only visible keys)."""
    b = random_batch(9, 32, 16, 2, head=64, dtype=torch.bfloat16, decode=decode)
    torch.testing.assert_close(run(nan_outside_real_slots(b)), run(b))


def test_isa_names_the_variant_loaded():
    paths = cpu_kernel.isa()
    variant, _ = cpu_kernel.choose_variant()
    assert paths.split("+")[0] == variant, paths
    assert ("+amx" in paths) == cpu_kernel.set_amx(True)


@pytest.mark.parametrize("decode", [False, True])
def test_fp32_query_over_bf16_cache(decode):
    b = random_batch(5, 32, 6, 3, decode=decode)
    cache = b.kv_cache.bfloat16()
    out = cpu_kernel.rope_paged_attention_cpu(b.query, cache, b.meta, b.rope, b.scale)
    want = rope_paged_attention_reference(b.query, cache.float(), b.meta, b.rope, b.scale)
    torch.testing.assert_close(out, want, atol=1e-5, rtol=1e-5)


def test_strided_block_major_cache_view():
    """The cache may be any strided view (the backend's own layout: tests/ops/test_kv_layout.py)."""
    b = random_batch(6, 32, 4, 2, decode=False)
    block_major = b.kv_cache.transpose(0, 1).contiguous()
    view = block_major.transpose(0, 1)
    assert not view.is_contiguous()
    out = cpu_kernel.rope_paged_attention_cpu(b.query, view, b.meta, b.rope, b.scale)
    check(out, b, 1e-5)


@pytest.mark.parametrize("decode", [False, True])
def test_pad_slots_may_hold_nan(decode):
    b = random_batch(9, 32, 8, 2, decode=decode)
    torch.testing.assert_close(run(nan_outside_real_slots(b)), run(b))


def test_dispatch_runs_the_kernel_by_default(monkeypatch):
    """On CPU every float32 step takes the kernel, decode and prefill alike, unless another
    implementation is forced."""
    calls = []
    real = cpu_kernel.rope_paged_attention_cpu

    def counted(*args):
        calls.append(1)
        return real(*args)

    def attend(b):
        return rope_paged_attention(b.query, b.kv_cache, b.meta, b.rope, b.scale)

    decode = random_batch(7, 16, 4, 2, decode=True)
    want = run(decode)
    monkeypatch.setattr(cpu_kernel, "rope_paged_attention_cpu", counted)
    monkeypatch.delenv("ASCEND_MEPIC_ATTN_IMPL", raising=False)
    torch.testing.assert_close(attend(decode), want)
    assert len(calls) == 1
    prefill = random_batch(8, 16, 4, 2)
    assert prefill.meta.max_query_len > 1
    check(attend(prefill), prefill, 1e-5)
    assert len(calls) == 2
    monkeypatch.setenv("ASCEND_MEPIC_ATTN_IMPL", "reference")  # forced: the torch reference
    attend(prefill)
    assert len(calls) == 2


def test_rejects_other_dtypes():
    b = random_batch(1, 16, 4, 2, dtype=torch.float16)
    with pytest.raises(TypeError, match="float32 or bfloat16"):
        run(b)


@pytest.mark.parametrize(
    "src,dst", [(torch.float32, torch.float32), (torch.float32, torch.bfloat16),
                (torch.bfloat16, torch.bfloat16), (torch.bfloat16, torch.float32)]
)  # fmt: skip
def test_native_kv_write_equals_the_reference(src, dst):
    from ascend_mepic.ops.reference import write_kv as write_kv_reference

    g = torch.Generator().manual_seed(0)
    n, hkv, d, blocks, bs = 11, 3, 64, 5, 16
    # K and V as the model hands them over: strided views of one fused qkv row.
    qkv = torch.randn(n, (9 + 2 * hkv) * d, generator=g).to(src)
    key = qkv[:, 9 * d : (9 + hkv) * d].view(n, hkv, d)
    value = qkv[:, (9 + hkv) * d :].view(n, hkv, d)
    slots = torch.randperm(blocks * bs, generator=g)[:n]
    slots[[2, 7]] = -1  # padding rows: skipped
    caches = [torch.randn(2, blocks, bs, hkv, d, generator=g).to(dst) for _ in range(2)]
    caches[1].copy_(caches[0])
    cpu_kernel.write_kv_cpu(key, value, caches[0], slots)
    write_kv_reference(key, value, caches[1], slots)
    assert torch.equal(caches[0], caches[1])
    with pytest.raises(RuntimeError, match="outside the cache"):
        cpu_kernel.write_kv_cpu(key, value, caches[0], slots + blocks * bs)


def test_write_kv_dispatch_uses_the_kernel_unless_the_reference_is_forced(monkeypatch):
    from ascend_mepic import ops

    monkeypatch.delenv("ASCEND_MEPIC_ATTN_IMPL", raising=False)
    calls = []
    monkeypatch.setattr(ops, "_write_kv_fns", {})
    monkeypatch.setattr(cpu_kernel, "write_kv_cpu", lambda *a: calls.append("cpu"))
    key = torch.zeros(1, 1, 8)
    cache = torch.zeros(2, 1, 4, 1, 8)
    ops.write_kv(key, key, cache, torch.tensor([0]))
    assert calls == ["cpu"]
    monkeypatch.setenv("ASCEND_MEPIC_ATTN_IMPL", "reference")
    ops.write_kv(key + 1, key + 2, cache, torch.tensor([1]))
    assert calls == ["cpu"] and cache[0, 0, 1].eq(1).all() and cache[1, 0, 1].eq(2).all()
    monkeypatch.delenv("ASCEND_MEPIC_ATTN_IMPL")
    ops.write_kv(key, key, cache.half(), torch.tensor([0]))  # float16: the kernel does not take it
    assert calls == ["cpu"]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_out_is_written_in_place(dtype):
    """``out=`` (the engine's output buffer) gets the rows a fresh tensor would; a view of a
    wider buffer works, rows outside it are untouched; a wrong shape or dtype is refused."""
    b = random_batch(3, 32, 8, 2, head=64, dtype=dtype)
    want = run(b)
    buffer = torch.full((b.query.shape[0] + 2, 8 * 64), 7.0, dtype=dtype)
    rows = buffer[: b.query.shape[0]].view(b.query.shape)
    assert run(b, out=rows) is rows
    torch.testing.assert_close(rows, want, atol=0, rtol=0)
    assert (buffer[b.query.shape[0] :] == 7).all()
    for bad in (torch.empty_like(b.query, dtype=torch.float16), torch.empty(1, 8, 64, dtype=dtype)):
        with pytest.raises(RuntimeError, match="out must be"):
            run(b, out=bad)


def test_dispatch_fills_out_for_every_impl(monkeypatch):
    """The dispatcher's ``out``: the kernel writes it, the reference's result is copied in."""
    b = random_batch(4, 16, 4, 2)
    for impl in ("cpu", "reference"):
        monkeypatch.setenv("ASCEND_MEPIC_ATTN_IMPL", impl)
        out = torch.zeros_like(b.query)
        got = rope_paged_attention(b.query, b.kv_cache, b.meta, b.rope, b.scale, out=out)
        assert got is out
        check(out, b, 1e-5)


def test_scratch_reused_across_calls_of_other_shapes():
    """Each thread's scratch is kept between calls and grown when a call needs more: calls of
    other head sizes, groups and row counts in turn (smaller after larger and back) all match
    their own fresh results."""
    batches = [
        random_batch(21, 32, 16, 1, head=128),  # many rows per item
        random_batch(22, 16, 4, 2, head=32, decode=True),
        random_batch(23, 32, 9, 3, head=64),
        random_batch(24, 16, 8, 8, head=128, decode=True),
    ]
    first = [run(b) for b in batches]
    for b, want in zip(batches * 2, first * 2, strict=True):
        torch.testing.assert_close(run(b), want, atol=0, rtol=0)
    check(first[0], batches[0], 1e-5)
    check(first[3], batches[3], 1e-5)


def test_amx_items_after_narrow_calls(amx_path):
    """A thread's scratch sized by decode calls (a few rows) then grown for prefill items whose
    rows are not whole AMX tiles (9 queries x a group of 2 = 18 rows, padded to 32 on the tiles):
    every buffer must hold the tile-padded rows (sized to whole row tiles of 4 only, the engine's
    worker crashed at the first bfloat16 prefill)."""
    for seed in range(6):
        d = random_batch(100 + seed, 16, 4, 2, dtype=torch.bfloat16, decode=True)
        check(run(d), d, 2e-2)
        b = random_batch(seed, 16, 4, 2, dtype=torch.bfloat16, num_seqs=4)
        check(run(b), b, 2e-2)
