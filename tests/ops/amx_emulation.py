"""When the CPU kernel's AMX emulation build can stand in for AMX (shared by the tests that
build it: test_cpu_kernel_amx_emulated.py and the guard build)."""

from __future__ import annotations

from ascend_mepic.ops import cpu_kernel

DEFINE = "MEPIC_AMX_EMULATE"


def can_emulate() -> tuple[bool, str]:
    """Whether this CPU runs the emulation build: the avx512 variant, with AVX512-BF16 for the
    conversions around the emulated tiles. The reason when not."""
    flags = cpu_kernel.cpu_flags()
    variant, why = cpu_kernel.choose_variant(flags)
    if variant != "avx512":
        return False, f"the emulation build is an avx512 library; this CPU takes {variant} ({why})"
    if "avx512_bf16" not in flags:
        return False, "the emulation build converts with AVX512-BF16, which this CPU lacks"
    return True, ""


def has_amx() -> bool:
    """The CPU reports AMX-BF16 (the kernel still needs Linux to grant the tile state)."""
    return "amx_bf16" in cpu_kernel.cpu_flags()
