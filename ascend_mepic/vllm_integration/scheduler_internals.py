"""The vLLM scheduler internals MEPIC's scheduler touches (vLLM 0.30.0), each with why.

``MepicScheduler`` is installed with ``--scheduler-cls`` (a documented hook); what that hook
does not offer is here.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

from vllm.sampling_params import SamplingParams
from vllm.v1.core.sched.output import NewRequestData, SchedulerOutput
from vllm.v1.engine import EngineCoreOutput, EngineCoreOutputs
from vllm.v1.request import Request, RequestStatus
from vllm.v1.utils import ConstantList


def install_kv_manager(scheduler: Any, manager: Any) -> None:
    """Replace the scheduler's ``KVCacheManager``.

    Why: ``Scheduler.__init__`` builds ``KVCacheManager`` itself with no option to choose
    another class; MEPIC's manager (a subclass sharing the same block pool) is swapped in right
    after construction, before any block is allocated.
    """
    if scheduler.kv_cache_manager.block_pool.get_num_free_blocks() != (
        scheduler.kv_cache_manager.block_pool.num_gpu_blocks - 1
    ):
        raise RuntimeError("the KV manager can only be replaced before any block is allocated")
    scheduler.kv_cache_manager = manager


@contextmanager
def step_limits(scheduler: Any, tokens: int, seqs: int) -> Iterator[None]:
    """Run one ``schedule()`` with its token and running-request limits lowered to ``tokens`` /
    ``seqs``, then restore them.

    Why: compiles are extra sequences of the step (below), and the model runner's buffers are
    sized by ``max_num_batched_tokens`` / ``max_num_seqs``. vLLM has no hook for a per-step
    budget; ``schedule()`` reads ``max_num_scheduled_tokens`` when it starts and
    ``max_num_running_reqs`` before each admission, and asserts the running queue stays within
    it, so the running-request limit never goes below the requests already running.
    """
    full = (scheduler.max_num_scheduled_tokens, scheduler.max_num_running_reqs)
    scheduler.max_num_scheduled_tokens = min(full[0], tokens)
    scheduler.max_num_running_reqs = min(full[1], max(seqs, len(scheduler.running)))
    try:
        yield
    finally:
        scheduler.max_num_scheduled_tokens, scheduler.max_num_running_reqs = full


def add_pseudo_request(
    output: SchedulerOutput, req_id: str, tokens: list[int], block_ids: list[int]
) -> None:
    """Add a sequence the worker runs in this step only (a chunk compile or a tier load).

    Why: a chunk compile is the chunk alone, from position 0, in its canonical blocks; it must
    run in the same forward pass as the requests that read it, and vLLM has no notion of a
    sequence that is not a request. The scheduler never tracks it; the worker drops it the next
    step (its id goes into ``finished_req_ids``).
    """
    output.scheduled_new_reqs.append(
        NewRequestData(
            req_id=req_id,
            prompt_token_ids=tokens,
            mm_features=[],
            sampling_params=SamplingParams(max_tokens=1, temperature=0.0),
            pooling_params=None,
            block_ids=(block_ids,),
            num_computed_tokens=0,
            lora_request=None,
        )
    )
    output.num_scheduled_tokens[req_id] = len(tokens)
    output.total_num_scheduled_tokens += len(tokens)


def set_prompt(request: Request, token_ids: list[int]) -> None:
    """Replace an engine request's prompt with its in-context tokens, before it is scheduled.

    Why: vLLM schedules and computes every prompt token of a request; a MEPIC request must
    have only its in-context tokens computed (shared chunk blocks are not). ``Request`` keeps
    the prompt in several fields (0.30.0: ``prompt_token_ids``, ``_all_token_ids``,
    ``all_token_ids``, ``num_prompt_tokens``, ``_block_hasher``), all rewritten together.
    """
    request.prompt_token_ids = token_ids
    request._all_token_ids = list(token_ids)
    request.all_token_ids = ConstantList(request._all_token_ids)
    request.num_prompt_tokens = len(token_ids)
    request._block_hasher = None


def emit_finished_at_arrival(
    outputs: dict[int, EngineCoreOutputs], done: dict[str, tuple[int, RequestStatus]]
) -> None:
    """Tell clients about requests finished when they arrived (rejected, or control requests).

    Why: vLLM's scheduler reports a request only once it was scheduled; a request MEPIC refuses
    at arrival never is, so its (empty) output is added to the step's engine outputs here.
    """
    for request_id, (client_index, status) in done.items():
        outputs.setdefault(client_index, EngineCoreOutputs()).outputs.append(
            EngineCoreOutput(
                request_id=request_id,
                new_token_ids=[],
                finish_reason=RequestStatus.get_finished_reason(status),
            )
        )
