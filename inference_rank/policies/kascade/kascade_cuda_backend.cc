// Kascade on the CUDA model (see kascade_cuda_backend.h).
#include "inference_rank/policies/kascade/kascade_cuda_backend.h"

#include <algorithm>
#include <string>
#include <vector>

#include "common/sizes.h"
#include "inference_rank/model/cuda_model.h"
#include "inference_rank/policies/kascade/kascade_cuda_prefill.h"
#include "kernels/cuda/cuda_status.h"
#include "kernels/cuda/decode_scores.cuh"
#include "kernels/cuda/device_buffer.h"
#include "kernels/cuda/index_gather_attention.cuh"
#include "kernels/cuda/pooled_top_k.cuh"

namespace rubato {
namespace {

constexpr int kKascadeRows = 1;  // the row group of its decode entries

class KascadeCudaBackend final : public CudaAttentionBackend {
 public:
  KascadeCudaBackend(const CudaModel& model, const KascadePolicy& policy)
      : owner_(&model),
        model_(model.config()),
        config_(policy.config()),
        policy_actions_(policy.layer_actions().data()),
        actions_(policy.layer_actions()),
        calibration_anchors_(policy.calibration().anchors),
        prefill_(model_, config_, static_cast<int>(calibration_anchors_.size())) {}

  // Uploads the head map ([layer][kv_head] -> the anchor's KV head).
  Status Init(const std::vector<std::vector<int>>& head_map) {
    std::vector<int32_t> flat;
    for (const auto& row : head_map) flat.insert(flat.end(), row.begin(), row.end());
    RUBATO_ASSIGN_OR_RETURN(head_maps_,
                            cuda::DeviceBuffer<int32_t>::Allocate(flat.size(), "kascade head map"));
    RUBATO_CUDA_RETURN_IF_ERROR(cudaMemcpy(head_maps_.data(), flat.data(),
                                           flat.size() * sizeof(int32_t), cudaMemcpyHostToDevice),
                                "kascade head map upload");
    return Status::Ok();
  }

  const Model* made_for_model() const override { return owner_; }

  bool AttendsPrefill() const override { return tiled_prefill(); }

  Status CheckBatch(std::span<const ForwardEntry> batch) const override {
    for (size_t e = 0; e < batch.size(); ++e) {
      const EntryAttention* attention = batch[e].attention;
      if (attention == nullptr) continue;
      if (attention->layer_actions != policy_actions_ || attention->row_group != kKascadeRows) {
        return InvalidArgumentError("forward: batch entry " + std::to_string(e) +
                                    ": not a kascade plan of this policy");
      }
      if (batch[e].tokens.size() != 1 && !tiled_prefill()) {
        return InvalidArgumentError("forward: batch entry " + std::to_string(e) +
                                    ": a kascade prefill plan while the policy's prefill is '" +
                                    config_.prefill + "'");
      }
    }
    return Status::Ok();
  }

  Status Reserve(std::span<const ForwardEntry> batch, const ForwardPlan& plan,
                 const std::function<void()>& drop_graphs) override;
  size_t StepInputBytes() const override { return DecodeInputBytes() + prefill_.StepInputBytes(); }

  // The decode rows' arrays (first: their offsets do not move when the prefill part grows), then
  // the prefill chunks' (kascade_cuda_prefill.h).
  void FillStepInputs(std::span<const ForwardEntry> batch, const ForwardPlan& plan,
                      const KvCacheShape& /*shape*/, std::byte* region) override {
    prefill_.FillStepInputs(region + DecodeInputBytes());
    const size_t array = Align16(sizeof(int32_t) * row_capacity_) / sizeof(int32_t);
    int32_t* begin = reinterpret_cast<int32_t*>(region);
    int32_t* count = begin + array;
    int32_t* row_k = count + array;
    for (size_t e = 0; e < batch.size(); ++e) {
      if (batch[e].attention == nullptr || batch[e].tokens.size() != 1) continue;
      const int row = plan.entry_first_row[e] - rows_.first_row;
      const int length = batch[e].start_position + 1;
      begin[row] = 0;
      count[row] = length;
      row_k[row] = KascadeTopK(config_, length);
    }
  }

  void AddToGraphKey(const ForwardPlan& /*plan*/, DecodeGraphKey& key) const override {
    key.policy = {rows_.rows,
                  k_capacity_,
                  reinterpret_cast<intptr_t>(selected_.data()),
                  reinterpret_cast<intptr_t>(scores_.data()),
                  score_stride_,
                  reinterpret_cast<intptr_t>(gather_workspace_.data())};
  }

  Status Attend(const CudaLayerContext& layer) override;

  Result<std::vector<std::vector<int>>> PrefillSelections(int anchor_layer) const {
    return prefill_.Selections(AnchorSlot(anchor_layer));
  }

 private:
  bool tiled_prefill() const { return config_.prefill == "tiled"; }
  size_t DecodeInputBytes() const { return 3 * Align16(sizeof(int32_t) * row_capacity_); }
  Status ReserveDecode(const ForwardPlan& plan, const std::function<void()>& drop_graphs);
  Status AttendDecode(const CudaLayerContext& layer);

  // Index of `layer` among the anchors (its selection slot), or -1.
  int AnchorSlot(int layer) const {
    const auto it = std::find(calibration_anchors_.begin(), calibration_anchors_.end(), layer);
    return it == calibration_anchors_.end() ? -1
                                            : static_cast<int>(it - calibration_anchors_.begin());
  }

  const Model* owner_;
  ModelConfig model_;
  KascadeConfig config_;
  const LayerAction* policy_actions_;  // identifies its entries (never read through)
  std::vector<LayerAction> actions_;   // [layers]: the policy's per-layer plan
  std::vector<int> calibration_anchors_;
  cuda::DeviceBuffer<int32_t> head_maps_;  // [layers][kv_heads]
  // The current step's rows and shapes (Reserve).
  DecodeRowGroup rows_;
  int k_capacity_ = 0;  // positions per selection row: k of the decode bucket
  int max_count_ = 0;   // the decode bucket
  int64_t score_stride_ = 0;
  int row_capacity_ = 0;
  cuda::DeviceBuffer<float> scores_;  // [rows][heads][score stride], log2 units
  cuda::DeviceBuffer<float> lse_;     // [rows][heads]: the scores' lse, natural log
  cuda::DeviceBuffer<unsigned char> scores_workspace_;  // the scores-only pass's lse partials
  cuda::DeviceBuffer<int32_t> selected_;                // [anchors][rows][kv_heads][k capacity]
  cuda::DeviceBuffer<int32_t> selected_count_;          // [anchors][rows][kv_heads]
  cuda::DeviceBuffer<unsigned char> top_k_workspace_;
  cuda::DeviceBuffer<unsigned char> gather_workspace_;
  KascadeCudaPrefill prefill_;  // the prefill chunks with its plan
};

Status KascadeCudaBackend::Reserve(std::span<const ForwardEntry> batch, const ForwardPlan& plan,
                                   const std::function<void()>& drop_graphs) {
  RUBATO_RETURN_IF_ERROR(ReserveDecode(plan, drop_graphs));
  return prefill_.Reserve(batch, plan, drop_graphs);
}

Status KascadeCudaBackend::ReserveDecode(const ForwardPlan& plan,
                                         const std::function<void()>& drop_graphs) {
  rows_ = plan.Group(kKascadeRows);
  if (rows_.rows == 0) return Status::Ok();
  const int rows = RoundUpPow2(rows_.rows);
  if (rows > row_capacity_) {
    drop_graphs();  // the step-input region's layout follows the row capacity
    row_capacity_ = rows;
  }
  max_count_ = plan.decode_max_seq_len;
  k_capacity_ = KascadeTopK(config_, max_count_);  // k grows with L: the bucket's bounds all
  score_stride_ = (static_cast<int64_t>(max_count_) + 63) / 64 * 64;
  const size_t r = static_cast<size_t>(row_capacity_);
  const size_t anchors = calibration_anchors_.size();
  const size_t kv_heads = static_cast<size_t>(model_.num_kv_heads);
  RUBATO_RETURN_IF_ERROR(GrowBackendBuffer(scores_, r * model_.num_heads * score_stride_,
                                           "kascade scores", drop_graphs));
  RUBATO_RETURN_IF_ERROR(
      GrowBackendBuffer(lse_, r * model_.num_heads, "kascade score lse", drop_graphs));
  RUBATO_RETURN_IF_ERROR(GrowBackendBuffer(
      scores_workspace_,
      cuda::DecodeScoresWorkspaceBytes(row_capacity_, model_.num_heads, max_count_),
      "kascade scores workspace", drop_graphs));
  RUBATO_RETURN_IF_ERROR(GrowBackendBuffer(selected_, anchors * r * kv_heads * k_capacity_,
                                           "kascade selection", drop_graphs));
  RUBATO_RETURN_IF_ERROR(
      GrowBackendBuffer(selected_count_, anchors * r * kv_heads, "kascade selection", drop_graphs));
  RUBATO_RETURN_IF_ERROR(
      GrowBackendBuffer(top_k_workspace_,
                        cuda::PooledTopKWorkspaceBytes(row_capacity_, model_.num_heads,
                                                       model_.num_kv_heads, max_count_),
                        "kascade top-k workspace", drop_graphs));
  return GrowBackendBuffer(gather_workspace_,
                           cuda::IndexGatherAttentionWorkspaceBytes(row_capacity_, model_.num_heads,
                                                                    model_.head_dim, k_capacity_),
                           "kascade index-gather workspace", drop_graphs);
}

Status KascadeCudaBackend::Attend(const CudaLayerContext& layer) {
  const LayerAction& action = actions_[layer.layer];
  RUBATO_RETURN_IF_ERROR(
      prefill_.Attend(layer, action, AnchorSlot(layer.layer), AnchorSlot(action.source_layer),
                      head_maps_.data() + static_cast<size_t>(layer.layer) * model_.num_kv_heads,
                      layer.policy_inputs + DecodeInputBytes()));
  return AttendDecode(layer);
}

Status KascadeCudaBackend::AttendDecode(const CudaLayerContext& layer) {
  if (rows_.rows == 0) return Status::Ok();
  const auto* inputs = reinterpret_cast<const int32_t*>(layer.policy_inputs);
  const size_t array = Align16(sizeof(int32_t) * row_capacity_) / sizeof(int32_t);
  const int32_t* begin = inputs;
  const int32_t* count = inputs + array;
  const int32_t* row_k = inputs + 2 * array;
  const LayerAction& action = actions_[layer.layer];
  const size_t kv_heads = static_cast<size_t>(model_.num_kv_heads);
  const size_t slot_rows = static_cast<size_t>(row_capacity_) * kv_heads;

  if (action.evidence & kPooledProbs) {
    // The anchor's raw scores and each head's lse: layer 0 from its dense attention (whose
    // output is the rows'), the other anchors from a scores-only pass (keys only; they attend
    // their selection below). The lse spares the top-k a pass over the scores.
    cuda::DecodeAttentionParams dense = layer.DecodeRows(rows_.first_row, rows_.rows);
    if (action.op == AttentionOp::kDense) {
      dense.scores = scores_.data();
      dense.scores_stride = score_stride_;
      dense.lse = lse_.data();
      RUBATO_RETURN_IF_ERROR(cuda::DecodeAttention(dense, layer.stream));
    } else {
      cuda::DecodeScoresParams pass;
      pass.q = dense.q;
      pass.q_row_stride = dense.q_row_stride;
      pass.key_pool = dense.key_pool;
      pass.num_pool_blocks = dense.num_pool_blocks;
      pass.block_tables = dense.block_tables;
      pass.block_table_stride = dense.block_table_stride;
      pass.seq_lens = dense.seq_lens;
      pass.batch = dense.batch;
      pass.num_heads = dense.num_heads;
      pass.num_kv_heads = dense.num_kv_heads;
      pass.head_dim = dense.head_dim;
      pass.block_tokens = dense.block_tokens;
      pass.max_seq_len = dense.max_seq_len;
      pass.scale = dense.scale;
      pass.scores = scores_.data();
      pass.scores_stride = score_stride_;
      pass.lse = lse_.data();
      pass.workspace = scores_workspace_.data();
      pass.workspace_bytes = scores_workspace_.size();
      RUBATO_RETURN_IF_ERROR(cuda::DecodeScores(pass, layer.stream));
    }

    const size_t slot = static_cast<size_t>(AnchorSlot(layer.layer));
    cuda::PooledTopKParams top_k;
    top_k.scores = scores_.data();
    top_k.scores_stride = score_stride_;
    top_k.begin = begin;
    top_k.count = count;
    top_k.max_count = max_count_;
    top_k.batch = rows_.rows;
    top_k.num_heads = model_.num_heads;
    top_k.num_kv_heads = model_.num_kv_heads;
    top_k.k = k_capacity_;
    top_k.row_k = row_k;
    top_k.head_lse = lse_.data();
    top_k.selected = selected_.data() + slot * slot_rows * k_capacity_;
    top_k.selected_count = selected_count_.data() + slot * slot_rows;
    top_k.workspace = top_k_workspace_.data();
    top_k.workspace_bytes = top_k_workspace_.size();
    RUBATO_RETURN_IF_ERROR(cuda::PooledTopK(top_k, layer.stream));
  }
  if (action.op == AttentionOp::kDense) return Status::Ok();

  const size_t slot = static_cast<size_t>(AnchorSlot(action.source_layer));
  const cuda::DecodeAttentionParams rows = layer.DecodeRows(rows_.first_row, rows_.rows);
  cuda::IndexGatherAttentionParams gather;
  gather.q = rows.q;
  gather.q_row_stride = rows.q_row_stride;
  gather.key_pool = rows.key_pool;
  gather.value_pool = rows.value_pool;
  gather.block_tables = rows.block_tables;
  gather.block_table_stride = rows.block_table_stride;
  gather.batch = rows_.rows;
  gather.num_heads = model_.num_heads;
  gather.num_kv_heads = model_.num_kv_heads;
  gather.head_dim = model_.head_dim;
  gather.block_tokens = rows.block_tokens;
  gather.scale = rows.scale;
  gather.lists = selected_.data() + slot * slot_rows * k_capacity_;
  gather.counts = selected_count_.data() + slot * slot_rows;
  gather.capacity = k_capacity_;
  gather.list_heads = model_.num_kv_heads;
  gather.head_map = head_maps_.data() + static_cast<size_t>(layer.layer) * kv_heads;
  gather.out = rows.out;
  gather.out_row_stride = rows.out_row_stride;
  gather.workspace = gather_workspace_.data();
  gather.workspace_bytes = gather_workspace_.size();
  return cuda::IndexGatherAttention(gather, layer.stream);
}

}  // namespace

Result<std::vector<std::vector<int>>> KascadeCudaPrefillSelectionsForTest(
    const AttentionBackend& backend, int anchor_layer) {
  return dynamic_cast<const KascadeCudaBackend&>(backend).PrefillSelections(anchor_layer);
}

Result<std::unique_ptr<AttentionBackend>> MakeKascadeCudaBackend(CudaModel& model,
                                                                 const KascadePolicy& policy) {
  const KascadeConfig& config = policy.config();
  if (config.prefill == "tiled" && config.prefill_tile % 64 != 0) {
    return UnsupportedError("policy kascade: prefill_tile " + std::to_string(config.prefill_tile) +
                            " must be a multiple of 64 on the CUDA backend (its prefill kernel's "
                            "query tiles); set prefill_tile: 128 or prefill: dense");
  }
  auto backend = std::make_unique<KascadeCudaBackend>(model, policy);
  RUBATO_RETURN_IF_ERROR(backend->Init(policy.calibration().head_map));
  return std::unique_ptr<AttentionBackend>(std::move(backend));
}

}  // namespace rubato
