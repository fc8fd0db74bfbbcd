"""The torch reference against the dense oracle, NoPE/pre-rotated equivalence, rejections."""

from dataclasses import replace

import pytest
import torch
import torch.nn.functional as F
from hypothesis import given, settings
from hypothesis import strategies as st

from ascend_mepic.ops import RopeSpec, UnsupportedRopeError, rope_paged_attention
from ascend_mepic.ops.reference import gather_sequence_keys, rope_paged_attention_reference
from tests.ops.oracle import dense_oracle, random_batch, rotate_complex

gqa = st.sampled_from([(4, 4), (8, 2), (6, 3), (4, 1)])


@settings(max_examples=40, deadline=None)
@given(
    seed=st.integers(0, 10**6),
    block_size=st.sampled_from([16, 32, 128]),
    heads=gqa,
    neox=st.booleans(),
    decode=st.booleans(),
)
def test_reference_matches_dense_oracle_fp32(seed, block_size, heads, neox, decode):
    b = random_batch(seed, block_size, *heads, neox=neox, decode=decode)
    out = rope_paged_attention_reference(b.query, b.kv_cache, b.meta, b.rope, b.scale)
    want = dense_oracle(b.query, b.kv_cache, b.meta, b.base, neox, b.scale)
    torch.testing.assert_close(out.double(), want, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("seed", range(4))
def test_reference_bf16(seed):
    b = random_batch(seed, 32, 8, 2, dtype=torch.bfloat16)
    out = rope_paged_attention_reference(b.query, b.kv_cache, b.meta, b.rope, b.scale)
    want = dense_oracle(b.query, b.kv_cache, b.meta, b.base, True, b.scale)
    torch.testing.assert_close(out.double(), want, atol=2e-2, rtol=2e-2)


@pytest.mark.parametrize("seed", range(6))
def test_nope_cache_equals_prerotated_cache_with_plain_causal_attention(seed):
    """Fused read-time RoPE over a NoPE cache == ordinary attention over pre-rotated K."""
    b = random_batch(seed, 16, 8, 2, neox=seed % 2 == 0)
    out = rope_paged_attention_reference(b.query, b.kv_cache, b.meta, b.rope, b.scale)
    loc = b.meta.query_start_loc.tolist()
    for s in range(b.meta.num_seqs):
        if loc[s] == loc[s + 1]:
            continue
        k, v, _, kidx = gather_sequence_keys(b.rotated_cache, b.meta, s, int(b.meta.num_blocks[s]))
        rows = slice(loc[s], loc[s + 1])
        q = rotate_complex(
            b.query[rows].double(), b.meta.query_positions[rows], b.base, seed % 2 == 0
        ).float()
        mask = kidx[None, :] <= b.meta.query_indices[rows, None]
        plain = F.scaled_dot_product_attention(
            q.transpose(0, 1)[None],
            k.transpose(0, 1)[None],
            v.transpose(0, 1)[None],
            attn_mask=mask,
            scale=b.scale,
            enable_gqa=True,
        )[0].transpose(0, 1)
        torch.testing.assert_close(out[rows], plain, atol=1e-5, rtol=1e-5)


def test_dispatch_default_and_forced(monkeypatch):
    b = random_batch(0, 16, 4, 2)
    monkeypatch.setenv("ASCEND_MEPIC_ATTN_IMPL", "reference")
    out = rope_paged_attention(b.query, b.kv_cache, b.meta, b.rope, b.scale)
    monkeypatch.delenv("ASCEND_MEPIC_ATTN_IMPL")
    torch.testing.assert_close(
        out, rope_paged_attention(b.query, b.kv_cache, b.meta, b.rope, b.scale)
    )
    monkeypatch.setenv("ASCEND_MEPIC_ATTN_IMPL", "cuda")
    with pytest.raises(ValueError, match="ASCEND_MEPIC_ATTN_IMPL"):
        rope_paged_attention(b.query, b.kv_cache, b.meta, b.rope, b.scale)


def test_rejects_unsupported_rope_and_bad_gqa():
    from vllm.config import VllmConfig, set_current_vllm_config

    with set_current_vllm_config(VllmConfig()):
        check_rope_rejections()


def check_rope_rejections():
    from vllm.model_executor.layers.rotary_embedding import get_rope

    plain = get_rope(64, 2048, True, {"rope_theta": 10000.0}, dtype=torch.float32)
    spec = RopeSpec.from_module(plain, 64)
    assert spec.is_neox_style and spec.head_size == 64
    partial = get_rope(
        64, 2048, True, {"rope_theta": 10000.0, "partial_rotary_factor": 0.5}, dtype=torch.float32
    )
    with pytest.raises(UnsupportedRopeError, match="partial rotary"):
        RopeSpec.from_module(partial, 64)
    dynamic = get_rope(
        64,
        2048,
        True,
        {"rope_theta": 10000.0, "rope_type": "dynamic", "factor": 2.0},
        dtype=torch.float32,
    )
    with pytest.raises(UnsupportedRopeError, match="not supported"):
        RopeSpec.from_module(dynamic, 64)
    b = random_batch(0, 16, 4, 2)
    with pytest.raises(ValueError, match="multiple"):
        rope_paged_attention(b.query[:, :3], b.kv_cache, b.meta, b.rope, b.scale)


def test_strided_block_major_cache_view():
    """The cache may be any strided view (the backend's own layout: tests/ops/test_kv_layout.py)."""
    b = random_batch(3, 32, 8, 2)
    block_major = b.kv_cache.transpose(0, 1).contiguous()  # [nb, 2, B, Hkv, D]
    view = block_major.transpose(0, 1)
    assert not view.is_contiguous()
    out = rope_paged_attention_reference(b.query, view, b.meta, b.rope, b.scale)
    want = rope_paged_attention_reference(b.query, b.kv_cache, b.meta, b.rope, b.scale)
    torch.testing.assert_close(out, want)
    from ascend_mepic.ops import write_kv

    k = torch.randn(3, 2, 32)
    write_kv(k, -k, view, torch.tensor([5, -1, 40]))
    assert torch.equal(block_major[0, 0, 5], k[0]) and torch.equal(block_major[1, 1, 8], -k[2])


@pytest.mark.parametrize("n", [1, 37, 96])
def test_plain_prefill_fast_paths_match_oracle(n):
    """A contiguous prefill from 0 (SDPA's own causal mask) and a lone query (no mask)."""
    from ascend_mepic.ops import RopeSpec, SequenceSpec, build_metadata
    from ascend_mepic.ops.rope import default_cos_sin_cache

    bs, hkv, d = 32, 2, 32
    nb = -(-n // bs)
    spec = SequenceSpec(
        block_ids=list(range(1, nb + 1)),
        block_first_pos=[j * bs for j in range(nb)],
        block_valid_start=[0] * nb,
        block_valid_end=[min(bs, n - j * bs) for j in range(nb)],
        query_indices=list(range(n)),
        query_positions=list(range(n)),
    )
    meta = build_metadata([spec], bs)
    gen = torch.Generator().manual_seed(n)
    cache = torch.randn(2, nb + 1, bs, hkv, d, generator=gen)
    query = torch.randn(n, 4, d, generator=gen)
    rope = RopeSpec.from_cache(default_cos_sin_cache(d, 512), True)
    out = rope_paged_attention_reference(query, cache, meta, rope, d**-0.5)
    want = dense_oracle(query, cache, meta, 10000.0, True, d**-0.5)
    torch.testing.assert_close(out.double(), want, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("seed", range(6))
def test_decode_batch_takes_exactly_the_single_queries_that_see_every_key(seed):
    """Planned as arrays over all sequences at once: one sequence whose single query sees only
    its first key, and one without queries, stay out of the batch; all match the oracle."""
    b = random_batch(seed, 16, 4, 2, num_seqs=7, decode=True)
    meta = b.meta
    meta.query_indices[0] = meta.block_valid_start[0, 0]
    meta.query_positions[0] = meta.block_first_pos[0, 0]
    keep = torch.tensor([0, *range(2, meta.num_queries)])  # sequence 1 schedules no query
    loc = meta.query_start_loc.clone()
    loc[2:] -= 1
    meta = replace(
        meta,
        query_start_loc=loc,
        query_positions=meta.query_positions[keep],
        query_indices=meta.query_indices[keep],
    )
    query = b.query[keep]
    out = rope_paged_attention_reference(query, b.kv_cache, meta, b.rope, b.scale)
    batch, alone = meta.memo["reference_step"]
    assert batch.rows.tolist() == loc[2:-1].tolist()
    assert [plan.q_rows for plan in alone] == [slice(0, 1)]
    want = dense_oracle(query, b.kv_cache, meta, b.base, b.rope.is_neox_style, b.scale)
    torch.testing.assert_close(out.double(), want, atol=1e-5, rtol=1e-5)
