// The parts of Model::Forward's contract that every backend shares (see model.h): batch
// validation, all-or-nothing block reservation and the host meaning of TokenSampling.
#include "inference_rank/model/model.h"

#include <algorithm>
#include <cmath>
#include <string>

namespace rubato {
namespace {

Status ValidateSampling(const TokenSampling& sampling, const std::string& where) {
  if (!(sampling.temperature >= 0.0f) || std::isinf(sampling.temperature)) {
    return InvalidArgumentError(where +
                                ": sampling temperature must be a finite number >= 0, got " +
                                std::to_string(sampling.temperature));
  }
  if (sampling.top_k < 0) {
    return InvalidArgumentError(where + ": sampling top_k must be >= 0, got " +
                                std::to_string(sampling.top_k));
  }
  if (!(sampling.top_p > 0.0f && sampling.top_p <= 1.0f)) {
    return InvalidArgumentError(where + ": sampling top_p must be in (0, 1], got " +
                                std::to_string(sampling.top_p));
  }
  for (const auto& [token, bias] : sampling.adjustments.logit_bias) {
    if (!std::isfinite(bias)) {
      return InvalidArgumentError(where + ": logit_bias of token " + std::to_string(token) +
                                  " is not finite");
    }
  }
  if (sampling.temperature > 0.0f && !(sampling.uniform >= 0.0 && sampling.uniform < 1.0)) {
    return InvalidArgumentError(where + ": sampling uniform must be in [0, 1), got " +
                                std::to_string(sampling.uniform));
  }
  return Status::Ok();
}

}  // namespace

namespace {

// An entry with a policy's plan: an op this model runs, W within the entry's tokens, a dense
// forward window (the plan chooses the keys), one decode token for kTwoSegment with its recent
// segment inside the sequence. The policy's own checks are its backend's (CheckBatch).
Status ValidateLayerAction(const ForwardEntry& entry, const LayerAction& action, int layer,
                           const std::string& where);

Status ValidateAttentionEntry(const ForwardEntry& entry, const AttentionWindow& window,
                              int num_layers, const std::string& where) {
  const EntryAttention& attention = *entry.attention;
  const int tokens = static_cast<int>(entry.tokens.size());
  if (!window.IsDense()) {
    return InvalidArgumentError(where +
                                ": entries with an attention plan need a dense forward "
                                "window (the plan chooses the keys)");
  }
  if (attention.window_queries < 1 || attention.window_queries > tokens) {
    return InvalidArgumentError(where + ": evidence window of " +
                                std::to_string(attention.window_queries) +
                                " queries, expected 1.." + std::to_string(tokens));
  }
  if (attention.layer_actions == nullptr) {
    return ValidateLayerAction(entry, attention.action, 0, where);
  }
  const bool fixed_budget = attention.layer_actions[0].op == AttentionOp::kFixedBudget;
  for (int layer = 0; layer < num_layers; ++layer) {
    RUBATO_RETURN_IF_ERROR(
        ValidateLayerAction(entry, attention.layer_actions[layer], layer, where));
    // The slots take the token's K/V in every layer or in none.
    if ((attention.layer_actions[layer].op == AttentionOp::kFixedBudget) != fixed_budget) {
      return InvalidArgumentError(where + ": fixed-budget attention in some layers only");
    }
  }
  return Status::Ok();
}

// `layer`: the action's layer (0 when one action holds for every layer: what it attends must
// exist in each).
Status ValidateLayerAction(const ForwardEntry& entry, const LayerAction& action, int layer,
                           const std::string& where) {
  const int tokens = static_cast<int>(entry.tokens.size());
  switch (action.op) {
    case AttentionOp::kDense:
      return Status::Ok();
    case AttentionOp::kTwoSegment:
      if (tokens != 1) {
        return InvalidArgumentError(where + ": two-segment attention takes one token, got " +
                                    std::to_string(tokens));
      }
      if (action.recent_begin < 0 || action.recent_begin > entry.start_position) {
        return InvalidArgumentError(
            where + ": recent segment starts at " + std::to_string(action.recent_begin) +
            ", past the query at position " + std::to_string(entry.start_position));
      }
      return Status::Ok();
    case AttentionOp::kIndexGather:  // one decode token, or a prefill chunk in tiles
      if (action.source_layer < 0 || action.source_layer > layer) {
        return InvalidArgumentError(
            where + ": layer " + std::to_string(layer) + " attends the selection of layer " +
            std::to_string(action.source_layer) + ", not one at or before it");
      }
      return Status::Ok();
    case AttentionOp::kFixedBudget:
      if (tokens != 1) {
        return InvalidArgumentError(where + ": fixed-budget attention takes one token, got " +
                                    std::to_string(tokens));
      }
      if (entry.slots == nullptr) {
        return InvalidArgumentError(where +
                                    ": fixed-budget attention needs the entry's slot arrays "
                                    "(ForwardEntry::slots)");
      }
      return Status::Ok();
  }
  return InvalidArgumentError(where + ": unknown attention op");
}

}  // namespace

Status ValidateForwardBatch(const ModelConfig& config, std::span<const ForwardEntry> batch,
                            const PagedKvCache& cache, const AttentionWindow& window) {
  if (window.sink_tokens < 0 || window.recent_tokens < 1) {
    return InvalidArgumentError("forward: attention window with sink " +
                                std::to_string(window.sink_tokens) + " and recent " +
                                std::to_string(window.recent_tokens) +
                                "; sink must be >= 0 and recent >= 1");
  }
  const KvCacheShape& shape = cache.shape();
  if (shape.num_layers != config.num_layers || shape.num_kv_heads != config.num_kv_heads ||
      shape.head_dim != config.head_dim) {
    return InvalidArgumentError("forward: the KV cache is shaped for " +
                                std::to_string(shape.num_layers) + " layers x " +
                                std::to_string(shape.num_kv_heads) + " KV heads x head_dim " +
                                std::to_string(shape.head_dim) + ", not for this model");
  }
  for (size_t e = 0; e < batch.size(); ++e) {
    const ForwardEntry& entry = batch[e];
    const std::string where = "forward: batch entry " + std::to_string(e);
    if (entry.sequence == nullptr) return InvalidArgumentError(where + " has no sequence");
    if (entry.tokens.empty()) return InvalidArgumentError(where + " has no tokens");
    if (entry.start_position < 0 || entry.start_position > entry.sequence->num_tokens) {
      return InvalidArgumentError(
          where + " starts at position " + std::to_string(entry.start_position) +
          " but its sequence holds " + std::to_string(entry.sequence->num_tokens) + " tokens");
    }
    for (size_t i = 0; i < entry.tokens.size(); ++i) {
      const int id = entry.tokens[i];
      if (id < 0 || id >= config.vocab_size) {
        return InvalidArgumentError(where + ": token id " + std::to_string(id) + " at index " +
                                    std::to_string(i) + " is outside the vocabulary [0, " +
                                    std::to_string(config.vocab_size) + ")");
      }
    }
    const int first_released =
        cache.FirstReleasedPosition(*entry.sequence, entry.start_position,
                                    entry.start_position + static_cast<int>(entry.tokens.size()));
    if (first_released >= 0) {
      return FailedPreconditionError(where + " writes position " + std::to_string(first_released) +
                                     ", whose KV block this rank released (it keeps only the "
                                     "positions its attention still reads)");
    }
    for (size_t other = 0; other < e; ++other) {
      if (batch[other].sequence == entry.sequence) {
        return InvalidArgumentError(where + " uses the same sequence as entry " +
                                    std::to_string(other));
      }
    }
    if (entry.sampling != nullptr) {
      if (entry.logits == LogitsWanted::kNone) {
        return InvalidArgumentError(where + " asks for sampling but wants no logits");
      }
      RUBATO_RETURN_IF_ERROR(ValidateSampling(*entry.sampling, where));
    }
    if (entry.attention != nullptr) {
      RUBATO_RETURN_IF_ERROR(ValidateAttentionEntry(entry, window, config.num_layers, where));
    }
    if (entry.slots != nullptr) {
      const SlotKvForward& slots = *entry.slots;
      if (slots.pool == nullptr || slots.arrays.array < 0 ||
          slots.arrays.array >= slots.pool->shape().num_arrays) {
        return InvalidArgumentError(where + ": slot entry without a slot array of its pool");
      }
      const SlotKvShape& shape = slots.pool->shape();
      if (shape.num_layers != config.num_layers || shape.num_kv_heads != config.num_kv_heads ||
          shape.head_dim != config.head_dim) {
        return InvalidArgumentError(where + ": its KV slot pool is not shaped for this model");
      }
    }
  }
  return Status::Ok();
}

Status ReserveForwardBlocks(std::span<const ForwardEntry> batch, PagedKvCache& cache) {
  int needed = 0;
  for (const ForwardEntry& entry : batch) {
    if (IsFixedBudgetEntry(entry)) continue;
    const int total = entry.start_position + static_cast<int>(entry.tokens.size());
    needed +=
        std::max(0, cache.BlocksFor(total) - static_cast<int>(entry.sequence->block_table.size()));
  }
  if (needed > cache.free_blocks()) {
    return ResourceExhaustedError("forward: the batch needs " + std::to_string(needed) +
                                  " more KV blocks but only " +
                                  std::to_string(cache.free_blocks()) + " of " +
                                  std::to_string(cache.shape().num_blocks) + " are free");
  }
  for (const ForwardEntry& entry : batch) {
    if (IsFixedBudgetEntry(entry)) continue;
    RUBATO_RETURN_IF_ERROR(cache.Reserve(
        *entry.sequence, entry.start_position + static_cast<int>(entry.tokens.size())));
  }
  return Status::Ok();
}

int SampleOnHost(std::span<const float> logits, const TokenSampling& sampling,
                 SamplingWorkspace& workspace, float* probability) {
  if (sampling.adjustments.active() || sampling.adjustments.repetition_active()) {
    workspace.adjusted.assign(logits.begin(), logits.end());
    ApplyLogitAdjustments(workspace.adjusted, sampling.adjustments, workspace);
    logits = workspace.adjusted;
  }
  int token = 0;
  if (sampling.temperature == 0.0f) {
    token = ArgMax(logits);
  } else {
    const SamplingFilter filter{sampling.temperature, sampling.top_k, sampling.top_p};
    token = SampleTokenWithUniform(logits, filter, sampling.uniform, workspace);
  }
  if (probability != nullptr) *probability = TokenProbability(logits, token);
  return token;
}

}  // namespace rubato
