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
// bfloat16 products, float32 sums). The file is compiled once per instruction set (ops/
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

#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <omp.h>
#include <torch/library.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstdlib>
#include <new>
#include <bit>
#include <limits>
#include <string>
#include <type_traits>
#include <vector>

#if defined(__AVX2__) && defined(__FMA__)
#include <immintrin.h>
#endif
#if defined(__AVX512F__) && defined(__GNUC__) && !defined(__clang__) && __GNUC__ >= 11
#include <cpuid.h>
#include <sys/syscall.h>
#include <unistd.h>
#define MEPIC_CPU_AMX 1
#endif
#include <atomic>
#if defined(MEPIC_CPU_GUARD) || defined(MEPIC_AMX_EMULATE)
#include <cstdio>
#include <cstring>
#endif
#ifdef MEPIC_CPU_GUARD
#include <mutex>
#include <unordered_map>
#endif

namespace {

// 64 queries (times the GQA group) per item: every K chunk and V slice a core brings into L1
// serves that many rows (32 and 16 were 5-15% slower in prefill on an AVX-512/AMX Xeon).
constexpr int64_t QUERY_TILE = 64;

#ifdef MEPIC_CPU_GUARD
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

// Live buffers whose guard was overwritten (and the size of the first), checked and re-armed.
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
#endif

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

constexpr int64_t KEY_CHUNK = 64;

// Scratch of one thread: rotated queries, a chunk of rotated keys and of values (row-major),
// the chunk's scores, and its work item's outputs. Each thread keeps its own across calls,
// grown to the largest call so far and never shrunk: allocating (and zero-filling) it per call
// cost about 20 us of page faults, more than a short decode step's attention.
constexpr int64_t AMX_STEP = 256;  // keys per softmax step of the AMX path

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

#if defined(__AVX2__) && defined(__FMA__)
#define MEPIC_CPU_AVX2 1

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

#if defined(__AVX512F__) && defined(MEPIC_CPU_AVX2)
#define MEPIC_CPU_AVX512 1
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

#ifdef MEPIC_AMX_EMULATE
// Test builds only (tests/ops/test_cpu_kernel_amx_emulated.py, and the guard build on CPUs
// without AMX): the six tile instructions this file uses, done in scalar code on a per-thread
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

constexpr int64_t AMX_KEYS = 64;  // keys per step: four 16-key score tiles, two 32-key P V steps

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

bool amx_enabled() {
  int state = g_amx_state.load(std::memory_order_relaxed);
  if (state < 0) {
    state = g_amx_allowed && amx_supported() ? 1 : 0;
    g_amx_state.store(state);
  }
  return state == 1;
}

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
    out = at::empty_like(q, q.options().memory_format(at::MemoryFormat::Contiguous));
  }
  if (q.size(0) == 0) return out;
  const at::Tensor cs = cos_sin_cache.to(at::kFloat).contiguous();
  const at::Tensor loc = contiguous_int32(query_start_loc), pos = contiguous_int32(query_positions),
                   idx = contiguous_int32(query_indices), tables = contiguous_int32(block_tables),
                   nb = contiguous_int32(num_blocks), first = contiguous_int32(block_first_pos),
                   vs = contiguous_int32(block_valid_start), ve = contiguous_int32(block_valid_end);
  Meta m{loc.data_ptr<int32_t>(), pos.data_ptr<int32_t>(),    idx.data_ptr<int32_t>(),
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
    run<float, float>(q, kv_cache, m, cs_ptr, d, is_neox, sc, out, num_splits);
  else if (q32)
    run<float, at::BFloat16>(q, kv_cache, m, cs_ptr, d, is_neox, sc, out, num_splits);
  else if (k32)
    run<at::BFloat16, float>(q, kv_cache, m, cs_ptr, d, is_neox, sc, out, num_splits);
  else
    run<at::BFloat16, at::BFloat16>(q, kv_cache, m, cs_ptr, d, is_neox, sc, out, num_splits);
#ifdef MEPIC_CPU_GUARD
  const auto [broken, bytes] = guard_violations();
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

namespace {

template <typename S, typename T>
void copy_rows(const S* src, int64_t src_stride, T* dst, int64_t dst_stride, int64_t rows,
               int64_t d) {
  for (int64_t r = 0; r < rows; ++r) {
    const S* a = src + r * src_stride;
    T* b = dst + r * dst_stride;
    if constexpr (std::is_same_v<S, T>) {
      std::copy(a, a + d, b);
    } else {
#pragma omp simd
      for (int64_t x = 0; x < d; ++x) b[x] = static_cast<T>(static_cast<float>(a[x]));
    }
  }
}

template <typename S, typename T>
void write_rows(const at::Tensor& key, const at::Tensor& value, at::Tensor& kv_cache,
                const int64_t* slots, int64_t n) {
  const int64_t hkv = kv_cache.size(3), d = kv_cache.size(4), bs = kv_cache.size(2);
  const int64_t cb = kv_cache.stride(1), cs = kv_cache.stride(2), ch = kv_cache.stride(3);
  T* k_cache = kv_cache.data_ptr<T>();
  T* v_cache = k_cache + kv_cache.stride(0);
  const S* k = key.data_ptr<S>();
  const S* v = value.data_ptr<S>();
  const int64_t ks0 = key.stride(0), ks1 = key.stride(1), vs0 = value.stride(0),
                vs1 = value.stride(1);
  for (int64_t i = 0; i < n; ++i) {
    const int64_t slot = slots[i];
    if (slot < 0) continue;
    const int64_t off = (slot / bs) * cb + (slot % bs) * cs;
    copy_rows(k + i * ks0, ks1, k_cache + off, ch, hkv, d);
    copy_rows(v + i * vs0, vs1, v_cache + off, ch, hkv, d);
  }
}

}  // namespace

// Stores un-rotated K and V rows [N, Hkv, D] at flat slots block * B + offset of kv_cache
// [2, num_blocks, B, Hkv, D] (slots < 0 skipped), converting to the cache's dtype: the
// reference's write_kv without its per-call index tensors (one call per layer per step).
void write_kv(const at::Tensor& key, const at::Tensor& value, at::Tensor kv_cache,
              const at::Tensor& slot_mapping) {
  TORCH_CHECK(key.device().is_cpu() && value.device().is_cpu() && kv_cache.device().is_cpu(),
              "CPU tensors only");
  TORCH_CHECK(kv_cache.dim() == 5 && kv_cache.size(0) == 2 && kv_cache.stride(4) == 1,
              "kv_cache [2, num_blocks, B, Hkv, D] with a contiguous head dimension expected");
  TORCH_CHECK(key.dim() == 3 && key.sizes() == value.sizes() && key.size(1) == kv_cache.size(3) &&
                  key.size(2) == kv_cache.size(4),
              "key and value [N, Hkv, D] matching the cache expected");
  TORCH_CHECK(key.scalar_type() == value.scalar_type(), "key and value dtypes differ");
  TORCH_CHECK(slot_mapping.dim() == 1 && slot_mapping.size(0) >= key.size(0),
              "one slot per key row expected");
  const at::Tensor k = key.stride(2) == 1 ? key : key.contiguous();
  const at::Tensor v = value.stride(2) == 1 ? value : value.contiguous();
  const at::Tensor slots = slot_mapping.to(at::kLong).contiguous();
  const int64_t n = k.size(0);
  const int64_t limit = kv_cache.size(1) * kv_cache.size(2);
  const int64_t* sp = slots.data_ptr<int64_t>();
  for (int64_t i = 0; i < n; ++i)
    TORCH_CHECK(sp[i] < limit, "slot ", sp[i], " is outside the cache's ", limit, " slots");
  const auto st = k.scalar_type(), ct = kv_cache.scalar_type();
  const bool s32 = st == at::kFloat, c32 = ct == at::kFloat;
  TORCH_CHECK((s32 || st == at::kBFloat16) && (c32 || ct == at::kBFloat16),
              "key/value and cache must be float32 or bfloat16");
  if (s32 && c32)
    write_rows<float, float>(k, v, kv_cache, sp, n);
  else if (s32)
    write_rows<float, at::BFloat16>(k, v, kv_cache, sp, n);
  else if (c32)
    write_rows<at::BFloat16, float>(k, v, kv_cache, sp, n);
  else
    write_rows<at::BFloat16, at::BFloat16>(k, v, kv_cache, sp, n);
}

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
  if (amx_enabled()) name += "+amx";
#endif
#ifdef MEPIC_AMX_EMULATE
  name += " (AMX emulated, a test build)";
#endif
  return name;
}

// Allows or forbids the AMX path; returns whether it is in use now.
bool set_amx(bool enabled) {
#if defined(MEPIC_CPU_AMX) && defined(MEPIC_CPU_AVX512)
  g_amx_allowed = enabled;
  g_amx_state.store(-1);
  return amx_enabled();
#else
  (void)enabled;
  return false;
#endif
}

#ifdef MEPIC_CPU_GUARD
// The guard build's negative control: writes one element past a fresh grown buffer and returns
// whether the check that every call runs sees it (the buffer is then freed re-armed).
bool guard_selftest() {
  Buffer<float> b;
  grow(b, 37);
  b.data()[37] = 1.f;  // deliberately past the end
  return guard_violations().first == 1;
}
#endif

TORCH_LIBRARY(ascend_mepic, lib) {
  lib.def(
      "rope_paged_attention(Tensor query, Tensor kv_cache, Tensor query_start_loc, "
      "Tensor query_positions, Tensor query_indices, Tensor block_tables, Tensor num_blocks, "
      "Tensor block_first_pos, Tensor block_valid_start, Tensor block_valid_end, "
      "Tensor cos_sin_cache, bool is_neox, float scale, int num_splits) -> Tensor");
  lib.def(
      "rope_paged_attention_out(Tensor query, Tensor kv_cache, Tensor query_start_loc, "
      "Tensor query_positions, Tensor query_indices, Tensor block_tables, Tensor num_blocks, "
      "Tensor block_first_pos, Tensor block_valid_start, Tensor block_valid_end, "
      "Tensor cos_sin_cache, bool is_neox, float scale, int num_splits, Tensor(a!) out) -> ()");
  lib.def("write_kv(Tensor key, Tensor value, Tensor(a!) kv_cache, Tensor slot_mapping) -> ()");
  lib.def("isa() -> str", &isa);
  lib.def("set_amx(bool enabled) -> bool", &set_amx);
#ifdef MEPIC_CPU_GUARD
  lib.def("guard_selftest() -> bool", &guard_selftest);
#endif
}

TORCH_LIBRARY_IMPL(ascend_mepic, CPU, lib) {
  lib.impl("rope_paged_attention", &rope_paged_attention);
  lib.impl("rope_paged_attention_out", &rope_paged_attention_out);
  lib.impl("write_kv", &write_kv);
}

