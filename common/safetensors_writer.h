// Writes .safetensors files: used by tests to fabricate checkpoints and by tools that export
// weights. The output follows the reference implementation (huggingface/safetensors): an
// 8-byte little-endian header length, a JSON header padded with spaces to a multiple of 8 bytes
// (so the data section starts 8-byte aligned), then the tensors back to back in the given order.
#pragma once

#include <filesystem>
#include <map>
#include <string>
#include <string_view>
#include <utility>
#include <vector>

#include "common/status.h"
#include "common/tensor.h"

namespace rubato {

// The safetensors dtype tag of `dtype`: "F32", "BF16" or "F16".
std::string_view SafetensorsDTypeTag(DType dtype);

// Writes `tensors` (name, view; views are read, not owned) and the optional "__metadata__"
// string map to `path`, replacing any existing file. Names must be non-empty, unique and not
// "__metadata__"; dims must be non-negative; a view with bytes must have data.
Status WriteSafetensors(const std::filesystem::path& path,
                        const std::vector<std::pair<std::string, TensorView>>& tensors,
                        const std::map<std::string, std::string>& metadata = {});

}  // namespace rubato
