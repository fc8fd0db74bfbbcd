"""The torch_npu composition's memory: a fixed scratch, and a bounded temporary peak per layer.

Why: vLLM sizes the KV cache from what its profiling run leaves free, and that run skips
attention; whatever the attention allocates per step is unaccounted for. The peak here is MEASURED
by c10's CPU allocator (the profiler's ``[memory]`` events), not computed. The ops run on
``OutputOnlyOps``: each returns a tensor of the shape and dtype the torch_npu op returns (what
the op allocates through the caching allocator; CANN's kernel workspaces aside) without computing
it, so that the measurement sees the composition's own allocations, not a double's float32
internals. Numerics under several passes are checked against the oracle with the real double.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator

import pytest
import torch
from torch.profiler import ProfilerActivity, profile

from ascend_mepic.ops import SequenceSpec, build_metadata, npu
from ascend_mepic.ops.rope import RopeSpec, default_cos_sin_cache
from tests.ops.emulated_device import NPU, emulated_npu, mark_npu
from tests.ops.npu_double import NpuOpsDouble
from tests.ops.oracle import dense_oracle, random_batch

# Qwen2.5-7B: 28 query heads, 4 KV heads, head 128, bfloat16, max_position 32768.
HQ, HKV, D, DTYPE, MAX_POS = 28, 4, 128, torch.bfloat16, 32768
SEQS, TOKENS, BLOCK = 128, 4096, 128  # a decode step: 128 sequences of 4k tokens
MB = 1e6


@pytest.fixture(autouse=True)
def fresh_scratch() -> Iterator[None]:
    """Each test reserves its own scratch; none leaks into other tests."""
    npu.release_scratch()
    yield
    npu.release_scratch()


def peak_bytes(fn: Callable[[], object]) -> int:
    """Peak bytes allocated (net of frees) while ``fn`` runs, from the allocator's events."""
    with profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
        fn()
    events = sorted(
        (e.start_ns(), e.nbytes())
        for e in prof.profiler.kineto_results.events()
        if e.name() == "[memory]"
    )
    current = peak = 0
    for _, nbytes in events:
        current += nbytes
        peak = max(peak, current)
    return peak


class OutputOnlyOps:
    """The ops' outputs, uncomputed: what torch_npu allocates for them."""

    def npu_rotary_mul(self, input, r1, r2, rotary_mode="half"):  # noqa: A002, ANN001, ANN201
        assert input.dtype == r1.dtype == r2.dtype
        return torch.empty_like(input)

    def npu_fused_infer_attention_score(self, query, key, value, **kwargs):  # noqa: ANN001, ANN003, ANN201
        return torch.empty_like(query), torch.empty(1, device=query.device)


def decode_step_7b() -> tuple[torch.Tensor, torch.Tensor, object, RopeSpec]:
    """One decode query per sequence over 4096 cached tokens each (32 blocks), 7B geometry."""
    blocks = TOKENS // BLOCK
    seqs = [
        SequenceSpec(
            block_ids=range(s * blocks, (s + 1) * blocks),
            block_first_pos=range(0, TOKENS, BLOCK),
            block_valid_start=[0] * blocks,
            block_valid_end=[BLOCK] * blocks,
            query_indices=[TOKENS - 1],
            query_positions=[TOKENS - 1],
        )
        for s in range(SEQS)
    ]
    meta = build_metadata(seqs, BLOCK)
    kv_cache = torch.zeros(2, SEQS * blocks, BLOCK, HKV, D, dtype=DTYPE)
    query = torch.zeros(SEQS, HQ, D, dtype=DTYPE)
    rope = RopeSpec.from_cache(default_cos_sin_cache(D, MAX_POS).to(DTYPE), True)
    return query, kv_cache, meta, rope


def test_peak_temporary_memory_is_bounded_for_a_7b_decode_batch(monkeypatch):
    """128 x 4k decode at Qwen2.5-7B geometry: N = 524,288 keys. The former path gathered all N
    keys per layer (about 18 * N * Hkv * D = 4.8 GB); now the layer's temporaries are bounded
    by one pass's rotation output plus O(N) int tables, the scratch being reserved beforehand."""
    query, kv_cache, meta, rope = decode_step_7b()
    n_keys, t = SEQS * TOKENS, SEQS
    monkeypatch.setattr(npu, "get_npu_ops", OutputOnlyOps)
    scratch = npu.reserve_scratch(kv_cache.device, HKV, D, DTYPE, max_model_len=TOKENS, rope=rope)
    assert scratch.keys == npu.DEFAULT_SCRATCH_KEYS
    # persistent: P * (2*Hkv*D*e + 2*D*e) + 2*max_position*D*e (ids are per step)
    p = scratch.keys
    assert scratch.nbytes == p * (2 * HKV * D * 2 + 2 * D * 2) + 2 * MAX_POS * D * 2

    def layer() -> None:
        npu.rope_paged_attention_npu(query, kv_cache, meta, rope, D**-0.5)

    first = peak_bytes(layer)  # the step's first layer builds the plan
    later = peak_bytes(layer)
    bound = scratch.rotation_bytes() + 64 * n_keys + 32 * t * HQ * D + 2**20
    old = 18 * n_keys * HKV * D
    print(
        f"scratch {scratch.nbytes / MB:.1f} MB; peak temporary: first layer {first / MB:.1f} "
        f"MB, later layers {later / MB:.1f} MB; bound {bound / MB:.1f} MB; former path "
        f"~{old / MB:.0f} MB"
    )
    assert first <= bound and later <= bound
    assert bound < old / 40
    passes = [v for k, v in meta.memo.items() if k[0] == "npu-plan"][0].passes
    assert len(passes) == n_keys // p  # 524,288 keys through a 65,536-key scratch


def test_the_measurement_sees_the_former_paths_gather():
    """The allocator-level measurement catches a large temporary: the former path's first step,
    gathering every key of the 7B batch by advanced indexing and widening it to float32."""
    query, kv_cache, meta, rope = decode_step_7b()
    blocks = meta.block_tables.long().repeat_interleave(BLOCK, dim=1).flatten()
    slots = torch.arange(BLOCK).repeat(SEQS * (TOKENS // BLOCK))

    def former_gather() -> None:
        k = kv_cache[0][blocks, slots].float()  # [N, Hkv, D]
        del k

    n_keys = SEQS * TOKENS
    assert peak_bytes(former_gather) >= n_keys * HKV * D * 4  # >= 1.07 GB


def run_on_npu(b) -> torch.Tensor:
    mark_npu(b.query, b.kv_cache, b.rope.cos_sin_cache, *b.meta.tensors())
    with emulated_npu():
        return npu.rope_paged_attention_npu(b.query, b.kv_cache, b.meta, b.rope, b.scale)


@pytest.mark.parametrize("decode", [False, True])
@pytest.mark.parametrize("neox", [True, False])
def test_several_passes_match_the_oracle(monkeypatch, decode, neox):
    """A scratch of a few blocks: sequences go through it in several passes, each pass's runs
    in FIA calls that fit it; the result is the oracle's."""
    b = random_batch(11 + decode, 16, 8, 2, head=128, num_seqs=6, neox=neox, decode=decode,
                     dtype=torch.bfloat16, max_segment=60)  # fmt: skip
    longest = int((b.meta.block_valid_end - b.meta.block_valid_start).sum(1).max())
    keys = -(-longest // npu.SCRATCH_BLOCK) * npu.SCRATCH_BLOCK
    ops = NpuOpsDouble()
    monkeypatch.setattr(npu, "get_npu_ops", lambda: ops)
    with emulated_npu():
        npu.reserve_scratch(NPU, 2, 128, torch.bfloat16, keys=keys)
    out = run_on_npu(b)
    (plan,) = [v for k, v in b.meta.memo.items() if k[0] == "npu-plan"]
    assert len(plan.passes) > 1
    want = dense_oracle(b.query, b.kv_cache, b.meta, b.base, neox, b.scale)
    torch.testing.assert_close(out.double(), want, atol=2e-2, rtol=2e-2)


def test_a_sequence_longer_than_the_scratch_is_refused(monkeypatch):
    b = random_batch(3, 16, 4, 2, head=128, num_seqs=2, dtype=torch.bfloat16, max_segment=90)
    monkeypatch.setattr(npu, "get_npu_ops", NpuOpsDouble)
    longest = int((b.meta.block_valid_end - b.meta.block_valid_start).sum(1).max())
    assert longest > npu.SCRATCH_BLOCK
    with emulated_npu():
        npu.reserve_scratch(NPU, 2, 128, torch.bfloat16, keys=npu.SCRATCH_BLOCK)
    with pytest.raises(ValueError, match="more than the attention scratch holds"):
        run_on_npu(b)


def test_scratch_holds_at_least_max_model_len(monkeypatch):
    monkeypatch.setenv(npu.SCRATCH_KEYS_ENV, "1000")
    assert npu.scratch_keys() == 1024
    assert npu.scratch_keys(max_model_len=32768 + 1) == 32768 + 128
