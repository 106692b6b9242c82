// Helpers shared by the end-to-end decode benchmarks (decode_e2e.cc: dense; decode_e2e_sfi.cc:
// SFI against dense): their common flags and main(), the random-weight model, the KV pool for a
// list of batch x context points and its random fill, percentiles, the device's copy bandwidth,
// the bytes a decode step reads, and the JSON report.
#pragma once

#include <cuda_runtime_api.h>

#include <CLI/CLI.hpp>
#include <nlohmann/json.hpp>

#include <algorithm>
#include <cstddef>
#include <cstdint>
#include <cstdio>
#include <fstream>
#include <memory>
#include <span>
#include <sstream>
#include <string>
#include <vector>

#include "common/hf_config.h"
#include "common/status.h"
#include "inference_rank/model/cuda_kv_storage.h"
#include "inference_rank/model/cuda_model.h"
#include "inference_rank/model/cuda_weights.h"
#include "kernels/cuda/cuda_status.h"
#include "kernels/cuda/device_buffer.h"
#include "kernels/cuda/random_fill.cuh"

#ifndef RUBATO_GIT_COMMIT
#define RUBATO_GIT_COMMIT "unknown"
#endif

namespace rubato::bench {

struct Point {
  int batch = 0;
  int context = 0;
};

// Memory kept free beyond the KV pool (and a benchmark's other buffers) for activations,
// workspaces and cuBLASLt.
constexpr size_t kHeadroomBytes = size_t{2} << 30;

// The flags every end-to-end decode benchmark takes (AddCommonOptions); the rest are its own.
struct CommonOptions {
  std::string config;  // model directory with config.json
  int block_size = 64;
  uint64_t seed = 1;
  int device = 0;
  std::string commit;        // empty: the build's
  std::string out;           // JSON report path; empty: none
  std::string command_line;  // set by BenchMain
};

inline void AddCommonOptions(CLI::App& app, CommonOptions& options) {
  app.add_option("--config", options.config, "model directory with config.json")->required();
  app.add_option("--block-size", options.block_size, "KV block tokens: 16 or 64");
  app.add_option("--seed", options.seed, "seed of the weights and KV values");
  app.add_option("--device", options.device, "CUDA device index");
  app.add_option("--commit", options.commit, "commit to record (default: the build's)");
  app.add_option("--out", options.out, "JSON report path");
}

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

// The config's model with random bf16 weights generated on the device, and the device's name.
struct BenchModel {
  std::unique_ptr<Model> owner;
  CudaModel* model = nullptr;
  std::string device_name;
};
inline Result<BenchModel> LoadBenchModel(const CommonOptions& options) {
  CudaModelOptions model_options;
  model_options.random_weights = true;
  model_options.seed = options.seed;
  model_options.device = options.device;
  BenchModel loaded;
  RUBATO_ASSIGN_OR_RETURN(loaded.owner, LoadCudaModel(options.config, model_options));
  loaded.model = dynamic_cast<CudaModel*>(loaded.owner.get());
  if (loaded.model == nullptr) return InternalError("LoadCudaModel did not return a CudaModel");
  cudaDeviceProp properties{};
  RUBATO_CUDA_RETURN_IF_ERROR(cudaGetDeviceProperties(&properties, options.device),
                              "reading the device properties");
  loaded.device_name = properties.name;
  return loaded;
}

// Blocks of `block_size` tokens that the largest point needs once each sequence grows by `grown`
// tokens (points run one after the other and release their blocks).
inline int BlocksForPoints(const std::vector<Point>& points, int grown, int block_size) {
  int blocks = 0;
  for (const Point& p : points) {
    blocks = std::max(blocks, p.batch * ((p.context + grown + block_size - 1) / block_size));
  }
  return blocks;
}

// The KV pool of `num_blocks` blocks for `model`, after checking that it, `extra_bytes` of other
// buffers (`extra_what`, e.g. ", the SFI maintenance ring up to N"; empty when none) and
// kHeadroomBytes fit in the free device memory: ResourceExhausted naming every term otherwise.
inline Result<std::unique_ptr<PagedKvCache>> CreateBenchKvCache(CudaModel& model, int block_size,
                                                                int num_blocks, size_t extra_bytes,
                                                                const std::string& extra_what) {
  const ModelConfig& config = model.config();
  const KvCacheShape shape{config.num_layers, config.num_kv_heads, config.head_dim, block_size,
                           num_blocks};
  const size_t pool_bytes = DeviceKvStorage::PoolBytes(shape);
  size_t free_bytes = 0, total_bytes = 0;
  RUBATO_CUDA_RETURN_IF_ERROR(cudaMemGetInfo(&free_bytes, &total_bytes), "querying memory");
  if (pool_bytes + extra_bytes + kHeadroomBytes > free_bytes) {
    return ResourceExhaustedError(
        "the KV cache for these points needs " + std::to_string(pool_bytes) + " bytes (" +
        std::to_string(num_blocks) + " blocks of " + std::to_string(block_size) + " tokens)" +
        extra_what + ", plus " + std::to_string(kHeadroomBytes) + " bytes of headroom, but only " +
        std::to_string(free_bytes) + " of " + std::to_string(total_bytes) +
        " bytes are free after the weights; run fewer or smaller points");
  }
  return model.CreateKvCache(block_size, num_blocks);
}

// Makes every sequence hold `context` positions of random KV without a prefill: reserves their
// blocks (all or nothing), fills the whole K and V pools of `cache` (made by `model`) with random
// bf16 in [-1, 1] on the model's stream, and sets num_tokens = context. The values mean nothing;
// decode speed does not depend on them. Sequences must be empty.
inline Status FillRandomKv(CudaModel& model, PagedKvCache& cache,
                           std::span<KvSequence* const> sequences, int context, uint64_t seed) {
  auto* kv = dynamic_cast<DeviceKvStorage*>(cache.storage());
  if (kv == nullptr) {
    return InvalidArgumentError("FillRandomKv: the KV cache was not created by a CUDA model");
  }
  if (context < 1) {
    return InvalidArgumentError("FillRandomKv: context " + std::to_string(context) + " < 1");
  }
  int needed = 0;
  for (KvSequence* sequence : sequences) {
    if (sequence == nullptr || sequence->num_tokens != 0 || !sequence->block_table.empty()) {
      return InvalidArgumentError("FillRandomKv: sequences must be empty");
    }
    needed += cache.BlocksFor(context);
  }
  if (needed > cache.free_blocks()) {
    return ResourceExhaustedError("FillRandomKv: " + std::to_string(sequences.size()) +
                                  " sequences of " + std::to_string(context) + " tokens need " +
                                  std::to_string(needed) + " KV blocks but only " +
                                  std::to_string(cache.free_blocks()) + " are free");
  }
  for (KvSequence* sequence : sequences) RUBATO_RETURN_IF_ERROR(cache.Reserve(*sequence, context));
  RUBATO_CUDA_RETURN_IF_ERROR(cudaSetDevice(model.device()), "selecting the model's device");
  int stream_id = 0;
  for (cuda::DeviceBuffer<__nv_bfloat16>* pool : {&kv->keys(), &kv->values()}) {
    cuda::RandomFillParams fill;
    fill.out = pool->data();
    fill.count = static_cast<int64_t>(pool->size());
    fill.seed = seed;
    fill.stream = static_cast<uint64_t>(stream_id++);
    fill.bound = 1.f;
    RUBATO_RETURN_IF_ERROR(cuda::RandomFill(fill, model.stream()));
  }
  RUBATO_CUDA_RETURN_IF_ERROR(cudaStreamSynchronize(model.stream()), "filling the KV pools");
  for (KvSequence* sequence : sequences) sequence->num_tokens = context;
  return Status::Ok();
}

// The report's device, commit, command, model and KV cache entries.
inline void AddReportHeader(nlohmann::json& report, const CommonOptions& options,
                            const BenchModel& loaded, const PagedKvCache& cache,
                            const char* kv_values) {
  const ModelConfig& config = loaded.model->config();
  report["device"] = loaded.device_name;
  report["commit"] = options.commit.empty() ? std::string(RUBATO_GIT_COMMIT) : options.commit;
  report["command"] = options.command_line;
  report["model"] = {{"config", options.config},
                     {"architecture", config.architecture},
                     {"layers", config.num_layers},
                     {"hidden", config.hidden_size},
                     {"heads", config.num_heads},
                     {"kv_heads", config.num_kv_heads},
                     {"head_dim", config.head_dim},
                     {"vocab", config.vocab_size},
                     {"weights", "random, generated on the device, bf16"},
                     {"weight_bytes", loaded.model->weight_bytes()}};
  report["kv_cache"] = {{"dtype", "bf16"},
                        {"block_size", options.block_size},
                        {"blocks", cache.shape().num_blocks},
                        {"pool_bytes", cache.pool_bytes()},
                        {"values", kv_values}};
}

// main() of a benchmark: parses the flags (app holds AddCommonOptions' and the benchmark's own),
// runs `run(report)` (which prints its own table), writes the report. Exit status 0, or 1 with
// the error on stderr naming `program`.
template <typename Run>
int BenchMain(const char* program, CLI::App& app, CommonOptions& options, int argc, char** argv,
              Run run) {
  CLI11_PARSE(app, argc, argv);
  for (int i = 0; i < argc; ++i) options.command_line += (i ? " " : "") + std::string(argv[i]);
  nlohmann::json report;
  const Status status = run(report);
  if (!status.ok()) {
    std::fprintf(stderr, "%s: %s\n", program, status.message().c_str());
    return 1;
  }
  return WriteReport(report, options.out, program) ? 0 : 1;
}

}  // namespace rubato::bench
