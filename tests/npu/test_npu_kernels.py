"""MEPIC's NPU attention implementations on a real NPU against the float64 oracle.

UNTESTED ON HARDWARE: written without an NPU. Block 128 (vllm-ascend's block size), head sizes
64 and 128, GQA (8 query heads over 2 KV heads), float16 and bfloat16, neox and GPT-J rotation,
prefill with scattered queries over MEPIC layouts and decode; each implementation
(``triton-ascend``: the triton-ascend kernel; ``npu``: the torch_npu composition) and the one
``select_impl`` picks. The batches are built on the CPU (tests/ops/oracle.py) and moved to the
NPU; the oracle runs on the CPU in float64.
"""

from __future__ import annotations

import pytest
import torch

from ascend_mepic import ops
from ascend_mepic.ops import RopeSpec
from tests.npu.conftest import sync
from tests.ops.oracle import Batch, dense_oracle, random_batch

pytestmark = pytest.mark.npu

BLOCK = 128
HQ, HKV = 8, 2
TOL = {torch.float16: 2e-2, torch.bfloat16: 3e-2}


def run_on(impl: str, b: Batch, device: torch.device) -> torch.Tensor:
    rope = RopeSpec(b.rope.cos_sin_cache.to(device), b.rope.is_neox_style)
    fn = ops.get_attention_fn(impl)
    out = fn(b.query.to(device), b.kv_cache.to(device), b.meta.to(device), rope, b.scale)
    sync()
    assert out.device.type == "npu" and out.dtype == b.query.dtype and out.shape == b.query.shape
    return out.cpu()


def check(out: torch.Tensor, b: Batch) -> None:
    want = dense_oracle(b.query, b.kv_cache, b.meta, b.base, b.rope.is_neox_style, b.scale)
    tol = TOL[b.query.dtype]
    torch.testing.assert_close(out.double(), want, atol=tol, rtol=tol)


def skip_unless_runs(impl: str, head: int) -> None:
    if impl == "npu":
        from ascend_mepic.ops.npu import FIA_TND_HEAD_DIMS

        if head not in FIA_TND_HEAD_DIMS:
            pytest.skip(f"the torch_npu composition takes head sizes {FIA_TND_HEAD_DIMS} only")
    if impl == "triton-ascend" and not ops.have_triton_ascend():
        pytest.skip("triton-ascend is not installed (pip install triton-ascend==3.2.2)")


@pytest.mark.parametrize("neox", [True, False], ids=["neox", "gptj"])
@pytest.mark.parametrize("decode", [False, True], ids=["prefill", "decode"])
@pytest.mark.parametrize("head", [64, 128])
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16], ids=["fp16", "bf16"])
@pytest.mark.parametrize("impl", ["triton-ascend", "npu"])
def test_impl_matches_oracle(impl, dtype, head, decode, neox, npu_device):
    skip_unless_runs(impl, head)
    for seed in range(2):
        b = random_batch(seed, BLOCK, HQ, HKV, head=head, dtype=dtype, decode=decode, neox=neox)
        check(run_on(impl, b, npu_device), b)


@pytest.mark.parametrize("head", [64, 128])
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16], ids=["fp16", "bf16"])
def test_selected_impl_matches_oracle(dtype, head, npu_device, monkeypatch):
    """What serving would run for this shape (``select_impl``, no forcing env)."""
    monkeypatch.delenv(ops.IMPL_ENV, raising=False)
    try:
        impl = ops.select_impl(npu_device, head_size=head, dtype=dtype)
    except RuntimeError as exc:  # NoNpuAttentionError
        pytest.fail(f"no NPU implementation for head {head} {dtype}: {exc}")
    assert impl in ("triton-ascend", "npu"), impl
    b = random_batch(3, BLOCK, HQ, HKV, head=head, dtype=dtype)
    check(run_on(impl, b, npu_device), b)


def test_doctor_passes_on_the_npu(npu_device):
    from ascend_mepic.entrypoints.doctor import diagnose, format_report

    report = diagnose()
    assert report.sections["self_test"]["device"] == "npu"
    assert not report.failures, format_report(report)
