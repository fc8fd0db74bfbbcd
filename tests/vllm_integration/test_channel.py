"""The scheduler-to-worker channel refuses every disagreement instead of wrong attention."""

from __future__ import annotations

import types

import numpy as np
import pytest
import torch
from vllm.v1.attention.backend import CommonAttentionMetadata
from vllm.v1.core.sched.output import NewRequestData, SchedulerOutput

from ascend_mepic.core.plan import SequencePlacement, StepPlan, StepPlanError
from ascend_mepic.core.segments import Segment, build_layout
from ascend_mepic.vllm_integration import channel
from ascend_mepic.vllm_integration.runner_internals import STEP_NOT_PLACED
from ascend_mepic.worker import step
from ascend_mepic.worker.attention import MepicAttentionMetadataBuilder
from ascend_mepic.worker.model_runner import MepicRunnerMixin
from ascend_mepic.worker.token_map import TokenMap
from ascend_mepic.worker.token_pool import TokenMapPool

BS = 16


def _placement(num_in_context: int | None = None) -> SequencePlacement:
    layout = build_layout(
        [Segment.prompt(range(5)), Segment.chunk(range(40)), Segment.prompt(range(7))], BS
    )
    real = len(layout.in_context_slots())
    return SequencePlacement(layout, real if num_in_context is None else num_in_context)


def _output() -> SchedulerOutput:
    return SchedulerOutput.make_empty()


def _common(num_reqs: int, num_tokens: int) -> CommonAttentionMetadata:
    loc = torch.tensor([0, num_tokens] + [num_tokens] * (num_reqs - 1), dtype=torch.int32)
    return CommonAttentionMetadata(
        query_start_loc=loc,
        query_start_loc_cpu=loc,
        seq_lens=torch.full((num_reqs,), num_tokens, dtype=torch.int32),
        num_reqs=num_reqs,
        num_actual_tokens=num_tokens,
        max_query_len=num_tokens,
        max_seq_len=num_tokens,
        block_table_tensor=torch.zeros((num_reqs, 4), dtype=torch.int32),
        slot_mapping=torch.arange(num_tokens),
        positions=torch.arange(num_tokens),
    )


def _builder() -> MepicAttentionMetadataBuilder:
    # The builder's own logic only; vLLM's base constructor needs a whole VllmConfig.
    builder = object.__new__(MepicAttentionMetadataBuilder)
    builder.block_size = BS
    builder._inputs = None
    return builder


def _tables(num_reqs: int, num_tokens: int) -> step.PlacedStep:
    idx = np.arange(num_tokens, dtype=np.int64)
    one = np.ones((num_reqs, 1), dtype=np.int32)
    return step.PlacedStep(
        idx, idx, idx > 0, idx, one[:, 0], 0 * one, 0 * one, BS * one, max_query_len=num_tokens
    )


def test_a_step_without_a_plan_is_refused():
    with pytest.raises(StepPlanError, match="without a MEPIC step plan"):
        channel.receive(_output())


def test_the_plan_round_trips_and_a_taken_slot_is_refused():
    out = _output()
    plan = StepPlan(step=3, placements={"a": _placement()})
    channel.attach(out, plan)
    assert channel.receive(out) is plan
    with pytest.raises(StepPlanError, match="KV connector"):
        channel.attach(out, plan)


def test_builder_refuses_tables_of_another_batch():
    builder = _builder()
    builder.set_step_inputs(_tables(num_reqs=2, num_tokens=10))
    with pytest.raises(StepPlanError, match="2 sequences / 10 tokens"):
        builder.build(0, _common(num_reqs=2, num_tokens=9))
    with pytest.raises(StepPlanError, match="2 sequences / 10 tokens"):
        builder.build(0, _common(num_reqs=1, num_tokens=10))
    meta = builder.build(0, _common(num_reqs=2, num_tokens=10))
    assert meta.num_actual_tokens == 10


def test_builder_refuses_a_step_the_runner_did_not_place():
    builder = _builder()
    builder.set_step_inputs(STEP_NOT_PLACED)
    with pytest.raises(StepPlanError, match="did not place"):
        builder.build(0, _common(num_reqs=1, num_tokens=4))
    builder.set_step_inputs(None)  # outside a step: vLLM's profiling runs, plain sequences
    assert builder.build(0, _common(num_reqs=1, num_tokens=4)).num_actual_tokens == 4


def _new_request(req_id: str, num_tokens: int) -> NewRequestData:
    return NewRequestData(
        req_id=req_id,
        prompt_token_ids=list(range(num_tokens)),
        mm_features=[],
        sampling_params=None,
        pooling_params=None,
        block_ids=([1, 2, 3, 4],),
        num_computed_tokens=0,
        lora_request=None,
    )


def _runner() -> types.SimpleNamespace:
    return types.SimpleNamespace(
        mepic_block_size=BS, _token_pool=TokenMapPool(BS), _lookup_prompts=None
    )


def test_runner_refuses_a_prompt_the_plan_does_not_describe():
    placement = _placement()
    plan = StepPlan(step=1, placements={"a": placement})
    runner = _runner()
    MepicRunnerMixin._take_placements(runner, plan, [_new_request("a", placement.num_in_context)])
    assert "a" in runner._token_pool
    with pytest.raises(StepPlanError, match="arrived with"):
        MepicRunnerMixin._take_placements(
            _runner(), plan, [_new_request("a", placement.num_in_context + 1)]
        )
    with pytest.raises(StepPlanError, match="does not schedule"):
        MepicRunnerMixin._take_placements(_runner(), plan, [_new_request("b", 3)])


def test_token_map_refuses_a_layout_of_another_block_size():
    placement = _placement()
    with pytest.raises(StepPlanError, match="disagree"):
        TokenMap.from_placement(placement, 64)  # the 40-token chunk fits one block there
