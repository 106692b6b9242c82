// Paged KV append (see kv_append.h).
#include "kernels/cpu/kv_append.h"

#include <algorithm>
#include <cstddef>

namespace rubato {

void AppendToPagedKv(const float* keys, const float* values, int tokens, int start_position,
                     const PagedKvView& kv) {
  const size_t head_dim = static_cast<size_t>(kv.head_dim);
  for (int t = 0; t < tokens; ++t) {
    for (int h = 0; h < kv.num_kv_heads; ++h) {
      const size_t src = (static_cast<size_t>(t) * kv.num_kv_heads + h) * head_dim;
      const size_t dst = kv.Offset(start_position + t, h);
      std::copy(keys + src, keys + src + head_dim, kv.keys + dst);
      std::copy(values + src, values + src + head_dim, kv.values + dst);
    }
  }
}

}  // namespace rubato
