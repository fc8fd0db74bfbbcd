"""The native CPU kernel (``csrc/cpu/rope_paged_attention.cpp``): build, load and call it.

The kernel is a torch extension registered as ``torch.ops.ascend_mepic.rope_paged_attention``.
``make setup`` builds it (``python -m ascend_mepic.ops.cpu_kernel``); otherwise the first call
builds it, once per torch version and environment, into
``~/.cache/ascend_mepic/torch_extensions`` (override with
``ASCEND_MEPIC_EXT_DIR``). If the build or the load fails, the reason is logged as an error once
and ``available()`` is False: the CPU path then uses the torch reference (the oracle), so a
machine without a compiler still serves, only slower.
"""

from __future__ import annotations

import hashlib
import logging
import os
import sys
from pathlib import Path

import torch

from ascend_mepic.ops.metadata import PagedRopeMetadata
from ascend_mepic.ops.rope import RopeSpec

logger = logging.getLogger(__name__)

SOURCE = Path(__file__).resolve().parents[2] / "csrc" / "cpu" / "rope_paged_attention.cpp"
EXT_NAME = "ascend_mepic_cpu"
SUPPORTED_DTYPES = (torch.float32, torch.bfloat16)

_state: dict[str, object] = {}


def build_dir() -> Path:
    """One build folder per torch, Python and environment (``sys.prefix``): environments with the
    same torch (``.venv`` and ``.venv-ascend``, two checkouts' venvs) otherwise see each other's
    build as stale and rebuild it in turn."""
    root = os.environ.get("ASCEND_MEPIC_EXT_DIR")
    base = Path(root) if root else Path.home() / ".cache" / "ascend_mepic" / "torch_extensions"
    env = hashlib.sha256(os.path.realpath(sys.prefix).encode()).hexdigest()[:10]
    py = f"py{sys.version_info.major}{sys.version_info.minor}"
    return base / f"torch-{torch.__version__}-{py}-env-{env}"


def load(verbose: bool = False) -> bool:
    """Build (if needed) and load the kernel; False, with the reason logged once, on failure."""
    if "ok" in _state:
        return bool(_state["ok"])
    try:
        if not SOURCE.is_file():
            raise FileNotFoundError(f"{SOURCE} is missing (install the repository editable)")
        from torch.utils.cpp_extension import load as load_extension

        directory = build_dir()
        directory.mkdir(parents=True, exist_ok=True)
        load_extension(
            name=EXT_NAME,
            sources=[str(SOURCE)],
            extra_cflags=[
                "-O3",
                "-march=native",
                "-mprefer-vector-width=256",
                "-fopenmp",
                "-fno-math-errno",
            ],
            build_directory=str(directory),
            is_python_module=False,
            verbose=verbose,
        )
        _state["ok"] = hasattr(torch.ops.ascend_mepic, "rope_paged_attention")
        logger.info("MEPIC's native CPU attention kernel loaded (%s)", directory)
    except Exception as exc:  # a compiler error, a missing toolchain, a bad .so: fall back
        logger.error(
            "MEPIC's native CPU attention kernel is unavailable (%s: %s); the CPU path falls "
            "back to the torch reference, which is correct but several times slower. Rebuild "
            "with `python -m ascend_mepic.ops.cpu_kernel`.",
            type(exc).__name__,
            exc,
        )
        _state["ok"] = False
    return bool(_state["ok"])


def available() -> bool:
    return load()


def supports(*dtypes: torch.dtype) -> bool:
    """Whether the kernel takes these dtypes (query and cache may differ)."""
    return all(dt in SUPPORTED_DTYPES for dt in dtypes)


def write_kv_cpu(
    key: torch.Tensor, value: torch.Tensor, kv_cache: torch.Tensor, slot_mapping: torch.Tensor
) -> None:
    """The reference's ``write_kv`` as one native call (no index tensors per layer)."""
    n = slot_mapping.shape[0]
    torch.ops.ascend_mepic.write_kv(key[:n], value[:n], kv_cache, slot_mapping)


def decode_splits(meta: PagedRopeMetadata, num_kv_heads: int) -> int:
    """KV splits per decode sequence: enough work items for every thread."""
    items = max(1, meta.num_seqs * num_kv_heads)
    return max(1, min(8, -(-2 * torch.get_num_threads() // items)))


def rope_paged_attention_cpu(
    query: torch.Tensor,
    kv_cache: torch.Tensor,
    meta: PagedRopeMetadata,
    rope: RopeSpec,
    scale: float,
    *,
    num_splits: int | None = None,
) -> torch.Tensor:
    """Fused-RoPE paged attention on CPU; same contract and result as the torch reference."""
    if not load():
        raise RuntimeError("the native CPU kernel is not available (see the error logged above)")
    for name, t in (("query", query), ("kv_cache", kv_cache)):
        if t.dtype not in SUPPORTED_DTYPES:
            raise TypeError(f"{name} dtype {t.dtype}: the CPU kernel takes float32 or bfloat16")
    cos_sin = meta.memo.get("cpu-cos-sin")
    if cos_sin is None:
        cos_sin = meta.memo["cpu-cos-sin"] = rope.cos_sin_cache.float().contiguous()
    splits = num_splits or decode_splits(meta, kv_cache.shape[3])
    return torch.ops.ascend_mepic.rope_paged_attention(
        query,
        kv_cache,
        meta.query_start_loc,
        meta.query_positions,
        meta.query_indices,
        meta.block_tables,
        meta.num_blocks,
        meta.block_first_pos,
        meta.block_valid_start,
        meta.block_valid_end,
        cos_sin,
        bool(rope.is_neox_style),
        float(scale),
        splits,
    )


if __name__ == "__main__":
    logging.basicConfig(level=logging.INFO)
    ok = load(verbose="-v" in sys.argv)
    state = "built and loaded" if ok else "NOT available"
    print(f"ascend_mepic CPU kernel: {state} ({build_dir()})")
    sys.exit(0 if ok else 1)
