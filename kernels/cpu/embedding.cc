// Token embedding lookup (see embedding.h).
#include "kernels/cpu/embedding.h"

#include <algorithm>
#include <cstddef>
#include <string>

namespace rubato {

Status EmbeddingLookup(const float* table, int vocab_size, int hidden,
                       std::span<const int> token_ids, float* out) {
  for (size_t t = 0; t < token_ids.size(); ++t) {
    const int id = token_ids[t];
    if (id < 0 || id >= vocab_size) {
      return InvalidArgumentError("embedding: token id " + std::to_string(id) + " at position " +
                                  std::to_string(t) + " is outside the vocabulary [0, " +
                                  std::to_string(vocab_size) + ")");
    }
  }
  for (size_t t = 0; t < token_ids.size(); ++t) {
    const float* row = table + static_cast<size_t>(token_ids[t]) * hidden;
    std::copy(row, row + hidden, out + t * hidden);
  }
  return Status::Ok();
}

}  // namespace rubato
