// StreamingLLM (docs/design.md §4.7), the weak baseline: every query, prefill and decode, attends
// the first sink_tokens positions and the last recent_window positions up to itself (a forward
// window, kernels/cpu/attention_window.h). The KV cache keeps every position.
#pragma once

#include <memory>

#include "common/config.h"
#include "inference_rank/attention/policy.h"

namespace rubato {

inline constexpr int kDefaultSinkTokens = 4;      // policy.sink_tokens, >= 0
inline constexpr int kDefaultRecentWindow = 256;  // policy.recent_window, >= 1

class StreamingLlmPolicy final : public AttentionPolicy {
 public:
  explicit StreamingLlmPolicy(const AttentionWindow& window) : window_(window) {}
  std::string_view name() const override { return "streaming_llm"; }
  const PolicyTraits& traits() const override;
  AttentionWindow window() const override { return window_; }
  Result<std::unique_ptr<AttentionBackend>> MakeBackend(Model& model, int max_batch) const override;
  std::unique_ptr<PolicyRequest> Admit(KvResidency residency) override;

 private:
  AttentionWindow window_;
};

// `policy: {name: streaming_llm, sink_tokens: 4, recent_window: 256}`.
Result<std::unique_ptr<AttentionPolicy>> CreateStreamingLlmPolicy(const PolicySection& section);

}  // namespace rubato
