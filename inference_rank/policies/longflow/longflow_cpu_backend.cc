// LongFlow on the CPU model (see longflow_cpu_backend.h).
#include "inference_rank/policies/longflow/longflow_cpu_backend.h"

#include <algorithm>
#include <string>

#include "common/sizes.h"
#include "kernels/cpu/attention.h"
#include "kernels/cpu/longflow_attention.h"
#include "kernels/cpu/snapkv_scores.h"

namespace rubato {
namespace {

// Grows every worker's scratch to `floats`.
void GrowScratch(LongFlowScratch& scratch, const ThreadPool& pool, int floats) {
  scratch.resize(static_cast<size_t>(pool.num_workers()));
  for (std::vector<float>& worker : scratch) GrowVector(worker, static_cast<size_t>(floats));
}

// The fused op over every KV head: output, next_slot.
Status FusedAttention(const SlotKvView& slots, int sink_tokens, int num_heads, const float* query,
                      float* output, ThreadPool& pool, LongFlowScratch& scratch) {
  LongFlowAttentionArgs args;
  args.query = query;
  args.output = output;
  args.num_heads = num_heads;
  args.keys = slots.keys;
  args.values = slots.values;
  args.valid = slots.valid;
  args.num_kv_heads = slots.num_kv_heads;
  args.budget = slots.budget;
  args.head_dim = slots.head_dim;
  args.sink_slots = sink_tokens;
  args.next_slot = slots.next_slot;
  RUBATO_RETURN_IF_ERROR(ValidateLongFlowAttention(args));
  GrowScratch(scratch, pool, LongFlowAttentionScratchSize(args));
  pool.ParallelFor(slots.num_kv_heads, [&](int kv_head, int worker) {
    LongFlowAttentionForKvHead(args, kv_head, scratch[static_cast<size_t>(worker)].data());
  });
  for (int h = 0; h < slots.num_kv_heads; ++h) {
    if (slots.next_slot[h] < 0) {
      return InternalError("longflow: KV head " + std::to_string(h) + " has no slot to evict");
    }
  }
  return Status::Ok();
}

LongFlowRequestState* StateOf(const CpuEntryRows& entry) {
  return entry.attention != nullptr ? static_cast<LongFlowRequestState*>(entry.attention->state)
                                    : nullptr;
}

}  // namespace

Status ChooseNextSlots(const SlotKvView& slots, int sink_tokens, int num_heads, const float* query,
                       ThreadPool& pool, LongFlowScratch& scratch) {
  std::vector<float> discarded(static_cast<size_t>(num_heads) * slots.head_dim);
  return FusedAttention(slots, sink_tokens, num_heads, query, discarded.data(), pool, scratch);
}

Result<bool> LongFlowDecodeStep(const SlotKvView& slots, int occupied_before, int sink_tokens,
                                int num_heads, const float* query, float* output, ThreadPool& pool,
                                LongFlowScratch& scratch) {
  if (occupied_before >= slots.budget) {
    RUBATO_RETURN_IF_ERROR(
        FusedAttention(slots, sink_tokens, num_heads, query, output, pool, scratch));
    return true;
  }
  for (int h = 0; h < slots.num_kv_heads; ++h) {
    if (slots.next_slot[h] != occupied_before) {
      return InternalError("longflow: KV head " + std::to_string(h) + " wrote slot " +
                           std::to_string(slots.next_slot[h]) + " of a budget filled to " +
                           std::to_string(occupied_before));
    }
  }
  // Slots [0, occupied) hold positions 0.. in order: one block of `budget` rows of the paged
  // layout ([kv_head][budget][head_dim]) is exactly the slot layout.
  const int occupied = occupied_before + 1;
  const int32_t block = 0;
  const PagedKvView view{slots.keys,   slots.values,       &block,
                         slots.budget, slots.num_kv_heads, slots.head_dim};
  const CausalAttentionArgs args{query, output,           1, occupied - 1, num_heads,
                                 view,  AttentionWindow()};
  GrowScratch(scratch, pool, CausalAttentionScratchSize(args));
  pool.ParallelFor(slots.num_kv_heads, [&](int kv_head, int worker) {
    CausalAttentionForKvHead(args, kv_head, scratch[static_cast<size_t>(worker)].data());
  });
  if (occupied < slots.budget) {
    std::fill(slots.next_slot, slots.next_slot + slots.num_kv_heads, occupied);
  } else {
    RUBATO_RETURN_IF_ERROR(ChooseNextSlots(slots, sink_tokens, num_heads, query, pool, scratch));
  }
  return false;
}

namespace {

class LongFlowCpuBackend final : public CpuAttentionBackend {
 public:
  LongFlowCpuBackend(const ModelConfig& model, const LongFlowConfig& config)
      : model_(model), config_(config) {}

  Status BeforeAttention(const CpuLayerContext& context) override {
    for (const CpuEntryRows& entry : context.entries) {
      LongFlowRequestState* state = StateOf(entry);
      if (state == nullptr || entry.attention->ActionFor(context.layer).op != AttentionOp::kDense) {
        continue;
      }
      RecordQueries(context, entry, *state);
    }
    return Status::Ok();
  }

  Result<CompactSegment> Compact(const CpuLayerContext& /*context*/, int /*entry*/) override {
    return UnsupportedError("longflow plans no two-segment attention");
  }

  Status AttendFixedBudget(const CpuLayerContext& context, int e) override {
    const CpuEntryRows& entry = context.entries[static_cast<size_t>(e)];
    LongFlowRequestState* state = StateOf(entry);
    if (state == nullptr || entry.slots == nullptr) {
      return InvalidArgumentError("longflow: batch entry " + std::to_string(e) +
                                  " has no LongFlow state or no slots");
    }
    Occupied(*state);
    int& occupied = state->occupied[static_cast<size_t>(context.layer)];
    const size_t row = static_cast<size_t>(entry.first_token) * model_.q_dim();
    const SlotKvView slots = entry.slots->pool->LayerView(context.layer, entry.slots->arrays);
    // The model wrote the token into next_slot (before the step below chooses the next one).
    int32_t* positions = Positions(*state, context.layer);
    for (int h = 0; h < model_.num_kv_heads; ++h) {
      const int32_t slot = slots.next_slot[h];
      if (slot >= 0 && slot < config_.budget) {
        positions[static_cast<size_t>(h) * config_.budget + slot] = entry.start_position;
      }
    }
    RUBATO_ASSIGN_OR_RETURN(
        const bool evicted,
        LongFlowDecodeStep(slots, occupied, config_.sink_tokens, model_.num_heads, context.q + row,
                           context.output + row, *context.pool, scratch_));
    if (evicted) {
      state->evictions += model_.num_kv_heads;
    } else {
      ++occupied;
    }
    return Status::Ok();
  }

  Result<std::span<const int32_t>> SlotPositions(const CpuLayerContext& context, int e) override {
    LongFlowRequestState* state = StateOf(context.entries[static_cast<size_t>(e)]);
    if (state == nullptr) {
      return InvalidArgumentError("longflow: batch entry " + std::to_string(e) +
                                  " has no LongFlow state");
    }
    const size_t layer_size = static_cast<size_t>(model_.num_kv_heads) * config_.budget;
    return std::span<const int32_t>(Positions(*state, context.layer), layer_size);
  }

  Status AfterAttention(const CpuLayerContext& context) override {
    for (size_t e = 0; e < context.entries.size(); ++e) {
      const CpuEntryRows& entry = context.entries[e];
      LongFlowRequestState* state = StateOf(entry);
      if (state == nullptr || state->prompt_end != entry.start_position + entry.tokens ||
          entry.attention->ActionFor(context.layer).op != AttentionOp::kDense) {
        continue;
      }
      if (entry.slots == nullptr) {
        return InvalidArgumentError("longflow: batch entry " + std::to_string(e) +
                                    " ends its prompt without evicting KV (slots to move it to)");
      }
      RUBATO_RETURN_IF_ERROR(MovePrompt(context, entry, *state)
                                 .WithContext("longflow, layer " + std::to_string(context.layer)));
    }
    return Status::Ok();
  }

 private:
  std::vector<int>& Occupied(LongFlowRequestState& state) const {
    state.occupied.resize(static_cast<size_t>(model_.num_layers), 0);
    return state.occupied;
  }
  // Layer `layer`'s slot positions, [num_kv_heads][budget]; every slot empty (-1) at first.
  int32_t* Positions(LongFlowRequestState& state, int layer) const {
    const size_t layer_size = static_cast<size_t>(model_.num_kv_heads) * config_.budget;
    state.slot_positions.resize(layer_size * model_.num_layers, -1);
    return state.slot_positions.data() + layer_size * layer;
  }
  void RecordQueries(const CpuLayerContext& context, const CpuEntryRows& entry,
                     LongFlowRequestState& state) const;
  Status MovePrompt(const CpuLayerContext& context, const CpuEntryRows& entry,
                    LongFlowRequestState& state);

  ModelConfig model_;
  LongFlowConfig config_;
  LongFlowScratch scratch_;
  std::vector<float> window_queries_;  // [snapkv_window][q_dim], f32, in position order
  std::vector<float> scores_;          // [num_kv_heads][prompt - snapkv_window], f32
  std::vector<int> kept_;
};

void LongFlowCpuBackend::RecordQueries(const CpuLayerContext& context, const CpuEntryRows& entry,
                                       LongFlowRequestState& state) const {
  const size_t q_dim = static_cast<size_t>(model_.q_dim());
  const int window = config_.snapkv_window;
  state.window_queries.resize(static_cast<size_t>(model_.num_layers) * window * q_dim);
  float* ring = state.window_queries.data() + static_cast<size_t>(context.layer) * window * q_dim;
  for (int t = std::max(0, entry.tokens - window); t < entry.tokens; ++t) {
    const float* q = context.q + static_cast<size_t>(entry.first_token + t) * q_dim;
    std::copy(q, q + q_dim,
              ring + static_cast<size_t>((entry.start_position + t) % window) * q_dim);
  }
}

Status LongFlowCpuBackend::MovePrompt(const CpuLayerContext& context, const CpuEntryRows& entry,
                                      LongFlowRequestState& state) {
  const int length = state.prompt_end;
  const int budget = config_.budget;
  const int kv_heads = model_.num_kv_heads;
  const size_t head_dim = static_cast<size_t>(model_.head_dim);
  const size_t q_dim = static_cast<size_t>(model_.q_dim());
  const PagedKvView kv = context.cache->LayerView(context.layer, *entry.sequence);
  const SlotKvView slots = entry.slots->pool->LayerView(context.layer, entry.slots->arrays);
  if (slots.budget != budget) {
    return InvalidArgumentError("the slot arrays hold " + std::to_string(slots.budget) +
                                " slots, the config's budget is " + std::to_string(budget));
  }
  const float* last_query =
      context.q + static_cast<size_t>(entry.first_token + entry.tokens - 1) * q_dim;
  int32_t* slot_positions = Positions(state, context.layer);
  std::fill(slot_positions, slot_positions + static_cast<size_t>(kv_heads) * budget, -1);
  // Slot i of head h takes position positions(h)[i].
  auto copy_positions = [&](int h, const std::vector<int>& positions) {
    for (size_t i = 0; i < positions.size(); ++i) {
      slot_positions[static_cast<size_t>(h) * budget + i] = positions[i];
      const size_t offset = kv.Offset(positions[i], h);
      std::copy_n(kv.keys + offset, head_dim, slots.Key(h, static_cast<int>(i)));
      std::copy_n(kv.values + offset, head_dim, slots.Value(h, static_cast<int>(i)));
    }
  };
  const int kept = std::min(length, budget);
  std::fill(slots.valid, slots.valid + budget, uint8_t{0});
  std::fill(slots.valid, slots.valid + kept, uint8_t{1});
  Occupied(state)[static_cast<size_t>(context.layer)] = kept;
  if (length <= budget) {  // within the budget: every position, in order
    kept_.resize(static_cast<size_t>(length));
    for (int p = 0; p < length; ++p) kept_[static_cast<size_t>(p)] = p;
    for (int h = 0; h < kv_heads; ++h) copy_positions(h, kept_);
    if (length < budget) {
      std::fill(slots.next_slot, slots.next_slot + kv_heads, length);
      return Status::Ok();
    }
    return ChooseNextSlots(slots, config_.sink_tokens, model_.num_heads, last_query, *context.pool,
                           scratch_);
  }
  // Longer: the window's queries (from the ring) score the prefix, SnapKV-style.
  const int window = config_.snapkv_window;
  const int prefix = length - window;
  if (state.window_queries.size() < static_cast<size_t>(model_.num_layers) * window * q_dim) {
    return InternalError("the prompt's latest queries were not recorded");
  }
  const float* ring =
      state.window_queries.data() + static_cast<size_t>(context.layer) * window * q_dim;
  window_queries_.resize(static_cast<size_t>(window) * q_dim);
  for (int p = prefix; p < length; ++p) {
    std::copy_n(ring + static_cast<size_t>(p % window) * q_dim, q_dim,
                window_queries_.data() + static_cast<size_t>(p - prefix) * q_dim);
  }
  scores_.resize(static_cast<size_t>(kv_heads) * prefix);
  const SnapKvScoreArgs args{
      window_queries_.data(),     window,        model_.num_heads, kv, length,
      config_.snapkv_pool_kernel, scores_.data()};
  RUBATO_RETURN_IF_ERROR(ValidateSnapKvScores(args));
  GrowScratch(scratch_, *context.pool, SnapKvScoresScratchSize(args));
  context.pool->ParallelFor(kv_heads, [&](int h, int worker) {
    SnapKvScoresForKvHead(args, h, scratch_[static_cast<size_t>(worker)].data());
  });
  for (int h = 0; h < kv_heads; ++h) {
    SnapKvKeep(scores_.data() + static_cast<size_t>(h) * prefix, length, window,
               config_.sink_tokens, budget, kept_);
    copy_positions(h, kept_);
  }
  state.prompt_evictions += static_cast<int64_t>(length - budget) * kv_heads;
  return ChooseNextSlots(slots, config_.sink_tokens, model_.num_heads, last_query, *context.pool,
                         scratch_);
}

}  // namespace

Result<std::unique_ptr<AttentionBackend>> MakeLongFlowCpuBackend(const ModelConfig& model,
                                                                 const LongFlowConfig& config) {
  return std::unique_ptr<AttentionBackend>(new LongFlowCpuBackend(model, config));
}

}  // namespace rubato
