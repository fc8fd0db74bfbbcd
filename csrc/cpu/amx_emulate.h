// The AMX emulation: the tile instructions done in scalar code, for test builds only
// (-DMEPIC_AMX_EMULATE), so that the AMX paths run and are checked on CPUs without AMX.
//
// Included by amx.h, where it replaces the tile intrinsics' names; never in a served library.
#pragma once

#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <cstring>

#include <immintrin.h>

#include "common.h"

namespace mepic_cpu {
namespace {

#ifdef MEPIC_AMX_EMULATE
// Test builds only (tests/ops/test_cpu_kernel_amx_emulated.py, and the guard build on CPUs
// without AMX): the six tile instructions amx.h uses, done in scalar code on a per-thread
// copy of the tile state, so that the AMX paths' packing, indexing, masking and buffer sizes
// are checked against the float64 oracle on any CPU with AVX512-BF16 (the conversions around
// the tiles run natively). It says nothing about speed. Semantics as the Intel SDM's
// pseudocode: a load zeroes the rows and bytes past the tile's configured shape; TDPBF16PS
// reads bfloat16 with denormals as zero and adds each pair's two products to the float32 sum
// in turn, rounding to nearest even and flushing denormal sums to zero. What it does not model
// (a palette other than 1, a tile used before its configuration or after the release, shapes
// that do not agree, a destination that is also a source) aborts, where the hardware faults.
namespace amx_emu {
struct State {
  alignas(64) unsigned char data[8][16][64];
  uint16_t colsb[8];
  uint8_t rows[8];
  bool configured = false;
};

inline State& state() {
  thread_local State s;
  return s;
}

[[noreturn]] inline void fault(const char* what) {
  std::fprintf(stderr, "ascend_mepic CPU kernel (AMX emulation): %s\n", what);
  std::abort();
}

inline State& tile(int t) {
  State& s = state();
  if (!s.configured) fault("tile instruction without a loaded configuration");
  if (t < 0 || t > 7 || s.rows[t] == 0 || s.colsb[t] == 0) fault("tile not configured");
  return s;
}

inline void loadconfig(const void* config) {
  const auto* c = static_cast<const unsigned char*>(config);
  if (c[0] != 1 || c[1] != 0) fault("palette other than 1, or a start row");
  State& s = state();
  for (int t = 0; t < 8; ++t) {
    std::memcpy(&s.colsb[t], c + 16 + 2 * t, sizeof(uint16_t));
    s.rows[t] = c[48 + t];
    if (s.colsb[t] > 64 || s.colsb[t] % 4 != 0 || s.rows[t] > 16) fault("tile beyond palette 1");
  }
  std::memset(s.data, 0, sizeof s.data);
  s.configured = true;
}

inline void release() { state() = State{}; }

inline void zero(int t) { std::memset(tile(t).data[t], 0, sizeof(State::data[0])); }

inline void load(int t, const void* base, int64_t stride) {
  State& s = tile(t);
  std::memset(s.data[t], 0, sizeof(State::data[0]));
  for (int r = 0; r < s.rows[t]; ++r)
    std::memcpy(s.data[t][r], static_cast<const char*>(base) + r * stride, s.colsb[t]);
}

inline void store(int t, void* base, int64_t stride) {
  const State& s = tile(t);
  for (int r = 0; r < s.rows[t]; ++r)
    std::memcpy(static_cast<char*>(base) + r * stride, s.data[t][r], s.colsb[t]);
}

inline float bf16_daz(const unsigned char* p) {
  uint16_t h;
  std::memcpy(&h, p, sizeof h);
  if ((h & 0x7f80) == 0) h &= 0x8000;  // denormal (or zero): signed zero
  return std::bit_cast<float>(static_cast<uint32_t>(h) << 16);
}

inline float ftz(float x) { return std::fpclassify(x) == FP_SUBNORMAL ? std::copysign(0.f, x) : x; }

inline void dpbf16ps(int c, int a, int b) {
  State& s = tile(c);
  tile(a);
  tile(b);
  if (c == a || c == b || a == b) fault("TDPBF16PS with a repeated tile");
  const int m_rows = s.rows[c], n_cols = s.colsb[c] / 4, k_pairs = s.colsb[a] / 4;
  if (s.rows[a] != m_rows || s.rows[b] != k_pairs || s.colsb[b] != s.colsb[c])
    fault("TDPBF16PS shapes do not agree");
  for (int m = 0; m < m_rows; ++m)
    for (int n = 0; n < n_cols; ++n) {
      float acc;
      std::memcpy(&acc, s.data[c][m] + 4 * n, sizeof acc);
      for (int k = 0; k < k_pairs; ++k) {
        acc = ftz(acc + bf16_daz(s.data[a][m] + 4 * k) * bf16_daz(s.data[b][k] + 4 * n));
        acc = ftz(acc + bf16_daz(s.data[a][m] + 4 * k + 2) * bf16_daz(s.data[b][k] + 4 * n + 2));
      }
      std::memcpy(s.data[c][m] + 4 * n, &acc, sizeof acc);
    }
}
}  // namespace amx_emu

// The intrinsics' names, so that the paths below read the same in both builds.
#undef _tile_loadd
#undef _tile_stream_loadd
#undef _tile_stored
#undef _tile_zero
#undef _tile_dpbf16ps
#define _tile_loadconfig(config) amx_emu::loadconfig(config)
#define _tile_release() amx_emu::release()
#define _tile_loadd(t, base, stride) amx_emu::load(t, base, stride)
#define _tile_stream_loadd(t, base, stride) amx_emu::load(t, base, stride)
#define _tile_stored(t, base, stride) amx_emu::store(t, base, stride)
#define _tile_zero(t) amx_emu::zero(t)
#define _tile_dpbf16ps(c, a, b) amx_emu::dpbf16ps(c, a, b)
#endif

}  // namespace
}  // namespace mepic_cpu
