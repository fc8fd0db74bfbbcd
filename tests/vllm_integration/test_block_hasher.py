"""vLLM's arrival-time prompt hashing is skipped for segmented requests, and MEPIC's own hashes of
the leading blocks equal vLLM's, so those blocks are still shared with unsegmented requests."""

from vllm.utils.hashing import sha256_cbor
from vllm.v1.core.kv_cache_utils import get_request_block_hasher

from ascend_mepic.core.segments import UNPIN_KEY, Segment
from ascend_mepic.eval.kvsim import build_manager, make_request
from ascend_mepic.vllm_integration import block_hasher

B = 16
SYSTEM = Segment.prompt(range(1, 41))  # two full blocks and 8 tokens
SEGS = [SYSTEM, Segment.chunk(range(1000, 1050)), Segment.prompt([5, 6, 7])]


def test_segmented_requests_get_no_hashes_at_arrival_others_get_vllms():
    build_manager("mepic", 8, B)  # sets vLLM's NONE_HASH for sha256_cbor
    seg = make_request("a", SEGS, B, "mepic")
    assert seg.block_hashes == []
    plain = make_request("p", SEGS, B, "mepic", max_tokens=4)
    plain.sampling_params.extra_args = None
    stock = get_request_block_hasher(B, sha256_cbor)
    assert block_hasher.mepic_request_block_hasher(B, sha256_cbor)(plain) == stock(plain)
    assert len(stock(plain)) == (40 + 50 + 3) // B
    unpin = make_request("u", SEGS, B, "mepic")
    unpin.sampling_params.extra_args[UNPIN_KEY] = True
    assert not block_hasher.rehashed_by_mepic(unpin)


def test_leading_hashes_equal_vllms_with_and_without_a_salt():
    build_manager("mepic", 8, B)
    stock = get_request_block_hasher(B, sha256_cbor)
    for salt in (None, "tenant-2"):
        req = make_request("a", SEGS, B, "mepic", cache_salt=salt)
        assert req.block_hashes == []
        ours = block_hasher.vllm_prompt_hashes(req, 2, B, sha256_cbor)
        assert ours == stock(req)[:2]
        # Hashes vLLM already computed are kept, the rest continue their chain.
        req.block_hashes = ours[:1]
        assert block_hasher.vllm_prompt_hashes(req, 2, B, sha256_cbor) == ours


def test_a_segmented_request_hits_the_blocks_a_plain_request_cached():
    m = build_manager("mepic", 64, B)
    plain = make_request("p", [Segment.prompt(range(1, 45))], B, "prefix")
    assert len(plain.block_hashes) == 2
    blocks, hit, _ = m.get_computed_blocks(plain)
    assert hit == 0 and m.allocate_slots(plain, plain.num_tokens, 0, blocks) is not None
    plain.num_computed_tokens = plain.num_tokens
    cached = [b.block_id for b in m.coordinator.single_type_managers[0].req_to_blocks["p"][:2]]
    seg = make_request("s", SEGS, B, "mepic")
    assert m.track(seg)
    blocks, hit, _ = m.get_computed_blocks(seg)
    assert hit == 2 * B
    assert [b.block_id for b in blocks.blocks[0]] == cached


def test_installed_only_into_the_engine_core_module_name():
    import vllm.v1.engine.core as engine_core

    saved = engine_core.get_request_block_hasher
    # Another test in this process (pytest-xdist runs several files per worker) may have
    # installed it already: start from vLLM's own.
    engine_core.get_request_block_hasher = get_request_block_hasher
    try:
        assert not block_hasher.installed()
        block_hasher.install()
        assert block_hasher.installed()
        assert engine_core.get_request_block_hasher is block_hasher.mepic_request_block_hasher
        engine_core.get_request_block_hasher = get_request_block_hasher
        assert not block_hasher.installed()
    finally:
        engine_core.get_request_block_hasher = saved
