"""Compile the CUDA Triton kernels for a GPU this machine does not have, and read the result.

Triton compiles for any target without a device (``GPUTarget("cuda", 90, 32)``): its own
binder specialises a launch's arguments (dtypes, divisibility, constants) exactly as at a real
launch, the NVIDIA backend lowers it to PTX, and the ``ptxas`` shipped in the Triton wheel
assembles that for ``sm_90a`` or ``sm_80`` and reports registers and spills (``-v``). The
launches are the shipped ones: ``plan_launches`` of ``cuda_fallback.rope_paged_attention``
plans them from CPU tensors.

What is read from the output (``CompileReport``): registers per thread, spill stores and loads
(bytes), and the asynchronous global-to-shared copies of the kernel (``cp.async`` in the PTX;
TMA's ``cp.async.bulk`` counts too), which is how a K/V loop's loads are pipelined: a load under
a data-dependent branch is never turned into one, and ``num_stages`` then changes nothing.

Needs ``TRITON_INTERPRET`` unset when triton was first imported (interpreted kernels cannot be
compiled). Nothing here runs a kernel.
"""

from __future__ import annotations

import re
import subprocess
import tempfile
from dataclasses import dataclass
from pathlib import Path
from typing import Any

ARCHES = (90, 80)


@dataclass(frozen=True)
class CompileReport:
    kernel: str
    arch: str
    registers: int
    spill_stores: int
    spill_loads: int
    async_copies: int
    shared_bytes: int

    @property
    def spills(self) -> bool:
        return bool(self.spill_stores or self.spill_loads)


def sm_name(arch: int) -> str:
    """ptxas's name for a capability (``sm_90a`` for Hopper's wgmma/TMA instructions)."""
    return f"sm_{arch}{'a' if arch >= 90 else ''}"


def specialise(kernel: Any, args: tuple, kwargs: dict[str, Any], arch: int) -> tuple:
    """``(source, target, options)`` of one launch for ``sm_<arch>``, as ``JITFunction.run``
    derives them, without a driver or a device."""
    from triton.backends.compiler import GPUTarget
    from triton.compiler.compiler import ASTSource, make_backend
    from triton.runtime.jit import create_function_from_signature

    target = GPUTarget("cuda", arch, 32)
    backend = make_backend(target)
    binder = create_function_from_signature(kernel.signature, kernel.params, backend)
    bound, specialization, options = binder(*args, **kwargs)
    options, signature, constexprs, attrs = kernel._pack_args(
        backend, kwargs, bound, specialization, options
    )
    return ASTSource(kernel, signature, constexprs, attrs), target, options


def ptxas_stats(ptx: str, arch: int) -> tuple[int, int, int]:
    """(registers, spill store bytes, spill load bytes) from ``ptxas -v`` for ``sm_<arch>``, by
    the ptxas Triton itself assembles that arch with (the wheel ships CUDA 12.9's and 13.4's)."""
    from triton.backends.nvidia.compiler import get_ptxas

    with tempfile.TemporaryDirectory() as tmp:
        src = Path(tmp) / "k.ptx"
        src.write_text(ptx)
        done = subprocess.run(
            [get_ptxas(arch).path, f"-arch={sm_name(arch)}", "-v", str(src), "-o",
             str(Path(tmp) / "k.cubin")],
            capture_output=True, text=True, check=False,
        )  # fmt: skip
    log = done.stdout + done.stderr
    if done.returncode:
        raise RuntimeError(f"ptxas failed ({done.returncode}):\n{log}")
    regs = re.search(r"Used (\d+) registers", log)
    spill = re.search(r"(\d+) bytes spill stores, (\d+) bytes spill loads", log)
    if regs is None or spill is None:
        raise RuntimeError(f"cannot read ptxas -v's report:\n{log}")
    return int(regs.group(1)), int(spill.group(1)), int(spill.group(2))


def compile_launch(kernel: Any, args: tuple, kwargs: dict[str, Any], arch: int) -> CompileReport:
    """Compile one launch for ``sm_<arch>`` and read registers, spills and async copies."""
    import triton

    src, target, options = specialise(kernel, args, kwargs, arch)
    compiled = triton.compile(src, target=target, options=options.__dict__)
    ptx = compiled.asm["ptx"]
    registers, stores, loads = ptxas_stats(ptx, arch)
    return CompileReport(
        kernel=kernel.fn.__name__,
        arch=sm_name(arch),
        registers=registers,
        spill_stores=stores,
        spill_loads=loads,
        async_copies=len(re.findall(r"^\s*cp\.async\b", ptx, re.MULTILINE)),
        shared_bytes=int(compiled.metadata.shared),
    )
