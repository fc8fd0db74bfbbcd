// The guard build's registry of live scratch buffers, and its negative control (guard_selftest).
//
// Guard builds only (-DMEPIC_CPU_GUARD; tests/ops/test_cpu_kernel_guard.py compiles one, never a
// served library): buffer.h puts a pattern after every buffer and records it here; every
// attention call checks them all before it returns (guard_violations). In other builds this
// unit is empty (and includes nothing).
#ifdef MEPIC_CPU_GUARD
#include "buffer.h"
#include "ops.h"

namespace mepic_cpu {

// Never destroyed: thread_local scratch is freed after static destructors may have run.
GuardRegistry& guards() {
  static GuardRegistry* registry = new GuardRegistry;
  return *registry;
}

bool guard_intact(const unsigned char* g) {
  for (std::size_t i = 0; i < GUARD_BYTES; ++i)
    if (g[i] != GUARD_FILL) return false;
  return true;
}

std::pair<int64_t, std::size_t> guard_violations() {
  GuardRegistry& r = guards();
  std::lock_guard<std::mutex> lock(r.mu);
  int64_t broken = 0;
  std::size_t first = 0;
  for (auto& [g, bytes] : r.live)
    if (!guard_intact(g)) {
      if (broken++ == 0) first = bytes;
      std::memset(const_cast<unsigned char*>(g), GUARD_FILL, GUARD_BYTES);
    }
  return {broken, first};
}

}  // namespace mepic_cpu

// The guard build's negative control: writes one element past a fresh grown buffer and returns
// whether the check that every call runs sees it (the buffer is then freed re-armed).
bool guard_selftest() {
  mepic_cpu::Buffer<float> b;
  mepic_cpu::grow(b, 37);
  b.data()[37] = 1.f;  // deliberately past the end
  return mepic_cpu::guard_violations().first == 1;
}
#endif
