// libFuzzer target: a Kascade calibration file through ParseCalibration. A file it accepts must
// hold what kascade_calibration.h promises (anchors ascending from layer 0 within the layers, a
// head map of layers x KV heads in range and the identity on anchors, S of L x L), or the fuzzer
// traps. Seeds: corpus/kascade_calibration (the committed calibration files).
#include <cstddef>
#include <cstdint>
#include <string_view>

#include "inference_rank/policies/kascade/kascade_calibration.h"

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  const std::string_view text(reinterpret_cast<const char*>(data), size);
  const auto calibration = rubato::ParseCalibration(text, "fuzz/calibration.json");
  if (!calibration.ok()) return 0;
  const rubato::KascadeCalibration& c = *calibration;
  const int layers = c.num_layers, heads = c.num_kv_heads;
  if (layers < 1 || heads < 1 || c.anchors.empty() || c.anchors.front() != 0) __builtin_trap();
  if (c.head_map.size() != static_cast<size_t>(layers)) __builtin_trap();
  if (c.similarity.size() != static_cast<size_t>(layers) * layers) __builtin_trap();
  for (int layer = 0; layer < layers; ++layer) {
    // What the policy reads per layer (kascade_policy.cc): the anchor and the head map row.
    const int anchor = c.AnchorOf(layer);
    if (anchor < 0 || anchor > layer || !c.IsAnchor(anchor)) __builtin_trap();
    const auto& row = c.head_map[static_cast<size_t>(layer)];
    if (row.size() != static_cast<size_t>(heads)) __builtin_trap();
    for (int h = 0; h < heads; ++h) {
      const int to = row[static_cast<size_t>(h)];
      if (to < 0 || to >= heads || (anchor == layer && to != h)) __builtin_trap();
    }
  }
  return 0;
}
