// The flags of `rubato bench serve` (see bench_serve_command.h): vLLM's names and defaults
// (`vllm bench serve --help`), rubato's earlier names kept as aliases (--input-len,
// --output-len, --result-file, --no-progress), and rubato's deadlines and bounds. Every number
// is parsed here, whole and strictly: a value out of range, NaN, not a number or with trailing
// text is refused with a short message naming the flag (exit 2), never wrapped or saturated.
#include <CLI/CLI.hpp>
#include <cctype>
#include <charconv>
#include <cmath>
#include <cstdint>
#include <limits>
#include <string>
#include <vector>

#include "inference_rank/cli/bench_serve_command.h"

namespace rubato {
namespace {

constexpr double kInf = std::numeric_limits<double>::infinity();

// The argument as an error message shows it: at most 32 bytes and its length.
std::string Shown(const std::string& text) {
  if (text.size() <= 32) return "'" + text + "'";
  return "'" + text.substr(0, 32) + "...' (" + std::to_string(text.size()) + " characters)";
}

int64_t IntFlag(const std::string& flag, const std::string& text, int64_t min, int64_t max) {
  int64_t value = 0;
  const char* end = text.data() + text.size();
  const auto [stop, error] = std::from_chars(text.data(), end, value);
  if (text.empty() || error != std::errc() || stop != end || value < min || value > max) {
    throw CLI::ValidationError(flag, "expected an integer in [" + std::to_string(min) + ", " +
                                         std::to_string(max) + "], got " + Shown(text));
  }
  return value;
}

// A decimal number (or "inf" / "infinity" where allow_inf) in [min, max]; min itself only when
// min_inclusive.
double FloatFlag(const std::string& flag, const std::string& text, double min, bool min_inclusive,
                 double max, bool allow_inf, const std::string& expected) {
  std::string lower;
  for (char c : text) lower += static_cast<char>(std::tolower(static_cast<unsigned char>(c)));
  if (allow_inf && (lower == "inf" || lower == "+inf" || lower == "infinity")) return kInf;
  double value = 0;
  const char* end = text.data() + text.size();
  const auto [stop, error] = std::from_chars(text.data(), end, value, std::chars_format::general);
  const bool in_range =
      std::isfinite(value) && (min_inclusive ? value >= min : value > min) && value <= max;
  if (text.empty() || error != std::errc() || stop != end || !in_range) {
    throw CLI::ValidationError(flag, "expected " + expected + ", got " + Shown(text));
  }
  return value;
}

// Splits "a,b,c" (no empty items).
std::vector<std::string> CommaList(const std::string& flag, const std::string& text) {
  std::vector<std::string> items;
  size_t at = 0;
  while (true) {
    const size_t comma = text.find(',', at);
    items.push_back(text.substr(at, comma == std::string::npos ? std::string::npos : comma - at));
    if (items.back().empty()) {
      throw CLI::ValidationError(flag, "expected a comma-separated list, got " + Shown(text));
    }
    if (comma == std::string::npos) return items;
    at = comma + 1;
  }
}

}  // namespace

CLI::App* AddBenchServeCommand(CLI::App& bench, BenchServeArgs& args) {
  CLI::App* cmd = bench.add_subcommand(
      "serve",
      "Load an OpenAI-compatible server with vllm bench serve's flags: TTFT, TPOT, ITL and "
      "end-to-end latency statistics, throughput and errors");
  cmd->add_option("--backend", args.backend,
                  "openai (/v1/completions, token-id prompts) or openai-chat "
                  "(/v1/chat/completions, word prompts)")
      ->check(CLI::IsMember({"openai", "openai-chat"}));
  cmd->add_option("--base-url", args.base_url,
                  "http://HOST:PORT[/PREFIX] of the server (instead of --host / --port)");
  cmd->add_option("--host", args.host, "Server address");
  cmd->add_option_function<std::string>(
      "--port", [&args](const std::string& v) { args.port = IntFlag("--port", v, 1, 65535); },
      "Server port (default 8000)");
  cmd->add_option("--endpoint", args.endpoint,
                  "API path (default /v1/completions, /v1/chat/completions for openai-chat)");
  cmd->add_option("--model", args.model, "Model name (default: the first of GET /v1/models)");
  cmd->add_option("--label", args.label, "Prefix of the default result file name (--backend)");
  cmd->add_option_function<std::string>(
      "--dataset-name",
      [](const std::string& v) {
        if (v != "random") {
          throw CLI::ValidationError("--dataset-name",
                                     "only 'random' is supported, got " + Shown(v));
        }
      },
      "random (the only one): prompts of random tokens");
  const auto int_option = [cmd](const std::string& flag, int64_t& out, int64_t min, int64_t max,
                                const std::string& help) {
    return cmd->add_option_function<std::string>(
        flag, [flag, &out, min, max](const std::string& v) { out = IntFlag(flag, v, min, max); },
        help);
  };
  int_option("--num-prompts", args.num_prompts, 1, int64_t{1} << 20,
             "Requests to send (default 1000)");
  int_option("--random-input-len,--input-len", args.input_len, 1, int64_t{1} << 20,
             "Prompt tokens per request (default 1024)");
  int_option("--random-output-len,--output-len", args.output_len, 1, int64_t{1} << 24,
             "max_tokens per request (default 128)");
  int_option("--random-prefix-len", args.prefix_len, 0, int64_t{1} << 20,
             "Random tokens every prompt starts with (default 0)");
  int_option("--vocab-limit", args.vocab_limit, 2, int64_t{1} << 30,
             "Prompt token ids are drawn from [1, N) (default 1000)");
  int_option("--max-concurrency", args.max_concurrency, 0, int64_t{1} << 20,
             "Requests in flight at most (default, or 0: no limit)");
  cmd->add_option_function<std::string>(
      "--random-range-ratio",
      [&args](const std::string& v) {
        args.range_ratio = FloatFlag("--random-range-ratio", v, 0, true, std::nextafter(1.0, 0.0),
                                     false, "a number in [0, 1)");
      },
      "Lengths are drawn from [len * (1 - r), len * (1 + r)] (default 0)");
  cmd->add_option_function<std::string>(
      "--request-rate",
      [&args](const std::string& v) {
        args.request_rate =
            FloatFlag("--request-rate", v, 0, true, 1e9, true,
                      "requests per second in [0, 1e9] or inf (0, inf: all at once)");
      },
      "Requests per second, Poisson (or gamma) arrivals; inf (default) or 0: all at once");
  cmd->add_option_function<std::string>(
      "--burstiness",
      [&args](const std::string& v) {
        args.burstiness =
            FloatFlag("--burstiness", v, 0, false, 1e9, true, "a number in (0, 1e9], or inf");
      },
      "Gamma shape of the arrival gaps: 1 (default) Poisson, < 1 burstier, inf evenly spaced");
  cmd->add_option_function<std::string>(
      "--temperature",
      [&args](const std::string& v) {
        args.temperature =
            FloatFlag("--temperature", v, 0, true, 100, false, "a number in [0, 100]");
      },
      "Sampling temperature sent with each request (default: the server's)");
  cmd->add_option_function<std::string>(
      "--seed",
      [&args](const std::string& v) {
        uint64_t value = 0;
        const char* end = v.data() + v.size();
        const auto [stop, error] = std::from_chars(v.data(), end, value);
        if (v.empty() || error != std::errc() || stop != end) {
          throw CLI::ValidationError(
              "--seed", "expected an integer in [0, 18446744073709551615], got " + Shown(v));
        }
        args.seed = value;
      },
      "Seed of the prompts, lengths and arrivals (default 0)");
  cmd->add_flag("--ignore-eos", args.ignore_eos,
                "Send ignore_eos: true (generate max_tokens whatever the model says)");
  cmd->add_flag("--save-result", args.save_result, "Write the result JSON");
  cmd->add_flag("--save-detailed", args.save_detailed,
                "Keep the per-request lists (input_lens, ttfts, itls, generated_texts, errors, "
                "...) in the result JSON");
  cmd->add_option("--result-dir", args.result_dir, "Directory of the result file (created)");
  CLI::Option* filename = cmd->add_option(
      "--result-filename", args.result_filename,
      "Result file name (default {label}-{rate}qps[-concurrency{n}]-{model}-{date}.json)");
  cmd->add_option_function<std::string>(
         "--result-file",
         [&args](const std::string& v) {
           args.result_filename = v;
           args.save_result = true;
         },
         "Same as --save-result --result-filename FILE")
      ->excludes(filename);
  cmd->add_option_function<std::string>(
      "--percentile-metrics",
      [&args](const std::string& v) {
        args.percentile_metrics = CommaList("--percentile-metrics", v);
        for (const std::string& metric : args.percentile_metrics) {
          if (metric != "ttft" && metric != "tpot" && metric != "itl" && metric != "e2el") {
            throw CLI::ValidationError(
                "--percentile-metrics",
                "expected names among ttft, tpot, itl, e2el, got " + Shown(metric));
          }
        }
      },
      "Metrics to report statistics of, of ttft,tpot,itl,e2el (default ttft,tpot,itl)");
  cmd->add_option_function<std::string>(
      "--metric-percentiles",
      [&args](const std::string& v) {
        args.metric_percentiles.clear();
        for (const std::string& item : CommaList("--metric-percentiles", v)) {
          args.metric_percentiles.push_back(FloatFlag("--metric-percentiles", item, 0, true, 100,
                                                      false, "percentiles in [0, 100]"));
        }
      },
      "Percentiles to report, comma-separated (default 99)");
  const auto seconds_option = [cmd](const std::string& flag, double& out, const std::string& help) {
    cmd->add_option_function<std::string>(
        flag,
        [flag, &out](const std::string& v) {
          out = FloatFlag(flag, v, 0, false, 604800, false, "seconds in (0, 604800]");
        },
        help);
  };
  seconds_option("--request-timeout", args.request_timeout_s,
                 "Seconds one request may take, connect to last byte (default 600)");
  seconds_option("--run-timeout", args.run_timeout_s,
                 "Seconds the whole run may take; requests still open then fail (default 10800)");
  cmd->add_option_function<std::string>(
      "--max-reply-bytes",
      [&args](const std::string& v) {
        args.max_reply_bytes =
            static_cast<uint64_t>(IntFlag("--max-reply-bytes", v, 1024, int64_t{1} << 40));
      },
      "A reply body longer than this fails its request (default 67108864)");
  cmd->add_flag("!--no-progress,!--disable-tqdm", args.progress, "No progress bar on stderr");
  return cmd;
}

}  // namespace rubato
