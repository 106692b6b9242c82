// Key norms for the SFI key-norm prior (key_norms.h).
#include "kernels/cpu/key_norms.h"

#include <cmath>
#include <cstdint>
#include <string>

namespace rubato {

Status KeyNorms(const PagedKvView& kv, int begin, int count, float* norms, int64_t norms_stride) {
  const auto invalid = [](const std::string& what) {
    return InvalidArgumentError("KeyNorms: " + what);
  };
  if (count == 0) return Status::Ok();
  if (kv.keys == nullptr || kv.block_table == nullptr || norms == nullptr) {
    return invalid("keys, block_table and norms must be set");
  }
  if (kv.block_tokens < 1 || kv.num_kv_heads < 1 || kv.head_dim < 1) {
    return invalid("block_tokens " + std::to_string(kv.block_tokens) + ", num_kv_heads " +
                   std::to_string(kv.num_kv_heads) + " and head_dim " +
                   std::to_string(kv.head_dim) + " must be >= 1");
  }
  if (begin < 0 || count < 0 || static_cast<int64_t>(begin) + count > INT32_MAX) {
    return invalid("positions [" + std::to_string(begin) + ", " + std::to_string(begin) + " + " +
                   std::to_string(count) + ") must lie in [0, 2^31)");
  }
  if (norms_stride < count) {
    return invalid("norms_stride " + std::to_string(norms_stride) + " < count " +
                   std::to_string(count));
  }
  for (int h = 0; h < kv.num_kv_heads; ++h) {
    float* row = norms + static_cast<int64_t>(h) * norms_stride;
    for (int i = 0; i < count; ++i) {
      const float* key = kv.keys + kv.Offset(begin + i, h);
      double squares = 0.0;
      for (int d = 0; d < kv.head_dim; ++d) squares += static_cast<double>(key[d]) * key[d];
      row[i] = static_cast<float>(std::sqrt(squares));
    }
  }
  return Status::Ok();
}

}  // namespace rubato
