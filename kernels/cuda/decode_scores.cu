// Scores-only decode pass (see decode_scores.cuh): the decode attention split kernel's
// scores-only variant (decode_attention_split.cuh ScoresOnlyVariant): key tiles through the same
// copies (whole-block tensor copies when the pool size is given), S = Q K^T on tensor cores, the
// raw scores written; no values, no P V; with the lse wanted, each split's softmax statistics and
// the merge of their lse.
#include <string>

#include "kernels/cuda/cuda_status.h"
#include "kernels/cuda/decode_attention.cuh"
#include "kernels/cuda/decode_scores.cuh"

namespace rubato::cuda {

size_t DecodeScoresWorkspaceBytes(int batch, int num_heads, int max_seq_len) {
  return DecodeScoresOnlyWorkspaceBytes(batch, num_heads, max_seq_len);
}

Status DecodeScores(const DecodeScoresParams& p, cudaStream_t stream) {
  if (p.batch == 0) return Status::Ok();
  if (p.batch < 0 || p.num_kv_heads < 1 || p.num_heads % p.num_kv_heads != 0 || p.max_seq_len < 1 ||
      p.scores_stride < p.max_seq_len || p.block_tokens < 1) {
    return InvalidArgumentError(
        "decode scores: bad shape (batch " + std::to_string(p.batch) + ", heads " +
        std::to_string(p.num_heads) + "/" + std::to_string(p.num_kv_heads) + ", max_seq_len " +
        std::to_string(p.max_seq_len) + ", stride " + std::to_string(p.scores_stride) + ")");
  }
  if (p.q == nullptr || p.key_pool == nullptr || p.block_tables == nullptr ||
      p.seq_lens == nullptr || p.scores == nullptr) {
    return InvalidArgumentError("decode scores: a required pointer is null");
  }
  DecodeAttentionParams d;
  d.q = p.q;
  d.q_row_stride = p.q_row_stride;
  d.key_pool = p.key_pool;
  d.num_pool_blocks = p.num_pool_blocks;
  d.block_tables = p.block_tables;
  d.block_table_stride = p.block_table_stride;
  d.seq_lens = p.seq_lens;
  d.batch = p.batch;
  d.num_heads = p.num_heads;
  d.num_kv_heads = p.num_kv_heads;
  d.head_dim = p.head_dim;
  d.block_tokens = p.block_tokens;
  d.max_seq_len = p.max_seq_len;
  d.scale = p.scale;
  d.scores = p.scores;
  d.scores_stride = p.scores_stride;
  d.scores_only = true;
  d.lse = p.lse;
  d.workspace = p.workspace;
  d.workspace_bytes = p.workspace_bytes;
  const Status status = DecodeAttention(d, stream);
  if (status.ok()) return status;
  return Status(status.code(), "decode scores: " + status.message());
}

}  // namespace rubato::cuda
