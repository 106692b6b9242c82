// The host half of an attention policy (docs/attention_seam.md): its config, its traits, the
// per-request state that plans every step of a request and judges the token it produced, and
// the factory of its backend half. The engine drives it and never names a policy; policies are
// one folder each under inference_rank/policies/ and one line of their registry.
#pragma once

#include <algorithm>
#include <cstdint>
#include <initializer_list>
#include <memory>
#include <string>
#include <string_view>

#include "cache_rank/cache_selector.h"
#include "common/metrics.h"
#include "common/status.h"
#include "inference_rank/attention/attention_backend.h"
#include "inference_rank/attention/kv_residency.h"
#include "inference_rank/attention/layer_action.h"
#include "kernels/cpu/attention_window.h"

namespace rubato {

class Model;
class Tokenizer;

struct PolicyTraits {
  ResidencySet residencies{KvResidency::kLocal};  // where its requests' KV may live
  bool graph_replayable = true;                   // its decode steps may be replayed as CUDA graphs
  // Evicting KV: the slots per (layer, KV head) each of its requests holds (its budget B), which
  // the engine reserves at admission in place of the request's length.
  int evicting_slots = 0;
};

// One request's policy state, owned by the engine for the request's lifetime.
class PolicyRequest {
 public:
  virtual ~PolicyRequest() = default;

  // The attention of the request's next entry, valid until the next call: a prefill chunk of
  // positions [start_position, start_position + chunk_tokens) (`last_chunk`: it ends the
  // prompt) or one decode token at `position`. Null: dense.
  virtual const EntryAttention* PlanPrefill(int start_position, int chunk_tokens,
                                            bool last_chunk) = 0;
  virtual const EntryAttention* PlanDecode(int position) = 0;
  // The planned entry needs its sampled token's probability for Observe.
  virtual bool WantsTokenProbability() const { return false; }

  enum class Verdict {
    kAccept,  // keep the token
    kRedo,    // throw it away: the engine rewinds the position and plans it again
  };
  // After the forward of a planned entry that sampled `token` (probability: -1 unless asked).
  // `decode`: the entry was a decode token (not the prompt's last chunk).
  virtual Verdict Observe(bool decode, int token, float probability) = 0;

  // Share of the context's positions the last accepted token's query attended.
  virtual double RetainedKvRatio(int context) const { return 1.0; }
};

class AttentionPolicy {
 public:
  virtual ~AttentionPolicy() = default;

  virtual std::string_view name() const = 0;
  virtual const PolicyTraits& traits() const = 0;
  // The keys every query of a forward may attend (dense unless the policy is a window).
  virtual AttentionWindow window() const { return AttentionWindow(); }

  // Resolves what needs the model's tokenizer (e.g. trigger strings to token ids); called once
  // before the engine is made. `tokenizer` may be null (a model directory without one).
  virtual Status UseTokenizer(const Tokenizer* /*tokenizer*/) { return Status::Ok(); }
  // The backend half for `model` and up to `max_batch` running requests (null: the policy needs
  // none). Unsupported naming the backend when the policy has no half for it;
  // ResourceExhausted when its device state does not fit.
  virtual Result<std::unique_ptr<AttentionBackend>> MakeBackend(Model& model,
                                                                int max_batch) const = 0;
  // What the cache rank selects for the policy's requests on offloaded KV (its cache-rank
  // half, cache_rank/cache_selector.h); Unsupported when traits() exclude offloaded KV.
  virtual Result<CacheSelectorSpec> MakeCacheSelector() const {
    return UnsupportedError("policy '" + std::string(name()) + "' has no cache-rank selector");
  }
  // A request's state for KV of `residency` (supported by traits()).
  virtual std::unique_ptr<PolicyRequest> Admit(KvResidency residency) = 0;

  // Checks the parameters that size per-request state (a budget, a top-k, windows) against the
  // engine's context `max_context` (engine.max_context or the model's), before anything is sized
  // from them: a budget of 10^8 is a refusal naming the key, never an allocation of gigabytes or
  // an overflow. Default: nothing to check.
  virtual Status CheckLimits(int /*max_context*/) const { return Status::Ok(); }

  // Registers the policy's counters (docs/design.md §3 names); `registry` outlives the policy.
  virtual Status RegisterMetrics(MetricsRegistry& /*registry*/) { return Status::Ok(); }
  // " key=value ..." for the CLI's stats line; "" when there is nothing to say.
  virtual std::string StatsLine() const { return ""; }
};

// A parameter that counts tokens, for CheckLimits: its key, value and default.
struct TokenCountParam {
  std::string_view key;
  int64_t value;
  int64_t default_value;
};

// "policy.budget: 100000000 tokens exceeds engine.max_context (40960) and the default 3200" for
// the first of `params` above both `max_context` and its default, else Ok. The default always
// passes (the paper's budget on a model of a shorter context is dense attention, not an error);
// above both, state sized from the value could exceed what the engine sizes for its context.
inline Status CheckTokenCounts(std::initializer_list<TokenCountParam> params, int max_context) {
  for (const TokenCountParam& param : params) {
    if (param.value <= std::max<int64_t>(max_context, param.default_value)) continue;
    return InvalidArgumentError(
        "policy." + std::string(param.key) + ": " + std::to_string(param.value) +
        " tokens exceeds engine.max_context (" + std::to_string(max_context) +
        ", the longest request) and the " + "default " + std::to_string(param.default_value) +
        "; lower it or raise engine.max_context");
  }
  return Status::Ok();
}

// "policy 'sfi' does not support offloaded KV (supported: local)" unless its traits allow it.
inline Status CheckResidency(const AttentionPolicy& policy, KvResidency residency) {
  const ResidencySet supported = policy.traits().residencies;
  if (supported.Has(residency)) return Status::Ok();
  std::string names;
  for (KvResidency r : kAllResidencies) {
    if (supported.Has(r)) names += (names.empty() ? "" : ", ") + std::string(KvResidencyName(r));
  }
  return UnsupportedError("policy '" + std::string(policy.name()) + "' does not support " +
                          std::string(KvResidencyName(residency)) + " KV (supported: " + names +
                          ")");
}

}  // namespace rubato
