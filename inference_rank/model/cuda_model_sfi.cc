// The CUDA model's SFI paths (cuda_model.h; sfi_state.h, DESIGN §4.2), the twin of the CPU
// model's cpu_model_sfi.cc with the same working sets (sink [0, sink_end), J = [sink_end,
// anchor), recent [anchor, L)) and the same Selector input (the raw attention logits of the
// entry's last W queries over J):
//   * fast decode rows [0, F): one two-segment decode attention per layer, compact rows from
//     each request's slot of the pool (cuda_sfi_pool.h), then the recent segment in place;
//   * slow decode rows [F, F + S): dense decode attention that also writes the raw scores
//     [S][heads][score stride] (log2 units) into the layer's ring slot (cuda_sfi_ring.h);
//   * SFI prefill chunks: their last W queries ("window rows", gathered out of the batch rows)
//     attend all of the chunk's keys once more in the dense decode kernel, for their scores
//     (the output goes to scratch: the chunk's own attention is the prefill kernel's). Like the
//     CPU twin, a window query's scores cover every position of J, its own causal future
//     included when recent_window < W;
//   * per layer, after those attentions: SfiSelect over the scores (logit_scale = ln 2) and
//     GatherCompactKv into each slow entry's slot, on the aux stream (or inline).
// Host side: the checks only the CUDA backend needs, slot acquisition, scratch sizes, and after
// the device work the states (anchor, per-layer counts copied back from the device).
#include <algorithm>
#include <bit>
#include <cmath>
#include <string>

#include "inference_rank/model/cuda_model.h"
#include "kernels/cuda/compact_gather.cuh"
#include "kernels/cuda/cuda_status.h"
#include "kernels/cuda/gather_rows.cuh"
#include "kernels/cuda/key_norms.cuh"
#include "kernels/cuda/sfi_selector.cuh"

namespace rubato {
namespace {

constexpr float kLn2 = 0.6931471805599453f;  // the decode kernel's scores are in log2 units

int64_t CompactRows(const SfiPolicyConfig& config) {
  return static_cast<int64_t>(config.sink_tokens) + config.selector.budget;
}

int RoundUpPow2(int value) { return static_cast<int>(std::bit_ceil(static_cast<unsigned>(value))); }

}  // namespace

// ---- host side --------------------------------------------------------------------------------

Status CudaModel::CheckSfiBatch(std::span<const ForwardEntry> batch) const {
  const SfiPolicyConfig* config = nullptr;
  int new_slots = 0;  // slow entries whose state holds no slot of the pool yet
  for (size_t e = 0; e < batch.size(); ++e) {
    const SfiForward* sfi = batch[e].sfi;
    if (sfi == nullptr) continue;
    auto where = [e] { return "forward: batch entry " + std::to_string(e); };  // errors only
    if (sfi_pool_ == nullptr) {
      return FailedPreconditionError(where() +
                                     ": SFI entries need CudaModel::PrepareSfi first "
                                     "(the engine calls it with engine.max_batch)");
    }
    if (config == nullptr) {
      config = sfi->config;
    } else if (sfi->config != config) {
      return UnsupportedError(where() +
                              ": the SFI entries of one CUDA forward must share one "
                              "SfiPolicyConfig object (the engine's)");
    }
    if (CompactRows(*config) > sfi_pool_->shape().capacity) {
      return InvalidArgumentError(where() + ": its SFI config keeps " +
                                  std::to_string(CompactRows(*config)) +
                                  " rows per head (sink + budget) but PrepareSfi sized the "
                                  "compact pool for " +
                                  std::to_string(sfi_pool_->shape().capacity));
    }
    for (size_t other = 0; other < e; ++other) {
      if (batch[other].sfi != nullptr && batch[other].sfi->state == sfi->state) {
        return InvalidArgumentError(where() + " uses the same SFI state as entry " +
                                    std::to_string(other));
      }
    }
    const bool held = sfi_pool_->SlotOf(*sfi->state) >= 0;
    if (sfi->step == SfiStepKind::kFast && !held) {
      return FailedPreconditionError(
          where() +
          ": SFI fast step on a selection this CUDA model did not make (its state holds "
          "no slot of the model's compact pool); run a slow step first");
    }
    if (!held) ++new_slots;
  }
  if (new_slots > 0) {
    const int free = sfi_pool_->shape().slots - sfi_pool_->slots_in_use();
    if (new_slots > free) {
      return ResourceExhaustedError(
          "forward: " + std::to_string(new_slots) + " SFI requests need a compact-pool slot but " +
          std::to_string(free) + " of " + std::to_string(sfi_pool_->shape().slots) +
          " are free (PrepareSfi's max_sequences; the engine passes engine.max_batch)");
    }
  }
  return Status::Ok();
}

Status CudaModel::AcquireSfiSlots(std::span<const ForwardEntry> batch) {
  sfi_slots_.assign(batch.size(), -1);
  for (size_t e = 0; e < batch.size(); ++e) {
    const SfiForward* sfi = batch[e].sfi;
    if (sfi == nullptr) continue;
    RUBATO_ASSIGN_OR_RETURN(sfi_slots_[e], sfi_pool_->AcquireFor(*sfi->state));
    // Its compact buffers are about to be rewritten: no selection until the step succeeded.
    if (sfi->step == SfiStepKind::kSlow) sfi->state->has_selection = false;
  }
  return Status::Ok();
}

Status CudaModel::EnsureSfiCapacity(const ForwardPlan& plan) {
  if (plan.sfi_config == nullptr) return Status::Ok();
  const SfiPolicyConfig& config = *plan.sfi_config;
  if (plan.sfi_window_rows > sfi_window_capacity_) {
    graphs_.Clear();  // captured launches may point into the old buffers
    const int rows = RoundUpPow2(plan.sfi_window_rows);
    const size_t q_dim = static_cast<size_t>(config_.q_dim());
    const size_t qkv_dim = q_dim + 2 * static_cast<size_t>(config_.kv_dim());
    sfi_window_capacity_ = 0;
    sfi_window_qkv_ = cuda::DeviceBuffer<__nv_bfloat16>();
    sfi_window_out_ = cuda::DeviceBuffer<__nv_bfloat16>();
    RUBATO_ASSIGN_OR_RETURN(sfi_window_qkv_,
                            cuda::DeviceBuffer<__nv_bfloat16>::Allocate(
                                static_cast<size_t>(rows) * qkv_dim, "SFI window queries"));
    RUBATO_ASSIGN_OR_RETURN(sfi_window_out_,
                            cuda::DeviceBuffer<__nv_bfloat16>::Allocate(
                                static_cast<size_t>(rows) * q_dim, "SFI window attention"));
    sfi_window_capacity_ = rows;
  }
  if (plan.sfi_selections == 0) return Status::Ok();
  const size_t kv_heads = static_cast<size_t>(config_.num_kv_heads);
  SfiMaintenanceRing::Sizes sizes;
  sizes.score_floats = static_cast<size_t>(plan.sfi_score_rows()) * config_.num_heads *
                       static_cast<size_t>(plan.sfi_score_stride);
  sizes.selected_ints = static_cast<size_t>(plan.sfi_selections) * kv_heads *
                        static_cast<size_t>(config.selector.budget);
  sizes.count_ints = static_cast<size_t>(plan.sfi_selections) * kv_heads;
  if (config.selector.gamma > 0.0) {  // the key-norm prior's norms, indexed by position
    sizes.norm_floats = static_cast<size_t>(plan.sfi_selections) * kv_heads *
                        static_cast<size_t>(plan.sfi_score_stride);
  }
  // The Selector's workspace depends on W x G and the config (its windows) as well as the shapes.
  const int group = config_.num_heads / config_.num_kv_heads;
  sizes.workspace_bytes = cuda::SfiSelectWorkspaceBytes(plan.sfi_slow_rows, config_.num_kv_heads,
                                                        plan.sfi_max_j_count, /*window=*/1, group,
                                                        config.selector);
  for (const SfiWindowPlan& window : plan.sfi_windows) {
    sizes.workspace_bytes = std::max(
        sizes.workspace_bytes,
        cuda::SfiSelectWorkspaceBytes(1, config_.num_kv_heads, window.j_count, window.window, group,
                                      config.selector));
  }
  if (!sfi_ring_->Covers(sizes)) graphs_.Clear();  // before any ring buffer is freed
  return sfi_ring_->Reserve(sizes);
}

Status CudaModel::FinishSfiStep(std::span<const ForwardEntry> batch) {
  if (plan_.sfi_selections == 0) return Status::Ok();
  const int layers = config_.num_layers;
  const int kv_heads = config_.num_kv_heads;
  const int slots = sfi_pool_->shape().slots;
  const auto* counts = reinterpret_cast<const int32_t*>(sfi_counts_host_.data());
  for (size_t e = 0; e < batch.size(); ++e) {
    const SfiForward* sfi = batch[e].sfi;
    if (sfi == nullptr || sfi->step != SfiStepKind::kSlow) continue;
    const SfiPolicyConfig& config = *sfi->config;
    SfiSequenceState& state = *sfi->state;
    const int length = batch[e].start_position + static_cast<int>(batch[e].tokens.size());
    const int sink_end = SfiSinkEnd(config, length);
    const int anchor = SfiAnchor(config, length);
    // What the Selector and the gather promise: sink + min(budget, |J|) rows per head.
    const int expected = sink_end + std::min(config.selector.budget, anchor - sink_end);
    state.layers.resize(static_cast<size_t>(layers));
    for (int layer = 0; layer < layers; ++layer) {
      SfiLayerState& layer_state = state.layers[static_cast<size_t>(layer)];
      layer_state.kept.clear();  // the CUDA model keeps positions and rows on the device
      layer_state.compact_keys.clear();
      layer_state.compact_values.clear();
      layer_state.counts.resize(static_cast<size_t>(kv_heads));
      const int32_t* row = counts + (static_cast<size_t>(layer) * slots + sfi_slots_[e]) * kv_heads;
      for (int h = 0; h < kv_heads; ++h) {
        if (row[h] != expected) {
          return InternalError("CUDA model: after the SFI slow step of batch entry " +
                               std::to_string(e) + ", layer " + std::to_string(layer) +
                               " KV head " + std::to_string(h) + " holds " +
                               std::to_string(row[h]) + " compact rows, expected " +
                               std::to_string(expected) + " (sink + min(budget, |J|))");
        }
        layer_state.counts[static_cast<size_t>(h)] = row[h];
      }
    }
    state.anchor = anchor;
    state.has_selection = true;
  }
  return Status::Ok();
}

// ---- device side ------------------------------------------------------------------------------

Status CudaModel::SfiFastAttention(int layer, DeviceKvStorage& kv, cudaStream_t stream) {
  cuda::DecodeAttentionParams fast =
      DecodeRows(layer, kv, /*first_row=*/0, plan_.sfi_fast_rows, AttentionWindow());
  fast.compact_keys = sfi_pool_->layer_keys(layer);
  fast.compact_values = sfi_pool_->layer_values(layer);
  fast.compact_capacity = sfi_pool_->shape().capacity;
  fast.compact_counts = sfi_pool_->layer_counts(layer);
  fast.compact_slots = StepInput<const int32_t>(input_layout_.sfi_fast_slots);
  fast.num_compact_slots = sfi_pool_->shape().slots;
  fast.recent_begin = StepInput<const int32_t>(input_layout_.sfi_recent_begin);
  fast.max_recent_tokens = plan_.sfi_recent_bucket;
  return cuda::DecodeAttention(fast, stream);
}

Status CudaModel::SfiSlowAttention(int layer, DeviceKvStorage& kv, cudaStream_t stream) {
  RUBATO_RETURN_IF_ERROR(sfi_ring_->BeforeAttention(layer));
  float* scores = sfi_ring_->slot(layer).scores.data();  // [score rows][heads][score stride]
  const size_t score_row = static_cast<size_t>(config_.num_heads) * plan_.sfi_score_stride;
  if (plan_.sfi_slow_rows > 0) {
    cuda::DecodeAttentionParams slow =
        DecodeRows(layer, kv, plan_.sfi_fast_rows, plan_.sfi_slow_rows, AttentionWindow());
    slow.scores = scores;
    slow.scores_stride = plan_.sfi_score_stride;
    RUBATO_RETURN_IF_ERROR(cuda::DecodeAttention(slow, stream));
  }
  if (plan_.sfi_window_rows == 0) return Status::Ok();
  const int q_dim = config_.q_dim();
  const int qkv_dim = q_dim + 2 * config_.kv_dim();
  cuda::GatherRowsParams gather;  // the window rows' q|k|v rows: [window rows][qkv_dim]
  gather.in = qkv_.data();
  gather.in_rows = plan_.tokens;
  gather.row_indices = StepInput<const int32_t>(input_layout_.sfi_window_q_rows);
  gather.rows = plan_.sfi_window_rows;
  gather.dim = qkv_dim;
  gather.out = sfi_window_qkv_.data();
  RUBATO_RETURN_IF_ERROR(cuda::GatherRows(gather, stream));

  cuda::DecodeAttentionParams window = LayerDecodeParams(layer, kv);
  window.q = sfi_window_qkv_.data();
  window.q_row_stride = qkv_dim;
  window.block_tables = StepInput<const int32_t>(input_layout_.sfi_window_block_tables);
  window.block_table_stride = plan_.prefill_table_stride;
  window.seq_lens = StepInput<const int32_t>(input_layout_.sfi_window_seq_lens);
  window.batch = plan_.sfi_window_rows;
  window.max_seq_len = plan_.sfi_window_max_seq_len;
  window.out = sfi_window_out_.data();
  window.scores = scores + static_cast<size_t>(plan_.sfi_slow_rows) * score_row;
  window.scores_stride = plan_.sfi_score_stride;
  return cuda::DecodeAttention(window, stream);
}

Status CudaModel::SfiMaintenance(int layer, DeviceKvStorage& kv) {
  RUBATO_ASSIGN_OR_RETURN(const cudaStream_t stream, sfi_ring_->BeginMaintenance(layer));
  const SfiPolicyConfig& config = *plan_.sfi_config;
  SfiMaintenanceRing::Slot& ring = sfi_ring_->slot(layer);
  const int kv_heads = config_.num_kv_heads;
  const int budget = config.selector.budget;
  const size_t score_row = static_cast<size_t>(config_.num_heads) * plan_.sfi_score_stride;
  const int32_t* sink_end = StepInput<const int32_t>(input_layout_.sfi_sink_end);
  const int32_t* j_count = StepInput<const int32_t>(input_layout_.sfi_j_count);
  const int32_t* slots = StepInput<const int32_t>(input_layout_.sfi_slow_slots);

  const bool key_norm_prior = config.selector.gamma > 0.0;
  // Selections [first, first + count): with gamma > 0 the norms of their keys over J first ...
  auto norms = [&](int first, int count, int max_j_count, const int32_t* block_tables,
                   int table_stride) {
    cuda::KeyNormsParams params;
    params.key_pool = kv.layer_keys(layer);
    params.num_pool_blocks = kv.shape().num_blocks;
    params.block_tables = block_tables;
    params.block_table_stride = table_stride;
    params.begin = sink_end + first;
    params.count = j_count + first;
    params.max_count = max_j_count;
    params.batch = count;
    params.num_kv_heads = kv_heads;
    params.head_dim = config_.head_dim;
    params.block_tokens = kv.shape().block_tokens;
    params.norms = SfiKeyNorms(layer, first);
    params.norms_stride = plan_.sfi_score_stride;
    return cuda::KeyNorms(params, stream);
  };
  // ... the Selector over their scores (W rows each) ...
  auto select = [&](int first, int count, int window, const float* logits, int max_j_count) {
    cuda::SfiSelectParams select;
    select.logits = logits;
    select.logits_stride = plan_.sfi_score_stride;
    select.logit_scale = kLn2;
    select.j_begin = sink_end + first;
    select.j_count = j_count + first;
    select.batch = count;
    select.num_kv_heads = kv_heads;
    select.group = config_.num_heads / kv_heads;
    select.window = window;
    select.max_j_count = max_j_count;
    select.config = config.selector;
    if (key_norm_prior) {
      select.key_norms = SfiKeyNorms(layer, first);
      select.norms_stride = plan_.sfi_score_stride;
    }
    select.selected = ring.selected.data() + static_cast<size_t>(first) * kv_heads * budget;
    select.selected_count = ring.selected_count.data() + static_cast<size_t>(first) * kv_heads;
    select.workspace = ring.workspace.data();
    select.workspace_bytes = ring.workspace.size();
    return cuda::SfiSelect(select, stream);
  };
  // ... then sink + selected rows into their slots of the compact pool.
  auto gather = [&](int first, int count, const int32_t* block_tables, int table_stride) {
    cuda::CompactGatherParams gather;
    gather.key_pool = kv.layer_keys(layer);
    gather.value_pool = kv.layer_values(layer);
    gather.num_pool_blocks = kv.shape().num_blocks;
    gather.block_tables = block_tables;
    gather.block_table_stride = table_stride;
    gather.sink_end = sink_end + first;
    gather.max_sink_tokens = config.sink_tokens;
    gather.selected = ring.selected.data() + static_cast<size_t>(first) * kv_heads * budget;
    gather.selected_count = ring.selected_count.data() + static_cast<size_t>(first) * kv_heads;
    gather.budget = budget;
    gather.batch = count;
    gather.num_kv_heads = kv_heads;
    gather.head_dim = config_.head_dim;
    gather.block_tokens = kv.shape().block_tokens;
    gather.compact_keys = sfi_pool_->layer_keys(layer);
    gather.compact_values = sfi_pool_->layer_values(layer);
    gather.compact_capacity = sfi_pool_->shape().capacity;
    gather.compact_counts = sfi_pool_->layer_counts(layer);
    gather.compact_positions = sfi_pool_->layer_positions(layer);
    gather.compact_slots = slots + first;
    gather.num_compact_slots = sfi_pool_->shape().slots;
    return cuda::GatherCompactKv(gather, stream);
  };

  if (plan_.sfi_slow_rows > 0) {  // decode rows [F, F + S): selections [0, S), W = 1
    const int32_t* tables = StepInput<const int32_t>(input_layout_.decode_block_tables) +
                            static_cast<size_t>(plan_.sfi_fast_rows) * plan_.decode_table_stride;
    if (key_norm_prior) {
      RUBATO_RETURN_IF_ERROR(norms(0, plan_.sfi_slow_rows, plan_.sfi_max_j_count, tables,
                                   plan_.decode_table_stride));
    }
    RUBATO_RETURN_IF_ERROR(
        select(0, plan_.sfi_slow_rows, 1, ring.scores.data(), plan_.sfi_max_j_count));
    RUBATO_RETURN_IF_ERROR(gather(0, plan_.sfi_slow_rows, tables, plan_.decode_table_stride));
  }
  for (size_t k = 0; k < plan_.sfi_windows.size(); ++k) {  // prefill chunks: one each
    const SfiWindowPlan& window = plan_.sfi_windows[k];
    const int selection = plan_.sfi_slow_rows + static_cast<int>(k);
    const float* logits = ring.scores.data() +
                          static_cast<size_t>(plan_.sfi_slow_rows + window.first_row) * score_row;
    const int32_t* table = StepInput<const int32_t>(input_layout_.prefill_block_tables) +
                           static_cast<size_t>(window.prefill_index) * plan_.prefill_table_stride;
    if (key_norm_prior) {
      RUBATO_RETURN_IF_ERROR(
          norms(selection, 1, window.j_count, table, plan_.prefill_table_stride));
    }
    RUBATO_RETURN_IF_ERROR(select(selection, 1, window.window, logits, window.j_count));
    RUBATO_RETURN_IF_ERROR(gather(selection, 1, table, plan_.prefill_table_stride));
  }
  return sfi_ring_->EndMaintenance(layer);
}

}  // namespace rubato
