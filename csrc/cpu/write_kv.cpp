// The write_kv op: un-rotated K and V rows stored into the paged cache at their slots,
// converting to the cache's dtype, in one native call per layer (no index tensors per call).
//
// Independent of the attention paths and of the instruction set (plain loops the compiler
// vectorises).
#include <ATen/core/Tensor.h>

#include <algorithm>
#include <cstdint>
#include <type_traits>

#include "ops.h"

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
