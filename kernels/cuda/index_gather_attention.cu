// Index-gather sparse decode attention (see index_gather_attention.cuh): the decode attention
// split kernel with a list key space (decode_attention_split.cuh ListVariant), its rows copied
// from wherever the list points, S = Q K^T and P V on tensor cores, then the same merge.
#include <algorithm>
#include <string>

#include "kernels/cuda/cuda_status.h"
#include "kernels/cuda/decode_attention.cuh"
#include "kernels/cuda/index_gather_attention.cuh"

namespace rubato::cuda {

size_t IndexGatherAttentionWorkspaceBytes(int batch, int num_heads, int head_dim, int capacity) {
  return DecodeAttentionWorkspaceBytes(batch, num_heads, head_dim, capacity, false);
}

Status IndexGatherAttention(const IndexGatherAttentionParams& p, cudaStream_t stream) {
  if (p.batch == 0) return Status::Ok();
  if (p.batch < 0 || p.num_kv_heads < 1 || p.num_heads % p.num_kv_heads != 0 || p.capacity < 1 ||
      p.list_heads < 1 || p.block_tokens < 1) {
    return InvalidArgumentError(
        "index-gather attention: bad shape (batch " + std::to_string(p.batch) + ", heads " +
        std::to_string(p.num_heads) + "/" + std::to_string(p.num_kv_heads) + ", capacity " +
        std::to_string(p.capacity) + ", list heads " + std::to_string(p.list_heads) + ")");
  }
  if (p.q == nullptr || p.key_pool == nullptr || p.value_pool == nullptr ||
      p.block_tables == nullptr || p.lists == nullptr || p.counts == nullptr || p.out == nullptr ||
      p.workspace == nullptr) {
    return InvalidArgumentError("index-gather attention: a required pointer is null");
  }
  DecodeAttentionParams d;
  d.q = p.q;
  d.q_row_stride = p.q_row_stride;
  d.key_pool = p.key_pool;
  d.value_pool = p.value_pool;
  d.block_tables = p.block_tables;
  d.block_table_stride = p.block_table_stride;
  d.batch = p.batch;
  d.num_heads = p.num_heads;
  d.num_kv_heads = p.num_kv_heads;
  d.head_dim = p.head_dim;
  d.block_tokens = p.block_tokens;
  // Positions are bounded by the block tables alone.
  d.max_seq_len = static_cast<int>(std::clamp<long long>(
      static_cast<long long>(p.block_table_stride) * p.block_tokens, 1, INT32_MAX));
  d.scale = p.scale;
  d.lists = p.lists;
  d.list_counts = p.counts;
  d.list_capacity = p.capacity;
  d.list_heads = p.list_heads;
  d.list_head_map = p.head_map;
  d.out = p.out;
  d.out_row_stride = p.out_row_stride;
  d.lse = p.lse;
  d.workspace = p.workspace;
  d.workspace_bytes = p.workspace_bytes;
  d.num_splits = p.num_splits;
  const Status status = DecodeAttention(d, stream);
  if (status.ok()) return status;
  return Status(status.code(), "index-gather attention: " + std::string(status.message()));
}

}  // namespace rubato::cuda
