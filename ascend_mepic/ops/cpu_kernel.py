"""The native CPU kernel (``csrc/cpu/``: ``SOURCES``, with the headers they include): build, load
and call it.

The kernel is a torch extension registered as ``torch.ops.ascend_mepic.rope_paged_attention``.
It is compiled only by ``build()``: ``make setup`` and ``python -m ascend_mepic.ops.cpu_kernel``
run it, once per torch version and environment, one library per instruction set (``VARIANTS``;
``load()`` takes the best the CPU runs), into ``~/.cache/ascend_mepic/torch_extensions``
(override with ``ASCEND_MEPIC_EXT_DIR``), and record what they built in a stamp. The serving path
(``load()``, reached from the attention forward) never compiles: it loads the library the stamp
names if the stamp matches these sources and torch, and otherwise logs why at once and returns
False, so the CPU path runs the torch reference (the oracle): correct, only slower. Compiling in
the serving path made every engine of a machine wait on torch's build lock, forever when a build
had been killed and left the lock behind.
"""

from __future__ import annotations

import argparse
import contextlib
import fcntl
import hashlib
import json
import logging
import os
import shutil
import subprocess
import sys
import tempfile
from collections.abc import Iterator, Sequence
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import torch

from ascend_mepic.host import cpu_info
from ascend_mepic.ops.metadata import PagedRopeMetadata
from ascend_mepic.ops.rope import RopeSpec

logger = logging.getLogger(__name__)

SOURCE_DIR = Path(__file__).resolve().parents[2] / "csrc" / "cpu"
# The translation units of every library, each compiled to an object by its own compiler
# process (side by side, in this order: the longest compiles first), then linked together; the
# headers they include (one per instruction set, the AMX emulation, ...) sit beside them. Only
# the units that need torch include it, each the least of it that serves. Every file in
# SOURCE_DIR is in the build's fingerprint, so a change to any of them makes the build stale.
SOURCES = tuple(
    SOURCE_DIR / name
    for name in (
        "rope_paged_attention.cpp",  # the attention op and the headers of its paths
        "bindings.cpp",  # the torch op registrations (torch/library.h: the second longest)
        "write_kv.cpp",  # the KV cache write
        "dispatch.cpp",  # AMX detection and switch, isa() (no torch)
        "guard.cpp",  # the guard build's registry (no torch; empty in other builds)
    )
)
EXT_NAME = "ascend_mepic_cpu"
SUPPORTED_DTYPES = (torch.float32, torch.bfloat16)
COMMON_CFLAGS = ("-O3", "-fopenmp", "-fno-math-errno")
# One library per instruction set, best first, each with the CPU flags it needs. No
# -march=native: a build runs on any CPU with its variant's flags, and `load()` picks the best
# variant this CPU has at run time. AMX (bf16 tiles) is not a variant: the avx512 library holds
# an AMX path compiled for it function by function, used only where the CPU has AMX and Linux
# grants the tile state (checked in the kernel at its first call).
VARIANTS: dict[str, tuple[tuple[str, ...], frozenset[str]]] = {
    "avx512": (
        ("-mavx2", "-mfma", "-mf16c", "-mavx512f", "-mavx512bw", "-mavx512vl", "-mavx512dq",
         "-mprefer-vector-width=512"),
        frozenset({"avx2", "fma", "f16c", "avx512f", "avx512bw", "avx512vl", "avx512dq"}),
    ),
    "avx2": (
        ("-mavx2", "-mfma", "-mf16c", "-mprefer-vector-width=256"),
        frozenset({"avx2", "fma", "f16c"}),
    ),
}  # fmt: skip
ISA_ENV = "ASCEND_MEPIC_CPU_ISA"  # force a variant (tests run the avx2 one on AVX-512 CPUs)
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


def source_sha256() -> str:
    """One hash of every file in ``SOURCE_DIR`` (units and headers, names and contents): editing,
    adding, removing or renaming any of them changes it."""
    digest = hashlib.sha256()
    for path in sorted(p for p in SOURCE_DIR.iterdir() if p.is_file()):
        digest.update(path.name.encode() + b"\0")
        digest.update(hashlib.sha256(path.read_bytes()).digest())
    return digest.hexdigest()


def missing_sources() -> str | None:
    """Why the sources cannot be built (``None`` when they are all there)."""
    missing = [p.name for p in SOURCES if not p.is_file()]
    if missing:
        return f"{SOURCE_DIR} lacks {missing} (install the repository editable)"
    return None


def fingerprint() -> dict[str, object]:
    """What a build depends on: the sources (all of ``SOURCE_DIR``), torch and the flags."""
    return {
        "source_sha256": source_sha256(),
        "torch": torch.__version__,
        "cflags": {name: [*COMMON_CFLAGS, *flags] for name, (flags, _) in VARIANTS.items()},
    }


def cpu_flags() -> frozenset[str]:
    """This CPU's feature flags (``host.cpu_info``; empty where unreadable)."""
    return cpu_info().flags


def choose_variant(flags: frozenset[str] | None = None) -> tuple[str | None, str]:
    """The best variant this CPU runs (``ASCEND_MEPIC_CPU_ISA`` forces one), or None and why."""
    flags = cpu_flags() if flags is None else flags
    forced = os.environ.get(ISA_ENV)
    if forced:
        if forced not in VARIANTS:
            return None, f"{ISA_ENV}={forced!r} is not one of {sorted(VARIANTS)}"
        missing = VARIANTS[forced][1] - flags
        if missing:
            return None, f"{ISA_ENV}={forced} needs CPU flags this CPU lacks: {sorted(missing)}"
        return forced, f"{forced} (forced by {ISA_ENV})"
    for name, (_, needs) in VARIANTS.items():
        if needs <= flags:
            return name, name
    return None, f"this CPU has none of the kernel's instruction sets ({sorted(VARIANTS)})"


def prebuilt() -> tuple[Path | None, str]:
    """The library a current build left in ``build_dir()``, or ``None`` and why; never compiles."""
    directory = build_dir()
    missing = missing_sources()
    if missing:
        return None, missing
    try:
        stamp = json.loads((directory / STAMP).read_text(encoding="utf-8"))
    except FileNotFoundError:
        return None, f"not built for this environment ({directory})"
    except (OSError, ValueError) as exc:
        return None, f"unreadable build stamp {directory / STAMP} ({exc})"
    if {k: stamp.get(k) for k in fingerprint()} != fingerprint():
        return None, f"the build in {directory} is stale (another source, torch or flags)"
    variant, why = choose_variant()
    if variant is None:
        return None, why
    name = (stamp.get("libraries") or {}).get(variant)
    if not name:
        return None, f"the build in {directory} has no {variant} library"
    library = directory / str(name)
    if not library.is_file():
        return None, f"{library} is missing"
    return library, f"built ({library}, {why})"


@contextlib.contextmanager
def _build_lock(directory: Path) -> Iterator[None]:
    """One builder per build folder at a time. An ``flock``, which the kernel releases when its
    holder dies, unlike torch's ``lock`` file: one left under it was left by a killed build."""
    with open(directory / ".ascend-mepic-build.flock", "w") as handle:
        fcntl.flock(handle, fcntl.LOCK_EX)
        try:
            for stale in [p for p in (directory / "lock", *directory.glob("*/lock")) if p.exists()]:
                logger.warning("removing %s, left by an interrupted build", stale)
                stale.unlink(missing_ok=True)
            yield
        finally:
            fcntl.flock(handle, fcntl.LOCK_UN)


def _unit_command(
    variant: str, source: Path, obj: Path, defines: tuple[str, ...] = ()
) -> list[str]:
    """The compiler call that makes one unit's object for a variant's library; ``defines`` (such
    as ``MEPIC_CPU_GUARD``, the tests' guard build, or ``MEPIC_AMX_EMULATE``) are added as
    ``-D`` flags, the same for every unit."""
    from torch.utils import cpp_extension

    flags, _ = VARIANTS[variant]
    abi = int(torch.compiled_with_cxx11_abi())
    includes = [arg for path in cpp_extension.include_paths() for arg in ("-isystem", path)]
    return [
        os.environ.get("CXX", "c++"), "-c", "-fPIC", "-std=c++20", *COMMON_CFLAGS, *flags,
        f"-DMEPIC_VARIANT={variant}", f"-D_GLIBCXX_USE_CXX11_ABI={abi}",
        *(f"-D{name}" for name in defines), *includes, str(source), "-o", str(obj),
    ]  # fmt: skip


def _link_command(variant: str, objects: Sequence[Path], output: Path) -> list[str]:
    """The compiler call that links a variant's objects (in ``SOURCES`` order) into its library."""
    from torch.utils import cpp_extension

    flags, _ = VARIANTS[variant]
    libs = [f"-L{path}" for path in cpp_extension.library_paths()]
    return [
        os.environ.get("CXX", "c++"), "-shared", "-fPIC", "-std=c++20", *COMMON_CFLAGS, *flags,
        *(str(obj) for obj in objects), *libs, "-lc10", "-ltorch_cpu", "-o", str(output),
    ]  # fmt: skip


def _run(command: list[str], verbose: bool) -> tuple[bool, str]:
    """Runs one compiler call: whether it succeeded, and what it printed."""
    if verbose:
        print(" ".join(command), file=sys.stderr)
    try:
        done = subprocess.run(command, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    except OSError as exc:  # no compiler
        return False, f"{command[0]}: {exc}"
    return done.returncode == 0, done.stdout


def _compile(
    targets: Sequence[tuple[str, Path, tuple[str, ...]]], verbose: bool = False
) -> dict[Path, str]:
    """Builds each target (variant, output, defines): every unit of every target is compiled to an
    object by its own compiler process, as many at once as this process may use CPUs (each
    target's attention unit first), then each target whose units all compiled is linked. The
    objects go to a private folder beside the output (removed after), so builds running at once
    never share one. Returns why each failed target failed (the file that did not compile and
    what the compiler said); a failed target leaves no output."""
    workers = max(1, len(os.sched_getaffinity(0)))
    failures: dict[Path, str] = {}
    with contextlib.ExitStack() as stack, ThreadPoolExecutor(workers) as pool:
        objects: dict[Path, list[Path]] = {}
        for _, output, _ in targets:
            temp = tempfile.TemporaryDirectory(
                prefix=f".{output.name}.", suffix=".objs", dir=output.parent
            )
            folder = Path(stack.enter_context(temp))
            objects[output] = [folder / f"{source.stem}.o" for source in SOURCES]
        compiles = {}
        for index, source in enumerate(SOURCES):  # unit by unit: the longest first
            for variant, output, defines in targets:
                command = _unit_command(variant, source, objects[output][index], defines)
                compiles[(output, source)] = pool.submit(_run, command, verbose)
        links = {}
        for variant, output, _ in targets:
            errors = []
            for source in SOURCES:
                ok, log = compiles[(output, source)].result()
                if not ok:
                    errors.append(f"{variant}: {source.name} did not compile:\n{log[-4000:]}")
            if errors:
                failures[output] = "\n".join(errors)
            else:
                command = _link_command(variant, objects[output], output)
                links[(variant, output)] = pool.submit(_run, command, verbose)
        for (variant, output), link in links.items():
            ok, log = link.result()
            if not ok:
                failures[output] = f"{variant}: {output.name} did not link:\n{log[-4000:]}"
                output.unlink(missing_ok=True)
    return failures


def compile_library(
    variant: str, output: Path, defines: tuple[str, ...] = (), verbose: bool = False
) -> Path:
    """Builds one variant's library into ``output`` (no stamp; raises on failure), with
    ``defines`` such as ``MEPIC_CPU_GUARD`` or ``MEPIC_AMX_EMULATE``: the tests' builds."""
    output = Path(output)
    failures = _compile([(variant, output, tuple(defines))], verbose)
    if failures:
        raise RuntimeError("the CPU kernel did not compile:\n" + "\n".join(failures.values()))
    return output


def _compile_command(variant: str, output: Path, defines: tuple[str, ...] = ()) -> list[str]:
    """One command building one variant's library into ``output`` (``compile_library`` in a
    fresh Python): for callers that run the build as a subprocess. In-process callers can call
    ``compile_library`` directly and save the interpreter's start."""
    return [
        sys.executable, "-m", "ascend_mepic.ops.cpu_kernel", "--library", str(output),
        "--variant", variant, *(f"-D{name}" for name in defines),
    ]  # fmt: skip


def build(verbose: bool = False) -> Path:
    """Compile every variant into ``build_dir()`` and stamp them (raises on failure); returns the
    library this CPU loads. For set-up (``make setup``, ``python -m ascend_mepic.ops.cpu_kernel``),
    never the serving path. Every variant is built wherever the compiler can (the variants'
    units compile side by side), so a build folder shared by machines serves each its best
    variant. Nothing is loaded while building: two variants register the same ops."""
    missing = missing_sources()
    if missing:
        raise FileNotFoundError(missing)
    directory = build_dir()
    directory.mkdir(parents=True, exist_ok=True)
    with _build_lock(directory):
        (directory / STAMP).unlink(missing_ok=True)
        # What a killed build left (every builder of this folder holds the lock).
        for stale in directory.glob(f".{EXT_NAME}_*.objs"):
            shutil.rmtree(stale, ignore_errors=True)
        for stale in directory.glob(f"{EXT_NAME}_*.so.*.tmp"):
            stale.unlink(missing_ok=True)
        pid = os.getpid()
        partials = {v: directory / f"{EXT_NAME}_{v}.so.{pid}.tmp" for v in VARIANTS}
        failures = _compile([(v, partial, ()) for v, partial in partials.items()], verbose)
        for variant, partial in partials.items():
            if partial not in failures:
                os.replace(partial, directory / f"{EXT_NAME}_{variant}.so")
        if failures:
            raise RuntimeError("the CPU kernel did not compile:\n" + "\n".join(failures.values()))
        stamp = {**fingerprint(), "libraries": {v: f"{EXT_NAME}_{v}.so" for v in VARIANTS}}
        tmp = directory / f"{STAMP}.{os.getpid()}"
        tmp.write_text(json.dumps(stamp, indent=1), encoding="utf-8")
        os.replace(tmp, directory / STAMP)
    library, why = prebuilt()
    if library is None:
        raise RuntimeError(f"built, but this CPU loads none of it: {why}")
    return library


def load(library: Path | None = None) -> bool:
    """Load the prebuilt kernel (once per process); False, with the reason logged once, when
    there is none for this source and environment. Never compiles. ``library`` loads that file
    instead of the prebuilt one (a test's guard build); it must come before any other load."""
    if "ok" in _state:
        if library is not None and _state.get("library") != library:
            raise RuntimeError(f"a CPU kernel is already loaded ({_state.get('library')})")
        return bool(_state["ok"])
    why = f"given ({library})"
    if library is None:
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
    _state["library"] = library
    return ok


def isa() -> str:
    """The paths the loaded kernel takes on this CPU (``"unavailable"`` without one), such as
    ``"avx512+amx"``: the variant loaded, and AMX where bf16 prefill uses it."""
    if not load():
        return "unavailable"
    return str(torch.ops.ascend_mepic.isa())


def set_amx(enabled: bool) -> bool:
    """Allow or forbid the AMX path (tests and benchmarks compare both); returns whether AMX is
    in use now (False where the CPU, the build or Linux does not offer it)."""
    if not load():
        return False
    return bool(torch.ops.ascend_mepic.set_amx(enabled))


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
    out: torch.Tensor | None = None,
) -> torch.Tensor:
    """Fused-RoPE paged attention on CPU; same contract and result as the torch reference.

    ``out`` (``[T, Hq, D]``, the query's dtype): written in place and returned, so the engine's
    output buffer takes the rows directly (no fresh tensor per call, no copy after)."""
    if not load():
        raise RuntimeError("the native CPU kernel is not available (see the error logged above)")
    for name, t in (("query", query), ("kv_cache", kv_cache)):
        if t.dtype not in SUPPORTED_DTYPES:
            raise TypeError(f"{name} dtype {t.dtype}: the CPU kernel takes float32 or bfloat16")
    cos_sin = meta.memo.get("cpu-cos-sin")
    if cos_sin is None:
        cos_sin = meta.memo["cpu-cos-sin"] = rope.cos_sin_cache.float().contiguous()
    splits = num_splits or decode_splits(meta, kv_cache.shape[3])
    args = (
        query,
        kv_cache,
        *meta.tensors(),
        cos_sin,
        bool(rope.is_neox_style),
        float(scale),
        splits,
    )
    if out is None:
        return torch.ops.ascend_mepic.rope_paged_attention(*args)
    torch.ops.ascend_mepic.rope_paged_attention_out(*args, out)
    return out


def main(argv: Sequence[str] | None = None) -> int:
    """Build (or confirm) the kernel for this environment and load it; with ``--library``, only
    build one variant's library into that file (the tests' guard and emulation builds)."""
    parser = argparse.ArgumentParser(prog="python -m ascend_mepic.ops.cpu_kernel")
    parser.add_argument("--force", action="store_true", help="rebuild even if the build is current")
    parser.add_argument("-v", "--verbose", action="store_true", help="print the compiler calls")
    parser.add_argument("--library", type=Path, help="build only this library file (no stamp)")
    parser.add_argument("--variant", choices=sorted(VARIANTS), help="the --library's variant")
    parser.add_argument("-D", dest="defines", action="append", default=[], metavar="NAME")
    args = parser.parse_args(argv)
    if args.library is not None or args.defines:
        if args.library is None or args.variant is None:
            parser.error("--library and --variant go together (and -D only with them)")
        try:
            compile_library(args.variant, args.library, tuple(args.defines), args.verbose)
        except Exception as exc:  # a compiler error, a missing toolchain
            print(f"ascend_mepic CPU kernel: NOT built: {exc}", file=sys.stderr)
            return 1
        print(f"ascend_mepic CPU kernel: built {args.library}")
        return 0
    logging.basicConfig(level=logging.INFO)
    try:
        library, _ = prebuilt()
        if library is None or args.force:
            library = build(verbose=args.verbose)
    except Exception as exc:  # a compiler error, a missing toolchain
        print(f"ascend_mepic CPU kernel: NOT built: {type(exc).__name__}: {exc}", file=sys.stderr)
        return 1
    ok = load()
    print(f"ascend_mepic CPU kernel: {'built and loaded' if ok else 'NOT loaded'} ({library})")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
