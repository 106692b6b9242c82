// Requests shared by the engine tests, the policies' engine tests among them: prompts over the
// tiny models' 97-token vocabulary and seeded sampled requests.
#pragma once

#include <cstdint>
#include <vector>

#include "inference_rank/engine/engine.h"

namespace rubato::engine_test {

// `length` token ids in [0, 97), varied by `salt`.
inline std::vector<int> Prompt(int length, int salt) {
  std::vector<int> ids;
  for (int i = 0; i < length; ++i) ids.push_back((i * 19 + salt * 7 + 1) % 97);
  return ids;
}

// Sampled at temperature 1 (seeded by `salt`), stop token 96: greedy decoding of a random tiny
// model repeats one token, which would hide a changed distribution.
inline GenerationRequest Sampled(int prompt_length, int salt, int max_new_tokens) {
  GenerationRequest request;
  request.prompt_ids = Prompt(prompt_length, salt);
  request.max_new_tokens = max_new_tokens;
  request.stop_token_ids = {96};
  request.sampling.temperature = 1.0f;
  request.sampling.seed = static_cast<uint64_t>(salt);
  return request;
}

}  // namespace rubato::engine_test
