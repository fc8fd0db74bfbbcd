"""The torch_npu composition (``ascend_mepic.ops.npu``) against the dense oracle, via a test double.

No NPU here: ``get_npu_ops`` is replaced by ``NpuOpsDouble``, plain torch written from the torch_npu
documentation. These tests check the composition's indices, masks, layouts and dtype handling, not
the hardware kernels.
"""

import importlib.util
import math
import sys

import pytest
import torch
import torch.nn.functional as F
from hypothesis import given, settings
from hypothesis import strategies as st

from ascend_mepic.ops import RopeSpec, npu, rope_paged_attention
from tests.ops import npu_double
from tests.ops.emulated_device import emulated_npu, mark_npu
from tests.ops.npu_double import DocumentedConstraintError, NpuOpsDouble
from tests.ops.oracle import dense_oracle, random_batch

gqa = st.sampled_from([(4, 4), (8, 2), (6, 3), (4, 1)])
FP32 = (torch.float16, torch.bfloat16, torch.float32)
HEAD = 128  # FIA's TND paged mode takes D = 64 or 128 on A2


@pytest.fixture
def double(monkeypatch: pytest.MonkeyPatch) -> NpuOpsDouble:
    ops = NpuOpsDouble()
    monkeypatch.setattr(npu, "get_npu_ops", lambda: ops)
    return ops


def on_npu(b) -> None:
    """What vLLM hands the backend lives on the NPU: query, cache, step metadata, RoPE cache."""
    mark_npu(b.query, b.kv_cache, b.rope.cos_sin_cache, *b.meta.tensors())


def run(b) -> torch.Tensor:
    on_npu(b)
    with emulated_npu():
        return npu.rope_paged_attention_npu(b.query, b.kv_cache, b.meta, b.rope, b.scale)


def plan_of(b) -> npu.NpuStepPlan:
    """The step plan the last ``run(b)`` memoised."""
    (plan,) = [v for k, v in b.meta.memo.items() if k[0] == "npu-plan"]
    return plan


def batch(seed, block_size, hq, hkv, **kw):
    kw.setdefault("max_segment", 60)
    return random_batch(seed, block_size, hq, hkv, head=HEAD, **kw)


def fia_calls(ops: NpuOpsDouble) -> list[dict]:
    return [kw for name, kw in ops.calls if name == "npu_fused_infer_attention_score"]


@settings(max_examples=12, deadline=None)
@given(
    seed=st.integers(0, 10**6),
    block_size=st.sampled_from([16, 32, 128]),
    heads=gqa,
    neox=st.booleans(),
    decode=st.booleans(),
)
def test_composition_matches_dense_oracle_fp32(seed, block_size, heads, neox, decode):
    """Index, run and rotation logic at fp32 precision (the double is widened to take fp32)."""
    ops = NpuOpsDouble(attention_dtypes=FP32)
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(npu, "get_npu_ops", lambda: ops)
        mp.setattr(npu, "FIA_DTYPES", FP32)
        mp.setattr(npu_double, "KV_CACHE_DTYPES", FP32)
        b = batch(seed, block_size, *heads, neox=neox, decode=decode)
        out = run(b)
    want = dense_oracle(b.query, b.kv_cache, b.meta, b.base, neox, b.scale)
    torch.testing.assert_close(out.double(), want, atol=1e-5, rtol=1e-5)
    modes = {kw["mode"] for name, kw in ops.calls if name == "npu_rotary_mul"}
    assert modes == {"half" if neox else "interleave"}


@pytest.mark.parametrize("neox", [True, False])
@pytest.mark.parametrize("block_size", [16, 128])
def test_documented_dtypes_bf16(double, block_size, neox):
    b = batch(block_size + neox, block_size, 8, 2, neox=neox, dtype=torch.bfloat16)
    out = run(b)
    assert out.dtype == torch.bfloat16
    want = dense_oracle(b.query, b.kv_cache, b.meta, b.base, neox, b.scale)
    torch.testing.assert_close(out.double(), want, atol=2e-2, rtol=2e-2)


def test_fp32_query_is_attended_in_bf16(double):
    """The A2 fused op takes no fp32: fp32 inputs are rotated in fp32, attended in bf16."""
    b = batch(3, 32, 6, 3, neox=False)
    out = run(b)
    assert out.dtype == torch.float32
    fia = fia_calls(double)
    assert fia and all(kw["dtype"] == torch.bfloat16 for kw in fia)
    want = dense_oracle(b.query, b.kv_cache, b.meta, b.base, False, b.scale)
    torch.testing.assert_close(out.double(), want, atol=2e-2, rtol=2e-2)


def test_one_paged_tnd_call_per_layer_without_dense_masks(double):
    """Decode: one FIA call in TND paged mode, one run (FIA batch) per sequence, the shared
    2048 x 2048 causal mask only; K/V reach the scratch through npu_scatter_pa_kv_cache."""
    b = batch(5, 128, 8, 2, decode=True, num_seqs=4)
    run(b)
    (call,) = fia_calls(double)
    assert call["layout"] == "TND" and call["paged"] and call["block_size"] == 128
    assert call["sparse_mode"] == 3 and call["mask"][1] == (2048, 2048)
    assert call["actual_seq_lengths"] == [1, 2, 3, 4]
    rotations = [kw for name, kw in double.calls if name == "npu_rotary_mul"]
    assert len(rotations) == 2  # the queries, and the keys of the step's one pass


def test_plan_is_built_once_per_step(double):
    b = batch(6, 128, 4, 2)
    run(b)
    plan = plan_of(b)
    run(b)  # a second layer of the same step
    assert plan_of(b) is plan


def test_runs_follow_visibility():
    """Each run is consecutive rows of one sequence whose visible key counts grow by one, so
    FIA's bottom-right causal rule reproduces MEPIC's scattered-query visibility exactly."""
    b = batch(8, 16, 4, 2, num_seqs=4)
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(npu, "get_npu_ops", lambda: NpuOpsDouble())
        run(b)
    (p,) = plan_of(b).passes
    m = b.meta
    loc = m.query_start_loc.tolist()
    visible = []
    for s in range(m.num_seqs):
        idx = [
            j * 16 + t
            for j in range(int(m.num_blocks[s]))
            for t in range(int(m.block_valid_start[s, j]), int(m.block_valid_end[s, j]))
        ]
        rows = m.query_indices[loc[s] : loc[s + 1]].tolist()
        visible += [sum(1 for k in idx if k <= q) for q in rows]
    (group,) = p.groups
    starts = [0, *group.query_ends[:-1]]
    for start, end, kv in zip(starts, group.query_ends, group.kv_lens, strict=True):
        q_len = end - start
        assert visible[start:end] == list(range(kv - q_len + 1, kv + 1))


@pytest.mark.parametrize("decode", [False, True])
def test_pad_slots_may_hold_nan(double, decode):
    """Never-written cache slots (pads, unused blocks) may be NaN without touching the result."""
    b = batch(9, 32, 8, 2, decode=decode, dtype=torch.float16)
    want = run(b)
    m = b.meta
    real = torch.zeros(b.kv_cache.shape[1:3], dtype=torch.bool)
    for s in range(m.num_seqs):
        for j in range(int(m.num_blocks[s])):
            blk = int(m.block_tables[s, j])
            real[blk, int(m.block_valid_start[s, j]) : int(m.block_valid_end[s, j])] = True
    assert not real.all()
    b.kv_cache[:, ~real] = float("nan")
    out = run(b)
    assert torch.isfinite(out).all()
    torch.testing.assert_close(out, want)


def test_dispatch_to_npu(double, monkeypatch):
    b = batch(7, 32, 4, 2, dtype=torch.float16)
    monkeypatch.setenv("ASCEND_MEPIC_ATTN_IMPL", "npu")
    on_npu(b)
    with emulated_npu():
        out = rope_paged_attention(b.query, b.kv_cache, b.meta, b.rope, b.scale)
    torch.testing.assert_close(out, run(b))


def test_rejects_shapes_outside_documented_limits(double):
    b = random_batch(0, 16, 4, 4, head=96)  # MHA: 64 and 128 only (GQA: up to 256)
    with pytest.raises(ValueError, match="TND paged mode takes"):
        run(b)


def test_without_torch_npu_raises_clear_error(monkeypatch):
    monkeypatch.setitem(sys.modules, "torch_npu", None)  # makes `import torch_npu` fail
    b = batch(0, 16, 4, 2)
    with pytest.raises(npu.NpuUnavailableError, match="torch_npu with the CANN toolkit"):
        npu.rope_paged_attention_npu(b.query, b.kv_cache, b.meta, b.rope, b.scale)


@pytest.mark.skipif(
    importlib.util.find_spec("torch_npu") is not None, reason="torch_npu is installed here"
)
def test_real_resolver_in_this_environment():
    with pytest.raises(ImportError, match="CANN"):
        npu.get_npu_ops()


# The double itself, against plain torch, so that a wrong double cannot hide a wrong composition.


def test_double_rotary_modes_match_complex_rotation():
    with emulated_npu(default_npu=True):  # the double checks its inputs are on the NPU
        ops = NpuOpsDouble()
        x = torch.randn(1, 5, 3, 8, dtype=torch.float64).float()
        angle = torch.rand(5, 4) * 6
        z = torch.polar(torch.ones_like(angle), angle)[None, :, None, :]
        c, s = angle.cos(), angle.sin()
        half = ops.npu_rotary_mul(x, *(torch.cat((t, t), -1)[None, :, None] for t in (c, s)))
        want = torch.complex(x[..., :4], x[..., 4:]) * z
        torch.testing.assert_close(half, torch.cat((want.real, want.imag), -1))
        inter = ops.npu_rotary_mul(
            x,
            *(t.repeat_interleave(2, -1)[None, :, None] for t in (c, s)),
            rotary_mode="interleave",
        )
        want = torch.complex(x[..., 0::2], x[..., 1::2]) * z
        torch.testing.assert_close(inter, torch.stack((want.real, want.imag), -1).flatten(-2))
        with pytest.raises(DocumentedConstraintError, match="interleave"):
            ops.npu_rotary_mul(x, torch.ones(1, 5, 3, 8), torch.ones(1, 5, 3, 8), "interleave")


@pytest.mark.parametrize("layout", ["BNSD", "BSND", "BSH"])
def test_double_attention_matches_sdpa(layout):
    with emulated_npu(default_npu=True):
        ops = NpuOpsDouble()
        q = torch.randn(2, 8, 7, 16, dtype=torch.float16)
        k = torch.randn(2, 2, 11, 16, dtype=torch.float16)
        v = torch.randn(2, 2, 11, 16, dtype=torch.float16)
        hidden = torch.rand(2, 1, 7, 11) < 0.3
        hidden[..., 0] = False
        want = F.scaled_dot_product_attention(
            q.float(), k.float(), v.float(), attn_mask=~hidden, scale=0.3, enable_gqa=True
        )

        def lay(t):
            if layout == "BNSD":
                return t.contiguous()
            t = t.transpose(1, 2).contiguous()
            return t if layout == "BSND" else t.flatten(2)

        out, lse = ops.npu_fused_infer_attention_score(
            lay(q),
            lay(k),
            lay(v),
            atten_mask=hidden,
            num_heads=8,
            num_key_value_heads=2,
            scale=0.3,
            input_layout=layout,
        )
        assert out.shape == lay(q).shape and out.dtype == torch.float16 and lse.shape == (1,)
        torch.testing.assert_close(out, lay(want.half()), atol=2e-3, rtol=2e-3)
        with pytest.raises(DocumentedConstraintError, match="dtype"):
            ops.npu_fused_infer_attention_score(
                lay(q).float(), lay(k).float(), lay(v).float(), num_heads=8, input_layout=layout
            )


def test_yarn_scaled_cos_sin_stay_in_the_rotary_ops_range():
    """YaRN's cos/sin carry an attention factor (mscale > 1), outside ``npu_rotary_mul``'s
    documented [-1, 1]: the tables are divided by it and FIA's scale takes its square, which
    gives the reference's result (the double rejects the unscaled tables)."""
    from dataclasses import replace

    from ascend_mepic.ops.reference import rope_paged_attention_reference

    ops = NpuOpsDouble(attention_dtypes=FP32)
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(npu, "get_npu_ops", lambda: ops)
        mp.setattr(npu, "FIA_DTYPES", FP32)
        mp.setattr(npu_double, "KV_CACHE_DTYPES", FP32)
        b = batch(3, 128, 8, 2)
        mscale = 0.1 * math.log(4.0) + 1.0  # vLLM's YaRN factor 4
        b = replace(b, rope=RopeSpec(b.rope.cos_sin_cache * mscale, b.rope.is_neox_style))
        out = run(b)
    want = rope_paged_attention_reference(b.query, b.kv_cache, b.meta, b.rope, b.scale)
    torch.testing.assert_close(out, want, atol=1e-5, rtol=1e-5)
