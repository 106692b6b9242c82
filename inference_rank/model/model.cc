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
  if (sampling.temperature > 0.0f && !(sampling.uniform >= 0.0 && sampling.uniform < 1.0)) {
    return InvalidArgumentError(where + ": sampling uniform must be in [0, 1), got " +
                                std::to_string(sampling.uniform));
  }
  return Status::Ok();
}

}  // namespace

namespace {

// An SFI entry: a valid policy config, a state, a dense forward window, W within the entry's
// tokens; a fast step is one token of a sequence whose state holds a selection for every layer,
// made for this model's KV heads, with the recent segment's anchor inside the sequence.
Status ValidateSfiEntry(const ModelConfig& config, const ForwardEntry& entry,
                        const AttentionWindow& window, const std::string& where) {
  const SfiForward& sfi = *entry.sfi;
  if (sfi.state == nullptr || sfi.config == nullptr) {
    return InvalidArgumentError(where + ": SFI entry without a state or a config");
  }
  if (!window.IsDense()) {
    return InvalidArgumentError(where + ": SFI entries need a dense forward window");
  }
  RUBATO_RETURN_IF_ERROR(ValidateSfiPolicyConfig(*sfi.config));
  const int tokens = static_cast<int>(entry.tokens.size());
  if (sfi.step == SfiStepKind::kSlow) {
    if (sfi.window_queries < 1 || sfi.window_queries > tokens) {
      return InvalidArgumentError(where + ": SFI window of " +
                                  std::to_string(sfi.window_queries) + " queries, expected 1.." +
                                  std::to_string(tokens));
    }
    return Status::Ok();
  }
  if (tokens != 1) {
    return InvalidArgumentError(where + ": an SFI fast step takes one token, got " +
                                std::to_string(tokens));
  }
  const SfiSequenceState& state = *sfi.state;
  if (!state.has_selection || static_cast<int>(state.layers.size()) != config.num_layers) {
    return InvalidArgumentError(where + ": SFI fast step before any slow step");
  }
  for (const SfiLayerState& layer : state.layers) {
    if (static_cast<int>(layer.counts.size()) != config.num_kv_heads) {
      return InvalidArgumentError(where + ": SFI state made for another model");
    }
  }
  if (state.anchor < 0 || state.anchor > entry.start_position) {
    return InvalidArgumentError(where + ": SFI recent segment starts at " +
                                std::to_string(state.anchor) + ", past the query at position " +
                                std::to_string(entry.start_position));
  }
  return Status::Ok();
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
    if (entry.sfi != nullptr) RUBATO_RETURN_IF_ERROR(ValidateSfiEntry(config, entry, window, where));
    if (entry.offload != nullptr) {
      if (entry.offload->exchange == nullptr) {
        return InvalidArgumentError(where + ": offloaded entry without an exchange");
      }
      if (entry.sfi != nullptr) {
        return InvalidArgumentError(where + " is both an SFI entry and offloaded");
      }
      if (!window.IsDense()) {
        return InvalidArgumentError(where + ": offloaded entries need a dense forward window");
      }
    }
  }
  return Status::Ok();
}

Status ReserveForwardBlocks(std::span<const ForwardEntry> batch, PagedKvCache& cache) {
  int needed = 0;
  for (const ForwardEntry& entry : batch) {
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
    RUBATO_RETURN_IF_ERROR(cache.Reserve(
        *entry.sequence, entry.start_position + static_cast<int>(entry.tokens.size())));
  }
  return Status::Ok();
}

Status Model::PrepareSfi(const SfiPolicyConfig& config, int max_sequences) {
  if (max_sequences < 1) {
    return InvalidArgumentError("PrepareSfi: max_sequences must be >= 1, got " +
                                std::to_string(max_sequences));
  }
  return ValidateSfiPolicyConfig(config).WithContext("PrepareSfi");
}

int SampleOnHost(std::span<const float> logits, const TokenSampling& sampling,
                 SamplingWorkspace& workspace) {
  if (sampling.temperature == 0.0f) return ArgMax(logits);
  const SamplingFilter filter{sampling.temperature, sampling.top_k, sampling.top_p};
  return SampleTokenWithUniform(logits, filter, sampling.uniform, workspace);
}

}  // namespace rubato
