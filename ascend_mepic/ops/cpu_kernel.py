"""The native CPU kernel (``csrc/cpu/rope_paged_attention.cpp``): build, load and call it.

The kernel is a torch extension registered as ``torch.ops.ascend_mepic.rope_paged_attention``.
It is compiled only by ``build()``: ``make setup`` and ``python -m ascend_mepic.ops.cpu_kernel``
run it, once per torch version and environment, into ``~/.cache/ascend_mepic/torch_extensions``
(override with ``ASCEND_MEPIC_EXT_DIR``), and record what they built in a stamp. The serving path
(``load()``, reached from the attention forward) never compiles: it loads the library the stamp
names if the stamp matches this source and torch, and otherwise logs why at once and returns
False, so the CPU path runs the torch reference (the oracle): correct, only slower. Compiling in
the serving path made every engine of a machine wait on torch's build lock, forever when a build
had been killed and left the lock behind.
"""

from __future__ import annotations

import contextlib
import fcntl
import hashlib
import json
import logging
import os
import sys
from collections.abc import Iterator
from pathlib import Path

import torch

from ascend_mepic.ops.metadata import PagedRopeMetadata
from ascend_mepic.ops.rope import RopeSpec

logger = logging.getLogger(__name__)

SOURCE = Path(__file__).resolve().parents[2] / "csrc" / "cpu" / "rope_paged_attention.cpp"
EXT_NAME = "ascend_mepic_cpu"
SUPPORTED_DTYPES = (torch.float32, torch.bfloat16)
CFLAGS = ("-O3", "-march=native", "-mprefer-vector-width=256", "-fopenmp", "-fno-math-errno")
STAMP = "ascend-mepic-build.json"
BUILD_HINT = "build it with `python -m ascend_mepic.ops.cpu_kernel` (`make setup` does)"

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


def fingerprint() -> dict[str, object]:
    """What a build depends on: the source, torch and the flags."""
    return {
        "source_sha256": hashlib.sha256(SOURCE.read_bytes()).hexdigest(),
        "torch": torch.__version__,
        "cflags": list(CFLAGS),
    }


def prebuilt() -> tuple[Path | None, str]:
    """The library a current build left in ``build_dir()``, or ``None`` and why; never compiles."""
    directory = build_dir()
    if not SOURCE.is_file():
        return None, f"{SOURCE} is missing (install the repository editable)"
    try:
        stamp = json.loads((directory / STAMP).read_text(encoding="utf-8"))
    except FileNotFoundError:
        return None, f"not built for this environment ({directory})"
    except (OSError, ValueError) as exc:
        return None, f"unreadable build stamp {directory / STAMP} ({exc})"
    if {k: stamp.get(k) for k in fingerprint()} != fingerprint():
        return None, f"the build in {directory} is stale (another source, torch or flags)"
    library = directory / str(stamp.get("library", ""))
    if not library.is_file():
        return None, f"{library} is missing"
    return library, f"built ({library})"


@contextlib.contextmanager
def _build_lock(directory: Path) -> Iterator[None]:
    """One builder per build folder at a time. An ``flock``, which the kernel releases when its
    holder dies, unlike torch's ``lock`` file: one left under it was left by a killed build."""
    with open(directory / ".ascend-mepic-build.flock", "w") as handle:
        fcntl.flock(handle, fcntl.LOCK_EX)
        try:
            stale = directory / "lock"
            if stale.exists():
                logger.warning("removing %s, left by an interrupted build", stale)
                stale.unlink(missing_ok=True)
            yield
        finally:
            fcntl.flock(handle, fcntl.LOCK_UN)


def build(verbose: bool = False) -> Path:
    """Compile the kernel into ``build_dir()`` and stamp it (raises on failure). For set-up
    (``make setup``, ``python -m ascend_mepic.ops.cpu_kernel``), never the serving path."""
    if not SOURCE.is_file():
        raise FileNotFoundError(f"{SOURCE} is missing (install the repository editable)")
    from torch.utils.cpp_extension import load as load_extension

    directory = build_dir()
    directory.mkdir(parents=True, exist_ok=True)
    with _build_lock(directory):
        (directory / STAMP).unlink(missing_ok=True)
        load_extension(
            name=EXT_NAME,
            sources=[str(SOURCE)],
            extra_cflags=list(CFLAGS),
            build_directory=str(directory),
            is_python_module=False,
            verbose=verbose,
        )
        libraries = sorted(directory.glob(f"{EXT_NAME}*.so"), key=lambda p: p.stat().st_mtime)
        if not libraries:
            raise FileNotFoundError(f"the build left no {EXT_NAME}*.so in {directory}")
        stamp = {**fingerprint(), "library": libraries[-1].name}
        tmp = directory / f"{STAMP}.{os.getpid()}"
        tmp.write_text(json.dumps(stamp, indent=1), encoding="utf-8")
        os.replace(tmp, directory / STAMP)
    return libraries[-1]


def load() -> bool:
    """Load the prebuilt kernel (once per process); False, with the reason logged once, when
    there is none for this source and environment. Never compiles."""
    if "ok" in _state:
        return bool(_state["ok"])
    library, why = prebuilt()
    ok = False
    if library is not None:
        try:
            torch.ops.load_library(str(library))
            ok = hasattr(torch.ops.ascend_mepic, "rope_paged_attention")
            why = f"loaded ({library})" if ok else f"{library} registers no kernel"
        except Exception as exc:  # a bad or foreign .so: fall back
            why = f"{library} did not load ({type(exc).__name__}: {exc})"
    if ok:
        logger.info("MEPIC's native CPU attention kernel %s", why)
    else:
        logger.error(
            "MEPIC's native CPU attention kernel is not used: %s; the CPU path runs the torch "
            "reference, which is correct but several times slower: %s.",
            why,
            BUILD_HINT,
        )
    _state["ok"] = ok
    return ok


def isa() -> str:
    """What the loaded build's vector code was compiled for (``"unavailable"`` without one)."""
    if not load():
        return "unavailable"
    op = getattr(torch.ops.ascend_mepic, "isa", None)
    return str(op()) if op is not None else "unknown (a build without isa())"


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


def main() -> int:
    """Build (or confirm) the kernel for this environment and load it."""
    logging.basicConfig(level=logging.INFO)
    try:
        library, _ = prebuilt()
        if library is None or "--force" in sys.argv:
            library = build(verbose="-v" in sys.argv)
    except Exception as exc:  # a compiler error, a missing toolchain
        print(f"ascend_mepic CPU kernel: NOT built: {type(exc).__name__}: {exc}", file=sys.stderr)
        return 1
    ok = load()
    print(f"ascend_mepic CPU kernel: {'built and loaded' if ok else 'NOT loaded'} ({library})")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
