// rubato_bench_prefill: prefill speed of the CUDA model at real shapes (random weights from a
// config.json): one prompt of each length, fed in chunks of each size through Model::Forward as
// the engine feeds it, timed with events; tokens/s and model TFLOP/s against the card's bf16
// tensor peak; and the layer's four GEMM shapes alone at the chunk's rows, so the GEMMs' own
// share of the peak is known. A benchmark, not a test. docs/benchmarks.md "Prefill".
#include <cuda_profiler_api.h>
#include <cuda_runtime_api.h>

#include <CLI/CLI.hpp>
#include <algorithm>
#include <cstdio>
#include <nlohmann/json.hpp>
#include <random>
#include <sstream>
#include <string>
#include <vector>

#include "bench/decode_bench_common.h"
#include "common/status.h"
#include "inference_rank/model/cuda_model.h"
#include "kernels/cuda/cuda_status.h"
#include "kernels/cuda/device_buffer.h"
#include "kernels/cuda/gemm.h"

namespace rubato {
namespace {

struct Options {
  bench::CommonOptions common;
  std::string prompts = "4096,32768";  // prompt lengths
  std::string chunks = "512,8192";     // prefill chunk sizes (engine.prefill_chunk)
  int repeats = 3;
  double peak_tflops = 0;  // 0: from the device name (H100 / H200 SXM: 989.4 dense bf16)
  bool profile =
      false;  // bracket one prefill per (prompt, chunk) for `ncu --profile-from-start off`
};

Result<std::vector<int>> ParseList(const std::string& text, const char* flag) {
  std::vector<int> values;
  std::stringstream in(text);
  std::string item;
  while (std::getline(in, item, ',')) {
    try {
      values.push_back(std::stoi(item));
    } catch (...) {
      return InvalidArgumentError(std::string(flag) + ": '" + item + "' is not a number");
    }
    if (values.back() < 1) return InvalidArgumentError(std::string(flag) + ": values must be >= 1");
  }
  if (values.empty()) return InvalidArgumentError(std::string(flag) + " is empty");
  return values;
}

// Matrix FLOPs of the decoder layers per prompt token, and the causal attention's for a prompt
// of `length` tokens (QK^T and PV over the lower triangle, diagonal included).
double LinearFlopsPerToken(const ModelConfig& c) {
  const double qkv = static_cast<double>(c.q_dim()) + 2.0 * c.kv_dim();
  const double per_layer = 2.0 * c.hidden_size * (qkv + c.q_dim()) +         // qkv, o
                           2.0 * c.hidden_size * 3.0 * c.intermediate_size;  // gate|up, down
  return per_layer * c.num_layers;
}
double AttentionFlops(const ModelConfig& c, double length) {
  return 4.0 * c.head_dim * c.num_heads * c.num_layers * length * (length + 1) / 2.0;
}

double PeakTflops(const std::string& device, double flag) {
  if (flag > 0) return flag;
  if (device.find("H100") != std::string::npos || device.find("H200") != std::string::npos)
    return 989.4;
  return 0;
}

// Milliseconds of one prefill of `length` tokens in chunks of `chunk` (mean of `repeats`).
Result<double> TimePrefill(CudaModel& model, PagedKvCache& cache, int length, int chunk,
                           int repeats, bool profile) {
  std::mt19937_64 rng(static_cast<uint64_t>(length) * 7919 + chunk);
  std::vector<int> tokens(static_cast<size_t>(length));
  for (int& t : tokens)
    t = static_cast<int>(rng() % static_cast<uint64_t>(model.config().vocab_size));
  const TokenSampling greedy;
  ForwardResult result;
  cudaEvent_t start, stop;
  RUBATO_CUDA_RETURN_IF_ERROR(cudaEventCreate(&start), "creating an event");
  RUBATO_CUDA_RETURN_IF_ERROR(cudaEventCreate(&stop), "creating an event");
  double total_ms = 0;
  Status status;
  // Run 0 warms up (cuBLASLt's heuristics, workspaces); the profiled run is the last.
  for (int run = 0; run <= repeats && status.ok(); ++run) {
    KvSequence sequence;
    const bool profiled = profile && run == repeats;
    if (profiled) cudaProfilerStart();
    cudaEventRecord(start, model.stream());
    for (int begin = 0; begin < length && status.ok(); begin += chunk) {
      const int n = std::min(chunk, length - begin);
      const bool last = begin + n == length;  // only the prompt's last chunk samples
      const ForwardEntry entry{&sequence,
                               {tokens.data() + begin, static_cast<size_t>(n)},
                               begin,
                               last ? LogitsWanted::kLast : LogitsWanted::kNone,
                               last ? &greedy : nullptr};
      status = model.Forward({&entry, 1}, cache, result);
    }
    cudaEventRecord(stop, model.stream());
    if (status.ok()) status = cuda::CudaStatus(cudaEventSynchronize(stop), "timing a prefill");
    if (profiled) cudaProfilerStop();
    float ms = 0;
    cudaEventElapsedTime(&ms, start, stop);
    if (run > 0) total_ms += ms;
    const Status released = cache.Release(sequence);
    if (status.ok()) status = released;
  }
  cudaEventDestroy(start);
  cudaEventDestroy(stop);
  RUBATO_RETURN_IF_ERROR(status);
  return total_ms / repeats;
}

// The layer's GEMMs at `rows` rows through the model's own GEMM class: ms per call each.
Result<nlohmann::json> TimeGemms(const ModelConfig& c, int rows, cudaStream_t stream,
                                 double peak_tflops) {
  struct Shape {
    const char* name;
    int in, out;
  };
  const Shape shapes[] = {{"qkv", c.hidden_size, c.q_dim() + 2 * c.kv_dim()},
                          {"o", c.q_dim(), c.hidden_size},
                          {"gate_up", c.hidden_size, 2 * c.intermediate_size},
                          {"down", c.intermediate_size, c.hidden_size}};
  RUBATO_ASSIGN_OR_RETURN(std::unique_ptr<cuda::CublasLtGemm> gemm, cuda::CublasLtGemm::Create());
  nlohmann::json out = nlohmann::json::array();
  double layer_ms = 0, layer_flops = 0;
  for (const Shape& s : shapes) {
    using Buffer = cuda::DeviceBuffer<__nv_bfloat16>;
    RUBATO_ASSIGN_OR_RETURN(Buffer x, Buffer::Allocate(static_cast<size_t>(rows) * s.in, "x"));
    RUBATO_ASSIGN_OR_RETURN(Buffer w, Buffer::Allocate(static_cast<size_t>(s.out) * s.in, "w"));
    RUBATO_ASSIGN_OR_RETURN(Buffer y, Buffer::Allocate(static_cast<size_t>(rows) * s.out, "y"));
    for (auto* buffer : {&x, &w}) {
      cuda::RandomFillParams fill;
      fill.out = buffer->data();
      fill.count = static_cast<int64_t>(buffer->size());
      fill.seed = 7;
      fill.bound = 1.f;
      RUBATO_RETURN_IF_ERROR(cuda::RandomFill(fill, stream));
    }
    cuda::LinearArgs args;
    args.x = x.data();
    args.weight = w.data();
    args.y = y.data();
    args.rows = rows;
    args.in_features = s.in;
    args.out_features = s.out;
    constexpr int kCalls = 20;
    RUBATO_RETURN_IF_ERROR(gemm->Linear(args, stream));  // heuristic query, warm-up
    cudaEvent_t start, stop;
    cudaEventCreate(&start);
    cudaEventCreate(&stop);
    cudaEventRecord(start, stream);
    for (int i = 0; i < kCalls; ++i) RUBATO_RETURN_IF_ERROR(gemm->Linear(args, stream));
    cudaEventRecord(stop, stream);
    RUBATO_CUDA_RETURN_IF_ERROR(cudaEventSynchronize(stop), "timing a GEMM");
    float ms = 0;
    cudaEventElapsedTime(&ms, start, stop);
    cudaEventDestroy(start);
    cudaEventDestroy(stop);
    const double call_ms = ms / kCalls;
    const double flops = 2.0 * rows * static_cast<double>(s.in) * s.out;
    const double tflops = flops / (call_ms * 1e-3) / 1e12;
    layer_ms += call_ms;
    layer_flops += flops;
    out.push_back({{"gemm", s.name},
                   {"rows", rows},
                   {"in", s.in},
                   {"out", s.out},
                   {"ms", call_ms},
                   {"tflops", tflops},
                   {"fraction_of_peak", peak_tflops > 0 ? tflops / peak_tflops : 0.0}});
  }
  const double tflops = layer_flops / (layer_ms * 1e-3) / 1e12;
  out.push_back({{"gemm", "layer (all four)"},
                 {"rows", rows},
                 {"ms", layer_ms},
                 {"tflops", tflops},
                 {"fraction_of_peak", peak_tflops > 0 ? tflops / peak_tflops : 0.0}});
  return out;
}

Status Run(const Options& options, nlohmann::json& report) {
  RUBATO_ASSIGN_OR_RETURN(const std::vector<int> prompts, ParseList(options.prompts, "--prompts"));
  RUBATO_ASSIGN_OR_RETURN(const std::vector<int> chunks, ParseList(options.chunks, "--chunks"));
  if (options.repeats < 1) return InvalidArgumentError("--repeats must be >= 1");
  RUBATO_ASSIGN_OR_RETURN(bench::BenchModel loaded, bench::LoadBenchModel(options.common));
  CudaModel& model = *loaded.model;
  const ModelConfig& config = model.config();
  const double peak = PeakTflops(loaded.device_name, options.peak_tflops);
  const int longest = *std::max_element(prompts.begin(), prompts.end());
  const int blocks = (longest + options.common.block_size - 1) / options.common.block_size + 1;
  RUBATO_ASSIGN_OR_RETURN(
      std::unique_ptr<PagedKvCache> cache,
      bench::CreateBenchKvCache(model, options.common.block_size, blocks, 0, ""));
  bench::AddReportHeader(report, options.common, loaded, *cache, "written by the prefill itself");
  report["peak_bf16_tflops"] = peak;
  report["peak_source"] = options.peak_tflops > 0 ? "--peak-tflops" : "device name (dense bf16)";
  report["repeats"] = options.repeats;
  std::printf("device %s, %s, bf16 peak %.1f TFLOP/s\n", loaded.device_name.c_str(),
              options.common.config.c_str(), peak);
  std::printf("%8s %7s %10s %12s %10s %8s\n", "prompt", "chunk", "ms", "tokens/s", "TFLOP/s",
              "of peak");
  for (int chunk : chunks) {
    RUBATO_ASSIGN_OR_RETURN(nlohmann::json gemms, TimeGemms(config, chunk, model.stream(), peak));
    report["gemms"].push_back(gemms);
    for (int length : prompts) {
      RUBATO_ASSIGN_OR_RETURN(const double ms, TimePrefill(model, *cache, length, chunk,
                                                           options.repeats, options.profile));
      const double flops = LinearFlopsPerToken(config) * length + AttentionFlops(config, length) +
                           2.0 * config.hidden_size * config.vocab_size;
      const double tflops = flops / (ms * 1e-3) / 1e12;
      std::printf("%8d %7d %10.2f %12.0f %10.1f %8.3f\n", length, chunk, ms, length / (ms * 1e-3),
                  tflops, peak > 0 ? tflops / peak : 0.0);
      report["points"].push_back({{"prompt", length},
                                  {"chunk", chunk},
                                  {"ms", ms},
                                  {"tokens_per_s", length / (ms * 1e-3)},
                                  {"model_flops", flops},
                                  {"attention_flops", AttentionFlops(config, length)},
                                  {"tflops", tflops},
                                  {"fraction_of_peak", peak > 0 ? tflops / peak : 0.0}});
    }
  }
  return Status::Ok();
}

}  // namespace
}  // namespace rubato

int main(int argc, char** argv) {
  rubato::Options options;
  CLI::App app{"rubato prefill benchmark (CUDA model, random weights)"};
  rubato::bench::AddCommonOptions(app, options.common);
  app.add_option("--prompts", options.prompts, "prompt lengths, e.g. 4096,32768");
  app.add_option("--chunks", options.chunks, "prefill chunk sizes, e.g. 512,8192");
  app.add_option("--repeats", options.repeats, "timed prefills per point (after one warm-up)");
  app.add_option("--peak-tflops", options.peak_tflops,
                 "the card's dense bf16 tensor peak (default: from the device name)");
  app.add_flag("--profile", options.profile,
               "bracket the last prefill of each point with cudaProfilerStart/Stop (ncu "
               "--profile-from-start off)");
  return rubato::bench::BenchMain(
      "rubato_bench_prefill", app, options.common, argc, argv,
      [&](nlohmann::json& report) { return rubato::Run(options, report); });
}
