"""vLLM general-plugin entry point; runs in every vLLM process (API server, engine, workers)."""

from __future__ import annotations

import logging

import torch

logger = logging.getLogger(__name__)


def register() -> None:
    """Ask Linux for AMX tile permission before vLLM's CPU kernels may use it.

    vLLM's CPU attention picks an AMX path for bf16 and dies with ``Illegal instruction`` unless
    the process asked first; doing it here covers every process vLLM spawns.
    """
    init_amx = getattr(torch.cpu, "_init_amx", None)
    if init_amx is not None:
        try:
            init_amx()
        except (RuntimeError, OSError) as e:
            logger.debug("AMX permission not granted: %s", e)
