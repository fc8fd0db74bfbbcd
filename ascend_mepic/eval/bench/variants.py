"""A benchmark *variant*: a policy name with MEPIC options, written ``POLICY[,OPTION=VALUE...]``.

``mepic,chunk_anchor=prefix`` is policy ``mepic`` with ``{"chunk_anchor": "prefix"}``, so the
real-engine benchmarks can set options side by side with plain policies, under the label the
user wrote. Values are read as JSON where they parse (``16``, ``0.5``, ``true``), else as text.
Options are checked by the option model (``config.MepicConfig``) before any engine starts.
"""

from __future__ import annotations

import json
from typing import Any


def split_variant(spec: str) -> tuple[str, dict[str, Any]]:
    """``"mepic,chunk_anchor=prefix"`` -> ``("mepic", {"chunk_anchor": "prefix"})``.

    Raises ValueError naming the bad part; the policy itself is checked by ``check_variant``."""
    name, *parts = [p.strip() for p in spec.split(",")]
    options: dict[str, Any] = {}
    for part in parts:
        key, sep, raw = part.partition("=")
        if not sep or not key or not raw:
            raise ValueError(f"variant {spec!r}: {part!r} is not OPTION=VALUE")
        if key in ("policy", *options):
            raise ValueError(f"variant {spec!r}: option {key!r} given twice")
        try:
            options[key] = json.loads(raw)
        except ValueError:
            options[key] = raw
    return name, options


def check_variant(spec: str) -> None:
    """Raise ValueError if ``spec`` is not a policy with valid MEPIC options (``prefix`` is stock
    vLLM and takes none)."""
    from ascend_mepic.config import MepicConfig

    name, options = split_variant(spec)
    if name == "prefix":
        if options:
            raise ValueError(f"variant {spec!r}: stock vLLM (prefix) takes no MEPIC option")
        return
    MepicConfig.from_options({"policy": name, **options})


def paper_variant(spec: str) -> str:
    """The paper's MEPIC for a shared-placement policy: chunks compiled alone from position 0
    (``chunk_anchor: none``) unless the variant sets the anchor. The simulator and its validation
    run it: the paper's workloads put request-specific text before the chunks, which anchored
    compiles (the product's default) would key every chunk by, sharing nothing."""
    from ascend_mepic.core.policies import Placement, parse_policy

    name, options = split_variant(spec)
    if name == "prefix" or "chunk_anchor" in options:
        return spec
    if parse_policy(name).placement is not Placement.SHARED:
        return spec
    return f"{spec},chunk_anchor=none"
