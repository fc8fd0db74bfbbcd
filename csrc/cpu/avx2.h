// The AVX2 + FMA micro-kernels (8-lane register tiles of ROWS rows): scores, in place or with
// keys rotated in registers, P.V, and the vector exp, max and sum of the online softmax (with
// their 16-lane forms where the build has AVX-512F).
//
// Compiled where the variant's flags give AVX2 and FMA (both variants); attend.h falls back to
// portable loops otherwise. Part of the attention unit (see common.h).
#pragma once

#include "common.h"

#ifdef MEPIC_CPU_AVX2
#include <immintrin.h>
#endif

namespace mepic_cpu {
namespace {

#ifdef MEPIC_CPU_AVX2

// Sums of four vectors, one float each: [sum a, sum b, sum c, sum d].
inline __m128 sum4(__m256 a, __m256 b, __m256 c, __m256 d) {
  const __m256 ab = _mm256_hadd_ps(a, b), cd = _mm256_hadd_ps(c, d);
  const __m256 abcd = _mm256_hadd_ps(ab, cd);
  return _mm_add_ps(_mm256_castps256_ps128(abcd), _mm256_extractf128_ps(abcd, 1));
}

// s[r][c] = q[r] . k[c] for ROWS rows and keys [0, n), n rounded up to 4 (k rows beyond n are
// zero). q rows and k rows are d floats apart, d a multiple of 8.
inline void score_tile(const float* __restrict q, const float* __restrict k, int64_t n,
                       int64_t d, float* __restrict s) {
  for (int64_t c = 0; c < n; c += 4) {
    __m256 acc[ROWS][4];
    for (int r = 0; r < ROWS; ++r)
      for (int j = 0; j < 4; ++j) acc[r][j] = _mm256_setzero_ps();
    const float* kc = k + c * d;
    for (int64_t x = 0; x < d; x += 8) {
      const __m256 k0 = _mm256_loadu_ps(kc + x), k1 = _mm256_loadu_ps(kc + d + x),
                   k2 = _mm256_loadu_ps(kc + 2 * d + x), k3 = _mm256_loadu_ps(kc + 3 * d + x);
      for (int r = 0; r < ROWS; ++r) {
        const __m256 qr = _mm256_loadu_ps(q + r * d + x);
        acc[r][0] = _mm256_fmadd_ps(qr, k0, acc[r][0]);
        acc[r][1] = _mm256_fmadd_ps(qr, k1, acc[r][1]);
        acc[r][2] = _mm256_fmadd_ps(qr, k2, acc[r][2]);
        acc[r][3] = _mm256_fmadd_ps(qr, k3, acc[r][3]);
      }
    }
    for (int r = 0; r < ROWS; ++r)
      _mm_storeu_ps(s + r * KEY_CHUNK + c, sum4(acc[r][0], acc[r][1], acc[r][2], acc[r][3]));
  }
}

// Eight floats from eight float32 or bfloat16 elements (bfloat16 is float32's upper half).
inline __m256 load8(const float* x) { return _mm256_loadu_ps(x); }
inline __m256 load8(const at::BFloat16* x) {
  const __m128i h = _mm_loadu_si128(reinterpret_cast<const __m128i*>(x));
  return _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(h), 16));
}

// acc[r] += sum_c p[r][c] * v[c] for ROWS rows over keys [0, n); v rows are v_stride apart,
// read in place (bfloat16 widened in registers). The head dimension goes 32 floats at a time
// (8 when d is not a multiple of 32), with the tile's accumulators in registers across all n keys.
template <int W, typename VT>
inline void pv_slice(const float* __restrict p, const VT* __restrict v, int64_t v_stride,
                     int64_t n, int64_t d, int64_t x0, float* __restrict acc_rows) {
  __m256 acc[ROWS][W];
  for (int r = 0; r < ROWS; ++r)
    for (int j = 0; j < W; ++j) acc[r][j] = _mm256_loadu_ps(acc_rows + r * d + x0 + 8 * j);
  for (int64_t c = 0; c < n; ++c) {
    __m256 vv[W];
    for (int j = 0; j < W; ++j) vv[j] = load8(v + c * v_stride + x0 + 8 * j);
    for (int r = 0; r < ROWS; ++r) {
      const __m256 pr = _mm256_broadcast_ss(p + r * KEY_CHUNK + c);
      for (int j = 0; j < W; ++j) acc[r][j] = _mm256_fmadd_ps(pr, vv[j], acc[r][j]);
    }
  }
  for (int r = 0; r < ROWS; ++r)
    for (int j = 0; j < W; ++j) _mm256_storeu_ps(acc_rows + r * d + x0 + 8 * j, acc[r][j]);
}

// Scores of ROWS rows against keys [0, n) read in place from the cache (rows ks apart, any
// dtype) and rotated in registers, NeoX halves: key c is turned by cos/sin row c (the caller
// has turned the rows back by the chunk's first position). n is rounded up to 4; keys past n
// repeat the last one (their scores are never read). half = d / 2, a multiple of 8.
template <typename KT>
inline void score_tile_rope(const float* __restrict q, const KT* __restrict k,
                            const KT* __restrict v, int64_t ks, int64_t in_block,
                            const float* __restrict cos_sin, int64_t cs_stride, int64_t n,
                            int64_t d, float* __restrict s) {
  const int64_t half = d / 2;
  for (int64_t c = 0; c < n; c += 4) {
    // K and V rows 8 keys ahead, while they are in this block (rows contiguous).
    for (int64_t a = c + 8; a < std::min<int64_t>(c + 12, in_block); ++a)
      for (int64_t b = 0; b < d * static_cast<int64_t>(sizeof(KT)); b += 64) {
        __builtin_prefetch(reinterpret_cast<const char*>(k + a * ks) + b, 0, 3);
        __builtin_prefetch(reinterpret_cast<const char*>(v + a * ks) + b, 0, 3);
      }
    __m256 acc[ROWS][4];
    for (int r = 0; r < ROWS; ++r)
      for (int j = 0; j < 4; ++j) acc[r][j] = _mm256_setzero_ps();
    const KT* kr[4];
    const float* cr[4];
    for (int j = 0; j < 4; ++j) {
      const int64_t key = std::min<int64_t>(c + j, n - 1);
      kr[j] = k + key * ks;
      cr[j] = cos_sin + key * cs_stride;
    }
    for (int64_t x = 0; x < half; x += 8) {
      for (int j = 0; j < 4; ++j) {
        const __m256 lo = load8(kr[j] + x), hi = load8(kr[j] + half + x);
        const __m256 cv = _mm256_loadu_ps(cr[j] + x), sv = _mm256_loadu_ps(cr[j] + half + x);
        const __m256 rlo = _mm256_fnmadd_ps(hi, sv, _mm256_mul_ps(lo, cv));
        const __m256 rhi = _mm256_fmadd_ps(lo, sv, _mm256_mul_ps(hi, cv));
        for (int r = 0; r < ROWS; ++r) {
          acc[r][j] = _mm256_fmadd_ps(_mm256_loadu_ps(q + r * d + x), rlo, acc[r][j]);
          acc[r][j] = _mm256_fmadd_ps(_mm256_loadu_ps(q + r * d + half + x), rhi, acc[r][j]);
        }
      }
    }
    for (int r = 0; r < ROWS; ++r)
      _mm_storeu_ps(s + r * KEY_CHUNK + c, sum4(acc[r][0], acc[r][1], acc[r][2], acc[r][3]));
  }
}

// exp(x) for eight x <= 0: exp_nonpositive's method, in AVX2.
inline __m256 exp_nonpositive8(__m256 x) {
  const __m256 t = _mm256_mul_ps(_mm256_max_ps(x, _mm256_set1_ps(-87.f)),
                                 _mm256_set1_ps(1.4426950408889634f));
  const __m256 fi = _mm256_round_ps(t, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
  const __m256 f = _mm256_sub_ps(t, fi);
  __m256 p = _mm256_set1_ps(0.00015404f);
  p = _mm256_fmadd_ps(p, f, _mm256_set1_ps(0.00133336f));
  p = _mm256_fmadd_ps(p, f, _mm256_set1_ps(0.00961813f));
  p = _mm256_fmadd_ps(p, f, _mm256_set1_ps(0.05550411f));
  p = _mm256_fmadd_ps(p, f, _mm256_set1_ps(0.24022652f));
  p = _mm256_fmadd_ps(p, f, _mm256_set1_ps(0.69314718f));
  p = _mm256_fmadd_ps(p, f, _mm256_set1_ps(1.f));
  const __m256i e = _mm256_slli_epi32(
      _mm256_add_epi32(_mm256_cvtps_epi32(fi), _mm256_set1_epi32(127)), 23);
  return _mm256_mul_ps(p, _mm256_castsi256_ps(e));
}

inline float hmax(__m256 v) {
  __m128 m = _mm_max_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
  m = _mm_max_ps(m, _mm_movehl_ps(m, m));
  m = _mm_max_ss(m, _mm_shuffle_ps(m, m, 1));
  return _mm_cvtss_f32(m);
}

inline float hsum(__m256 v) {
  __m128 m = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
  m = _mm_add_ps(m, _mm_movehl_ps(m, m));
  m = _mm_add_ss(m, _mm_shuffle_ps(m, m, 1));
  return _mm_cvtss_f32(m);
}

#ifdef __AVX512F__
// exp(x) for sixteen x <= 16: exp_nonpositive's method in AVX-512 (scalef applies 2^i). DEGREE 6
// for float32 results (relative error about 1e-7); 5 where P is rounded to bfloat16 (about 3e-6,
// far below bfloat16's 4e-3).
template <int DEGREE = 6>
inline __m512 exp16(__m512 x) {
  static_assert(DEGREE == 5 || DEGREE == 6, "degree 5 or 6");
  const __m512 t = _mm512_mul_ps(_mm512_max_ps(x, _mm512_set1_ps(-87.f)),
                                 _mm512_set1_ps(1.4426950408889634f));
  const __m512 fi = _mm512_roundscale_ps(t, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
  const __m512 f = _mm512_sub_ps(t, fi);
  __m512 p = _mm512_set1_ps(0.00133336f);
  if constexpr (DEGREE == 6) p = _mm512_fmadd_ps(_mm512_set1_ps(0.00015404f), f, p);
  p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(0.00961813f));
  p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(0.05550411f));
  p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(0.24022652f));
  p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(0.69314718f));
  p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(1.f));
  return _mm512_scalef_ps(p, fi);
}
#endif

inline float max_of(const float* x, int64_t n) {
#ifdef __AVX512F__
  __m512 acc16 = _mm512_set1_ps(NEG_INF);
  int64_t c16 = 0;
  for (; c16 + 16 <= n; c16 += 16) acc16 = _mm512_max_ps(acc16, _mm512_loadu_ps(x + c16));
  if (c16 < n)
    acc16 = _mm512_max_ps(
        acc16, _mm512_mask_loadu_ps(acc16, static_cast<__mmask16>((1u << (n - c16)) - 1u), x + c16));
  return _mm512_reduce_max_ps(acc16);
#endif
  __m256 acc = _mm256_set1_ps(NEG_INF);
  int64_t c = 0;
  for (; c + 8 <= n; c += 8) acc = _mm256_max_ps(acc, _mm256_loadu_ps(x + c));
  float mx = hmax(acc);
  for (; c < n; ++c) mx = std::max(mx, x[c]);
  return mx;
}

// x[c] = exp(x[c] - shift) for c < n; returns their sum.
inline float exp_shifted(float* x, int64_t n, float shift) {
#ifdef __AVX512F__
  const __m512 sh16 = _mm512_set1_ps(shift);
  __m512 acc16 = _mm512_setzero_ps();
  for (int64_t c16 = 0; c16 < n; c16 += 16) {
    const __mmask16 mk = static_cast<__mmask16>((1u << std::min<int64_t>(n - c16, 16)) - 1u);
    const __m512 e = _mm512_maskz_mov_ps(
        mk, exp16(_mm512_sub_ps(_mm512_maskz_loadu_ps(mk, x + c16), sh16)));
    _mm512_mask_storeu_ps(x + c16, mk, e);
    acc16 = _mm512_add_ps(acc16, e);
  }
  return _mm512_reduce_add_ps(acc16);
#endif
  const __m256 sh = _mm256_set1_ps(shift);
  __m256 acc = _mm256_setzero_ps();
  int64_t c = 0;
  for (; c + 8 <= n; c += 8) {
    const __m256 e = exp_nonpositive8(_mm256_sub_ps(_mm256_loadu_ps(x + c), sh));
    _mm256_storeu_ps(x + c, e);
    acc = _mm256_add_ps(acc, e);
  }
  float total = hsum(acc);
  for (; c < n; ++c) total += (x[c] = exp_nonpositive(x[c] - shift));
  return total;
}

template <typename VT>
inline void pv_tile(const float* p, const VT* v, int64_t v_stride, int64_t n, int64_t d,
                    float* acc_rows) {
  int64_t x0 = 0;
  for (; x0 + 32 <= d; x0 += 32) pv_slice<4>(p, v, v_stride, n, d, x0, acc_rows);
  for (; x0 < d; x0 += 8) pv_slice<1>(p, v, v_stride, n, d, x0, acc_rows);
}
#endif

}  // namespace
}  // namespace mepic_cpu
