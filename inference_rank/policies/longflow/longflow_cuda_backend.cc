// LongFlow on the CUDA model (see longflow_cuda_backend.h).
#include "inference_rank/policies/longflow/longflow_cuda_backend.h"

#include <algorithm>
#include <cmath>
#include <string>
#include <vector>

#include "common/sizes.h"
#include "inference_rank/attention/cuda_backend.h"
#include "inference_rank/model/cuda_model.h"
#include "inference_rank/model/cuda_slot_kv_storage.h"
#include "kernels/cuda/compact_gather.cuh"
#include "kernels/cuda/cuda_status.h"
#include "kernels/cuda/device_buffer.h"
#include "kernels/cuda/longflow_attention.cuh"
#include "kernels/cuda/pooled_top_k.cuh"
#include "kernels/cuda/slot_writes.cuh"
#include "kernels/cuda/snapkv_scores.cuh"

namespace rubato {
namespace {

LongFlowRequestState* StateOf(const ForwardEntry& entry) {
  return entry.attention != nullptr ? static_cast<LongFlowRequestState*>(entry.attention->state)
                                    : nullptr;
}

// The step inputs of one prompt that ends in this forward, int32 each, device.
enum PromptInput {
  kArray,      // its slot array
  kKept,       // slots valid after the move: min(length, budget)
  kNext,       // every head's next slot while one is free (length < budget), else -1
  kSinkEnd,    // rows gathered in position order: length (within the budget) or sink_tokens
  kTopKBegin,  // the scored candidates: [sink_tokens, length) ...
  kTopKCount,  // ... (the window scored above every prefix position: always kept)
  kPromptInputs
};

// A prefill chunk of the step (host): where its rows sit and what it writes.
struct PromptChunk {
  int array = 0;      // its slot array
  int first_row = 0;  // its first batch row
  int tokens = 0;
  int start = 0;          // position of its first token
  int prefill_index = 0;  // its row of the prefill block tables; -1: a one-token chunk (its
                          // decode row's block table)
  int ending = -1;        // its index among the prompts ending in this forward, else -1
  int length = 0;         // the prompt's length where it ends
};

class LongFlowCudaBackend final : public CudaAttentionBackend {
 public:
  LongFlowCudaBackend(const CudaModel& model, const LongFlowConfig& config)
      : owner_(&model), model_(model.config()), config_(config) {}

  const Model* made_for_model() const override { return owner_; }
  // Decode steps replay; a step with prompt work (a one-token chunk makes a decode-only plan)
  // runs eagerly: moving a prompt launches with its length and array baked in.
  bool graph_replayable() const override { return chunks_.empty(); }
  Status CheckBatch(std::span<const ForwardEntry> batch) const override;
  Status Reserve(std::span<const ForwardEntry> batch, const ForwardPlan& plan,
                 const std::function<void()>& drop_graphs) override;
  size_t StepInputBytes() const override {
    return Align16(sizeof(int32_t) * row_capacity_) +
           Align16(sizeof(int32_t) * kPromptInputs * ending_capacity_);
  }
  size_t DecodeWorkspaceBytes(const ForwardPlan& /*plan*/) const override {
    // The decode rows' fused op, or one prompt's choice of its first decode slot.
    return cuda::LongFlowAttentionWorkspaceBytes(std::max(rows_.rows, 1), model_.num_heads,
                                                 model_.head_dim, config_.budget);
  }
  void FillStepInputs(std::span<const ForwardEntry> batch, const ForwardPlan& plan,
                      const KvCacheShape& shape, std::byte* region) override;
  void AddToGraphKey(const ForwardPlan& /*plan*/, DecodeGraphKey& key) const override {
    key.policy = {rows_.rows, row_capacity_, reinterpret_cast<intptr_t>(slots_)};
  }
  Status Attend(const CudaLayerContext& layer) override;
  Status FinishStep(std::span<const ForwardEntry> batch) override;

 private:
  const int32_t* DecodeArrays(const CudaLayerContext& layer) const {
    return reinterpret_cast<const int32_t*>(layer.policy_inputs);
  }
  const int32_t* PromptInputs(const CudaLayerContext& layer, int ending) const {
    return reinterpret_cast<const int32_t*>(layer.policy_inputs +
                                            Align16(sizeof(int32_t) * row_capacity_)) +
           static_cast<size_t>(ending) * kPromptInputs;
  }
  // The fused op for `rows` rows of `arrays` with queries from `q` (row stride qkv): output to
  // `out` (row stride q_dim), next slots into the arrays.
  Status Fused(const CudaLayerContext& layer, const __nv_bfloat16* q, const int32_t* arrays,
               int rows, __nv_bfloat16* out) const;
  Status RecordWindow(const CudaLayerContext& layer, const PromptChunk& chunk);
  Status MovePrompt(const CudaLayerContext& layer, const PromptChunk& chunk);

  const Model* owner_;
  ModelConfig model_;
  LongFlowConfig config_;
  DeviceSlotKvStorage* slots_ = nullptr;  // the engine's slot arrays (from the batch)
  // The current step (Reserve).
  DecodeRowGroup rows_;         // the fixed-budget decode rows
  DecodeRowGroup prompt_rows_;  // one-token prompt chunks: dense decode rows
  std::vector<PromptChunk> chunks_;
  int row_capacity_ = 0;     // decode rows the step-input region holds
  int ending_capacity_ = 0;  // prompt ends it holds
  int max_prompt_ = 0;       // the longest prompt ending in the step (sizes the scratch)
  // The prompts' latest queries per array and layer (a ring by position, so that chunk borders
  // do not matter): [num_arrays][layers][snapkv_window][q_dim], bf16, made at the first prompt.
  cuda::DeviceBuffer<__nv_bfloat16> window_ring_;
  cuda::DeviceBuffer<__nv_bfloat16> window_queries_;  // [snapkv_window][q_dim], position order
  cuda::DeviceBuffer<float> scores_;                  // [kv_heads][longest prompt], f32
  cuda::DeviceBuffer<unsigned char> snapkv_workspace_;
  cuda::DeviceBuffer<unsigned char> top_k_workspace_;
  cuda::DeviceBuffer<int32_t> selected_;         // [kv_heads][budget - sinks]
  cuda::DeviceBuffer<int32_t> selected_count_;   // [kv_heads]
  cuda::DeviceBuffer<int32_t> gathered_;         // [num_arrays][kv_heads]: compact gather counts
  cuda::DeviceBuffer<__nv_bfloat16> discarded_;  // [q_dim]: the prompt's last query's output
};

Status LongFlowCudaBackend::CheckBatch(std::span<const ForwardEntry> batch) const {
  for (size_t e = 0; e < batch.size(); ++e) {
    const ForwardEntry& entry = batch[e];
    if (entry.attention == nullptr) continue;
    const std::string where = "longflow (CUDA): batch entry " + std::to_string(e);
    const bool decode = IsFixedBudgetEntry(entry);
    const int group = decode ? kLongFlowRows : kLongFlowPromptRows;
    if (StateOf(entry) == nullptr || entry.attention->row_group != group) {
      return InvalidArgumentError(where + " is not a LongFlow plan (no state or row group " +
                                  std::to_string(entry.attention->row_group) + ")");
    }
    if (entry.slots == nullptr) {
      return InvalidArgumentError(where + " has no evicting KV (slots to attend and move into)");
    }
    const SlotKvShape& shape = entry.slots->pool->shape();
    if (shape.budget != config_.budget) {
      return InvalidArgumentError(where + ": its slot arrays hold " + std::to_string(shape.budget) +
                                  " slots, the config's budget is " +
                                  std::to_string(config_.budget));
    }
    if (dynamic_cast<DeviceSlotKvStorage*>(entry.slots->pool->storage()) == nullptr) {
      return InvalidArgumentError(where + ": its slot arrays are not on the GPU");
    }
    if (decode ? entry.tokens.size() != 1
               : entry.attention->ActionFor(0).op != AttentionOp::kDense) {
      return InvalidArgumentError(where +
                                  ": a fixed-budget entry is one decode token, a prompt "
                                  "chunk attends densely");
    }
  }
  return Status::Ok();
}

Status LongFlowCudaBackend::Reserve(std::span<const ForwardEntry> batch, const ForwardPlan& plan,
                                    const std::function<void()>& drop_graphs) {
  rows_ = plan.Group(kLongFlowRows);
  prompt_rows_ = plan.Group(kLongFlowPromptRows);
  chunks_.clear();
  max_prompt_ = 0;
  int endings = 0;
  for (size_t e = 0; e < batch.size(); ++e) {
    const ForwardEntry& entry = batch[e];
    LongFlowRequestState* state = StateOf(entry);
    if (state == nullptr) continue;
    auto* storage = static_cast<DeviceSlotKvStorage*>(entry.slots->pool->storage());
    if (slots_ != storage) {
      drop_graphs();  // captured launches point into the arrays
      slots_ = storage;
    }
    if (IsFixedBudgetEntry(entry)) continue;
    PromptChunk chunk;
    chunk.array = entry.slots->arrays.array;
    chunk.first_row = plan.entry_first_row[e];
    chunk.tokens = static_cast<int>(entry.tokens.size());
    chunk.start = entry.start_position;
    chunk.prefill_index = plan.entry_prefill_index[e];
    if (state->prompt_end == chunk.start + chunk.tokens) {
      chunk.ending = endings++;
      chunk.length = state->prompt_end;
      max_prompt_ = std::max(max_prompt_, chunk.length);
    }
    chunks_.push_back(chunk);
  }
  if (rows_.rows > row_capacity_ || endings > ending_capacity_) {
    drop_graphs();  // the step-input region's layout follows the capacities
    row_capacity_ = std::max(row_capacity_, RoundUpPow2(std::max(rows_.rows, 1)));
    ending_capacity_ = std::max(ending_capacity_, RoundUpPow2(std::max(endings, 1)));
  }
  if (chunks_.empty()) return Status::Ok();
  // Prompt work runs eagerly (a step with prefill rows is never captured): growing here drops
  // no graph that could point into these buffers, but the calls stay uniform.
  const SlotKvShape& shape = slots_->shape();
  const size_t q_dim = static_cast<size_t>(model_.q_dim());
  const size_t window = static_cast<size_t>(config_.snapkv_window);
  const size_t kv_heads = static_cast<size_t>(model_.num_kv_heads);
  RUBATO_RETURN_IF_ERROR(GrowBackendBuffer(
      window_ring_, static_cast<size_t>(shape.num_arrays) * shape.num_layers * window * q_dim,
      "longflow prompt query ring", drop_graphs));
  RUBATO_RETURN_IF_ERROR(
      GrowBackendBuffer(window_queries_, window * q_dim, "longflow window queries", drop_graphs));
  RUBATO_RETURN_IF_ERROR(GrowBackendBuffer(gathered_,
                                           static_cast<size_t>(shape.num_arrays) * kv_heads,
                                           "longflow gather counts", drop_graphs));
  RUBATO_RETURN_IF_ERROR(
      GrowBackendBuffer(discarded_, q_dim, "longflow discarded output", drop_graphs));
  const size_t select = static_cast<size_t>(config_.budget - config_.sink_tokens);
  RUBATO_RETURN_IF_ERROR(
      GrowBackendBuffer(selected_, kv_heads * select, "longflow prompt selection", drop_graphs));
  RUBATO_RETURN_IF_ERROR(
      GrowBackendBuffer(selected_count_, kv_heads, "longflow prompt selection", drop_graphs));
  if (max_prompt_ > config_.budget) {
    RUBATO_RETURN_IF_ERROR(
        GrowBackendBuffer(scores_, kv_heads * max_prompt_, "longflow prompt scores", drop_graphs));
    RUBATO_RETURN_IF_ERROR(
        GrowBackendBuffer(snapkv_workspace_,
                          cuda::SnapKvScoresWorkspaceBytes(model_.num_heads, model_.num_kv_heads,
                                                           config_.snapkv_window, max_prompt_),
                          "longflow snapkv workspace", drop_graphs));
    RUBATO_RETURN_IF_ERROR(GrowBackendBuffer(
        top_k_workspace_,
        cuda::PooledTopKWorkspaceBytes(1, model_.num_kv_heads, model_.num_kv_heads,
                                       max_prompt_ - config_.sink_tokens),
        "longflow top-k workspace", drop_graphs));
  }
  return Status::Ok();
}

void LongFlowCudaBackend::FillStepInputs(std::span<const ForwardEntry> batch,
                                         const ForwardPlan& plan, const KvCacheShape& /*shape*/,
                                         std::byte* region) {
  auto* arrays = reinterpret_cast<int32_t*>(region);
  for (size_t e = 0; e < batch.size(); ++e) {
    if (StateOf(batch[e]) == nullptr || !IsFixedBudgetEntry(batch[e])) continue;
    arrays[plan.entry_first_row[e] - rows_.first_row] = batch[e].slots->arrays.array;
  }
  auto* prompts = reinterpret_cast<int32_t*>(region + Align16(sizeof(int32_t) * row_capacity_));
  const int budget = config_.budget;
  for (const PromptChunk& chunk : chunks_) {
    if (chunk.ending < 0) continue;
    int32_t* in = prompts + static_cast<size_t>(chunk.ending) * kPromptInputs;
    const bool within = chunk.length <= budget;
    in[kArray] = chunk.array;
    in[kKept] = std::min(chunk.length, budget);
    in[kNext] = chunk.length < budget ? chunk.length : -1;
    in[kSinkEnd] = within ? chunk.length : config_.sink_tokens;
    in[kTopKBegin] = config_.sink_tokens;
    in[kTopKCount] = within ? 0 : chunk.length - config_.sink_tokens;
  }
}

Status LongFlowCudaBackend::Fused(const CudaLayerContext& layer, const __nv_bfloat16* q,
                                  const int32_t* arrays, int rows, __nv_bfloat16* out) const {
  const int layer_index = layer.layer;
  cuda::LongFlowAttentionParams p;
  p.q = q;
  p.q_row_stride = model_.q_dim() + 2 * model_.kv_dim();
  p.keys = slots_->layer_keys(layer_index);
  p.values = slots_->layer_values(layer_index);
  p.valid = slots_->layer_valid(layer_index);
  p.batch = rows;
  p.num_heads = model_.num_heads;
  p.num_kv_heads = model_.num_kv_heads;
  p.head_dim = model_.head_dim;
  p.budget = config_.budget;
  p.sink_slots = config_.sink_tokens;
  p.scale = static_cast<float>(1.0 / std::sqrt(static_cast<double>(model_.head_dim)));
  p.out = out;
  p.out_row_stride = model_.q_dim();
  p.next_slot = slots_->layer_next_slot(layer_index);
  p.arrays = arrays;
  p.num_arrays = slots_->shape().num_arrays;
  p.workspace = layer.decode_workspace;
  p.workspace_bytes = layer.decode_workspace_bytes;
  return cuda::LongFlowAttention(p, layer.stream);
}

Status LongFlowCudaBackend::Attend(const CudaLayerContext& layer) {
  const size_t qkv_dim = static_cast<size_t>(model_.q_dim() + 2 * model_.kv_dim());
  if (rows_.rows > 0) {
    // The tokens' K/V into the slots the previous step chose, then the fused attention, which
    // chooses the next ones: all on the device.
    const __nv_bfloat16* rows = layer.qkv + static_cast<size_t>(rows_.first_row) * qkv_dim;
    cuda::SlotWriteParams write;
    write.keys = rows + model_.q_dim();
    write.values = rows + model_.q_dim() + model_.kv_dim();
    write.row_stride = static_cast<int64_t>(qkv_dim);
    write.arrays = DecodeArrays(layer);
    write.rows = rows_.rows;
    write.num_arrays = slots_->shape().num_arrays;
    write.num_kv_heads = model_.num_kv_heads;
    write.head_dim = model_.head_dim;
    write.budget = config_.budget;
    write.slot_keys = slots_->layer_keys(layer.layer);
    write.slot_values = slots_->layer_values(layer.layer);
    write.valid = slots_->layer_valid(layer.layer);
    write.next_slot = slots_->layer_next_slot(layer.layer);
    RUBATO_RETURN_IF_ERROR(cuda::WriteToNextSlots(write, layer.stream));
    RUBATO_RETURN_IF_ERROR(
        Fused(layer, rows, DecodeArrays(layer), rows_.rows,
              layer.attention + static_cast<size_t>(rows_.first_row) * model_.q_dim()));
  }
  if (prompt_rows_.rows > 0) {  // one-token prompt chunks: plain dense decode attention
    RUBATO_RETURN_IF_ERROR(cuda::DecodeAttention(
        layer.DecodeRows(prompt_rows_.first_row, prompt_rows_.rows), layer.stream));
  }
  for (const PromptChunk& chunk : chunks_) {
    RUBATO_RETURN_IF_ERROR(RecordWindow(layer, chunk));
    if (chunk.ending >= 0) RUBATO_RETURN_IF_ERROR(MovePrompt(layer, chunk));
  }
  return Status::Ok();
}

// The chunk's latest snapkv_window queries into its array's ring (row position % window): at
// most two strided copies.
Status LongFlowCudaBackend::RecordWindow(const CudaLayerContext& layer, const PromptChunk& chunk) {
  const int window = config_.snapkv_window;
  const size_t q_dim = static_cast<size_t>(model_.q_dim());
  const size_t qkv_dim = q_dim + 2 * static_cast<size_t>(model_.kv_dim());
  const size_t row_bytes = q_dim * sizeof(__nv_bfloat16);
  __nv_bfloat16* ring =
      window_ring_.data() +
      (static_cast<size_t>(chunk.array) * model_.num_layers + layer.layer) * window * q_dim;
  for (int t = std::max(0, chunk.tokens - window); t < chunk.tokens;) {
    const int slot = (chunk.start + t) % window;
    const int run = std::min(chunk.tokens - t, window - slot);
    RUBATO_CUDA_RETURN_IF_ERROR(
        cudaMemcpy2DAsync(ring + static_cast<size_t>(slot) * q_dim, row_bytes,
                          layer.qkv + static_cast<size_t>(chunk.first_row + t) * qkv_dim,
                          qkv_dim * sizeof(__nv_bfloat16), row_bytes, static_cast<size_t>(run),
                          cudaMemcpyDeviceToDevice, layer.stream),
        "longflow: recording the prompt's latest queries");
    t += run;
  }
  return Status::Ok();
}

Status LongFlowCudaBackend::MovePrompt(const CudaLayerContext& layer, const PromptChunk& chunk) {
  const int length = chunk.length;
  const int budget = config_.budget;
  const int sinks = config_.sink_tokens;
  const int window = config_.snapkv_window;
  const int kv_heads = model_.num_kv_heads;
  const size_t q_dim = static_cast<size_t>(model_.q_dim());
  const size_t qkv_dim = q_dim + 2 * static_cast<size_t>(model_.kv_dim());
  const int32_t* in = PromptInputs(layer, chunk.ending);
  const bool decode_row = chunk.prefill_index < 0;
  const int table_stride =
      decode_row ? layer.plan->decode_table_stride : layer.plan->prefill_table_stride;
  const int32_t* table =
      decode_row
          ? layer.decode_block_tables + static_cast<size_t>(chunk.first_row) * table_stride
          : layer.prefill_block_tables + static_cast<size_t>(chunk.prefill_index) * table_stride;
  const std::string where = "longflow (CUDA), layer " + std::to_string(layer.layer);

  cuda::CompactGatherParams gather;
  gather.key_pool = layer.kv->layer_keys(layer.layer);
  gather.value_pool = layer.kv->layer_values(layer.layer);
  gather.num_pool_blocks = layer.kv->shape().num_blocks;
  gather.block_tables = table;
  gather.block_table_stride = table_stride;
  gather.sink_end = in + kSinkEnd;
  gather.batch = 1;
  gather.num_kv_heads = kv_heads;
  gather.head_dim = model_.head_dim;
  gather.block_tokens = layer.kv->shape().block_tokens;
  gather.compact_keys = slots_->layer_keys(layer.layer);
  gather.compact_values = slots_->layer_values(layer.layer);
  gather.compact_capacity = budget;
  gather.compact_counts = gathered_.data();
  gather.compact_slots = in + kArray;
  gather.num_compact_slots = slots_->shape().num_arrays;
  gather.selected = selected_.data();
  gather.selected_count = selected_count_.data();
  if (length <= budget) {  // every position, in order (no selected rows: budget 0)
    gather.max_sink_tokens = length;
    gather.budget = 0;
  } else {
    // SnapKV: the window's queries (from the ring, in position order) score the prefix; the
    // window's own positions score above any prefix score (0x7f7f7f7f, a finite 3.4e38), so the
    // top-k over [sinks, length) keeps them and the best budget - sinks - window of the prefix.
    const __nv_bfloat16* ring =
        window_ring_.data() +
        (static_cast<size_t>(chunk.array) * model_.num_layers + layer.layer) * window * q_dim;
    const int first_slot = length % window;  // ring row of position length - window
    const size_t row_bytes = q_dim * sizeof(__nv_bfloat16);
    RUBATO_CUDA_RETURN_IF_ERROR(
        cudaMemcpyAsync(window_queries_.data(), ring + static_cast<size_t>(first_slot) * q_dim,
                        (window - first_slot) * row_bytes, cudaMemcpyDeviceToDevice, layer.stream),
        where + ": ordering the window's queries");
    RUBATO_CUDA_RETURN_IF_ERROR(
        cudaMemcpyAsync(window_queries_.data() + static_cast<size_t>(window - first_slot) * q_dim,
                        ring, first_slot * row_bytes, cudaMemcpyDeviceToDevice, layer.stream),
        where + ": ordering the window's queries");
    cuda::SnapKvScoresParams snap;
    snap.window_queries = window_queries_.data();
    snap.q_row_stride = static_cast<int64_t>(q_dim);
    snap.window = window;
    snap.num_heads = model_.num_heads;
    snap.key_pool = gather.key_pool;
    snap.num_pool_blocks = gather.num_pool_blocks;
    snap.block_table = table;
    snap.num_kv_heads = kv_heads;
    snap.head_dim = model_.head_dim;
    snap.block_tokens = gather.block_tokens;
    snap.length = length;
    snap.pool_kernel = config_.snapkv_pool_kernel;
    snap.scores = scores_.data();
    snap.scores_stride = length;
    snap.workspace = snapkv_workspace_.data();
    snap.workspace_bytes = snapkv_workspace_.size();
    RUBATO_RETURN_IF_ERROR(cuda::SnapKvScores(snap, layer.stream).WithContext(where));
    RUBATO_CUDA_RETURN_IF_ERROR(
        cudaMemset2DAsync(scores_.data() + (length - window), sizeof(float) * length, 0x7f,
                          sizeof(float) * window, static_cast<size_t>(kv_heads), layer.stream),
        where + ": ranking the window first");
    cuda::PooledTopKParams top_k;
    top_k.scores = scores_.data();
    top_k.scores_stride = length;
    top_k.begin = in + kTopKBegin;
    top_k.count = in + kTopKCount;
    top_k.max_count = length - sinks;
    top_k.batch = 1;
    top_k.num_heads = kv_heads;
    top_k.num_kv_heads = kv_heads;
    top_k.k = budget - sinks;
    top_k.pooled_input = true;
    top_k.selected = selected_.data();
    top_k.selected_count = selected_count_.data();
    top_k.workspace = top_k_workspace_.data();
    top_k.workspace_bytes = top_k_workspace_.size();
    RUBATO_RETURN_IF_ERROR(cuda::PooledTopK(top_k, layer.stream).WithContext(where));
    gather.max_sink_tokens = sinks;
    gather.budget = budget - sinks;
  }
  RUBATO_RETURN_IF_ERROR(cuda::GatherCompactKv(gather, layer.stream).WithContext(where));
  cuda::PromptSlotsParams mark;
  mark.arrays = in + kArray;
  mark.kept = in + kKept;
  mark.next = in + kNext;
  mark.rows = 1;
  mark.num_arrays = slots_->shape().num_arrays;
  mark.num_kv_heads = kv_heads;
  mark.budget = budget;
  mark.valid = slots_->layer_valid(layer.layer);
  mark.next_slot = slots_->layer_next_slot(layer.layer);
  RUBATO_RETURN_IF_ERROR(cuda::MarkPromptSlots(mark, layer.stream).WithContext(where));
  if (length < budget) return Status::Ok();
  // Full: the first decode token's slot is the fused op's choice for the prompt's last query.
  const __nv_bfloat16* last =
      layer.qkv + static_cast<size_t>(chunk.first_row + chunk.tokens - 1) * qkv_dim;
  return Fused(layer, last, in + kArray, 1, discarded_.data()).WithContext(where);
}

// Counters from the known fill state: while a slot is free the next one is the lowest free
// (slots fill in order), afterwards every decode token evicts one slot per (layer, KV head).
Status LongFlowCudaBackend::FinishStep(std::span<const ForwardEntry> batch) {
  const int budget = config_.budget;
  const int64_t kv_heads = model_.num_kv_heads;
  for (const ForwardEntry& entry : batch) {
    LongFlowRequestState* state = StateOf(entry);
    if (state == nullptr) continue;
    state->occupied.resize(static_cast<size_t>(model_.num_layers), 0);
    if (IsFixedBudgetEntry(entry)) {
      for (int& occupied : state->occupied) {
        if (occupied < budget) {
          ++occupied;
        } else {
          state->evictions += kv_heads;
        }
      }
    } else if (state->prompt_end == entry.start_position + static_cast<int>(entry.tokens.size())) {
      const int length = state->prompt_end;
      std::fill(state->occupied.begin(), state->occupied.end(), std::min(length, budget));
      if (length > budget) {
        state->prompt_evictions +=
            static_cast<int64_t>(length - budget) * kv_heads * model_.num_layers;
      }
    }
  }
  return Status::Ok();
}

}  // namespace

Result<std::unique_ptr<AttentionBackend>> MakeLongFlowCudaBackend(CudaModel& model,
                                                                  const LongFlowConfig& config) {
  return std::unique_ptr<AttentionBackend>(new LongFlowCudaBackend(model, config));
}

}  // namespace rubato
