// libFuzzer target: a SyncKV calibration file through ParseSyncKvCalibration. A file it accepts
// must hold what synckv_calibration.h promises (S of layers x KV heads^2, finite in [0, 1];
// every layer's clusters non-empty with an R-head inside each), or the fuzzer traps; the policy
// then clusters S again, which must succeed. Seeds: corpus/synckv_calibration.
#include <cmath>
#include <cstddef>
#include <cstdint>
#include <string_view>

#include "inference_rank/policies/synckv/synckv_calibration.h"

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  const std::string_view text(reinterpret_cast<const char*>(data), size);
  const auto calibration = rubato::ParseSyncKvCalibration(text, "fuzz/calibration.json");
  if (!calibration.ok()) return 0;
  const rubato::SyncKvCalibration& c = *calibration;
  const int layers = c.num_layers, heads = c.num_kv_heads;
  if (layers < 1 || heads < 1 || c.clusters < 1 || c.clusters > heads) __builtin_trap();
  if (c.similarity.size() != static_cast<size_t>(layers) * heads * heads) __builtin_trap();
  if (c.layers.size() != static_cast<size_t>(layers)) __builtin_trap();
  for (double s : c.similarity) {
    if (!std::isfinite(s) || s < 0.0 || s > 1.0) __builtin_trap();
  }
  for (const rubato::HeadClusters& layer : c.layers) {
    if (layer.representative.size() != static_cast<size_t>(c.clusters)) __builtin_trap();
    for (int g = 0; g < c.clusters; ++g) {
      const int r = layer.representative[static_cast<size_t>(g)];
      if (r < 0 || r >= heads || layer.cluster[static_cast<size_t>(r)] != g) __builtin_trap();
    }
  }
  // What the policy does with a file it loaded: cluster every layer again.
  rubato::SyncKvCalibration again = c;
  if (heads <= 16 && !rubato::ClusterCalibration(again, c.clusters).ok()) __builtin_trap();
  return 0;
}
