// Which paths this library takes on this CPU: whether AMX is used (CPUID and Linux's grant of
// the tile state, and the set_amx switch), and isa(), which names the variant and its paths.
//
// The variant itself (avx512 or avx2) is chosen by the loader (ops/cpu_kernel.py) from the
// CPU's flags; within the avx512 library, AMX is decided here at the first call.
#include <string>

#include "config.h"
#include "ops.h"

#if defined(MEPIC_CPU_AMX) && defined(MEPIC_CPU_AVX512)
#include <atomic>
#include <cpuid.h>
#include <sys/syscall.h>
#include <unistd.h>

namespace mepic_cpu {
namespace {

std::atomic<int> g_amx_state{-1};  // -1 unknown, 0 unavailable or off, 1 on
bool g_amx_allowed = true;

// The CPU has AMX-BF16, AMX-TILE and AVX512-BF16, and Linux grants this process the tile
// state (arch_prctl ARCH_REQ_XCOMP_PERM for XTILEDATA; without it the first tile instruction
// raises SIGILL).
bool amx_supported() {
  unsigned a, b, c, dx;
#ifdef MEPIC_AMX_EMULATE
  // The tiles are emulated: only AVX512-BF16, for the conversions around them.
  return __get_cpuid_count(7, 1, &a, &b, &c, &dx) && (a >> 5 & 1);
#endif
  if (!__get_cpuid_count(7, 0, &a, &b, &c, &dx)) return false;
  const bool tiles = (dx >> 22 & 1) && (dx >> 24 & 1);  // AMX-BF16, AMX-TILE
  if (!tiles || !__get_cpuid_count(7, 1, &a, &b, &c, &dx)) return false;
  if (!(a >> 5 & 1)) return false;  // AVX512-BF16
  constexpr long ARCH_REQ_XCOMP_PERM = 0x1023, XFEATURE_XTILEDATA = 18;
  return syscall(SYS_arch_prctl, ARCH_REQ_XCOMP_PERM, XFEATURE_XTILEDATA) == 0;
}

}  // namespace

bool amx_enabled() {
  int state = g_amx_state.load(std::memory_order_relaxed);
  if (state < 0) {
    state = g_amx_allowed && amx_supported() ? 1 : 0;
    g_amx_state.store(state);
  }
  return state == 1;
}

}  // namespace mepic_cpu
#endif

#define MEPIC_STR2(x) #x
#define MEPIC_STR(x) MEPIC_STR2(x)

// The paths this library takes on this CPU (what `bench kernels` reports beside vLLM's): the
// variant it was built as, "+amx" where bfloat16 prefill runs on AMX tiles.
std::string isa() {
#ifdef MEPIC_VARIANT
  std::string name = MEPIC_STR(MEPIC_VARIANT);
#else
  std::string name = "unnamed build";
#endif
#ifndef MEPIC_CPU_AVX2
  name += " (generic loops)";
#endif
#ifdef MEPIC_CPU_GUARD
  name += " (guard build)";
#endif
#if defined(MEPIC_CPU_AMX) && defined(MEPIC_CPU_AVX512)
  if (mepic_cpu::amx_enabled()) name += "+amx";
#endif
#ifdef MEPIC_AMX_EMULATE
  name += " (AMX emulated, a test build)";
#endif
  return name;
}

// Allows or forbids the AMX path; returns whether it is in use now.
bool set_amx(bool enabled) {
#if defined(MEPIC_CPU_AMX) && defined(MEPIC_CPU_AVX512)
  mepic_cpu::g_amx_allowed = enabled;
  mepic_cpu::g_amx_state.store(-1);
  return mepic_cpu::amx_enabled();
#else
  (void)enabled;
  return false;
#endif
}
