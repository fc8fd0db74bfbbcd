// MEPIC's fused-RoPE paged attention for CPU: the op contract of ascend_mepic/ops/metadata.py.
//
// Why a native kernel: the torch reference gathers every real key of every sequence, rotates it
// into a new tensor and runs SDPA on the copy, per layer. Here each K row is read in place from
// the paged cache (through the cache's strides), rotated in a small per-thread buffer at its
// logical position and consumed at once by an online softmax; nothing rotated is written back.
//
// Work items (an OpenMP loop on torch's threads): (sequence, KV head, query tile, KV split). A tile holds up to
// QUERY_TILE queries of one sequence; its rows are those queries times the GQA group sharing the
// KV head, so each K/V row is read and rotated once per tile. Decode (one query per sequence)
// splits a sequence's block table into ranges when there are fewer (sequence, KV head) items
// than threads; each range yields a partial output and its log-sum-exp, merged afterwards.
//
// Query, K, V: float32 or bfloat16 (the cache may differ from the query); math in float32 (AMX:
// bfloat16 products, float32 sums). The kernel is compiled once per instruction set (ops/
// cpu_kernel.py: avx512, avx2; never -march=native) and the loader picks the library the CPU
// runs. AMX code is compiled per function (MEPIC_AMX_FN) and used only where CPUID reports
// AMX-BF16 and Linux grants the tile state; a test build (MEPIC_AMX_EMULATE) emulates the tile
// instructions so that the AMX paths are checked on CPUs without AMX.
//
// Paths, chosen per work item:
// * bfloat16, a sequence with at least 16 rows (prefill): attend_amx, over keys rotated and
//   packed into tile order once per call (pack_amx);
// * bfloat16 decode with a GQA group wider than ROWS: attend_amx_decode (S^T = K Q^T);
// * otherwise attend(): AVX-512/AVX2 register tiles of ROWS rows; float32 prefill reads keys
//   rotated and transposed once per call, each row tile prefetching a share of the next chunk;
//   decode rotates keys in registers (fused: 16 lanes, four keys at a time, for heads of 64 and
//   128 under AVX-512; 8 lanes otherwise). The online softmax takes a tile's 4 rows at once
//   (AVX-512); bfloat16 values are widened in split order (load32) and rows turned back once.
//
// Each thread keeps its scratch across calls (thread_scratch); rope_paged_attention_out writes
// the caller's output buffer (the attention layer's), so a call allocates nothing large.
//
// Any cache strides work; decode is bound by streaming K/V, so the serving backend stores one KV
// head's rows of a block contiguously (worker/attention.py, block_view). With token-major blocks
// (rows Hkv * D apart) the same kernel was a third slower beyond L3, and software prefetch
// did not recover it. With contiguous rows, decode fetches K/V rows 8 keys ahead (at a block's
// end, the next block's first rows: a gain at block 32, where a quarter of the keys had waited)
// and each prefill row tile a share of the next chunk (measured gains; other distances and hints
// were not).
//
// Files (csrc/cpu/, all compiled into one library per variant): this unit holds the op (the
// work plan, AMX packing and per-item dispatch in run(), the merge of split decode) with the
// headers it includes: common.h (tiling, RoPE, metadata, scratch), buffer.h (aligned and guarded
// scratch buffers), avx2.h, avx512.h and amx.h (one per instruction set; amx_emulate.h for the
// emulation build) and attend.h (the vector path's work item). dispatch.cpp decides at run time
// whether AMX is used and names the paths (isa); write_kv.cpp is the cache write; guard.cpp the
// guard build's registry; bindings.cpp registers the ops with torch.

// The Tensor class and torch's thread count only: with ATen/ATen.h (every op's header) this
// unit took three times as long to parse.
#include <ATen/Parallel.h>
#include <ATen/core/Tensor.h>
#include <omp.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <type_traits>
#include <vector>

#include "amx.h"
#include "attend.h"
#include "buffer.h"
#include "common.h"
#include "config.h"
#include "ops.h"

namespace mepic_cpu {
namespace {

template <typename QT, typename KT>
void run(const at::Tensor& query, const at::Tensor& kv_cache, const Meta& m,
         const float* cos_sin, int64_t cs_stride, bool neox, float scale, at::Tensor& out,
         int64_t splits) {
  const int64_t hq = query.size(1), d = query.size(2);
  const int64_t hkv = kv_cache.size(3);
  const int64_t group = hq / hkv;
  const QT* q_ptr = query.data_ptr<QT>();
  QT* o_ptr = out.data_ptr<QT>();
  const int64_t qs0 = query.stride(0), qs1 = query.stride(1);
  const int64_t os0 = out.stride(0), os1 = out.stride(1);
  const KT* k_ptr = kv_cache.data_ptr<KT>();
  const KT* v_ptr = k_ptr + kv_cache.stride(0);
  const int64_t cb = kv_cache.stride(1), cs = kv_cache.stride(2), ch = kv_cache.stride(3);

  const std::vector<WorkItem> work = plan_work(m, hkv, splits);
  const int64_t n = static_cast<int64_t>(work.size());
  // The widest item's rows, padded to whole row tiles of every path: ROWS for the vector
  // tiles, 16 for the AMX tiles (attend_amx fills its rows up to a multiple of 16).
  int64_t max_rows = 16;
  for (const WorkItem& w : work) {
    const int64_t rows = (w.q_end - w.q_begin) * group;
    max_rows = std::max({max_rows, (rows + ROWS - 1) / ROWS * ROWS, (rows + 15) / 16 * 16});
  }
  // Per work item: its rows' outputs (unnormalised), maxima and sums, merged below.
  // Items of a split decode sequence keep their rows' unnormalised outputs, maxima and sums
  // for the merge below; every other item writes its normalised rows itself.
  std::vector<int64_t> slot(n, -1);
  int64_t slots = 0;
  for (int64_t i = 0; i < n; ++i)
    if (work[i].split >= 0) slot[i] = slots++;
  // Reused across calls by the calling thread, like the scratch (the OpenMP threads use the
  // pointers: the names would be their own thread_local buffers).
  static thread_local Buffer<float> merge_acc, merge_mx, merge_sm;
  grow(merge_acc, slots * max_rows * d);
  grow(merge_mx, slots * max_rows);
  grow(merge_sm, slots * max_rows);
  float* const acc = merge_acc.data();
  float* const mx = merge_mx.data();
  float* const sm = merge_sm.data();
  // Items run largest first and are handed out one at a time, so causal prefill tiles (whose
  // cost grows with their position) and uneven sequences spread evenly over the threads.
  std::vector<int64_t> order(n);
  for (int64_t i = 0; i < n; ++i) order[i] = i;
  std::stable_sort(order.begin(), order.end(), [&](int64_t a, int64_t b) {
    return work_cost(work[a], m) > work_cost(work[b], m);
  });
  const int threads = static_cast<int>(std::max<int64_t>(1, std::min<int64_t>(at::get_num_threads(), n)));
#if defined(MEPIC_CPU_AMX) && defined(MEPIC_CPU_AVX512)
  // bfloat16 sequences with at least a tile of rows go to the AMX path, their keys packed
  // first (one pack per sequence and KV head, shared by its query tiles).
  std::vector<int64_t> pack_of(m.num_seqs, -1);  // sequence -> first pack
  std::vector<int64_t> seqs;
  std::vector<int64_t> pack_keys, pack_base;
  std::vector<std::vector<int32_t>> key_index;
  // Reused across calls (grown, never shrunk): a fresh 8 MB per call cost page faults.
  static thread_local Buffer<uint16_t> packs;
  uint16_t* pack_data = nullptr;  // packs is this thread's: OpenMP threads use the pointer
  bool any_amx = false;
  bool amx_decode = false;  // one-query items of a bfloat16 cache on the tiles
  if constexpr (std::is_same_v<QT, at::BFloat16> && std::is_same_v<KT, at::BFloat16>) {
    // Groups the vector path fuses (at most ROWS rows) decode faster there; wider groups
    // (7 or 8 query heads per KV head) gain about 12% on the tiles.
    amx_decode = d % 32 == 0 && d <= 256 && group > ROWS && group <= 16 && amx_enabled();
    if (d % 32 == 0 && amx_enabled()) {
      int64_t total = 0;
      for (int64_t sq = 0; sq < m.num_seqs; ++sq) {
        if ((m.loc[sq + 1] - m.loc[sq]) * group < 16) continue;
        const int64_t row0 = sq * m.table_stride;
        std::vector<int32_t> index;
        for (int32_t j = 0; j < m.nblocks[sq]; ++j)
          for (int32_t c = m.vstart[row0 + j]; c < m.vend[row0 + j]; ++c)
            index.push_back(static_cast<int32_t>(j * m.block_size + c));
        const int64_t keys = static_cast<int64_t>(index.size());
        const int64_t padded = (keys + AMX_KEYS - 1) / AMX_KEYS * AMX_KEYS;
        pack_of[sq] = static_cast<int64_t>(pack_keys.size());
        seqs.push_back(sq);
        key_index.push_back(std::move(index));
        for (int64_t h = 0; h < hkv; ++h) {
          pack_keys.push_back(keys);
          pack_base.push_back(total);
          total += 2 * padded * d;
        }
      }
      grow(packs, total);
      pack_data = packs.data();
      const int64_t jobs = static_cast<int64_t>(pack_keys.size());
      any_amx = jobs > 0;
#pragma omp parallel num_threads(threads)
      {
        std::vector<float> row(d);
#pragma omp for schedule(dynamic, 1)
        for (int64_t job = 0; job < jobs; ++job) {
          const int64_t si = job / hkv, h = job % hkv;
          const int64_t padded = (pack_keys[job] + AMX_KEYS - 1) / AMX_KEYS * AMX_KEYS;
          uint16_t* kp = pack_data + pack_base[job];
          pack_amx(k_ptr, v_ptr, cb, cs, ch, seqs[si], h, m, cos_sin, cs_stride, neox, d, kp,
                   kp + padded * d, row.data());
        }
      }
    }
  }
  auto pack_for = [&](const WorkItem& w, AmxPack& pk) {
    const int64_t first = pack_of[w.seq];
    if (first < 0 || w.split >= 0) return false;
    const int64_t job = first + w.kv_head;
    const int64_t padded = (pack_keys[job] + AMX_KEYS - 1) / AMX_KEYS * AMX_KEYS;
    const std::vector<int32_t>& index = key_index[job / hkv];
    pk = {index.data(), pack_keys[job], pack_data + pack_base[job],
          pack_data + pack_base[job] + padded * d};
    return true;
  };
#endif
#ifdef MEPIC_CPU_AVX512
  // Vector-path prefill (sequences with many row tiles that AMX does not take): each
  // sequence's keys, per KV head, rotated and transposed once into chunks of d x KEY_CHUNK
  // floats in the order attend() visits them; before, every query tile redid both.
  std::vector<int64_t> kt_of(m.num_seqs, -1), chunk_base;  // per sequence: first chunk base
  std::vector<int64_t> kt_seq_chunks;                       // chunks per packed sequence
  std::vector<int64_t> kt_seqs, kt_index(m.num_seqs, -1);  // packed sequences; their index
  static thread_local Buffer<float> kt_packs;
  float* kt_data = nullptr;
  int64_t kt_chunks_total = 0;
  if (d % 16 == 0) {
    for (int64_t sq = 0; sq < m.num_seqs; ++sq) {
      const int64_t nq = m.loc[sq + 1] - m.loc[sq];
#if defined(MEPIC_CPU_AMX)
      if (pack_of[sq] >= 0) continue;  // on the tiles
#endif
      if (nq * group < 4 * ROWS) continue;
      const int64_t row0 = sq * m.table_stride;
      kt_of[sq] = static_cast<int64_t>(chunk_base.size());
      int64_t chunks = 0;
      for (int32_t j = 0; j < m.nblocks[sq]; ++j) {
        chunk_base.push_back(chunks);
        const int64_t keys = std::max(0, m.vend[row0 + j] - m.vstart[row0 + j]);
        chunks += (keys + KEY_CHUNK - 1) / KEY_CHUNK;
      }
      kt_index[sq] = static_cast<int64_t>(kt_seqs.size());
      kt_seqs.push_back(sq);
      kt_seq_chunks.push_back(kt_chunks_total);
      kt_chunks_total += chunks * hkv;
    }
    if (kt_chunks_total > 0) {
      const int64_t need = kt_chunks_total * d * KEY_CHUNK;
      grow(kt_packs, need);
      kt_data = kt_packs.data();
      const int64_t jobs = static_cast<int64_t>(kt_seqs.size()) * hkv;
#pragma omp parallel num_threads(threads)
      {
        Buffer<float> rows_buf(KEY_CHUNK * d);
#pragma omp for schedule(dynamic, 1)
        for (int64_t job = 0; job < jobs; ++job) {
          const int64_t si = job / hkv, h = job % hkv, sq = kt_seqs[si];
          const int64_t row0 = sq * m.table_stride;
          const int64_t seq_chunks =
              (si + 1 < static_cast<int64_t>(kt_seqs.size()) ? kt_seq_chunks[si + 1]
                                                              : kt_chunks_total) -
              kt_seq_chunks[si];
          float* out = kt_data + (kt_seq_chunks[si] + h * (seq_chunks / hkv)) * d * KEY_CHUNK;
          for (int32_t j = 0; j < m.nblocks[sq]; ++j) {
            const int32_t v0 = m.vstart[row0 + j], v1 = m.vend[row0 + j];
            const int64_t blk = m.tables[row0 + j];
            const int32_t first = m.first[row0 + j];
            for (int32_t c0 = v0; c0 < v1; c0 += KEY_CHUNK) {
              const int64_t n = std::min<int64_t>(KEY_CHUNK, v1 - c0);
              const int64_t off = blk * cb + c0 * cs + h * ch;
              const float* cs_chunk = cos_sin + static_cast<int64_t>(first + c0 - v0) * cs_stride;
              for (int64_t c = 0; c < n; ++c)
                rotate_into(k_ptr + off + c * cs, rows_buf.data() + c * d,
                            cs_chunk + c * cs_stride, d, neox);
              transpose_keys(rows_buf.data(), n, d, out);
              out += d * KEY_CHUNK;
            }
          }
        }
      }
    }
  }
  auto kt_for = [&](const WorkItem& w) -> const float* {
    const int64_t first = kt_of[w.seq];
    if (first < 0 || w.split >= 0) return nullptr;
    const int64_t si = kt_index[w.seq];
    const int64_t seq_chunks =
        (si + 1 < static_cast<int64_t>(kt_seqs.size()) ? kt_seq_chunks[si + 1]
                                                        : kt_chunks_total) -
        kt_seq_chunks[si];
    return kt_data + (kt_seq_chunks[si] + w.kv_head * (seq_chunks / hkv)) * d * KEY_CHUNK;
  };
#endif
#pragma omp parallel num_threads(threads)
  {
    Scratch& scratch = thread_scratch(max_rows, d);
    float* own = scratch.own.data();
    float* own_mx = scratch.own_mx.data();
    float* own_sm = scratch.own_sm.data();
#pragma omp for schedule(dynamic, 1)
    for (int64_t o = 0; o < n; ++o) {
      const int64_t i = order[o];
      const WorkItem& w = work[i];
      const bool split = slot[i] >= 0;
      float* rows_out = split ? acc + slot[i] * max_rows * d : own;
      float* rows_mx = split ? mx + slot[i] * max_rows : own_mx;
      float* rows_sm = split ? sm + slot[i] * max_rows : own_sm;
      bool done = false;
#if defined(MEPIC_CPU_AMX) && defined(MEPIC_CPU_AVX512)
      AmxPack pk;
      if (any_amx && pack_for(w, pk)) {
        attend_amx<QT>(w, q_ptr, qs0, qs1, pk, m, cos_sin, cs_stride, neox, scale, group, d,
                       scratch, rows_out, rows_mx, rows_sm);
        done = true;
      }
      if constexpr (std::is_same_v<KT, at::BFloat16>) {
        if (!done && amx_decode && w.q_end - w.q_begin == 1) {
          attend_amx_decode<QT>(w, q_ptr, qs0, qs1, k_ptr, v_ptr, cb, cs, ch, m, cos_sin,
                                cs_stride, neox, scale, group, d, scratch, rows_out, rows_mx,
                                rows_sm);
          done = true;
        }
      }
#endif
      if (!done) {
        const float* packed_kt = nullptr;
        const int64_t* bases = nullptr;
#ifdef MEPIC_CPU_AVX512
        packed_kt = kt_data != nullptr ? kt_for(w) : nullptr;
        if (packed_kt != nullptr) bases = chunk_base.data() + kt_of[w.seq];
#endif
        attend<QT, KT>(w, q_ptr, qs0, qs1, k_ptr, v_ptr, cb, cs, ch, m, cos_sin, cs_stride,
                       neox, scale, group, d, scratch, rows_out, rows_mx, rows_sm, packed_kt,
                       bases);
      }
      if (split) continue;
      const int64_t rows = (w.q_end - w.q_begin) * group;
      for (int64_t r = 0; r < rows; ++r) {
        const float inv = rows_sm[r] > 0.f ? 1.f / rows_sm[r] : 0.f;  // no visible key: 0
        const int64_t t = w.q_begin + r / group;
        const int64_t head = static_cast<int64_t>(w.kv_head) * group + r % group;
        QT* dst = o_ptr + t * os0 + head * os1;
        store_scaled(dst, rows_out + r * d, inv, d);
      }
    }
#if defined(MEPIC_CPU_AMX) && defined(MEPIC_CPU_AVX512)
    if (any_amx || amx_decode) amx_release();
#endif
  }
  // Merge: items of one (sequence, KV head, tile) differ only by split and are adjacent.
  std::vector<float> row(d);
  for (int64_t i = 0; i < n;) {
    if (slot[i] < 0) {
      ++i;
      continue;
    }
    int64_t j = i + 1;
    while (j < n && work[j].split > 0 && work[j].seq == work[i].seq &&
           work[j].kv_head == work[i].kv_head && work[j].q_begin == work[i].q_begin)
      ++j;
    const WorkItem& w = work[i];
    const int64_t rows = (w.q_end - w.q_begin) * group;
    for (int64_t r = 0; r < rows; ++r) {
      float best = NEG_INF;
      for (int64_t p = slot[i]; p < slot[i] + j - i; ++p)
        best = std::max(best, mx[p * max_rows + r]);
      std::fill(row.begin(), row.end(), 0.f);
      float total = 0.f;
      if (best != NEG_INF) {
        for (int64_t p = slot[i]; p < slot[i] + j - i; ++p) {
          const float m_p = mx[p * max_rows + r];
          if (m_p == NEG_INF) continue;
          const float wgt = std::exp(m_p - best);
          total += wgt * sm[p * max_rows + r];
          axpy(wgt, acc + (p * max_rows + r) * d, row.data(), d);
        }
      }
      const float inv = total > 0.f ? 1.f / total : 0.f;  // no visible key: 0
      const int64_t t = w.q_begin + r / group;
      const int64_t head = static_cast<int64_t>(w.kv_head) * group + r % group;
      QT* dst = o_ptr + t * os0 + head * os1;
      store_scaled(dst, row.data(), inv, d);
    }
    i = j;
  }
}

at::Tensor contiguous_int32(const at::Tensor& t) {
  return t.to(at::kInt).contiguous();
}

}  // namespace
}  // namespace mepic_cpu

// query [T, Hq, D]; kv_cache [2, num_blocks, B, Hkv, D] (any strides, last dim contiguous);
// cos_sin_cache [max_pos, D] (cos | sin); metadata as in ascend_mepic/ops/metadata.py. The
// rows go to `out` ([T, Hq, D], the query's dtype, last dim contiguous) when it is defined,
// else to a new tensor; either is returned.
at::Tensor attention_into(const at::Tensor& query, const at::Tensor& kv_cache,
                          const at::Tensor& query_start_loc, const at::Tensor& query_positions,
                          const at::Tensor& query_indices, const at::Tensor& block_tables,
                          const at::Tensor& num_blocks, const at::Tensor& block_first_pos,
                          const at::Tensor& block_valid_start, const at::Tensor& block_valid_end,
                          const at::Tensor& cos_sin_cache, bool is_neox, double scale,
                          int64_t num_splits, at::Tensor out) {
  TORCH_CHECK(query.device().is_cpu() && kv_cache.device().is_cpu(), "CPU tensors only");
  TORCH_CHECK(query.dim() == 3 && kv_cache.dim() == 5 && kv_cache.size(0) == 2,
              "query [T, Hq, D] and kv_cache [2, num_blocks, B, Hkv, D] expected");
  const int64_t d = query.size(2);
  TORCH_CHECK(kv_cache.size(4) == d && cos_sin_cache.size(1) == d && d % 2 == 0,
              "head dims of query, cache and cos_sin_cache must agree and be even");
  TORCH_CHECK(query.size(1) % kv_cache.size(3) == 0, "query heads must be a multiple of KV heads");
  TORCH_CHECK(kv_cache.stride(4) == 1, "the cache's head dimension must be contiguous");
  const at::Tensor q = query.stride(2) == 1 ? query : query.contiguous();
  if (out.defined()) {
    TORCH_CHECK(out.device().is_cpu() && out.scalar_type() == q.scalar_type() &&
                    out.sizes() == q.sizes() && out.stride(2) == 1,
                "out must be a CPU tensor of the query's shape ", q.sizes(), " and dtype ",
                q.scalar_type(), " with a contiguous last dimension; got ", out.sizes(), " ",
                out.scalar_type());
  } else {
    out = q.new_empty(q.sizes());  // contiguous, the query's dtype and device
  }
  if (q.size(0) == 0) return out;
  const at::Tensor cs = cos_sin_cache.to(at::kFloat).contiguous();
  using mepic_cpu::contiguous_int32;
  const at::Tensor loc = contiguous_int32(query_start_loc), pos = contiguous_int32(query_positions),
                   idx = contiguous_int32(query_indices), tables = contiguous_int32(block_tables),
                   nb = contiguous_int32(num_blocks), first = contiguous_int32(block_first_pos),
                   vs = contiguous_int32(block_valid_start), ve = contiguous_int32(block_valid_end);
  mepic_cpu::Meta m{loc.data_ptr<int32_t>(), pos.data_ptr<int32_t>(),    idx.data_ptr<int32_t>(),
         tables.data_ptr<int32_t>(), nb.data_ptr<int32_t>(),  first.data_ptr<int32_t>(),
         vs.data_ptr<int32_t>(),     ve.data_ptr<int32_t>(),  tables.size(1),
         kv_cache.size(2),           tables.size(0)};
  const float* cs_ptr = cs.data_ptr<float>();
  const float sc = static_cast<float>(scale);
  const auto qt = q.scalar_type(), kt = kv_cache.scalar_type();
  const bool q32 = qt == at::kFloat, k32 = kt == at::kFloat;
  TORCH_CHECK((q32 || qt == at::kBFloat16) && (k32 || kt == at::kBFloat16),
              "query and cache must be float32 or bfloat16");
  if (q32 && k32)
    mepic_cpu::run<float, float>(q, kv_cache, m, cs_ptr, d, is_neox, sc, out, num_splits);
  else if (q32)
    mepic_cpu::run<float, at::BFloat16>(q, kv_cache, m, cs_ptr, d, is_neox, sc, out, num_splits);
  else if (k32)
    mepic_cpu::run<at::BFloat16, float>(q, kv_cache, m, cs_ptr, d, is_neox, sc, out, num_splits);
  else
    mepic_cpu::run<at::BFloat16, at::BFloat16>(q, kv_cache, m, cs_ptr, d, is_neox, sc, out, num_splits);
#ifdef MEPIC_CPU_GUARD
  const auto [broken, bytes] = mepic_cpu::guard_violations();
  TORCH_CHECK(broken == 0, "ascend_mepic CPU kernel (guard build): this call wrote past ", broken,
              " buffer(s) (the first of ", bytes, " bytes)");
#endif
  return out;
}

at::Tensor rope_paged_attention(const at::Tensor& query, const at::Tensor& kv_cache,
                                const at::Tensor& query_start_loc,
                                const at::Tensor& query_positions,
                                const at::Tensor& query_indices, const at::Tensor& block_tables,
                                const at::Tensor& num_blocks, const at::Tensor& block_first_pos,
                                const at::Tensor& block_valid_start,
                                const at::Tensor& block_valid_end, const at::Tensor& cos_sin_cache,
                                bool is_neox, double scale, int64_t num_splits) {
  return attention_into(query, kv_cache, query_start_loc, query_positions, query_indices,
                        block_tables, num_blocks, block_first_pos, block_valid_start,
                        block_valid_end, cos_sin_cache, is_neox, scale, num_splits, at::Tensor());
}

// rope_paged_attention into the caller's buffer (the attention layer's output): no fresh
// tensor per call (page faults, 32 MB for a float32 prefill of 2k tokens at 32 x 128) and no
// copy after.
void rope_paged_attention_out(const at::Tensor& query, const at::Tensor& kv_cache,
                              const at::Tensor& query_start_loc, const at::Tensor& query_positions,
                              const at::Tensor& query_indices, const at::Tensor& block_tables,
                              const at::Tensor& num_blocks, const at::Tensor& block_first_pos,
                              const at::Tensor& block_valid_start,
                              const at::Tensor& block_valid_end, const at::Tensor& cos_sin_cache,
                              bool is_neox, double scale, int64_t num_splits, at::Tensor& out) {
  TORCH_CHECK(out.defined(), "out must be a tensor");
  attention_into(query, kv_cache, query_start_loc, query_positions, query_indices, block_tables,
                 num_blocks, block_first_pos, block_valid_start, block_valid_end, cos_sin_cache,
                 is_neox, scale, num_splits, out);
}
