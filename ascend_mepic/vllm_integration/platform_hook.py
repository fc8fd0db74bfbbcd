"""Turning MEPIC on from the engine configuration alone: the platform hooks (vLLM 0.30.0).

``vllm serve MODEL --additional-config '{"mepic": {}}'`` (and ``LLM(..., additional_config=...)``)
must start MEPIC's scheduler, worker, runner and attention backend, and must refuse at start-up
what MEPIC cannot serve. The platform's ``check_and_update_config`` is the only code that sees the
final configuration before any process starts: it is where ``worker_cls="auto"`` becomes the
platform's own worker and after which vLLM's defaults (async scheduling, the V2 model runner,
full CUDA graphs, the attention backend) are settled. So MEPIC's general plugin wraps that one
classmethod of the current platform (``install_config_hook``, running the platform's
``engine_config.MepicSelection``); with no ``mepic`` entry in ``additional_config`` the wrapper
only calls the platform's own check. vLLM has no documented hook
that runs on the final configuration. The same function wraps the platform's per-request hook,
``validate_request``, so that vLLM's front end refuses a segmented request the engine could never
serve, as it refuses an over-long prompt (``front_end`` says why; a request without
``mepic_segments`` only gets the platform's own check). These two are this module's patches.
"""

from __future__ import annotations

from typing import Any

from ascend_mepic.core.segments import EXTRA_ARGS_KEY
from ascend_mepic.vllm_integration.engine_config import (
    CpuSelection,
    CudaSelection,
    MepicSelection,
    mepic_on,
)


def selection_for(platform: Any) -> MepicSelection | None:
    """MEPIC's selection for vLLM's current platform, None where MEPIC has none."""
    if platform.is_cpu():
        return CpuSelection()
    if platform.is_cuda():
        return CudaSelection()
    if platform.device_type == "npu":
        from ascend_mepic.vllm_integration.ascend import AscendSelection  # imports vllm_ascend

        return AscendSelection()
    return None


def install_config_hook(platform_cls: type, selection: MepicSelection) -> None:
    """Wrap ``platform_cls.check_and_update_config`` so configurations with MEPIC on get
    ``selection``. Why: see the module docstring. Idempotent per platform class."""
    current = platform_cls.check_and_update_config
    if getattr(current, "mepic_selection", None) is not None:
        return

    def check_and_update_config(cls, vllm_config) -> None:
        on = mepic_on(vllm_config)
        if on:
            selection.before_platform_check(vllm_config)
        current(vllm_config)
        if on:
            selection.after_platform_check(vllm_config)
            from ascend_mepic.config import MepicConfig
            from ascend_mepic.vllm_integration import front_end

            front_end.register(
                vllm_config, MepicConfig.from_additional_config(vllm_config.additional_config)
            )

    check_and_update_config.mepic_selection = selection  # type: ignore[attr-defined]
    platform_cls.check_and_update_config = classmethod(check_and_update_config)  # type: ignore[method-assign]
    validate = platform_cls.validate_request

    def validate_request(cls, processed_inputs, params) -> None:
        validate(processed_inputs, params)
        extra = getattr(params, "extra_args", None)
        if extra and EXTRA_ARGS_KEY in extra:
            from ascend_mepic.vllm_integration import front_end

            front_end.check_request(processed_inputs, params)

    platform_cls.validate_request = classmethod(validate_request)  # type: ignore[method-assign]
