// Small size arithmetic shared by the backends: powers of two for buffers that only grow (few
// reallocations while a server warms up), ceiling division, and growing a host vector.
#pragma once

#include <bit>
#include <cstddef>
#include <vector>

namespace rubato {

// The power of two at or above `value`; values <= 1 are returned as they are.
inline int RoundUpPow2(int value) {
  return value <= 1 ? value : static_cast<int>(std::bit_ceil(static_cast<unsigned>(value)));
}

inline int CeilDiv(int a, int b) { return (a + b - 1) / b; }

// Grows `buffer` to at least `size` elements; never shrinks (no reallocation once warm).
template <typename T>
void GrowVector(std::vector<T>& buffer, size_t size) {
  if (buffer.size() < size) buffer.resize(size);
}

}  // namespace rubato
