// What every path of the attention kernel shares: tiling constants, the scalar RoPE, exp and
// row helpers, the call's metadata and its work items (plan_work), and each thread's scratch.
//
// Part of the attention unit (rope_paged_attention.cpp, which includes it with avx2.h,
// avx512.h, amx.h and attend.h): internal linkage, as when it was one file, so that the
// compiler sees and inlines the same code.
#pragma once

#include <c10/util/BFloat16.h>  // at::BFloat16, all these headers need of torch

#include <algorithm>
#include <bit>
#include <cmath>
#include <cstdint>
#include <limits>
#include <vector>

#include "buffer.h"
#include "config.h"

namespace mepic_cpu {
namespace {

// 64 queries (times the GQA group) per item: every K chunk and V slice a core brings into L1
// serves that many rows (32 and 16 were 5-15% slower in prefill on an AVX-512/AMX Xeon).
constexpr int64_t QUERY_TILE = 64;
constexpr int64_t KEY_CHUNK = 64;
constexpr int64_t AMX_STEP = 256;  // keys per softmax step of the AMX path

constexpr float NEG_INF = -std::numeric_limits<float>::infinity();

template <typename T>
inline void load_row(const T* __restrict src, float* __restrict dst, int64_t d) {
#pragma omp simd
  for (int64_t i = 0; i < d; ++i) dst[i] = static_cast<float>(src[i]);
}

// Reads row `src` (D elements), rotates it with a cos/sin row (cos in [0, D/2), sin in
// [D/2, D)) and writes the float result to `dst`, in one pass. BACK turns it the other way:
// R(-p) instead of R(p) for the row's position p.
template <typename T, bool BACK = false>
inline void rotate_into(const T* __restrict src, float* __restrict dst, const float* __restrict cs,
                        int64_t d, bool neox) {
  const int64_t half = d / 2;
  const float* cosv = cs;
  const float* sinv = cs + half;
  if (neox) {
#pragma omp simd
    for (int64_t i = 0; i < half; ++i) {
      const float a = static_cast<float>(src[i]), b = static_cast<float>(src[i + half]);
      const float sn = BACK ? -sinv[i] : sinv[i];
      dst[i] = a * cosv[i] - b * sn;
      dst[i + half] = b * cosv[i] + a * sn;
    }
  } else {
    for (int64_t i = 0; i < half; ++i) {
      const float a = static_cast<float>(src[2 * i]), b = static_cast<float>(src[2 * i + 1]);
      const float sn = BACK ? -sinv[i] : sinv[i];
      dst[2 * i] = a * cosv[i] - b * sn;
      dst[2 * i + 1] = b * cosv[i] + a * sn;
    }
  }
}

// exp(x) for x <= 0 (scores minus their running maximum), in a form the compiler vectorises
// (libm's expf is a scalar call): 2^(x log2 e) = 2^i * 2^f with i the nearest integer, so
// |f| <= 1/2, and 2^f by its degree-6 Taylor polynomial (relative error about 1e-7, float
// rounding level). Inputs below -87 are clamped: their weight is below float precision anyway.
inline float exp_nonpositive(float x) {
  const float t = std::max(x, -87.f) * 1.4426950408889634f;
  const float fi = std::nearbyint(t);
  const float f = t - fi;
  const float p =
      1.f + f * (0.69314718f +
                 f * (0.24022652f +
                      f * (0.05550411f + f * (0.00961813f + f * (0.00133336f + f * 0.00015404f)))));
  return p * std::bit_cast<float>((static_cast<int32_t>(fi) + 127) << 23);
}

inline float dot(const float* __restrict a, const float* __restrict b, int64_t d) {
  float s = 0.f;
#pragma omp simd reduction(+ : s)
  for (int64_t i = 0; i < d; ++i) s += a[i] * b[i];
  return s;
}

inline void axpy(float alpha, const float* __restrict x, float* __restrict y, int64_t d) {
#pragma omp simd
  for (int64_t i = 0; i < d; ++i) y[i] += alpha * x[i];
}

// dst[x] = src[x] * scale for x < d, rounded to the output's dtype. The bfloat16 rounding
// (nearest even, NaN kept) is written out so that it vectorises: c10's scalar conversion
// per element cost as much as a whole AMX prefill's score tiles.
inline void store_scaled(float* __restrict dst, const float* __restrict src, float scale,
                         int64_t d) {
#pragma omp simd
  for (int64_t x = 0; x < d; ++x) dst[x] = src[x] * scale;
}

inline void store_scaled(at::BFloat16* __restrict dst, const float* __restrict src, float scale,
                         int64_t d) {
  uint16_t* bits = reinterpret_cast<uint16_t*>(dst);
#pragma omp simd
  for (int64_t x = 0; x < d; ++x) {
    const float f = src[x] * scale;
    const uint32_t u = std::bit_cast<uint32_t>(f);
    const uint16_t rounded = static_cast<uint16_t>((u + 0x7fffu + ((u >> 16) & 1u)) >> 16);
    bits[x] = f != f ? static_cast<uint16_t>(0x7fc0) : rounded;
  }
}

struct Meta {
  const int32_t* loc;
  const int32_t* q_pos;
  const int32_t* q_idx;
  const int32_t* tables;
  const int32_t* nblocks;
  const int32_t* first;
  const int32_t* vstart;
  const int32_t* vend;
  int64_t table_stride;
  int64_t block_size;
  int64_t num_seqs;
};

struct WorkItem {
  int32_t seq, kv_head, q_begin, q_end, entry_begin, entry_end, split;
};

std::vector<WorkItem> plan_work(const Meta& m, int64_t hkv, int64_t splits) {
  std::vector<WorkItem> work;
  for (int64_t s = 0; s < m.num_seqs; ++s) {
    const int32_t q0 = m.loc[s], q1 = m.loc[s + 1];
    if (q0 == q1) continue;
    const int32_t nb = m.nblocks[s];
    const int64_t parts = (q1 - q0 == 1) ? std::max<int64_t>(1, std::min<int64_t>(splits, nb)) : 1;
    for (int64_t h = 0; h < hkv; ++h) {
      for (int32_t t = q0; t < q1; t += QUERY_TILE) {
        const int32_t t1 = std::min<int32_t>(t + QUERY_TILE, q1);
        for (int64_t p = 0; p < parts; ++p) {
          const int32_t e0 = static_cast<int32_t>(nb * p / parts);
          const int32_t e1 = static_cast<int32_t>(nb * (p + 1) / parts);
          work.push_back({static_cast<int32_t>(s), static_cast<int32_t>(h), t, t1, e0, e1,
                          parts > 1 ? static_cast<int32_t>(p) : -1});
        }
      }
    }
  }
  return work;
}

// Rough cost of an item, for ordering: its queries times the keys the last of them can see.
inline int64_t work_cost(const WorkItem& w, const Meta& m) {
  const int64_t last_key = static_cast<int64_t>(m.q_idx[w.q_end - 1]) + 1;
  const int64_t keys = std::min<int64_t>(last_key, static_cast<int64_t>(w.entry_end) * m.block_size) -
                       static_cast<int64_t>(w.entry_begin) * m.block_size;
  return (w.q_end - w.q_begin) * std::max<int64_t>(keys, 0);
}

// Scratch of one thread: rotated queries, a chunk of rotated keys and of values (row-major),
// the chunk's scores, and its work item's outputs. Each thread keeps its own across calls,
// grown to the largest call so far and never shrunk: allocating (and zero-filling) it per call
// cost about 20 us of page faults, more than a short decode step's attention.
struct Scratch {
  Buffer<float> q, qc, k, kt, v, s, amx_s, own, own_mx, own_sm;
  Buffer<uint16_t> amx_p;
  Buffer<int64_t> visible;  // per row of a tile: keys of the chunk it sees
  void reserve(int64_t rows, int64_t d) {
    const int64_t tiles = (rows + 15) / 16 * 16;
    for (Buffer<float>* b : {&q, &qc, &own}) grow(*b, rows * d);
    for (Buffer<float>* b : {&k, &kt, &v}) grow(*b, KEY_CHUNK * d);
    for (Buffer<float>* b : {&own_mx, &own_sm}) grow(*b, rows);
    grow(visible, rows);
    grow(s, rows * KEY_CHUNK);
    grow(amx_s, tiles * AMX_STEP);
    grow(amx_p, tiles * AMX_STEP);
  }
};

// This thread's scratch, sized for `rows` rows of d.
Scratch& thread_scratch(int64_t rows, int64_t d) {
  static thread_local Scratch scratch;
  scratch.reserve(rows, d);
  return scratch;
}

// Score and P.V micro-kernels. Each works on a tile of ROWS rows (queries times the GQA group
// sharing the KV head, padded with zero rows), so every rotated key and every value row loaded
// into registers serves all the tile's rows: the small-GEMM tiling vLLM's CPU kernels use.
#ifdef __AVX512F__
constexpr int64_t ROWS = 4;  // 32 vector registers: GQA groups of 4 (most 7B models) fused
#else
constexpr int64_t ROWS = 3;
#endif

}  // namespace
}  // namespace mepic_cpu
