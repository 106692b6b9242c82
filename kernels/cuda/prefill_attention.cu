// Causal prefill attention on the GPU (prefill_attention.cuh): the launcher, the kDense
// instantiations and input validation; the kernel is prefill_attention_kernel.cuh.
// The loop and masks: docs/cuda_model.md "Prefill attention".
#include <cmath>
#include <cstdint>
#include <string>

#include "kernels/cuda/launch_checks.h"
#include "kernels/cuda/prefill_attention_kernel.cuh"

namespace rubato::cuda {
namespace {

Status ValidatePrefillAttention(const PrefillAttentionParams& params);

}  // namespace

Status PrefillAttention(const PrefillAttentionParams& params, cudaStream_t stream) {
  RUBATO_RETURN_IF_ERROR(ValidatePrefillAttention(params));
  if (params.entries == 0 || params.total_tokens == 0) return Status::Ok();
  switch (params.mode) {
    case PrefillMode::kDense:
      return prefill::LaunchPrefillAttention<PrefillMode::kDense>(params, stream);
    case PrefillMode::kLse:
      return prefill::LaunchPrefillLse(params, stream);
    case PrefillMode::kPool:
      return prefill::LaunchPrefillPool(params, stream);
    case PrefillMode::kList:
      return prefill::LaunchPrefillList(params, stream);
  }
  return InvalidArgumentError("prefill_attention: unknown mode");
}

// ---- input validation ---------------------------------------------------------------------

namespace {

Status Invalid(const std::string& message) {
  return InvalidArgumentError("prefill_attention: " + message);
}

// What the Kascade modes read and write beyond the dense launch.
Status ValidateModeFields(const PrefillAttentionParams& p) {
  const bool needs_lse = p.mode == PrefillMode::kLse || p.mode == PrefillMode::kPool;
  if (needs_lse && p.lse == nullptr) return Invalid("lse is null");
  if (p.mode == PrefillMode::kDense) return Status::Ok();
  if (p.sink_tokens != 0 || p.recent_tokens != INT_MAX) {
    return Invalid(
        "the selection modes attend the dense window only (sink_tokens 0, "
        "recent_tokens unbounded)");
  }
  if (p.tile_tokens < 64 || p.tile_tokens % 64 != 0) {
    return Invalid("tile_tokens " + std::to_string(p.tile_tokens) +
                   " must be a positive multiple of 64");
  }
  if (p.tile_base == nullptr) return Invalid("tile_base is null");
  if (p.mode == PrefillMode::kPool) {
    if (p.pooled == nullptr) return Invalid("pooled is null");
    if (p.pooled_stride < 0) {
      return Invalid("pooled_stride " + std::to_string(p.pooled_stride) + " < 0");
    }
  }
  if (p.mode == PrefillMode::kList) {
    if (p.list_capacity < 0 || p.list_heads < 1) {
      return Invalid("list_capacity " + std::to_string(p.list_capacity) + " and list_heads " +
                     std::to_string(p.list_heads) + " must be >= 0 and >= 1");
    }
    if (p.lists == nullptr || p.list_counts == nullptr) {
      return Invalid("lists and list_counts must be set");
    }
  }
  return Status::Ok();
}

Status ValidatePrefillAttention(const PrefillAttentionParams& p) {
  // Shapes first (the grid's y and z dimensions hold at most 65535).
  if (p.entries < 0 || p.entries > 65535) {
    return Invalid("entries " + std::to_string(p.entries) + " is outside [0, 65535]");
  }
  if (p.total_tokens < 0) return Invalid("total_tokens " + std::to_string(p.total_tokens) + " < 0");
  if (p.num_heads <= 0 || p.num_kv_heads <= 0 || p.num_kv_heads > 65535) {
    return Invalid("num_heads " + std::to_string(p.num_heads) + " and num_kv_heads " +
                   std::to_string(p.num_kv_heads) + " must be positive (num_kv_heads <= 65535)");
  }
  if (p.num_heads % p.num_kv_heads != 0) {
    return Invalid("num_heads " + std::to_string(p.num_heads) +
                   " is not a multiple of num_kv_heads " + std::to_string(p.num_kv_heads));
  }
  if (p.head_dim <= 0 || p.head_dim % 8 != 0) {
    // Dispatch reports the unsupported values; this only keeps the stride checks meaningful.
    return UnsupportedError("CUDA: head_dim " + std::to_string(p.head_dim) +
                            " is not supported (supported: 16, 32, 64, 128)");
  }
  if (p.entries > 0 && p.total_tokens > 0 &&
      (p.max_query_tokens < 1 || p.max_query_tokens > p.total_tokens ||
       static_cast<int64_t>(p.max_query_tokens) * p.entries < p.total_tokens)) {
    return Invalid("max_query_tokens " + std::to_string(p.max_query_tokens) +
                   " cannot be the largest of " + std::to_string(p.entries) + " entries holding " +
                   std::to_string(p.total_tokens) + " tokens");
  }
  if (p.block_tokens <= 0) {
    return Invalid("block_tokens " + std::to_string(p.block_tokens) + " <= 0");
  }
  if (p.block_table_stride <= 0) {
    return Invalid("block_table_stride " + std::to_string(p.block_table_stride) + " <= 0");
  }
  const int64_t row_elements = static_cast<int64_t>(p.num_heads) * p.head_dim;
  if (p.q_row_stride < row_elements || p.q_row_stride % 8 != 0) {
    return Invalid(
        "q_row_stride " + std::to_string(p.q_row_stride) +
        " must be a multiple of 8 and >= num_heads * head_dim = " + std::to_string(row_elements));
  }
  const bool writes_out = p.mode == PrefillMode::kDense || p.mode == PrefillMode::kList;
  if (writes_out && (p.out_row_stride < row_elements || p.out_row_stride % 8 != 0)) {
    return Invalid(
        "out_row_stride " + std::to_string(p.out_row_stride) +
        " must be a multiple of 8 and >= num_heads * head_dim = " + std::to_string(row_elements));
  }
  if (!std::isfinite(p.scale)) return Invalid("scale is not finite");
  if (p.sink_tokens < 0) return Invalid("sink_tokens " + std::to_string(p.sink_tokens) + " < 0");
  if (p.recent_tokens < 1) {
    return Invalid("recent_tokens " + std::to_string(p.recent_tokens) + " < 1");
  }
  if (p.entries == 0 || p.total_tokens == 0) return Status::Ok();  // nothing will be read
  RUBATO_RETURN_IF_ERROR(ValidateModeFields(p));

  // Pointers: present, and 16-byte aligned where the kernel moves 16-byte chunks.
  const struct {
    const void* pointer;
    const char* name;
    bool chunked;
  } pointers[] = {{p.q, "q", true},
                  {p.key_pool, "key_pool", true},
                  {p.value_pool, "value_pool", true},
                  {writes_out ? p.out : p.q, "out", true},  // kLse, kPool: unused
                  {p.block_tables, "block_tables", false},
                  {p.query_start, "query_start", false},
                  {p.start_position, "start_position", false}};
  for (const auto& [pointer, name, chunked] : pointers) {
    if (pointer == nullptr) return Invalid(std::string(name) + " is null");
    if (chunked && !Aligned16(pointer)) {
      return Invalid(std::string(name) + " is not 16-byte aligned");
    }
  }
  return Status::Ok();
}

}  // namespace
}  // namespace rubato::cuda
