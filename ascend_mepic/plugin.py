"""vLLM general-plugin entry point; runs in every vLLM process (API server, engine, workers)."""

from __future__ import annotations

import logging

import torch

logger = logging.getLogger(__name__)


def register() -> None:
    """Per-process set-up: MEPIC's logs through vLLM's logging; MEPIC's configuration hook on
    the current platform; AMX permission.

    With the hook, ``vllm serve --additional-config '{"mepic": {}}'`` (or the same
    ``additional_config`` in ``LLM``) selects MEPIC's scheduler, worker and attention backend on
    CPU, CUDA and vllm-ascend's NPU platform, and refuses at config time what MEPIC cannot serve
    (``vllm_integration.engine_config``). vLLM's CPU attention picks an AMX path for bf16 and dies
    with ``Illegal instruction`` unless the process asked first; doing it here covers every
    process vLLM spawns.
    """
    from vllm.platforms import current_platform

    from ascend_mepic.vllm_integration.logs import use_vllm_logging
    from ascend_mepic.vllm_integration.platform_hook import install_config_hook, selection_for

    use_vllm_logging()

    selection = selection_for(current_platform)
    if selection is not None:
        install_config_hook(type(current_platform), selection)
    init_amx = getattr(torch.cpu, "_init_amx", None)
    if init_amx is not None:
        try:
            init_amx()
        except (RuntimeError, OSError) as e:
            logger.debug("AMX permission not granted: %s", e)
