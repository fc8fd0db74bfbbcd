"""The chunk-aware KV manager on vLLM's real BlockPool (no model)."""

import random

import pytest
from vllm.v1.request import RequestStatus

from ascend_mepic.core.chunk_cache import ChunkState
from ascend_mepic.core.kv_manager import MepicCapacityError, MepicKVCacheManager
from ascend_mepic.core.plan import Residency
from ascend_mepic.core.segments import BlockKind, Segment
from ascend_mepic.eval.kvsim import build_manager, make_request

B = 16


def chunk(seed: int, n: int = 50) -> Segment:
    return Segment.chunk(range(seed * 1000, seed * 1000 + n))


def admit(m, req):
    """One scheduling step for a new request; returns the block ids or None if it must wait."""
    if not m.is_tracked(req.request_id):
        assert m.track(req)
    blocks, hit, _ = m.get_computed_blocks(req)
    out = m.allocate_slots(req, req.num_tokens - hit, hit, blocks)
    if out is None:
        return None
    req.num_computed_tokens = req.num_tokens
    return m.get_block_ids(req.request_id)[0]


def finish(m, req, status=RequestStatus.FINISHED_STOPPED):
    req.status = status
    m.free(req)


def check_conservation(m: MepicKVCacheManager):
    """Every block is free, held by requests/chunks, and ref counts match the holders."""
    pool = m.block_pool
    holders = {}
    for blocks in m._single.req_to_blocks.values():
        for b in blocks:
            holders[b.block_id] = holders.get(b.block_id, 0) + 1
    for entry in m.chunk_cache.entries.values():
        for b in entry.blocks:
            holders[b.block_id] = holders.get(b.block_id, 0) + 1
    for st in m._states.values():
        for b in st.scratch:
            holders[b.block_id] = holders.get(b.block_id, 0) + 1
    free_ids = set()
    node = pool.free_block_queue.fake_free_list_head.next_free_block
    while node is not pool.free_block_queue.fake_free_list_tail:
        assert node.block_id not in free_ids, "block twice in the free queue"
        free_ids.add(node.block_id)
        node = node.next_free_block
    assert len(free_ids) == pool.get_num_free_blocks()
    for b in pool.blocks[1:]:
        assert b.ref_cnt == holders.get(b.block_id, 0), (b.block_id, b.ref_cnt)
        assert (b.block_id in free_ids) == (b.ref_cnt == 0)


def test_same_chunk_different_offsets_shares_blocks_after_the_first():
    m = build_manager("mepic", 128, B)
    c = chunk(1, 60)
    a = make_request("a", [Segment.prompt([1, 2, 3]), c, Segment.prompt([9])], B)
    b = make_request("b", [Segment.prompt(range(100, 140)), chunk(2), c, Segment.prompt([9])], B)
    ta, tb = admit(m, a), admit(m, b)
    la, lb = m.get_plan("a").layout, m.get_plan("b").layout
    sa, sb = la.spans[1], lb.spans[2]
    assert sa.num_blocks == sb.num_blocks == 4
    assert (
        ta[sa.first_block + 1 : sa.first_block + 4] == tb[sb.first_block + 1 : sb.first_block + 4]
    )
    assert ta[sa.first_block] != tb[sb.first_block]
    assert m.get_plan("a").residency == (Residency.COMPILE,)
    assert m.get_plan("b").residency == (Residency.COMPILE, Residency.IN_FLIGHT)
    assert len(set(ta) & set(tb)) == 3
    check_conservation(m)
    # Private copies would need 3 more blocks for the second request.
    assert m.num_used_blocks() == len(set(ta) | set(tb)) + 2  # + compile scratch blocks
    m.new_step_starts()
    assert m.num_used_blocks() == len(set(ta) | set(tb))
    check_conservation(m)


def test_refcounts_and_idle_chunks_stay_resident():
    m = build_manager("mepic", 64, B)
    c = chunk(1)
    reqs = [
        make_request(f"r{i}", [Segment.prompt([i + 1]), c, Segment.prompt([7])], B)
        for i in range(3)
    ]
    for r in reqs:
        admit(m, r)
    m.new_step_starts()
    entry = next(iter(m.chunk_cache.entries.values()))
    assert entry.refs == 3 and entry.state is ChunkState.READY
    assert all(b.ref_cnt == 4 for b in entry.blocks)  # residency + three users
    for r in reqs:
        finish(m, r)
    assert entry.refs == 0 and all(b.ref_cnt == 1 for b in entry.blocks)
    assert entry in m.chunk_cache.lru  # idle, resident, not in vLLM's free queue
    assert m.num_used_blocks() == 0
    check_conservation(m)
    # A later request reuses the idle chunk without computing it.
    r = make_request("late", [Segment.prompt([50, 51]), c, Segment.prompt([7])], B)
    admit(m, r)
    assert m.get_plan("late").residency == (Residency.RESIDENT,)
    assert m.get_plan("late").compiles == ()
    assert entry.refs == 1 and entry not in m.chunk_cache.lru


def test_eviction_only_under_pressure_whole_chunks_lru_order():
    m = build_manager("mepic", 20, B)  # 19 usable blocks
    chunks = [chunk(i, 3 * B) for i in range(1, 4)]  # 3 blocks each: 2 canonical
    for i, c in enumerate(chunks):
        r = make_request(f"r{i}", [Segment.prompt([i + 1]), c, Segment.prompt([7])], B)
        admit(m, r)
        m.new_step_starts()
        finish(m, r)
    assert len(m.chunk_cache.entries) == 3 and m.chunk_cache.stats.evictions == 0
    ids = list(m.chunk_cache.entries)
    # Touch chunk 0 again so chunk 1 becomes the least recently used.
    r = make_request("again", [Segment.prompt([9]), chunks[0], Segment.prompt([7])], B)
    admit(m, r)
    finish(m, r)
    m.new_step_starts()
    free_before = m.block_pool.get_num_free_blocks()
    # A big prompt needing more than the free blocks evicts exactly one whole chunk (chunk 1).
    big = make_request("big", [Segment.prompt(range(1, (free_before + 1) * B))], B)
    assert admit(m, big) is not None
    assert m.chunk_cache.stats.evictions == 1
    assert ids[1] not in m.chunk_cache.entries
    assert ids[0] in m.chunk_cache.entries and ids[2] in m.chunk_cache.entries
    check_conservation(m)


def test_admission_waits_without_partial_allocation_and_too_big_errors():
    m = build_manager("mepic", 12, B)  # 11 usable blocks
    hog = make_request("hog", [Segment.prompt(range(1, 8 * B))], B)
    admit(m, hog)
    free = m.block_pool.get_num_free_blocks()
    r = make_request("r", [Segment.prompt([1]), chunk(1, 3 * B), Segment.prompt([2])], B)
    assert admit(m, r) is None  # needs 1 + 3 + 1 + 1 scratch = 6 > free
    assert m.block_pool.get_num_free_blocks() == free and not m.chunk_cache.entries
    assert m.get_plan("r") is None and m.counters.admissions_deferred == 1
    finish(m, hog)
    assert admit(m, r) is not None
    huge = make_request("huge", [Segment.prompt([1]), chunk(2, 12 * B), Segment.prompt([2])], B)
    with pytest.raises(MepicCapacityError, match="usable blocks"):
        m.track(huge)
    check_conservation(m)


def test_repeated_prefix_reuses_chunk_first_block_from_prefix_cache():
    m = build_manager("mepic", 64, B)
    segs = [Segment.prompt(range(1, 20)), chunk(1), chunk(2), Segment.prompt([5, 6])]
    a = make_request("a", segs, B)
    ta = admit(m, a)
    m.new_step_starts()
    finish(m, a)
    b = make_request("b", [*segs[:-1], Segment.prompt([8, 9, 10])], B)
    blocks, hit, _ = m.get_computed_blocks(b) if m.track(b) else (None, 0, 0)
    layout = m._states["b"].layout
    # Everything up to the final prompt block hits: prompt blocks, both chunks' first blocks
    # (prefix cache) and their canonical blocks (chunk cache).
    assert hit == b.num_tokens - 3  # every in-context token but the final prompt's block
    m.allocate_slots(b, b.num_tokens - hit, hit, blocks)
    tb = m.get_block_ids("b")[0]
    first = [s.index for s in layout.blocks if s.kind is BlockKind.CHUNK_FIRST]
    assert [tb[i] for i in first] == [ta[i] for i in first]
    assert m.get_plan("b").compute_blocks == (layout.num_blocks - 1,)
    # A different salt shares nothing.
    c = make_request("c", segs, B, cache_salt="other-tenant")
    admit(m, c)
    assert not set(m.get_block_ids("c")[0]) & set(tb)
    check_conservation(m)


def test_same_chunk_twice_in_one_request_and_single_block_chunks():
    m = build_manager("mepic", 64, B)
    c = chunk(1)
    r = make_request(
        "r", [Segment.prompt([1]), c, Segment.chunk([5, 6]), c, Segment.prompt([2])], B
    )
    t = admit(m, r)
    plan = m.get_plan("r")
    assert plan.residency == (Residency.COMPILE, Residency.SINGLE_BLOCK, Residency.IN_FLIGHT)
    assert len(plan.compiles) == 1
    s1, s3 = plan.layout.spans[1], plan.layout.spans[3]
    assert t[s1.first_block + 1 : s1.first_block + 4] == t[s3.first_block + 1 : s3.first_block + 4]
    m.new_step_starts()
    finish(m, r)
    check_conservation(m)
    entry = next(iter(m.chunk_cache.entries.values()))
    assert entry.refs == 0


def test_abort_before_compile_drops_pending_chunk():
    m = build_manager("mepic", 64, B)
    r = make_request("r", [Segment.prompt([1]), chunk(1), Segment.prompt([2])], B)
    admit(m, r)
    finish(m, r, RequestStatus.FINISHED_ABORTED)  # before the step that compiles it ran
    assert not m.chunk_cache.entries and m.chunk_cache.stats.dropped_pending == 1
    assert m.block_pool.get_num_free_blocks() == 63
    check_conservation(m)


def test_decode_growth_and_preemption_resume():
    m = build_manager("mepic", 64, B)
    r = make_request("r", [Segment.prompt([1]), chunk(1), Segment.prompt([2])], B, max_tokens=40)
    admit(m, r)
    m.new_step_starts()
    n0 = len(m.get_block_ids("r")[0])
    for t in range(40):
        r.append_output_token_ids(100 + t)
        new = m.allocate_slots(r, 1)
        assert new is not None
        r.num_computed_tokens = r.num_tokens
    padded_len = m._states["r"].layout.num_padded_tokens
    assert len(m.get_block_ids("r")[0]) == -(-(padded_len + 40) // B) > n0
    # Preempt: everything released, layout kept; re-admission hits prefix + chunk caches.
    r.status = RequestStatus.PREEMPTED
    m.free(r)
    r.num_computed_tokens = 0
    check_conservation(m)
    blocks, hit, _ = m.get_computed_blocks(r)
    # Decode blocks are not prefix-cached: the hit ends before the final prompt block.
    assert hit == r.num_tokens - 40 - 1
    assert m.allocate_slots(r, r.num_tokens - hit, hit, blocks) is not None
    check_conservation(m)


@pytest.mark.parametrize("seed", [0, 1])
def test_randomized_operations_never_leak_or_double_free(seed):
    """>= 10,000 admit/finish/abort/preempt/decode operations under eviction pressure."""
    rng = random.Random(seed)
    m = build_manager("mepic", 48, B)
    library = [chunk(i, rng.randint(5, 4 * B)) for i in range(1, 15)]
    live, waiting = [], []
    ops = 0
    next_id = 0
    while ops < 5000:
        ops += 1
        op = rng.random()
        if op < 0.35 or not live:
            segs = [Segment.prompt(range(1, rng.randint(2, 40)))]
            for _ in range(rng.randint(0, 3)):
                segs += [rng.choice(library), Segment.prompt([rng.randint(1, 99)])]
            req = make_request(f"q{next_id}", segs, B, cache_salt=rng.choice([None, "t2"]))
            next_id += 1
            try:
                m.track(req)
            except MepicCapacityError:
                continue
            waiting.append(req)
        elif op < 0.45 and waiting:
            req = waiting.pop(rng.randrange(len(waiting)))
            req.status = RequestStatus.FINISHED_ABORTED
            m.free(req)
        elif op < 0.65:
            req = live.pop(rng.randrange(len(live)))
            finish(
                m, req, rng.choice([RequestStatus.FINISHED_STOPPED, RequestStatus.FINISHED_ABORTED])
            )
        elif op < 0.75:
            req = live.pop(rng.randrange(len(live)))
            req.status = RequestStatus.PREEMPTED
            m.free(req)
            req.num_computed_tokens = 0
            waiting.append(req)
        elif op < 0.85:
            req = rng.choice(live)
            req.append_output_token_ids(rng.randint(1, 999))
            if m.allocate_slots(req, 1) is None:
                live.remove(req)
                req.status = RequestStatus.PREEMPTED
                m.free(req)
                req.num_computed_tokens = 0
                waiting.append(req)
            else:
                req.num_computed_tokens = req.num_tokens
        if waiting and rng.random() < 0.6:
            req = waiting[0]
            if admit(m, req) is not None:
                req.status = RequestStatus.RUNNING
                live.append(waiting.pop(0))
        if rng.random() < 0.5:
            m.new_step_starts()
        if ops % 250 == 0:
            check_conservation(m)
    for req in live + waiting:
        finish(m, req, RequestStatus.FINISHED_ABORTED)
    m.new_step_starts()
    check_conservation(m)
    assert all(e.refs == 0 for e in m.chunk_cache.entries.values())
    assert m.num_used_blocks() == 0
    assert m.chunk_cache.stats.evictions > 0, "the test must exercise eviction"
    assert not m._states
    # Every block is free or cached (idle chunk / prefix-cached), nothing else.
    cats = m.block_categories()
    assert cats["free"] + cats["prefix_cached"] + cats["chunk_shared_idle"] == 47


def test_free_queue_including_cached_prefix_blocks_goes_before_idle_chunks():
    """Documented order: vLLM's free queue (its cached prefix blocks in its own LRU) is used up
    before any idle chunk is evicted."""
    m = build_manager("mepic", 16, B)  # 15 usable blocks
    r = make_request(
        "r", [Segment.prompt(range(1, 2 * B + 1)), chunk(1, 3 * B), Segment.prompt([5])], B
    )
    admit(m, r)
    m.new_step_starts()
    finish(m, r)
    cats = m.block_categories()
    assert cats["chunk_shared_idle"] == 2 and cats["prefix_cached"] >= 2
    free = m.block_pool.get_num_free_blocks()  # includes the cached prefix blocks
    fill = make_request("fill", [Segment.prompt(range(100, 100 + free * B - 1))], B)
    admit(m, fill)
    assert m.chunk_cache.stats.evictions == 0  # prefix blocks were reused, chunk kept
    assert m.block_categories()["prefix_cached"] == 0
    more = make_request("more", [Segment.prompt(range(200, 200 + B))], B)
    admit(m, more)
    assert m.chunk_cache.stats.evictions == 1  # only now the idle chunk goes, whole
    check_conservation(m)


def test_pinned_chunks_are_never_evicted_until_unpinned():
    from ascend_mepic.core.segments import PIN_KEY

    m = build_manager("mepic", 20, B)  # 19 usable blocks
    c = chunk(1, 3 * B)
    pin = make_request("pin", [c, Segment.prompt([1])], B)
    pin.sampling_params.extra_args[PIN_KEY] = 1
    admit(m, pin)
    m.new_step_starts()
    finish(m, pin)
    entry = next(iter(m.chunk_cache.entries.values()))
    assert entry.pinned and entry not in m.chunk_cache.lru
    assert m.metrics()["pinned_chunks"] == 1
    # Pressure: a prompt needing every block but the pinned chunk's cannot evict it, and one
    # that needs the pinned blocks too can never fit while the chunk is pinned.
    free = m.block_pool.get_num_free_blocks()
    big = make_request("big", [Segment.prompt(range(1, free * B))], B)
    assert admit(m, big) is not None
    finish(m, big)
    assert entry.pinned and m.chunk_cache.stats.evictions == 0
    too_big = make_request("too_big", [Segment.prompt(range(1, (free + 1) * B))], B)
    with pytest.raises(MepicCapacityError):
        m.track(too_big)
    unpin = make_request("unpin", [c, Segment.prompt([1])], B)
    assert m.unpin_chunks(unpin) == 1
    assert not entry.pinned and entry in m.chunk_cache.lru
    assert admit(m, too_big) is not None  # now the idle chunk can go
    assert m.chunk_cache.stats.evictions == 1
    check_conservation(m)
