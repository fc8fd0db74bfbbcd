"""matplotlib for the benchmark reports, if installed (the ``eval`` extra); else no plots."""

from __future__ import annotations

from typing import Any

from ascend_mepic.entrypoints.streams import log

_WARNED: list[bool] = []


def pyplot() -> Any:
    """``matplotlib.pyplot`` on the Agg backend, or None (said once) when it is not installed."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        if not _WARNED:
            log(
                "[bench] matplotlib is not installed: skipping plots (it is in the `eval` extra: "
                "pip install -e '.[eval]')"
            )
            _WARNED.append(True)
        return None
    return plt
