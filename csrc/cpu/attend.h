// The vector path's work item (attend): the online softmax over KEY_CHUNK keys at a time, on
// the best tiles the build has (AVX-512, AVX2, or portable loops), with its portable fallbacks,
// prefetch and row-by-row softmax.
//
// Every item AMX does not take runs here. Part of the attention unit (see common.h).
#pragma once

#include "avx512.h"

namespace mepic_cpu {
namespace {

// Portable versions (any head size, any ISA the compiler vectorises for).
inline void score_tile_generic(const float* __restrict q, const float* __restrict k, int64_t n,
                               int64_t d, float* __restrict s) {
  for (int64_t c = 0; c < n; ++c)
    for (int r = 0; r < ROWS; ++r) s[r * KEY_CHUNK + c] = dot(q + r * d, k + c * d, d);
}

inline void pv_tile_generic(const float* p, const float* v, int64_t v_stride, int64_t n,
                            int64_t d, float* acc_rows) {
  for (int64_t c = 0; c < n; ++c)
    for (int r = 0; r < ROWS; ++r) axpy(p[r * KEY_CHUNK + c], v + c * v_stride, acc_rows + r * d, d);
}

// Part `part` of `parts` of a span of `rows` rows (row_bytes each, stride apart), prefetched:
// a prefill's row tiles each fetch a share of the next chunk's K or V, so that its first tile
// does not wait on L3 (the chunk's 16-32 KB then stay in L1 for the tiles after it).
inline void prefetch_share(const void* base, int64_t stride, int64_t rows, int64_t row_bytes,
                           int64_t part, int64_t parts) {
  const char* b = static_cast<const char*>(base);
  for (int64_t r = rows * part / parts; r < rows * (part + 1) / parts; ++r)
    for (int64_t x = 0; x < row_bytes; x += 64) _mm_prefetch(b + r * stride + x, _MM_HINT_T0);
}

// The online-softmax step of one chunk, row by row (s: the rows' KEY_CHUNK scores; vis[r]:
// keys visible to row r). Scores become probabilities, zero past each row's visible keys.
inline void softmax_rows(float* s, const int64_t* vis, int64_t rows, int64_t n, float* row_max,
                         float* row_sum, float* out_rows, int64_t d) {
  for (int64_t r = 0; r < rows; ++r) {
    float* sr = s + r * KEY_CHUNK;
    if (vis[r] <= 0) {
      std::fill(sr, sr + n, 0.f);
      continue;
    }
#ifdef MEPIC_CPU_AVX2
    const float mx = max_of(sr, vis[r]);
#else
    float mx = NEG_INF;
#pragma omp simd reduction(max : mx)
    for (int64_t c = 0; c < vis[r]; ++c) mx = std::max(mx, sr[c]);
#endif
    const float new_max = std::max(row_max[r], mx);
    const float alpha = std::exp(row_max[r] - new_max);  // 0 on the row's first keys
    if (alpha != 1.f) {
      float* acc = out_rows + r * d;
#pragma omp simd
      for (int64_t x = 0; x < d; ++x) acc[x] *= alpha;
    }
#ifdef MEPIC_CPU_AVX2
    const float total = exp_shifted(sr, vis[r], new_max);
#else
    float total = 0.f;
#pragma omp simd reduction(+ : total)
    for (int64_t c = 0; c < vis[r]; ++c) {
      sr[c] = exp_nonpositive(sr[c] - new_max);
      total += sr[c];
    }
#endif
    std::fill(sr + vis[r], sr + n, 0.f);
    row_sum[r] = row_sum[r] * alpha + total;
    row_max[r] = new_max;
  }
}

// One work item: online softmax of its rows over block-table entries [entry_begin, entry_end),
// KEY_CHUNK keys at a time: the chunk's keys are rotated into scratch, scored against every row
// tile, the softmax updated per row, and the values accumulated per row tile.
template <typename QT, typename KT>
void attend(const WorkItem& w, const QT* q_ptr, int64_t qs0, int64_t qs1, const KT* k_ptr,
            const KT* v_ptr, int64_t cb, int64_t cs, int64_t ch, const Meta& m,
            const float* cos_sin, int64_t cs_stride, bool neox, float scale, int64_t group,
            int64_t d, Scratch& sc, float* out_rows, float* row_max, float* row_sum,
            const float* packed_kt = nullptr, const int64_t* chunk_base = nullptr) {
  const int64_t nq = w.q_end - w.q_begin;
  const int64_t rows = nq * group;
  const int64_t padded = (rows + ROWS - 1) / ROWS * ROWS;  // rows beyond `rows` are zero
  const int64_t bs = m.block_size;
#ifdef MEPIC_CPU_AVX2
  const bool tiled = d % 8 == 0;
#else
  const bool tiled = false;
#endif
  // One row tile (decode: a query times a GQA group of at most ROWS) with NeoX halves: keys are
  // rotated in registers inside the score loop, no scratch copy.
  const bool fused = tiled && neox && d % 16 == 0 && padded == ROWS;
#ifdef MEPIC_CPU_AVX512
  // The fused tile in 16 lanes (d = 64 or 128): its cos/sin rows for key offsets [0, split_rows)
  // in split order, made as chunks first need them; its query rows in split order per chunk.
  const bool fused512 = fused && (d == 64 || d == 128);
  float* split_cs = sc.kt.data();
  float* split_q = sc.v.data();
  int64_t split_rows = 0;
#endif
  float* q = sc.q.data();
  float* qc = sc.qc.data();
  float* kb = sc.k.data();
  float* vb = sc.v.data();
  float* s = sc.s.data();
  int32_t max_idx = -1;
  std::fill(q, q + padded * d, 0.f);
  std::fill(qc, qc + padded * d, 0.f);
  for (int64_t i = 0; i < nq; ++i) {
    const int64_t t = w.q_begin + i;
    max_idx = std::max(max_idx, m.q_idx[t]);
    const float* cs_row = cos_sin + static_cast<int64_t>(m.q_pos[t]) * cs_stride;
    for (int64_t g = 0; g < group; ++g) {
      float* row = q + (i * group + g) * d;
      rotate_into(q_ptr + t * qs0 + (w.kv_head * group + g) * qs1, row, cs_row, d, neox);
#pragma omp simd
      for (int64_t x = 0; x < d; ++x) row[x] *= scale;
    }
  }
  std::fill(out_rows, out_rows + padded * d, 0.f);
  std::fill(row_max, row_max + padded, NEG_INF);
  std::fill(row_sum, row_sum + padded, 0.f);
  const int64_t meta_row = static_cast<int64_t>(w.seq) * m.table_stride;
  int64_t* const visible = sc.visible.data();
  const int64_t row_tiles = padded / ROWS;
  const bool ahead = row_tiles >= 4;  // prefill: many row tiles share each chunk
  for (int32_t j = w.entry_begin; j < w.entry_end; ++j) {
    const int64_t base = static_cast<int64_t>(j) * bs;
    const int32_t v0 = m.vstart[meta_row + j];
    const int32_t v1 = static_cast<int32_t>(
        std::min<int64_t>(m.vend[meta_row + j], static_cast<int64_t>(max_idx) - base + 1));
    if (v0 >= v1) continue;  // empty entry, or wholly after every query of the tile
    const int64_t blk = m.tables[meta_row + j];
    const int32_t first = m.first[meta_row + j];
    // The next entry's first rows (offset, visible keys), which the prefetches run into at this
    // entry's end; none after the item's last entry.
    int64_t next_off = 0, next_keys = 0;
    if (j + 1 < w.entry_end) {
      const int32_t s0 = m.vstart[meta_row + j + 1];
      next_off = m.tables[meta_row + j + 1] * cb + s0 * cs + static_cast<int64_t>(w.kv_head) * ch;
      next_keys = std::max<int64_t>(0, m.vend[meta_row + j + 1] - s0);
    }
    for (int32_t c0 = v0; c0 < v1; c0 += KEY_CHUNK) {
      const int64_t n = std::min<int64_t>(KEY_CHUNK, v1 - c0);
      const int64_t n4 = (n + 3) / 4 * 4;
      const int64_t chunk_off = blk * cb + c0 * cs + static_cast<int64_t>(w.kv_head) * ch;
      const float* cs_chunk = cos_sin + static_cast<int64_t>(first + c0 - v0) * cs_stride;
      // Prefill: the next chunk's values (the rest of this block, else the next entry's first
      // keys), fetched a share per row tile.
      const KT* v_next = nullptr;
      int64_t n_next = 0;
      if (ahead && c0 + KEY_CHUNK < v1) {
        v_next = v_ptr + chunk_off + KEY_CHUNK * cs;
        n_next = std::min<int64_t>(KEY_CHUNK, v1 - c0 - KEY_CHUNK);
      } else if (ahead && next_keys > 0) {
        v_next = v_ptr + next_off;
        n_next = std::min<int64_t>(KEY_CHUNK, next_keys);
      }
      // Keys of the chunk each row sees: causal in layout order (keys after the row's query
      // hidden). Per query, shared by its GQA group's rows (a division per row and chunk was a
      // few percent of a prefill).
      for (int64_t i = 0, r = 0; i < nq; ++i) {
        const int64_t vis = std::clamp<int64_t>(m.q_idx[w.q_begin + i] - base - c0 + 1, 0, n);
        for (int64_t g = 0; g < group; ++g) visible[r++] = vis;
      }
      std::fill(visible + rows, visible + padded, int64_t{0});
      // A row tile's reach: the most keys any of its rows sees (0: the tile skips the chunk).
      const auto reach_of = [&](int64_t r) {
        int64_t reach = 0;
        for (int64_t u = 0; u < ROWS; ++u) reach = std::max(reach, visible[r + u]);
        return reach;
      };
#ifdef MEPIC_CPU_AVX2
      if (fused) {
        // Key c sits at position p0 + c and R(p0 + c) = R(p0) R(c): the rows are turned back
        // by p0 once per chunk, and each key by its offset c only, so the keys' cos/sin rows
        // are the table's first KEY_CHUNK (cache-resident), not a fresh row per key.
        for (int64_t r = 0; r < rows; ++r)
          rotate_into<float, true>(q + r * d, qc + r * d, cs_chunk, d, true);
#ifdef MEPIC_CPU_AVX512
        if (fused512) {
          for (; split_rows < n; ++split_rows)
            to_split_order<KT>(cos_sin + split_rows * cs_stride, split_cs + split_rows * d, d);
          for (int64_t r = 0; r < ROWS; ++r) to_split_order<KT>(qc + r * d, split_q + r * d, d);
          const KT* kc = k_ptr + chunk_off;
          const KT* vc = v_ptr + chunk_off;
          // The last chunk of a block prefetches into the next entry's first keys.
          const KT* kn = k_ptr + next_off;
          const KT* vn = v_ptr + next_off;
          const int64_t nn = c0 + KEY_CHUNK >= v1 ? next_keys : 0;
          if (d == 64 && rows == 3)
            score_tile_rope512<KT, 64, 3>(split_q, kc, vc, cs, v1 - c0, split_cs, n, s, kn, vn, nn);
          else if (d == 64)
            score_tile_rope512<KT, 64>(split_q, kc, vc, cs, v1 - c0, split_cs, n, s, kn, vn, nn);
          else if (rows == 3)
            score_tile_rope512<KT, 128, 3>(split_q, kc, vc, cs, v1 - c0, split_cs, n, s, kn, vn, nn);
          else
            score_tile_rope512<KT, 128>(split_q, kc, vc, cs, v1 - c0, split_cs, n, s, kn, vn, nn);
        } else
#endif
        score_tile_rope(qc, k_ptr + chunk_off, v_ptr + chunk_off, cs, v1 - c0, cos_sin,
                        cs_stride, n, d, s);
      }
#endif
#ifdef MEPIC_CPU_AVX512
      if (packed_kt != nullptr) {
        // The sequence's keys were rotated and transposed once for all its query tiles.
        const float* kt = packed_kt + (chunk_base[j] + (c0 - v0) / KEY_CHUNK) * d * KEY_CHUNK;
        for (int64_t r = 0; r < padded; r += ROWS) {
          // The next chunk's transposed keys follow this one's in the pack.
          if (ahead)
            prefetch_share(kt + d * KEY_CHUNK, KEY_CHUNK * sizeof(float), d,
                           KEY_CHUNK * sizeof(float), r / ROWS, row_tiles);
          // Only the keys some row of the tile sees (fewer on the causal diagonal); the softmax
          // follows at once, on scores still in L1 (a pass over all tiles' scores after the
          // score pass read them back from L2 on a 32 KB L1: 3% of a prefill on an EPYC).
          const int64_t reach = reach_of(r);
          if (reach > 0) {
            score_tile_t512(q + r * d, kt, d, s + r * KEY_CHUNK, reach);
            softmax_tile512(s + r * KEY_CHUNK, visible + r, row_max + r, row_sum + r,
                            out_rows + r * d, d);
          }
        }
      } else
#endif
      if (!fused) {
        for (int64_t c = 0; c < n; ++c) {
          if (nq == 1 && c0 + c + 8 < v1) {  // decode: K, V rows 8 keys ahead (in the block)
            const char* kn = reinterpret_cast<const char*>(k_ptr + chunk_off + (c + 8) * cs);
            const char* vn = reinterpret_cast<const char*>(v_ptr + chunk_off + (c + 8) * cs);
            for (int64_t b = 0; b < d * static_cast<int64_t>(sizeof(KT)); b += 64) {
              __builtin_prefetch(kn + b, 0, 3);
              __builtin_prefetch(vn + b, 0, 3);
            }
          }
          rotate_into(k_ptr + chunk_off + c * cs, kb + c * d, cs_chunk + c * cs_stride, d, neox);
        }
        std::fill(kb + n * d, kb + n4 * d, 0.f);
#ifdef MEPIC_CPU_AVX512
        // Many row tiles (prefill): transposing the chunk once pays for itself.
        const bool outer = tiled && padded >= 4 * ROWS;
        if (outer) transpose_keys(kb, n, d, sc.kt.data());
#endif
        for (int64_t r = 0; r < padded; r += ROWS) {
#ifdef MEPIC_CPU_AVX512
          if (outer) {
            score_tile_t512(q + r * d, sc.kt.data(), d, s + r * KEY_CHUNK);
            continue;
          }
#endif
#ifdef MEPIC_CPU_AVX2
          if (tiled) {
            score_tile(q + r * d, kb, n4, d, s + r * KEY_CHUNK);
            continue;
          }
#endif
          score_tile_generic(q + r * d, kb, n, d, s + r * KEY_CHUNK);
        }
      }
      // Value rows: the vectorised P.V reads them in place (bfloat16 widened in registers);
      // the portable one takes float rows, converted once per chunk from a bfloat16 cache.
      const float* vrows = vb;
      int64_t v_stride = d;
      if constexpr (std::is_same_v<KT, float>) {
        vrows = v_ptr + chunk_off;
        v_stride = cs;
      } else {
        if (!tiled)
          for (int64_t c = 0; c < n; ++c) load_row(v_ptr + chunk_off + c * cs, vb + c * d, d);
      }
      // Online softmax per row tile (the packed prefill ran it right after each tile's scores,
      // while they were in L1); a tile that sees no key keeps its state.
#ifdef MEPIC_CPU_AVX512
      for (int64_t r = 0; r < padded; r += ROWS)
        if (packed_kt == nullptr && reach_of(r) > 0)
          softmax_tile512(s + r * KEY_CHUNK, visible + r, row_max + r, row_sum + r,
                          out_rows + r * d, d);
#else
      softmax_rows(s, visible, padded, n, row_max, row_sum, out_rows, d);
#endif
      for (int64_t r = 0; r < padded; r += ROWS) {
        if (ahead && v_next != nullptr)
          prefetch_share(v_next, cs * sizeof(KT), n_next, d * sizeof(KT), r / ROWS, row_tiles);
        const int64_t reach = reach_of(r);
        if (reach == 0) continue;
#ifdef MEPIC_CPU_AVX512
        if (tiled) {
          if (rows == 3)
            pv_tile512<KT, 3>(s + r * KEY_CHUNK, v_ptr + chunk_off, cs, reach, d, out_rows);
          else
            pv_tile512(s + r * KEY_CHUNK, v_ptr + chunk_off, cs, reach, d, out_rows + r * d);
          continue;
        }
#endif
#ifdef MEPIC_CPU_AVX2
        if (tiled) {
          pv_tile(s + r * KEY_CHUNK, v_ptr + chunk_off, cs, reach, d, out_rows + r * d);
          continue;
        }
#endif
        pv_tile_generic(s + r * KEY_CHUNK, vrows, v_stride, reach, d, out_rows + r * d);
      }
    }
  }
#ifdef MEPIC_CPU_AVX512
  if (tiled && split_v<KT>(d))
    for (int64_t r = 0; r < padded; ++r) from_split_order(out_rows + r * d, d);
#endif
}

}  // namespace
}  // namespace mepic_cpu
