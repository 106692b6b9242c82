// libFuzzer target: a Hugging Face config.json through ParseModelConfig. A config it accepts must
// hold what hf_config.h promises (positive sizes within their bounds, query heads a multiple of
// the KV heads), or the fuzzer traps. Seeds: corpus/hf_config.
#include <cstddef>
#include <cstdint>
#include <string_view>

#include "common/hf_config.h"

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  const std::string_view text(reinterpret_cast<const char*>(data), size);
  const auto config = rubato::ParseModelConfig(text, "fuzz/config.json");
  if (!config.ok()) return 0;
  const bool positive = config->vocab_size > 0 && config->hidden_size > 0 &&
                        config->intermediate_size > 0 && config->num_layers > 0 &&
                        config->num_heads > 0 && config->num_kv_heads > 0 && config->head_dim > 0 &&
                        config->max_position_embeddings > 0;
  if (!positive || config->num_heads % config->num_kv_heads != 0) __builtin_trap();
  // The products the model sizes its buffers with must not overflow (UBSan checks them).
  static_cast<void>(config->gqa_group() + config->q_dim() + config->kv_dim());
  return 0;
}
