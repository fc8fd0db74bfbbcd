"""Refuse to report a benchmark or evaluation whose requests failed or whose timings are not
positive.

Why: vLLM answers a request it refuses (a prompt it cannot schedule, an engine error) with an
empty output whose ``finish_reason`` is ``"error"``, and ``LLM.generate`` returns it like any
served one. A benchmark that times such calls measures how fast the engine says no: MEPIC's TTFT
came out as 1.3 ms and its decode rate as -12,146 tok/s, with exit status 0 (issue 46). So every
command that makes numbers from generation outputs checks them here before it computes anything,
and every time or rate it reports goes through :func:`positive`: a failed run ends with a
non-zero exit and the reason (which request, which configuration, what finish reason, tokens
received against tokens asked), never with a table.

Job processes (one engine each) report such an error to their parent on their data stream
(:func:`failure_line`), and the parent raises it again with the same type and message
(:func:`raise_from_job`), so the reason survives the process boundary even when the child's
stderr is not captured.
"""

from __future__ import annotations

import json
import math
import time
from collections.abc import Callable, Iterator, Mapping, Sequence
from contextlib import contextmanager
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, TextIO

if TYPE_CHECKING:
    from vllm.outputs import RequestOutput

# vLLM's finish reasons of a request it did not serve (``vllm.v1.engine.FinishReason``): "error"
# (an engine-side failure) and "abort" (cancelled). "stop", "length" and "repetition" are served.
FAILED_FINISH_REASONS = frozenset({"error", "abort"})
MAX_SHOWN = 5  # failures spelled out in a message; the rest are counted
FAILURE_PREFIX = "FAILED"  # a job process's failure line (beside the RESULT line of a success)


class ResultError(RuntimeError):
    """A benchmark or evaluation result that must not be reported: the run is not valid."""


class FailedRequestError(ResultError):
    """Requests that were not served: an error or abort finish, or no tokens where some were
    asked. ``failures`` holds them (empty when re-raised from a job process's message)."""

    def __init__(self, message: str, failures: Sequence[RequestFailure] = ()) -> None:
        super().__init__(message)
        self.failures = tuple(failures)


class InvalidMeasurementError(ResultError):
    """A measured time or rate that is zero, negative or not finite: the arithmetic of a failed
    or empty run (e.g. a decode time taken as the difference of two calls that did nothing)."""


@dataclass(frozen=True)
class RequestFailure:
    """One request that was not served."""

    request: str  # e.g. "request 3 (id '3')"
    finish_reason: str | None
    tokens: int  # output tokens received
    asked: int | None  # max_tokens (None: up to the model's length)

    def __str__(self) -> str:
        return (
            f"{self.request}: finish_reason {self.finish_reason!r}, {self.tokens} tokens "
            f"received of max_tokens={self.asked}"
        )


def request_failure(
    request: str, finish_reason: str | None, tokens: int, asked: int | None
) -> RequestFailure | None:
    """The failure of one finished request, or None when it was served."""
    failed = finish_reason in FAILED_FINISH_REASONS
    empty = tokens == 0 and (asked is None or asked > 0)
    return RequestFailure(request, finish_reason, tokens, asked) if failed or empty else None


def raise_failures(
    what: str, failures: Sequence[RequestFailure], total: int, hint: str = ""
) -> None:
    """Raise :class:`FailedRequestError` naming ``failures`` (nothing when there are none)."""
    if not failures:
        return
    shown = "; ".join(str(f) for f in failures[:MAX_SHOWN])
    if len(failures) > MAX_SHOWN:
        shown += f"; and {len(failures) - MAX_SHOWN} more"
    message = f"{what}: {len(failures)} of {total} requests failed: {shown}"
    if hint:
        message += f" ({hint})"
    raise FailedRequestError(message, failures)


def _max_tokens(asked: Any) -> int | None:
    return getattr(asked, "max_tokens", asked)


def _asked_per_request(asked: Any, n: int) -> list[int | None]:
    """``asked`` (max_tokens, SamplingParams, or a sequence of either, one per request)."""
    if isinstance(asked, Sequence) and not isinstance(asked, str):
        if len(asked) != n:
            raise ValueError(f"{len(asked)} max_tokens values for {n} requests")
        return [_max_tokens(a) for a in asked]
    return [_max_tokens(asked)] * n


def check_request_outputs(
    outputs: Sequence[RequestOutput], asked: Any, what: str, expected: int | None = None
) -> None:
    """Check vLLM ``RequestOutput`` objects (``LLM.generate``'s results, or a finished one of
    ``LLMEngine.step``): each finished, served and, where tokens were asked, not empty.

    ``asked``: the SamplingParams (or max_tokens) given with the prompts, one or one per prompt;
    ``expected``: how many outputs the call must return (one per prompt).
    """
    failures = []
    if expected is not None and len(outputs) != expected:
        raise FailedRequestError(
            f"{what}: the engine returned {len(outputs)} outputs for {expected} prompts"
        )
    asked_each = _asked_per_request(asked, len(outputs))
    for i, (out, n) in enumerate(zip(outputs, asked_each, strict=True)):
        name = f"request {i} (id {out.request_id!r})"
        if not out.outputs:
            failures.append(RequestFailure(name + ", no completion", None, 0, n))
            continue
        c = out.outputs[0]
        if not out.finished:
            failures.append(
                RequestFailure(name + ", not finished", c.finish_reason, len(c.token_ids), n)
            )
            continue
        failure = request_failure(name, c.finish_reason, len(c.token_ids), n)
        if failure is not None:
            failures.append(failure)
    raise_failures(what, failures, len(outputs))


def check_records(
    records: Sequence[Mapping[str, Any]], asked: int | None, what: str, hint: str = ""
) -> None:
    """Check per-request result records (the bench runner's ``per_request``: ``index``,
    ``finish_reason``, ``output_tokens``). A record without ``output_tokens`` never finished;
    one without ``finish_reason`` (a result written before it was recorded) is judged by its
    tokens alone."""
    failures = []
    for i, rec in enumerate(records):
        name = f"request {rec.get('index', i)}"
        failure = request_failure(
            name, rec.get("finish_reason"), int(rec.get("output_tokens") or 0), asked
        )
        if failure is not None:
            failures.append(failure)
    raise_failures(what, failures, len(records), hint)


def check_token_lists(generations: Mapping[str, Sequence[int]], asked: int, what: str) -> None:
    """Check generated token lists that carry no finish reason (the dense reference's greedy
    answers), keyed by what produced each (a policy): none empty where tokens were asked."""
    failures = [
        f
        for key, tokens in generations.items()
        if (f := request_failure(key, None, len(tokens), asked)) is not None
    ]
    raise_failures(what, failures, len(generations))


def positive(value: float | None, what: str) -> float:
    """``value`` if it is a positive finite time or rate; else raise InvalidMeasurementError.

    A duration of zero or less (or a rate from one) is never a measurement of work done: it comes
    from a run that did nothing (refused requests) or from subtracting two noisy timings.
    """
    if value is None or not math.isfinite(value) or value <= 0:
        raise InvalidMeasurementError(
            f"{what} is {value!r}: a measured time or rate must be positive and finite, so "
            "this run's numbers are not reported"
        )
    return float(value)


def timed_generate(
    generate: Callable[[list[Any], Any], Sequence[RequestOutput]],
    prompts: list[Any],
    params: Any,
    what: str,
) -> tuple[Sequence[RequestOutput], float]:
    """``generate(prompts, params)`` (e.g. ``LLM.generate`` without its progress bar): its
    checked outputs and its wall time in seconds, positive. The check runs after the clock stops
    and before the time is used."""
    start = time.perf_counter()
    outputs = generate(prompts, params)
    seconds = time.perf_counter() - start
    check_request_outputs(outputs, params, what, expected=len(prompts))
    return outputs, positive(seconds, f"{what}: wall time (s)")


def failure_line(error: ResultError) -> str:
    """The line a job process writes to its data stream before it exits on ``error``; its
    parent raises the error again (:func:`raise_from_job`)."""
    return FAILURE_PREFIX + json.dumps({"error": type(error).__name__, "message": str(error)})


def raise_from_job(stdout: str, label: str) -> None:
    """Raise the result error a job process reported with :func:`failure_line`, if any."""
    kinds = {c.__name__: c for c in (FailedRequestError, InvalidMeasurementError, ResultError)}
    for line in stdout.splitlines():
        if line.startswith(FAILURE_PREFIX + "{"):
            report = json.loads(line[len(FAILURE_PREFIX) :])
            raise kinds.get(report["error"], ResultError)(f"{label}: {report['message']}")


@contextmanager
def failures_reported(out: TextIO) -> Iterator[None]:
    """In a job process: a result error raised inside also goes to ``out`` (the data stream its
    parent reads) as a :func:`failure_line`, then propagates (the process exits non-zero)."""
    try:
        yield
    except ResultError as e:
        out.write(failure_line(e) + "\n")
        out.flush()
        raise
