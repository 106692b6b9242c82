// Helpers shared by the end-to-end decode benchmarks (decode_e2e.cc: dense; decode_e2e_sfi.cc:
// SFI against dense): batch x context points, percentiles, the device's copy bandwidth, the
// bytes a decode step reads, and writing the JSON report.
#pragma once

#include <cuda_runtime_api.h>

#include <nlohmann/json.hpp>

#include <algorithm>
#include <cstddef>
#include <cstdio>
#include <fstream>
#include <sstream>
#include <string>
#include <vector>

#include "common/hf_config.h"
#include "common/status.h"
#include "inference_rank/model/cuda_weights.h"
#include "kernels/cuda/cuda_status.h"
#include "kernels/cuda/device_buffer.h"

namespace rubato::bench {

struct Point {
  int batch = 0;
  int context = 0;
};

// Writes `report` to `path` as indented JSON (nothing when the path is empty); false, with a
// message on stderr naming `program`, when the file cannot be written.
inline bool WriteReport(const nlohmann::json& report, const std::string& path,
                        const char* program) {
  if (path.empty()) return true;
  std::ofstream out(path);
  out << report.dump(2) << "\n";
  if (!out) {
    std::fprintf(stderr, "%s: cannot write %s\n", program, path.c_str());
    return false;
  }
  return true;
}

// "8x12288,16x32768" -> points; empty: the one point {batch, context}.
inline Result<std::vector<Point>> ParsePoints(const std::string& list, int batch, int context) {
  if (list.empty()) return std::vector<Point>{{batch, context}};
  std::vector<Point> points;
  std::stringstream items(list);
  std::string item;
  while (std::getline(items, item, ',')) {
    Point p;
    char x = 0;
    std::stringstream one(item);
    if (!(one >> p.batch >> x >> p.context) || x != 'x' || !one.eof() || p.batch < 1 ||
        p.context < 1) {
      return InvalidArgumentError("--points: '" + item + "' is not BATCHxCONTEXT (e.g. 16x32768)");
    }
    points.push_back(p);
  }
  if (points.empty()) return InvalidArgumentError("--points is empty");
  return points;
}

// The q-quantile (nearest rank) of `values`, which must not be empty.
inline double Percentile(std::vector<double> values, double q) {
  std::sort(values.begin(), values.end());
  const size_t index = static_cast<size_t>(q * static_cast<double>(values.size() - 1) + 0.5);
  return values[std::min(index, values.size() - 1)];
}

// Device-to-device copy bandwidth: bytes read + written per second, median of 10 copies.
inline Result<double> CopyBandwidth(size_t bytes, cudaStream_t stream) {
  RUBATO_ASSIGN_OR_RETURN(auto source,
                          cuda::DeviceBuffer<unsigned char>::Allocate(bytes, "copy source"));
  RUBATO_ASSIGN_OR_RETURN(auto dest,
                          cuda::DeviceBuffer<unsigned char>::Allocate(bytes, "copy destination"));
  RUBATO_CUDA_RETURN_IF_ERROR(cudaMemsetAsync(source.data(), 1, bytes, stream), "memset");
  cudaEvent_t start, stop;
  RUBATO_CUDA_RETURN_IF_ERROR(cudaEventCreate(&start), "creating an event");
  RUBATO_CUDA_RETURN_IF_ERROR(cudaEventCreate(&stop), "creating an event");
  std::vector<double> seconds;
  Status status;
  for (int i = 0; i < 12 && status.ok(); ++i) {
    cudaEventRecord(start, stream);
    cudaMemcpyAsync(dest.data(), source.data(), bytes, cudaMemcpyDeviceToDevice, stream);
    cudaEventRecord(stop, stream);
    status = cuda::CudaStatus(cudaEventSynchronize(stop), "timing the copy");
    float ms = 0;
    cudaEventElapsedTime(&ms, start, stop);
    if (i >= 2) seconds.push_back(ms / 1e3);
  }
  cudaEventDestroy(start);
  cudaEventDestroy(stop);
  RUBATO_RETURN_IF_ERROR(status);
  return 2.0 * static_cast<double>(bytes) / Percentile(seconds, 0.5);
}

// Bytes one decode step reads from the weights: every layer, the final norm and the lm_head
// (the embedding lookup reads only `batch` rows; a tied table is read once, as the lm_head).
inline double WeightBytesPerStep(const ModelConfig& config) {
  const double all = static_cast<double>(CudaWeightBytes(config));
  if (config.tie_word_embeddings) return all;
  return all - 2.0 * config.vocab_size * static_cast<double>(config.hidden_size);
}

// Bytes of K and V one decode step reads for sequences attending `keys` positions on average.
inline double KvBytesPerStep(const ModelConfig& config, int batch, double keys) {
  return static_cast<double>(batch) * keys * config.num_layers * 2.0 * config.num_kv_heads *
         config.head_dim * 2.0;
}

}  // namespace rubato::bench
