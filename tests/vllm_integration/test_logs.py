"""MEPIC's loggers print through vLLM's logging configuration (``vllm_integration/logs.py``)."""

from __future__ import annotations

import logging
import re

from ascend_mepic.vllm_integration.logs import use_vllm_logging


def test_mepic_logs_take_vllms_handler_format_and_level():
    assert use_vllm_logging()
    ours, theirs = logging.getLogger("ascend_mepic"), logging.getLogger("vllm")
    assert theirs.handlers and set(theirs.handlers) <= set(ours.handlers)
    assert ours.level == theirs.level and not ours.propagate
    use_vllm_logging()  # every vLLM process calls it once per plugin load: nothing doubles
    assert len(ours.handlers) == len(set(ours.handlers))
    child = logging.getLogger("ascend_mepic.core.scheduler")
    record = child.makeRecord(child.name, logging.INFO, "/x/scheduler.py", 105, "MEPIC on", (), 0)
    line = theirs.handlers[0].format(record)
    assert re.search(r"INFO \d\d-\d\d \d\d:\d\d:\d\d \[scheduler\.py:105\] MEPIC on$", line), line
