// rubato_bench_decode_e2e_capacity: KV beyond one card. Dense decode of the CUDA model at real
// shapes (random weights from a config.json) at one long context (128K by default), in one
// process and one run, steps replayed as CUDA graphs:
//   local:  every sequence's KV in the model GPU's pool, at the largest batch that pool holds;
//   placed: the placed residency (docs/residency.md "Placement") over a GPU cache rank of this
//           process: sequences admitted in turn, each kept whole on the model GPU while its
//           pool has room, else on the cache GPU while its budget has room (the model GPU
//           keeps the block being written): the largest batch the two cards hold together.
//           Each layer the cache GPU attends its sequences while the model GPU attends its own.
// Per side: batch, TPOT, tokens/s, bytes per step each way, the exposed wait. A side that does
// not fit is reported as such. No prefill: the KV is random bf16 on both GPUs. A benchmark,
// not a test: it measures and never asserts. docs/benchmarks.md "Capacity: KV beyond one card".
#include <cuda_runtime_api.h>

#include <CLI/CLI.hpp>
#include <algorithm>
#include <cstdio>
#include <memory>
#include <nlohmann/json.hpp>
#include <random>
#include <string>
#include <vector>

#include "bench/decode_bench_common.h"
#include "common/config.h"
#include "common/status.h"
#include "inference_rank/kv/kv_pool_sizing.h"
#include "inference_rank/model/cuda_forward_plan.h"
#include "inference_rank/model/cuda_model.h"
#include "inference_rank/residency/offloaded/gpu_cache_residency.h"
#include "inference_rank/residency/placed/placed_residency.h"
#include "kernels/cuda/cuda_status.h"
#include "kernels/cuda/decode_attention.cuh"

namespace rubato {
namespace {

using bench::Percentile;

struct Options {
  bench::CommonOptions common;  // --config, --block-size, --seed, --device, --commit, --out
  int context = 131072;
  int steps = 20;
  int warmup = 3;
  int max_batch = 64;  // bounds the step workspaces and the batches
  double utilization = 0.9;
  int cache_device = -1;  // -1: device 1 when there are two GPUs
  // Several cache GPUs (each a GPU cache rank of this process, a sequence on the one with the
  // most free blocks); empty: cache_device alone.
  std::vector<int> cache_devices;
};

// One decode sequence of the run: its KV on the model GPU (whole, or only the block being
// written) and, when placed on the cache GPU, its request there.
struct Sequence {
  KvSequence kv;
  std::unique_ptr<ResidencyRequest> request;  // null: local (the local side runs none)
  bool windowed = false;                      // only the block being written is local
};

struct StepTimes {
  double mean_ms = 0, median_ms = 0, p90_ms = 0, wait_ms = 0;
  int64_t graph_steps = 0;
};

// Decode steps of `sequences` (one token each; the first `count`), the placed side's handles
// attached when `placed`; a windowed sequence releases its older blocks and takes the one its
// next position needs before each step, as the engine does. Mean, median and p90 device time of
// the timed steps.
Result<StepTimes> RunSteps(CudaModel& model, PagedKvCache& cache, std::vector<Sequence>& sequences,
                           size_t count, bool placed,
                           const std::vector<GpuCacheAttention*>& attentions,
                           const Options& options, uint64_t seed) {
  const ModelConfig& config = model.config();
  std::mt19937_64 rng(seed);
  std::vector<int> next(count);
  for (int& token : next) token = static_cast<int>(rng() % config.vocab_size);
  const TokenSampling greedy;
  ForwardResult result;
  std::vector<ForwardEntry> batch(count);
  cudaEvent_t start, stop;
  RUBATO_CUDA_RETURN_IF_ERROR(cudaEventCreate(&start), "creating an event");
  RUBATO_CUDA_RETURN_IF_ERROR(cudaEventCreate(&stop), "creating an event");
  std::vector<double> device_ms, wait_ms;
  int64_t replays_before = 0;
  Status status;
  for (int step = 0; step < options.warmup + options.steps && status.ok(); ++step) {
    if (step == options.warmup) replays_before = model.graph_replays();
    for (size_t i = 0; i < count && status.ok(); ++i) {
      Sequence& s = sequences[i];
      if (s.windowed) {
        status = cache.ReleaseBefore(s.kv, s.kv.num_tokens);
        if (status.ok()) status = cache.Reserve(s.kv, s.kv.num_tokens + 1);
      }
      batch[i] = ForwardEntry{&s.kv, {&next[i], 1}, s.kv.num_tokens, LogitsWanted::kLast, &greedy};
      if (placed && s.request != nullptr) s.request->AttachTo(batch[i]);
    }
    if (!status.ok()) break;
    cudaEventRecord(start, model.stream());
    status = model.Forward(batch, cache, result);
    cudaEventRecord(stop, model.stream());
    if (status.ok()) status = cuda::CudaStatus(cudaEventSynchronize(stop), "timing a step");
    float ms = 0;
    cudaEventElapsedTime(&ms, start, stop);
    if (step >= options.warmup && status.ok()) {
      device_ms.push_back(ms);
      // The model stream's waits for every cache GPU, one after the other: their sum.
      double waited_ms = 0;
      for (GpuCacheAttention* attention : attentions) {
        Result<double> waited = attention->LastStepWaitMs();
        if (!waited.ok()) status = waited.status();
        if (waited.ok()) waited_ms += *waited;
      }
      if (!attentions.empty()) wait_ms.push_back(waited_ms);
    }
    for (size_t i = 0; i < count && status.ok(); ++i) next[i] = result.sampled_tokens[i];
  }
  cudaEventDestroy(start);
  cudaEventDestroy(stop);
  RUBATO_RETURN_IF_ERROR(status);
  StepTimes times;
  for (const double ms : device_ms) times.mean_ms += ms / static_cast<double>(device_ms.size());
  times.median_ms = Percentile(device_ms, 0.5);
  times.p90_ms = Percentile(device_ms, 0.9);
  if (!wait_ms.empty()) times.wait_ms = Percentile(wait_ms, 0.5);
  times.graph_steps = model.graph_replays() - replays_before;
  return times;
}

// The cache GPU's budget: `utilization` of its memory less what is in use, less the store's own
// buffers and workspaces (the decode attention workspace of max_batch rows at the longest
// bucket) and the benchmarks' headroom.
Result<double> CacheBudgetGiB(const ModelConfig& config, int device, int max_context,
                              const Options& options) {
  int previous = 0;
  RUBATO_CUDA_RETURN_IF_ERROR(cudaGetDevice(&previous), "reading the current device");
  RUBATO_CUDA_RETURN_IF_ERROR(cudaSetDevice(device), "selecting the cache GPU");
  size_t free_bytes = 0, total_bytes = 0;
  const cudaError_t queried = cudaMemGetInfo(&free_bytes, &total_bytes);
  (void)cudaSetDevice(previous);
  RUBATO_CUDA_RETURN_IF_ERROR(queried, "querying the cache GPU's memory");
  const double workspace = static_cast<double>(
      cuda::DecodeAttentionWorkspaceBytes(options.max_batch, config.num_heads, config.head_dim,
                                          DecodeSeqLenBucket(max_context, INT32_MAX), false));
  const double budget = static_cast<double>(free_bytes) -
                        (1.0 - options.utilization) * static_cast<double>(total_bytes) - workspace -
                        static_cast<double>(bench::kHeadroomBytes);
  if (budget <= 0) {
    return ResourceExhaustedError("the cache GPU " + std::to_string(device) + " has " +
                                  std::to_string(free_bytes) + " bytes free: no KV budget");
  }
  return budget / static_cast<double>(uint64_t{1} << 30);
}

Status Run(const Options& options, nlohmann::json& report) {
  if (options.steps < 1 || options.warmup < 2 || options.context < 1 || options.max_batch < 1) {
    return InvalidArgumentError(
        "--steps must be >= 1, --warmup >= 2 (eager, then capture), --context and --max-batch "
        ">= 1");
  }
  int devices = 0;
  RUBATO_CUDA_RETURN_IF_ERROR(cudaGetDeviceCount(&devices), "counting CUDA devices");
  const int cache_device = options.cache_device >= 0 ? options.cache_device
                           : devices > 1             ? (options.common.device == 0 ? 1 : 0)
                                                     : -1;
  RUBATO_ASSIGN_OR_RETURN(bench::BenchModel loaded, bench::LoadBenchModel(options.common));
  CudaModel& model = *loaded.model;
  const ModelConfig& config = model.config();
  const int block = options.common.block_size;
  // A local sequence decodes both sides' steps; a placed one only the placed side's.
  const int grown = 2 * (options.warmup + options.steps) + 1;
  const int longest = options.context + grown;
  const int blocks_per_sequence = (longest + block - 1) / block;

  // The model GPU's pool: the engine's rule (gpu_memory_utilization of the card, less the
  // weights and the largest step's workspaces), at most max_batch whole sequences.
  RUBATO_ASSIGN_OR_RETURN(
      const KvPoolMemory memory,
      model.KvPoolMemoryFor(block, StepBounds{options.max_batch, options.max_batch, longest}));
  RUBATO_ASSIGN_OR_RETURN(
      const KvPoolSize size,
      SizeKvPool(memory, options.utilization, int64_t{blocks_per_sequence} * options.max_batch));
  RUBATO_ASSIGN_OR_RETURN(std::unique_ptr<PagedKvCache> cache,
                          model.CreateKvCache(block, size.num_blocks));
  bench::AddReportHeader(report, options.common, loaded, *cache,
                         "random bf16 in [-1, 1] written directly on both GPUs, no prefill");
  report["context"] = options.context;
  report["steps"] = options.steps;
  report["warmup"] = options.warmup;
  report["gpu_memory_utilization"] = options.utilization;
  report["model_device"] = options.common.device;
  std::vector<int> cache_devices = options.cache_devices;
  if (cache_devices.empty() && cache_device >= 0) cache_devices.push_back(cache_device);
  for (const int device : cache_devices) {
    if (device < 0 || device >= devices) {
      return InvalidArgumentError("--cache-devices: GPU " + std::to_string(device) + " of " +
                                  std::to_string(devices));
    }
    if (std::count(cache_devices.begin(), cache_devices.end(), device) > 1) {
      return InvalidArgumentError("--cache-devices: GPU " + std::to_string(device) + " twice");
    }
  }
  report["cache_device"] = cache_devices.empty() ? -1 : cache_devices.front();
  report["cache_devices"] = cache_devices;
  report["gpus"] = devices;
  const double kv_bytes_per_token = static_cast<double>(memory.bytes_per_block) / block;

  // The placed residency over the cache GPU, when there is one.
  std::shared_ptr<GpuCacheResidency> gpu;
  std::unique_ptr<PlacedResidency> placed;
  std::string placed_not_run;
  double cache_budget_gib = 0;
  const bool model_gpu_caches =
      std::count(cache_devices.begin(), cache_devices.end(), options.common.device) > 0;
  if (cache_devices.empty() || model_gpu_caches) {
    placed_not_run = "placement needs a cache GPU other than the model's (" +
                     std::to_string(devices) + " found)";
  } else {
    CacheSection section;
    section.memory = CacheSection::Memory::kDevice;
    section.device = cache_devices.front();
    // Every cache GPU gets the section's budget: the smallest any of them has room for.
    Result<double> budget = CacheBudgetGiB(config, cache_devices.front(), longest, options);
    for (size_t c = 1; c < cache_devices.size() && budget.ok(); ++c) {
      Result<double> other = CacheBudgetGiB(config, cache_devices[c], longest, options);
      if (!other.ok() || *other < *budget) budget = other;
    }
    if (budget.ok()) {
      section.budget_gib = cache_budget_gib = *budget;
      gpu = std::make_shared<GpuCacheResidency>(section, longest, options.max_batch, block,
                                                cache_devices);
      gpu->set_local_window(0);
      placed = std::make_unique<PlacedResidency>(gpu);
      Status attached = placed->Attach(model, nullptr, options.max_batch);
      for (int c = 0; c < gpu->num_caches() && attached.ok(); ++c) {
        attached = gpu->attention(c)->FillRandom(options.common.seed + 7 + c);
      }
      if (!attached.ok()) placed_not_run = attached.message();
    } else {
      placed_not_run = budget.status().message();
    }
    if (!placed_not_run.empty()) {
      placed.reset();
      (void)model.SetResidencyBackend(nullptr);
    }
  }

  // Admission in turn, as the engine's: local while the pool has room for a whole sequence,
  // else (placed side) on the cache GPU while its budget takes one and the model GPU has the
  // block it writes; the first refusal ends the batch.
  std::vector<Sequence> sequences(static_cast<size_t>(options.max_batch));
  size_t local_batch = 0, placed_batch = 0;
  std::string placed_stop = "max_batch";
  for (size_t i = 0; i < sequences.size(); ++i) {
    Sequence& s = sequences[i];
    const int room_tokens = cache->free_blocks() * block;
    if (placed == nullptr) {
      if (longest - 1 > room_tokens) break;
      RUBATO_RETURN_IF_ERROR(cache->Reserve(s.kv, longest));
      local_batch = placed_batch = i + 1;
      continue;
    }
    if (room_tokens < block) {
      placed_stop = "the model GPU has no free block for a placed sequence's window";
      break;
    }
    Result<std::unique_ptr<ResidencyRequest>> admitted = placed->Admit(i, longest - 1, room_tokens);
    if (!admitted.ok()) {
      placed_stop = admitted.status().message();
      break;
    }
    s.request = std::move(admitted).value();
    if (s.request->WhollyLocal()) {
      RUBATO_RETURN_IF_ERROR(cache->Reserve(s.kv, longest));
      local_batch = i + 1;
    } else {
      // Every position before the context is on the cache GPU: the table's entries are
      // released, the block being written is taken before each step.
      s.windowed = true;
      s.kv.block_table.assign(static_cast<size_t>(options.context / block), kReleasedBlock);
      s.kv.released_blocks = options.context / block;
      RUBATO_RETURN_IF_ERROR(cache->Reserve(s.kv, options.context + 1));
    }
    placed_batch = i + 1;
  }
  // The local sequences' KV: random, at the context (FillRandomKv wants empty sequences).
  std::vector<KvSequence*> whole;
  for (size_t i = 0; i < local_batch; ++i) whole.push_back(&sequences[i].kv);
  if (!whole.empty()) {
    for (KvSequence* kv : whole) RUBATO_RETURN_IF_ERROR(cache->Release(*kv));
    RUBATO_RETURN_IF_ERROR(
        bench::FillRandomKv(model, *cache, whole, options.context, options.common.seed + 1));
    // Every position both sides decode, held from the start.
    for (KvSequence* kv : whole) RUBATO_RETURN_IF_ERROR(cache->Reserve(*kv, longest));
  }
  for (size_t i = local_batch; i < placed_batch; ++i) sequences[i].kv.num_tokens = options.context;
  std::printf(
      "model on GPU %d, %zu cache GPU(s) from GPU %d (%d GPUs); context %d: one card holds %zu "
      "sequences (%d blocks of %d tokens)\n",
      options.common.device, cache_devices.size(), cache_devices.empty() ? -1 : cache_devices[0],
      devices, options.context, local_batch, size.num_blocks, block);

  nlohmann::json local_json = {{"batch", local_batch}, {"kv_pool_blocks", size.num_blocks}};
  StepTimes local;
  if (local_batch == 0) {
    local_json["not_run"] = "no sequence of " + std::to_string(longest) + " positions fits";
  } else {
    // The local side has no residency step: no entry carries a handle.
    RUBATO_ASSIGN_OR_RETURN(local, RunSteps(model, *cache, sequences, local_batch, false, {},
                                            options, options.common.seed + 2));
    local_json.update({{"tpot_ms", local.mean_ms},
                       {"step_ms_median", local.median_ms},
                       {"step_ms_p90", local.p90_ms},
                       {"tokens_per_s", local_batch / (local.mean_ms / 1e3)},
                       {"graph_replayed_steps", local.graph_steps},
                       {"kv_bytes_read_per_step",
                        kv_bytes_per_token * local_batch * (options.context + options.warmup)}});
    std::printf("local:  batch %zu, TPOT %.3f ms, %.1f tokens/s\n", local_batch, local.mean_ms,
                local_batch / (local.mean_ms / 1e3));
  }
  report["local"] = local_json;

  nlohmann::json placed_json = {{"batch", placed_batch},
                                {"local_batch", local_batch},
                                {"cache_batch", placed_batch - local_batch}};
  if (placed == nullptr) {
    placed_json["not_run"] = placed_not_run;
    std::printf("placed: does not run: %s\n", placed_not_run.c_str());
  } else {
    placed_json["batch_ended_by"] = placed_stop;
    std::vector<GpuCacheAttention*> attentions;
    for (int c = 0; c < gpu->num_caches(); ++c) {
      attentions.push_back(gpu->attention(c));
      RUBATO_RETURN_IF_ERROR(attentions.back()->SetMeasureWaits(true));
    }
    Result<StepTimes> run = RunSteps(model, *cache, sequences, placed_batch, true, attentions,
                                     options, options.common.seed + 3);
    size_t out = 0, back = 0;
    for (GpuCacheAttention* attention : attentions) {
      out += attention->step_bytes_out();
      back += attention->step_bytes_back();
    }
    for (size_t i = 0; i < placed_batch; ++i) {
      if (sequences[i].request != nullptr) (void)placed->Close(*sequences[i].request);
    }
    RUBATO_RETURN_IF_ERROR(run.status());
    const double tokens_per_s = placed_batch / (run->mean_ms / 1e3);
    placed_json.update({{"tpot_ms", run->mean_ms},
                        {"step_ms_median", run->median_ms},
                        {"step_ms_p90", run->p90_ms},
                        {"tokens_per_s", tokens_per_s},
                        {"graph_replayed_steps", run->graph_steps},
                        {"exposed_wait_ms_per_step", run->wait_ms},
                        {"bytes_to_cache_per_step", out},
                        {"bytes_from_cache_per_step", back},
                        {"cache_device_bytes", gpu->device_bytes()},
                        {"cache_budget_gib", cache_budget_gib}});
    if (local_batch > 0) {
      placed_json["tokens_per_s_ratio_to_local"] =
          tokens_per_s / (local_batch / (local.mean_ms / 1e3));
    }
    std::printf(
        "placed: batch %zu (%zu local + %zu on the cache GPUs), TPOT %.3f ms, %.1f tokens/s "
        "(%.2fx local), exposed wait %.3f ms/step, %.0f KB out / %.0f KB back per step\n",
        placed_batch, local_batch, placed_batch - local_batch, run->mean_ms, tokens_per_s,
        local_batch > 0 ? tokens_per_s / (local_batch / (local.mean_ms / 1e3)) : 0.0, run->wait_ms,
        out / 1e3, back / 1e3);
  }
  report["placed"] = placed_json;
  (void)model.SetResidencyBackend(nullptr);
  for (Sequence& s : sequences) (void)cache->Release(s.kv);
  return Status::Ok();
}

}  // namespace
}  // namespace rubato

int main(int argc, char** argv) {
  rubato::Options options;
  CLI::App app{"rubato capacity benchmark: local dense on one card against placement on two"};
  rubato::bench::AddCommonOptions(app, options.common);
  app.add_option("--context", options.context, "context of every sequence (tokens)");
  app.add_option("--steps", options.steps, "timed decode steps per side");
  app.add_option("--warmup", options.warmup, "untimed steps per side (>= 2)");
  app.add_option("--max-batch", options.max_batch, "the most sequences either side runs");
  app.add_option("--gpu-memory-utilization", options.utilization,
                 "share of each card's memory the process may use (the engine's rule)");
  app.add_option("--cache-device", options.cache_device,
                 "the cache rank's GPU (default: 1 with two GPUs)");
  app.add_option("--cache-devices", options.cache_devices,
                 "several cache GPUs, e.g. 1,2,3 (overrides --cache-device)")
      ->delimiter(',');
  return rubato::bench::BenchMain(
      "rubato_bench_decode_e2e_capacity", app, options.common, argc, argv,
      [&](nlohmann::json& report) { return rubato::Run(options, report); });
}
