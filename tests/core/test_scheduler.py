"""MepicScheduler inside a real VllmConfig (tiny Llama), driven through schedule() calls."""

from types import SimpleNamespace

import pytest
import torch
from vllm.engine.arg_utils import EngineArgs
from vllm.sampling_params import SamplingParams
from vllm.utils.hashing import get_hash_fn_by_name
from vllm.v1.core.kv_cache_manager import KVCacheManager
from vllm.v1.core.kv_cache_utils import get_request_block_hasher, init_none_hash
from vllm.v1.core.sched.scheduler import Scheduler
from vllm.v1.kv_cache_interface import FullAttentionSpec, KVCacheConfig, KVCacheGroupSpec
from vllm.v1.outputs import ModelRunnerOutput
from vllm.v1.request import Request, RequestStatus
from vllm.v1.structured_output import StructuredOutputManager

from ascend_mepic.core.kv_manager import MepicKVCacheManager
from ascend_mepic.core.scheduler import MepicScheduler
from ascend_mepic.core.segments import EXTRA_ARGS_KEY, Segment, build_layout
from ascend_mepic.eval.prepare import prepare_tiny_llama

B = 32


@pytest.fixture(scope="module")
def tiny_model(tmp_path_factory):
    return prepare_tiny_llama(tmp_path_factory.mktemp("models") / "tiny")


def make_scheduler(
    model_dir, additional_config, num_blocks=64, max_num_seqs=None, max_num_batched_tokens=None
):
    args = EngineArgs(
        max_num_seqs=max_num_seqs,
        max_num_batched_tokens=max_num_batched_tokens,
        model=str(model_dir),
        dtype="float32",
        block_size=B,
        max_model_len=1024,
        enforce_eager=True,
        enable_prefix_caching=True,
        scheduler_cls="ascend_mepic.core.scheduler.MepicScheduler",
        additional_config=additional_config,
    )
    config = args.create_engine_config()
    spec = FullAttentionSpec(block_size=B, num_kv_heads=2, head_size=16, dtype=torch.float32)
    kv = KVCacheConfig(num_blocks, [], [KVCacheGroupSpec(["model.layers.0.self_attn"], spec)])
    config.cache_config.num_gpu_blocks = num_blocks
    sched = MepicScheduler(
        vllm_config=config,
        kv_cache_config=kv,
        structured_output_manager=StructuredOutputManager(config),
        block_size=B,
        hash_block_size=B,
        log_stats=True,
    )
    hash_fn = get_hash_fn_by_name(config.cache_config.prefix_caching_hash_algo)
    init_none_hash(hash_fn)
    return sched, get_request_block_hasher(B, hash_fn)


def mepic_request(rid, segments, hasher, salt=None, extra=None):
    layout = build_layout(segments, B)
    params = SamplingParams(
        max_tokens=4, extra_args=extra or {EXTRA_ARGS_KEY: layout.segment_lengths()}
    )
    return Request(
        rid,
        [t for seg in layout.segments for t in seg.token_ids],
        params,
        None,
        cache_salt=salt,
        block_hasher=hasher,
    )


def test_mepic_off_is_stock_vllm(tiny_model):
    sched, _ = make_scheduler(tiny_model, {})
    assert type(sched.kv_cache_manager) is KVCacheManager
    assert isinstance(sched, Scheduler) and not sched.mepic_config.enabled


def test_unknown_option_is_an_error(tiny_model):
    with pytest.raises(ValueError, match="unknown MEPIC option"):
        make_scheduler(tiny_model, {"mepic": {"blocksize": 3}})


def test_schedule_shares_chunk_blocks_and_rejects_bad_requests(tiny_model):
    # a and b have other prefixes: unanchored compiles share the chunk across them.
    sched, hasher = make_scheduler(tiny_model, {"mepic": {"chunk_anchor": "none"}}, num_blocks=24)
    assert isinstance(sched.kv_cache_manager, MepicKVCacheManager)
    doc = Segment.chunk(range(10, 110))  # 16 private tokens, 84 canonical (3 blocks at B=32)
    a = mepic_request("a", [Segment.prompt([1, 5, 6]), doc, Segment.prompt([7, 8])], hasher)
    b = mepic_request("b", [Segment.prompt(range(20, 60)), doc, Segment.prompt([9])], hasher)
    bad = mepic_request(
        "bad",
        [Segment.prompt([1]), Segment.prompt([2])],
        hasher,
        extra={EXTRA_ARGS_KEY: [["chunk", 5], ["prompt", 7]]},
    )
    huge = mepic_request(
        "huge", [Segment.prompt([1]), Segment.chunk(range(5, 900)), Segment.prompt([2])], hasher
    )
    for r in (a, b, bad, huge):
        sched.add_request(r)
    assert bad.status is RequestStatus.FINISHED_ERROR
    assert huge.status is RequestStatus.FINISHED_ERROR
    out = sched.schedule()
    tables = {r.req_id: r.block_ids[0] for r in out.scheduled_new_reqs}
    (compile_id,) = set(tables) - {"a", "b"}
    assert compile_id.startswith("mepic-compile-") and set(tables) - {compile_id} == {"a", "b"}
    # The chunk is compiled once, alone, within the same step: its 16 private tokens in a
    # scratch block, its canonical tokens in the chunk cache's blocks.
    compile_req = next(r for r in out.scheduled_new_reqs if r.req_id == compile_id)
    assert compile_req.prompt_token_ids == list(range(10, 110))
    assert out.num_scheduled_tokens[compile_id] == 100
    # In-context tokens only: a's prompt (3), the chunk's first 16 tokens, the final prompt (2).
    assert out.num_scheduled_tokens["a"] == 3 + 16 + 2
    manager = sched.kv_cache_manager
    sa = manager.get_plan("a").layout.spans[1]
    sb = manager.get_plan("b").layout.spans[1]
    shared_a = tables["a"][sa.shared_first : sa.shared_first + sa.num_shared]
    assert sa.num_shared == 3 and tables[compile_id][1:] == shared_a
    assert shared_a == tables["b"][sb.shared_first : sb.shared_first + sb.num_shared]
    private_a, private_b = (
        {b.block_id for b in manager._states[r].private_blocks} for r in ("a", "b")
    )
    assert not private_a & private_b and not private_a & set(shared_a)
    # The rejected requests come back to the client as errors; the others keep running.
    ran = ModelRunnerOutput(
        req_ids=["a", "b"], req_id_to_index={"a": 0, "b": 1}, sampled_token_ids=[[3], [4]]
    )
    outputs = sched.update_from_output(out, ran)
    errors = {o.request_id for eco in outputs.values() for o in eco.outputs}
    assert {"bad", "huge"} <= errors and {"a", "b"} <= set(sched.requests)
    # Next step: the compile has run, the chunk is READY, a third request reuses it.
    c = mepic_request("c", [Segment.prompt([2, 3]), doc, Segment.prompt([4])], hasher)
    sched.add_request(c)
    out = sched.schedule()
    assert [r.req_id for r in out.scheduled_new_reqs] == ["c"]
    assert compile_id in out.finished_req_ids  # the worker forgets the compile
    assert sched.kv_cache_manager.get_plan("c").compiles == ()
    assert sched.kv_cache_manager.metrics()["chunk_misses"] == 1
    sched.finish_requests(["a", "b", "c"], RequestStatus.FINISHED_ABORTED)
    assert sched.kv_cache_manager.num_used_blocks() == 0
    assert sched.kv_cache_manager.block_categories()["chunk_shared_idle"] == 3


def test_request_ending_in_its_compile_step_leaves_the_chunk_resident(tiny_model):
    sched, hasher = make_scheduler(tiny_model, {"mepic": {}}, num_blocks=24)
    doc = Segment.chunk(range(10, 110))
    r = mepic_request("r", [Segment.prompt([1, 5]), doc, Segment.prompt([7])], hasher)
    r.sampling_params.max_tokens = 1
    r.max_tokens = 1
    sched.add_request(r)
    out = sched.schedule()
    ran = ModelRunnerOutput(req_ids=["r"], req_id_to_index={"r": 0}, sampled_token_ids=[[3]])
    sched.update_from_output(out, ran)
    assert r.is_finished()
    manager = sched.kv_cache_manager
    assert manager.chunk_cache.stats.dropped_pending == 0
    assert manager.metrics()["resident_chunks"] == 1
    assert manager.block_categories()["compile_scratch"] == 0


def test_a_step_without_compiles_gets_the_whole_batch(tiny_model):
    """No compile room is set aside: vLLM admits up to max_num_seqs when nothing compiles."""
    sched, hasher = make_scheduler(tiny_model, {"mepic": {}}, num_blocks=64, max_num_seqs=8)
    assert sched.max_num_running_reqs == 8
    for i in range(10):
        sched.add_request(mepic_request(f"r{i}", [Segment.prompt([1, 2, 3 + i])], hasher))
    out = sched.schedule()
    assert len(sched.running) == 8 and len(out.scheduled_new_reqs) == 8
    assert sched.max_num_running_reqs == 8  # limits are stock outside schedule()


def _run_step(sched, out):
    ids = [r.req_id for r in out.scheduled_new_reqs if not r.req_id.startswith("mepic-")]
    ids += list(out.scheduled_cached_reqs.req_ids)
    ran = ModelRunnerOutput(
        req_ids=ids,
        req_id_to_index={r: i for i, r in enumerate(ids)},
        sampled_token_ids=[[3]] * len(ids),
    )
    sched.update_from_output(out, ran)


def test_compiles_never_overflow_the_batch(tiny_model):
    """Compiles take what the step's requests leave: scheduled tokens and sequences, compiles
    included, stay within max_num_batched_tokens / max_num_seqs, and every request runs."""
    sched, hasher = make_scheduler(  # other prefixes, chunks shared: unanchored compiles
        tiny_model,
        {"mepic": {"chunk_anchor": "none"}},
        num_blocks=128,
        max_num_seqs=4,
        max_num_batched_tokens=256,
    )
    docs = [Segment.chunk(range(100 * i + 10, 100 * i + 110)) for i in range(5)]
    for i in range(6):
        segs = [Segment.prompt([1, 2 + i]), docs[i % 5], docs[(i + 1) % 5], Segment.prompt([7])]
        sched.add_request(mepic_request(f"r{i}", segs, hasher))
    compiles, admitted = 0, set()
    for _ in range(12):
        out = sched.schedule()
        assert out.total_num_scheduled_tokens <= 256
        assert sum(out.num_scheduled_tokens.values()) == out.total_num_scheduled_tokens
        assert len(out.num_scheduled_tokens) <= 4
        compiles += sum(r.req_id.startswith("mepic-compile-") for r in out.scheduled_new_reqs)
        admitted |= {r.req_id for r in out.scheduled_new_reqs}
        _run_step(sched, out)
    assert compiles == 5 and {f"r{i}" for i in range(6)} <= admitted


def test_deferred_compiles_get_room_in_the_next_step(tiny_model):
    """A request whose compile did not fit beside the step's requests gets exactly that room
    kept in the next step, and is admitted then."""
    sched, hasher = make_scheduler(
        tiny_model, {"mepic": {}}, num_blocks=64, max_num_batched_tokens=256
    )
    sched.add_request(mepic_request("long", [Segment.prompt(range(5, 205))], hasher))
    doc = Segment.chunk(range(300, 400))
    sched.add_request(mepic_request("b", [Segment.prompt([1]), doc, Segment.prompt([2])], hasher))
    out = sched.schedule()
    assert set(out.num_scheduled_tokens) == {"long"}  # 200 + 100 to compile do not fit in 256
    assert sched.kv_cache_manager.counters.admissions_deferred == 1
    _run_step(sched, out)
    out = sched.schedule()
    assert "b" in out.num_scheduled_tokens and out.total_num_scheduled_tokens <= 256
    assert any(r.req_id.startswith("mepic-compile-") for r in out.scheduled_new_reqs)
    assert sched.max_num_scheduled_tokens == 256


def test_compile_cap_rejects_requests_that_can_never_compile(tiny_model):
    sched, hasher = make_scheduler(
        tiny_model,
        {"mepic": {"compile_token_fraction": 0.25}},
        num_blocks=64,
        max_num_batched_tokens=256,
    )
    big = Segment.chunk(range(300, 400))  # 100 tokens > a quarter of 256
    r = mepic_request("r", [Segment.prompt([1]), big, Segment.prompt([2])], hasher)
    sched.add_request(r)
    assert r.status is RequestStatus.FINISHED_ERROR
    assert "raise --max-num-batched-tokens" in sched.mepic_errors["r"][1]


@pytest.mark.parametrize(("seqs", "tokens"), [(1, None), (None, 1), (1, 1)])
def test_full_policy_runs_with_one_sequence_or_one_token_a_step(tiny_model, seqs, tokens):
    """``full`` never compiles a chunk: vLLM's smallest batches start and schedule."""
    sched, hasher = make_scheduler(
        tiny_model, {"mepic": {"policy": "full"}}, max_num_seqs=seqs, max_num_batched_tokens=tokens
    )
    doc = Segment.chunk(range(300, 340))
    for i in range(2):
        segs = [Segment.prompt([1, 2 + i]), doc, Segment.prompt([9])]
        sched.add_request(mepic_request(f"r{i}", segs, hasher))
    out = sched.schedule()
    assert len(out.num_scheduled_tokens) == 1
    assert out.total_num_scheduled_tokens == (1 if tokens == 1 else 43)


def test_mepic_refuses_a_step_too_small_for_a_compile(tiny_model):
    with pytest.raises(ValueError, match=r"max_num_seqs=1 is too small.*policy 'full'"):
        make_scheduler(tiny_model, {"mepic": {}}, max_num_seqs=1)


@pytest.mark.parametrize(
    ("change", "message"),
    [
        (lambda c: setattr(c.parallel_config, "pipeline_parallel_size", 2), "pipeline"),
        (lambda c: setattr(c.scheduler_config, "async_scheduling", True), "async scheduling"),
        (
            lambda c: setattr(c, "speculative_config", SimpleNamespace(method="eagle")),
            "speculative decoding with method 'eagle'",
        ),
        (lambda c: setattr(c, "lora_config", object()), "LoRA"),
        (lambda c: setattr(c.parallel_config, "tensor_parallel_size", 2), "host store"),
    ],
)
def test_unsupported_engine_features_fail_at_start(tiny_model, change, message):
    from ascend_mepic.core.engine_support import UnsupportedEngineFeature, check_engine_supported
    from ascend_mepic.core.policies import parse_policy

    sched, _ = make_scheduler(tiny_model, {"mepic": {}})
    config = sched.vllm_config
    policy = parse_policy("epic-16")  # a loading policy: refused with TP > 1
    check_engine_supported(config, policy, tier_enabled=False)
    change(config)
    with pytest.raises(UnsupportedEngineFeature, match=message):
        check_engine_supported(config, policy, tier_enabled=False)
