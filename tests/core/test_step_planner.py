"""``core/step_planner.py``: each step's plan from what the KV manager's parts queued, taken once.

On vLLM's real BlockPool through the KV manager (no model), as ``test_kv_manager.py``.
"""

from ascend_mepic.core.segments import Segment
from ascend_mepic.eval.kvsim import build_manager, make_request
from tests.core.test_kv_manager import admit, chunk

B = 16


def test_a_first_time_chunk_is_compiled_in_its_request_step_and_planned_once():
    m = build_manager("mepic", 128, B)
    c = chunk(1, 60)  # 16 tokens in context, 44 canonical
    a = make_request("a", [Segment.prompt([1, 2, 3]), c, Segment.prompt([9])], B)
    assert admit(m, a) is not None
    plan, extra = m.take_step_plan(1, ["a"])
    assert plan.step == 1 and set(plan.placements) == {"a", *(e.seq_id for e in extra)}
    (compile_,) = extra  # the chunk alone, from position 0, in its own blocks
    assert compile_.seq_id.startswith("mepic-compile-")
    placement = plan.placements[compile_.seq_id]
    assert placement.compile and placement.num_in_context == len(compile_.token_ids)
    assert placement.layout.packed  # canonical tokens where the arena placed them
    assert placement.layout.num_real_tokens == len(compile_.token_ids)  # the chunk alone
    assert not plan.placements["a"].compile
    assert plan.host_loads == plan.host_saves == plan.tier_loads == plan.tier_puts == ()
    # Taken once: the next plan holds neither the compile nor the request.
    again, more = m.take_step_plan(2, [])
    assert again.placements == {} and more == []


def test_a_cached_chunk_needs_no_compile():
    m = build_manager("mepic", 128, B)
    c = chunk(1, 60)
    a = make_request("a", [Segment.prompt([1, 2, 3]), c, Segment.prompt([9])], B)
    b = make_request("b", [Segment.prompt(range(100, 140)), c, Segment.prompt([8])], B)
    admit(m, a)
    m.take_step_plan(1, ["a"])
    m.new_step_starts()  # the compile ran: the chunk is READY
    assert admit(m, b) is not None
    plan, extra = m.take_step_plan(2, ["b"])
    assert extra == [] and set(plan.placements) == {"b"}
