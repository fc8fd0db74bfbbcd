// The AMX paths (bfloat16 on tiles): the tile configuration, keys rotated and packed into tile
// order once per call (pack_amx), prefill on the tiles (attend_amx) and decode of wide GQA
// groups (attend_amx_decode).
//
// Compiled in the avx512 variant, function by function (MEPIC_AMX_FN), and run only where
// dispatch.cpp finds AMX; -DMEPIC_AMX_EMULATE swaps the tile instructions for amx_emulate.h's.
// Part of the attention unit (see common.h).
#pragma once

#include "avx512.h"
#if defined(MEPIC_CPU_AMX) && defined(MEPIC_CPU_AVX512) && defined(MEPIC_AMX_EMULATE)
#include "amx_emulate.h"
#endif

namespace mepic_cpu {
namespace {

#if defined(MEPIC_CPU_AMX) && defined(MEPIC_CPU_AVX512)
// ---------------------------------------------------------------------------------------------
// AMX path (bfloat16 query and cache, query tiles of many rows: prefill and chunked prefill).
//
// AMX multiplies 16x32 bfloat16 tiles into 16x16 float32 tiles, an order of magnitude more
// work per instruction than AVX-512, but its B operand must be in "VNNI" order (pairs along
// the reduced dimension interleaved). Un-rotated K cannot go to the tiles as it is, so each
// sequence's visible keys are rotated once per call, per KV head, at their logical positions,
// and packed with its values into tile order (pack_amx); every query tile of the sequence then
// reads the packed copy (attend_amx). Rotation stays at read: nothing rotated is written to
// the cache, and the copy lives for one call. Scores S = Q K^T and P V run on the tiles; the
// online softmax between them in AVX-512, on float32, with P rounded to bfloat16 for P V (what
// the reference's bfloat16 SDPA does too).
#define MEPIC_AMX_FN __attribute__((target("amx-tile,amx-bf16,avx512bf16")))

constexpr int64_t AMX_KEYS = 64;  // keys per step: four 16-key score tiles, two 32-key P V steps

struct alignas(64) TileConfig {
  uint8_t palette = 1;
  uint8_t start_row = 0;
  uint8_t reserved[14] = {};
  uint16_t colsb[16] = {};
  uint8_t rows[16] = {};
};

MEPIC_AMX_FN inline void amx_configure() {
  TileConfig cfg;
  for (int t = 0; t < 8; ++t) {
    cfg.colsb[t] = 64;
    cfg.rows[t] = 16;
  }
  // GCC 12's _tile_loadconfig tells the compiler it reads 8 bytes of the 64-byte config, so the
  // stores above may be dropped as dead (a config with other rows, built the same way, lost
  // them all: tiles of 0 rows, SIGILL at the first tile instruction). The barrier keeps them.
  __asm__ __volatile__("" : : "r"(&cfg) : "memory");
  _tile_loadconfig(&cfg);
}

MEPIC_AMX_FN inline void amx_release() { _tile_release(); }

// dst[x] = bfloat16(src[x] * scale) for x < d (a multiple of 32), rounding to nearest even.
MEPIC_AMX_FN inline void to_bf16(const float* src, float scale, int64_t d, uint16_t* dst) {
  const __m512 sc = _mm512_set1_ps(scale);
  for (int64_t x = 0; x < d; x += 32) {
    const __m512 lo = _mm512_mul_ps(_mm512_loadu_ps(src + x), sc);
    const __m512 hi = _mm512_mul_ps(_mm512_loadu_ps(src + x + 16), sc);
    _mm512_storeu_si512(dst + x, (__m512i)_mm512_cvtne2ps_pbh(hi, lo));
  }
}

// Sixteen bfloat16 elements of a value row.
inline __m256i load_bf16x16(const at::BFloat16* x) {
  return _mm256_loadu_si256(reinterpret_cast<const __m256i*>(x));
}
MEPIC_AMX_FN inline __m256i load_bf16x16(const float* x) {
  return (__m256i)_mm512_cvtneps_pbh(_mm512_loadu_ps(x));
}

// One sequence's keys for one KV head, rotated and in tile order, with its values.
struct AmxPack {
  const int32_t* key_index;  // layout index of each packed key (ascending)
  int64_t keys;              // visible keys packed
  const uint16_t* k;         // [keys/16][d/32] tiles of 16 rows (pairs of dims) x 16 keys x 2
  const uint16_t* v;         // [keys/32][d/16] tiles of 16 rows (pairs of keys) x 16 dims x 2
};

// Packs keys [0, n) of the sequence's layout (entries' visible ranges in order): K rotated at
// its position, rounded to bfloat16, as AMX B tiles for Q K^T; V as B tiles for P V. Buffers
// hold n rounded up to AMX_KEYS keys and are zero beyond n.
template <typename KT>
MEPIC_AMX_FN void pack_amx(const KT* k_ptr, const KT* v_ptr, int64_t cb, int64_t cs, int64_t ch,
                           int64_t seq, int64_t head, const Meta& m, const float* cos_sin,
                           int64_t cs_stride, bool neox, int64_t d, uint16_t* kp, uint16_t* vp,
                           float* row) {
  const int64_t meta_row = seq * m.table_stride;
  const int64_t dk = d / 32, dv = d / 16, words = d / 2;
  // Rotated bfloat16 K rows of 16 keys (32-bit words: pairs of dims), then transposed into
  // the tiles; V rows of a key pair interleaved element by element into tile rows.
  std::vector<uint32_t> block(16 * words, 0);
  int64_t keys = 0;
  for (int32_t j = 0; j < m.nblocks[seq]; ++j)
    keys += std::max(0, m.vend[meta_row + j] - m.vstart[meta_row + j]);
  const int64_t padded = (keys + AMX_KEYS - 1) / AMX_KEYS * AMX_KEYS;
  if (padded > 0) {  // the last AMX_KEYS keys' tiles: zero where no key is packed
    std::fill(kp + (padded - AMX_KEYS) * d, kp + padded * d, 0);
    std::fill(vp + (padded - AMX_KEYS) * d, vp + padded * d, 0);
  }
  const KT* pending = nullptr;  // V row of the even key of an unfinished pair
  uint32_t* kp32 = reinterpret_cast<uint32_t*>(kp);
  auto flush = [&](int64_t kk) {  // keys [kk - kk % 16 ...) of the block are done
    const int64_t b = (kk - 1) / 16;
    uint32_t* tiles = kp32 + b * dk * 256;
    for (int64_t x = 0; x < dk; ++x)
      for (int64_t i = 0; i < 16; ++i)
        for (int64_t c = 0; c < 16; ++c) tiles[x * 256 + i * 16 + c] = block[c * words + 16 * x + i];
    std::fill(block.begin(), block.end(), 0u);
  };
  auto put_pair = [&](int64_t kk, const KT* a, const KT* b) {  // keys kk - 1 (a), kk (b)
    uint16_t* tiles = vp + (kk / 32) * dv * 512 + ((kk % 32) / 2) * 32;
    for (int64_t y = 0; y < dv; ++y) {
      const __m256i ra = load_bf16x16(a + 16 * y);
      const __m256i rb = b ? load_bf16x16(b + 16 * y) : _mm256_setzero_si256();
      const __m256i lo = _mm256_unpacklo_epi16(ra, rb), hi = _mm256_unpackhi_epi16(ra, rb);
      uint16_t* dst = tiles + y * 512;
      _mm256_storeu_si256(reinterpret_cast<__m256i*>(dst), _mm256_permute2x128_si256(lo, hi, 0x20));
      _mm256_storeu_si256(reinterpret_cast<__m256i*>(dst + 16),
                          _mm256_permute2x128_si256(lo, hi, 0x31));
    }
  };
  int64_t kk = 0;
  for (int32_t j = 0; j < m.nblocks[seq]; ++j) {
    const int32_t v0 = m.vstart[meta_row + j], v1 = m.vend[meta_row + j];
    const int64_t blk = m.tables[meta_row + j];
    const int32_t first = m.first[meta_row + j];
    for (int32_t c = v0; c < v1; ++c, ++kk) {
      const int64_t off = blk * cb + c * cs + head * ch;
      rotate_row(k_ptr + off, row, cos_sin + static_cast<int64_t>(first + c - v0) * cs_stride,
                  d, neox);
      to_bf16(row, 1.f, d, reinterpret_cast<uint16_t*>(block.data() + (kk % 16) * words));
      if (kk % 16 == 15) flush(kk + 1);
      if (kk % 2 == 0) {
        pending = v_ptr + off;
      } else {
        put_pair(kk, pending, v_ptr + off);
        pending = nullptr;
      }
    }
  }
  if (kk % 16 != 0) flush(kk);
  if (pending != nullptr) put_pair(kk, pending, nullptr);
}

// O tiles y .. y + NT - 1 (16 columns each) of 16 rows += P [16 x n] V [n keys, packed].
template <int NT>
MEPIC_AMX_FN inline void amx_pv(const uint16_t* pb, const uint16_t* v, int64_t k0, int64_t n,
                                int64_t dv, int64_t y, float* o, int64_t o_stride) {
  _tile_loadd(0, o + 16 * y, o_stride);
  _tile_loadd(1, o + 16 * (y + 1), o_stride);
  if constexpr (NT == 4) {
    _tile_loadd(2, o + 16 * (y + 2), o_stride);
    _tile_loadd(3, o + 16 * (y + 3), o_stride);
  }
  for (int64_t c = 0; c < n; c += 32) {
    const uint16_t* vt = v + ((k0 + c) / 32) * dv * 512 + y * 512;
    _tile_loadd(4, pb + c, AMX_STEP * 2);
    _tile_loadd(5, vt, 64);
    _tile_dpbf16ps(0, 4, 5);
    _tile_loadd(6, vt + 512, 64);
    _tile_dpbf16ps(1, 4, 6);
    if constexpr (NT == 4) {
      _tile_loadd(5, vt + 1024, 64);
      _tile_dpbf16ps(2, 4, 5);
      _tile_loadd(6, vt + 1536, 64);
      _tile_dpbf16ps(3, 4, 6);
    }
  }
  _tile_stored(0, o + 16 * y, o_stride);
  _tile_stored(1, o + 16 * (y + 1), o_stride);
  if constexpr (NT == 4) {
    _tile_stored(2, o + 16 * (y + 2), o_stride);
    _tile_stored(3, o + 16 * (y + 3), o_stride);
  }
}

constexpr float AMX_HEADROOM = 16.f;
constexpr int64_t PREFETCH_AHEAD = 8;  // keys

// prow[c] = bfloat16(exp(sr[c] - m)) for c < v, 0 for v <= c < n (n a multiple of 32);
// total = the float32 values' lane sums. False, with prow incomplete, when a score exceeds
// limit (the caller then starts again with a new maximum).
MEPIC_AMX_FN inline bool softmax_step(const float* sr, uint16_t* prow, int64_t n, int64_t v,
                                      float m, float limit, __m512& total) {
  const __m512 nm = _mm512_set1_ps(m);
  __m512 peak = _mm512_set1_ps(NEG_INF);
  total = _mm512_setzero_ps();
  for (int64_t c = 0; c < n; c += 32) {
    const __m512 s0 = _mm512_loadu_ps(sr + c), s1 = _mm512_loadu_ps(sr + c + 16);
    __m512 e0 = exp16<5>(_mm512_sub_ps(s0, nm));
    __m512 e1 = exp16<5>(_mm512_sub_ps(s1, nm));
    if (c + 32 > v) {
      const __mmask16 m0 = static_cast<__mmask16>((1u << std::clamp<int64_t>(v - c, 0, 16)) - 1u);
      const __mmask16 m1 =
          static_cast<__mmask16>((1u << std::clamp<int64_t>(v - c - 16, 0, 16)) - 1u);
      e0 = _mm512_maskz_mov_ps(m0, e0);
      e1 = _mm512_maskz_mov_ps(m1, e1);
      peak = _mm512_mask_max_ps(peak, m0, peak, s0);
      peak = _mm512_mask_max_ps(peak, m1, peak, s1);
    } else {
      peak = _mm512_max_ps(peak, _mm512_max_ps(s0, s1));
    }
    total = _mm512_add_ps(total, _mm512_add_ps(e0, e1));
    _mm512_storeu_si512(prow + c, (__m512i)_mm512_cvtne2ps_pbh(e1, e0));
  }
  return _mm512_reduce_max_ps(peak) <= limit;
}

// One work item on the tiles: rows (queries x GQA group) in tiles of 16 over the packed keys
// each row can see (layout order, causal), AMX_KEYS at a time. Leaves unnormalised outputs,
// maxima and sums in out_rows / row_max / row_sum like attend().
template <typename QT>
MEPIC_AMX_FN void attend_amx(const WorkItem& w, const QT* q_ptr, int64_t qs0, int64_t qs1,
                             const AmxPack& pk, const Meta& m, const float* cos_sin,
                             int64_t cs_stride, bool neox, float scale, int64_t group, int64_t d,
                             Scratch& sc, float* out_rows, float* row_max, float* row_sum) {
  const int64_t nq = w.q_end - w.q_begin;
  const int64_t rows = nq * group;
  const int64_t padded = (rows + 15) / 16 * 16;
  // Scratch reuse: q holds the bfloat16 query rows, kt the rows' visible key counts.
  uint16_t* qb = reinterpret_cast<uint16_t*>(sc.q.data());
  int32_t* vis = reinterpret_cast<int32_t*>(sc.kt.data());
  float* row = sc.qc.data();
  int64_t reach = 0;
  for (int64_t r = 0; r < padded; ++r) {
    uint16_t* dst = qb + r * d;
    if (r >= rows) {
      std::fill(dst, dst + d, 0);
      vis[r] = 0;
      continue;
    }
    const int64_t t = w.q_begin + r / group;
    rotate_row(q_ptr + t * qs0 + (w.kv_head * group + r % group) * qs1, row,
                cos_sin + static_cast<int64_t>(m.q_pos[t]) * cs_stride, d, neox);
    to_bf16(row, scale, d, dst);
    vis[r] = static_cast<int32_t>(
        std::upper_bound(pk.key_index, pk.key_index + pk.keys, m.q_idx[t]) - pk.key_index);
    reach = std::max<int64_t>(reach, vis[r]);
  }
  std::fill(out_rows, out_rows + padded * d, 0.f);
  std::fill(row_max, row_max + padded, NEG_INF);
  std::fill(row_sum, row_sum + padded, 0.f);
  const int64_t dk = d / 32, dv = d / 16;
  const int64_t q_stride = d * 2, o_stride = d * 4;
  float* s = sc.amx_s.data();
  uint16_t* pb = sc.amx_p.data();
  amx_configure();
  // Steps of up to AMX_STEP keys: scores for the step (64 keys, four tiles, at a time), the
  // softmax over the whole step, then P V with each output tile loaded and stored once.
  for (int64_t k0 = 0; k0 < reach; k0 += AMX_STEP) {
    const int64_t n = std::min<int64_t>(AMX_STEP, (reach - k0 + AMX_KEYS - 1) / AMX_KEYS * AMX_KEYS);
    // Row tiles that see a key of this step: a suffix (vis grows with r).
    int64_t r_first = 0;
    while (r_first < padded && vis[std::min<int64_t>(r_first + 15, rows - 1)] <= k0) r_first += 16;
    // Scores: per 64 keys (16 KB of K, kept in L1), every active row tile.
    for (int64_t c0 = 0; c0 < n; c0 += AMX_KEYS) {
      const uint16_t* kt = pk.k + ((k0 + c0) / 16) * dk * 512;
      for (int64_t r0 = r_first; r0 < padded; r0 += 16) {
        _tile_zero(0);
        _tile_zero(1);
        _tile_zero(2);
        _tile_zero(3);
        for (int64_t x = 0; x < dk; ++x) {
          _tile_loadd(4, qb + r0 * d + 32 * x, q_stride);
          _tile_loadd(5, kt + (0 * dk + x) * 512, 64);
          _tile_dpbf16ps(0, 4, 5);
          _tile_loadd(6, kt + (1 * dk + x) * 512, 64);
          _tile_dpbf16ps(1, 4, 6);
          _tile_loadd(5, kt + (2 * dk + x) * 512, 64);
          _tile_dpbf16ps(2, 4, 5);
          _tile_loadd(6, kt + (3 * dk + x) * 512, 64);
          _tile_dpbf16ps(3, 4, 6);
        }
        float* sr = s + r0 * AMX_STEP + c0;
        _tile_stored(0, sr, AMX_STEP * 4);
        _tile_stored(1, sr + 16, AMX_STEP * 4);
        _tile_stored(2, sr + 32, AMX_STEP * 4);
        _tile_stored(3, sr + 48, AMX_STEP * 4);
      }
    }
    // Online softmax, one row at a time; keys a row cannot see get P = 0.
    for (int64_t r = r_first; r < padded; ++r) {
      uint16_t* prow = pb + r * AMX_STEP;
      const int64_t v = std::min<int64_t>(vis[r] - k0, n);
      if (v <= 0) {
        std::fill(prow, prow + n, 0);
        continue;
      }
      const float* sr = s + r * AMX_STEP;
      // One pass against the row's running maximum m: p = exp(s - m) while no score exceeds
      // m by more than AMX_HEADROOM (p then stays below e^16, exact enough in float32 and
      // bfloat16), so most steps neither search a maximum first nor rescale O. A row's first
      // step, or a step that exceeds the headroom, takes two passes with the new maximum.
      float new_max = row_max[r];
      float alpha = 1.f;
      __m512 total;
      bool done = false;
      if (new_max != NEG_INF) {
        done = softmax_step(sr, prow, n, v, new_max, new_max + AMX_HEADROOM, total);
      }
      if (!done) {
        __m512 mxv = _mm512_set1_ps(NEG_INF);
        int64_t c = 0;
        for (; c + 16 <= v; c += 16) mxv = _mm512_max_ps(mxv, _mm512_loadu_ps(sr + c));
        if (c < v)
          mxv = _mm512_max_ps(
              mxv, _mm512_mask_loadu_ps(mxv, static_cast<__mmask16>((1u << (v - c)) - 1u), sr + c));
        new_max = std::max(row_max[r], _mm512_reduce_max_ps(mxv));
        alpha = std::exp(row_max[r] - new_max);
        if (alpha != 1.f) {
          float* o = out_rows + r * d;
          const __m512 a = _mm512_set1_ps(alpha);
          for (int64_t y = 0; y < d; y += 16)
            _mm512_storeu_ps(o + y, _mm512_mul_ps(_mm512_loadu_ps(o + y), a));
        }
        softmax_step(sr, prow, n, v, new_max, std::numeric_limits<float>::infinity(), total);
      }
      row_sum[r] = row_sum[r] * alpha + _mm512_reduce_add_ps(total);
      row_max[r] = new_max;
    }
    // O += P V over the step's keys: per four (or two) 16-wide output columns (a V slice that
    // stays in L1), every active row tile; four accumulations in flight.
    for (int64_t y = 0; y < dv; y += 4)
      for (int64_t r0 = r_first; r0 < padded; r0 += 16) {
        if (dv - y >= 4)
          amx_pv<4>(pb + r0 * AMX_STEP, pk.v, k0, n, dv, y, out_rows + r0 * d, o_stride);
        else
          amx_pv<2>(pb + r0 * AMX_STEP, pk.v, k0, n, dv, y, out_rows + r0 * d, o_stride);
      }
  }
}
// Decode on the tiles (one query, its GQA group of at most 16 rows, bfloat16): keys need no
// tile order here. The scores come transposed, S^T = K Q^T, with the chunk's rotated K rows
// as the A operand (plain row-major bfloat16) and Q^T, packed once per item, as B; the
// softmax then runs down the keys with the rows in the 16 lanes, and P V on AVX-512 FMAs over
// the real rows only. Per key that is a rotation and a few vector operations, where the
// vector path spent a dot product and a reduction per row.
template <typename QT>
MEPIC_AMX_FN void attend_amx_decode(const WorkItem& w, const QT* q_ptr, int64_t qs0, int64_t qs1,
                                    const at::BFloat16* k_ptr, const at::BFloat16* v_ptr,
                                    int64_t cb, int64_t cs, int64_t ch, const Meta& m,
                                    const float* cos_sin, int64_t cs_stride, bool neox,
                                    float scale, int64_t group, int64_t d, Scratch& sc,
                                    float* out_rows, float* row_max, float* row_sum) {
  const int64_t rows = group;  // one query
  const int64_t t = w.q_begin;
  const int64_t dk = d / 32;
  // B operands: qt[x] = Q^T for dims [32x, 32x + 32) in pairs: row i, column 2r + e holds
  // Q[r][32x + 2i + e] (rows past `rows` zero).
  uint16_t* qt = sc.amx_p.data();  // dk tiles of 16 x 32
  uint16_t* kb = reinterpret_cast<uint16_t*>(sc.k.data());  // KEY_CHUNK rotated K rows
  float* st = sc.amx_s.data();  // KEY_CHUNK x 16 scores, then probabilities
  float* row = sc.qc.data();
  float* qf = sc.q.data();  // the rows' rotated, scaled queries (float32)
  for (int64_t r = 0; r < rows; ++r) {
    rotate_row(q_ptr + t * qs0 + (w.kv_head * group + r) * qs1, qf + r * d,
               cos_sin + static_cast<int64_t>(m.q_pos[t]) * cs_stride, d, neox);
    for (int64_t x = 0; x < d; ++x) qf[r * d + x] *= scale;
  }
  std::fill(qt, qt + dk * 512, 0);
  for (int64_t r = 0; r < rows; ++r) {
    uint16_t bits[512];
    to_bf16(qf + r * d, 1.f, d, bits);
    for (int64_t x = 0; x < d; ++x)
      qt[(x / 32) * 512 + ((x % 32) / 2) * 32 + 2 * r + x % 2] = bits[x];
  }
  std::fill(out_rows, out_rows + rows * d, 0.f);
  __m512 mx = _mm512_set1_ps(NEG_INF), sum = _mm512_setzero_ps();
  const int32_t q_idx = m.q_idx[t];
  const int64_t meta_row = static_cast<int64_t>(w.seq) * m.table_stride;
  amx_configure();
  for (int32_t j = w.entry_begin; j < w.entry_end; ++j) {
    const int64_t base = static_cast<int64_t>(j) * m.block_size;
    const int32_t v0 = m.vstart[meta_row + j];
    const int32_t v1 = static_cast<int32_t>(
        std::min<int64_t>(m.vend[meta_row + j], static_cast<int64_t>(q_idx) - base + 1));
    if (v0 >= v1) continue;
    const int64_t blk = m.tables[meta_row + j];
    const int32_t first = m.first[meta_row + j];
    for (int32_t c0 = v0; c0 < v1; c0 += KEY_CHUNK) {
      const int64_t n = std::min<int64_t>(KEY_CHUNK, v1 - c0);
      const int64_t tiles = (n + 15) / 16;
      const int64_t off = blk * cb + c0 * cs + static_cast<int64_t>(w.kv_head) * ch;
      const float* cs_chunk = cos_sin + static_cast<int64_t>(first + c0 - v0) * cs_stride;
      // The chunk's K and V rows stream from L3 or memory; fetching them a few keys ahead
      // halved decode time (the hardware prefetcher alone left each row's load exposed).
      const int64_t row_bytes = d * static_cast<int64_t>(sizeof(at::BFloat16));
      for (int64_t c = 0; c < n; ++c) {
        if (c0 + c + PREFETCH_AHEAD < v1) {  // within the block: rows are contiguous
          const char* kn = reinterpret_cast<const char*>(k_ptr + off + (c + PREFETCH_AHEAD) * cs);
          const char* vn = reinterpret_cast<const char*>(v_ptr + off + (c + PREFETCH_AHEAD) * cs);
          for (int64_t b = 0; b < row_bytes; b += 64) {
            _mm_prefetch(kn + b, _MM_HINT_T0);
            _mm_prefetch(vn + b, _MM_HINT_T0);
          }
        }
        rotate_row(k_ptr + off + c * cs, row, cs_chunk + c * cs_stride, d, neox);
        to_bf16(row, 1.f, d, kb + c * d);
      }
      // S^T for the chunk, 16 keys per tile (rows past n are stale: masked below).
      for (int64_t b = 0; b < tiles; ++b) {
        _tile_zero(0);
        for (int64_t x = 0; x < dk; ++x) {
          _tile_loadd(1, kb + b * 16 * d + 32 * x, d * 2);
          _tile_loadd(2, qt + x * 512, 64);
          _tile_dpbf16ps(0, 1, 2);
        }
        _tile_stored(0, st + b * 256, 64);
      }
      __m512 cmax = mx;
      for (int64_t c = 0; c < n; ++c) cmax = _mm512_max_ps(cmax, _mm512_loadu_ps(st + c * 16));
      const __m512 alpha = exp16<5>(_mm512_sub_ps(mx, cmax));  // ~0 after -inf (O, sum 0)
      mx = cmax;
      __m512 csum = _mm512_setzero_ps();
      for (int64_t c = 0; c < n; ++c) {
        const __m512 e = exp16<5>(_mm512_sub_ps(_mm512_loadu_ps(st + c * 16), cmax));
        csum = _mm512_add_ps(csum, e);
        _mm512_storeu_ps(st + c * 16, e);
      }
      sum = _mm512_fmadd_ps(sum, alpha, csum);
      alignas(64) float a[16];
      _mm512_store_ps(a, alpha);
      for (int64_t r = 0; r < rows; ++r) {
        if (a[r] == 1.f) continue;
        float* o = out_rows + r * d;
        const __m512 av = _mm512_set1_ps(a[r]);
        for (int64_t y = 0; y < d; y += 16)
          _mm512_storeu_ps(o + y, _mm512_mul_ps(_mm512_loadu_ps(o + y), av));
      }
      // O[r] += sum_c P^T[c][r] V[c], four rows and 64 dims in registers at a time.
      const at::BFloat16* vrows = v_ptr + off;
      for (int64_t r0 = 0; r0 < rows; r0 += 4) {
        const int64_t rn = std::min<int64_t>(4, rows - r0);
        for (int64_t y = 0; y < d; y += 64) {
          const int64_t wn = std::min<int64_t>(4, (d - y) / 16);
          __m512 acc[4][4];
          for (int64_t r = 0; r < 4; ++r)
            for (int64_t u = 0; u < 4; ++u)
              acc[r][u] = r < rn && u < wn ? _mm512_loadu_ps(out_rows + (r0 + r) * d + y + 16 * u)
                                           : _mm512_setzero_ps();
          for (int64_t c = 0; c < n; ++c) {
            __m512 vv[4];
            for (int64_t u = 0; u < 4; ++u)
              vv[u] = u < wn ? load16(vrows + c * cs + y + 16 * u) : _mm512_setzero_ps();
            for (int64_t r = 0; r < 4; ++r) {
              const __m512 pr = _mm512_set1_ps(st[c * 16 + r0 + r]);
              for (int64_t u = 0; u < 4; ++u) acc[r][u] = _mm512_fmadd_ps(pr, vv[u], acc[r][u]);
            }
          }
          for (int64_t r = 0; r < rn; ++r)
            for (int64_t u = 0; u < wn; ++u)
              _mm512_storeu_ps(out_rows + (r0 + r) * d + y + 16 * u, acc[r][u]);
        }
      }
    }
  }
  alignas(64) float mv[16], sv[16];
  _mm512_store_ps(mv, mx);
  _mm512_store_ps(sv, sum);
  for (int64_t r = 0; r < rows; ++r) {
    row_max[r] = mv[r];
    row_sum[r] = sv[r];
  }
}
#endif

}  // namespace
}  // namespace mepic_cpu
