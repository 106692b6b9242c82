// The step entries LongFlow's model-level tests feed Model::Forward one at a time, on the CPU
// and the CUDA model alike: the prompt in two chunks (its first length / 2 + 3 tokens, then the
// rest), then one decode token a step, each planned by the request when there is one.
#pragma once

#include <span>

#include "inference_rank/attention/policy.h"
#include "inference_rank/model/model.h"

namespace rubato::longflow_test {

// The entry at `start` of `sequence`: a prompt chunk while the prompt lasts (logits only for
// the chunk that ends it), else `*next_token` alone. With `request`, its plan and `evicting`.
inline ForwardEntry StepEntry(KvSequence& sequence, std::span<const int> prompt, int start,
                              const int* next_token, PolicyRequest* request,
                              SlotKvForward* evicting) {
  ForwardEntry entry;
  entry.sequence = &sequence;
  entry.start_position = start;
  const int length = static_cast<int>(prompt.size());
  if (start < length) {
    const int end = start == 0 ? length / 2 + 3 : length;
    entry.tokens = prompt.subspan(static_cast<size_t>(start), static_cast<size_t>(end - start));
    entry.logits = end == length ? LogitsWanted::kLast : LogitsWanted::kNone;
    if (request != nullptr)
      entry.attention = request->PlanPrefill(start, end - start, end == length);
  } else {
    entry.tokens = std::span<const int>(next_token, 1);
    if (request != nullptr) entry.attention = request->PlanDecode(start);
  }
  if (request != nullptr) entry.slots = evicting;
  return entry;
}

}  // namespace rubato::longflow_test
