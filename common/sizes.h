// Small size arithmetic shared by the backends: powers of two for buffers that only grow (few
// reallocations while a server warms up), ceiling division, growing a host vector, and the
// 16-byte aligned offsets of the fields packed into one step-input buffer.
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

// A capacity that only grows: `have` when it covers `want`, else the power of two at or above it.
inline int GrowCapacity(int have, int want) { return have >= want ? have : RoundUpPow2(want); }

inline size_t Align16(size_t bytes) { return (bytes + 15) / 16 * 16; }

// Lays out consecutive fields of one packed buffer, each at a 16-byte aligned offset.
class PackedOffsets {
 public:
  // The offset of a field of `bytes` bytes placed after the ones before it.
  size_t Place(size_t bytes) {
    const size_t at = offset_;
    offset_ += Align16(bytes);
    return at;
  }
  size_t bytes() const { return offset_; }

 private:
  size_t offset_ = 0;
};

// Grows `buffer` to at least `size` elements; never shrinks (no reallocation once warm).
template <typename T>
void GrowVector(std::vector<T>& buffer, size_t size) {
  if (buffer.size() < size) buffer.resize(size);
}

}  // namespace rubato
