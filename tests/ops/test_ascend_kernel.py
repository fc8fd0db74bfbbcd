"""The triton-ascend kernel (``ascend_mepic.ops.triton_ascend``) under an interpreter.

Two kinds of check. The UB tests (pure Python) run everywhere triton is installed: they run the
launcher with its kernels replaced by a recorder and check the tile sizes it picked against the
budget (85% of A2's unified buffer) under the module's own ``ub_bytes`` model (fitted to
bishengir-compile's plan; ``tests/ops/test_ascend_compile.py`` checks the compiler's own figure).
The kernel tests need triton-ascend's interpreter (the kernel's tiles are block pointers, which
upstream Triton removed): they run in process under ``make test-ascend`` (``.venv-ascend``, with
``TRITON_INTERPRET=1`` set before triton is imported) and skip elsewhere; under upstream Triton
the launcher only has to refuse, clearly. Results are checked against the dense float64 oracle and
the torch reference, with fp32 dots and with the fp16/bf16 dots the NPU would run. Nothing here
says the kernel compiles or runs on an NPU.
"""

from __future__ import annotations

import functools
import importlib
import importlib.util
from dataclasses import replace

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from ascend_mepic.ops import RopeSpec, have_triton_ascend
from ascend_mepic.ops.reference import rope_paged_attention_reference
from tests.ops.interpreter_dots import bf16_dots as bf16_dots  # the fixture
from tests.ops.oracle import Batch, dense_oracle, random_batch

if importlib.util.find_spec("triton") is None:
    pytest.skip("needs triton", allow_module_level=True)

import triton  # noqa: E402

asc = importlib.import_module("ascend_mepic.ops.triton_ascend")
TRITON_ASCEND = have_triton_ascend()
# Interpreted only if TRITON_INTERPRET was set before this process first imported triton.
IN_PROCESS = asc.INTERPRETED and type(triton.language.standard.max).__name__ == (
    "InterpretedFunction"
)
if not TRITON_ASCEND:
    _NOT_HERE = ("needs triton-ascend's interpreter (the kernel's block pointers are not in "
                 "upstream Triton): make test-ascend runs it")  # fmt: skip
else:
    _NOT_HERE = "needs TRITON_INTERPRET=1 from process start (make test-ascend sets it)"
interpreted = pytest.mark.skipif(not (TRITON_ASCEND and IN_PROCESS), reason=_NOT_HERE)
# triton-ascend 3.2.0's interpreter indexes numpy arrays the way numpy 1.25+ deprecates.
pytestmark = pytest.mark.filterwarnings("ignore:Conversion of an array with ndim > 0")
MAX_SEGMENT = 40
HALF_DTYPES = (torch.float16, torch.bfloat16)


def run(b: Batch, **kwargs) -> torch.Tensor:
    return asc.rope_paged_attention_ascend(b.query, b.kv_cache, b.meta, b.rope, b.scale, **kwargs)


def check(out: torch.Tensor, b: Batch, tol: float) -> None:
    assert out.dtype == b.query.dtype and out.shape == b.query.shape
    want = dense_oracle(b.query, b.kv_cache, b.meta, b.base, b.rope.is_neox_style, b.scale)
    torch.testing.assert_close(out.double(), want, atol=tol, rtol=tol)
    ref = rope_paged_attention_reference(b.query, b.kv_cache, b.meta, b.rope, b.scale)
    torch.testing.assert_close(out.double(), ref.double(), atol=tol, rtol=tol)


def half_tol(dtype: torch.dtype) -> float:
    """Half-precision dots round rotated Q/K, P and the output to the dtype: a few units of its
    machine epsilon (the oracle sees the same rounded inputs, in float64)."""
    return 8 * torch.finfo(dtype).eps


# --- UB budget: the launcher's tiles, from the constexprs it passes -------------------------------


def launched_tiles(monkeypatch, b: Batch, kernel: str) -> dict:
    """The constexprs of the attention launch the launcher plans on an NPU (nothing runs)."""
    monkeypatch.setattr(asc, "INTERPRETED", False)  # the NPU's dot choice
    plan = asc.plan_launches(b.query, b.kv_cache, b.meta, b.rope, b.scale, kernel=kernel,
                             num_splits=1, cores=asc.DEFAULT_NPU_CORES)  # fmt: skip
    (launch,) = [x for x in plan.launches if x.kernel in (asc._prefill_kernel, asc._decode_kernel)]
    return launch.kwargs


def ub_of_launch(c: dict, kernel: str) -> int:
    rows = c.get("ROWS") or c["GROUP_P"]
    return asc.ub_bytes(rows, c["BLOCK_N"], c["D"], decode=kernel == "decode", neox=c["IS_NEOX"])


@functools.cache
def _template(block_size: int, decode: bool) -> Batch:
    return random_batch(block_size, block_size, 1, 1, head=16, num_seqs=1, decode=decode,
                        max_segment=4)  # fmt: skip


def shaped_batch(block_size: int, decode: bool, hq: int, head: int, dtype, cos_sin_dtype) -> Batch:
    """A batch of the given shapes (zeros) over a small random table: the launcher reads shapes."""
    b = _template(block_size, decode)
    nblk = b.kv_cache.shape[1]
    cache = torch.zeros(b.rope.cos_sin_cache.shape[0], head, dtype=cos_sin_dtype)
    return replace(
        b,
        query=torch.zeros(b.query.shape[0], hq, head, dtype=dtype),
        kv_cache=torch.zeros(2, nblk, block_size, 1, head, dtype=dtype),
        rope=RopeSpec.from_cache(cache, True),
        meta=replace(b.meta, memo={}),
    )


@pytest.mark.parametrize("head", [64, 128, 256])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
@pytest.mark.parametrize("block_size", [16, 128])
def test_launcher_tiles_fit_the_ub_budget(monkeypatch, head, dtype, block_size):
    """Every default launch, GQA 1..8, both kernels, cos/sin in fp32 or the model dtype, fits
    (NeoX rotation; GPT-J decode at head 256 is over even at the smallest tiles, see
    ``test_gptj_decode_at_head_256_is_the_one_over_the_budget``)."""
    for group in range(1, 9):
        for cos_sin_dtype in {torch.float32, dtype}:
            for kernel in ("prefill", "decode"):
                b = shaped_batch(block_size, kernel == "decode", group, head, dtype, cos_sin_dtype)
                c = launched_tiles(monkeypatch, b, kernel)
                used = ub_of_launch(c, kernel)
                assert c["D"] == head and c["DOT_FP32"] == (dtype == torch.float32)
                assert (c.get("ROWS") or c["GROUP_P"]) >= 16  # tl.dot's rows
                assert used <= asc.UB_BUDGET, (kernel, group, cos_sin_dtype, c, used)


def test_the_planner_takes_the_largest_tiles_under_the_budget():
    """Head 64 prefill gets 32 rows x 64 keys, head 128 32 x 16 (32 x 32: 92% of UB in the
    compiler's plan), head 256 the smallest tiles; each under the budget."""
    assert asc.choose_tiles(64, 1, 128) == (32, 64)
    assert asc.choose_tiles(128, 4, 128) == (8, 16)
    assert asc.choose_tiles(256, 1, 128, neox=False) == (16, 16)
    assert asc.ub_bytes(32, 32, 128, decode=False, neox=True) > asc.UB_BUDGET
    assert asc.UB_BUDGET == int(0.85 * 192 * 1024)


def test_gptj_decode_at_head_256_is_the_one_over_the_budget():
    """The one shape whose smallest tiles the model puts over 85%: GPT-J rotation, decode, head
    256 (the compiler places 78% in float16, 86.6% in float32); everything else fits."""
    over = [(decode, neox, head) for decode in (False, True) for neox in (True, False)
            for head in (64, 80, 96, 128, 256)
            if asc.ub_bytes(16, 16, head, decode=decode, neox=neox) > asc.UB_BUDGET]  # fmt: skip
    assert over == [(True, False, 256)]


def test_prefill_items_cover_every_row_once_in_tile_runs():
    loc = torch.tensor([0, 5, 5, 40, 41])
    for cores, hkv in ((1, 1), (20, 1), (20, 8), (3, 2)):
        seqs, lo, hi = asc.prefill_items(loc, 4, cores, hkv)
        rows = sorted(r for a, b_ in zip(lo.tolist(), hi.tolist(), strict=True)
                      for r in range(a, b_))  # fmt: skip
        assert rows == list(range(41))
        for s, a, b_ in zip(seqs.tolist(), lo.tolist(), hi.tolist(), strict=True):
            assert loc[s] <= a < b_ <= loc[s + 1] and (a - loc[s]) % 4 == 0
        if seqs.numel() * hkv >= cores:  # enough work: fewest runs, one per sequence
            assert len(seqs) == 3 or seqs.numel() * hkv >= cores


# --- the kernel under the interpreter -------------------------------------------------------------


@interpreted
@settings(max_examples=4, deadline=None)
@given(
    seed=st.integers(0, 10**6),
    block_size=st.sampled_from([16, 32, 128]),
    heads=st.sampled_from([(2, 2), (4, 2), (3, 1), (8, 1)]),
    neox=st.booleans(),
)
def test_prefill_matches_oracle_fp32(seed, block_size, heads, neox):
    """Held-out random batches: padded and packed tables, scattered queries, GQA."""
    b = random_batch(seed, block_size, *heads, neox=neox, max_segment=MAX_SEGMENT)
    check(run(b, kernel="prefill"), b, 1e-5)


@interpreted
@settings(max_examples=4, deadline=None)
@given(
    seed=st.integers(0, 10**6),
    block_size=st.sampled_from([16, 64, 128]),
    heads=st.sampled_from([(4, 4), (8, 2), (6, 3), (16, 1)]),
    neox=st.booleans(),
    splits=st.sampled_from([1, 2, 4]),
)
def test_split_kv_decode_matches_oracle_fp32(seed, block_size, heads, neox, splits):
    b = random_batch(seed, block_size, *heads, neox=neox, decode=True, max_segment=MAX_SEGMENT)
    check(run(b, num_splits=splits), b, 1e-5)


@interpreted
@pytest.mark.parametrize("cores", [1, 7])
def test_one_run_reuses_rotated_k_across_query_tiles(cores):
    """Few programs: a run spans many query tiles, so later tiles read K back from the scratch."""
    b = random_batch(11, 16, 8, 1, num_seqs=2, max_segment=MAX_SEGMENT)
    check(run(b, kernel="prefill", cores=cores, block_q=2), b, 1e-5)


@interpreted
def test_queries_out_of_causal_order():
    """Queries of a sequence in any row order: a tile may end before an earlier tile's entries."""
    b = random_batch(4, 16, 4, 2, num_seqs=2, max_segment=MAX_SEGMENT)
    m = b.meta
    perm = torch.cat([
        lo + torch.randperm(hi - lo, generator=torch.Generator().manual_seed(lo))
        for lo, hi in zip(m.query_start_loc[:-1].tolist(), m.query_start_loc[1:].tolist(),
                          strict=True)
    ])  # fmt: skip
    meta = replace(m, query_positions=m.query_positions[perm],
                   query_indices=m.query_indices[perm], memo={})  # fmt: skip
    b = replace(b, query=b.query[perm], meta=meta)
    check(run(b, kernel="prefill", cores=1, block_q=4), b, 1e-5)


@interpreted
@pytest.mark.parametrize("block_n", [16, 32, 128])
def test_sub_tiles_of_a_block(block_n):
    b = random_batch(5, 128, 4, 1, neox=False, num_seqs=2, max_segment=MAX_SEGMENT)
    check(run(b, kernel="prefill", block_n=block_n), b, 1e-5)


# head, block size, (Hq, Hkv), kernel: head 64/128 x block 16/128 x GQA 1, 2, 4, 8.
HALF_CASES = [
    (64, 16, (2, 2), "prefill"),
    (64, 128, (4, 2), "prefill"),
    (128, 16, (8, 2), "prefill"),
    (128, 128, (8, 1), "prefill"),
    (64, 16, (8, 1), "decode"),
    (64, 128, (2, 2), "decode"),
    (128, 16, (4, 2), "decode"),
    (128, 128, (8, 2), "decode"),
]


@interpreted
@pytest.mark.parametrize("dtype", HALF_DTYPES)
@pytest.mark.parametrize("head, block_size, heads, kernel", HALF_CASES)
def test_half_precision_dots(bf16_dots, dtype, head, block_size, heads, kernel):
    """The fp16/bf16 ``tl.dot`` path the NPU runs (no forced fp32), against the float64 oracle;
    bf16 through the interpreter patch of ``tests/ops/interpreter_dots.py``."""
    decode = kernel == "decode"
    b = random_batch(head + block_size + heads[0], block_size, *heads, head=head, num_seqs=2,
                     dtype=dtype, decode=decode, neox=not decode, max_segment=24)  # fmt: skip
    assert not asc.dots_in_fp32(dtype, dtype, True)
    out = run(b, kernel=kernel, half_dots=True)
    check(out, b, half_tol(dtype))
    # The half path really ran: it rounds differently from the fp32 dots.
    assert not torch.equal(out, run(b, kernel=kernel, half_dots=False))


@interpreted
def test_fp16_dots_are_the_default_under_the_interpreter():
    """fp16 needs no patch, so the default path is the NPU's; bf16 falls back unless forced."""
    assert not asc.dots_in_fp32(torch.float16, torch.float16, None)
    assert asc.dots_in_fp32(torch.bfloat16, torch.bfloat16, None)
    b = random_batch(7, 128, 4, 2, num_seqs=2, dtype=torch.float16, max_segment=24)
    check(run(b), b, half_tol(torch.float16))


@interpreted
def test_bf16_dot_patch_is_needed_and_works(monkeypatch):
    """Without the patch the interpreter's bf16 dot is garbage; with it, exact in fp32."""
    import triton.language as tl

    from tests.ops.interpreter_dots import upcast_bf16_dots

    @triton.jit
    def dot_kernel(a_ptr, b_ptr, o_ptr, M: tl.constexpr):
        r = tl.arange(0, M)
        idx = r[:, None] * M + r[None, :]
        tl.store(o_ptr + idx, tl.dot(tl.load(a_ptr + idx), tl.load(b_ptr + idx)))

    a, b = torch.randn(2, 16, 16, generator=torch.Generator().manual_seed(0)).bfloat16()
    want, out = a.float() @ b.float(), torch.empty(16, 16)
    dot_kernel[(1,)](a, b, out, M=16)
    assert not torch.allclose(out, want, atol=1e-2)
    upcast_bf16_dots(monkeypatch)
    dot_kernel[(1,)](a, b, out, M=16)
    torch.testing.assert_close(out, want, atol=1e-5, rtol=1e-5)


@interpreted
def test_unsupported_block_size_raises_before_launch():
    b = random_batch(3, 24, 2, 2, max_segment=20)
    with pytest.raises(ValueError, match="block size 24"):
        run(b)


def test_decode_split_choice_fills_the_cores():
    assert asc.decode_splits(20, 1, 2, 64) == 16  # 2 work items, 20 cores: 10 -> 16
    assert asc.decode_splits(20, 64, 8, 64) == 1
    assert asc.decode_splits(20, 1, 1, 3) == 1  # too few entries to split


def test_refuses_to_run_without_triton_ascend(monkeypatch):
    """Under upstream Triton (no block pointers) the launcher says so before any launch."""
    monkeypatch.setattr("ascend_mepic.ops.have_triton_ascend", lambda: False)
    b = random_batch(3, 16, 2, 2, max_segment=20)
    with pytest.raises(RuntimeError, match="needs triton-ascend.*block pointers"):
        run(b)
