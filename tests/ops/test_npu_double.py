"""The torch_npu double's TND/paged attention, KV-cache writes and RoPE ops, against plain torch.

A wrong double would hide a wrong composition, so each modelled mode is checked against a
straightforward dense computation written independently here (token-by-token block-table walks,
``F.scaled_dot_product_attention``, complex rotation), and each documented limit must raise.
"""

import inspect
import math
import re
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F

from tests.ops import npu_double
from tests.ops.emulated_device import NPU, NotOnNpuError, emulated_npu, mark_npu, on_npu
from tests.ops.npu_double import OPS, DocumentedConstraintError, NpuOpsDouble

FP32 = dict(atol=1e-5, rtol=1e-5)
CAUSAL_2048 = torch.triu(torch.ones(2048, 2048), diagonal=1).to(torch.int8)
mark_npu(CAUSAL_2048)  # made at import; the tests' own tensors are made on the NPU (fixture)


@pytest.fixture(autouse=True)
def tensors_on_npu():
    """Every tensor a test makes lands on the emulated NPU (like ``set_default_device("npu")``),
    except where it names the host (``device="cpu"``)."""
    with emulated_npu(default_npu=True):
        yield


def _npu_values(change: dict) -> dict:
    """Parametrised tensors are made at collection, outside the fixture: put them on the NPU."""
    for value in change.values():
        if isinstance(value, torch.Tensor):
            mark_npu(value)
    return change


def small_fp32_double() -> NpuOpsDouble:
    """Knobs widened past the A2 limits (fp32, D=16, block 16) to test index logic tightly."""
    return NpuOpsDouble(
        attention_dtypes=(torch.float32,), tnd_head_dims=(16,), tnd_block_sizes=(16,)
    )


def _gather(cache: torch.Tensor, table: torch.Tensor, b: int, n: int) -> torch.Tensor:
    """Token-by-token walk of batch b's blocks in a [num_blocks, block_size, KV_N, D] cache."""
    bs = cache.shape[1]
    return torch.stack([cache[int(table[b, i // bs]), i % bs] for i in range(n)])


def _attend(q, k, v, scale, causal):
    """Dense reference: q [q_len, N, D], k/v [kv_len, KV_N, D]; bottom-right causal if asked."""
    q_len, kv_len = q.shape[0], k.shape[0]
    keep = None
    if causal:
        i = torch.arange(q_len)[:, None]
        keep = torch.arange(kv_len)[None, :] <= i + (kv_len - q_len)
    out = F.scaled_dot_product_attention(
        q.double().transpose(0, 1),
        k.double().transpose(0, 1),
        v.double().transpose(0, 1),
        attn_mask=keep,
        scale=scale,
        enable_gqa=True,
    )
    return out.transpose(0, 1)


def _paged_case(q_lens, kv_lens, heads, kv_heads, d, bs, dtype, seed=0, spare=3):
    """Random query, BnBsH caches (as ``cache.view(nb, bs, -1)``) and a shuffled block table."""
    g = torch.Generator().manual_seed(seed)
    need = [math.ceil(n / bs) for n in kv_lens]
    nb = sum(need) + spare
    k_cache = torch.randn(nb, bs, kv_heads, d, generator=g).to(dtype)
    v_cache = torch.randn(nb, bs, kv_heads, d, generator=g).to(dtype)
    perm = torch.randperm(nb, generator=g)
    table = torch.full((len(kv_lens), max(need) + 1), nb - 1, dtype=torch.int32)
    used = 0
    for b, m in enumerate(need):
        table[b, :m] = perm[used : used + m].to(torch.int32)
        used += m
    query = torch.randn(sum(q_lens), heads, d, generator=g).to(dtype)
    ends = torch.tensor(q_lens).cumsum(0).tolist()
    return query, k_cache, v_cache, table, ends


def _fia_paged(ops, query, k_cache, v_cache, table, ends, kv_lens, bs, sparse, **kw):
    nb, _, kv_heads, d = k_cache.shape
    return ops.npu_fused_infer_attention_score(
        query,
        k_cache.view(nb, bs, -1),
        v_cache.view(nb, bs, -1),
        atten_mask=CAUSAL_2048 if sparse == 3 else None,
        block_table=table,
        input_layout="TND",
        block_size=bs,
        actual_seq_lengths=ends,
        actual_seq_lengths_kv=kv_lens,
        num_key_value_heads=kv_heads,
        num_heads=query.shape[1],
        scale=kw.pop("scale", 1 / math.sqrt(d)),
        sparse_mode=sparse,
        **kw,
    )


# ---------------------------------------------------------------- TND paged attention


@pytest.mark.parametrize("sparse", [0, 3])
@pytest.mark.parametrize("heads", [(4, 4), (8, 2)])
def test_tnd_paged_matches_per_sequence_attention(sparse, heads):
    """Documented A2 shapes (D=128, block 128, fp16): decode, chunk, prefill-no-cache mixed."""
    q_lens, kv_lens = [1, 5, 130, 0], [200, 37, 130, 3]
    query, kc, vc, table, ends = _paged_case(q_lens, kv_lens, *heads, 128, 128, torch.float16)
    ops = NpuOpsDouble()
    out, lse = _fia_paged(ops, query, kc, vc, table, ends, kv_lens, 128, sparse)
    assert out.shape == query.shape and out.dtype == torch.float16 and lse.shape == (1,)
    start = 0
    for b, (q_len, kv_len) in enumerate(zip(q_lens, kv_lens, strict=True)):
        k, v = _gather(kc, table, b, kv_len), _gather(vc, table, b, kv_len)
        want = _attend(query[start : start + q_len], k, v, 1 / math.sqrt(128), sparse == 3)
        torch.testing.assert_close(out[start : start + q_len].double(), want, atol=2e-3, rtol=2e-3)
        start += q_len
    (name, kw), *_ = ops.calls
    assert name == "npu_fused_infer_attention_score" and kw["layout"] == "TND" and kw["paged"]
    assert kw["actual_seq_lengths"] == ends and kw["actual_seq_lengths_kv"] == kv_lens


@pytest.mark.parametrize("seed", range(4))
def test_tnd_paged_index_logic_fp32_small_blocks(seed):
    """Widened knobs (fp32, D=16, block 16) to check the block walk and lse at tight tolerance."""
    g = torch.Generator().manual_seed(seed)
    batch = 5
    kv_lens = torch.randint(1, 70, (batch,), generator=g).tolist()
    q_lens = [int(torch.randint(0, n + 1, (1,), generator=g)) for n in kv_lens]
    query, kc, vc, table, ends = _paged_case(
        q_lens, kv_lens, 6, 3, 16, 16, torch.float32, seed=seed
    )
    ops = small_fp32_double()
    out, lse = _fia_paged(
        ops, query, kc, vc, table, ends, kv_lens, 16, 3, scale=0.3, softmax_lse_flag=True
    )
    assert lse.shape == (sum(q_lens), 6, 1) and lse.dtype == torch.float32
    start = 0
    for b, (q_len, kv_len) in enumerate(zip(q_lens, kv_lens, strict=True)):
        if q_len:
            q = query[start : start + q_len].double()
            k = _gather(kc, table, b, kv_len).double().repeat_interleave(2, 1)
            v = _gather(vc, table, b, kv_len).double()
            want = _attend(q, k[:, ::2], v, 0.3, True)
            torch.testing.assert_close(out[start : start + q_len].double(), want, **FP32)
            s = torch.einsum("qnd,knd->qnk", q, k) * 0.3
            hide = torch.arange(kv_len)[None, :] > torch.arange(q_len)[:, None] + kv_len - q_len
            s = s.masked_fill(hide[:, None, :], float("-inf"))
            got = lse[start : start + q_len, :, 0].double()
            torch.testing.assert_close(got, s.logsumexp(-1), **FP32)
        start += q_len


def test_sparse_mode_3_is_bottom_right_causal_and_ignores_unread_slots():
    """Row i of a batch sees keys 0..kv_len-q_len+i only; slots past kv_len are never read."""
    q_lens, kv_lens = [4, 1], [10, 7]
    query, kc, vc, table, ends = _paged_case(q_lens, kv_lens, 2, 1, 16, 16, torch.float32, spare=0)
    ops = small_fp32_double()
    base, _ = _fia_paged(ops, query, kc, vc, table, ends, kv_lens, 16, 3)
    # Batch 0: q_len 4, kv_len 10 -> query i sees keys 0..6+i. Change key 9 (seen by row 3 only).
    blk = int(table[0, 0])
    kc2, vc2 = kc.clone(), vc.clone()
    kc2[blk, 9] += 5.0
    vc2[blk, 9] += 5.0
    # Unread slots (past each batch's length) may hold anything, NaN included.
    kc2[blk, 10:] = float("nan")
    vc2[int(table[1, 0]), 7:] = float("nan")
    out, _ = _fia_paged(ops, query, kc2, vc2, table, ends, kv_lens, 16, 3)
    assert torch.isfinite(out).all()
    torch.testing.assert_close(out[:3], base[:3])
    assert not torch.allclose(out[3], base[3])
    torch.testing.assert_close(out[4:], base[4:])
    # Decode row (q_len 1) sees every key of its batch: same as sparse_mode=0.
    full, _ = _fia_paged(ops, query, kc, vc, table, ends, kv_lens, 16, 0)
    torch.testing.assert_close(full[4:], base[4:])


def test_tnd_contiguous_kv_uses_cumulative_kv_ends():
    """Without a block table, key/value are [T_kv, KV_N, D] and the kv lengths are cumulative."""
    g = torch.Generator().manual_seed(3)
    lens = [3, 0, 9]
    ends = torch.tensor(lens).cumsum(0).tolist()
    q = torch.randn(12, 8, 128, generator=g).half()
    k = torch.randn(12, 2, 128, generator=g).half()
    v = torch.randn(12, 2, 128, generator=g).half()
    ops = NpuOpsDouble()
    out, _ = ops.npu_fused_infer_attention_score(
        q,
        k,
        v,
        atten_mask=CAUSAL_2048.bool(),
        input_layout="TND",
        actual_seq_lengths=ends,
        actual_seq_lengths_kv=ends,
        num_heads=8,
        num_key_value_heads=2,
        scale=0.1,
        sparse_mode=3,
    )
    for s, e in ((0, 3), (3, 12)):
        want = _attend(q[s:e], k[s:e], v[s:e], 0.1, True)
        torch.testing.assert_close(out[s:e].double(), want, atol=2e-3, rtol=2e-3)
    with pytest.raises(DocumentedConstraintError, match="non-decreasing"):
        ops.npu_fused_infer_attention_score(
            q, k, v, input_layout="TND", actual_seq_lengths=ends, actual_seq_lengths_kv=lens,
            num_heads=8, num_key_value_heads=2,
        )  # fmt: skip


def _good_call_kwargs():
    query, kc, vc, table, ends = _paged_case([2, 1], [130, 9], 4, 2, 128, 128, torch.bfloat16)
    nb = kc.shape[0]
    return dict(
        query=query,
        key=kc.view(nb, 128, -1),
        value=vc.view(nb, 128, -1),
        atten_mask=CAUSAL_2048,
        block_table=table,
        input_layout="TND",
        block_size=128,
        actual_seq_lengths=ends,
        actual_seq_lengths_kv=[130, 9],
        num_heads=4,
        num_key_value_heads=2,
        scale=0.08,
        sparse_mode=3,
    )


def test_good_call_passes():
    out, _ = NpuOpsDouble().npu_fused_infer_attention_score(**_good_call_kwargs())
    assert out.shape == (3, 4, 128) and out.dtype == torch.bfloat16


def _tril_mask():
    return torch.tril(torch.ones(2048, 2048, dtype=torch.bool))


@pytest.mark.parametrize(
    ("change", "match"),
    [
        (dict(block_size=256), "block_size"),
        (dict(block_size=16), "block_size"),
        (dict(actual_seq_lengths=[2, 2]), r"actual_seq_lengths\[-1\]"),
        (dict(actual_seq_lengths=[3, 2]), "non-decreasing"),
        (dict(actual_seq_lengths=torch.tensor([2, 3])), "List"),
        (dict(actual_seq_lengths_kv=[130, 139, 5]), "batch"),
        (dict(actual_seq_lengths_kv=[130, 139 + 256]), "narrower"),
        (dict(atten_mask=None), "2048"),
        (dict(atten_mask=_tril_mask()), "triu"),
        (dict(atten_mask=CAUSAL_2048[:512, :512].contiguous()), "shape"),
        (dict(atten_mask=CAUSAL_2048 * 2), "0/1"),
        (dict(sparse_mode=0), "no atten_mask"),
        (dict(sparse_mode=4), "not modelled"),
        (dict(inner_precise=2), "inner_precise"),
        (dict(num_key_value_heads=4), "KV_N"),
        (dict(input_layout="BSH"), "TND layout only"),
    ],
)
def test_tnd_documented_limits_raise(change, match):
    kwargs = _good_call_kwargs()
    kwargs.update(_npu_values(change))
    with pytest.raises(DocumentedConstraintError, match=match):
        NpuOpsDouble().npu_fused_infer_attention_score(**kwargs)


def test_tnd_more_documented_limits_raise():
    ops = NpuOpsDouble()
    kw = _good_call_kwargs()
    with pytest.raises(DocumentedConstraintError, match="int32"):
        ops.npu_fused_infer_attention_score(**{**kw, "block_table": kw["block_table"].long()})
    bad = kw["block_table"].clone()
    bad[0, 1] = kw["key"].shape[0]
    with pytest.raises(DocumentedConstraintError, match="invalid block id"):
        ops.npu_fused_infer_attention_score(**{**kw, "block_table": bad})
    nb = kw["key"].shape[0]
    bnnbsd = kw["key"].view(nb, 128, 2, 128).transpose(1, 2).contiguous()
    with pytest.raises(DocumentedConstraintError, match="BnBsH"):
        ops.npu_fused_infer_attention_score(**{**kw, "key": bnnbsd, "value": bnnbsd})
    with pytest.raises(DocumentedConstraintError, match="q_len <= kv_len"):
        ops.npu_fused_infer_attention_score(**{**kw, "actual_seq_lengths_kv": [1, 9]})
    q64 = torch.zeros(3, 4, 64, dtype=torch.bfloat16)
    k64 = torch.zeros(nb, 128, 128, dtype=torch.bfloat16)
    with pytest.raises(DocumentedConstraintError, match="head dim"):
        ops.npu_fused_infer_attention_score(**{**kw, "query": q64, "key": k64, "value": k64})
    with pytest.raises(DocumentedConstraintError, match="dtype"):
        ops.npu_fused_infer_attention_score(
            **{**kw, "query": kw["query"].float(), "key": kw["key"].float(),
               "value": kw["value"].float()}
        )  # fmt: skip


# ---------------------------------------------------------------- KV cache writes


def _kv(t=5, n=2, dk=16, dv=32, nb=3, bs=4, dtype=torch.float16, seed=0):
    g = torch.Generator().manual_seed(seed)
    key = torch.randn(t, n, dk, generator=g).to(dtype)
    value = torch.randn(t, n, dv, generator=g).to(dtype)
    kc = torch.randn(nb, bs, n, dk, generator=g).to(dtype)
    vc = torch.randn(nb, bs, n, dv, generator=g).to(dtype)
    return key, value, kc, vc


@pytest.mark.parametrize("op", ["npu_scatter_pa_kv_cache", "_npu_reshape_and_cache"])
@pytest.mark.parametrize("slot_dtype", [torch.int32, torch.int64])
def test_cache_write_hits_exact_slots(op, slot_dtype):
    key, value, kc, vc = _kv()
    slots = torch.tensor([11, 0, 4, 7, 3], dtype=slot_dtype)
    k0, v0 = kc.clone(), vc.clone()
    ops = NpuOpsDouble()
    if op == "npu_scatter_pa_kv_cache":
        assert ops.npu_scatter_pa_kv_cache(key, value, kc, vc, slots, cache_mode="Norm") is None
    else:
        ops._npu_reshape_and_cache(key, value, kc, vc, slots)
    written = set(slots.tolist())
    for s in range(12):
        blk, off = divmod(s, 4)
        if s in written:
            t = slots.tolist().index(s)
            assert torch.equal(kc[blk, off], key[t]) and torch.equal(vc[blk, off], value[t])
        else:
            assert torch.equal(kc[blk, off], k0[blk, off])
            assert torch.equal(vc[blk, off], v0[blk, off])
    assert ops.calls[0][0] == op


@pytest.mark.parametrize(
    ("change", "match"),
    [
        (dict(cache_mode="PA_NZ"), "PA_NZ"),
        (dict(slot_mapping=torch.tensor([11, 0, -1, 7, 3], dtype=torch.int32)), "no -1"),
        (dict(slot_mapping=torch.tensor([11, 0, 12, 7, 3], dtype=torch.int32)), "lie in"),
        (dict(slot_mapping=torch.tensor([11, 0, 0, 7, 3], dtype=torch.int32)), "distinct"),
        (dict(slot_mapping=torch.tensor([11, 0, 4, 7], dtype=torch.int32)), "length T"),
        (dict(slot_mapping=torch.tensor([11.0, 0, 4, 7, 3])), "int32/int64"),
        (dict(seq_lens=torch.tensor([5], dtype=torch.int32)), "compressed"),
    ],
)
def test_scatter_documented_limits_raise(change, match):
    key, value, kc, vc = _kv()
    kwargs = dict(
        key=key,
        value=value,
        key_cache=kc,
        value_cache=vc,
        slot_mapping=torch.tensor([11, 0, 4, 7, 3], dtype=torch.int32),
        cache_mode="Norm",
    )
    kwargs.update(_npu_values(change))
    before = kc.clone()
    with pytest.raises(DocumentedConstraintError, match=match):
        NpuOpsDouble().npu_scatter_pa_kv_cache(**kwargs)
    assert torch.equal(kc, before)


def test_scatter_default_cache_mode_is_pa_nz_and_rejected():
    key, value, kc, vc = _kv()
    slots = torch.arange(5, dtype=torch.int32)
    with pytest.raises(DocumentedConstraintError, match="cache_mode='Norm'"):
        NpuOpsDouble().npu_scatter_pa_kv_cache(key, value, kc, vc, slots)


def test_cache_write_dtype_layout_and_contiguity_limits():
    ops = NpuOpsDouble()
    slots = torch.arange(5, dtype=torch.int32)
    key, value, kc, vc = _kv(dtype=torch.float32)
    with pytest.raises(DocumentedConstraintError, match="float32"):
        ops.npu_scatter_pa_kv_cache(key, value, kc, vc, slots, cache_mode="Norm")
    key, value, kc, vc = _kv()
    with pytest.raises(DocumentedConstraintError, match="dtypes must be identical"):
        ops._npu_reshape_and_cache(key, value.bfloat16(), kc, vc, slots)
    with pytest.raises(DocumentedConstraintError, match="contiguous"):
        ops.npu_scatter_pa_kv_cache(
            key.transpose(0, 1).contiguous().transpose(0, 1), value, kc, vc, slots,
            cache_mode="Norm",
        )  # fmt: skip
    hnd = kc.transpose(1, 2).contiguous()  # [nb, N, bs, D] is not the "Norm" layout
    with pytest.raises(DocumentedConstraintError, match="key_cache must be"):
        ops.npu_scatter_pa_kv_cache(key, value, hnd, vc, slots, cache_mode="Norm")
    key, value, kc, vc = _kv(dtype=torch.int8)
    ops.npu_scatter_pa_kv_cache(key, value, kc, vc, slots, cache_mode="Norm")
    assert torch.equal(kc.view(-1, 2, 16)[:5], key)


# ---------------------------------------------------------------- RoPE


def _rope_reference(x, pos, cache, head_size, neox):
    """Multiply by cos + i sin (the cache's halves) per head; lanes past rotary_dim pass through."""
    t, rotary_dim = x.shape[0], cache.shape[-1]
    h = x.double().reshape(t, -1, head_size)
    rot, keep = h[..., :rotary_dim], h[..., rotary_dim:]
    cos, sin = cache.double()[pos].chunk(2, dim=-1)
    z = torch.complex(cos, sin)[:, None, :]
    if neox:
        c = torch.complex(rot[..., : rotary_dim // 2], rot[..., rotary_dim // 2 :]) * z
        rot = torch.cat((c.real, c.imag), -1)
    else:
        c = torch.complex(rot[..., 0::2], rot[..., 1::2]) * z
        rot = torch.stack((c.real, c.imag), -1).flatten(-2)
    return torch.cat((rot, keep), -1).reshape(x.shape)


@pytest.mark.parametrize("mode", ["half", "interleaved"])
@pytest.mark.parametrize(("dtype", "head_size", "rotary_dim"), [
    (torch.float32, 48, 32), (torch.float32, 64, 64), (torch.bfloat16, 128, 64),
])  # fmt: skip
def test_mrope_matches_rotation_formula(mode, dtype, head_size, rotary_dim):
    g = torch.Generator().manual_seed(1)
    t, max_pos = 7, 40
    theta = torch.rand(max_pos, rotary_dim // 2, generator=g, dtype=torch.float64) * 6
    cache = torch.cat((theta.cos(), theta.sin()), -1).to(dtype)
    pos = torch.randint(0, max_pos, (t,), generator=g)
    q = torch.randn(t, 4 * head_size, generator=g).to(dtype)
    k = torch.randn(t, 2 * head_size, generator=g).to(dtype)
    ops = NpuOpsDouble()
    q_out, k_out = ops.npu_mrope(pos, q, k, cache, head_size, rotary_mode=mode)
    assert q_out.shape == q.shape and q_out.dtype == dtype and k_out.shape == k.shape
    tol = FP32 if dtype == torch.float32 else dict(atol=3e-2, rtol=3e-2)
    for x, out in ((q, q_out), (k, k_out)):
        want = _rope_reference(x, pos, cache, head_size, mode == "half")
        torch.testing.assert_close(out.double(), want, **tol)
        keep = out.reshape(t, -1, head_size)[..., rotary_dim:]
        assert torch.equal(keep, x.reshape(t, -1, head_size)[..., rotary_dim:])


def test_mrope_documented_limits_raise():
    ops = NpuOpsDouble()
    pos = torch.arange(3)
    q, k = torch.zeros(3, 128, dtype=torch.float16), torch.zeros(3, 64, dtype=torch.float16)
    cache = torch.zeros(8, 64, dtype=torch.float16)
    ops.npu_mrope(pos, q, k, cache, 64, mrope_section=[0, 0, 0])  # documented RoPE mode
    cases = [
        (dict(rotary_mode="interleave"), "interleaved"),
        (dict(head_size=48), "multiple of 32"),
        (dict(cos_sin_cache=torch.zeros(8, 48, dtype=torch.float16)), "rotary_dim"),
        (dict(cos_sin_cache=torch.zeros(8, 128, dtype=torch.float16)), "rotary_dim"),
        (dict(cos_sin_cache=cache.float()), "identical"),
        (dict(positions=torch.tensor([0, 8, 1])), "max_seq_len"),
        (dict(positions=pos.float()), "positions dtype"),
        (dict(positions=pos.repeat(3, 1), mrope_section=[16, 8, 8]), "MRoPE"),
        (dict(cache_mode="interleave"), "cache_mode"),
        (dict(query=q.reshape(3, 2, 64)), "2-D"),
        (dict(query=q.double(), key=k.double(), cos_sin_cache=cache.double()), "dtype"),
    ]
    for change, match in cases:
        kwargs = dict(positions=pos, query=q, key=k, cos_sin_cache=cache, head_size=64)
        kwargs.update(change)
        with pytest.raises(DocumentedConstraintError, match=match):
            ops.npu_mrope(**kwargs)


@pytest.mark.parametrize("layout", ["BSND", "TND"])
def test_apply_rotary_pos_emb_in_place_matches_rotary_mul(layout):
    g = torch.Generator().manual_seed(2)
    lead = (2, 3) if layout == "BSND" else (6,)
    q = torch.randn(*lead, 4, 64, generator=g).half()
    k = torch.randn(*lead, 2, 64, generator=g).half()
    angle = torch.rand(*lead, 1, 32, generator=g) * 6
    cos = torch.cat((angle.cos(), angle.cos()), -1).half()
    sin = torch.cat((angle.sin(), angle.sin()), -1).half()
    ops = NpuOpsDouble()
    as4d = (lambda t: t) if layout == "BSND" else (lambda t: t[None])
    want_q = ops.npu_rotary_mul(as4d(q), as4d(cos), as4d(sin)).reshape(q.shape)
    want_k = ops.npu_rotary_mul(as4d(k), as4d(cos), as4d(sin)).reshape(k.shape)
    q_out, k_out = ops.npu_apply_rotary_pos_emb(q, k, cos, sin, layout=layout)
    assert q_out is q and k_out is k
    torch.testing.assert_close(q, want_q)
    torch.testing.assert_close(k, want_k)
    with pytest.raises(DocumentedConstraintError, match="'half' only"):
        ops.npu_apply_rotary_pos_emb(q, k, cos, sin, layout=layout, rotary_mode="interleave")
    with pytest.raises(DocumentedConstraintError, match="64 or 128"):
        ops.npu_apply_rotary_pos_emb(q[..., :32], k[..., :32], cos[..., :32], sin[..., :32],
                                     layout=layout)  # fmt: skip
    with pytest.raises(DocumentedConstraintError, match="layout"):
        ops.npu_apply_rotary_pos_emb(q, k, cos, sin, layout="BNSD")


# ---------------------------------------------------------------- signatures (torch_npu 2.10)

SCHEMAS = Path(__file__).with_name("torch_npu_schemas.txt")
# Keyword arguments the double takes through ``**kwargs`` (rejecting any other name), with the
# defaults they must keep.
UNMODELLED_KWARGS = {"npu_fused_infer_attention_score": npu_double.UNMODELLED}


def _schemas() -> dict[str, torch.FunctionSchema]:
    lines = [line for line in SCHEMAS.read_text().splitlines() if not line.startswith("#")]
    parsed = [torch._C.parse_schema(line) for line in lines]
    return {schema.name: schema for schema in parsed}


def _same_default(ours: object, theirs: object) -> bool:
    return type(ours) is type(theirs) and ours == theirs


def signature_mismatches(cls: type, name: str, schema: torch.FunctionSchema) -> list[str]:
    """How ``cls.name`` accepts other calls than the schema: names, order, keyword-only-ness,
    defaults, ``*args``/``**kwargs``, number of results. Empty when it accepts exactly them."""
    P = inspect.Parameter
    sig = inspect.signature(getattr(cls, name))  # follows the device wrapper's __wrapped__
    params = list(sig.parameters.values())[1:]  # self
    unmodelled = UNMODELLED_KWARGS.get(name, {})
    problems = []
    if any(p.kind in (P.POSITIONAL_ONLY, P.VAR_POSITIONAL) for p in params):
        problems.append("positional-only parameters or *args (torch ops take names)")
    if any(p.kind is P.VAR_KEYWORD for p in params) != bool(unmodelled):
        problems.append("**kwargs without a declared list of the names it takes, or vice versa")
    positional = [p for p in params if p.kind is P.POSITIONAL_OR_KEYWORD]
    want_positional = [a.name for a in schema.arguments if not a.kwarg_only]
    if [p.name for p in positional] != want_positional:
        problems.append(f"positional {[p.name for p in positional]} != {want_positional}")
    keyword = {p.name: p for p in params if p.kind is P.KEYWORD_ONLY}
    want_keyword = {a.name for a in schema.arguments if a.kwarg_only}
    if keyword.keys() & unmodelled.keys() or keyword.keys() | unmodelled.keys() != want_keyword:
        got = keyword.keys() | unmodelled.keys()
        missing, extra = sorted(want_keyword - got), sorted(got - want_keyword)
        problems.append(f"keyword-only: missing {missing}, extra {extra}")
    ours = {p.name: p.default for p in params} | dict(unmodelled)
    for arg in schema.arguments:
        if arg.name not in ours:
            continue
        default = ours[arg.name]
        if arg.has_default_value() and not _same_default(default, arg.default_value):
            problems.append(f"{arg.name} default {default!r} != {arg.default_value!r}")
        if not arg.has_default_value() and default is not P.empty:
            problems.append(f"{arg.name} has a default ({default!r}); the op requires it")
    n = len(schema.returns)
    want_return = {0: "None", 1: "torch.Tensor"}.get(n, f"tuple[{', '.join(['torch.Tensor'] * n)}]")
    if sig.return_annotation != want_return:
        problems.append(f"returns {sig.return_annotation} != {want_return}")
    return problems


def test_schemas_cover_every_op_of_the_double():
    assert sorted(_schemas()) == sorted(OPS)
    assert "7d88428d9bb8473919a38947617fcc481cb6e28927a8aa30e486a9bc42f30d90" in SCHEMAS.read_text()


@pytest.mark.parametrize("name", OPS)
def test_double_signature_matches_torch_npu_schema(name):
    assert signature_mismatches(NpuOpsDouble, name, _schemas()[name]) == []


class _Renamed(NpuOpsDouble):
    def npu_swiglu(self, x: torch.Tensor, dim: int = -1) -> torch.Tensor: ...


class _DefaultChanged(NpuOpsDouble):
    def npu_rms_norm(
        self, input: torch.Tensor, gamma: torch.Tensor, epsilon: float = 1e-5
    ) -> tuple[torch.Tensor, torch.Tensor]: ...


class _KeywordOnlyMadePositional(NpuOpsDouble):
    def npu_mrope(
        self, positions, query, key, cos_sin_cache, head_size,
        mrope_section=None, rotary_mode="half", cache_mode="default",
    ) -> tuple[torch.Tensor, torch.Tensor]: ...  # fmt: skip


class _MissingArgument(NpuOpsDouble):  # the double before this check: no ``rotate``
    def npu_rotary_mul(self, input, r1, r2, rotary_mode: str = "half") -> torch.Tensor: ...


class _ExtraArgument(NpuOpsDouble):
    def npu_swiglu(self, input, dim: int = -1, out=None) -> torch.Tensor: ...


class _Reordered(NpuOpsDouble):
    def _npu_reshape_and_cache(self, key, value, value_cache, key_cache, slot_indices) -> None: ...


class _AnyKeyword(NpuOpsDouble):
    def npu_scatter_pa_kv_cache(self, key, value, key_cache, value_cache, slot_mapping,
                                **kwargs) -> None: ...  # fmt: skip


class _RequiredMadeOptional(NpuOpsDouble):
    def npu_rms_norm(self, input, gamma=None, epsilon: float = 1e-06) -> tuple[
        torch.Tensor, torch.Tensor]: ...  # fmt: skip


class _WrongResults(NpuOpsDouble):
    def npu_swiglu(self, input, dim: int = -1) -> tuple[torch.Tensor, torch.Tensor]: ...


@pytest.mark.parametrize(
    ("cls", "name", "match"),
    [
        (_Renamed, "npu_swiglu", "positional"),
        (_DefaultChanged, "npu_rms_norm", "epsilon default"),
        (_KeywordOnlyMadePositional, "npu_mrope", "keyword-only: missing"),
        (_MissingArgument, "npu_rotary_mul", "positional"),
        (_ExtraArgument, "npu_swiglu", "positional"),
        (_Reordered, "_npu_reshape_and_cache", "positional"),
        (_AnyKeyword, "npu_scatter_pa_kv_cache", r"\*\*kwargs"),
        (_RequiredMadeOptional, "npu_rms_norm", "gamma has a default"),
        (_WrongResults, "npu_swiglu", "returns"),
    ],
)
def test_signature_check_fails_on_a_broken_signature(cls, name, match):
    problems = signature_mismatches(cls, name, _schemas()[name])
    assert any(re.search(match, p) for p in problems), problems


# ---------------------------------------------------------------- dtypes, ranges, token limits


def _rotary_inputs(dtype=torch.float16):
    x = torch.randn(1, 4, 2, 64).to(dtype)
    angle = torch.rand(1, 4, 1, 32) * 6
    cos = torch.cat((angle.cos(), angle.cos()), -1).to(dtype)
    sin = torch.cat((angle.sin(), angle.sin()), -1).to(dtype)
    return x, cos, sin


def test_rotary_mul_requires_one_dtype():
    x, cos, sin = _rotary_inputs()
    NpuOpsDouble().npu_rotary_mul(x, cos, sin)
    with pytest.raises(DocumentedConstraintError, match="dtypes must be identical"):
        NpuOpsDouble().npu_rotary_mul(x, cos.float(), sin.float())
    with pytest.raises(DocumentedConstraintError, match="dtypes must be identical"):
        NpuOpsDouble().npu_rotary_mul(x.float(), cos.float(), sin)


@pytest.mark.parametrize("arg", ["r1", "r2"])
def test_rotary_mul_takes_cos_sin_in_unit_range_only(arg):
    """YaRN's cos/sin times mscale (> 1) are outside the documented [-1, 1]."""
    x, cos, sin = _rotary_inputs(torch.float32)
    mscale = 0.1 * math.log(4.0) + 1.0  # YaRN, factor 4
    args = {"r1": cos, "r2": sin}
    args[arg] = args[arg] * mscale
    with pytest.raises(DocumentedConstraintError, match=f"{arg} values must lie in"):
        NpuOpsDouble().npu_rotary_mul(x, args["r1"], args["r2"])
    args[arg] = torch.full_like(cos, float("nan"))
    with pytest.raises(DocumentedConstraintError, match=f"{arg} values must lie in"):
        NpuOpsDouble().npu_rotary_mul(x, args["r1"], args["r2"])
    NpuOpsDouble().npu_rotary_mul(x, torch.ones_like(cos), -torch.ones_like(sin))  # the bounds


def test_rotary_mul_rotate_matrix_is_not_modelled():
    x, cos, sin = _rotary_inputs()
    with pytest.raises(DocumentedConstraintError, match="rotate"):
        NpuOpsDouble().npu_rotary_mul(x, cos, sin, "half", torch.eye(64, dtype=x.dtype))


def test_tnd_token_limit_is_the_2_10_docstrings():
    assert npu_double.TND_MAX_TOKENS == 65536
    kw = _good_call_kwargs()
    t = npu_double.TND_MAX_TOKENS + 1
    query = torch.zeros(t, 4, 128, dtype=torch.bfloat16)
    with pytest.raises(DocumentedConstraintError, match="T=65537 > 65536"):
        NpuOpsDouble().npu_fused_infer_attention_score(
            **{**kw, "query": query, "actual_seq_lengths": [2, t]}
        )


# ---------------------------------------------------------------- device placement


def test_every_op_rejects_a_host_tensor():
    """A host tensor (a missing ``.to(device)``) reaching any op raises, naming the argument."""
    x, cos, sin = _rotary_inputs()
    with pytest.raises(NotOnNpuError, match="r1 not on the NPU"):
        NpuOpsDouble().npu_rotary_mul(x, cos.to("cpu"), sin)
    kw = _good_call_kwargs()
    with pytest.raises(NotOnNpuError, match="block_table not on the NPU"):
        NpuOpsDouble().npu_fused_infer_attention_score(
            **{**kw, "block_table": kw["block_table"].cpu()}
        )
    key, value, kc, vc = _kv()
    slots = torch.arange(5, dtype=torch.int32, device="cpu")
    for op in (NpuOpsDouble().npu_scatter_pa_kv_cache, NpuOpsDouble()._npu_reshape_and_cache):
        with pytest.raises(NotOnNpuError, match="not on the NPU"):
            op(key, value, kc, vc, slots)
    with pytest.raises(NotOnNpuError, match="input not on the NPU"):
        NpuOpsDouble().npu_swiglu(torch.ones(2, 4, device="cpu"))
    # The check is the double's: with it off, the same call runs.
    NpuOpsDouble(device_check=False).npu_rotary_mul(x, cos.to("cpu"), sin)


def test_op_outputs_are_on_the_npu():
    x, cos, sin = _rotary_inputs()
    out = NpuOpsDouble().npu_rotary_mul(x, cos, sin)
    assert on_npu(out) and out.device == NPU
    out, lse = NpuOpsDouble().npu_fused_infer_attention_score(**_good_call_kwargs())
    assert on_npu(out) and on_npu(lse)


def test_marks_follow_ordinary_torch_calls_and_moves():
    with emulated_npu():  # nested in the fixture's: its factories land on the NPU
        host = torch.arange(12.0, device="cpu").reshape(3, 4)
        assert not on_npu(host) and host.device == torch.device("cpu")
        dev = host.to(NPU)
        assert on_npu(dev) and not on_npu(host) and dev.device == NPU
        assert dev.to(NPU) is dev  # already there
        rows = torch.tensor([0, 2], device=dev.device)
        derived = [dev[1:], dev.t().contiguous(), dev.to(torch.float16), dev * 2 + 1,
                   dev.index_select(0, rows), torch.empty(2, device=dev.device),
                   torch.zeros_like(dev), dev.view(-1)]  # fmt: skip
        assert all(on_npu(t) for t in derived)
        back = [dev.cpu(), dev.to("cpu"), dev.to("cpu", torch.int64)]
        assert not any(on_npu(t) for t in back) and on_npu(dev)
        assert on_npu(host.to(dev)) and not on_npu(dev.to(host))


def _compose(query: torch.Tensor, positions: list[int], move: bool) -> torch.Tensor:
    """A composition step in production style: per-step cos/sin built on the host from a list,
    moved to ``query.device`` or not."""
    angle = torch.tensor(positions, dtype=torch.float32)[:, None] * torch.ones(32)
    cos = torch.cat((angle.cos(), angle.cos()), -1)[None, :, None]
    sin = torch.cat((angle.sin(), angle.sin()), -1)[None, :, None]
    if move:
        cos, sin = cos.to(query.device), sin.to(query.device)
    return NpuOpsDouble().npu_rotary_mul(query, cos, sin)


def test_a_missing_move_to_the_device_is_caught():
    query = torch.randn(1, 3, 2, 64)  # on the NPU (fixture)
    with emulated_npu():  # the code under test: its factories land on the host
        assert on_npu(_compose(query, [0, 5, 9], move=True))
        with pytest.raises(NotOnNpuError, match="r1, r2 not on the NPU"):
            _compose(query, [0, 5, 9], move=False)
