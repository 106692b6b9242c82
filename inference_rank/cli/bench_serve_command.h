// `rubato bench serve`: a load client for an OpenAI-compatible server in the manner of
// `vllm bench serve`. Sends --num-prompts streamed completions of --input-len random token ids
// (seeded) asking for --output-len tokens, at --request-rate (Poisson arrivals; inf: all at
// once) and at most --max-concurrency in flight; measures TTFT, TPOT, ITL and end-to-end latency
// per request; prints their mean / p50 / p90 / p99, throughput and errors, with a progress bar
// on stderr; writes the same as JSON to --result-file. Usage: docs/benchmarks.md "Serving".
#pragma once

#include <cstdint>
#include <optional>
#include <string>

#include "common/status.h"

namespace rubato {

struct BenchServeArgs {
  std::string host = "127.0.0.1";
  int port = 8000;
  std::optional<std::string> model;  // default: the first id of GET /v1/models
  int num_prompts = 100;
  double request_rate = 0;  // requests/s; 0: inf (all at once)
  int max_concurrency = 0;  // 0: no limit
  int input_len = 128;      // prompt tokens (random ids)
  int output_len = 128;     // max_tokens of each request
  int vocab_limit = 1000;   // prompt ids are drawn from [1, vocab_limit)
  uint64_t seed = 0;
  std::optional<std::string> result_file;
  bool progress = true;
};

Status RunBenchServe(const BenchServeArgs& args);

}  // namespace rubato
