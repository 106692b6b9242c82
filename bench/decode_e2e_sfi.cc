// rubato_bench_decode_e2e_sfi: end-to-end SFI decode against dense decode on the CUDA model at
// real shapes, batch x context points, in the same process and run: dense steps, SFI cycles of
// one slow step and N - 1 fast steps per "slow every N" schedule, and slow steps with the
// maintenance inline (what the aux stream hides). No prefill: random bf16 KV, fresh SFI states.
// A benchmark, not a test. Method, outputs and a command line: docs/benchmarks.md "End-to-end
// SFI decode".
#include <cuda_runtime_api.h>

#include <CLI/CLI.hpp>
#include <algorithm>
#include <bit>
#include <cstdio>
#include <memory>
#include <nlohmann/json.hpp>
#include <random>
#include <sstream>
#include <string>
#include <vector>

#include "bench/decode_bench_common.h"
#include "common/status.h"
#include "inference_rank/model/cuda_kv_storage.h"
#include "inference_rank/model/cuda_model.h"
#include "inference_rank/policies/sfi/sfi_cuda_backend.h"
#include "inference_rank/policies/sfi/sfi_state.h"
#include "kernels/cuda/cuda_status.h"

namespace rubato {
namespace {

using bench::Percentile;
using bench::Point;

struct Options {
  bench::CommonOptions common;  // --config, --block-size, --seed, --device, --commit, --out
  std::string points = "8x12288,16x32768,4x131072";
  std::string slow_every = "16,tmax";  // N per schedule; "tmax" = t_max + 1
  int dense_steps = 20;
  int dense_warmup = 3;
  int cycles = 4;         // timed cycles per schedule
  int warmup_cycles = 2;  // untimed (a slow step's graph: eager, captured, then replayed)
  int sink = 4;
  int recent = 256;
  int budget = 2048;
  int t_max = 64;
  double gamma = 0.0;  // the key-norm prior's exponent (0: off, the default)
};

struct Timings {
  std::vector<double> slow_ms, fast_ms;  // timed steps by kind (dense steps count as slow)
  double total_ms = 0;                   // all timed steps
  int timed_steps = 0;
  int64_t graph_steps = 0;  // timed steps replayed as graphs
};

// `warmup + timed` decode steps of `point` from a fresh KV fill (and fresh SFI states when
// `sfi`, planned for the model's SFI backend): step i is slow when i % slow_every == 0, fast
// otherwise.
Result<Timings> RunSteps(CudaModel& model, PagedKvCache& cache, const Point& point, bool sfi,
                         int slow_every, int warmup, int timed, uint64_t seed) {
  const ModelConfig& config = model.config();
  std::vector<KvSequence> sequences(static_cast<size_t>(point.batch));
  std::vector<KvSequence*> pointers;
  for (KvSequence& s : sequences) pointers.push_back(&s);
  RUBATO_RETURN_IF_ERROR(bench::FillRandomKv(model, cache, pointers, point.context, seed));
  std::vector<SfiSequenceState> states(sequences.size());  // slots go back when they go
  std::vector<EntryAttention> attentions(sequences.size());

  std::mt19937_64 rng(seed);
  std::vector<int> next(sequences.size());
  for (int& token : next)
    token = static_cast<int>(rng() % static_cast<uint64_t>(config.vocab_size));
  const TokenSampling greedy;
  ForwardResult result;
  std::vector<ForwardEntry> batch(sequences.size());
  cudaEvent_t start, stop;
  RUBATO_CUDA_RETURN_IF_ERROR(cudaEventCreate(&start), "creating an event");
  RUBATO_CUDA_RETURN_IF_ERROR(cudaEventCreate(&stop), "creating an event");
  Timings t;
  int64_t replays_before = 0;
  Status status;
  for (int step = 0; step < warmup + timed && status.ok(); ++step) {
    if (step == warmup) replays_before = model.graph_replays();
    const bool slow = step % slow_every == 0;
    for (size_t i = 0; i < sequences.size(); ++i) {
      batch[i] = ForwardEntry{
          &sequences[i], {&next[i], 1}, sequences[i].num_tokens, LogitsWanted::kLast, &greedy};
      if (sfi) {
        attentions[i] = SfiStep(slow ? SfiStepKind::kSlow : SfiStepKind::kFast, &states[i]);
        batch[i].attention = &attentions[i];
      }
    }
    cudaEventRecord(start, model.stream());  // the stream is idle: the events bracket the step
    status = model.Forward(batch, cache, result);
    cudaEventRecord(stop, model.stream());
    if (status.ok()) status = cuda::CudaStatus(cudaEventSynchronize(stop), "timing a step");
    float ms = 0;
    cudaEventElapsedTime(&ms, start, stop);
    if (step >= warmup) {
      (slow || !sfi ? t.slow_ms : t.fast_ms).push_back(ms);
      t.total_ms += ms;
      ++t.timed_steps;
    }
    for (size_t i = 0; i < sequences.size() && status.ok(); ++i) next[i] = result.sampled_tokens[i];
  }
  t.graph_steps = model.graph_replays() - replays_before;
  cudaEventDestroy(start);
  cudaEventDestroy(stop);
  for (KvSequence& s : sequences) {
    const Status released = cache.Release(s);
    if (status.ok()) status = released;
  }
  RUBATO_RETURN_IF_ERROR(status);
  return t;
}

Result<std::vector<int>> ParseSchedules(const std::string& list, int t_max) {
  std::vector<int> schedules;
  std::stringstream items(list);
  std::string item;
  while (std::getline(items, item, ',')) {
    int n = 0;
    if (item == "tmax") {
      n = t_max + 1;
    } else {
      std::stringstream one(item);
      if (!(one >> n) || !one.eof() || n < 2 || n > t_max + 1) {
        return InvalidArgumentError("--slow-every: '" + item + "' is not an N in [2, t_max + 1 = " +
                                    std::to_string(t_max + 1) + "] or 'tmax'");
      }
    }
    schedules.push_back(n);
  }
  if (schedules.empty()) return InvalidArgumentError("--slow-every is empty");
  return schedules;
}

// Device bytes of the SFI maintenance ring at its largest (cuda_sfi_ring.h: 4 slots, buffers
// rounded up to powers of two): scores, Selector workspace, selected positions and counts, and
// key norms (gamma > 0).
size_t RingBytes(const ModelConfig& config, const SfiPolicyConfig& sfi, int batch, int keys) {
  const size_t stride = static_cast<size_t>(keys + 4096);  // the decode bucket's excess, at most
  const size_t b = static_cast<size_t>(batch);
  const size_t scores = std::bit_ceil(b * config.num_heads * stride) * sizeof(float);
  const size_t workspace = std::bit_ceil(3 * b * config.num_kv_heads * stride * sizeof(float));
  const size_t selected =
      std::bit_ceil(b * config.num_kv_heads * static_cast<size_t>(sfi.selector.budget)) * 4;
  const size_t norms =  // gamma > 0: the key norms of J
      sfi.selector.gamma > 0.0 ? std::bit_ceil(b * config.num_kv_heads * stride) * sizeof(float)
                               : 0;
  return 4 * (scores + workspace + selected + norms + std::bit_ceil(b * config.num_kv_heads) * 4);
}

struct Row {  // one (point, schedule)
  Point point;
  int slow_every = 0;
  double dense_ms = 0, fast_ms = 0, slow_ms = 0, slow_inline_ms = 0;
  double dense_tok_s = 0, sfi_tok_s = 0;
  int fast_steps = 0, slow_steps = 0;
  int64_t graph_steps = 0;
  double SfiOverDense() const { return sfi_tok_s / dense_tok_s; }
  double SlowOverDense() const { return slow_ms / dense_ms; }
  double Hidden() const { return 1.0 - (slow_ms - dense_ms) / (slow_inline_ms - dense_ms); }
};

Status Run(const Options& options, nlohmann::json& report, std::vector<Row>& rows) {
  RUBATO_ASSIGN_OR_RETURN(const std::vector<Point> points,
                          bench::ParsePoints(options.points, 16, 32768));
  RUBATO_ASSIGN_OR_RETURN(const std::vector<int> schedules,
                          ParseSchedules(options.slow_every, options.t_max));
  if (options.dense_steps < 1 || options.dense_warmup < 2 || options.cycles < 1 ||
      options.warmup_cycles < 2) {
    return InvalidArgumentError(
        "--dense-steps and --cycles must be >= 1, --dense-warmup and --warmup-cycles >= 2 (the "
        "first step of a shape runs eagerly, the second captures its graph)");
  }
  SfiPolicyConfig sfi;
  sfi.sink_tokens = options.sink;
  sfi.recent_window = options.recent;
  sfi.t_max = options.t_max;
  sfi.triggers.clear();  // the schedule is the benchmark's
  sfi.selector.budget = options.budget;
  sfi.selector.gamma = options.gamma;
  RUBATO_RETURN_IF_ERROR(ValidateSfiPolicyConfig(sfi));

  RUBATO_ASSIGN_OR_RETURN(bench::BenchModel loaded, bench::LoadBenchModel(options.common));
  CudaModel* model = loaded.model;
  const ModelConfig& config = model->config();

  // The compact pool for the largest batch, then one KV pool for the largest point, beside the
  // SFI maintenance ring.
  int max_batch = 0, grown = options.dense_warmup + options.dense_steps;
  for (const Point& p : points) max_batch = std::max(max_batch, p.batch);
  for (int n : schedules) grown = std::max(grown, (options.warmup_cycles + options.cycles) * n);
  RUBATO_ASSIGN_OR_RETURN(std::unique_ptr<AttentionBackend> backend,
                          MakeSfiCudaBackend(*model, sfi, max_batch));
  auto* sfi_backend = static_cast<SfiCudaBackend*>(backend.get());
  RUBATO_RETURN_IF_ERROR(model->SetAttentionBackend(std::move(backend)));
  const int num_blocks = bench::BlocksForPoints(points, grown, options.common.block_size);
  size_t ring_bytes = 0;
  for (const Point& p : points) {
    ring_bytes = std::max(ring_bytes, RingBytes(config, sfi, p.batch, p.context + grown));
  }
  RUBATO_ASSIGN_OR_RETURN(
      std::unique_ptr<PagedKvCache> cache,
      bench::CreateBenchKvCache(*model, options.common.block_size, num_blocks, ring_bytes,
                                ", the SFI maintenance ring up to " + std::to_string(ring_bytes) +
                                    " (the SFI compact pool is already allocated)"));
  RUBATO_ASSIGN_OR_RETURN(const double copy_bandwidth,
                          bench::CopyBandwidth(size_t{4} << 30, model->stream()));
  std::printf(
      "device %s, device-to-device copy %.0f GB/s, %s: %.2f GB of bf16 weights; SFI sink "
      "%d, recent %d, budget %d, t_max %d\n",
      loaded.device_name.c_str(), copy_bandwidth / 1e9, options.common.config.c_str(),
      model->weight_bytes() / 1e9, sfi.sink_tokens, sfi.recent_window, sfi.selector.budget,
      sfi.t_max);

  bench::AddReportHeader(report, options.common, loaded, *cache,
                         "random bf16 in [-1, 1], no prefill");
  report["sfi"] = {{"sink_tokens", sfi.sink_tokens},
                   {"recent_window", sfi.recent_window},
                   {"budget", sfi.selector.budget},
                   {"t_max", sfi.t_max},
                   {"gamma", sfi.selector.gamma},
                   {"selector", "GPU SfiSelect, decode W = 1"}};
  report["copy_bandwidth_bytes_per_s"] = copy_bandwidth;
  report["timing"] =
      "events around each whole Forward (host planning, input copy, graph or eager launches, SFI "
      "maintenance, copies back); medians over the timed steps; tok/s over whole timed cycles";

  for (size_t p = 0; p < points.size(); ++p) {
    const Point& point = points[p];
    const uint64_t seed = options.common.seed + 1 + p;
    RUBATO_ASSIGN_OR_RETURN(const Timings dense,
                            RunSteps(*model, *cache, point, /*sfi=*/false, 1, options.dense_warmup,
                                     options.dense_steps, seed));
    sfi_backend->SetOverlap(false);  // the maintenance inline: what the overlap hides
    const int first = schedules.front();
    RUBATO_ASSIGN_OR_RETURN(const Timings inline_run,
                            RunSteps(*model, *cache, point, /*sfi=*/true, first,
                                     options.warmup_cycles * first, options.cycles * first, seed));
    sfi_backend->SetOverlap(true);
    for (int n : schedules) {
      RUBATO_ASSIGN_OR_RETURN(const Timings run,
                              RunSteps(*model, *cache, point, /*sfi=*/true, n,
                                       options.warmup_cycles * n, options.cycles * n, seed));
      Row row;
      row.point = point;
      row.slow_every = n;
      row.dense_ms = Percentile(dense.slow_ms, 0.5);
      row.fast_ms = Percentile(run.fast_ms, 0.5);
      row.slow_ms = Percentile(run.slow_ms, 0.5);
      row.slow_inline_ms = Percentile(inline_run.slow_ms, 0.5);
      row.dense_tok_s = point.batch * dense.timed_steps / (dense.total_ms / 1e3);
      row.sfi_tok_s = point.batch * run.timed_steps / (run.total_ms / 1e3);
      row.fast_steps = static_cast<int>(run.fast_ms.size());
      row.slow_steps = static_cast<int>(run.slow_ms.size());
      row.graph_steps = run.graph_steps;
      std::printf(
          "%dx%d N=%d: dense %.3f ms, SFI fast %.3f ms, slow %.3f ms (inline %.3f ms); tok/s dense "
          "%.0f, SFI %.0f (%.2fx); slow/dense %.3f; maintenance hidden %.2f\n",
          point.batch, point.context, n, row.dense_ms, row.fast_ms, row.slow_ms, row.slow_inline_ms,
          row.dense_tok_s, row.sfi_tok_s, row.SfiOverDense(), row.SlowOverDense(), row.Hidden());
      report["points"].push_back({{"batch", point.batch},
                                  {"context", point.context},
                                  {"slow_every", n},
                                  {"dense_step_ms", row.dense_ms},
                                  {"dense_step_ms_p90", Percentile(dense.slow_ms, 0.9)},
                                  {"sfi_fast_step_ms", row.fast_ms},
                                  {"sfi_fast_step_ms_p90", Percentile(run.fast_ms, 0.9)},
                                  {"sfi_slow_step_ms", row.slow_ms},
                                  {"sfi_slow_step_inline_ms", row.slow_inline_ms},
                                  {"dense_tokens_per_s", row.dense_tok_s},
                                  {"sfi_tokens_per_s", row.sfi_tok_s},
                                  {"sfi_over_dense", row.SfiOverDense()},
                                  {"slow_over_dense", row.SlowOverDense()},
                                  {"maintenance_hidden_fraction", row.Hidden()},
                                  {"timed_fast_steps", row.fast_steps},
                                  {"timed_slow_steps", row.slow_steps},
                                  {"dense_graph_replayed_steps", dense.graph_steps},
                                  {"sfi_graph_replayed_steps", row.graph_steps}});
      rows.push_back(row);
    }
  }
  return Status::Ok();
}

void PrintTable(const std::vector<Row>& rows) {
  std::printf("\n%6s %8s %4s %9s %9s %9s %10s %10s %10s %7s %9s %7s\n", "batch", "context", "N",
              "dense ms", "fast ms", "slow ms", "inline ms", "dense t/s", "SFI t/s", "SFI/d",
              "slow/d", "hidden");
  for (const Row& r : rows) {
    std::printf("%6d %8d %4d %9.3f %9.3f %9.3f %10.3f %10.0f %10.0f %7.2f %9.3f %7.2f\n",
                r.point.batch, r.point.context, r.slow_every, r.dense_ms, r.fast_ms, r.slow_ms,
                r.slow_inline_ms, r.dense_tok_s, r.sfi_tok_s, r.SfiOverDense(), r.SlowOverDense(),
                r.Hidden());
  }
}

}  // namespace
}  // namespace rubato

int main(int argc, char** argv) {
  rubato::Options options;
  CLI::App app{"rubato end-to-end SFI decode benchmark (CUDA model, random weights)"};
  rubato::bench::AddCommonOptions(app, options.common);
  app.add_option("--points", options.points, "BATCHxCONTEXT list, e.g. 8x12288,16x32768");
  app.add_option("--slow-every", options.slow_every,
                 "schedules: a slow step every N steps (1 slow, N - 1 fast), comma-separated; "
                 "'tmax' = t_max + 1 (no trigger tokens)");
  app.add_option("--dense-steps", options.dense_steps, "timed dense steps per point");
  app.add_option("--dense-warmup", options.dense_warmup, "untimed dense steps per point (>= 2)");
  app.add_option("--cycles", options.cycles, "timed SFI cycles per schedule");
  app.add_option("--warmup-cycles", options.warmup_cycles, "untimed SFI cycles (>= 2)");
  app.add_option("--sink", options.sink, "SFI sink tokens");
  app.add_option("--recent", options.recent, "SFI recent window");
  app.add_option("--budget", options.budget, "SFI selected positions per KV head (K)");
  app.add_option("--t-max", options.t_max, "SFI t_max (the 'tmax' schedule is t_max + 1)");
  app.add_option("--gamma", options.gamma,
                 "SFI key-norm prior exponent (> 0 adds the key norms of J to each slow step)");
  return rubato::bench::BenchMain("rubato_bench_decode_e2e_sfi", app, options.common, argc, argv,
                                  [&](nlohmann::json& report) {
                                    std::vector<rubato::Row> rows;
                                    RUBATO_RETURN_IF_ERROR(rubato::Run(options, report, rows));
                                    rubato::PrintTable(rows);
                                    return rubato::Status::Ok();
                                  });
}
