// rubato_bench_attention_sparse: decode attention in its two-segment mode (compact sink +
// selected rows, recent keys read in place) against the same kernel's dense launch, at one
// context and a sweep of retentions (speedup = dense ms / sparse ms); also one layer's slow-step
// maintenance (GPU Selector + compact gather, with --gamma the key norms first) beside that
// layer's dense attention. A benchmark, not a test.
// Method and a command line: docs/benchmarks.md "Sparse decode attention and slow-step
// maintenance".
#include <cuda_bf16.h>
#include <cuda_runtime_api.h>

#include <CLI/CLI.hpp>
#include <nlohmann/json.hpp>

#include <algorithm>
#include <cmath>
#include <cstdio>
#include <fstream>
#include <numeric>
#include <random>
#include <sstream>
#include <string>
#include <vector>

#include "common/status.h"
#include "kernels/cuda/cuda_status.h"
#include "kernels/cuda/decode_attention.cuh"
#include "kernels/cuda/device_buffer.h"
#include "kernels/cuda/key_norms.cuh"
#include "kernels/cuda/compact_gather.cuh"
#include "kernels/cuda/random_fill.cuh"
#include "inference_rank/policies/sfi/kernels/sfi_selector.cuh"

namespace rubato {
namespace {

using cuda::DeviceBuffer;

struct Options {
  int batch = 16;
  int heads = 32;
  int kv_heads = 8;
  int head_dim = 128;
  int block_size = 64;
  int context = 16384;
  int recent = 256;  // recent segment length (capped by the working set)
  std::vector<double> retentions = {1.6, 6.3, 12.5, 25, 50, 100};
  int budget = 2048;  // the Selector's K for the maintenance timing
  int continuation = 8;  // the Selector's stage C reach (0: the paper's selection)
  double gamma = 0.0;    // > 0: the key-norm prior, its norms computed (and timed) first
  int warmup = 10;
  int iterations = 100;
  std::string out;
};

double Median(std::vector<double> values) {
  std::sort(values.begin(), values.end());
  return values[values.size() / 2];
}

Status Fill(__nv_bfloat16* device, size_t count, uint64_t stream) {
  cuda::RandomFillParams fill;
  fill.out = device;
  fill.count = static_cast<int64_t>(count);
  fill.seed = 11;
  fill.stream = stream;
  fill.bound = 1.f;
  return cuda::RandomFill(fill, nullptr);
}

// Median ms of `params` over the options' iterations (one launch per CUDA-event pair).
Result<double> TimeLaunch(const cuda::DecodeAttentionParams& params, const Options& options) {
  cudaEvent_t start, stop;
  cudaEventCreate(&start);
  cudaEventCreate(&stop);
  std::vector<double> ms;
  for (int i = 0; i < options.warmup + options.iterations; ++i) {
    cudaEventRecord(start);
    const Status status = cuda::DecodeAttention(params, nullptr);
    cudaEventRecord(stop);
    if (!status.ok()) {
      cudaEventDestroy(start);
      cudaEventDestroy(stop);
      return status;
    }
    RUBATO_CUDA_RETURN_IF_ERROR(cudaEventSynchronize(stop), "running decode attention");
    float elapsed = 0;
    cudaEventElapsedTime(&elapsed, start, stop);
    if (i >= options.warmup) ms.push_back(elapsed);
  }
  cudaEventDestroy(start);
  cudaEventDestroy(stop);
  return Median(ms);
}

// One layer's slow-step maintenance at the dense launch's shapes: with gamma > 0 the key norms of
// J, then SfiSelect over J = [4, L - 256) from random logits (W = 1), then the compact gather of
// sink + selected rows.
Status TimeMaintenance(const Options& options, const cuda::DecodeAttentionParams& dense,
                       const DeviceBuffer<__nv_bfloat16>& keys,
                       const DeviceBuffer<__nv_bfloat16>& values, size_t num_blocks,
                       nlohmann::json& report) {
  const int L = options.context;
  const int sink = 4;
  const int j_count = std::max(0, L - options.recent - sink);
  const int heads = options.heads;
  const size_t logit_count = static_cast<size_t>(options.batch) * heads * L;
  std::vector<float> host_logits(logit_count);
  std::mt19937_64 rng(7);
  std::normal_distribution<float> normal(0.f, 2.f);
  for (float& x : host_logits) x = normal(rng);
  RUBATO_ASSIGN_OR_RETURN(auto logits, DeviceBuffer<float>::Allocate(logit_count, "logits"));
  RUBATO_RETURN_IF_ERROR(logits.CopyFromHost(host_logits.data(), host_logits.size(), nullptr));
  const std::vector<int32_t> host_begin(options.batch, sink), host_count(options.batch, j_count),
      host_sink(options.batch, sink);
  RUBATO_ASSIGN_OR_RETURN(auto j_begin, DeviceBuffer<int32_t>::Allocate(options.batch, "jb"));
  RUBATO_ASSIGN_OR_RETURN(auto j_counts, DeviceBuffer<int32_t>::Allocate(options.batch, "jc"));
  RUBATO_ASSIGN_OR_RETURN(auto sink_end, DeviceBuffer<int32_t>::Allocate(options.batch, "se"));
  RUBATO_RETURN_IF_ERROR(j_begin.CopyFromHost(host_begin.data(), host_begin.size(), nullptr));
  RUBATO_RETURN_IF_ERROR(j_counts.CopyFromHost(host_count.data(), host_count.size(), nullptr));
  RUBATO_RETURN_IF_ERROR(sink_end.CopyFromHost(host_sink.data(), host_sink.size(), nullptr));
  const size_t pairs = static_cast<size_t>(options.batch) * options.kv_heads;
  RUBATO_ASSIGN_OR_RETURN(auto selected,
                          DeviceBuffer<int32_t>::Allocate(pairs * options.budget, "selected"));
  RUBATO_ASSIGN_OR_RETURN(auto selected_count, DeviceBuffer<int32_t>::Allocate(pairs, "count"));
  const int capacity = sink + options.budget;
  const size_t compact_elements = pairs * capacity * options.head_dim;
  RUBATO_ASSIGN_OR_RETURN(auto compact_keys,
                          DeviceBuffer<__nv_bfloat16>::Allocate(compact_elements, "compact K"));
  RUBATO_ASSIGN_OR_RETURN(auto compact_values,
                          DeviceBuffer<__nv_bfloat16>::Allocate(compact_elements, "compact V"));
  RUBATO_ASSIGN_OR_RETURN(auto compact_counts, DeviceBuffer<int32_t>::Allocate(pairs, "cc"));

  cuda::SfiSelectParams select;
  select.logits = logits.data();
  select.logits_stride = L;
  select.j_begin = j_begin.data();
  select.j_count = j_counts.data();
  select.batch = options.batch;
  select.num_kv_heads = options.kv_heads;
  select.group = heads / options.kv_heads;
  select.window = 1;
  select.max_j_count = std::max(1, j_count);
  select.config.budget = options.budget;
  select.config.continuation = options.continuation;
  select.config.gamma = options.gamma;
  DeviceBuffer<float> norms;  // [batch][kv_heads][L], indexed by position
  cuda::KeyNormsParams norm_params;
  if (options.gamma > 0.0) {
    RUBATO_ASSIGN_OR_RETURN(norms, DeviceBuffer<float>::Allocate(pairs * L, "key norms"));
    norm_params.key_pool = keys.data();
    norm_params.num_pool_blocks = static_cast<int64_t>(num_blocks);
    norm_params.block_tables = dense.block_tables;
    norm_params.block_table_stride = dense.block_table_stride;
    norm_params.begin = j_begin.data();
    norm_params.count = j_counts.data();
    norm_params.max_count = j_count;
    norm_params.batch = options.batch;
    norm_params.num_kv_heads = options.kv_heads;
    norm_params.head_dim = options.head_dim;
    norm_params.block_tokens = options.block_size;
    norm_params.norms = norms.data();
    norm_params.norms_stride = L;
    select.key_norms = norms.data();
    select.norms_stride = L;
  }
  select.selected = selected.data();
  select.selected_count = selected_count.data();
  const size_t workspace_bytes = cuda::SfiSelectWorkspaceBytes(
      options.batch, options.kv_heads, select.max_j_count, select.window, select.group,
      select.config);
  RUBATO_ASSIGN_OR_RETURN(auto workspace,
                          DeviceBuffer<unsigned char>::Allocate(workspace_bytes, "sfi workspace"));
  select.workspace = workspace.data();
  select.workspace_bytes = workspace_bytes;
  cuda::CompactGatherParams gather;
  gather.key_pool = keys.data();
  gather.value_pool = values.data();
  gather.num_pool_blocks = static_cast<int64_t>(num_blocks);
  gather.block_tables = dense.block_tables;
  gather.block_table_stride = dense.block_table_stride;
  gather.sink_end = sink_end.data();
  gather.max_sink_tokens = sink;
  gather.selected = selected.data();
  gather.selected_count = selected_count.data();
  gather.budget = options.budget;
  gather.batch = options.batch;
  gather.num_kv_heads = options.kv_heads;
  gather.head_dim = options.head_dim;
  gather.block_tokens = options.block_size;
  gather.compact_keys = compact_keys.data();
  gather.compact_values = compact_values.data();
  gather.compact_capacity = capacity;
  gather.compact_counts = compact_counts.data();

  cudaEvent_t before, start, middle, stop;
  cudaEventCreate(&before);
  cudaEventCreate(&start);
  cudaEventCreate(&middle);
  cudaEventCreate(&stop);
  std::vector<double> norms_ms, select_ms, gather_ms;
  Status status = Status::Ok();
  for (int i = 0; i < options.warmup + options.iterations && status.ok(); ++i) {
    cudaEventRecord(before);
    if (options.gamma > 0.0) status = cuda::KeyNorms(norm_params, nullptr);
    cudaEventRecord(start);
    if (status.ok()) status = cuda::SfiSelect(select, nullptr);
    cudaEventRecord(middle);
    if (status.ok()) status = cuda::GatherCompactKv(gather, nullptr);
    cudaEventRecord(stop);
    if (cudaEventSynchronize(stop) != cudaSuccess && status.ok()) {
      status = InternalError("timing the SFI maintenance: " +
                             std::string(cudaGetErrorString(cudaGetLastError())));
    }
    float zeroth = 0, first = 0, second = 0;
    cudaEventElapsedTime(&zeroth, before, start);
    cudaEventElapsedTime(&first, start, middle);
    cudaEventElapsedTime(&second, middle, stop);
    if (i >= options.warmup) {
      norms_ms.push_back(zeroth);
      select_ms.push_back(first);
      gather_ms.push_back(second);
    }
  }
  cudaEventDestroy(before);
  cudaEventDestroy(start);
  cudaEventDestroy(middle);
  cudaEventDestroy(stop);
  RUBATO_RETURN_IF_ERROR(status);
  const double norms_median = Median(norms_ms), select_median = Median(select_ms),
               gather_median = Median(gather_ms);
  std::printf("slow-step maintenance per layer (|J| = %d, K = %d, continuation %d, gamma %g): "
              "key norms %.4f ms + selector %.4f ms + gather %.4f ms vs dense attention %.4f ms\n",
              j_count, options.budget, options.continuation, options.gamma, norms_median,
              select_median, gather_median, report["dense_ms"].get<double>());
  report["maintenance"] = {{"j_count", j_count},
                           {"budget", options.budget},
                           {"continuation", options.continuation},
                           {"gamma", options.gamma},
                           {"key_norms_ms", norms_median},
                           {"selector_ms", select_median},
                           {"gather_ms", gather_median},
                           {"dense_attention_ms", report["dense_ms"]}};
  return Status::Ok();
}

Status Run(const Options& options, nlohmann::json& report) {
  cudaDeviceProp properties{};
  RUBATO_CUDA_RETURN_IF_ERROR(cudaGetDeviceProperties(&properties, 0), "reading the device");
  report["device"] = properties.name;
  report["shape"] = {{"batch", options.batch},         {"heads", options.heads},
                     {"kv_heads", options.kv_heads},   {"head_dim", options.head_dim},
                     {"block_size", options.block_size}, {"context", options.context},
                     {"dtype", "bf16"}};
  const int L = options.context;
  const int blocks_per_sequence = (L + options.block_size - 1) / options.block_size;
  const size_t num_blocks = static_cast<size_t>(blocks_per_sequence) * options.batch;
  const size_t pool = num_blocks * options.kv_heads * options.block_size * options.head_dim;
  RUBATO_ASSIGN_OR_RETURN(auto keys, DeviceBuffer<__nv_bfloat16>::Allocate(pool, "K"));
  RUBATO_ASSIGN_OR_RETURN(auto values, DeviceBuffer<__nv_bfloat16>::Allocate(pool, "V"));
  RUBATO_RETURN_IF_ERROR(Fill(keys.data(), pool, 1));
  RUBATO_RETURN_IF_ERROR(Fill(values.data(), pool, 2));
  std::vector<int32_t> physical(num_blocks);
  std::iota(physical.begin(), physical.end(), 0);
  std::shuffle(physical.begin(), physical.end(), std::mt19937_64(3));
  RUBATO_ASSIGN_OR_RETURN(auto tables, DeviceBuffer<int32_t>::Allocate(num_blocks, "tables"));
  RUBATO_RETURN_IF_ERROR(tables.CopyFromHost(physical.data(), physical.size(), nullptr));
  const size_t q_elements = static_cast<size_t>(options.batch) * options.heads * options.head_dim;
  RUBATO_ASSIGN_OR_RETURN(auto queries, DeviceBuffer<__nv_bfloat16>::Allocate(q_elements, "q"));
  RUBATO_ASSIGN_OR_RETURN(auto out, DeviceBuffer<__nv_bfloat16>::Allocate(q_elements, "out"));
  RUBATO_RETURN_IF_ERROR(Fill(queries.data(), q_elements, 4));
  const std::vector<int32_t> host_lens(options.batch, L);
  RUBATO_ASSIGN_OR_RETURN(auto lens, DeviceBuffer<int32_t>::Allocate(options.batch, "lens"));
  RUBATO_RETURN_IF_ERROR(lens.CopyFromHost(host_lens.data(), host_lens.size(), nullptr));
  const size_t workspace_bytes =
      cuda::DecodeAttentionWorkspaceBytes(options.batch, options.heads, options.head_dim, L, false);
  RUBATO_ASSIGN_OR_RETURN(auto workspace,
                          DeviceBuffer<unsigned char>::Allocate(workspace_bytes, "workspace"));

  cuda::DecodeAttentionParams dense;
  dense.q = queries.data();
  dense.q_row_stride = static_cast<int64_t>(options.heads) * options.head_dim;
  dense.key_pool = keys.data();
  dense.value_pool = values.data();
  dense.num_pool_blocks = static_cast<int64_t>(num_blocks);
  dense.block_tables = tables.data();
  dense.block_table_stride = blocks_per_sequence;
  dense.seq_lens = lens.data();
  dense.batch = options.batch;
  dense.num_heads = options.heads;
  dense.num_kv_heads = options.kv_heads;
  dense.head_dim = options.head_dim;
  dense.block_tokens = options.block_size;
  dense.max_seq_len = L;
  dense.scale = static_cast<float>(1.0 / std::sqrt(static_cast<double>(options.head_dim)));
  dense.out = out.data();
  dense.out_row_stride = dense.q_row_stride;
  dense.workspace = workspace.data();
  dense.workspace_bytes = workspace_bytes;
  RUBATO_ASSIGN_OR_RETURN(const double dense_ms, TimeLaunch(dense, options));
  const double dense_bytes =
      2.0 * options.batch * static_cast<double>(L) * options.kv_heads * options.head_dim * 2;
  report["dense_ms"] = dense_ms;
  std::printf("dense  context %d: %.4f ms, K+V read %.0f GB/s\n", L, dense_ms,
              dense_bytes / dense_ms / 1e6);

  for (double retention : options.retentions) {
    const int kept = std::clamp(static_cast<int>(std::lround(retention / 100.0 * L)), 1, L);
    const int recent = std::min(options.recent, kept);
    const int compact = kept - recent;
    const int capacity = std::max(compact, 1);
    const size_t compact_elements =
        static_cast<size_t>(options.batch) * options.kv_heads * capacity * options.head_dim;
    RUBATO_ASSIGN_OR_RETURN(auto compact_keys,
                            DeviceBuffer<__nv_bfloat16>::Allocate(compact_elements, "compact K"));
    RUBATO_ASSIGN_OR_RETURN(
        auto compact_values, DeviceBuffer<__nv_bfloat16>::Allocate(compact_elements, "compact V"));
    RUBATO_RETURN_IF_ERROR(Fill(compact_keys.data(), compact_elements, 5));
    RUBATO_RETURN_IF_ERROR(Fill(compact_values.data(), compact_elements, 6));
    const std::vector<int32_t> host_counts(static_cast<size_t>(options.batch) * options.kv_heads,
                                           compact);
    const std::vector<int32_t> host_recent(options.batch, L - recent);
    RUBATO_ASSIGN_OR_RETURN(auto counts, DeviceBuffer<int32_t>::Allocate(host_counts.size(), "c"));
    RUBATO_ASSIGN_OR_RETURN(auto recent_begin, DeviceBuffer<int32_t>::Allocate(options.batch, "r"));
    RUBATO_RETURN_IF_ERROR(counts.CopyFromHost(host_counts.data(), host_counts.size(), nullptr));
    RUBATO_RETURN_IF_ERROR(
        recent_begin.CopyFromHost(host_recent.data(), host_recent.size(), nullptr));

    cuda::DecodeAttentionParams sparse = dense;
    sparse.compact_keys = compact_keys.data();
    sparse.compact_values = compact_values.data();
    sparse.compact_capacity = capacity;
    sparse.compact_counts = counts.data();
    sparse.recent_begin = recent_begin.data();
    sparse.max_recent_tokens = recent;
    RUBATO_ASSIGN_OR_RETURN(const double sparse_ms, TimeLaunch(sparse, options));
    const double bytes =
        2.0 * options.batch * static_cast<double>(kept) * options.kv_heads * options.head_dim * 2;
    std::printf("sparse retention %5.1f%% (%d compact + %d recent keys): %.4f ms, %.0f GB/s, "
                "speedup over dense %.2fx\n",
                retention, compact, recent, sparse_ms, bytes / sparse_ms / 1e6,
                dense_ms / sparse_ms);
    report["points"].push_back({{"retention_percent", retention},
                                {"kept_keys", kept},
                                {"compact_keys", compact},
                                {"recent_keys", recent},
                                {"sparse_ms", sparse_ms},
                                {"kv_read_bytes_per_s", bytes / (sparse_ms / 1e3)},
                                {"speedup_over_dense", dense_ms / sparse_ms}});
  }
  return TimeMaintenance(options, dense, keys, values, num_blocks, report);
}

}  // namespace
}  // namespace rubato

int main(int argc, char** argv) {
  rubato::Options options;
  CLI::App app{"rubato two-segment sparse decode attention benchmark"};
  app.add_option("--batch", options.batch)->check(CLI::Range(1, 4096));
  app.add_option("--heads", options.heads)->check(CLI::Range(1, 256));
  app.add_option("--kv-heads", options.kv_heads)->check(CLI::Range(1, 256));
  app.add_option("--head-dim", options.head_dim);
  app.add_option("--block-size", options.block_size);
  app.add_option("--context", options.context)->check(CLI::Range(1, 1 << 20));
  app.add_option("--recent", options.recent)->check(CLI::Range(1, 1 << 20));
  app.add_option("--retentions", options.retentions, "percent of the context attended")
      ->delimiter(',')
      ->check(CLI::Range(0.0, 100.0));
  app.add_option("--budget", options.budget, "the Selector's K for the maintenance timing")
      ->check(CLI::Range(1, 1 << 20));
  app.add_option("--continuation", options.continuation, "the Selector's stage C reach")
      ->check(CLI::Range(0, 1 << 20));
  app.add_option("--gamma", options.gamma, "the Selector's key-norm prior exponent")
      ->check(CLI::Range(0.0, 1e6));
  app.add_option("--warmup", options.warmup)->check(CLI::Range(0, 100000));
  app.add_option("--iterations", options.iterations)->check(CLI::Range(1, 100000));
  app.add_option("--out", options.out, "JSON report path");
  CLI11_PARSE(app, argc, argv);

  nlohmann::json report;
  report["benchmark"] =
      "two-segment sparse decode attention vs dense decode attention, same kernel family";
  std::ostringstream command;
  for (int i = 0; i < argc; ++i) command << (i ? " " : "") << argv[i];
  report["command"] = command.str();
  const rubato::Status status = rubato::Run(options, report);
  if (!status.ok()) {
    std::fprintf(stderr, "rubato_bench_attention_sparse: error: %s\n", status.message().c_str());
    return 1;
  }
  if (!options.out.empty()) std::ofstream(options.out) << report.dump(2) << "\n";
  return 0;
}
