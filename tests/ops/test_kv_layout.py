"""The CPU/CUDA per-layer KV layout (``ops.layout.block_view``) and the code that reads it.

The backend stores a block as ``[Hkv, 2, B, D]`` (per KV head its K rows, then its V rows) and
hands every consumer a strided logical view; these tests pin the physical layout and check that
the kernel, the reference, the KV write and the tier copies agree through it with the same
content held in a plain token-major cache.
"""

from __future__ import annotations

import pytest
import torch

from ascend_mepic.ops import cpu_kernel, reference, write_kv
from ascend_mepic.ops.layout import block_view, cache_view
from ascend_mepic.ops.reference import rope_paged_attention_reference
from ascend_mepic.tier import transfer
from tests.ops.oracle import random_batch


def _buffer_holding(token_major: torch.Tensor) -> torch.Tensor:
    """A flat per-layer buffer (as vLLM allocates it) whose ``block_view`` equals
    ``token_major`` (``[nb, 2, B, Hkv, D]``)."""
    nb, _, bs, hkv, d = token_major.shape
    raw = torch.empty(nb, hkv * 2 * bs * d, dtype=token_major.dtype)
    block_view(raw, hkv, d).copy_(token_major)
    return raw


def test_a_heads_k_and_v_rows_of_a_block_are_contiguous():
    raw = torch.arange(3 * 2 * 2 * 16 * 8, dtype=torch.float32).view(3, -1)
    view = cache_view(raw, 2, 8)  # [2, nb, B, Hkv, D]
    assert view.shape == (2, 3, 16, 2, 8)
    block, head = 1, 1
    run = raw[block].view(2, 2, 16, 8)[head]  # what the kernel streams for one KV head
    assert torch.equal(view[0, block, :, head], run[0])
    assert torch.equal(view[1, block, :, head], run[1])
    with pytest.raises(RuntimeError, match="contiguous"):
        cache_view(raw.t(), 2, 8)


@pytest.mark.parametrize("decode", [False, True])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_kernel_and_reference_read_the_backend_layout(decode, dtype):
    b = random_batch(11, 32, 6, 3, decode=decode)
    cache = b.kv_cache.to(dtype)
    view = cache_view(_buffer_holding(cache.transpose(0, 1)), 3, cache.shape[-1])
    assert not view.is_contiguous() and torch.equal(view, cache)
    want = rope_paged_attention_reference(b.query, cache.float(), b.meta, b.rope, b.scale)
    out = cpu_kernel.rope_paged_attention_cpu(b.query, view, b.meta, b.rope, b.scale)
    tol = 1e-5 if dtype == torch.float32 else 2e-2
    torch.testing.assert_close(out, want, atol=tol, rtol=tol)
    ref = rope_paged_attention_reference(b.query, view.float(), b.meta, b.rope, b.scale)
    torch.testing.assert_close(ref, want)


@pytest.mark.parametrize("writer", [write_kv, cpu_kernel.write_kv_cpu, reference.write_kv])
def test_kv_write_lands_in_the_heads_runs(writer):
    raw = torch.zeros(4, 2 * 2 * 16 * 8)
    view = cache_view(raw, 2, 8)
    k, v = torch.randn(3, 2, 8), torch.randn(3, 2, 8)
    writer(k, v, view, torch.tensor([5, -1, 40]))
    physical = raw.view(4, 2, 2, 16, 8)  # [nb, Hkv, K|V, B, D]
    assert torch.equal(physical[0, 1, 0, 5], k[0, 1]) and torch.equal(physical[0, 1, 1, 5], v[0, 1])
    assert torch.equal(physical[2, 0, 0, 8], k[2, 0]) and torch.equal(physical[2, 1, 1, 8], v[2, 1])
    assert int((raw != 0).sum()) == 2 * 2 * 2 * 8  # nothing else written (slot -1 skipped)


def test_tier_copies_agree_with_a_token_major_cache():
    gen = torch.Generator().manual_seed(3)
    plain = [torch.randn(6, 2, 16, 3, 8, generator=gen) for _ in range(2)]  # token-major
    views = [block_view(_buffer_holding(c), 3, 8) for c in plain]

    saved = transfer.save_blocks(views, [1, 4])  # what CacheTune's scores read: layout-free
    assert torch.equal(saved, transfer.save_blocks(plain, [1, 4]))
    tokens = transfer.save_tokens(views, [0, 5], 10, 12, 16)
    assert torch.equal(tokens, transfer.save_tokens(plain, [0, 5], 10, 12, 16))

    for caches in (plain, views):
        transfer.load_blocks(caches, saved, [1, 0], [2, 3])
        transfer.load_tokens(caches, tokens, [1, 2], 3, 16)
        transfer.load_stored_tokens(caches, saved, 20, [(0, 7, 0, 9), (7, 13, 5, 0)], 16)
    for p, v in zip(plain, views, strict=True):
        assert torch.equal(p, v)
    assert torch.equal(views[1][2], saved[1, 1])  # the loads did write (not both no-ops)
