"""vLLM general-plugin entry point; runs in every vLLM process (API server, engine, workers)."""

from __future__ import annotations

import importlib.util
import logging

import torch

logger = logging.getLogger(__name__)


def register() -> None:
    """Per-process set-up: AMX permission on CPU; on Ascend, MEPIC's worker for MEPIC configs.

    vLLM's CPU attention picks an AMX path for bf16 and dies with ``Illegal instruction`` unless
    the process asked first; doing it here covers every process vLLM spawns. On vllm-ascend's
    platform, ``vllm serve --additional-config '{"mepic": {}}'`` then selects MEPIC's NPU worker
    and scheduler (``vllm_integration.ascend.select_mepic_from_config``).
    """
    if importlib.util.find_spec("vllm_ascend") is not None:
        from vllm.platforms import current_platform

        if current_platform.device_type == "npu":
            from ascend_mepic.vllm_integration.ascend import select_mepic_from_config

            select_mepic_from_config()
    init_amx = getattr(torch.cpu, "_init_amx", None)
    if init_amx is not None:
        try:
            init_amx()
        except (RuntimeError, OSError) as e:
            logger.debug("AMX permission not granted: %s", e)
