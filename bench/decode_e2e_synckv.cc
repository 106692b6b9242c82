// rubato_bench_decode_e2e_synckv: SyncKV (split_by_head KV) against dense decode on the CUDA
// model with random weights (Qwen3-8B shapes with --config configs/models/qwen3-8b):
//   bytes:      the GPU KV bytes of SyncKV against the full KV per Mem% (--mems), from the
//               residency's device storage allocated for --bytes-slots requests;
//   throughput: decode step time of SyncKV (Mem% --mem, stride --stride, the NR store in pinned
//               host memory or on GPU --store-device) against dense at the same batch x context
//               points, tokens/s, and the exposed fetch wait and rows fetched per step;
//   capacity:   the largest batch at --capacity-context each fits (dense: its paged KV on this
//               GPU; SyncKV: its device storage and local window here, the NR store where
//               --store says), and the tokens/s of each at its largest batch.
// No prefill: KV is random bf16 written directly (the R-heads' pools, the store, the paged
// cache), and each SyncKV request's prompt ends with one forward of its last token, which makes
// the initial selection from the paged cache (held whole for that request only). A point that
// does not fit is reported as such. A benchmark, not a test. docs/benchmarks.md "SyncKV decode".
#include <cuda_runtime_api.h>
#include <unistd.h>

#include <CLI/CLI.hpp>
#include <algorithm>
#include <chrono>
#include <cstdio>
#include <nlohmann/json.hpp>
#include <random>
#include <string>
#include <vector>

#include "bench/decode_bench_common.h"
#include "common/status.h"
#include "inference_rank/model/cuda_kv_storage.h"
#include "inference_rank/model/cuda_model.h"
#include "inference_rank/policies/synckv/synckv_policy.h"
#include "inference_rank/residency/split_by_head/split_by_head_cuda_kv.h"
#include "inference_rank/residency/split_by_head/split_by_head_residency.h"
#include "kernels/cuda/cuda_status.h"
#include "kernels/cuda/random_fill.cuh"

namespace rubato {
namespace {

using bench::Percentile;
using bench::Point;

struct Options {
  bench::CommonOptions common;
  std::string modes = "bytes,throughput,capacity";
  std::string points = "8x32768,2x131072";
  std::vector<double> mems = {20, 30, 50};
  double mem = 20;
  int stride = 5;
  std::string store = "host";
  int store_device = 1;
  int steps = 20;  // timed decode steps: stride 5 gives 4 anticipations
  int warmup = 3;
  int capacity_context = 131072;
  int max_batch = 64;
  int bytes_slots = 1;
};

// Step times: tokens/s and the ratios come from the mean (a SyncKV cycle of m steps has one
// anticipation step, far longer than the suspension steps that the median shows).
struct Timing {
  double mean_ms = 0, median_ms = 0, p90_ms = 0;
  double wait_ms_per_step = 0, rows_fetched_per_step = 0;
  double gpu_kv_bytes = 0;  // SyncKV: the residency's device storage; dense: the paged KV
};

double Mean(const std::vector<double>& values) {
  double sum = 0;
  for (const double v : values) sum += v;
  return values.empty() ? 0.0 : sum / static_cast<double>(values.size());
}

SyncKvCalibration SyntheticCalibration(const ModelConfig& config) {
  SyncKvCalibration c;
  c.model = "random weights (benchmark)";
  c.num_layers = config.num_layers;
  c.num_heads = config.num_heads;
  c.num_kv_heads = config.num_kv_heads;
  c.head_dim = config.head_dim;
  for (int l = 0; l < config.num_layers; ++l) {
    for (int i = 0; i < config.num_kv_heads; ++i) {
      for (int j = 0; j < config.num_kv_heads; ++j) c.similarity.push_back(i == j ? 1.0 : 0.5);
    }
  }
  return c;
}

Result<std::shared_ptr<SyncKvPolicy>> MakePolicy(const ModelConfig& config, const Options& o,
                                                 double mem) {
  SyncKvConfig sc;
  sc.calibration = "(synthetic)";
  sc.mem_percent = mem;
  sc.stride = o.stride;
  sc.store = o.store;
  sc.store_device = o.store_device;
  SyncKvCalibration calibration = SyntheticCalibration(config);
  RUBATO_RETURN_IF_ERROR(ClusterCalibration(calibration, 1));
  RUBATO_ASSIGN_OR_RETURN(std::unique_ptr<SyncKvPolicy> policy,
                          SyncKvPolicy::Create(sc, std::move(calibration)));
  return std::shared_ptr<SyncKvPolicy>(std::move(policy));
}

Status Fill(__nv_bfloat16* out, size_t count, uint64_t seed, uint64_t stream, cudaStream_t s) {
  cuda::RandomFillParams fill;
  fill.out = out;
  fill.count = static_cast<int64_t>(count);
  fill.seed = seed;
  fill.stream = stream;
  fill.bound = 1.f;
  return cuda::RandomFill(fill, s);
}

double FullKvBytes(const ModelConfig& c, double positions) {
  return positions * c.num_layers * 2.0 * c.num_kv_heads * c.head_dim * 2.0;
}

// Times `steps` decode steps of `sequences` (after `warmup`), each entry planned by its request.
Result<std::vector<double>> TimeSteps(CudaModel& model, PagedKvCache& cache,
                                      std::vector<KvSequence>& sequences,
                                      std::vector<std::unique_ptr<PolicyRequest>>& requests,
                                      std::vector<std::unique_ptr<ResidencyRequest>>& storage,
                                      const Options& o) {
  std::vector<int> next(sequences.size(), 1);
  const TokenSampling greedy;
  ForwardResult result;
  std::vector<ForwardEntry> batch(sequences.size());
  std::vector<double> ms;
  for (int step = 0; step < o.warmup + o.steps; ++step) {
    for (size_t i = 0; i < sequences.size(); ++i) {
      batch[i] = ForwardEntry{
          &sequences[i], {&next[i], 1}, sequences[i].num_tokens, LogitsWanted::kLast, &greedy};
      if (!requests.empty()) batch[i].attention = requests[i]->PlanDecode(batch[i].start_position);
      if (!storage.empty()) storage[i]->AttachTo(batch[i]);
    }
    const auto start = std::chrono::steady_clock::now();
    RUBATO_RETURN_IF_ERROR(model.Forward(batch, cache, result));  // synchronizes
    const auto end = std::chrono::steady_clock::now();
    if (step >= o.warmup)
      ms.push_back(std::chrono::duration<double, std::milli>(end - start).count());
    for (size_t i = 0; i < sequences.size(); ++i) {
      next[i] = result.sampled_tokens[i];
      if (!requests.empty()) requests[i]->Observe(true, next[i], -1.f);
    }
  }
  return ms;
}

Result<Timing> RunDense(CudaModel& model, const Point& point, const Options& o) {
  const int grown = o.warmup + o.steps;
  RUBATO_ASSIGN_OR_RETURN(std::unique_ptr<PagedKvCache> cache,
                          bench::CreateBenchKvCache(
                              model, o.common.block_size,
                              bench::BlocksForPoints({point}, grown, o.common.block_size), 0, ""));
  std::vector<KvSequence> sequences(static_cast<size_t>(point.batch));
  std::vector<KvSequence*> pointers;
  for (KvSequence& s : sequences) pointers.push_back(&s);
  RUBATO_RETURN_IF_ERROR(
      bench::FillRandomKv(model, *cache, pointers, point.context, o.common.seed));
  std::vector<std::unique_ptr<PolicyRequest>> none;
  std::vector<std::unique_ptr<ResidencyRequest>> no_storage;
  RUBATO_ASSIGN_OR_RETURN(std::vector<double> ms,
                          TimeSteps(model, *cache, sequences, none, no_storage, o));
  Timing t;
  t.mean_ms = Mean(ms);
  t.median_ms = Percentile(ms, 0.5);
  t.p90_ms = Percentile(ms, 0.9);
  t.gpu_kv_bytes = static_cast<double>(cache->pool_bytes());
  for (KvSequence& s : sequences) RUBATO_RETURN_IF_ERROR(cache->Release(s));
  return t;
}

Result<Timing> RunSyncKv(CudaModel& model, const Point& point, const Options& o, double mem) {
  const ModelConfig& config = model.config();
  const int grown = o.warmup + o.steps;
  RUBATO_ASSIGN_OR_RETURN(std::shared_ptr<SyncKvPolicy> policy, MakePolicy(config, o, mem));
  RUBATO_ASSIGN_OR_RETURN(std::unique_ptr<AttentionBackend> backend,
                          policy->MakeBackend(model, point.batch));
  RUBATO_RETURN_IF_ERROR(model.SetAttentionBackend(std::move(backend)));
  auto residency = std::make_shared<SplitByHeadResidency>(nullptr, point.context + grown + 1);
  RUBATO_RETURN_IF_ERROR(residency->Attach(model, policy.get(), point.batch));
  SplitByHeadDeviceKv& kv = *residency->device_kv();
  // Random R-head pools and store (the compact pools are filled by the prompts' selections).
  const size_t d = static_cast<size_t>(config.head_dim);
  for (int l = 0; l < config.num_layers; ++l) {
    const size_t r_rows =
        static_cast<size_t>(kv.r_pool_blocks()) * SplitByHeadDeviceKv::kRBlockTokens;
    const size_t store = static_cast<size_t>(kv.nr_heads()) * kv.store_rows() * d;
    RUBATO_RETURN_IF_ERROR(Fill(kv.r_keys(l, 0), r_rows * d, o.common.seed, 4 * l, model.stream()));
    RUBATO_RETURN_IF_ERROR(
        Fill(kv.r_values(l, 0), r_rows * d, o.common.seed, 4 * l + 1, model.stream()));
    RUBATO_RETURN_IF_ERROR(Fill(kv.store_keys(l), store, o.common.seed, 4 * l + 2, model.stream()));
    RUBATO_RETURN_IF_ERROR(
        Fill(kv.store_values(l), store, o.common.seed, 4 * l + 3, model.stream()));
  }
  // The paged cache: one whole context (a prompt's end reads it) and every request's window.
  const int window = residency->LocalWindow() + grown + 2 * o.common.block_size;
  const int blocks = (point.context + o.common.block_size - 1) / o.common.block_size +
                     point.batch * ((window + o.common.block_size - 1) / o.common.block_size + 2);
  RUBATO_ASSIGN_OR_RETURN(std::unique_ptr<PagedKvCache> cache,
                          bench::CreateBenchKvCache(model, o.common.block_size, blocks, 0, ""));
  auto* storage_kv = dynamic_cast<DeviceKvStorage*>(cache->storage());
  RUBATO_RETURN_IF_ERROR(Fill(storage_kv->keys().data(), storage_kv->keys().size(), o.common.seed,
                              1000, model.stream()));
  RUBATO_RETURN_IF_ERROR(Fill(storage_kv->values().data(), storage_kv->values().size(),
                              o.common.seed, 1001, model.stream()));
  RUBATO_CUDA_RETURN_IF_ERROR(cudaStreamSynchronize(model.stream()), "filling the KV");

  std::vector<KvSequence> sequences(static_cast<size_t>(point.batch));
  std::vector<std::unique_ptr<PolicyRequest>> requests;
  std::vector<std::unique_ptr<ResidencyRequest>> storage;
  const TokenSampling greedy;
  ForwardResult result;
  for (int i = 0; i < point.batch; ++i) {
    KvSequence& s = sequences[static_cast<size_t>(i)];
    requests.push_back(policy->Admit(KvResidency::kSplitByHead));
    RUBATO_ASSIGN_OR_RETURN(std::unique_ptr<ResidencyRequest> opened,
                            residency->Open(static_cast<uint64_t>(i), point.context + grown));
    storage.push_back(std::move(opened));
    RUBATO_RETURN_IF_ERROR(cache->Reserve(s, point.context - 1));
    s.num_tokens = point.context - 1;
    const int token = 1;
    ForwardEntry end{&s, {&token, 1}, point.context - 1, LogitsWanted::kLast, &greedy};
    end.attention = requests.back()->PlanPrefill(point.context - 1, 1, true);
    storage.back()->AttachTo(end);
    RUBATO_RETURN_IF_ERROR(model.Forward({&end, 1}, *cache, result));
    requests.back()->Observe(false, result.sampled_tokens[0], -1.f);
    RUBATO_RETURN_IF_ERROR(cache->ReleaseBefore(s, point.context - residency->LocalWindow()));
  }
  const int64_t wait_before = residency->counters().exposed_wait_ns;
  const int64_t rows_before = residency->counters().rows_fetched;
  Result<std::vector<double>> ms = TimeSteps(model, *cache, sequences, requests, storage, o);
  Timing t;
  if (ms.ok()) {
    t.mean_ms = Mean(*ms);
    t.median_ms = Percentile(*ms, 0.5);
    t.p90_ms = Percentile(*ms, 0.9);
    const int steps = o.warmup + o.steps;
    t.wait_ms_per_step = (residency->counters().exposed_wait_ns - wait_before) * 1e-6 / steps;
    t.rows_fetched_per_step =
        static_cast<double>(residency->counters().rows_fetched - rows_before) / steps;
    t.gpu_kv_bytes = static_cast<double>(residency->device_bytes());
  }
  for (auto& r : storage) RUBATO_RETURN_IF_ERROR(residency->Close(*r));
  storage.clear();
  for (KvSequence& s : sequences) RUBATO_RETURN_IF_ERROR(cache->Release(s));
  cache.reset();
  RUBATO_RETURN_IF_ERROR(model.SetResidencyBackend(nullptr));
  RUBATO_RETURN_IF_ERROR(model.SetAttentionBackend(nullptr));
  RUBATO_RETURN_IF_ERROR(ms.status());
  return t;
}

// SyncKV's bytes per request: on this GPU (device storage + window), in the store.
struct SyncKvSizes {
  double device = 0, store = 0;
};
SyncKvSizes SizesPerRequest(const ModelConfig& c, const SyncKvPolicy& policy, int context,
                            int window) {
  const double t = (context + 63) / 64 * 64.0, p = policy.Budget(static_cast<int>(t));
  const double row = c.head_dim * 2.0 * 2.0;  // K and V, bf16
  SyncKvSizes s;
  s.device = c.num_layers * ((1.0 * t + c.num_kv_heads * p) * row + 4.0 * (t + p + 2)) +
             FullKvBytes(c, window);
  s.store = c.num_layers * (c.num_kv_heads - 1.0) * t * row;
  return s;
}

Status Run(const Options& o, nlohmann::json& report) {
  RUBATO_ASSIGN_OR_RETURN(bench::BenchModel loaded, bench::LoadBenchModel(o.common));
  CudaModel& model = *loaded.model;
  const ModelConfig& config = model.config();
  report["device"] = loaded.device_name;
  report["config"] = o.common.config;
  report["command"] = o.common.command_line;
  report["store"] =
      o.store == "host" ? "pinned host memory" : "GPU " + std::to_string(o.store_device);
  report["stride"] = o.stride;
  std::printf("device %s, %s, weights %.2f GB, NR store: %s\n", loaded.device_name.c_str(),
              o.common.config.c_str(), model.weight_bytes() / 1e9,
              std::string(report["store"]).c_str());
  const auto has = [&](const char* mode) { return o.modes.find(mode) != std::string::npos; };

  if (has("bytes")) {  // (a) GPU KV bytes against full, per Mem%
    for (double mem : o.mems) {
      const Point point{o.bytes_slots, o.capacity_context};
      RUBATO_ASSIGN_OR_RETURN(std::shared_ptr<SyncKvPolicy> policy, MakePolicy(config, o, mem));
      SplitByHeadResidency residency(nullptr, point.context);
      size_t free_before = 0, free_after = 0, total = 0;
      cudaMemGetInfo(&free_before, &total);
      const Status attached = residency.Attach(model, policy.get(), point.batch);
      cudaMemGetInfo(&free_after, &total);
      if (!attached.ok()) {
        std::printf("bytes Mem %.0f %%: does not fit (%s)\n", mem, attached.message().c_str());
        report["bytes"].push_back(
            {{"mem_percent", mem}, {"fits", false}, {"error", attached.message()}});
        continue;
      }
      const double full = FullKvBytes(config, static_cast<double>(point.batch) * point.context);
      const double held = static_cast<double>(residency.device_bytes());
      std::printf(
          "bytes Mem %.0f %%: GPU KV %.3f GB of full %.3f GB = %.1f %% (measured %.3f GB)\n", mem,
          held / 1e9, full / 1e9, 100 * held / full, (free_before - free_after) / 1e9);
      report["bytes"].push_back({{"mem_percent", mem},
                                 {"fits", true},
                                 {"slots", point.batch},
                                 {"context", point.context},
                                 {"gpu_kv_bytes", held},
                                 {"full_kv_bytes", full},
                                 {"share", held / full},
                                 {"measured_bytes", free_before - free_after}});
      RUBATO_RETURN_IF_ERROR(model.SetResidencyBackend(nullptr));
    }
  }
  if (has("throughput")) {  // (b) tok/s against dense at the same points
    RUBATO_ASSIGN_OR_RETURN(const std::vector<Point> points, bench::ParsePoints(o.points, 0, 0));
    for (const Point& point : points) {
      nlohmann::json entry = {
          {"batch", point.batch}, {"context", point.context}, {"mem_percent", o.mem}};
      Result<Timing> dense = RunDense(model, point, o);
      Result<Timing> synckv = RunSyncKv(model, point, o, o.mem);
      if (dense.ok()) {
        entry["dense_step_ms"] = dense->mean_ms;
        entry["dense_step_ms_median"] = dense->median_ms;
        entry["dense_tokens_per_s"] = point.batch / (dense->mean_ms / 1e3);
      } else {
        entry["dense_error"] = dense.status().message();
      }
      if (synckv.ok()) {
        entry["synckv_step_ms"] = synckv->mean_ms;
        entry["synckv_step_ms_median"] = synckv->median_ms;
        entry["synckv_step_ms_p90"] = synckv->p90_ms;
        entry["synckv_tokens_per_s"] = point.batch / (synckv->mean_ms / 1e3);
        entry["exposed_fetch_wait_ms_per_step"] = synckv->wait_ms_per_step;
        entry["rows_fetched_per_step"] = synckv->rows_fetched_per_step;
        entry["synckv_gpu_kv_bytes"] = synckv->gpu_kv_bytes;
      } else {
        entry["synckv_error"] = synckv.status().message();
      }
      std::printf("%dx%d: dense %s, synckv %s", point.batch, point.context,
                  dense.ok() ? (std::to_string(dense->mean_ms) + " ms").c_str() : "does not fit",
                  synckv.ok() ? (std::to_string(synckv->mean_ms) + " ms").c_str() : "does not fit");
      if (dense.ok() && synckv.ok()) {
        std::printf(
            " (%.2fx tok/s), exposed fetch wait %.3f ms/step (%.1f %%), %.0f rows fetched/step",
            dense->mean_ms / synckv->mean_ms, synckv->wait_ms_per_step,
            100 * synckv->wait_ms_per_step / synckv->mean_ms, synckv->rows_fetched_per_step);
        entry["speedup"] = dense->mean_ms / synckv->mean_ms;
      }
      if (!synckv.ok()) std::printf(" [%s]", synckv.status().message().c_str());
      if (!dense.ok()) std::printf(" [%s]", dense.status().message().c_str());
      std::printf("\n");
      report["throughput"].push_back(entry);
    }
  }
  if (has("capacity")) {  // (c) the largest batch at one context, tok/s of each
    const int context = o.capacity_context, grown = o.warmup + o.steps;
    size_t free = 0, total = 0;
    cudaMemGetInfo(&free, &total);
    const double usable = static_cast<double>(free) - bench::kHeadroomBytes - (2ull << 30);
    const double dense_per = FullKvBytes(config, (context + grown + o.common.block_size));
    const int dense_batch = std::clamp(static_cast<int>(usable / dense_per), 0, o.max_batch);
    RUBATO_ASSIGN_OR_RETURN(std::shared_ptr<SyncKvPolicy> policy, MakePolicy(config, o, o.mem));
    const SyncKvSizes sizes = SizesPerRequest(config, *policy, context + grown + 1,
                                              o.stride + 63 + grown + 3 * o.common.block_size);
    double store_free = 0;
    if (o.store == "host") {
      store_free = 0.8 * static_cast<double>(sysconf(_SC_PHYS_PAGES)) * sysconf(_SC_PAGE_SIZE);
    } else {
      size_t other_free = 0, other_total = 0;
      cudaSetDevice(o.store_device);
      cudaMemGetInfo(&other_free, &other_total);
      cudaSetDevice(o.common.device);
      store_free = static_cast<double>(other_free) - (1ull << 30);
    }
    const double device_left = usable - FullKvBytes(config, context);  // one prompt's end, whole
    const int synckv_batch =
        std::clamp(static_cast<int>(std::min(device_left / sizes.device, store_free / sizes.store)),
                   0, o.max_batch);
    std::printf(
        "capacity at %d: dense batch %d (%.1f GB each), synckv batch %d (%.2f GB on this "
        "GPU, %.1f GB in the store each)\n",
        context, dense_batch, dense_per / 1e9, synckv_batch, sizes.device / 1e9, sizes.store / 1e9);
    nlohmann::json entry = {{"context", context},
                            {"mem_percent", o.mem},
                            {"dense_batch", dense_batch},
                            {"synckv_batch", synckv_batch},
                            {"synckv_device_bytes_per_request", sizes.device},
                            {"synckv_store_bytes_per_request", sizes.store}};
    Result<Timing> dense = dense_batch > 0
                               ? RunDense(model, {dense_batch, context}, o)
                               : Result<Timing>(ResourceExhaustedError("no request fits"));
    Result<Timing> synckv = synckv_batch > 0
                                ? RunSyncKv(model, {synckv_batch, context}, o, o.mem)
                                : Result<Timing>(ResourceExhaustedError("no request fits"));
    if (dense.ok())
      entry["dense_tokens_per_s"] = dense_batch / (dense->mean_ms / 1e3);
    else
      entry["dense_error"] = dense.status().message();
    if (synckv.ok()) {
      entry["synckv_tokens_per_s"] = synckv_batch / (synckv->mean_ms / 1e3);
      entry["exposed_fetch_wait_ms_per_step"] = synckv->wait_ms_per_step;
    } else {
      entry["synckv_error"] = synckv.status().message();
    }
    if (dense.ok() && synckv.ok()) {
      entry["ratio"] = (synckv_batch / synckv->mean_ms) / (dense_batch / dense->mean_ms);
      std::printf("capacity: dense %.1f tok/s at %d, synckv %.1f tok/s at %d: %.2fx\n",
                  dense_batch / (dense->mean_ms / 1e3), dense_batch,
                  synckv_batch / (synckv->mean_ms / 1e3), synckv_batch, double(entry["ratio"]));
    } else {
      std::printf("capacity: dense %s, synckv %s\n",
                  dense.ok() ? "ran" : dense.status().message().c_str(),
                  synckv.ok() ? "ran" : synckv.status().message().c_str());
    }
    report["capacity"] = entry;
  }
  return Status::Ok();
}

}  // namespace
}  // namespace rubato

int main(int argc, char** argv) {
  rubato::Options options;
  CLI::App app{"SyncKV against dense decode on the CUDA model (bench/README.md)"};
  rubato::bench::AddCommonOptions(app, options.common);
  app.add_option("--modes", options.modes, "any of bytes,throughput,capacity");
  app.add_option("--points", options.points, "throughput points, BATCHxCONTEXT,...");
  app.add_option("--mems", options.mems, "Mem% values of the bytes mode");
  app.add_option("--mem", options.mem, "Mem% of the throughput and capacity modes");
  app.add_option("--stride", options.stride, "m: an anticipation every m steps");
  app.add_option("--store", options.store, "host (pinned) or device (--store-device)");
  app.add_option("--store-device", options.store_device, "the store's GPU with --store device");
  app.add_option("--steps", options.steps, "timed decode steps per point");
  app.add_option("--warmup", options.warmup, "untimed steps first");
  app.add_option("--capacity-context", options.capacity_context, "context of capacity and bytes");
  app.add_option("--max-batch", options.max_batch, "capacity: the largest batch tried");
  app.add_option("--bytes-slots", options.bytes_slots, "bytes: requests the storage is made for");
  return rubato::bench::BenchMain(
      "rubato_bench_decode_e2e_synckv", app, options.common, argc, argv,
      [&](nlohmann::json& report) { return rubato::Run(options, report); });
}
