// The AVX-512 micro-kernels (16-lane tiles): keys transposed per chunk for outer-product scores,
// P.V, bfloat16 values widened in split order, the online softmax of a tile's four rows at
// once, and the fused decode tile that rotates keys in registers (heads of 64 and 128).
//
// Compiled in the avx512 variant only (MEPIC_CPU_AVX512); on top of avx2.h. Part of the
// attention unit (see common.h).
#pragma once

#include "avx2.h"

namespace mepic_cpu {
namespace {

#ifdef MEPIC_CPU_AVX512
static_assert(KEY_CHUNK == 64, "the AVX-512 score tile covers 64 keys as four 16-lane vectors");

// kt[x][c] = k[c][x]: a chunk's rotated keys (n rows of d) as d rows of KEY_CHUNK, keys past n
// zero, so that scores are outer products (a query element broadcast times 16 keys) with no
// horizontal sums.
inline void transpose_keys(const float* __restrict k, int64_t n, int64_t d,
                           float* __restrict kt) {
  if (d % 16 == 0) {  // 16 x 16 blocks in registers; keys past n are zero rows
    for (int64_t c0 = 0; c0 < KEY_CHUNK; c0 += 16)
      for (int64_t x0 = 0; x0 < d; x0 += 16) {
        __m512 r[16], t[16];
        for (int i = 0; i < 16; ++i)
          r[i] = c0 + i < n ? _mm512_loadu_ps(k + (c0 + i) * d + x0) : _mm512_setzero_ps();
        for (int i = 0; i < 16; i += 2) {  // pairs of rows: 2 x 2 blocks of floats
          t[i] = _mm512_unpacklo_ps(r[i], r[i + 1]);
          t[i + 1] = _mm512_unpackhi_ps(r[i], r[i + 1]);
        }
        for (int i = 0; i < 16; i += 4) {  // 4 x 4 blocks
          const __m512d a = _mm512_castps_pd(t[i]), b = _mm512_castps_pd(t[i + 1]);
          const __m512d c = _mm512_castps_pd(t[i + 2]), e = _mm512_castps_pd(t[i + 3]);
          r[i] = _mm512_castpd_ps(_mm512_unpacklo_pd(a, c));
          r[i + 1] = _mm512_castpd_ps(_mm512_unpackhi_pd(a, c));
          r[i + 2] = _mm512_castpd_ps(_mm512_unpacklo_pd(b, e));
          r[i + 3] = _mm512_castpd_ps(_mm512_unpackhi_pd(b, e));
        }
        for (int i = 0; i < 4; ++i)  // 128-bit lanes: rows i, i+4, i+8, i+12 -> 8 x 8
          for (int h = 0; h < 2; ++h) {
            t[8 * h + i] = _mm512_shuffle_f32x4(r[i + 8 * h], r[i + 4 + 8 * h], 0x88);
            t[8 * h + i + 4] = _mm512_shuffle_f32x4(r[i + 8 * h], r[i + 4 + 8 * h], 0xDD);
          }
        for (int i = 0; i < 8; ++i) {  // 16 x 16
          r[i] = _mm512_shuffle_f32x4(t[i], t[i + 8], 0x88);
          r[i + 8] = _mm512_shuffle_f32x4(t[i], t[i + 8], 0xDD);
        }
        // r[m]: column x0 + m of the block, keys c0 .. c0 + 15.
        for (int i = 0; i < 16; ++i) _mm512_storeu_ps(kt + (x0 + i) * KEY_CHUNK + c0, r[i]);
      }
    return;
  }
  for (int64_t x = 0; x < d; ++x) {
    float* row = kt + x * KEY_CHUNK;
    for (int64_t c = 0; c < n; ++c) row[c] = k[c * d + x];
    for (int64_t c = n; c < KEY_CHUNK; ++c) row[c] = 0.f;
  }
}

// s[r][c] = q[r] . k[c] for ROWS rows and the chunk's first 16 J keys, from the transposed
// chunk (J < 4: a chunk on the causal diagonal, whose later keys no row of the tile sees; their
// scores are left unwritten). D: the head size as a constant (0: d at run time), so that the
// loop's trip count is known and the accumulators stay in registers.
template <int J, int D>
inline void score_tile_t512_j(const float* __restrict q, const float* __restrict kt, int64_t d,
                              float* __restrict s) {
  const int64_t dd = D > 0 ? D : d;
  __m512 acc[ROWS][J];
  for (int r = 0; r < ROWS; ++r)
    for (int j = 0; j < J; ++j) acc[r][j] = _mm512_setzero_ps();
  for (int64_t x = 0; x < dd; ++x) {
    const float* kx = kt + x * KEY_CHUNK;
    __m512 k[J];
    for (int j = 0; j < J; ++j) k[j] = _mm512_loadu_ps(kx + 16 * j);
    for (int r = 0; r < ROWS; ++r) {
      const __m512 qr = _mm512_set1_ps(q[r * dd + x]);
      for (int j = 0; j < J; ++j) acc[r][j] = _mm512_fmadd_ps(qr, k[j], acc[r][j]);
    }
  }
  for (int r = 0; r < ROWS; ++r)
    for (int j = 0; j < J; ++j) _mm512_storeu_ps(s + r * KEY_CHUNK + 16 * j, acc[r][j]);
}

template <int D>
inline void score_tile_t512_d(const float* q, const float* kt, int64_t d, float* s, int64_t reach) {
  switch ((reach + 15) / 16) {
    case 1: return score_tile_t512_j<1, D>(q, kt, d, s);
    case 2: return score_tile_t512_j<2, D>(q, kt, d, s);
    case 3: return score_tile_t512_j<3, D>(q, kt, d, s);
    default: return score_tile_t512_j<4, D>(q, kt, d, s);
  }
}

// Scores of ROWS rows against a transposed chunk's keys [0, reach) (at least; 16 at a time).
inline void score_tile_t512(const float* __restrict q, const float* __restrict kt, int64_t d,
                            float* __restrict s, int64_t reach = KEY_CHUNK) {
  if (d == 64) return score_tile_t512_d<64>(q, kt, d, s, reach);
  if (d == 128) return score_tile_t512_d<128>(q, kt, d, s, reach);
  score_tile_t512_d<0>(q, kt, d, s, reach);
}

inline __m512 load16(const float* x) { return _mm512_loadu_ps(x); }
inline __m512 load16(const at::BFloat16* x) {
  const __m256i h = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(x));
  return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(h), 16));
}

// rotate_into with 16-lane vectors for NeoX halves that are a multiple of 16 (bfloat16
// widened in registers); otherwise rotate_into itself.
template <typename T>
inline void rotate_row(const T* __restrict src, float* __restrict dst, const float* __restrict cs,
                       int64_t d, bool neox) {
  const int64_t half = d / 2;
  if (!neox || half % 16 != 0) {
    rotate_into(src, dst, cs, d, neox);
    return;
  }
  for (int64_t i = 0; i < half; i += 16) {
    const __m512 a = load16(src + i), b = load16(src + half + i);
    const __m512 c = _mm512_loadu_ps(cs + i), sn = _mm512_loadu_ps(cs + half + i);
    _mm512_storeu_ps(dst + i, _mm512_fnmadd_ps(b, sn, _mm512_mul_ps(a, c)));
    _mm512_storeu_ps(dst + half + i, _mm512_fmadd_ps(a, sn, _mm512_mul_ps(b, c)));
  }
}

// 32 elements of a K row as two 16-lane float vectors. bfloat16 is float32's upper half, so
// one 64-byte load holds the 32 elements in pairs: shifting widens the even ones and masking
// the odd ones, two instructions where widening in order takes four. The vectors are then in
// "split order" (evens, then odds, per group of 32); float32 rows are in order already.
inline void load32(const at::BFloat16* x, __m512& a, __m512& b) {
  const __m512i w = _mm512_loadu_si512(x);
  a = _mm512_castsi512_ps(_mm512_slli_epi32(w, 16));
  b = _mm512_castsi512_ps(_mm512_and_si512(w, _mm512_set1_epi32(static_cast<int>(0xFFFF0000u))));
}
inline void load32(const float* x, __m512& a, __m512& b) {
  a = _mm512_loadu_ps(x);
  b = _mm512_loadu_ps(x + 16);
}

// Whether P.V keeps a row's outputs in split order (load32's, per group of 32): bfloat16 values
// whose head is whole groups of 32, widened two instructions per 32 elements instead of four.
// attend() turns the rows back (from_split_order) before they leave it.
template <typename VT>
constexpr bool split_v(int64_t d) {
  return std::is_same_v<VT, at::BFloat16> && d % 32 == 0;
}

// Each group of 32 floats of src (d a multiple of 32) reordered into dst: its first 16 by
// index vector lo, its last 16 by hi (permutex2var indices into the group). src may be dst.
inline void permute32(const float* src, float* dst, int64_t d, __m512i lo, __m512i hi) {
  for (int64_t g = 0; g < d; g += 32) {
    const __m512 a = _mm512_loadu_ps(src + g), b = _mm512_loadu_ps(src + g + 16);
    _mm512_storeu_ps(dst + g, _mm512_permutex2var_ps(a, lo, b));
    _mm512_storeu_ps(dst + g + 16, _mm512_permutex2var_ps(a, hi, b));
  }
}

// A row of d floats (d a multiple of 32) from split order back to head order.
inline void from_split_order(float* row, int64_t d) {
  permute32(row, row, d,
            _mm512_set_epi32(23, 7, 22, 6, 21, 5, 20, 4, 19, 3, 18, 2, 17, 1, 16, 0),
            _mm512_set_epi32(31, 15, 30, 14, 29, 13, 28, 12, 27, 11, 26, 10, 25, 9, 24, 8));
}

// pv_slice with 16-lane vectors: W x 16 head elements from x0, ROWS rows, keys [0, n); in
// split order if SPLIT (bfloat16 values, W even).
template <int W, typename VT, int R = ROWS, bool SPLIT = false>
inline void pv_slice512(const float* __restrict p, const VT* __restrict v, int64_t v_stride,
                        int64_t n, int64_t d, int64_t x0, float* __restrict acc_rows) {
  if (n <= 0) return;
  __m512 acc[R][W];
  for (int r = 0; r < R; ++r)
    for (int j = 0; j < W; ++j) acc[r][j] = _mm512_loadu_ps(acc_rows + r * d + x0 + 16 * j);
  for (int64_t c = 0; c < n; ++c) {
    __m512 vv[W];
    if constexpr (SPLIT) {
      static_assert(std::is_same_v<VT, at::BFloat16> && W % 2 == 0, "split order: bf16 pairs");
      for (int j = 0; j < W; j += 2) load32(v + c * v_stride + x0 + 16 * j, vv[j], vv[j + 1]);
    } else {
      for (int j = 0; j < W; ++j) vv[j] = load16(v + c * v_stride + x0 + 16 * j);
    }
    for (int r = 0; r < R; ++r) {
      const __m512 pr = _mm512_set1_ps(p[r * KEY_CHUNK + c]);
      for (int j = 0; j < W; ++j) acc[r][j] = _mm512_fmadd_ps(pr, vv[j], acc[r][j]);
    }
  }
  for (int r = 0; r < R; ++r)
    for (int j = 0; j < W; ++j) _mm512_storeu_ps(acc_rows + r * d + x0 + 16 * j, acc[r][j]);
}

// R < ROWS: only the tile's first R rows are live (decode of a GQA group of 3), the rest
// skipped rather than multiplied by zero.
template <typename VT, int R = ROWS>
inline void pv_tile512(const float* p, const VT* v, int64_t v_stride, int64_t n, int64_t d,
                       float* acc_rows) {
  int64_t x0 = 0;
  if constexpr (std::is_same_v<VT, at::BFloat16>) {
    if (split_v<VT>(d)) {
      for (; x0 + 64 <= d; x0 += 64)
        pv_slice512<4, VT, R, true>(p, v, v_stride, n, d, x0, acc_rows);
      if (x0 < d) pv_slice512<2, VT, R, true>(p, v, v_stride, n, d, x0, acc_rows);  // 32 left
      return;
    }
  }
  for (; x0 + 64 <= d; x0 += 64) pv_slice512<4, VT, R>(p, v, v_stride, n, d, x0, acc_rows);
  for (; x0 + 16 <= d; x0 += 16) pv_slice512<1, VT, R>(p, v, v_stride, n, d, x0, acc_rows);
  for (; x0 < d; x0 += 8) pv_slice<1>(p, v, v_stride, n, d, x0, acc_rows);
}

// dst = a float row (d a multiple of 32) in load32's order for KT. Dot products do not depend
// on the order, so query rows and cos/sin rows put in the keys' order meet them lane by lane.
template <typename KT>
inline void to_split_order(const float* __restrict src, float* __restrict dst, int64_t d) {
  if constexpr (std::is_same_v<KT, float>) {
    std::copy(src, src + d, dst);
  } else {
    permute32(src, dst, d,  // the evens, then the odds
              _mm512_set_epi32(30, 28, 26, 24, 22, 20, 18, 16, 14, 12, 10, 8, 6, 4, 2, 0),
              _mm512_set_epi32(31, 29, 27, 25, 23, 21, 19, 17, 15, 13, 11, 9, 7, 5, 3, 1));
  }
}

// Sums of a 4 x 4 tile of vectors: lane 4r + j of the result is the sum of acc[r][j]'s lanes.
// Per row, the four keys' vectors are folded into one (a partial sum per 128-bit lane); then
// the four rows' 128-bit lanes are summed across.
// Rows from R on are known zero (not reduced).
template <int R = 4>
inline __m512 sum_tile(const __m512 (&acc)[4][4]) {
  __m512 w[4];
  for (int r = R; r < 4; ++r) w[r] = _mm512_setzero_ps();
  for (int r = 0; r < R; ++r) {
    const __m512 u = _mm512_add_ps(_mm512_unpacklo_ps(acc[r][0], acc[r][1]),
                                   _mm512_unpackhi_ps(acc[r][0], acc[r][1]));
    const __m512 v = _mm512_add_ps(_mm512_unpacklo_ps(acc[r][2], acc[r][3]),
                                   _mm512_unpackhi_ps(acc[r][2], acc[r][3]));
    w[r] = _mm512_add_ps(_mm512_shuffle_ps(u, v, _MM_SHUFFLE(1, 0, 1, 0)),
                         _mm512_shuffle_ps(u, v, _MM_SHUFFLE(3, 2, 3, 2)));
  }
  const __m512 t01 = _mm512_add_ps(_mm512_shuffle_f32x4(w[0], w[1], _MM_SHUFFLE(1, 0, 1, 0)),
                                   _mm512_shuffle_f32x4(w[0], w[1], _MM_SHUFFLE(3, 2, 3, 2)));
  const __m512 t23 = _mm512_add_ps(_mm512_shuffle_f32x4(w[2], w[3], _MM_SHUFFLE(1, 0, 1, 0)),
                                   _mm512_shuffle_f32x4(w[2], w[3], _MM_SHUFFLE(3, 2, 3, 2)));
  return _mm512_add_ps(_mm512_shuffle_f32x4(t01, t23, _MM_SHUFFLE(2, 0, 2, 0)),
                       _mm512_shuffle_f32x4(t01, t23, _MM_SHUFFLE(3, 1, 3, 1)));
}

// [op-reduce(a), op-reduce(b), op-reduce(c), op-reduce(d)] of four 16-lane vectors, in one
// shuffle tree (four separate reductions cost three times the shuffles and serialise).
template <typename Op>
inline __m128 reduce4(__m512 a, __m512 b, __m512 c, __m512 d, Op op) {
  const __m512 ab = op(_mm512_unpacklo_ps(a, b), _mm512_unpackhi_ps(a, b));
  const __m512 cd = op(_mm512_unpacklo_ps(c, d), _mm512_unpackhi_ps(c, d));
  const __m512 w = op(_mm512_shuffle_ps(ab, cd, _MM_SHUFFLE(1, 0, 1, 0)),
                      _mm512_shuffle_ps(ab, cd, _MM_SHUFFLE(3, 2, 3, 2)));
  const __m256 h = op(_mm512_castps512_ps256(w),
                      _mm256_castpd_ps(_mm512_extractf64x4_pd(_mm512_castps_pd(w), 1)));
  return op(_mm256_castps256_ps128(h), _mm256_extractf128_ps(h, 1));
}

// The online-softmax step of one chunk for a tile of four rows (s: their KEY_CHUNK scores;
// vis[u]: keys visible to row u, 0 for padding rows and rows whose queries precede the chunk).
// The rows' maxima, rescalings and sums go through the tile at once, in vectors of four: row
// by row, the horizontal reductions and a scalar exp per row were a quarter of a float32
// prefill. Scores become probabilities, zero past each row's visible keys.
constexpr float LAZY_RESCALE = 8.f;

inline void softmax_tile512(float* __restrict s, const int64_t* vis, float* __restrict row_max,
                            float* __restrict row_sum, float* __restrict acc_rows, int64_t d) {
  const auto vmax = [](auto x, auto y) {
    if constexpr (sizeof(x) == 64) return _mm512_max_ps(x, y);
    else if constexpr (sizeof(x) == 32) return _mm256_max_ps(x, y);
    else return _mm_max_ps(x, y);
  };
  const auto vadd = [](auto x, auto y) {
    if constexpr (sizeof(x) == 64) return _mm512_add_ps(x, y);
    else if constexpr (sizeof(x) == 32) return _mm256_add_ps(x, y);
    else return _mm_add_ps(x, y);
  };
  const __m512 neg = _mm512_set1_ps(NEG_INF);
  __mmask16 keep[4][4];
  for (int u = 0; u < 4; ++u)
    for (int j = 0; j < 4; ++j) {
      const int64_t left = std::clamp<int64_t>(vis[u] - 16 * j, 0, 16);
      keep[u][j] = static_cast<__mmask16>((1u << left) - 1u);
    }
  // Row u's scores become exp(score - mx), zero past its visible keys (no exp for vectors
  // wholly past them: a short chunk); returns their sum, per lane.
  const auto exp_row = [&](int u, float mx) {
    __m512 total = _mm512_setzero_ps();
    float* sr = s + u * KEY_CHUNK;
    const __m512 m = _mm512_set1_ps(mx);
    for (int j = 0; j < 4; ++j) {
      if (keep[u][j] == 0) {
        _mm512_storeu_ps(sr + 16 * j, _mm512_setzero_ps());
        continue;
      }
      const __m512 e = _mm512_maskz_mov_ps(
          keep[u][j], exp16(_mm512_sub_ps(_mm512_loadu_ps(sr + 16 * j), m)));
      _mm512_storeu_ps(sr + 16 * j, e);
      total = _mm512_add_ps(total, e);
    }
    return total;
  };
  // Lazy rescaling: while every row's scores stay within LAZY_RESCALE of its running maximum,
  // exponentiate against that maximum as it is. The exps then wait on no reduction (only the
  // check, which the branch predicts), and nothing is rescaled; p <= e^8, far from float32's
  // range. A row's first keys, or a score above the bound, take the exact step below.
  bool lazy = true;
  for (int u = 0; u < 4; ++u)
    if (vis[u] > 0 && row_max[u] == NEG_INF) lazy = false;
  if (lazy) {
    __mmask16 over = 0;
    for (int u = 0; u < 4; ++u) {
      if (vis[u] <= 0) continue;
      const __m512 bound = _mm512_set1_ps(row_max[u] + LAZY_RESCALE);
      for (int j = 0; j < 4; ++j)
        if (keep[u][j] != 0)
          over |= _mm512_mask_cmp_ps_mask(keep[u][j], _mm512_loadu_ps(s + u * KEY_CHUNK + 16 * j),
                                          bound, _CMP_GT_OQ);
    }
    if (over == 0) {
      __m512 total[4];
      for (int u = 0; u < 4; ++u) total[u] = exp_row(u, vis[u] > 0 ? row_max[u] : 0.f);
      const __m128 sums = reduce4(total[0], total[1], total[2], total[3], vadd);
      _mm_storeu_ps(row_sum, _mm_add_ps(_mm_loadu_ps(row_sum), sums));
      return;
    }
  }
  __m512 peak[4];
  for (int u = 0; u < 4; ++u) {
    peak[u] = neg;
    for (int j = 0; j < 4; ++j)
      peak[u] = _mm512_max_ps(
          peak[u], _mm512_mask_loadu_ps(neg, keep[u][j], s + u * KEY_CHUNK + 16 * j));
  }
  // Rows with no visible key keep their maximum (-inf until a key shows up).
  const __m128 old_max = _mm_loadu_ps(row_max);
  const __m128 new_max = _mm_max_ps(old_max, reduce4(peak[0], peak[1], peak[2], peak[3], vmax));
  // alpha = exp(old - new): 0 on a row's first keys (old = -inf), 1 where the maximum held.
  const __m128 diff = _mm_sub_ps(old_max, new_max);
  __m128 alpha = _mm512_castps512_ps128(exp16(_mm512_castps128_ps512(diff)));
  alpha = _mm_blendv_ps(alpha, _mm_setzero_ps(), _mm_cmpeq_ps(old_max, _mm_set1_ps(NEG_INF)));
  alpha = _mm_blendv_ps(alpha, _mm_set1_ps(1.f), _mm_cmpeq_ps(diff, _mm_setzero_ps()));
  alignas(16) float a[4], nm[4];
  _mm_store_ps(a, alpha);
  _mm_store_ps(nm, new_max);
  __m512 total[4];
  for (int u = 0; u < 4; ++u) {
    if (vis[u] <= 0) {  // no visible key: probabilities 0, sums and outputs as they were
      a[u] = 1.f;
      total[u] = exp_row(u, 0.f);
      continue;
    }
    if (a[u] != 1.f) {
      const __m512 av = _mm512_set1_ps(a[u]);
      float* acc = acc_rows + u * d;
      int64_t x = 0;
      for (; x + 16 <= d; x += 16)
        _mm512_storeu_ps(acc + x, _mm512_mul_ps(av, _mm512_loadu_ps(acc + x)));
      for (; x < d; ++x) acc[x] *= a[u];
    }
    total[u] = exp_row(u, nm[u]);
  }
  const __m128 sums = reduce4(total[0], total[1], total[2], total[3], vadd);
  _mm_storeu_ps(row_sum, _mm_fmadd_ps(_mm_loadu_ps(row_sum), _mm_load_ps(a), sums));
  _mm_storeu_ps(row_max, new_max);
}

// score_tile_rope with 16-lane vectors, for heads of D = 64 or 128 (NeoX halves, whole groups
// of 32): four keys at a time, each rotated in registers and dotted with the ROWS rows, the 16
// (row, key) sums reduced together (sum_tile). q rows (D floats apart) and the cos/sin rows
// (row c for key c, D floats apart) are in split order for KT. D is a template parameter so
// that every row offset is an immediate: with a run-time d the compiler ran out of
// general-purpose registers and spilled the key pointers.
static_assert(ROWS == 4, "sum_tile reduces four rows");
template <typename KT, int D, int R = ROWS>
inline void score_tile_rope512(const float* __restrict q, const KT* __restrict k,
                               const KT* __restrict v, int64_t ks, int64_t in_block,
                               const float* __restrict cs, int64_t n, float* __restrict s,
                               const KT* k_next = nullptr, const KT* v_next = nullptr,
                               int64_t n_next = 0) {
  constexpr int HALF = D / 2;
  constexpr int ROW_BYTES = D * static_cast<int>(sizeof(KT));
  for (int64_t c = 0; c < n; c += 4) {
    // K and V rows 8 keys ahead: in this block, else the next block's first ones.
    for (int64_t a = c + 8; a < c + 12; ++a) {
      const KT* kp = k + a * ks;
      const KT* vp = v + a * ks;
      if (a >= in_block) {
        if (a - in_block >= n_next) break;
        kp = k_next + (a - in_block) * ks;
        vp = v_next + (a - in_block) * ks;
      }
      for (int b = 0; b < ROW_BYTES; b += 64) {
        __builtin_prefetch(reinterpret_cast<const char*>(kp) + b, 0, 3);
        __builtin_prefetch(reinterpret_cast<const char*>(vp) + b, 0, 3);
      }
    }
    __m512 acc[4][4];
    for (int r = 0; r < 4; ++r)
      for (int j = 0; j < 4; ++j) acc[r][j] = _mm512_setzero_ps();
    const KT* kb[4];
    const float* cb[4];
    for (int j = 0; j < 4; ++j) {
      const int64_t key = std::min<int64_t>(c + j, n - 1);  // past n: the last key again
      kb[j] = k + key * ks;
      cb[j] = cs + key * D;
    }
    for (int x = 0; x < HALF; x += 32) {
#pragma GCC unroll 4
      for (int j = 0; j < 4; ++j) {
        const KT* kr = kb[j];
        const float* cr = cb[j];
        __m512 lo_a, lo_b, hi_a, hi_b;
        load32(kr + x, lo_a, lo_b);
        load32(kr + HALF + x, hi_a, hi_b);
        const __m512 c_a = _mm512_loadu_ps(cr + x), c_b = _mm512_loadu_ps(cr + x + 16);
        const __m512 s_a = _mm512_loadu_ps(cr + HALF + x);
        const __m512 s_b = _mm512_loadu_ps(cr + HALF + x + 16);
        const __m512 rlo_a = _mm512_fnmadd_ps(hi_a, s_a, _mm512_mul_ps(lo_a, c_a));
        const __m512 rlo_b = _mm512_fnmadd_ps(hi_b, s_b, _mm512_mul_ps(lo_b, c_b));
        const __m512 rhi_a = _mm512_fmadd_ps(lo_a, s_a, _mm512_mul_ps(hi_a, c_a));
        const __m512 rhi_b = _mm512_fmadd_ps(lo_b, s_b, _mm512_mul_ps(hi_b, c_b));
        for (int r = 0; r < R; ++r) {  // rows past R stay zero
          const float* qr = q + r * D;
          __m512 t = _mm512_fmadd_ps(_mm512_loadu_ps(qr + x), rlo_a, acc[r][j]);
          t = _mm512_fmadd_ps(_mm512_loadu_ps(qr + x + 16), rlo_b, t);
          t = _mm512_fmadd_ps(_mm512_loadu_ps(qr + HALF + x), rhi_a, t);
          acc[r][j] = _mm512_fmadd_ps(_mm512_loadu_ps(qr + HALF + x + 16), rhi_b, t);
        }
      }
    }
    const __m512 sums = sum_tile<R>(acc);
    _mm_storeu_ps(s + c, _mm512_extractf32x4_ps(sums, 0));
    _mm_storeu_ps(s + KEY_CHUNK + c, _mm512_extractf32x4_ps(sums, 1));
    _mm_storeu_ps(s + 2 * KEY_CHUNK + c, _mm512_extractf32x4_ps(sums, 2));
    _mm_storeu_ps(s + 3 * KEY_CHUNK + c, _mm512_extractf32x4_ps(sums, 3));
  }
}
#endif

}  // namespace
}  // namespace mepic_cpu
