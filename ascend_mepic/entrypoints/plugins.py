"""MEPIC's vLLM plugin names and the ``VLLM_PLUGINS`` allowlist that admits them.

Kept apart from the server package, which imports vLLM's OpenAI server (15 s on 2 cores):
``ascend-mepic plugins``, which a shell runs before ``vllm serve``
(``VLLM_PLUGINS=$(ascend-mepic plugins)``), needs only these names and the installed entry points.
"""

from __future__ import annotations

import os
from collections.abc import MutableMapping
from importlib.metadata import distributions

# One name for both entry points, so VLLM_PLUGINS=ascend_mepic allows the pair.
PLUGIN_NAME = "ascend_mepic"
ENDPOINT_PLUGINS_GROUP = "vllm.endpoint_plugins"
ENDPOINT_ENTRY_POINT = "ascend_mepic.entrypoints.server:MepicEndpointPlugin"


def allow_mepic_plugins(environ: MutableMapping[str, str] = os.environ) -> str:
    """Add ``ascend_mepic`` to ``VLLM_PLUGINS`` (endpoint plugins load only when named).

    When unset, vLLM loads every general/platform/stat-logger plugin; setting the variable
    would turn that into an allowlist, so it lists all of them to keep that behaviour.
    """
    current = environ.get("VLLM_PLUGINS")
    if current is None:
        names = {
            ep.name
            for dist in distributions()
            for ep in dist.entry_points
            if ep.group.startswith("vllm.") and ep.group != ENDPOINT_PLUGINS_GROUP
        }
    else:
        names = {n for n in current.split(",") if n}
    names.add(PLUGIN_NAME)
    environ["VLLM_PLUGINS"] = ",".join(sorted(names))
    return environ["VLLM_PLUGINS"]
