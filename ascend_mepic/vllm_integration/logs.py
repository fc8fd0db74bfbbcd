"""MEPIC's log lines go where vLLM's go, in vLLM's format, level and stream.

vLLM configures its own logger (``vllm``) at import: a handler with its format, at
``VLLM_LOGGING_LEVEL``, on ``VLLM_LOGGING_STREAM``, not propagating to the root logger, which
has no handler under ``vllm serve``. MEPIC's modules log to ``ascend_mepic.*``; without this
their INFO lines vanished and their warnings came out bare. The plugin's ``register`` (run in
every vLLM process: API server, engine core, workers, ``LLM``) attaches vLLM's handlers to
``ascend_mepic``, so a user's ``VLLM_LOGGING_CONFIG_PATH`` or ``VLLM_LOGGING_LEVEL`` governs
MEPIC too. With ``VLLM_CONFIGURE_LOGGING=0`` vLLM has no handler and nothing is attached: the
application's own logging configuration applies to both.
"""

from __future__ import annotations

import logging

MEPIC_LOGGER = "ascend_mepic"


def use_vllm_logging() -> bool:
    """Attach vLLM's handlers and level to MEPIC's logger; False where vLLM has none."""
    import vllm.logger  # noqa: F401  (configures vLLM's logging on first import)

    ours, theirs = logging.getLogger(MEPIC_LOGGER), logging.getLogger("vllm")
    if not theirs.handlers:
        return False
    for handler in theirs.handlers:
        if handler not in ours.handlers:
            ours.addHandler(handler)
    ours.setLevel(theirs.level)
    ours.propagate = False  # as vLLM's own logger: its handler prints, the root's does not
    return True
