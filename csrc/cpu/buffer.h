// Scratch buffers: 64-byte aligned vectors (LineAligned, Buffer) grown across calls (grow), and
// the guard build's checks on them.
//
// Every path's per-thread and per-call scratch is a Buffer. In a guard build
// (-DMEPIC_CPU_GUARD) each is allocated to its exact size with a known pattern after it; the
// registry of live buffers is shared by all units and defined in guard.cpp.
#pragma once

#include <cstddef>
#include <cstdint>
#include <cstdlib>
#include <new>
#include <vector>

#include "config.h"

#ifdef MEPIC_CPU_GUARD
#include <cstdio>
#include <cstring>
#include <mutex>
#include <unordered_map>
#include <utility>

namespace mepic_cpu {
// Guard builds (tests/ops/test_cpu_kernel_guard.py compiles one; never a served library): every
// buffer is followed by GUARD_BYTES of a known pattern and allocated to its exact size (grow),
// and every call checks the guards of all live buffers before it returns. A write past a
// scratch buffer then fails the call that made it; in a normal build it lands in the
// allocation's slack or a neighbour and goes unseen until something crashes.
constexpr std::size_t GUARD_BYTES = 16384;  // more than 15 rows of 128 floats (an AMX tile's padding)
constexpr unsigned char GUARD_FILL = 0xA5;

struct GuardRegistry {
  std::mutex mu;
  std::unordered_map<const unsigned char*, std::size_t> live;  // guard start -> owner's bytes
};

// The registry of live buffers (guard.cpp).
GuardRegistry& guards();
bool guard_intact(const unsigned char* g);
// Live buffers whose guard was overwritten (and the size of the first), checked and re-armed.
std::pair<int64_t, std::size_t> guard_violations();
}  // namespace mepic_cpu
#endif

namespace mepic_cpu {
namespace {

// Buffers on 64-byte (cache line) boundaries: AMX tile rows and 512-bit vectors that straddle
// two lines load at half speed, and malloc's 16-byte alignment made timings vary by a third
// from one process to the next.
template <typename T>
struct LineAligned {
  using value_type = T;
  LineAligned() = default;
  template <typename U>
  LineAligned(const LineAligned<U>&) {}
  T* allocate(std::size_t n) {
    const std::size_t bytes = (n * sizeof(T) + 63) / 64 * 64;
#ifdef MEPIC_CPU_GUARD
    auto* p = static_cast<unsigned char*>(std::aligned_alloc(64, bytes + GUARD_BYTES));
    if (p == nullptr) throw std::bad_alloc();
    // The guard starts right after the n elements, inside the 64-byte rounding too.
    unsigned char* g = p + n * sizeof(T);
    std::memset(g, GUARD_FILL, GUARD_BYTES);
    GuardRegistry& r = guards();
    std::lock_guard<std::mutex> lock(r.mu);
    r.live[g] = n * sizeof(T);
    return reinterpret_cast<T*>(p);
#else
    void* p = std::aligned_alloc(64, bytes);
    if (p == nullptr) throw std::bad_alloc();
    return static_cast<T*>(p);
#endif
  }
  void deallocate(T* p, std::size_t n) {
#ifdef MEPIC_CPU_GUARD
    const unsigned char* g = reinterpret_cast<const unsigned char*>(p) + n * sizeof(T);
    {
      GuardRegistry& r = guards();
      std::lock_guard<std::mutex> lock(r.mu);
      r.live.erase(g);
    }
    if (!guard_intact(g)) {
      std::fprintf(stderr, "ascend_mepic CPU kernel (guard build): a write past a buffer of %zu "
                   "bytes found when it was freed\n", n * sizeof(T));
      std::abort();
    }
#else
    (void)n;
#endif
    std::free(p);
  }
  template <typename U>
  bool operator==(const LineAligned<U>&) const { return true; }
};
template <typename T>
using Buffer = std::vector<T, LineAligned<T>>;

// At least n elements (kept across calls, never shrunk). A guard build makes it exactly n,
// this call's need: a write past it then shows even after a larger earlier call.
template <typename T>
inline void grow(Buffer<T>& b, int64_t n) {
#ifdef MEPIC_CPU_GUARD
  if (static_cast<int64_t>(b.size()) != n) Buffer<T>(n).swap(b);
#else
  if (static_cast<int64_t>(b.size()) < n) b.resize(n);
#endif
}

}  // namespace
}  // namespace mepic_cpu
