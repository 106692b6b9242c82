// StreamingLLM: a forward window and nothing else (see streaming_llm_policy.h).
#include "inference_rank/policies/streaming_llm/streaming_llm_policy.h"

#include <limits>

#include "common/yaml_map_reader.h"

namespace rubato {

const PolicyTraits& StreamingLlmPolicy::traits() const {
  static const PolicyTraits traits{ResidencySet{KvResidency::kLocal}, true};
  return traits;
}

Result<std::unique_ptr<AttentionBackend>> StreamingLlmPolicy::MakeBackend(Model& /*model*/,
                                                                          int /*max_batch*/) const {
  return std::unique_ptr<AttentionBackend>();
}

std::unique_ptr<PolicyRequest> StreamingLlmPolicy::Admit(KvResidency /*residency*/) {
  return nullptr;
}

Result<std::unique_ptr<AttentionPolicy>> CreateStreamingLlmPolicy(const PolicySection& section) {
  RUBATO_ASSIGN_OR_RETURN(YamlMapReader params, section.ParamsReader());
  constexpr int64_t kMax = std::numeric_limits<int>::max();  // recent = kUnbounded is dense
  AttentionWindow window{kDefaultSinkTokens, kDefaultRecentWindow};
  RUBATO_RETURN_IF_ERROR(params.ReadInt("sink_tokens", 0, kMax, &window.sink_tokens));
  RUBATO_RETURN_IF_ERROR(params.ReadInt("recent_window", 1, kMax, &window.recent_tokens));
  RUBATO_RETURN_IF_ERROR(params.Finish());
  return std::unique_ptr<AttentionPolicy>(new StreamingLlmPolicy(window));
}

}  // namespace rubato
