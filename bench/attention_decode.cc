// rubato_bench_attention_decode: rubato's paged split-K decode attention at batch x heads x
// contexts, with the device-to-device copy bandwidth measured in the same process as the memory
// roofline (bench/attention_sdpa.py times PyTorch SDPA on the same shapes). Random bf16 inputs,
// shuffled blocks, K and V read from HBM. A benchmark, not a test.
// Method and a command line: docs/benchmarks.md "Decode attention".
#include <cuda_bf16.h>
#include <cuda_runtime_api.h>

#include <CLI/CLI.hpp>
#include <nlohmann/json.hpp>

#include <algorithm>
#include <cmath>
#include <cstdio>
#include <fstream>
#include <iostream>
#include <numeric>
#include <random>
#include <sstream>
#include <string>
#include <vector>

#include "common/dtype.h"
#include "common/status.h"
#include "kernels/cuda/decode_attention.cuh"
#include "kernels/cuda/device_buffer.h"

namespace rubato {
namespace {

using cuda::DeviceBuffer;

struct Options {
  int batch = 16;
  int heads = 32;
  int kv_heads = 8;
  int head_dim = 128;
  int block_size = 64;
  std::vector<int> contexts = {8192, 32768, 131072};
  int warmup = 10;
  int iterations = 50;
  bool shuffle_blocks = true;  // false: each sequence's blocks contiguous in the pool
  bool row_copies = false;     // true: the kernel's row-copy path (pool size withheld)
  // Bytes between the start of the V allocation and the V pool: the K and V pools of equal
  // power-of-two sizes otherwise sit a power of two apart, which may map K row i and V row i to
  // the same DRAM channel (an experiment knob; 0 = none).
  size_t v_offset_bytes = 0;
  std::vector<int> splits = {0};  // 0 = the kernel's own choice; others force a split count
  // Also write every raw score (DecodeAttentionParams::scores, [batch][heads][context] f32), as
  // an SFI slow step's decode launch does: what that output costs the kernel.
  bool scores = false;
  std::string out;
};

double Median(std::vector<double> values) {
  std::sort(values.begin(), values.end());
  return values[values.size() / 2];
}

// Fills `count` bf16 with a repeated 32 MB block of random values (uploading gigabytes from the
// host would take longer than the benchmark; the repetition is far larger than any cache).
Status FillRandom(__nv_bfloat16* device, size_t count, uint64_t seed) {
  const size_t pattern = std::min<size_t>(count, 16u << 20);
  std::vector<uint16_t> host(pattern);
  std::mt19937_64 rng(seed);
  std::uniform_real_distribution<float> dist(-1.f, 1.f);
  for (auto& bits : host) bits = F32ToBf16(dist(rng));
  RUBATO_CUDA_RETURN_IF_ERROR(
      cudaMemcpy(device, host.data(), pattern * 2, cudaMemcpyHostToDevice), "uploading pattern");
  for (size_t done = pattern; done < count; done += pattern) {
    const size_t n = std::min(pattern, count - done);
    RUBATO_CUDA_RETURN_IF_ERROR(
        cudaMemcpy(device + done, device, n * 2, cudaMemcpyDeviceToDevice), "tiling pattern");
  }
  return Status::Ok();
}

// Device-to-device copy bandwidth, bytes read + written per second (docs/design.md §10
// "Benchmark ceilings").
Result<double> CopyBandwidth(size_t bytes) {
  RUBATO_ASSIGN_OR_RETURN(auto source, DeviceBuffer<unsigned char>::Allocate(bytes, "copy source"));
  RUBATO_ASSIGN_OR_RETURN(auto dest, DeviceBuffer<unsigned char>::Allocate(bytes, "copy dest"));
  RUBATO_CUDA_RETURN_IF_ERROR(cudaMemset(source.data(), 1, bytes), "memset");
  cudaEvent_t start, stop;
  cudaEventCreate(&start);
  cudaEventCreate(&stop);
  std::vector<double> seconds;
  for (int i = 0; i < 12; ++i) {
    cudaEventRecord(start);
    cudaMemcpyAsync(dest.data(), source.data(), bytes, cudaMemcpyDeviceToDevice);
    cudaEventRecord(stop);
    RUBATO_CUDA_RETURN_IF_ERROR(cudaEventSynchronize(stop), "timing the copy");
    float ms = 0;
    cudaEventElapsedTime(&ms, start, stop);
    if (i >= 2) seconds.push_back(ms / 1e3);
  }
  cudaEventDestroy(start);
  cudaEventDestroy(stop);
  return 2.0 * static_cast<double>(bytes) / Median(seconds);
}

Status Run(const Options& options, nlohmann::json& report) {
  cudaDeviceProp properties{};
  RUBATO_CUDA_RETURN_IF_ERROR(cudaGetDeviceProperties(&properties, 0), "reading the device");
  RUBATO_ASSIGN_OR_RETURN(const double copy_bandwidth, CopyBandwidth(size_t{4} << 30));
  report["device"] = properties.name;
  report["copy_bandwidth_bytes_per_s"] = copy_bandwidth;
  report["shape"] = {{"batch", options.batch},         {"heads", options.heads},
                     {"kv_heads", options.kv_heads},   {"head_dim", options.head_dim},
                     {"block_size", options.block_size}, {"dtype", "bf16"}};
  report["copies"] = options.row_copies ? "rows" : "tensor maps where the window is dense";
  std::printf("device %s, device-to-device copy %.0f GB/s (read + write)\n", properties.name,
              copy_bandwidth / 1e9);

  const int max_context = *std::max_element(options.contexts.begin(), options.contexts.end());
  const int blocks_per_sequence = (max_context + options.block_size - 1) / options.block_size;
  const size_t num_blocks = static_cast<size_t>(blocks_per_sequence) * options.batch;
  const size_t pool_elements =
      num_blocks * options.kv_heads * options.block_size * options.head_dim;
  RUBATO_ASSIGN_OR_RETURN(auto keys, DeviceBuffer<__nv_bfloat16>::Allocate(pool_elements, "K"));
  const size_t v_offset = options.v_offset_bytes / 2;  // elements
  RUBATO_ASSIGN_OR_RETURN(
      auto values, DeviceBuffer<__nv_bfloat16>::Allocate(pool_elements + v_offset, "V"));
  RUBATO_RETURN_IF_ERROR(FillRandom(keys.data(), pool_elements, 1));
  RUBATO_RETURN_IF_ERROR(FillRandom(values.data(), pool_elements + v_offset, 2));

  std::vector<int32_t> physical(num_blocks);
  std::iota(physical.begin(), physical.end(), 0);
  if (options.shuffle_blocks) std::shuffle(physical.begin(), physical.end(), std::mt19937_64(3));
  RUBATO_ASSIGN_OR_RETURN(auto tables, DeviceBuffer<int32_t>::Allocate(num_blocks, "tables"));
  RUBATO_RETURN_IF_ERROR(tables.CopyFromHost(physical.data(), physical.size(), nullptr));

  const size_t q_elements = static_cast<size_t>(options.batch) * options.heads * options.head_dim;
  RUBATO_ASSIGN_OR_RETURN(auto queries, DeviceBuffer<__nv_bfloat16>::Allocate(q_elements, "q"));
  RUBATO_ASSIGN_OR_RETURN(auto out, DeviceBuffer<__nv_bfloat16>::Allocate(q_elements, "out"));
  RUBATO_RETURN_IF_ERROR(FillRandom(queries.data(), q_elements, 4));
  RUBATO_ASSIGN_OR_RETURN(auto lens, DeviceBuffer<int32_t>::Allocate(options.batch, "lens"));

  for (int context : options.contexts) {
   for (int splits : options.splits) {
    const std::vector<int32_t> host_lens(options.batch, context);
    RUBATO_RETURN_IF_ERROR(lens.CopyFromHost(host_lens.data(), host_lens.size(), nullptr));
    const size_t workspace_bytes = cuda::DecodeAttentionWorkspaceBytes(
        options.batch, options.heads, options.head_dim, context, false);
    RUBATO_ASSIGN_OR_RETURN(auto workspace,
                            DeviceBuffer<unsigned char>::Allocate(workspace_bytes, "workspace"));
    cuda::DecodeAttentionParams params;
    params.q = queries.data();
    params.q_row_stride = static_cast<int64_t>(options.heads) * options.head_dim;
    params.key_pool = keys.data();
    params.value_pool = values.data() + v_offset;
    params.block_tables = tables.data();
    params.block_table_stride = blocks_per_sequence;
    params.seq_lens = lens.data();
    params.batch = options.batch;
    params.num_heads = options.heads;
    params.num_kv_heads = options.kv_heads;
    params.head_dim = options.head_dim;
    params.block_tokens = options.block_size;
    params.max_seq_len = context;
    params.scale = static_cast<float>(1.0 / std::sqrt(static_cast<double>(options.head_dim)));
    params.out = out.data();
    params.out_row_stride = params.q_row_stride;
    params.workspace = workspace.data();
    params.workspace_bytes = workspace_bytes;
    params.num_splits = splits;
    params.num_pool_blocks = options.row_copies ? 0 : static_cast<int64_t>(num_blocks);
    DeviceBuffer<float> scores;
    if (options.scores) {
      const size_t count = static_cast<size_t>(options.batch) * options.heads * context;
      RUBATO_ASSIGN_OR_RETURN(scores, DeviceBuffer<float>::Allocate(count, "scores"));
      params.scores = scores.data();
      params.scores_stride = context;
    }

    cudaEvent_t start, stop;
    cudaEventCreate(&start);
    cudaEventCreate(&stop);
    std::vector<double> ms;
    for (int i = 0; i < options.warmup + options.iterations; ++i) {
      cudaEventRecord(start);
      RUBATO_RETURN_IF_ERROR(cuda::DecodeAttention(params, nullptr));
      cudaEventRecord(stop);
      RUBATO_CUDA_RETURN_IF_ERROR(cudaEventSynchronize(stop), "running decode attention");
      float elapsed = 0;
      cudaEventElapsedTime(&elapsed, start, stop);
      if (i >= options.warmup) ms.push_back(elapsed);
    }
    cudaEventDestroy(start);
    cudaEventDestroy(stop);
    const double median_ms = Median(ms);
    const double kv_bytes = 2.0 * options.batch * static_cast<double>(context) * options.kv_heads *
                            options.head_dim * 2;
    const double read_bandwidth = kv_bytes / (median_ms / 1e3);
    // The floor: K + V read once at the copy's rate (a copy's bytes read + written per second).
    const double floor_ms = kv_bytes / copy_bandwidth * 1e3;
    std::printf("context %7d splits %3d%s: %.4f ms, K+V read %.0f GB/s, floor %.4f ms (%.2fx)\n",
                context, splits, options.scores ? " scores" : "", median_ms,
                read_bandwidth / 1e9, floor_ms, median_ms / floor_ms);
    if (splits != 0) {  // a sweep point, not the kernel as shipped
      report["split_sweep"].push_back({{"context", context}, {"splits", splits},
                                       {"median_ms", median_ms}});
      continue;
    }
    report["points"].push_back({{"context", context},
                                {"scores", options.scores},
                                {"median_ms", median_ms},
                                {"min_ms", *std::min_element(ms.begin(), ms.end())},
                                {"kv_bytes", kv_bytes},
                                {"kv_read_bytes_per_s", read_bandwidth},
                                {"copy_floor_ms", floor_ms}});
   }
  }
  return Status::Ok();
}

}  // namespace
}  // namespace rubato

int main(int argc, char** argv) {
  rubato::Options options;
  CLI::App app{"rubato decode attention benchmark"};
  app.add_option("--batch", options.batch)->check(CLI::Range(1, 4096));
  app.add_option("--heads", options.heads)->check(CLI::Range(1, 256));
  app.add_option("--kv-heads", options.kv_heads)->check(CLI::Range(1, 256));
  app.add_option("--head-dim", options.head_dim);
  app.add_option("--block-size", options.block_size);
  app.add_option("--contexts", options.contexts)->delimiter(',');
  app.add_flag("!--no-shuffle", options.shuffle_blocks, "keep each sequence's blocks in order");
  app.add_flag("--row-copies", options.row_copies,
               "withhold the pool size: the kernel's row-copy path instead of tensor maps");
  app.add_option("--v-offset-bytes", options.v_offset_bytes)->check(CLI::Range(0, 1 << 30));
  app.add_option("--splits", options.splits, "split counts to sweep; 0 = the kernel's choice")
      ->delimiter(',');
  app.add_flag("--scores", options.scores,
               "also write the raw scores, as an SFI slow step's launch does");
  app.add_option("--warmup", options.warmup)->check(CLI::Range(0, 100000));
  app.add_option("--iterations", options.iterations)->check(CLI::Range(1, 100000));
  app.add_option("--out", options.out, "JSON report path");
  CLI11_PARSE(app, argc, argv);

  nlohmann::json report;
  std::ostringstream command;
  for (int i = 0; i < argc; ++i) command << (i ? " " : "") << argv[i];
  report["command"] = command.str();
  const rubato::Status status = rubato::Run(options, report);
  if (!status.ok()) {
    std::fprintf(stderr, "rubato_bench_attention_decode: error: %s\n", status.message().c_str());
    return 1;
  }
  if (!options.out.empty()) std::ofstream(options.out) << report.dump(2) << "\n";
  return 0;
}
