// The results of `rubato bench serve` as `vllm bench serve` gives them: the printed report and
// the flat result JSON (duration, completed, failed, total_input_tokens, ..., mean_ttft_ms,
// median_ttft_ms, std_ttft_ms, p99_ttft_ms, ... for the --percentile-metrics and
// --metric-percentiles chosen), and the writing of the result file.
#pragma once

#include <nlohmann/json.hpp>
#include <string>
#include <vector>

#include "common/status.h"
#include "inference_rank/cli/bench_serve_load.h"

namespace rubato::bench {

struct MetricSelection {
  std::vector<std::string> metrics;  // of ttft, tpot, itl, e2el
  std::vector<double> percentiles;   // in [0, 100]
};

// numpy's percentile (linear interpolation between closest ranks); 0 for no values.
double Percentile(std::vector<double> values, double p);

// The benchmark part of vLLM's result: totals, throughputs, per-request lists (input_lens,
// output_lens, ttfts, itls, latencies, start_times, queue_times, generated_texts, errors),
// peak output tokens per second and concurrency, and the selected statistics in ms.
nlohmann::json BenchmarkJson(const LoadResult& load, const MetricSelection& selection);

// The report vLLM prints, from that JSON.
std::string ReportText(const nlohmann::json& result, const MetricSelection& selection,
                       int max_concurrency, double request_rate);

// vLLM's default result file name: {label}-{rate}qps[-concurrency{n}]-{model's last path
// part}-{YYYYmmdd-HHMMSS}.json.
std::string DefaultResultFilename(const std::string& label, double request_rate,
                                  int max_concurrency, const std::string& model,
                                  const std::string& date);

// "inf" or Python's str() of a float (10.0, 0.5).
std::string PythonFloatText(double value);

// Writes `result` to `path` (UTF-8 errors replaced), an error naming the path when any byte
// could not be written.
Status WriteResultFile(const std::string& path, const nlohmann::json& result);

}  // namespace rubato::bench
