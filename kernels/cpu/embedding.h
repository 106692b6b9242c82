// Token embedding lookup: gathers rows of the embedding table into an fp32 activation.
#pragma once

#include <span>

#include "common/status.h"

namespace rubato {

// out[t][:] = table[token_ids[t]][:].
//   table: [vocab_size][hidden], f32
//   out:   [token_ids.size()][hidden], f32
// Returns InvalidArgument naming the position and id when an id is outside [0, vocab_size);
// nothing is written in that case.
Status EmbeddingLookup(const float* table, int vocab_size, int hidden,
                       std::span<const int> token_ids, float* out);

}  // namespace rubato
