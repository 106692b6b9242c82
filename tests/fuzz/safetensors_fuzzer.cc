// libFuzzer target: a .safetensors file's bytes through SafetensorsFile::Parse (header length,
// JSON header, dtypes, shapes, data offsets, overlaps). Every tensor it accepts is then read
// whole, so ASan reports any view that reaches past the input. Seeds: corpus/safetensors.
#include <cstddef>
#include <cstdint>
#include <span>
#include <vector>

#include "common/dtype.h"
#include "common/safetensors.h"

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  const std::span<const std::byte> bytes(reinterpret_cast<const std::byte*>(data), size);
  const auto file = rubato::SafetensorsFile::Parse(bytes, "fuzz.safetensors");
  if (!file.ok()) return 0;
  std::vector<float> values;
  for (const rubato::SafetensorsTensor& tensor : (*file)->tensors()) {
    const auto count = static_cast<size_t>(tensor.view.numel());
    values.resize(count);
    rubato::ConvertToF32(tensor.view.dtype, tensor.view.data, values.data(), count);
    if ((*file)->Find(tensor.name) != &tensor) __builtin_trap();  // the index lost a tensor
  }
  return 0;
}
