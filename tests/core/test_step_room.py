"""StepRoom: compiles take the room a step's scheduled requests leave, nothing more."""

import pytest

from ascend_mepic.core.errors import MepicCapacityError, MepicUnsupportedError
from ascend_mepic.core.segments import Segment, build_packed_layout
from ascend_mepic.core.step_room import StepRoom


def room(tokens=100, seqs=4, cap=100):
    r = StepRoom()
    r.set_budgets(tokens, seqs, cap)
    return r


def test_a_step_without_compiles_has_the_whole_batch():
    r = room()
    assert all(r.claim(f"r{i}", 25) for i in range(4))
    assert not r.claim("r4", 1)  # a fifth sequence does not fit
    assert r.tokens_left == 0 and r.seqs_left == 0


def test_compiles_use_what_requests_leave_and_requests_what_compiles_leave():
    r = room()
    assert r.claim("a", 60)
    assert r.fits(40, 1) and not r.fits(41, 1)
    assert r.fits(39, 1)
    r.use(39, 1)
    assert not r.claim("b", 2) and r.claim("b", 1)
    assert r.tokens_left == 0
    r.release("b")
    assert r.tokens_left == 1 and r.seqs_left == 2


def test_claims_are_replaced_and_running_requests_are_forced():
    r = room(tokens=10)
    assert r.claim("a", 4) and r.claim("a", 6)
    assert r.claimed_tokens == 6 and len(r.claims) == 1
    r.use(4, 1)
    assert not r.claim("b", 1) and r.claim("b", 1, force=True)


def test_deferred_compiles_are_reserved_once_and_capped():
    r = room(tokens=100, seqs=4, cap=50)
    assert not r.fits(60, 1)  # over the cap, even in an empty step
    r.defer(30, 1)
    r.defer(20, 2)
    assert r.take_reserve() == (30, 2)
    assert r.take_reserve() == (0, 0)
    r.defer(500, 9)
    assert r.take_reserve() == (50, 3)


def test_check_request_measures_unique_chunks_against_one_step():
    r = room(tokens=100, seqs=3, cap=100)
    doc = Segment.chunk(range(60))
    layout = build_packed_layout([Segment.prompt([1]), doc, doc, Segment.prompt([2])], 16, [16, 16])
    r.check_request(layout, {1: "x", 2: "x"})  # one unique chunk of 60 tokens
    with pytest.raises(MepicCapacityError, match="raise --max-num-batched-tokens"):
        r.check_request(layout, {1: "x", 2: "y"})  # 120 tokens
    r.whole_prefills = True  # the whole prompt is scheduled beside the compile
    r.check_request(layout, {1: "x", 2: "x"})
    small = room(tokens=70, seqs=3, cap=70)
    small.check_request(layout, {1: "x", 2: None})  # 60 to compile beside 1 token
    small.whole_prefills = True
    with pytest.raises(MepicCapacityError):  # beside 34 in-context tokens: 94 > 70
        small.check_request(layout, {1: "x", 2: None})


def test_budgets_too_small_for_a_compile_beside_its_request():
    """A policy that compiles needs a step of 2 sequences and 2 tokens; the error says why."""
    # MEPIC's own refusal type (a ValueError), as vLLM's core tests check (tests/vllm_core)
    too_small = MepicUnsupportedError
    with pytest.raises(too_small, match=r"max_num_batched_tokens=1 is too small.*beside"):
        room(tokens=1)
    with pytest.raises(too_small, match=r"max_num_seqs=1 is too small.*sequence of its own"):
        room(seqs=1)


def test_budgets_of_one_without_compiles():
    """``full`` / ``prefix`` never compile: one sequence, one token a step is a valid batch."""
    r = StepRoom()
    r.set_budgets(1, 1, 1, compiles=False)
    assert r.claim("a", 1) and not r.claim("b", 1)
    assert r.max_compile_seqs == 0 and r.max_compile_tokens == 0
    with pytest.raises(ValueError, match="positive"):
        r.set_budgets(0, 1, 1, compiles=False)
