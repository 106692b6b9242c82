// The CPU reference model's load and forward pass (see cpu_model.h).
#include "inference_rank/model/cpu_model.h"

#include <cblas.h>

#include <algorithm>
#include <new>
#include <string>
#include <thread>

#include "common/logging.h"
#include "common/sizes.h"
#include "kernels/cpu/add.h"
#include "kernels/cpu/attention.h"
#include "kernels/cpu/embedding.h"
#include "kernels/cpu/kv_append.h"
#include "kernels/cpu/linear.h"
#include "kernels/cpu/qk_norm.h"
#include "kernels/cpu/rmsnorm.h"
#include "kernels/cpu/rope.h"
#include "kernels/cpu/sampling.h"
#include "kernels/cpu/swiglu.h"

namespace rubato {
namespace {

int ResolveThreads(int num_threads) {
  if (num_threads > 0) return num_threads;
  return static_cast<int>(std::max(1u, std::thread::hardware_concurrency()));
}

const float* OrNull(const std::vector<float>& v) { return v.empty() ? nullptr : v.data(); }

bool IsFixedBudget(const CpuEntryRows& p, int layer) {
  return p.attention != nullptr && p.attention->ActionFor(layer).op == AttentionOp::kFixedBudget;
}

}  // namespace

// ---- construction -------------------------------------------------------------------------

CpuModel::CpuModel(ModelConfig config, ModelWeights weights, const ModelLoadOptions& options)
    : config_(std::move(config)),
      weights_(std::move(weights)),
      inv_freq_(
          RopeInverseFrequencies(config_.head_dim, config_.rope_theta, config_.rope_scaling)) {
  SetNumThreads(options.num_threads);
}

Result<std::unique_ptr<CpuModel>> CpuModel::Create(ModelConfig config, ModelWeights weights,
                                                   const ModelLoadOptions& options) {
  if (config.head_dim % 2 != 0) {
    return UnsupportedError("model: head_dim " + std::to_string(config.head_dim) +
                            " is odd; rotary embeddings need an even head_dim");
  }
  RUBATO_RETURN_IF_ERROR(CheckWeightSizes(config, weights));
  return std::unique_ptr<CpuModel>(new CpuModel(std::move(config), std::move(weights), options));
}

Result<std::unique_ptr<CpuModel>> CpuModel::Load(const std::filesystem::path& model_dir,
                                                 const ModelLoadOptions& options) {
  const std::string context = "loading model " + model_dir.string();
  Result<ModelConfig> config = LoadModelConfig(model_dir);
  if (!config.ok()) return config.status().WithContext(context);
  auto load_weights = [&]() -> Result<ModelWeights> {
    if (options.random_weights) return RandomWeights(*config, options.seed);
    Result<SafetensorsCheckpoint> checkpoint = SafetensorsCheckpoint::OpenDirectory(model_dir);
    if (!checkpoint.ok()) return checkpoint.status().WithContext(context);
    return LoadWeights(*config, *checkpoint, model_dir.string());
  };
  Result<ModelWeights> weights = load_weights();
  if (!weights.ok()) return weights.status();
  RUBATO_LOG_INFO("model", "{}: {} ({} layers, hidden {}), {} parameters, {} MiB fp32{}",
                  model_dir.string(), config->architecture, config->num_layers, config->hidden_size,
                  ParameterCount(*config), WeightBytes(*config) >> 20,
                  options.random_weights ? ", random weights" : "");
  return Create(std::move(config).value(), std::move(weights).value(), options);
}

Result<std::unique_ptr<PagedKvCache>> CpuModel::CreateKvCache(int block_tokens, int num_blocks) {
  return PagedKvCache::Create(KvCacheShape{config_.num_layers, config_.num_kv_heads,
                                           config_.head_dim, block_tokens, num_blocks});
}

Result<KvPoolMemory> CpuModel::KvPoolMemoryFor(int block_tokens,
                                               const StepBounds& /*bounds*/) const {
  RUBATO_ASSIGN_OR_RETURN(KvPoolMemory memory, ReadHostMemory());
  memory.bytes_per_block = PagedKvCache::PoolBytes(KvCacheShape{
      config_.num_layers, config_.num_kv_heads, config_.head_dim, block_tokens, /*num_blocks=*/1});
  return memory;
}

Result<std::unique_ptr<SlotKvPool>> CpuModel::CreateSlotKvPool(int budget, int num_arrays) {
  return SlotKvPool::Create(
      SlotKvShape{config_.num_layers, config_.num_kv_heads, config_.head_dim, budget, num_arrays});
}

Status CpuModel::SetAttentionBackend(std::unique_ptr<AttentionBackend> backend) {
  if (backend == nullptr) {
    backend_.reset();
    return Status::Ok();
  }
  auto* cpu = dynamic_cast<CpuAttentionBackend*>(backend.get());
  if (cpu == nullptr) {
    return InvalidArgumentError("CPU model: an attention backend made for the " +
                                std::string(backend->backend_name()) + " model");
  }
  backend.release();
  backend_.reset(cpu);
  return Status::Ok();
}

Status CpuModel::SetResidencyBackend(std::unique_ptr<ResidencyBackend> backend) {
  if (backend == nullptr) {
    residency_.reset();
    return Status::Ok();
  }
  auto* cpu = dynamic_cast<CpuResidencyBackend*>(backend.get());
  if (cpu == nullptr) {
    return InvalidArgumentError("CPU model: a residency backend made for the " +
                                std::string(backend->backend_name()) + " model");
  }
  backend.release();
  residency_.reset(cpu);
  return Status::Ok();
}

void CpuModel::SetNumThreads(int num_threads) {
  const int threads = ResolveThreads(num_threads);
  openblas_set_num_threads(threads);
  if (thread_pool_ && thread_pool_->num_workers() == threads) return;
  thread_pool_ = std::make_unique<ThreadPool>(threads);
  attention_scratch_.resize(static_cast<size_t>(threads));
}

// ---- forward --------------------------------------------------------------------------------

void CpuModel::PlanBatch(std::span<const ForwardEntry> batch) {
  plan_.clear();
  total_tokens_ = 0;
  int scratch_floats = 0;
  for (const ForwardEntry& entry : batch) {
    const int tokens = static_cast<int>(entry.tokens.size());
    plan_.push_back(CpuEntryRows{total_tokens_, tokens, entry.start_position, entry.sequence,
                                 entry.attention, entry.residency, entry.slots});
    total_tokens_ += tokens;
    CausalAttentionArgs shape_only;  // the scratch size depends on sizes only
    shape_only.tokens = tokens;
    shape_only.start_position = entry.start_position;
    shape_only.num_heads = config_.num_heads;
    shape_only.kv.num_kv_heads = config_.num_kv_heads;
    shape_only.kv.head_dim = config_.head_dim;
    scratch_floats = std::max(scratch_floats, CausalAttentionScratchSize(shape_only));
  }
  EnsureWorkspace(total_tokens_, scratch_floats);
  for (const ForwardEntry& entry : batch) {
    const CpuEntryRows& p = plan_[static_cast<size_t>(&entry - batch.data())];
    for (int i = 0; i < p.tokens; ++i) {
      token_ids_[static_cast<size_t>(p.first_token + i)] = entry.tokens[static_cast<size_t>(i)];
      positions_[static_cast<size_t>(p.first_token + i)] = p.start_position + i;
    }
  }
}

void CpuModel::EnsureWorkspace(int total_tokens, int attention_scratch_floats) {
  const size_t t = static_cast<size_t>(total_tokens);
  GrowVector(token_ids_, t);
  GrowVector(positions_, t);
  GrowVector(hidden_, t * config_.hidden_size);
  GrowVector(normed_, t * config_.hidden_size);
  GrowVector(q_, t * config_.q_dim());
  GrowVector(k_, t * config_.kv_dim());
  GrowVector(v_, t * config_.kv_dim());
  GrowVector(attention_, t * config_.q_dim());
  GrowVector(projected_, t * config_.hidden_size);
  GrowVector(gate_, t * config_.intermediate_size);
  GrowVector(up_, t * config_.intermediate_size);
  GrowVector(rope_cos_, t * (config_.head_dim / 2));
  GrowVector(rope_sin_, t * (config_.head_dim / 2));
  for (std::vector<float>& scratch : attention_scratch_) {
    GrowVector(scratch, static_cast<size_t>(attention_scratch_floats));
  }
}

Status CpuModel::Forward(std::span<const ForwardEntry> batch, PagedKvCache& cache,
                         ForwardResult& result, const AttentionWindow& window) {
  result.Reset(config_.vocab_size, batch.size());
  if (batch.empty()) return Status::Ok();
  RUBATO_RETURN_IF_ERROR(ValidateForwardBatch(config_, batch, cache, window));
  for (size_t e = 0; e < batch.size(); ++e) {
    if (batch[e].attention != nullptr && backend_ == nullptr) {
      return FailedPreconditionError("forward: batch entry " + std::to_string(e) +
                                     " has an attention plan but the model has no attention "
                                     "backend (SetAttentionBackend)");
    }
  }
  for (size_t e = 0; e < batch.size(); ++e) {
    if (batch[e].residency != nullptr && residency_ == nullptr) {
      return FailedPreconditionError("forward: batch entry " + std::to_string(e) +
                                     " has a residency handle but the model has no residency "
                                     "backend (SetResidencyBackend)");
    }
  }
  if (backend_ != nullptr) RUBATO_RETURN_IF_ERROR(backend_->CheckBatch(batch));
  if (residency_ != nullptr) RUBATO_RETURN_IF_ERROR(residency_->CheckBatch(batch, window));
  RUBATO_RETURN_IF_ERROR(ReserveForwardBlocks(batch, cache));
  try {
    PlanBatch(batch);
    const int hidden = config_.hidden_size;
    RUBATO_RETURN_IF_ERROR(
        EmbeddingLookup(weights_.embed_tokens.data(), config_.vocab_size, hidden,
                        std::span<const int>(token_ids_.data(), static_cast<size_t>(total_tokens_)),
                        hidden_.data()));
    // One cos/sin table per forward: every layer rotates the same positions.
    RopeCosSin(std::span<const int>(positions_.data(), static_cast<size_t>(total_tokens_)),
               inv_freq_, rope_cos_.data(), rope_sin_.data());
    for (int layer = 0; layer < config_.num_layers; ++layer) {
      RUBATO_RETURN_IF_ERROR(DecoderLayer(layer, cache, window));
    }
    for (const ForwardEntry& entry : batch) {
      entry.sequence->num_tokens = entry.start_position + static_cast<int>(entry.tokens.size());
    }
    if (backend_ != nullptr) RUBATO_RETURN_IF_ERROR(backend_->FinishForward(batch));
    ComputeLogits(batch, result);
    SampleTokens(batch, result);
  } catch (const std::bad_alloc&) {
    return ResourceExhaustedError("forward: out of memory for the activations of " +
                                  std::to_string(total_tokens_) + " tokens");
  }
  return Status::Ok();
}

Status CpuModel::DecoderLayer(int layer, PagedKvCache& cache, const AttentionWindow& window) {
  const LayerWeights& w = weights_.layers[static_cast<size_t>(layer)];
  const int tokens = total_tokens_;
  const int hidden = config_.hidden_size;
  const float eps = static_cast<float>(config_.rms_norm_eps);
  const int64_t count = static_cast<int64_t>(tokens) * hidden;

  RmsNorm(hidden_.data(), w.input_norm.data(), tokens, hidden, eps, normed_.data());
  RUBATO_RETURN_IF_ERROR(SelfAttention(layer, cache, window));
  if (backend_ != nullptr) {
    RUBATO_RETURN_IF_ERROR(
        backend_->AfterAttentionBlock(layer, hidden_.data(), projected_.data(), tokens));
  }
  AddInPlace(hidden_.data(), projected_.data(), count);

  RmsNorm(hidden_.data(), w.post_attention_norm.data(), tokens, hidden, eps, normed_.data());
  Mlp(layer);
  AddInPlace(hidden_.data(), projected_.data(), count);
  return Status::Ok();
}

Status CpuModel::SelfAttention(int layer, PagedKvCache& cache, const AttentionWindow& window) {
  const LayerWeights& w = weights_.layers[static_cast<size_t>(layer)];
  const int tokens = total_tokens_;
  const int hidden = config_.hidden_size;
  const int heads = config_.num_heads;
  const int kv_heads = config_.num_kv_heads;
  const int head_dim = config_.head_dim;
  const int q_dim = config_.q_dim();
  const int kv_dim = config_.kv_dim();

  Linear(normed_.data(), w.q_proj.data(), OrNull(w.q_bias), tokens, hidden, q_dim, q_.data());
  Linear(normed_.data(), w.k_proj.data(), OrNull(w.k_bias), tokens, hidden, kv_dim, k_.data());
  Linear(normed_.data(), w.v_proj.data(), OrNull(w.v_bias), tokens, hidden, kv_dim, v_.data());
  if (config_.qk_norm) {
    const float eps = static_cast<float>(config_.rms_norm_eps);
    HeadRmsNormInPlace(q_.data(), w.q_norm.data(), tokens, heads, head_dim, eps);
    HeadRmsNormInPlace(k_.data(), w.k_norm.data(), tokens, kv_heads, head_dim, eps);
  }
  ApplyRope(q_.data(), tokens, heads, head_dim, rope_cos_.data(), rope_sin_.data());
  ApplyRope(k_.data(), tokens, kv_heads, head_dim, rope_cos_.data(), rope_sin_.data());

  for (const CpuEntryRows& p : plan_) {
    const size_t offset = static_cast<size_t>(p.first_token) * kv_dim;
    if (IsFixedBudget(p, layer)) {  // slot arrays: the slot the previous step chose
      RUBATO_RETURN_IF_ERROR(WriteToNextSlots(p.slots->pool->LayerView(layer, p.slots->arrays),
                                              k_.data() + offset, v_.data() + offset)
                                 .WithContext("layer " + std::to_string(layer)));
      continue;
    }
    AppendToPagedKv(k_.data() + offset, v_.data() + offset, p.tokens, p.start_position,
                    cache.LayerView(layer, *p.sequence));
  }
  const CpuLayerContext context{
      layer,     &config_, &cache, plan_, q_.data(), thread_pool_.get(), attention_.data(),
      k_.data(), v_.data()};
  two_segment_args_.resize(plan_.size());
  index_gather_args_.resize(plan_.size());
  tile_gather_args_.resize(plan_.size());
  if (backend_ != nullptr) {
    RUBATO_RETURN_IF_ERROR(backend_->BeforeAttention(context));
    RUBATO_RETURN_IF_ERROR(PlannedOpArgs(context));
  }
  RUBATO_RETURN_IF_ERROR(ResidencyLayer(context));
  RUBATO_RETURN_IF_ERROR(CheckLocalReads(context));
  for (size_t e = 0; e < plan_.size(); ++e) {
    if (!IsFixedBudget(plan_[e], layer)) continue;
    RUBATO_RETURN_IF_ERROR(backend_->AttendFixedBudget(context, static_cast<int>(e)));
  }
  // One work item per (entry, KV head); items write disjoint rows of attention_.
  const int items = static_cast<int>(plan_.size()) * kv_heads;
  thread_pool_->ParallelFor(items, [&](int item, int worker) {
    const CpuEntryRows& p = plan_[static_cast<size_t>(item / kv_heads)];
    const AttentionOp op =
        p.attention != nullptr ? p.attention->ActionFor(layer).op : AttentionOp::kDense;
    if (op == AttentionOp::kFixedBudget) return;  // the backend's, above
    if (op == AttentionOp::kIndexGather) {
      const size_t e = static_cast<size_t>(item / kv_heads);
      float* scratch = attention_scratch_[static_cast<size_t>(worker)].data();
      if (p.tokens == 1) {
        IndexGatherAttentionForKvHead(index_gather_args_[e], item % kv_heads, scratch);
      } else {
        TileGatherAttentionForKvHead(tile_gather_args_[e], item % kv_heads, scratch);
      }
      return;
    }
    const ResidencyAttention::Kind residency =
        residency_attention_[static_cast<size_t>(item / kv_heads)];
    if (residency == ResidencyAttention::Kind::kWritten) return;  // the residency's, above
    if (op == AttentionOp::kTwoSegment || residency == ResidencyAttention::Kind::kTwoSegment) {
      TwoSegmentAttentionForKvHead(two_segment_args_[static_cast<size_t>(item / kv_heads)],
                                   item % kv_heads,
                                   attention_scratch_[static_cast<size_t>(worker)].data());
      return;
    }
    const size_t offset = static_cast<size_t>(p.first_token) * q_dim;
    CausalAttentionArgs args{q_.data() + offset,
                             attention_.data() + offset,
                             p.tokens,
                             p.start_position,
                             heads,
                             cache.LayerView(layer, *p.sequence),
                             window};
    CausalAttentionForKvHead(args, item % kv_heads,
                             attention_scratch_[static_cast<size_t>(worker)].data());
  });
  if (backend_ != nullptr) RUBATO_RETURN_IF_ERROR(backend_->AfterAttention(context));
  Linear(attention_.data(), w.o_proj.data(), OrNull(w.o_bias), tokens, q_dim, hidden,
         projected_.data());
  return Status::Ok();
}

Status CpuModel::PlannedOpArgs(const CpuLayerContext& context) {
  for (size_t e = 0; e < plan_.size(); ++e) {
    const CpuEntryRows& p = plan_[e];
    if (p.attention == nullptr) continue;
    const LayerAction& action = p.attention->ActionFor(context.layer);
    if (action.op == AttentionOp::kIndexGather) {
      RUBATO_RETURN_IF_ERROR(IndexGatherArgs(context, static_cast<int>(e)));
      continue;
    }
    if (action.op != AttentionOp::kTwoSegment) continue;
    RUBATO_ASSIGN_OR_RETURN(const CompactSegment segment,
                            backend_->Compact(context, static_cast<int>(e)));
    TwoSegmentAttentionArgs& args = two_segment_args_[e];
    const size_t offset = static_cast<size_t>(p.first_token) * config_.q_dim();
    args.query = q_.data() + offset;
    args.output = attention_.data() + offset;
    args.num_heads = config_.num_heads;
    args.compact = segment.view;
    args.compact_counts = segment.counts;
    args.kv = context.cache->LayerView(context.layer, *p.sequence);
    args.recent_begin = action.recent_begin;
    args.recent_end = p.start_position + 1;
    RUBATO_RETURN_IF_ERROR(ValidateTwoSegmentAttention(args));
    const size_t scratch = static_cast<size_t>(TwoSegmentAttentionScratchSize(args));
    for (std::vector<float>& worker_scratch : attention_scratch_)
      GrowVector(worker_scratch, scratch);
  }
  return Status::Ok();
}

Status CpuModel::IndexGatherArgs(const CpuLayerContext& context, int entry) {
  const CpuEntryRows& p = plan_[static_cast<size_t>(entry)];
  RUBATO_ASSIGN_OR_RETURN(const GatherPositions positions, backend_->Positions(context, entry));
  const std::string where =
      "layer " + std::to_string(context.layer) + ", batch entry " + std::to_string(entry);
  if (p.tokens > 1) {
    TileGatherAttentionArgs& args = tile_gather_args_[static_cast<size_t>(entry)];
    args.query = q_.data() + static_cast<size_t>(p.first_token) * config_.q_dim();
    args.output = attention_.data() + static_cast<size_t>(p.first_token) * config_.q_dim();
    args.tokens = p.tokens;
    args.start_position = p.start_position;
    args.num_heads = config_.num_heads;
    args.kv = context.cache->LayerView(context.layer, *p.sequence);
    args.tile_tokens = positions.tile_tokens;
    args.lists = positions.lists;
    args.counts = positions.counts;
    if (positions.tiles != TileGatherTiles(p.start_position, p.tokens, positions.tile_tokens)) {
      return InvalidArgumentError(where + ": the backend's positions cover " +
                                  std::to_string(positions.tiles) + " tiles, not the chunk's");
    }
    RUBATO_RETURN_IF_ERROR(ValidateTileGatherAttention(args).WithContext(where));
    const size_t scratch = static_cast<size_t>(TileGatherAttentionScratchSize(args));
    for (std::vector<float>& worker_scratch : attention_scratch_) {
      GrowVector(worker_scratch, scratch);
    }
    return Status::Ok();
  }
  IndexGatherAttentionArgs& args = index_gather_args_[static_cast<size_t>(entry)];
  const size_t offset = static_cast<size_t>(p.first_token) * config_.q_dim();
  args.query = q_.data() + offset;
  args.output = attention_.data() + offset;
  args.num_heads = config_.num_heads;
  args.kv = context.cache->LayerView(context.layer, *p.sequence);
  args.length = p.start_position + 1;
  args.positions = positions.lists;
  args.counts = positions.counts;
  if (positions.tiles != 1) {
    return InvalidArgumentError(where + ": a decode token's positions are one list per KV head");
  }
  RUBATO_RETURN_IF_ERROR(ValidateIndexGatherAttention(args).WithContext(where));
  const size_t scratch = static_cast<size_t>(IndexGatherAttentionScratchSize(args));
  for (std::vector<float>& worker_scratch : attention_scratch_) GrowVector(worker_scratch, scratch);
  return Status::Ok();
}

Status CpuModel::ResidencyLayer(const CpuLayerContext& context) {
  residency_attention_.assign(plan_.size(), ResidencyAttention::Kind::kLocal);
  if (residency_ == nullptr) return Status::Ok();
  const bool any = std::any_of(plan_.begin(), plan_.end(),
                               [](const CpuEntryRows& p) { return p.residency != nullptr; });
  if (!any) return Status::Ok();
  RUBATO_RETURN_IF_ERROR(residency_->LayerComputed(context));
  const int q_dim = config_.q_dim();
  for (size_t e = 0; e < plan_.size(); ++e) {
    const CpuEntryRows& p = plan_[e];
    if (p.residency == nullptr) continue;
    RUBATO_ASSIGN_OR_RETURN(const ResidencyAttention read,
                            residency_->Attend(context, static_cast<int>(e)));
    residency_attention_[e] = read.kind;
    if (read.kind != ResidencyAttention::Kind::kTwoSegment) continue;
    TwoSegmentAttentionArgs& args = two_segment_args_[e];
    const size_t offset = static_cast<size_t>(p.first_token) * q_dim;
    args.query = q_.data() + offset;
    args.output = attention_.data() + offset;
    args.num_heads = config_.num_heads;
    args.compact = read.compact.view;
    args.compact_counts = read.compact.counts;
    args.kv = context.cache->LayerView(context.layer, *p.sequence);
    args.recent_begin = read.recent_begin;
    args.recent_end = p.start_position + 1;
    RUBATO_RETURN_IF_ERROR(ValidateTwoSegmentAttention(args).WithContext(
        std::string(residency_->residency_name()) + " attention of layer " +
        std::to_string(context.layer)));
    // The compact capacity is the residency's to choose: grow the workers' scratch to it.
    const size_t scratch = static_cast<size_t>(TwoSegmentAttentionScratchSize(args));
    for (std::vector<float>& worker_scratch : attention_scratch_)
      GrowVector(worker_scratch, scratch);
  }
  return Status::Ok();
}

Status CpuModel::CheckLocalReads(const CpuLayerContext& context) const {
  for (size_t e = 0; e < plan_.size(); ++e) {
    const CpuEntryRows& p = plan_[e];
    if (p.sequence->released_blocks == 0 || IsFixedBudget(p, context.layer)) continue;
    const ResidencyAttention::Kind kind = residency_attention_[e];
    if (kind == ResidencyAttention::Kind::kWritten) continue;  // reads nothing here
    // The recent segment of the two-segment op, else (dense, or a plan's op: conservatively)
    // every position up to the entry's last.
    const bool two_segment = kind == ResidencyAttention::Kind::kTwoSegment ||
                             (p.attention != nullptr &&
                              p.attention->ActionFor(context.layer).op == AttentionOp::kTwoSegment);
    const int begin = two_segment ? two_segment_args_[e].recent_begin : 0;
    const int end = p.start_position + p.tokens;
    const int released = context.cache->FirstReleasedPosition(*p.sequence, begin, end);
    if (released >= 0) {
      return FailedPreconditionError(
          "layer " + std::to_string(context.layer) + ", batch entry " + std::to_string(e) +
          ": its attention would read position " + std::to_string(released) +
          ", whose KV block this rank released (it holds positions from " +
          std::to_string(p.sequence->released_blocks * context.cache->shape().block_tokens) +
          " on)");
    }
  }
  return Status::Ok();
}

void CpuModel::Mlp(int layer) {
  const LayerWeights& w = weights_.layers[static_cast<size_t>(layer)];
  const int tokens = total_tokens_;
  const int hidden = config_.hidden_size;
  const int intermediate = config_.intermediate_size;
  Linear(normed_.data(), w.gate_proj.data(), nullptr, tokens, hidden, intermediate, gate_.data());
  Linear(normed_.data(), w.up_proj.data(), nullptr, tokens, hidden, intermediate, up_.data());
  SwiGlu(gate_.data(), up_.data(), static_cast<int64_t>(tokens) * intermediate, gate_.data());
  Linear(gate_.data(), w.down_proj.data(), nullptr, tokens, intermediate, hidden,
         projected_.data());
}

void CpuModel::ComputeLogits(std::span<const ForwardEntry> batch, ForwardResult& result) {
  const size_t hidden = static_cast<size_t>(config_.hidden_size);
  // Gather the rows whose logits are wanted; RMSNorm is per row, so norm-then-gather equals
  // gather-then-norm and the lm_head runs only on the wanted rows.
  int rows = 0;
  for (size_t e = 0; e < batch.size(); ++e) {
    const CpuEntryRows& p = plan_[e];
    int first = 0, count = 0;
    switch (batch[e].logits) {
      case LogitsWanted::kNone:
        break;
      case LogitsWanted::kLast:
        first = p.first_token + p.tokens - 1;
        count = 1;
        break;
      case LogitsWanted::kAll:
        first = p.first_token;
        count = p.tokens;
        break;
    }
    result.entry_first_row[e] = rows;
    result.entry_row_count[e] = count;
    GrowVector(logit_rows_, static_cast<size_t>(rows + count) * hidden);
    std::copy(hidden_.begin() + static_cast<ptrdiff_t>(first * hidden),
              hidden_.begin() + static_cast<ptrdiff_t>((first + count) * hidden),
              logit_rows_.begin() + static_cast<ptrdiff_t>(rows * hidden));
    rows += count;
  }
  if (rows == 0) return;
  RmsNorm(logit_rows_.data(), weights_.final_norm.data(), rows, config_.hidden_size,
          static_cast<float>(config_.rms_norm_eps), logit_rows_.data());
  result.logits.resize(static_cast<size_t>(rows) * config_.vocab_size);
  Linear(logit_rows_.data(), weights_.output_projection().data(), nullptr, rows,
         config_.hidden_size, config_.vocab_size, result.logits.data());
}

void CpuModel::SampleTokens(std::span<const ForwardEntry> batch, ForwardResult& result) {
  for (size_t e = 0; e < batch.size(); ++e) {
    if (batch[e].sampling == nullptr) continue;
    const std::span<const float> logits = result.LastLogits(static_cast<int>(e));
    float* probability =
        batch[e].sampling->report_probability ? &result.sampled_probabilities[e] : nullptr;
    result.sampled_tokens[e] =
        SampleOnHost(logits, *batch[e].sampling, sampling_workspace_, probability);
    if (batch[e].sampling->logprobs >= 0) {
      ComputeTokenLogprobs(logits, result.sampled_tokens[e], batch[e].sampling->logprobs,
                           sampling_workspace_.candidates, result.sampled_logprobs[e]);
    }
  }
}

}  // namespace rubato
