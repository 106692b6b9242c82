// Oracle top-k on the CUDA model (see oracle_topk_cuda_backend.h).
#include "inference_rank/policies/oracle_topk/oracle_topk_cuda_backend.h"

#include <algorithm>
#include <bit>
#include <string>

#include "common/sizes.h"
#include "inference_rank/model/cuda_model.h"
#include "kernels/cuda/compact_gather.cuh"
#include "kernels/cuda/device_buffer.h"
#include "kernels/cuda/pooled_top_k.cuh"

namespace rubato {
namespace {

class OracleTopKCudaBackend final : public CudaAttentionBackend {
 public:
  OracleTopKCudaBackend(const CudaModel& model, const OracleTopKConfig& config)
      : owner_(&model), model_(model.config()), config_(config) {}

  const Model* made_for_model() const override { return owner_; }

  Status CheckBatch(std::span<const ForwardEntry> batch) const override {
    for (size_t e = 0; e < batch.size(); ++e) {
      const EntryAttention* attention = batch[e].attention;
      if (attention == nullptr) continue;
      const int length = batch[e].start_position + 1;
      if (attention->action.op != AttentionOp::kTwoSegment ||
          attention->row_group != kOracleTopKRows ||
          attention->action.recent_begin != OracleCandidatesFor(config_, length).recent_begin) {
        return InvalidArgumentError("forward: batch entry " + std::to_string(e) +
                                    ": not an oracle_topk plan of this config");
      }
    }
    return Status::Ok();
  }

  Status Reserve(std::span<const ForwardEntry> batch, const ForwardPlan& plan,
                 const std::function<void()>& drop_graphs) override;
  size_t StepInputBytes() const override { return 3 * Align16(sizeof(int32_t) * row_capacity_); }

  void FillStepInputs(std::span<const ForwardEntry> batch, const ForwardPlan& plan,
                      const KvCacheShape& /*shape*/, std::byte* region) override {
    int32_t* sink_end = reinterpret_cast<int32_t*>(region);
    int32_t* count = sink_end + Align16(sizeof(int32_t) * row_capacity_) / sizeof(int32_t);
    int32_t* recent_begin = count + Align16(sizeof(int32_t) * row_capacity_) / sizeof(int32_t);
    for (size_t e = 0; e < batch.size(); ++e) {
      if (batch[e].attention == nullptr) continue;
      const int row = plan.entry_first_row[e] - rows_.first_row;
      const OracleCandidates c = OracleCandidatesFor(config_, batch[e].start_position + 1);
      sink_end[row] = c.sink_end;
      count[row] = c.count();
      recent_begin[row] = c.recent_begin;
    }
  }

  void AddToGraphKey(const ForwardPlan& /*plan*/, DecodeGraphKey& key) const override {
    key.policy = {rows_.rows,
                  k_,
                  reinterpret_cast<intptr_t>(compact_keys_.data()),
                  reinterpret_cast<intptr_t>(scores_.data()),
                  score_stride_,
                  0};
  }

  Status Attend(const CudaLayerContext& layer) override;

 private:
  const Model* owner_;
  ModelConfig model_;
  OracleTopKConfig config_;
  // The current step's rows and shapes (Reserve).
  DecodeRowGroup rows_;  // its decode rows
  int k_ = 0;            // min(top_k, the decode bucket): selected positions per row and head
  int capacity_ = 0;     // compact rows per (row, KV head): sink + k
  int max_count_ = 0;    // candidates per row at most: the decode bucket
  int64_t score_stride_ = 0;
  int row_capacity_ = 0;                         // rows the buffers below hold
  cuda::DeviceBuffer<float> scores_;             // [rows][heads][score stride], log2 units
  cuda::DeviceBuffer<__nv_bfloat16> dense_out_;  // [rows][q_dim], bf16: the pass's output
  cuda::DeviceBuffer<int32_t> selected_;         // [rows][kv_heads][k]
  cuda::DeviceBuffer<int32_t> selected_count_;   // [rows][kv_heads]
  cuda::DeviceBuffer<unsigned char> top_k_workspace_;
  cuda::DeviceBuffer<__nv_bfloat16> compact_keys_;    // [rows][kv_heads][capacity][head_dim]
  cuda::DeviceBuffer<__nv_bfloat16> compact_values_;  // [rows][kv_heads][capacity][head_dim]
  cuda::DeviceBuffer<int32_t> compact_counts_;        // [rows][kv_heads]
};

Status OracleTopKCudaBackend::Reserve(std::span<const ForwardEntry> batch, const ForwardPlan& plan,
                                      const std::function<void()>& drop_graphs) {
  rows_ = plan.Group(kOracleTopKRows);  // every entry it planned
  if (rows_.rows == 0) return Status::Ok();
  const int rows = RoundUpPow2(rows_.rows);
  if (rows > row_capacity_) {
    drop_graphs();  // the step-input region's layout follows the row capacity
    row_capacity_ = rows;
  }
  max_count_ = plan.decode_max_seq_len;
  k_ = std::min(config_.top_k, max_count_);
  capacity_ = config_.sink_tokens + k_;
  score_stride_ = (static_cast<int64_t>(max_count_) + 63) / 64 * 64;
  const size_t r = static_cast<size_t>(row_capacity_);
  const size_t heads = static_cast<size_t>(model_.num_heads);
  const size_t kv_heads = static_cast<size_t>(model_.num_kv_heads);
  const size_t compact = r * kv_heads * capacity_ * model_.head_dim;
  RUBATO_RETURN_IF_ERROR(
      GrowBackendBuffer(scores_, r * heads * score_stride_, "oracle_topk scores", drop_graphs));
  RUBATO_RETURN_IF_ERROR(
      GrowBackendBuffer(dense_out_, r * model_.q_dim(), "oracle_topk dense pass", drop_graphs));
  RUBATO_RETURN_IF_ERROR(
      GrowBackendBuffer(selected_, r * kv_heads * k_, "oracle_topk selection", drop_graphs));
  RUBATO_RETURN_IF_ERROR(
      GrowBackendBuffer(selected_count_, r * kv_heads, "oracle_topk selection", drop_graphs));
  RUBATO_RETURN_IF_ERROR(
      GrowBackendBuffer(top_k_workspace_,
                        cuda::PooledTopKWorkspaceBytes(row_capacity_, model_.num_heads,
                                                       model_.num_kv_heads, max_count_),
                        "oracle_topk top-k workspace", drop_graphs));
  RUBATO_RETURN_IF_ERROR(
      GrowBackendBuffer(compact_keys_, compact, "oracle_topk compact keys", drop_graphs));
  RUBATO_RETURN_IF_ERROR(
      GrowBackendBuffer(compact_values_, compact, "oracle_topk compact values", drop_graphs));
  return GrowBackendBuffer(compact_counts_, r * kv_heads, "oracle_topk compact counts",
                           drop_graphs);
}

Status OracleTopKCudaBackend::Attend(const CudaLayerContext& layer) {
  if (rows_.rows == 0) return Status::Ok();
  const auto* inputs = reinterpret_cast<const int32_t*>(layer.policy_inputs);
  const size_t array = Align16(sizeof(int32_t) * row_capacity_) / sizeof(int32_t);
  const int32_t* sink_end = inputs;
  const int32_t* count = inputs + array;
  const int32_t* recent_begin = inputs + 2 * array;

  // 1. Dense attention of the rows, for its raw scores (its output is not the rows').
  cuda::DecodeAttentionParams dense = layer.DecodeRows(rows_.first_row, rows_.rows);
  dense.out = dense_out_.data();
  dense.scores = scores_.data();
  dense.scores_stride = score_stride_;
  RUBATO_RETURN_IF_ERROR(cuda::DecodeAttention(dense, layer.stream));

  // 2. The k best candidates of every row and KV head.
  cuda::PooledTopKParams top_k;
  top_k.scores = scores_.data();
  top_k.scores_stride = score_stride_;
  top_k.begin = sink_end;
  top_k.count = count;
  top_k.max_count = max_count_;
  top_k.batch = rows_.rows;
  top_k.num_heads = model_.num_heads;
  top_k.num_kv_heads = model_.num_kv_heads;
  top_k.k = k_;
  top_k.selected = selected_.data();
  top_k.selected_count = selected_count_.data();
  top_k.workspace = top_k_workspace_.data();
  top_k.workspace_bytes = top_k_workspace_.size();
  RUBATO_RETURN_IF_ERROR(cuda::PooledTopK(top_k, layer.stream));

  // 3. Sink + selected rows into the rows' compact buffers.
  cuda::CompactGatherParams gather;
  gather.key_pool = layer.kv->layer_keys(layer.layer);
  gather.value_pool = layer.kv->layer_values(layer.layer);
  gather.num_pool_blocks = layer.kv->shape().num_blocks;
  gather.block_tables = layer.decode_block_tables +
                        static_cast<size_t>(rows_.first_row) * layer.plan->decode_table_stride;
  gather.block_table_stride = layer.plan->decode_table_stride;
  gather.sink_end = sink_end;
  gather.max_sink_tokens = config_.sink_tokens;
  gather.selected = selected_.data();
  gather.selected_count = selected_count_.data();
  gather.budget = k_;
  gather.batch = rows_.rows;
  gather.num_kv_heads = model_.num_kv_heads;
  gather.head_dim = model_.head_dim;
  gather.block_tokens = layer.kv->shape().block_tokens;
  gather.compact_keys = compact_keys_.data();
  gather.compact_values = compact_values_.data();
  gather.compact_capacity = capacity_;
  gather.compact_counts = compact_counts_.data();
  RUBATO_RETURN_IF_ERROR(cuda::GatherCompactKv(gather, layer.stream));

  // 4. The rows' attention: compact rows, then the recent segment in place.
  cuda::DecodeAttentionParams sparse = layer.DecodeRows(rows_.first_row, rows_.rows);
  sparse.compact_keys = compact_keys_.data();
  sparse.compact_values = compact_values_.data();
  sparse.compact_capacity = capacity_;
  sparse.compact_counts = compact_counts_.data();
  sparse.recent_begin = recent_begin;
  sparse.max_recent_tokens = std::min(config_.recent_window, layer.plan->decode_max_seq_len);
  return cuda::DecodeAttention(sparse, layer.stream);
}

}  // namespace

Result<std::unique_ptr<AttentionBackend>> MakeOracleTopKCudaBackend(CudaModel& model,
                                                                    const OracleTopKConfig& config,
                                                                    int /*max_batch*/) {
  return std::unique_ptr<AttentionBackend>(new OracleTopKCudaBackend(model, config));
}

}  // namespace rubato
