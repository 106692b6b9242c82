// `rubato bench serve`: a load client for an OpenAI-compatible server that takes the flags of
// `vllm bench serve` (--backend openai | openai-chat, --dataset-name random, --random-input-len,
// --request-rate with Poisson / gamma arrivals, --max-concurrency, --save-result, ...) and writes
// its flat result JSON (median_ttft_ms, p99_tpot_ms, ...). Numeric flags are parsed strictly
// (a value out of range, NaN or not a number is refused naming the flag). The requests run
// under deadlines with bounded buffers (bench_serve_load.h). Usage: docs/benchmarks.md
// "Serving".
#pragma once

#include <cstdint>
#include <optional>
#include <string>
#include <vector>

#include "common/status.h"

namespace CLI {
class App;
}

namespace rubato {

struct BenchServeArgs {
  std::string backend = "openai";       // openai (/v1/completions) | openai-chat
  std::optional<std::string> base_url;  // http://host:port[/prefix]; else --host / --port
  std::string host = "127.0.0.1";
  int port = 8000;
  std::optional<std::string> endpoint;  // default: the backend's
  std::optional<std::string> model;     // default: the first id of GET /v1/models
  std::string label;                    // default: the backend
  int64_t num_prompts = 1000;
  int64_t input_len = 1024;     // --random-input-len (--input-len)
  int64_t output_len = 128;     // --random-output-len (--output-len)
  double range_ratio = 0;       // lengths uniform in [len * (1 - r), len * (1 + r)]
  int64_t prefix_len = 0;       // random tokens every prompt starts with
  int64_t vocab_limit = 1000;   // prompt ids are drawn from [1, vocab_limit)
  double request_rate = 0;      // requests/s; 0 or inf: all at once
  double burstiness = 1;        // gamma shape of the gaps; 1: Poisson
  int64_t max_concurrency = 0;  // 0: no limit
  bool ignore_eos = false;
  std::optional<double> temperature;  // sent only when given
  uint64_t seed = 0;
  bool save_result = false;
  bool save_detailed = false;
  std::optional<std::string> result_dir;
  std::optional<std::string> result_filename;
  std::vector<std::string> percentile_metrics = {"ttft", "tpot", "itl"};
  std::vector<double> metric_percentiles = {99};
  double request_timeout_s = 600;
  double run_timeout_s = 10800;
  uint64_t max_reply_bytes = uint64_t{64} << 20;
  bool progress = true;
};

// Adds the `serve` subcommand and its flags to `bench`; values land in `args` as parsed.
CLI::App* AddBenchServeCommand(CLI::App& bench, BenchServeArgs& args);

Status RunBenchServe(const BenchServeArgs& args);

}  // namespace rubato
