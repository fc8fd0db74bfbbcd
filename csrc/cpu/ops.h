// The library's ops, as torch registers them (bindings.cpp), each defined in the unit of its
// concern: attention in rope_paged_attention.cpp, write_kv in write_kv.cpp, isa and set_amx in
// dispatch.cpp, guard_selftest (guard builds only) in guard.cpp. A declaration, so that units
// need not include torch to name at::Tensor.
#pragma once

#include <cstdint>
#include <string>

namespace at {
class Tensor;
}  // namespace at

at::Tensor rope_paged_attention(const at::Tensor& query, const at::Tensor& kv_cache,
                                const at::Tensor& query_start_loc,
                                const at::Tensor& query_positions,
                                const at::Tensor& query_indices, const at::Tensor& block_tables,
                                const at::Tensor& num_blocks, const at::Tensor& block_first_pos,
                                const at::Tensor& block_valid_start,
                                const at::Tensor& block_valid_end, const at::Tensor& cos_sin_cache,
                                bool is_neox, double scale, int64_t num_splits);

void rope_paged_attention_out(const at::Tensor& query, const at::Tensor& kv_cache,
                              const at::Tensor& query_start_loc, const at::Tensor& query_positions,
                              const at::Tensor& query_indices, const at::Tensor& block_tables,
                              const at::Tensor& num_blocks, const at::Tensor& block_first_pos,
                              const at::Tensor& block_valid_start,
                              const at::Tensor& block_valid_end, const at::Tensor& cos_sin_cache,
                              bool is_neox, double scale, int64_t num_splits, at::Tensor& out);

void write_kv(const at::Tensor& key, const at::Tensor& value, at::Tensor kv_cache,
              const at::Tensor& slot_mapping);

std::string isa();

bool set_amx(bool enabled);

#ifdef MEPIC_CPU_GUARD
bool guard_selftest();
#endif
