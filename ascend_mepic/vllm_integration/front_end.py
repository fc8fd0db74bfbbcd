"""Refusing, in vLLM's front end, a segmented request the engine could never serve.

vLLM checks a prompt against ``max_model_len`` before it reaches the engine core, and
``LLM.generate`` (or the API server) raises ``VLLMValidationError``. A request MEPIC refuses in the
engine core instead finishes with an empty output and ``finish_reason="error"``, which offline
callers easily take for a result. So every check that needs only the engine's configuration
(``core.request_limits.RequestLimits.check_prompt``: malformed segments, too many chunks, tokens
beyond ``max_model_len``, compiles no step can hold, a KV pool too small) runs here too, from the
platform's per-request hook ``Platform.validate_request``, which ``InputProcessor.process_inputs``
calls with the processed prompt and its sampling parameters (vLLM 0.30.0).

That hook is a classmethod and sees no engine, so the configurations of this process's MEPIC
engines are registered as they are checked (``register``, from ``engine_config``'s configuration
hook) and held weakly (an engine's configuration goes with its engine). With several live MEPIC
engines in one process, a request is refused only if every one of them would refuse it (then with
the first one's reason): the engine core still checks it against its own limits.
"""

from __future__ import annotations

import weakref
from typing import Any

from ascend_mepic.config import MepicConfig
from ascend_mepic.core.errors import MepicCapacityError
from ascend_mepic.core.request_limits import RequestLimits
from ascend_mepic.core.segments import EXTRA_ARGS_KEY, UNPIN_KEY, LayoutError

# id(vllm_config) -> (weak reference to it, its MEPIC options), for live MEPIC engines.
_ENGINES: dict[int, tuple[weakref.ref, MepicConfig]] = {}


def register(vllm_config: Any, config: MepicConfig) -> None:
    """Check segmented requests of this process against ``vllm_config``'s engine from now on."""
    key = id(vllm_config)
    _ENGINES[key] = (weakref.ref(vllm_config, lambda _: _ENGINES.pop(key, None)), config)


def unregister(vllm_config: Any) -> None:
    """The engine of ``vllm_config`` shut down (its scheduler says so): stop checking against it.
    Its configuration may outlive it in process globals, and a dead engine's wider limits must
    not let through what the live engines refuse."""
    _ENGINES.pop(id(vllm_config), None)


def live_limits() -> list[RequestLimits]:
    """The request limits of this process's live MEPIC engines."""
    found = []
    for ref, config in list(_ENGINES.values()):
        vllm_config = ref()
        if vllm_config is not None:
            found.append(RequestLimits.from_vllm_config(vllm_config, config))
    return found


def check_request(engine_input: Any, params: Any) -> None:
    """Raise ``VLLMValidationError`` for a segmented request no live MEPIC engine can serve."""
    extra = getattr(params, "extra_args", None)
    if not extra or EXTRA_ARGS_KEY not in extra or extra.get(UNPIN_KEY):
        return
    limits = live_limits()
    if not limits:
        return
    from vllm.exceptions import VLLMValidationError

    token_ids = engine_input.get("prompt_token_ids") if isinstance(engine_input, dict) else None
    if token_ids is None:
        raise VLLMValidationError(
            f"a request with {EXTRA_ARGS_KEY} needs its prompt as token ids (got "
            f"{engine_input.get('type') if isinstance(engine_input, dict) else engine_input!r})"
        )
    reasons = []
    for limit in limits:
        try:
            limit.check_prompt(token_ids, extra[EXTRA_ARGS_KEY])
            return
        except LayoutError as e:
            reasons.append(f"invalid {EXTRA_ARGS_KEY}: {e}")
        except MepicCapacityError as e:
            reasons.append(str(e))
    raise VLLMValidationError(f"MEPIC cannot serve this request: {reasons[0]}")
