"""The stage after ``ttadapter``: BiSheng IR's ``bishengir-compile`` (package ``ascendnpu-ir``
1.2.0, x86-64) from a launch's ``.ttadapter`` to the final HIVM IR, with the 910B's on-chip
memory planned and checked.

Why this stage: it is where a kernel that does not fit the unified buffer (UB) or L1 fails
(``ub overflow, requires N bits while 1572864 bits available``), which ``ttir``/``ttadapter``
never check. It is invoked as triton-ascend 3.2.0's own backend does for A2/A3
(``linalg_to_bin_enable_npu_compile_A2_A3``): the same ``mix_mode`` stripping (its own
``_parse_linalg_metadata``), the same flags from the launch's options (``backend_flags``), plus
``--save-temps`` (to keep the final HIVM, ``module.hivm.opt.mlir``) and
``--enable-memory-display`` (the compiler's own placement records, ``memory_info_*.json``; it
does not change the HIVM, ``test_memory_display_does_not_change_the_hivm``). The run then stops
where it would call CANN's ``hivmc`` (not shipped): that error, and no other, is the expected end.

A launch's planned use of a buffer is the highest end (offset + size) of the buffers placed in
it: read from the final HIVM's ``hivm.hir.pointer_cast`` placements (``placements``) and checked
against the compiler's own records (``display_placements``). Capacities are the target's, from
the HIVM module's ``dlti.target_system_spec`` (UB 192 KiB, L1 512 KiB on every 910B).
"""

from __future__ import annotations

import hashlib
import importlib.util
import json
import logging
import os
import re
import subprocess
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

logger = logging.getLogger(__name__)

# 910B2 (24 AI cores) and 910B3 (20): the two 910B parts vllm-ascend's A2 builds run on. Every
# launch is compiled for ARCH; B1, B2 and B4 give the same HIVM but for the core-count line (their
# target specs differ from B3's only there; test_other_910b_targets_plan_as_b3): with both B2
# and B3 compiled for all 144 launches, their placements were the same for every one.
ARCH = "Ascend910B3"
SAME_AS_ARCH = ("Ascend910B1", "Ascend910B2", "Ascend910B4")
# The only error an otherwise complete run may end with here (the last, external step).
HIVMC_MISSING = "External hivmc run fails"
# bishengir-compile 1.2.0 sometimes dies of a segmentation fault in a worker thread (about 1 run
# in 100 here, at random, a launch that compiled before compiling again after): a run killed by a
# signal says nothing of the kernel, so it is run again, this many times at most (counted in
# ``HivmReport.crashes``). Any other failure is final.
CRASH_RETRIES = 3
# The target spec's names for the buffers reported, by HIVM address space.
SPACES = {"ub": "UB_SIZE", "cbuf": "L1_SIZE", "cc": "L0C_SIZE"}
_BITS = {"i1": 1, "i8": 8, "i16": 16, "f16": 16, "bf16": 16, "i32": 32, "f32": 32, "i64": 64}


class HivmError(RuntimeError):
    """bishengir-compile failed before its last (``hivmc``) step: its own words."""


@dataclass(frozen=True)
class HivmReport:
    """One launch's final HIVM for one target: planned bytes and capacity per buffer."""

    arch: str
    kernel: str
    mix_mode: str
    used: dict[str, int]  # address space -> highest placed end, bytes
    capacity: dict[str, int]  # address space -> the target's size, bytes
    display: dict[str, int] = field(default_factory=dict)  # the compiler's own records
    seconds: float = 0.0
    crashes: int = 0  # runs killed by a signal before this one (CRASH_RETRIES)

    def fraction(self, space: str) -> float:
        return self.used.get(space, 0) / self.capacity[space]


def compiler_path() -> Path:
    """``bishengir-compile`` of the installed ``ascendnpu-ir`` (its Python ``compile()`` refuses
    to run without CANN's ``hivmc``, so the binary is called directly)."""
    spec = importlib.util.find_spec("ascendnpuir")
    if spec is None or not spec.submodule_search_locations:
        raise FileNotFoundError("ascendnpu-ir is not installed (requirements/ascend.lock)")
    return Path(spec.submodule_search_locations[0]) / "bin" / "bishengir-compile"


# triton-ascend 3.2.0's A2/A3 flags, by the launch metadata key each comes from (in its order);
# a key whose value is None adds nothing (as there).
_OPTION_FLAGS = (
    ("multibuffer", "--enable-auto-multi-buffer"),
    ("enable_auto_bind_sub_block", "--enable-auto-bind-sub-block"),
    ("enable_hivm_auto_cv_balance", "--enable-hivm-auto-cv-balance"),
    ("sync_solver", "--enable-hivm-graph-sync-solver"),
    ("unit_flag", "--enable-hivm-unit-flag-sync"),
    ("inject_barrier_all", "--enable-hivm-inject-barrier-all-sync"),
    ("inject_block_all", "--enable-hivm-inject-block-all-sync"),
    ("limit_auto_multi_buffer_only_for_local_buffer",
     "--limit-auto-multi-buffer-only-for-local-buffer"),
    ("set_workspace_multibuffer", "--set-workspace-multibuffer"),
    ("tile_mix_vector_loop", "--tile-mix-vector-loop"),
    ("tile_mix_cube_loop", "--tile-mix-cube-loop"),
    ("limit_auto_multi_buffer_of_local_buffer", "--limit-auto-multi-buffer-of-local-buffer"),
    ("disable_auto_inject_block_sync", "--disable-auto-inject-block-sync"),
)  # fmt: skip


def backend_flags(metadata: dict[str, Any], arch: str) -> list[str]:
    """The flags ``linalg_to_bin_enable_npu_compile_A2_A3`` passes for this launch, with
    triton-ascend's environment switches at their defaults (no sanitizer, no line info, no UB
    print, no auto-blockify). ``--reg-based`` replaces ``--enable-hivm-compile`` only for a
    register-based compiler, which 1.2.0 is not (its help has no ``reg-based``; asserted)."""
    flags = [f"--target={arch}"]
    flags += [f"{flag}={metadata[key]}" for key, flag in _OPTION_FLAGS
              if metadata.get(key) is not None]  # fmt: skip
    return flags + [
        "--enable-hfusion-compile=true",
        "--enable-hivm-compile=true",
        "--enable-triton-kernel-compile=true",
    ]


def strip_mix_mode(ttadapter: str) -> tuple[str, str]:
    """``(text, mix_mode)`` as the backend prepares the file: its own ``_parse_linalg_metadata``
    (which drops the ``mix_mode`` attribute bishengir-compile does not take)."""
    from triton.backends.ascend.compiler import _parse_linalg_metadata

    text, meta = _parse_linalg_metadata(ttadapter, {})
    return text, meta["mix_mode"]


def _constants(text: str) -> dict[str, int]:
    return {m[1]: int(m[2]) for m in re.finditer(r"(%c\w*) = arith\.constant (-?\d+) : i64", text)}


_PLACEMENT = re.compile(
    r"hivm\.hir\.pointer_cast\(([^)]*)\)[^\n:]*: memref<([0-9x]*)(\w+)(?:, [^#\n]*)?, "
    r"#hivm\.address_space<(\w+)>>"
)


def placements(hivm: str) -> dict[str, int]:
    """Highest end (bytes) of the buffers the planner placed, per address space: each
    ``pointer_cast(offset, ...)`` (one offset per multi-buffer copy) of a static ``memref``;
    size = elements x element bits."""
    consts = _constants(hivm)
    ends: dict[str, int] = {}
    for m in _PLACEMENT.finditer(hivm):
        offsets = [consts[a.strip()] for a in m[1].split(",")]
        elems = 1
        for d in m[2].rstrip("x").split("x") if m[2] else ():
            elems *= int(d)
        size = -(-elems * _BITS[m[3]] // 8)
        end = max(o + size for o in offsets)
        ends[m[4]] = max(ends.get(m[4], 0), end)
    return ends


def capacities(hivm: str) -> dict[str, int]:
    """The target's buffer sizes (bytes) as the HIVM module states them (in bits there)."""
    out = {}
    for space, name in SPACES.items():
        m = re.search(rf'"{name}", (\d+) : i32', hivm)
        if m is None:
            raise ValueError(f"no {name} in the HIVM module's target spec")
        out[space] = int(m[1]) // 8
    return out


def display_placements(workdir: Path) -> dict[str, int]:
    """The same figure from the compiler's own records (``--enable-memory-display``: offsets in
    bytes, extents in bits), successful plans only."""
    ends: dict[str, int] = {}
    for path in workdir.glob("memory_info_*.json"):
        for record in json.loads(path.read_text())["Record"]:
            if record.get("status") != "success":
                continue
            for buf in record["memory_info_array"]:
                space = re.search(r"address_space<(\w+)>", buf["buffer"])[1]
                end = max(o * 8 + buf["extent"] for o in buf["offset"]) // 8
                ends[space] = max(ends.get(space, 0), end)
    return ends


@dataclass(frozen=True)
class FinalHivm:
    """What one successful run left: the final HIVM text and the compiler's placement records."""

    hivm: str
    display: dict[str, int]
    seconds: float
    crashes: int


def _cache_path(text: str, flags: list[str]) -> Path | None:
    """Where a successful run of this compiler on this input with these flags is kept, or None
    with the cache off (``ASCEND_HIVM_CACHE=0``, as ``make test-ascend-compile`` runs).

    Why: the HIVM stage was about 250 of the 270 CPU-seconds of the compile test, every
    ``make test``, for the same launches. The run is a function of the compiler (its binary's
    SHA-256), the flags and the ``.ttadapter`` text, as Triton's own cache keys a ptxas run (the
    CUDA compile test's), so a changed kernel, launch or compiler compiles again; failures are
    never kept."""
    if os.environ.get("ASCEND_HIVM_CACHE", "1") == "0":
        return None
    binary = compiler_path()
    digest = hashlib.sha256()
    for part in (_file_digest(binary), *flags, text):
        digest.update(part.encode() + b"\0")
    root = Path(os.environ.get("XDG_CACHE_HOME", Path.home() / ".cache"))
    return root / "ascend_mepic" / "hivm" / f"{digest.hexdigest()}.json"


_DIGESTS: dict[Path, str] = {}


def _file_digest(path: Path) -> str:
    if path not in _DIGESTS:
        _DIGESTS[path] = hashlib.sha256(path.read_bytes()).hexdigest()
    return _DIGESTS[path]


def run_compiler(text: str, metadata: dict[str, Any], arch: str, display: bool = True) -> FinalHivm:
    """bishengir-compile on a prepared ``.ttadapter`` (``strip_mix_mode``) with the backend's
    flags, ``--save-temps`` and (``display``) ``--enable-memory-display``. Raises ``HivmError``
    with the compiler's output unless the only error is the missing ``hivmc`` and the final HIVM
    exists. A successful run is kept in the cache (``_cache_path``) and answered from it."""
    flags = [*backend_flags(metadata, arch), *(["--enable-memory-display"] if display else [])]
    cache = _cache_path(text, flags)
    if cache is not None and cache.exists():
        kept = json.loads(cache.read_text())
        return FinalHivm(kept["hivm"], kept["display"], kept["seconds"], kept["crashes"])
    run = _run_compiler(text, flags)
    if cache is not None:
        cache.parent.mkdir(parents=True, exist_ok=True)
        tmp = cache.with_suffix(f".{os.getpid()}.tmp")
        tmp.write_text(json.dumps({"hivm": run.hivm, "display": run.display,
                                   "seconds": run.seconds, "crashes": run.crashes}))  # fmt: skip
        tmp.replace(cache)  # whole or absent, with two compiles at a time
    return run


def _run_compiler(text: str, flags: list[str]) -> FinalHivm:
    arch = next((f.split("=", 1)[1] for f in flags if f.startswith("--target=")), "?")
    for crashes in range(CRASH_RETRIES + 1):
        with tempfile.TemporaryDirectory(prefix="hivm-") as tmp:
            work = Path(tmp)
            (work / "kernel.ttadapter.mlir").write_text(text)
            cmd = [str(compiler_path()), "kernel.ttadapter.mlir", *flags, f"--save-temps={work}",
                   "-o", str(work / "kernel")]  # fmt: skip
            start = time.perf_counter()
            # cwd: the memory records are written to the working directory. PATH without CANN:
            # the run ends where hivmc would be called, on any machine.
            run = subprocess.run(cmd, cwd=work, capture_output=True, text=True,
                                 env={**os.environ, "PATH": "/usr/bin:/bin"})  # fmt: skip
            seconds = time.perf_counter() - start
            out = run.stdout + run.stderr
            if run.returncode < 0 and crashes < CRASH_RETRIES:
                logger.warning("bishengir-compile %s: killed by signal %d; running it again",
                               arch, -run.returncode)  # fmt: skip
                continue
            errors = [ln for ln in out.splitlines() if "error:" in ln and HIVMC_MISSING not in ln]
            hivm_path = work / "module.hivm.opt.mlir"
            if run.returncode < 0 or errors or HIVMC_MISSING not in out or not hivm_path.exists():
                raise HivmError(f"bishengir-compile {arch} (exit {run.returncode}):\n{out}")
            return FinalHivm(hivm_path.read_text(), display_placements(work), seconds, crashes)
    raise AssertionError("unreachable")


def compile_hivm(ttadapter: str, metadata: dict[str, Any], arch: str) -> HivmReport:
    """One launch's ``.ttadapter`` to the final HIVM for ``arch``, and what it places where."""
    text, mix_mode = strip_mix_mode(ttadapter)
    kernel = re.search(r"func\.func\s+@(\w+)", text)[1]
    run = run_compiler(text, metadata, arch)
    report = HivmReport(arch, kernel, mix_mode, placements(run.hivm), capacities(run.hivm),
                        run.display, run.seconds, run.crashes)  # fmt: skip
    logger.debug("%s %s: %s in %.1f s", arch, kernel, report.used, run.seconds)
    return report


def ub_overflow(err: BaseException) -> tuple[int, int] | None:
    """The compiler's verdict that the unified buffer overflowed, if that is what failed:
    ``(required, available)`` bits from ``ub overflow, requires N bits while M bits available``,
    or ``(0, 0)`` where only its retry note (``Due to Ub overflow, ... still failed``) says so (a
    run seen once ended so, without the figure)."""
    text = str(err)
    found = re.search(r"ub overflow, requires (\d+) bits while (\d+) bits available", text)
    if found:
        return int(found[1]), int(found[2])
    return (0, 0) if re.search(r"Due to Ub overflow,.*still failed", text) else None
