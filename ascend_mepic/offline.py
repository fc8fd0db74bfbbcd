"""Offline use: run segmented requests through ``vllm.LLM`` with MEPIC on.

    from vllm import LLM, SamplingParams
    from ascend_mepic.offline import Segment, generate_segments, mepic_llm_kwargs

    llm = LLM(model=path, **mepic_llm_kwargs())
    outs = generate_segments(llm, [[Segment.prompt(q0), Segment.chunk(doc), Segment.prompt(q1)]],
                             SamplingParams(max_tokens=32))

A request travels as its real prompt tokens plus ``extra_args["mepic_segments"]`` (the segment
kinds and lengths); the scheduler lays it out and the worker places its tokens.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from vllm import SamplingParams

from ascend_mepic.core.markers import segments_from_text
from ascend_mepic.core.segments import EXTRA_ARGS_KEY, Segment
from ascend_mepic.vllm_integration.class_names import NPU_WORKER_CLS, SCHEDULER_CLS, worker_cls_for

__all__ = [
    "Segment",
    "generate_segments",
    "mepic_llm_kwargs",
    "segment_request",
    "segments_from_text",
    "worker_cls_for_platform",
]


def worker_cls_for_platform() -> str:
    """MEPIC's worker for the current vLLM platform (CPU tested; CUDA and Ascend untested on
    hardware)."""
    from vllm.platforms import current_platform

    return worker_cls_for(current_platform)


def mepic_llm_kwargs(**options: Any) -> dict[str, Any]:
    """``LLM(...)`` / engine arguments that turn MEPIC on (options go to ``{"mepic": ...}``).

    The options are validated here (``config.MepicConfig``): a wrong one fails at this call,
    naming the field, not when the engine starts.
    """
    from ascend_mepic.config import MepicConfig

    policy = MepicConfig.from_options(dict(options)).policy
    worker_cls = worker_cls_for_platform()
    eager = {"enforce_eager": True} if worker_cls == NPU_WORKER_CLS else {}
    return {
        **eager,
        # vLLM 0.30.0 turns async scheduling on by default (the CPU platform turns it off):
        # MEPIC's step plan must describe the step the worker runs next.
        "async_scheduling": False,
        "scheduler_cls": SCHEDULER_CLS,
        "worker_cls": worker_cls,
        "additional_config": {"mepic": dict(options)},
        "enable_prefix_caching": policy != "full",
    }


def segment_request(
    segments: Sequence[Segment], params: SamplingParams, cache_salt: str | None = None
) -> tuple[dict[str, Any], SamplingParams]:
    """The (prompt, sampling params) pair vLLM needs for one segmented request."""
    prompt: dict[str, Any] = {"prompt_token_ids": [t for s in segments for t in s.token_ids]}
    if cache_salt is not None:
        prompt["cache_salt"] = cache_salt
    params = params.clone()
    extra = dict(params.extra_args or {})
    extra[EXTRA_ARGS_KEY] = [[s.kind.value, len(s.token_ids)] for s in segments]
    params.extra_args = extra
    return prompt, params


def generate_segments(
    llm: Any,
    requests: Sequence[Sequence[Segment]],
    params: SamplingParams,
    cache_salts: Sequence[str | None] | None = None,
    use_tqdm: bool = False,
) -> list[Any]:
    """``LLM.generate`` over segmented requests, in one batch."""
    salts = list(cache_salts) if cache_salts is not None else [None] * len(requests)
    pairs = [
        segment_request(segs, params, salt) for segs, salt in zip(requests, salts, strict=True)
    ]
    return llm.generate([p for p, _ in pairs], [sp for _, sp in pairs], use_tqdm=use_tqdm)
