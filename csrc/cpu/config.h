// The instruction sets this build compiles for, and what one translation unit defines for another.
//
// Every file of the kernel is compiled with its variant's flags (ops/cpu_kernel.py: avx512 or
// avx2, never -march=native); the macros below say which paths those flags allow, so that all
// units agree: MEPIC_CPU_AVX2 (AVX2 + FMA register tiles, avx2.h), MEPIC_CPU_AVX512 (16-lane
// tiles, avx512.h) and MEPIC_CPU_AMX (the AMX code, compiled function by function, amx.h; used
// only where the CPU has it, dispatch.cpp). The kernel's code lives in namespace mepic_cpu; what
// is private to a unit sits in an unnamed namespace inside it, as in the single file it came from.
#pragma once

#include <cstdint>

// Macros only: units without vector code (dispatch.cpp, guard.cpp) include this too, so the
// intrinsics header is left to those that use it (avx2.h, amx_emulate.h).
#if defined(__AVX2__) && defined(__FMA__)
#define MEPIC_CPU_AVX2 1
#endif
#if defined(__AVX512F__) && defined(MEPIC_CPU_AVX2)
#define MEPIC_CPU_AVX512 1
#endif
#if defined(__AVX512F__) && defined(__GNUC__) && !defined(__clang__) && __GNUC__ >= 11
#define MEPIC_CPU_AMX 1
#endif

namespace mepic_cpu {
#if defined(MEPIC_CPU_AMX) && defined(MEPIC_CPU_AVX512)
// Whether the AMX paths run: the CPU and Linux offer the tiles and set_amx has not forbidden
// them (dispatch.cpp; checked once, again after each set_amx).
bool amx_enabled();
#endif
}  // namespace mepic_cpu
