"""Chunk residency as vLLM KV events, on the KV manager over vLLM's real BlockPool (no model)."""

from vllm.distributed.kv_events import AllBlocksCleared, BlockRemoved, BlockStored
from vllm.v1.request import RequestStatus

from ascend_mepic.core.chunk_events import EXTRA_KEY_TAG, anchor_digest, chunk_block_hashes
from ascend_mepic.core.segments import PIN_KEY, Segment
from ascend_mepic.eval.kvsim import make_request
from tests.core.test_kv_manager import admit, check_conservation, chunk, finish, mepic_manager

B = 16


def manager(num_blocks: int = 64, events: bool = True, anchor: bool = False):
    return mepic_manager(num_blocks, anchor=anchor, events=events)


def chunk_events(m):
    """(kind, event) of the chunk events taken, in order; vLLM's prefix events left out."""
    out = []
    for e in m.take_events():
        if (
            isinstance(e, BlockStored)
            and (e.extra_keys or [None])[0]
            and e.extra_keys[0][0] == EXTRA_KEY_TAG
        ):
            out.append(("stored", e))
            m._published |= set(e.block_hashes)
        elif isinstance(e, BlockRemoved) and set(e.block_hashes) & m._published:
            out.append(("removed", e))
        elif isinstance(e, AllBlocksCleared):
            out.append(("cleared", e))
    return out


def run(m, rid, segments, salt=None, step=True):
    r = make_request(rid, segments, B, cache_salt=salt)
    m._published = getattr(m, "_published", set())
    assert admit(m, r) is not None
    if step:
        m.new_step_starts()
    return r


def test_compile_publishes_the_chunk_as_a_root_chain_of_its_tokens_and_a_hit_nothing():
    m = manager()
    c = chunk(1, 3 * B + 5)  # 3 full blocks of its tokens (the tail of 5 is not published)
    a = run(m, "a", [Segment.prompt([1, 2, 3]), c, Segment.prompt([9])], salt="t1")
    (entry,) = m.chunk_cache.entries.values()
    (kind, ev), *rest = chunk_events(m)
    assert kind == "stored" and not rest
    assert ev.parent_block_hash is None and ev.block_size == B and ev.group_idx == 0
    assert ev.token_ids == list(c.token_ids[: 3 * B])
    assert ev.block_hashes == chunk_block_hashes(entry.chunk_id, 3)
    assert ev.extra_keys == [(EXTRA_KEY_TAG, "t1", "")] * 3
    assert ev.medium == "GPU"
    # Another request with the chunk elsewhere: a hit, no new chunk event.
    finish(m, a)
    b = run(
        m, "b", [Segment.prompt(range(100, 140)), chunk(2, 10), c, Segment.prompt([9])], salt="t1"
    )
    assert chunk_events(m) == []
    finish(m, b)
    # Another tenant's copy of the same tokens: another chain (other hashes), its salt.
    run(m, "c", [Segment.prompt([1]), c, Segment.prompt([9])], salt="t2")
    ((kind, other),) = chunk_events(m)
    assert other.token_ids == ev.token_ids and other.extra_keys[0] == (EXTRA_KEY_TAG, "t2", "")
    assert not set(other.block_hashes) & set(ev.block_hashes)
    check_conservation(m)


def test_eviction_and_reset_remove_what_was_published_and_a_dropped_compile_nothing():
    m = manager(num_blocks=20)  # 19 usable blocks
    chunks = [chunk(i, 3 * B) for i in range(1, 4)]
    stored = []
    for i, c in enumerate(chunks):
        finish(m, run(m, f"r{i}", [Segment.prompt([i + 1]), c, Segment.prompt([7])]))
        ((_, ev),) = chunk_events(m)
        stored.append(ev)
    # Pressure evicts the oldest idle chunk: its hashes are removed.
    free = m.block_pool.get_num_free_blocks()
    big = run(m, "big", [Segment.prompt(range(1, (free + 1) * B))], step=False)
    assert m.chunk_cache.stats.evictions == 1
    ((kind, ev),) = chunk_events(m)
    assert kind == "removed" and ev.block_hashes == stored[0].block_hashes
    finish(m, big)
    # A compile dropped before its step ran was never published: nothing to remove.
    r = run(m, "gone", [Segment.prompt([5]), chunk(9, 3 * B), Segment.prompt([1])], step=False)
    finish(m, r, RequestStatus.FINISHED_ABORTED)
    m.new_step_starts()
    assert chunk_events(m) == []
    # A reset removes every idle chunk, then vLLM clears all.
    assert m.reset_prefix_cache()
    got = chunk_events(m)
    assert [k for k, _ in got] == ["removed", "removed", "cleared"]
    assert sorted(h for _, e in got[:2] for h in e.block_hashes) == sorted(
        h for e in stored[1:] for h in e.block_hashes
    )
    check_conservation(m)


def test_pinned_chunks_stay_published_through_a_failed_reset():
    m = manager()
    c = chunk(1, 2 * B)
    pin = make_request("pin", [c, Segment.prompt([1])], B)
    pin.sampling_params.extra_args[PIN_KEY] = 1
    m._published = set()
    admit(m, pin)
    m.new_step_starts()
    finish(m, pin)
    assert [k for k, _ in chunk_events(m)] == ["stored"]
    assert not m.reset_prefix_cache()  # a pinned chunk holds its blocks
    assert chunk_events(m) == []


def test_anchored_chunks_carry_the_anchor_digest_and_a_tier_load_publishes_like_a_compile():
    m = manager(anchor=True)
    prefix = Segment.prompt(range(100, 130))  # the anchor: its first 20 tokens
    c = chunk(1, 2 * B)
    run(m, "a", [prefix, c, Segment.prompt([9])])
    ((_, ev),) = chunk_events(m)
    assert ev.extra_keys[0] == (EXTRA_KEY_TAG, "", anchor_digest(range(100, 120)))
    # A tier load (placed LOADING, then verified): published once, when it is verified.
    cache = m.chunk_cache
    toks = tuple(range(5000, 5000 + 2 * B))
    entry = cache.create_loading("loaded-id", 2 * B, 2 * B - 16, token_ids=toks)
    assert chunk_events(m) == []
    cache.finish_loading(entry, ok=True)
    ((_, ev),) = chunk_events(m)
    assert ev.token_ids == list(toks) and ev.block_hashes == chunk_block_hashes("loaded-id", 2)
    failed = cache.create_loading("failed-id", 2 * B, 2 * B - 16, token_ids=toks)
    cache.finish_loading(failed, ok=False)
    assert chunk_events(m) == []


def test_no_events_when_kv_events_are_off():
    m = manager(events=False)
    run(m, "a", [Segment.prompt([1]), chunk(1, 2 * B), Segment.prompt([2])])
    assert m.take_events() == [] and m.block_pool.kv_event_queue == []


def test_a_late_subscriber_replays_chunk_events_from_vllms_publisher(tmp_path):
    """The events survive vLLM's ZMQ publisher (msgpack) and its replay socket: a subscriber
    that was not there when they were published asks for them from sequence 0."""
    import time

    import msgspec
    import zmq
    from vllm.distributed.kv_events import KVEventBatch, ZmqEventPublisher

    m = manager()
    c = chunk(1, 2 * B)
    run(m, "a", [Segment.prompt([1]), c, Segment.prompt([2])])
    published = [e for _, e in chunk_events(m)]
    replay = f"ipc://{tmp_path}/replay"
    pub = ZmqEventPublisher(0, endpoint=f"ipc://{tmp_path}/pub", replay_endpoint=replay)
    ctx = zmq.Context()
    late = ctx.socket(zmq.DEALER)
    try:
        pub.publish(KVEventBatch(ts=time.time(), events=published))
        time.sleep(0.3)  # published before anyone listened
        late.connect(replay)
        late.send_multipart([b"", (0).to_bytes(8, "big")])
        decoder = msgspec.msgpack.Decoder(type=KVEventBatch)
        got = []
        while late.poll(5000):
            _, _, seq, payload = late.recv_multipart()
            if seq == ZmqEventPublisher.END_SEQ:
                break
            got.extend(decoder.decode(payload).events)
    finally:
        late.close(linger=0)
        ctx.term()
        pub.shutdown()
    assert got == published and got[0].token_ids == list(c.token_ids)
