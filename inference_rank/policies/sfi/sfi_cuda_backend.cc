// SFI on the CUDA model (sfi_cuda_backend.h), the twin of sfi_cpu_backend.cc with the same working
// sets (sink [0, sink_end), J = [sink_end, anchor), recent [anchor, L)) and the same Selector
// input (the raw attention logits of the entry's last W queries over J). Host side first (the
// step plan, the checks, slots, scratch and the states after the step), then the device side per
// layer; docs/sfi.md "CUDA model" has the why.
#include "inference_rank/policies/sfi/sfi_cuda_backend.h"

#include <algorithm>
#include <bit>
#include <string>
#include <utility>

#include "common/logging.h"
#include "common/sizes.h"
#include "inference_rank/policies/sfi/kernels/sfi_selector.cuh"
#include "kernels/cuda/compact_gather.cuh"
#include "kernels/cuda/cuda_status.h"
#include "kernels/cuda/decode_attention.cuh"
#include "kernels/cuda/gather_rows.cuh"
#include "kernels/cuda/key_norms.cuh"

namespace rubato {
namespace {

constexpr float kLn2 = 0.6931471805599453f;  // the decode kernel's scores are in log2 units

// Device address of one of SFI's step-input arrays (SfiStepInputLayout) in `layer`'s region.
const int32_t* StepInts(const CudaLayerContext& layer, size_t offset) {
  return reinterpret_cast<const int32_t*>(layer.policy_inputs + offset);
}

}  // namespace

// ---- construction -------------------------------------------------------------------------------

Result<std::unique_ptr<AttentionBackend>> MakeSfiCudaBackend(CudaModel& model,
                                                             const SfiPolicyConfig& config,
                                                             int max_batch) {
  if (max_batch < 1) {
    return InvalidArgumentError("SFI CUDA backend: max_batch must be >= 1, got " +
                                std::to_string(max_batch));
  }
  RUBATO_RETURN_IF_ERROR(ValidateSfiPolicyConfig(config).WithContext("SFI CUDA backend"));
  const int64_t capacity = SfiCompactCapacity(config);
  if (capacity > (int64_t{1} << 24)) {
    return InvalidArgumentError(
        "SFI CUDA backend: sink_tokens + budget = " + std::to_string(capacity) +
        " compact rows per head is more than the CUDA pool takes (2^24)");
  }
  RUBATO_RETURN_IF_ERROR(cuda::CudaStatus(
      cudaSetDevice(model.device()), "selecting CUDA device " + std::to_string(model.device())));
  const ModelConfig& shape = model.config();
  const bool guard = config.fidelity_guard > 0.0;
  const CudaSfiPoolShape pool_shape{shape.num_layers, shape.num_kv_heads,
                                    shape.head_dim,   static_cast<int>(capacity),
                                    max_batch,        guard ? shape.q_dim() : 0};
  RUBATO_ASSIGN_OR_RETURN(std::unique_ptr<CudaSfiPool> pool, CudaSfiPool::Create(pool_shape));
  RUBATO_ASSIGN_OR_RETURN(PinnedBuffer counts_host,
                          PinnedBuffer::Allocate(pool->counts().bytes(), "SFI counts"));
  RUBATO_ASSIGN_OR_RETURN(std::unique_ptr<SfiMaintenanceRing> ring, SfiMaintenanceRing::Create());
  PinnedBuffer guard_sums_host;
  if (guard) {
    RUBATO_ASSIGN_OR_RETURN(
        guard_sums_host,
        PinnedBuffer::Allocate(pool->guard_cosine_sums_buffer().bytes(), "SFI guard cosine sums"));
  }
  RUBATO_LOG_INFO(
      "policy", "SFI compact pool: {} requests x {} layers x {} KV heads x {} rows, {} MiB",
      max_batch, shape.num_layers, shape.num_kv_heads, capacity, pool_shape.Bytes() >> 20);
  return std::unique_ptr<AttentionBackend>(
      new SfiCudaBackend(model, config, std::move(pool), std::move(ring), std::move(counts_host),
                         std::move(guard_sums_host)));
}

SfiCudaBackend::SfiCudaBackend(CudaModel& model, const SfiPolicyConfig& config,
                               std::unique_ptr<CudaSfiPool> pool,
                               std::unique_ptr<SfiMaintenanceRing> ring, PinnedBuffer counts_host,
                               PinnedBuffer guard_sums_host)
    : model_(model),
      config_(config),
      pool_(std::move(pool)),
      ring_(std::move(ring)),
      counts_host_(std::move(counts_host)),
      guard_sums_host_(std::move(guard_sums_host)) {}

SfiCudaBackend::~SfiCudaBackend() = default;  // the ring waits for its aux stream

// ---- host side, in the model's order ------------------------------------------------------------

Status SfiCudaBackend::CheckBatch(std::span<const ForwardEntry> batch) const {
  const ModelConfig& model = model_.config();
  auto where = [](size_t e) { return "forward: batch entry " + std::to_string(e); };  // errors
  // Plans SFI made; a fast step's state holds a selection of every layer of this model.
  for (size_t e = 0; e < batch.size(); ++e) {
    const EntryAttention* attention = batch[e].attention;
    if (attention == nullptr) continue;
    if (attention->state == nullptr) {
      return InvalidArgumentError(where(e) + ": SFI entry without a state");
    }
    if (!IsSfiFastPlan(*attention) && !IsSfiSlowPlan(*attention)) {
      return InvalidArgumentError(where(e) + ": an attention plan of row group " +
                                  std::to_string(attention->row_group) +
                                  " that SFI did not make (its backend runs SfiStep's plans only)");
    }
    if (IsSfiSlowPlan(*attention)) continue;
    const SfiSequenceState& state = SfiStateOf(*attention);
    if (!state.has_selection || static_cast<int>(state.layers.size()) != model.num_layers) {
      return InvalidArgumentError(where(e) + ": SFI fast step before any slow step");
    }
    for (const SfiLayerState& layer : state.layers) {
      if (static_cast<int>(layer.counts.size()) != model.num_kv_heads) {
        return InvalidArgumentError(where(e) + ": SFI state made for another model");
      }
    }
    if (attention->action.recent_begin != state.anchor) {
      return InvalidArgumentError(where(e) + ": SFI fast step's recent segment starts at " +
                                  std::to_string(attention->action.recent_begin) +
                                  ", not at its selection's end " + std::to_string(state.anchor));
    }
  }
  // The compact pool: fast states hold a slot of it, slow ones get one (all or nothing).
  int new_slots = 0;  // slow entries whose state holds no slot of the pool yet
  for (size_t e = 0; e < batch.size(); ++e) {
    const EntryAttention* attention = batch[e].attention;
    if (attention == nullptr) continue;
    for (size_t other = 0; other < e; ++other) {
      if (batch[other].attention != nullptr && batch[other].attention->state == attention->state) {
        return InvalidArgumentError(where(e) + " uses the same SFI state as entry " +
                                    std::to_string(other));
      }
    }
    const bool held = pool_->SlotOf(SfiStateOf(*attention)) >= 0;
    if (IsSfiFastPlan(*attention) && !held) {
      return FailedPreconditionError(
          where(e) +
          ": SFI fast step on a selection this CUDA backend did not make (its state holds no "
          "slot of the backend's compact pool); run a slow step first");
    }
    if (!held) ++new_slots;
  }
  if (new_slots > 0) {
    const int free = pool_->shape().slots - pool_->slots_in_use();
    if (new_slots > free) {
      return ResourceExhaustedError(
          "forward: " + std::to_string(new_slots) + " SFI requests need a compact-pool slot but " +
          std::to_string(free) + " of " + std::to_string(pool_->shape().slots) +
          " are free (MakeSfiCudaBackend's max_batch; the engine passes engine.max_batch)");
    }
  }
  return Status::Ok();
}

Status SfiCudaBackend::Reserve(std::span<const ForwardEntry> batch, const ForwardPlan& plan,
                               const std::function<void()>& drop_graphs) {
  PlanSfiStep(batch, plan, config_, step_);
  const SfiStepInputCapacity need = step_.Needs(plan);
  if (!input_capacity_.Covers(need)) {
    drop_graphs();  // captured launches read the region's old layout
    input_capacity_ = input_capacity_.GrownToCover(need);
    input_layout_ = SfiStepInputLayout::For(input_capacity_);
  }
  const ModelConfig& model = model_.config();
  if (step_.window_rows > window_capacity_) {
    drop_graphs();  // captured launches may point into the old buffers
    const int rows = RoundUpPow2(step_.window_rows);
    const size_t q_dim = static_cast<size_t>(model.q_dim());
    const size_t qkv_dim = q_dim + 2 * static_cast<size_t>(model.kv_dim());
    window_capacity_ = 0;
    window_qkv_ = cuda::DeviceBuffer<__nv_bfloat16>();
    window_out_ = cuda::DeviceBuffer<__nv_bfloat16>();
    RUBATO_ASSIGN_OR_RETURN(window_qkv_,
                            cuda::DeviceBuffer<__nv_bfloat16>::Allocate(
                                static_cast<size_t>(rows) * qkv_dim, "SFI window queries"));
    RUBATO_ASSIGN_OR_RETURN(
        window_out_, cuda::DeviceBuffer<__nv_bfloat16>::Allocate(static_cast<size_t>(rows) * q_dim,
                                                                 "SFI window attention"));
    window_capacity_ = rows;
  }
  if (step_.selections == 0) return Status::Ok();
  const size_t kv_heads = static_cast<size_t>(model.num_kv_heads);
  SfiMaintenanceRing::Sizes sizes;
  sizes.score_floats = static_cast<size_t>(step_.score_rows()) * model.num_heads *
                       static_cast<size_t>(step_.score_stride);
  sizes.selected_ints = static_cast<size_t>(step_.selections) * kv_heads *
                        static_cast<size_t>(config_.selector.budget);
  sizes.count_ints = static_cast<size_t>(step_.selections) * kv_heads;
  if (config_.selector.gamma > 0.0) {  // the key-norm prior's norms, indexed by position
    sizes.norm_floats =
        static_cast<size_t>(step_.selections) * kv_heads * static_cast<size_t>(step_.score_stride);
  }
  // The Selector's workspace depends on W x G and the config (its windows) as well as the shapes.
  const int group = model.num_heads / model.num_kv_heads;
  sizes.workspace_bytes =
      cuda::SfiSelectWorkspaceBytes(step_.slow_rows, model.num_kv_heads, step_.max_j_count,
                                    /*window=*/1, group, config_.selector);
  for (const SfiWindowPlan& window : step_.windows) {
    sizes.workspace_bytes =
        std::max(sizes.workspace_bytes,
                 cuda::SfiSelectWorkspaceBytes(1, model.num_kv_heads, window.j_count, window.window,
                                               group, config_.selector));
  }
  if (!ring_->Covers(sizes)) drop_graphs();  // before any ring buffer is freed
  return ring_->Reserve(sizes);
}

size_t SfiCudaBackend::DecodeWorkspaceBytes(const ForwardPlan& /*plan*/) const {
  // The window rows' launch; the slow and fast rows' launches are within the decode rows'.
  const ModelConfig& model = model_.config();
  return cuda::DecodeAttentionWorkspaceBytes(step_.window_rows, model.num_heads, model.head_dim,
                                             step_.window_max_seq_len, /*want_probs=*/false);
}

Status SfiCudaBackend::Acquire(std::span<const ForwardEntry> batch) {
  slots_.assign(batch.size(), -1);
  for (size_t e = 0; e < batch.size(); ++e) {
    const EntryAttention* attention = batch[e].attention;
    if (attention == nullptr) continue;
    SfiSequenceState& state = SfiStateOf(*attention);
    RUBATO_ASSIGN_OR_RETURN(slots_[e], pool_->AcquireFor(state));
    // Its compact buffers are about to be rewritten: no selection until the step succeeded.
    if (IsSfiSlowPlan(*attention)) state.has_selection = false;
  }
  return Status::Ok();
}

void SfiCudaBackend::FillStepInputs(std::span<const ForwardEntry> batch, const ForwardPlan& plan,
                                    const KvCacheShape& shape, std::byte* region) {
  FillSfiStepInputs(batch, plan, step_, config_, shape, input_layout_, slots_, region);
}

void SfiCudaBackend::AddToGraphKey(const ForwardPlan& /*plan*/, DecodeGraphKey& key) const {
  // The pool, the ring and the config are the backend's for its lifetime; the ring's buffers
  // moving drops the graphs (Reserve).
  key.policy = {step_.fast_rows, step_.slow_rows, step_.recent_bucket, overlap_ ? 1 : 0};
}

Status SfiCudaBackend::BeginStep(cudaStream_t main) {
  if (step_.selections > 0) ring_->BeginStep(main, overlap_);
  return Status::Ok();
}

Status SfiCudaBackend::EndStep() {
  // The one end-of-step barrier (the last layers' maintenance overlapped the lm_head).
  return step_.selections > 0 ? ring_->EndStep() : Status::Ok();
}

Status SfiCudaBackend::EnqueueReadBack(cudaStream_t stream) {
  if (guard_on() && step_.fast_rows > 0) {  // every slot's cosine sum: a few bytes per request
    RUBATO_CUDA_RETURN_IF_ERROR(
        cudaMemcpyAsync(guard_sums_host_.data(), pool_->guard_cosine_sums(),
                        pool_->guard_cosine_sums_buffer().bytes(), cudaMemcpyDeviceToHost, stream),
        "copying the SFI guard's cosine sums to the host");
  }
  if (step_.selections == 0) return Status::Ok();
  // Every layer's counts, for the states (FinishStep).
  return cuda::CudaStatus(cudaMemcpyAsync(counts_host_.data(), pool_->counts().data(),
                                          pool_->counts().bytes(), cudaMemcpyDeviceToHost, stream),
                          "copying the SFI compact counts to the host");
}

void SfiCudaBackend::AbortStep() { ring_->SynchronizeAux(); }

Status SfiCudaBackend::FinishStep(std::span<const ForwardEntry> batch) {
  FinishGuard(batch);
  if (step_.selections == 0) return Status::Ok();
  const int layers = model_.config().num_layers;
  const int kv_heads = model_.config().num_kv_heads;
  const int slots = pool_->shape().slots;
  const auto* counts = reinterpret_cast<const int32_t*>(counts_host_.data());
  for (size_t e = 0; e < batch.size(); ++e) {
    const EntryAttention* attention = batch[e].attention;
    if (attention == nullptr || !IsSfiSlowPlan(*attention)) continue;
    SfiSequenceState& state = SfiStateOf(*attention);
    const int length = batch[e].start_position + static_cast<int>(batch[e].tokens.size());
    const int sink_end = SfiSinkEnd(config_, length);
    const int anchor = SfiAnchor(config_, length);
    // What the Selector and the gather promise: sink + min(budget, |J|) rows per head.
    const int expected = sink_end + std::min(config_.selector.budget, anchor - sink_end);
    state.layers.resize(static_cast<size_t>(layers));
    for (int layer = 0; layer < layers; ++layer) {
      SfiLayerState& layer_state = state.layers[static_cast<size_t>(layer)];
      layer_state.kept.clear();  // the CUDA backend keeps positions and rows on the device
      layer_state.compact_keys.clear();
      layer_state.compact_values.clear();
      layer_state.counts.resize(static_cast<size_t>(kv_heads));
      const int32_t* row = counts + (static_cast<size_t>(layer) * slots + slots_[e]) * kv_heads;
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

// ---- tests --------------------------------------------------------------------------------------

Result<std::vector<float>> SfiCudaBackend::KeyNormsForTest(int layer, int selection,
                                                           int positions) {
  const ModelConfig& model = model_.config();
  const int oldest = std::max(0, model.num_layers - SfiMaintenanceRing::kSlots);
  if (config_.selector.gamma <= 0.0 || layer < oldest || layer >= model.num_layers ||
      selection < 0 || selection >= step_.selections || positions < 0 ||
      positions > step_.score_stride) {
    return FailedPreconditionError(
        "KeyNormsForTest: the last forward computed no key norms of selection " +
        std::to_string(selection) + " at layer " + std::to_string(layer) + " for " +
        std::to_string(positions) + " positions that the ring still holds");
  }
  RUBATO_RETURN_IF_ERROR(cuda::CudaStatus(cudaSetDevice(model_.device()), "selecting the device"));
  const size_t kv_heads = static_cast<size_t>(model.num_kv_heads);
  const size_t stride = static_cast<size_t>(step_.score_stride);
  std::vector<float> norms(kv_heads * static_cast<size_t>(positions));
  RUBATO_CUDA_RETURN_IF_ERROR(
      cudaMemcpy2DAsync(norms.data(), static_cast<size_t>(positions) * sizeof(float),
                        KeyNorms(layer, selection), stride * sizeof(float),
                        static_cast<size_t>(positions) * sizeof(float), kv_heads,
                        cudaMemcpyDeviceToHost, model_.stream()),
      "copying SFI key norms to the host");
  RUBATO_CUDA_RETURN_IF_ERROR(cudaStreamSynchronize(model_.stream()), "copying SFI key norms");
  return norms;
}

Result<std::vector<std::vector<int>>> SfiCudaBackend::KeptPositions(const SfiSequenceState& state,
                                                                    int layer) {
  const ModelConfig& model = model_.config();
  const int slot = pool_->SlotOf(state);
  if (slot < 0 || !state.has_selection || layer < 0 || layer >= model.num_layers ||
      state.layers.size() != static_cast<size_t>(model.num_layers)) {
    return FailedPreconditionError("KeptPositions: the state holds no selection of layer " +
                                   std::to_string(layer) + " made by this SFI CUDA backend");
  }
  RUBATO_RETURN_IF_ERROR(cuda::CudaStatus(cudaSetDevice(model_.device()), "selecting the device"));
  const int kv_heads = model.num_kv_heads;
  const int capacity = pool_->shape().capacity;
  std::vector<int32_t> rows(static_cast<size_t>(kv_heads) * capacity);
  RUBATO_CUDA_RETURN_IF_ERROR(
      cudaMemcpyAsync(
          rows.data(),
          pool_->layer_positions(layer) + static_cast<size_t>(slot) * kv_heads * capacity,
          rows.size() * sizeof(int32_t), cudaMemcpyDeviceToHost, model_.stream()),
      "copying SFI positions to the host");
  RUBATO_CUDA_RETURN_IF_ERROR(cudaStreamSynchronize(model_.stream()), "copying SFI positions");
  std::vector<std::vector<int>> kept(static_cast<size_t>(kv_heads));
  for (int h = 0; h < kv_heads; ++h) {
    const auto first = rows.begin() + static_cast<ptrdiff_t>(h) * capacity;
    kept[static_cast<size_t>(h)].assign(
        first, first + state.layers[static_cast<size_t>(layer)].counts[static_cast<size_t>(h)]);
  }
  return kept;
}

// ---- device side, per layer ---------------------------------------------------------------------

float* SfiCudaBackend::KeyNorms(int layer, int selection) {
  const size_t row = static_cast<size_t>(model_.config().num_kv_heads) * step_.score_stride;
  return ring_->slot(layer).key_norms.data() + static_cast<size_t>(selection) * row;
}

// The slow rows (and the window rows) go first, so that their maintenance, forked right after,
// overlaps the rest of the layer.
Status SfiCudaBackend::Attend(const CudaLayerContext& layer) {
  if (step_.selections > 0) {
    RUBATO_RETURN_IF_ERROR(SlowAttention(layer));
    RUBATO_RETURN_IF_ERROR(Maintenance(layer));
    if (guard_on()) RUBATO_RETURN_IF_ERROR(RememberGuardQueries(layer));
  }
  if (step_.fast_rows > 0) {
    RUBATO_RETURN_IF_ERROR(FastAttention(layer));
    if (guard_on()) RUBATO_RETURN_IF_ERROR(AddGuardDrift(layer));
  }
  return Status::Ok();
}

Status SfiCudaBackend::FastAttention(const CudaLayerContext& layer) {
  cuda::DecodeAttentionParams fast = layer.DecodeRows(step_.fast_first_row, step_.fast_rows);
  fast.compact_keys = pool_->layer_keys(layer.layer);
  fast.compact_values = pool_->layer_values(layer.layer);
  fast.compact_capacity = pool_->shape().capacity;
  fast.compact_counts = pool_->layer_counts(layer.layer);
  fast.compact_slots = StepInts(layer, input_layout_.fast_slots);
  fast.num_compact_slots = pool_->shape().slots;
  fast.recent_begin = StepInts(layer, input_layout_.recent_begin);
  fast.max_recent_tokens = step_.recent_bucket;
  return cuda::DecodeAttention(fast, layer.stream);
}

Status SfiCudaBackend::SlowAttention(const CudaLayerContext& layer) {
  RUBATO_RETURN_IF_ERROR(ring_->BeforeAttention(layer.layer));
  const ModelConfig& model = *layer.config;
  float* scores = ring_->slot(layer.layer).scores.data();  // [score rows][heads][score stride]
  const size_t score_row = static_cast<size_t>(model.num_heads) * step_.score_stride;
  if (step_.slow_rows > 0) {
    cuda::DecodeAttentionParams slow = layer.DecodeRows(step_.slow_first_row, step_.slow_rows);
    slow.scores = scores;
    slow.scores_stride = step_.score_stride;
    RUBATO_RETURN_IF_ERROR(cuda::DecodeAttention(slow, layer.stream));
  }
  if (step_.window_rows == 0) return Status::Ok();
  const int q_dim = model.q_dim();
  const int qkv_dim = q_dim + 2 * model.kv_dim();
  cuda::GatherRowsParams gather;  // the window rows' q|k|v rows: [window rows][qkv_dim]
  gather.in = layer.qkv;
  gather.in_rows = layer.plan->tokens;
  gather.row_indices = StepInts(layer, input_layout_.window_q_rows);
  gather.rows = step_.window_rows;
  gather.dim = qkv_dim;
  gather.out = window_qkv_.data();
  RUBATO_RETURN_IF_ERROR(cuda::GatherRows(gather, layer.stream));

  cuda::DecodeAttentionParams window = layer.LayerDecodeParams();
  window.q = window_qkv_.data();
  window.q_row_stride = qkv_dim;
  window.block_tables = StepInts(layer, input_layout_.window_block_tables);
  window.block_table_stride = layer.plan->prefill_table_stride;
  window.seq_lens = StepInts(layer, input_layout_.window_seq_lens);
  window.batch = step_.window_rows;
  window.max_seq_len = step_.window_max_seq_len;
  window.out = window_out_.data();
  window.scores = scores + static_cast<size_t>(step_.slow_rows) * score_row;
  window.scores_stride = step_.score_stride;
  return cuda::DecodeAttention(window, layer.stream);
}

Status SfiCudaBackend::Maintenance(const CudaLayerContext& context) {
  const int layer = context.layer;
  RUBATO_ASSIGN_OR_RETURN(const cudaStream_t stream, ring_->BeginMaintenance(layer));
  const ModelConfig& model = *context.config;
  DeviceKvStorage& kv = *context.kv;
  const ForwardPlan& plan = *context.plan;
  SfiMaintenanceRing::Slot& ring = ring_->slot(layer);
  const int kv_heads = model.num_kv_heads;
  const int budget = config_.selector.budget;
  const size_t score_row = static_cast<size_t>(model.num_heads) * step_.score_stride;
  const int32_t* sink_end = StepInts(context, input_layout_.sink_end);
  const int32_t* j_count = StepInts(context, input_layout_.j_count);
  const int32_t* slots = StepInts(context, input_layout_.slow_slots);

  const bool key_norm_prior = config_.selector.gamma > 0.0;
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
    params.head_dim = model.head_dim;
    params.block_tokens = kv.shape().block_tokens;
    params.norms = KeyNorms(layer, first);
    params.norms_stride = step_.score_stride;
    return cuda::KeyNorms(params, stream);
  };
  // ... the Selector over their scores (W rows each) ...
  auto select = [&](int first, int count, int window, const float* logits, int max_j_count) {
    cuda::SfiSelectParams select;
    select.logits = logits;
    select.logits_stride = step_.score_stride;
    select.logit_scale = kLn2;
    select.j_begin = sink_end + first;
    select.j_count = j_count + first;
    select.batch = count;
    select.num_kv_heads = kv_heads;
    select.group = model.num_heads / kv_heads;
    select.window = window;
    select.max_j_count = max_j_count;
    select.config = config_.selector;
    if (key_norm_prior) {
      select.key_norms = KeyNorms(layer, first);
      select.norms_stride = step_.score_stride;
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
    gather.max_sink_tokens = config_.sink_tokens;
    gather.selected = ring.selected.data() + static_cast<size_t>(first) * kv_heads * budget;
    gather.selected_count = ring.selected_count.data() + static_cast<size_t>(first) * kv_heads;
    gather.budget = budget;
    gather.batch = count;
    gather.num_kv_heads = kv_heads;
    gather.head_dim = model.head_dim;
    gather.block_tokens = kv.shape().block_tokens;
    gather.compact_keys = pool_->layer_keys(layer);
    gather.compact_values = pool_->layer_values(layer);
    gather.compact_capacity = pool_->shape().capacity;
    gather.compact_counts = pool_->layer_counts(layer);
    gather.compact_positions = pool_->layer_positions(layer);
    gather.compact_slots = slots + first;
    gather.num_compact_slots = pool_->shape().slots;
    return cuda::GatherCompactKv(gather, stream);
  };

  if (step_.slow_rows > 0) {  // the slow decode rows: selections [0, S), W = 1
    const int32_t* tables = context.decode_block_tables +
                            static_cast<size_t>(step_.slow_first_row) * plan.decode_table_stride;
    if (key_norm_prior) {
      RUBATO_RETURN_IF_ERROR(
          norms(0, step_.slow_rows, step_.max_j_count, tables, plan.decode_table_stride));
    }
    RUBATO_RETURN_IF_ERROR(select(0, step_.slow_rows, 1, ring.scores.data(), step_.max_j_count));
    RUBATO_RETURN_IF_ERROR(gather(0, step_.slow_rows, tables, plan.decode_table_stride));
  }
  for (size_t k = 0; k < step_.windows.size(); ++k) {  // prefill chunks: one each
    const SfiWindowPlan& window = step_.windows[k];
    const int selection = step_.slow_rows + static_cast<int>(k);
    const float* logits =
        ring.scores.data() + static_cast<size_t>(step_.slow_rows + window.first_row) * score_row;
    const int32_t* table = context.prefill_block_tables +
                           static_cast<size_t>(window.prefill_index) * plan.prefill_table_stride;
    if (key_norm_prior) {
      RUBATO_RETURN_IF_ERROR(norms(selection, 1, window.j_count, table, plan.prefill_table_stride));
    }
    RUBATO_RETURN_IF_ERROR(select(selection, 1, window.window, logits, window.j_count));
    RUBATO_RETURN_IF_ERROR(gather(selection, 1, table, plan.prefill_table_stride));
  }
  return ring_->EndMaintenance(layer);
}

}  // namespace rubato
