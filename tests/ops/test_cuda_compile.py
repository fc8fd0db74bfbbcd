"""The CUDA Triton kernels compiled for sm_90a and sm_80 with Triton's own compiler and ptxas,
every launch ``launch_config`` can choose: no spill, and every K/V loop's loads asynchronous.

Runs where Triton has its NVIDIA backend and kernels are compiled, not interpreted
(``TRITON_INTERPRET`` unset); no GPU is needed (``tests/ops/cuda_compile.py`` says how).

The kernels before issue 49 failed it: 29 of the 40 launches spilled and none had a single
``cp.async`` (a data-dependent branch around the K/V loads kept them serial). ``make
test-cuda-compile`` prints every launch's report (docs/results.md). About a minute of compiling
on one core.
"""

from __future__ import annotations

import importlib.util
import os

import pytest
import torch

HAVE_NVIDIA = (
    os.environ.get("TRITON_INTERPRET") != "1"
    and importlib.util.find_spec("triton") is not None
    and importlib.util.find_spec("triton.backends.nvidia") is not None
)
needs_compiler = pytest.mark.skipif(
    not HAVE_NVIDIA, reason="needs Triton's NVIDIA backend, TRITON_INTERPRET unset"
)

# (decode, block size, max_query_len): every branch of ``launch_config`` on a GPU.
CALLS = [
    (True, 16, 1),
    (True, 128, 1),
    (False, 16, 2048),  # 64 x 64 tiles
    (False, 128, 512),  # 64 x 64 tiles, a short prompt
    (False, 128, 2048),  # 128 x 32 tiles: block >= 64 and a long prompt
]


def _launches(decode: bool, block: int, max_query_len: int, head: int, dtype: torch.dtype):
    from cuda_fallback.rope_paged_attention import launch_config, plan_launches
    from tests.ops.oracle import random_batch

    b = random_batch(0, block, 32, 8, head=head, num_seqs=3, dtype=dtype, decode=decode)
    cfg = launch_config(decode, block, max_query_len, head)
    # The batch is small; the launch is the one a call of this shape gets (7B-like heads: 32
    # query heads on 8 KV heads), and decode is checked unsplit and split (flash-decoding).
    plans = []
    for splits in (1, 4) if decode else (None,):
        _, launches = plan_launches(
            b.query, b.kv_cache, b.meta, b.rope, b.scale, block_m=cfg.block_m,
            block_n=cfg.block_n, num_warps=cfg.num_warps, num_stages=cfg.num_stages,
            num_splits=splits,
        )  # fmt: skip
        plans += launches[:1]  # the attention kernel (the split combine has no K/V loop)
    return plans


@needs_compiler
def test_the_check_sees_pipelined_loads_and_spills():
    """The check's own control: a K loop of plain loads compiles to cp.async once it has stages,
    not with one; held to too few registers, it spills."""
    import triton
    import triton.language as tl

    from tests.ops.cuda_compile import compile_launch

    @triton.jit
    def rows_dot(x_ptr, y_ptr, out_ptr, n, BLOCK: tl.constexpr):
        r = tl.arange(0, BLOCK)
        acc = tl.zeros([BLOCK, BLOCK], tl.float32)
        for k in range(0, n, BLOCK):
            x = tl.load(x_ptr + r[:, None] * n + k + r[None, :])
            y = tl.load(y_ptr + (k + r[:, None]) * BLOCK + r[None, :])
            acc += tl.dot(x, y)
        tl.store(out_ptr + r[:, None] * BLOCK + r[None, :], acc)

    x = torch.empty(64, 256, dtype=torch.float16)
    y = torch.empty(256, 64, dtype=torch.float16)
    out = torch.empty(64, 64, dtype=torch.float32)
    piped = compile_launch(
        rows_dot, (x, y, out, 256), dict(BLOCK=64, num_warps=4, num_stages=3), 80
    )
    serial = compile_launch(
        rows_dot, (x, y, out, 256), dict(BLOCK=64, num_warps=4, num_stages=1), 80
    )
    assert piped.async_copies > 0 and serial.async_copies == 0
    assert not piped.spills and 0 < piped.registers <= 255
    # the same loop held to 32 registers (PTX's .maxnreg) spills, and the report says so
    tight = compile_launch(
        rows_dot, (x, y, out, 256), dict(BLOCK=64, num_warps=4, num_stages=1, maxnreg=32), 80
    )
    assert tight.spills and tight.registers <= 32


@needs_compiler
@pytest.mark.parametrize("arch", [90, 80])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=["bf16", "fp16"])
@pytest.mark.parametrize("head", [64, 128])
@pytest.mark.parametrize(
    "call", CALLS, ids=lambda c: f"{'decode' if c[0] else 'prefill'}-B{c[1]}-q{c[2]}"
)
def test_launch_compiles_without_spills_and_with_async_kv_loads(call, head, dtype, arch):
    from tests.ops.cuda_compile import compile_launch

    failures = []
    for launch in _launches(*call, head, dtype):
        r = compile_launch(launch.kernel, launch.args, launch.kwargs, arch)
        print(
            f"{r.kernel} {r.arch} head {head} {str(dtype)[6:]} B{call[1]} "
            f"tile {launch.kwargs.get('BLOCK_M', launch.kwargs.get('BLOCK_G'))}x"
            f"{launch.kwargs['BLOCK_N']} splits {launch.kwargs.get('NUM_SPLITS', '-')} "
            f"warps {launch.kwargs['num_warps']} "
            f"stages {launch.kwargs['num_stages']}: {r.registers} registers, spills "
            f"{r.spill_stores}/{r.spill_loads} B, {r.async_copies} cp.async, "
            f"{r.shared_bytes} B shared"
        )
        if r.spills:
            failures.append(f"{r.kernel}: spills {r.spill_stores}/{r.spill_loads} bytes")
        if r.async_copies == 0:
            failures.append(f"{r.kernel}: no asynchronous copy in its K/V loop")
    assert not failures, "; ".join(failures)
