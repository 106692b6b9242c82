// The result JSON, report and result file of `rubato bench serve` (see bench_serve_result.h).
// The statistics are numpy's (mean, median, population std, interpolated percentiles) over the
// successful requests, as vLLM's calculate_metrics computes them.
#include "inference_rank/cli/bench_serve_result.h"

#include <algorithm>
#include <cerrno>
#include <charconv>
#include <cmath>
#include <cstdio>
#include <cstring>
#include <limits>

namespace rubato::bench {
namespace {

using nlohmann::json;

struct Stats {
  double mean = 0, median = 0, std = 0;
};

Stats StatsOf(const std::vector<double>& values) {
  Stats stats;
  if (values.empty()) return stats;
  double sum = 0;
  for (double v : values) sum += v;
  stats.mean = sum / static_cast<double>(values.size());
  double squares = 0;
  for (double v : values) squares += (v - stats.mean) * (v - stats.mean);
  stats.std = std::sqrt(squares / static_cast<double>(values.size()));
  stats.median = Percentile(values, 50);
  return stats;
}

// "99", "99.9": Python's str(int(p)) when p is whole, else str(p).
std::string PercentileWord(double p) {
  if (p == std::floor(p)) return std::to_string(static_cast<int>(p));
  char text[32];
  const auto end = std::to_chars(text, text + sizeof(text), p).ptr;
  return std::string(text, end);
}

const char* MetricName(const std::string& metric) {
  if (metric == "ttft") return "TTFT";
  if (metric == "tpot") return "TPOT";
  if (metric == "itl") return "ITL";
  return "E2EL";
}

const char* MetricHeader(const std::string& metric) {
  if (metric == "ttft") return "Time to First Token";
  if (metric == "tpot") return "Time per Output Token (excl. 1st token)";
  if (metric == "itl") return "Inter-token Latency";
  return "End-to-end Latency";
}

// " title " centred in 50 columns of `fill`, as Python's "{s:{c}^{n}}".
std::string Banner(const std::string& title, char fill) {
  const size_t width = 50;
  if (title.size() >= width) return title;
  const size_t left = (width - title.size()) / 2;
  return std::string(left, fill) + title + std::string(width - title.size() - left, fill);
}

// Peak output tokens in one second and peak requests in flight, as vLLM computes them: a
// token's time is its request's start + TTFT + the ITLs before it.
void Peaks(const std::vector<RequestOutcome>& outcomes, double& tokens_per_s, int& concurrency) {
  double first = std::numeric_limits<double>::infinity();
  double last = 0;
  for (const RequestOutcome& o : outcomes) {
    if (!o.success) continue;
    first = std::min(first, o.start_time);
    last = std::max(last, o.start_time + o.latency);
  }
  tokens_per_s = 0;
  concurrency = 0;
  if (first > last) return;
  std::vector<double> buckets(static_cast<size_t>(std::ceil(last - first)) + 1, 0.0);
  std::vector<std::pair<double, int>> events;
  for (const RequestOutcome& o : outcomes) {
    if (!o.success) continue;
    double at = o.start_time + o.ttft;
    for (size_t k = 0;; ++k) {
      const auto bucket = static_cast<size_t>(std::max(0.0, at - first));
      if (bucket < buckets.size()) buckets[bucket] += 1;
      if (k == o.itl.size()) break;
      at += o.itl[k];
    }
    events.emplace_back(o.start_time, 1);
    events.emplace_back(o.start_time + o.latency, -1);
  }
  tokens_per_s = *std::max_element(buckets.begin(), buckets.end());
  std::sort(events.begin(), events.end());  // an end before a start at the same time
  int now = 0;
  for (const auto& [time, delta] : events) concurrency = std::max(concurrency, now += delta);
}

}  // namespace

double Percentile(std::vector<double> values, double p) {
  if (values.empty()) return 0;
  std::sort(values.begin(), values.end());
  const double rank = p / 100.0 * static_cast<double>(values.size() - 1);
  const auto low = static_cast<size_t>(rank);
  const size_t high = std::min(low + 1, values.size() - 1);
  return values[low] + (values[high] - values[low]) * (rank - static_cast<double>(low));
}

json BenchmarkJson(const LoadResult& load, const MetricSelection& selection) {
  std::vector<double> ttfts, tpots, itls, e2els;
  int64_t completed = 0, total_input = 0, total_output = 0;
  json input_lens = json::array(), output_lens = json::array(), ttft_list = json::array(),
       itl_lists = json::array(), latencies = json::array(), start_times = json::array(),
       queue_times = json::array(), texts = json::array(), errors = json::array();
  for (const RequestOutcome& o : load.outcomes) {
    input_lens.push_back(o.prompt_len);
    output_lens.push_back(o.success ? o.output_tokens : 0);
    ttft_list.push_back(o.ttft);
    itl_lists.push_back(o.itl);
    latencies.push_back(o.latency);
    start_times.push_back(o.start_time);
    queue_times.push_back(o.queue_time);
    texts.push_back(o.generated_text);
    errors.push_back(o.error);
    if (!o.success) continue;
    ++completed;
    total_input += o.prompt_len;
    total_output += o.output_tokens;
    if (o.output_tokens > 1) {
      tpots.push_back((o.latency - o.ttft) / static_cast<double>(o.output_tokens - 1));
    }
    itls.insert(itls.end(), o.itl.begin(), o.itl.end());
    ttfts.push_back(o.ttft);
    e2els.push_back(o.latency);
  }
  // A run that ended at once (nothing sent) still divides by a positive duration.
  const double duration = std::max(load.duration_s, 1e-9);
  double peak_tokens = 0;
  int peak_concurrency = 0;
  Peaks(load.outcomes, peak_tokens, peak_concurrency);
  json result = {
      {"duration", load.duration_s},
      {"completed", completed},
      {"failed", static_cast<int64_t>(load.outcomes.size()) - completed},
      {"total_input_tokens", total_input},
      {"total_output_tokens", total_output},
      {"request_throughput", static_cast<double>(completed) / duration},
      {"request_goodput", nullptr},
      {"output_throughput", static_cast<double>(total_output) / duration},
      {"total_token_throughput", static_cast<double>(total_input + total_output) / duration},
      {"input_lens", std::move(input_lens)},
      {"output_lens", std::move(output_lens)},
      {"ttfts", std::move(ttft_list)},
      {"itls", std::move(itl_lists)},
      {"latencies", std::move(latencies)},
      {"start_times", std::move(start_times)},
      {"queue_times", std::move(queue_times)},
      {"generated_texts", std::move(texts)},
      {"errors", std::move(errors)},
      {"max_output_tokens_per_s", peak_tokens},
      {"max_concurrent_requests", peak_concurrency}};
  for (const std::string& metric : selection.metrics) {
    const std::vector<double>& values = metric == "ttft"   ? ttfts
                                        : metric == "tpot" ? tpots
                                        : metric == "itl"  ? itls
                                                           : e2els;
    const Stats stats = StatsOf(values);
    result["mean_" + metric + "_ms"] = stats.mean * 1e3;
    result["median_" + metric + "_ms"] = stats.median * 1e3;
    result["std_" + metric + "_ms"] = stats.std * 1e3;
    for (double p : selection.percentiles) {
      result["p" + PercentileWord(p) + "_" + metric + "_ms"] = Percentile(values, p) * 1e3;
    }
  }
  return result;
}

std::string ReportText(const json& result, const MetricSelection& selection, int max_concurrency,
                       double request_rate) {
  std::string text;
  char line[256];
  const auto add_int = [&](const char* label, int64_t value) {
    std::snprintf(line, sizeof(line), "%-40s %-10lld\n", label, static_cast<long long>(value));
    text += line;
  };
  const auto add_float = [&](const std::string& label, double value) {
    std::snprintf(line, sizeof(line), "%-40s %-10.2f\n", label.c_str(), value);
    text += line;
  };
  text += Banner(" Serving Benchmark Result ", '=') + "\n";
  add_int("Successful requests:", result["completed"].get<int64_t>());
  add_int("Failed requests:", result["failed"].get<int64_t>());
  if (max_concurrency > 0) add_int("Maximum request concurrency:", max_concurrency);
  if (!std::isinf(request_rate)) add_float("Request rate configured (RPS):", request_rate);
  add_float("Benchmark duration (s):", result["duration"].get<double>());
  add_int("Total input tokens:", result["total_input_tokens"].get<int64_t>());
  add_int("Total generated tokens:", result["total_output_tokens"].get<int64_t>());
  add_float("Request throughput (req/s):", result["request_throughput"].get<double>());
  add_float("Output token throughput (tok/s):", result["output_throughput"].get<double>());
  add_float("Peak output token throughput (tok/s):",
            result["max_output_tokens_per_s"].get<double>());
  add_float("Peak concurrent requests:", result["max_concurrent_requests"].get<double>());
  add_float("Total token throughput (tok/s):", result["total_token_throughput"].get<double>());
  for (const std::string& metric : selection.metrics) {
    const std::string name = MetricName(metric);
    text += Banner(MetricHeader(metric), '-') + "\n";
    add_float("Mean " + name + " (ms):", result["mean_" + metric + "_ms"].get<double>());
    add_float("Median " + name + " (ms):", result["median_" + metric + "_ms"].get<double>());
    for (double p : selection.percentiles) {
      const std::string word = PercentileWord(p);
      add_float("P" + word + " " + name + " (ms):",
                result["p" + word + "_" + metric + "_ms"].get<double>());
    }
  }
  text += std::string(50, '=') + "\n";
  return text;
}

std::string PythonFloatText(double value) {
  if (std::isinf(value)) return "inf";
  char text[64];
  const auto end = std::to_chars(text, text + sizeof(text), value).ptr;
  std::string out(text, end);
  if (out.find_first_of(".e") == std::string::npos) out += ".0";
  return out;
}

std::string DefaultResultFilename(const std::string& label, double request_rate,
                                  int max_concurrency, const std::string& model,
                                  const std::string& date) {
  const size_t slash = model.rfind('/');
  const std::string base_model = slash == std::string::npos ? model : model.substr(slash + 1);
  return label + "-" + PythonFloatText(request_rate) + "qps" +
         (max_concurrency > 0 ? "-concurrency" + std::to_string(max_concurrency) : "") + "-" +
         base_model + "-" + date + ".json";
}

Status WriteResultFile(const std::string& path, const json& result) {
  const std::string text = result.dump(-1, ' ', false, json::error_handler_t::replace);
  std::FILE* file = std::fopen(path.c_str(), "w");
  if (file == nullptr) {
    return IoError("bench serve: cannot write the result file " + path + ": " +
                   std::strerror(errno));
  }
  const bool written = std::fwrite(text.data(), 1, text.size(), file) == text.size();
  const int flush_errno = std::fflush(file) == 0 ? 0 : errno;
  const bool closed = std::fclose(file) == 0;
  if (!written || flush_errno != 0 || !closed) {
    return IoError("bench serve: cannot write the result file " + path + ": " +
                   std::strerror(flush_errno != 0 ? flush_errno : EIO));
  }
  return Status::Ok();
}

}  // namespace rubato::bench
