// The ops' schemas and their CPU implementations, registered with torch as
// torch.ops.ascend_mepic.* (the library's only entry points; ops/cpu_kernel.py calls them).
#include <torch/library.h>

#include "ops.h"

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
