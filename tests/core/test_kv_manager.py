"""The chunk-aware KV manager on vLLM's real BlockPool (no model)."""

import random

import pytest
from vllm.v1.request import RequestStatus

from ascend_mepic.core.chunk_cache import ChunkState
from ascend_mepic.core.kv_manager import MepicCapacityError, MepicKVCacheManager
from ascend_mepic.core.plan import Residency
from ascend_mepic.core.segments import Segment
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
    assert m.chunk_cache.num_pinned_blocks() == num_pinned_blocks(m)


def num_pinned_blocks(m: MepicKVCacheManager) -> int:
    """Distinct blocks holding a pinned chunk, counted over every chunk."""
    return len({b.block_id for e in m.chunk_cache.entries.values() if e.pinned for b in e.blocks})


def canonical_ids(m, rid: str, span_index: int) -> list[int]:
    """Block ids a request's table lists for one chunk's canonical tokens."""
    plan = m.get_plan(rid)
    sp = plan.layout.spans[span_index]
    return list(plan.block_ids[sp.shared_first : sp.shared_first + sp.num_shared])


def test_same_chunk_anywhere_shares_its_canonical_blocks_packed():
    m = build_manager("mepic", 128, B)
    c = chunk(1, 60)  # 16 private tokens, 44 canonical
    a = make_request("a", [Segment.prompt([1, 2, 3]), c, Segment.prompt([9])], B)
    b = make_request("b", [Segment.prompt(range(100, 140)), chunk(2), c, Segment.prompt([9])], B)
    ta, tb = admit(m, a), admit(m, b)
    assert canonical_ids(m, "a", 1) == canonical_ids(m, "b", 2)
    assert m.get_plan("a").residency == (Residency.COMPILE,)
    assert m.get_plan("b").residency == (Residency.COMPILE, Residency.IN_FLIGHT)
    # Private streams packed: a = 3 + 16 + 1 tokens (2 blocks), b = 40 + 16 + 16 + 1 (5 blocks).
    sa, sb = m._states["a"], m._states["b"]
    assert len(sa.private_blocks) == 2 and len(sb.private_blocks) == 5
    # chunk 2's canonical tokens start where chunk 1's ended: one block holds both.
    e1, e2 = (m.chunk_cache.lookup(x) for x in m.chunk_cache.entries)
    assert e2.blocks[0] is e1.blocks[-1] and e2.offset == (e1.offset + 44) % B
    assert m.chunk_cache.slot_utilisation() == pytest.approx((44 + 34) / (5 * B))
    check_conservation(m)
    shared = {bl.block_id for e in (e1, e2) for bl in e.blocks}
    assert len(shared) == 5  # 78 canonical tokens in 5 blocks, no padding
    assert m.num_used_blocks() == 2 + 5 + len(shared) + 2  # + one compile scratch block each
    assert set(ta) | set(tb) == shared | {
        bl.block_id for bl in sa.private_blocks + sb.private_blocks
    }
    m.new_step_starts()
    assert m.num_used_blocks() == 2 + 5 + len(shared)
    check_conservation(m)


def test_chunks_sharing_a_block_are_evicted_whole_and_the_block_freed_with_the_last():
    m = build_manager("mepic", 64, B)
    c1, c2 = chunk(1, 16 + 40), chunk(2, 16 + 40)  # 40 canonical tokens each: share a block
    r1 = make_request("r1", [Segment.prompt([1]), c1, Segment.prompt([7])], B)
    admit(m, r1)
    m.new_step_starts()
    finish(m, r1)
    r2 = make_request("r2", [Segment.prompt([2]), c2, Segment.prompt([7])], B)
    admit(m, r2)  # c2 in use, c1 idle
    m.new_step_starts()
    e1, e2 = (m.chunk_cache.lookup(x) for x in m.chunk_cache.entries)
    joint = e1.blocks[-1]
    assert e2.blocks[0] is joint and joint.block_id in canonical_ids(m, "r2", 1)
    assert joint.ref_cnt == 3  # two chunks stored in it, one request lists it
    cats = m.block_categories()
    assert cats["chunk_shared_referenced"] == 3 and cats["chunk_shared_idle"] == 2
    # Evicting c1 frees only the blocks c2 does not use; the joint block keeps c2's KV.
    assert m.chunk_cache.lru.evictable_blocks() == 2
    m.chunk_cache.evict(e1)
    assert m.chunk_cache.stats.evicted_blocks == 2 and joint.ref_cnt == 2
    check_conservation(m)
    finish(m, r2)
    m.chunk_cache.evict(e2)
    assert joint.ref_cnt == 0 and not m.chunk_cache.entries
    assert m.chunk_cache.arena.open is None  # forgotten with its last chunk
    check_conservation(m)


def test_an_idle_chunk_used_again_moves_next_to_the_chunks_in_use():
    m = build_manager("mepic", 64, B)
    c1, c2, c3 = chunk(1, 16 + 40), chunk(2, 16 + 40), chunk(3, 16 + 40)
    for i, c in enumerate((c1, c2)):
        r = make_request(f"r{i}", [Segment.prompt([i + 1]), c, Segment.prompt([7])], B)
        admit(m, r)
        m.new_step_starts()
        finish(m, r)
    live = make_request("live", [Segment.prompt([5]), c3, Segment.prompt([7])], B)
    admit(m, live)  # c3 in use, placed after c2
    m.new_step_starts()
    e1 = m.chunk_cache.lookup(next(iter(m.chunk_cache.entries)))
    old = [b.block_id for b in e1.blocks]
    again = make_request("again", [Segment.prompt([3]), c1, Segment.prompt([7])], B)
    admit(m, again)
    # c1's blocks were used by nobody: it moves after c3 instead of making them used.
    moves = m.take_step_plan(1, ())[0].chunk_moves
    assert [mv.chunk_id for mv in moves] == [e1.chunk_id] and m.chunk_cache.stats.moves == 1
    assert moves[0].src_block_ids == tuple(old) and moves[0].dst_block_ids == tuple(e1.block_ids)
    assert canonical_ids(m, "again", 1) == e1.block_ids and not set(old) & set(e1.block_ids)
    assert m._states["again"].scratch  # the old blocks are held until the copy has run
    check_conservation(m)
    m.new_step_starts()
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


def test_repeated_prefix_reuses_packed_private_blocks_from_prefix_cache():
    m = build_manager("mepic", 64, B)
    segs = [Segment.prompt(range(1, 20)), chunk(1), chunk(2), Segment.prompt([5, 6])]
    a = make_request("a", segs, B)
    admit(m, a)
    private_a = [bl.block_id for bl in m._states["a"].private_blocks]
    m.new_step_starts()
    finish(m, a)
    b = make_request("b", [*segs[:-1], Segment.prompt([8, 9, 10])], B)
    blocks, hit, _ = m.get_computed_blocks(b) if m.track(b) else (None, 0, 0)
    # Private stream: 19 prompt + 16 + 16 chunk tokens + the question. Its first three blocks
    # (48 tokens, both chunks' private tokens included) are the same in both requests.
    assert b.num_tokens == 19 + 16 + 16 + 3 and hit == 48
    m.allocate_slots(b, b.num_tokens - hit, hit, blocks)
    assert [bl.block_id for bl in m._states["b"].private_blocks[:3]] == private_a[:3]
    assert m.get_plan("b").num_in_context_computed == b.num_tokens - 48
    assert m.get_plan("b").residency == (Residency.RESIDENT, Residency.RESIDENT)
    tb = m.get_block_ids("b")[0]
    # A different salt shares nothing: neither private blocks, nor chunks, nor a chunk block
    # with another tenant's chunk in it (each tenant packs into blocks of its own).
    c = make_request("c", segs, B, cache_salt="other-tenant")
    admit(m, c)
    assert not set(m.get_block_ids("c")[0]) & set(tb)
    assert set(m.chunk_cache.arena.open_blocks) == {None, "other-tenant"}
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
    assert canonical_ids(m, "r", 1) == canonical_ids(m, "r", 3) and len(t) > 4
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
    st = m._states["r"]
    in_context = r.num_tokens - 40  # 1 + 16 + 1
    assert len(st.private_blocks) == -(-(in_context + 40) // B)
    extra = len(st.private_blocks) - st.layout.num_private_blocks
    assert len(m.get_block_ids("r")[0]) == st.layout.num_blocks + extra > n0
    # Preempt: everything released; re-admission hits the prefix cache and the chunk cache.
    r.status = RequestStatus.PREEMPTED
    m.free(r)
    r.num_computed_tokens = 0
    check_conservation(m)
    blocks, hit, _ = m.get_computed_blocks(r)
    # Decode blocks are not prefix-cached: the hit is the prompt's full private blocks.
    assert hit == (in_context - 1) // B * B
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
    with pytest.raises(MepicCapacityError, match="pinned chunks .POST /v1/chunks. hold 2 of"):
        m.track(too_big)
    unpin = make_request("unpin", [c, Segment.prompt([1])], B)
    assert m.unpin_chunks(unpin) == 1
    assert not entry.pinned and entry in m.chunk_cache.lru
    assert admit(m, too_big) is not None  # now the idle chunk can go
    assert m.chunk_cache.stats.evictions == 1
    check_conservation(m)


def test_pinned_block_count_follows_pins_moves_and_drops():
    from ascend_mepic.core.segments import PIN_KEY

    m = build_manager("mepic", 64, B)
    c1, c2, c3 = chunk(1, 16 + 40), chunk(2, 16 + 40), chunk(3, 16 + 40)

    def request(rid, c, first, pin=False):
        r = make_request(rid, [Segment.prompt([first]), c, Segment.prompt([7])], B)
        if pin:
            r.sampling_params.extra_args[PIN_KEY] = 1
        return r

    # A pinned chunk dropped before its compile ran takes its pinned blocks with it.
    r = request("dropped", c1, 1, pin=True)
    admit(m, r)
    assert m.chunk_cache.num_pinned_blocks() == num_pinned_blocks(m) > 0
    finish(m, r, RequestStatus.FINISHED_ABORTED)
    assert m.chunk_cache.num_pinned_blocks() == num_pinned_blocks(m) == 0
    # A pinned chunk left idle, then moved when used again: its new blocks are the pinned ones.
    for i, (c, pin) in enumerate(((c1, True), (c2, False))):
        r = request(f"r{i}", c, i + 1, pin)
        admit(m, r)
        m.new_step_starts()
        finish(m, r)
    pinned = m.chunk_cache.num_pinned_blocks()
    assert pinned == num_pinned_blocks(m) > 0
    admit(m, request("live", c3, 5))
    m.new_step_starts()
    admit(m, request("again", c1, 3))
    assert m.chunk_cache.stats.moves == 1
    assert m.chunk_cache.num_pinned_blocks() == num_pinned_blocks(m) == pinned
    check_conservation(m)
    assert m.unpin_chunks(request("unpin", c1, 1)) == 1
    assert m.chunk_cache.num_pinned_blocks() == num_pinned_blocks(m) == 0
    m.new_step_starts()
    check_conservation(m)


def test_server_precheck_accepts_and_rejects_what_the_engine_does():
    """The HTTP server's 400 and the engine's intake judge requests by one rule."""
    from ascend_mepic.core.policies import parse_policy
    from ascend_mepic.core.request_limits import RequestLimits
    from ascend_mepic.entrypoints.server.text_segments import MepicRequestError, check_fits

    rng, policy, seen = random.Random(0), parse_policy("mepic"), set()
    for i in range(150):
        max_len = rng.choice([256, 512, 1024])
        m = build_manager("mepic", 4096, B, max_model_len=max_len)
        segs = [Segment.prompt(range(rng.randint(1, 40)))]
        for c in range(rng.randint(1, 6)):
            segs += [
                chunk(10 * i + c, rng.randint(1, 150)),
                Segment.prompt([7] * rng.randint(1, 9)),
            ]
        tokens = [t for s in segs for t in s.token_ids]
        lengths = [[s.kind.value, len(s.token_ids)] for s in segs]
        try:
            check_fits(tokens, lengths, RequestLimits(policy, B, max_len))
            server_ok = True
        except MepicRequestError as e:
            assert f"maximum model length of {max_len}" in str(e)
            server_ok = False
        try:
            m.track(make_request(f"r{i}", segs, B))
            engine_ok = True
        except MepicCapacityError as e:
            assert f"maximum model length of {max_len}" in str(e)
            engine_ok = False
        assert server_ok == engine_ok, segs
        seen.add(server_ok)
    assert seen == {True, False}


def mepic_manager(
    num_blocks: int = 128, anchor: bool = True, events: bool = False, policy=None
) -> MepicKVCacheManager:
    """A ``mepic`` manager built as kvsim builds it; ``anchor``: its compiles run after the
    request's prefix (``chunk_anchor``, up to 20 tokens); ``events``: vLLM's KV events on;
    ``policy``: this one instead."""
    import dataclasses

    from ascend_mepic.core.kv_settings import KVSettings
    from ascend_mepic.core.policies import parse_policy
    from ascend_mepic.eval.kvsim import SIM_MODEL, kv_cache_config
    from ascend_mepic.vllm_integration.core_types import sha256_cbor

    if policy is None:
        policy = parse_policy("mepic")
        if anchor:
            policy = dataclasses.replace(policy, anchor="prefix", anchor_max_tokens=20)
    m = build_manager("mepic", 8, B)  # hashing set up as kvsim does
    return MepicKVCacheManager(
        kv_cache_config(num_blocks, B),
        hash_fn=sha256_cbor,
        model_fingerprint=SIM_MODEL,
        enable_caching=True,
        enable_kv_cache_events=events,
        settings=KVSettings(policy=policy),
        max_model_len=m.max_model_len,
        scheduler_block_size=B,
        hash_block_size=B,
    )


def anchored_manager(num_blocks: int = 128) -> MepicKVCacheManager:
    """A MEPIC manager whose compiles run after the request's prefix (``chunk_anchor``)."""
    return mepic_manager(num_blocks, anchor=True)


def test_anchored_compiles_run_after_the_prefix_and_key_the_chunk_by_it():
    """Under ``chunk_anchor: prefix`` a first-time chunk compiles after the request's prefix (at
    most ``anchor_max_tokens`` of it) in scratch: the compile sequence is anchor + chunk, its
    scratch holds anchor and private tokens, its canonical tokens go to the arena. Requests with
    the same prefix share the chunk wherever it sits; another prefix gets its own."""
    m = anchored_manager()
    c = chunk(1, 60)  # 16 private, 44 canonical
    prefix = Segment.prompt(range(100, 130))  # 30 tokens: the anchor is its first 20
    a = make_request("a", [prefix, c, Segment.prompt([9])], B)
    b = make_request("b", [prefix, chunk(2), c, Segment.prompt([8, 7])], B)
    other = make_request("o", [Segment.prompt([1, 2, 3]), c, Segment.prompt([9])], B)
    admit(m, a)
    (compile_,) = m.get_plan("a").compiles
    assert compile_.anchor_tokens == tuple(range(100, 120))
    assert compile_.sequence_tokens == (*range(100, 120), *c.token_ids)
    assert compile_.num_scratch == -(-(20 + 16) // B) == 3
    assert compile_.layout.num_real_tokens == 80 and compile_.num_canonical == 44
    admit(m, b)
    assert canonical_ids(m, "a", 1) == canonical_ids(m, "b", 2)
    assert m.get_plan("b").residency == (Residency.COMPILE, Residency.IN_FLIGHT)
    admit(m, other)
    assert m.get_plan("o").residency == (Residency.COMPILE,)  # another anchor, another chunk
    assert not set(canonical_ids(m, "o", 1)) & set(canonical_ids(m, "a", 1)[:-1])
    plan, extra = m.take_step_plan(0, ["a", "b", "o"])
    compiles = [e for e in extra if e.seq_id.startswith("mepic-compile-")]
    assert sorted(len(e.token_ids) for e in compiles) == [3 + 60, 20 + 50, 20 + 60]
    check_conservation(m)
    m.new_step_starts()
    check_conservation(m)


def test_pin_quota_refuses_registrations_past_each_limit_and_nothing_else():
    """Pins past the engine-wide limit (a fraction of the pool) or a cache salt's own limit are
    refused at arrival with MepicQuotaError, counting pins still in flight; an ordinary request
    of any tenant is still served, and unpinning gives the room back."""
    from dataclasses import replace

    from ascend_mepic.core.errors import MepicQuotaError
    from ascend_mepic.core.kv_settings import KVSettings
    from ascend_mepic.core.segments import PIN_KEY
    from ascend_mepic.eval.kvsim import SIM_MODEL, kv_cache_config
    from ascend_mepic.vllm_integration.core_types import sha256_cbor

    def manager(settings: KVSettings) -> MepicKVCacheManager:
        common = dict(max_model_len=4096, scheduler_block_size=B, hash_block_size=B)
        return MepicKVCacheManager(
            kv_cache_config(41, B),  # 40 usable blocks
            hash_fn=sha256_cbor,
            model_fingerprint=SIM_MODEL,
            enable_caching=True,
            settings=settings,
            **common,
        )

    def pin(m, rid, seed, salt=None):
        r = make_request(rid, [chunk(seed, 16 + 3 * B), Segment.prompt([1])], B, cache_salt=salt)
        r.sampling_params.extra_args[PIN_KEY] = 1
        return r

    # The engine-wide limit: a quarter of 40 blocks, every tenant together.
    m = manager(replace(KVSettings(), pinned_fraction=0.25))
    assert m.track(pin(m, "a1", 1, "a"))  # up to 4 blocks each (3, and an open block)
    assert m.track(pin(m, "b1", 2, "b"))  # reserved, not pinned yet: 8 of 10
    with pytest.raises(MepicQuotaError, match=r"hold 8 of the 10 .*pinned_kv_fraction 0\.25"):
        m.track(pin(m, "c1", 3, "c"))
    m.forget("b1")  # never admitted: its reservation goes with it
    assert m.chunk_cache.reserved_pins() == 4
    assert m.track(pin(m, "c1", 3, "c"))
    # A salt's own limit; other tenants' pins and every ordinary request still go through.
    m = manager(replace(KVSettings(), pinned_per_salt=8))
    first = pin(m, "a1", 1, "a")
    admit(m, first)
    m.new_step_starts()
    finish(m, first)
    assert m.chunk_cache.num_pinned_blocks("a", all_tenants=False) == 3
    assert m.chunk_cache.reserved_pins() == 0
    assert m.track(pin(m, "a2", 2, "a"))  # 3 pinned + 4 reserved
    with pytest.raises(MepicQuotaError, match="this cache_salt's pinned chunks hold 7 of the 8"):
        m.track(pin(m, "a3", 3, "a"))
    assert m.track(pin(m, "b1", 3, "b"))
    plain = make_request("plain", [Segment.prompt(range(1, 20 * B))], B, cache_salt="a")
    assert admit(m, plain) is not None
    metrics = m.metrics()
    assert metrics["pinned_blocks"] == 3 and metrics["pinned_blocks_top_salt"] == 3
    assert metrics["pinned_blocks_limit"] == 20 and metrics["pinned_blocks_per_salt_limit"] == 8
