// rubato_bench_longflow_nll: the quality of long outputs under LongFlow. Teacher-forced decoding
// of held-out text (a prompt, then every continuation token fed back whatever the model
// predicted) on the CPU model: per position, the next-token negative log-likelihood and the greedy
// argmax, dense attention against LongFlow's evicting KV at several budgets. Reports the mean NLL
// increase and how often LongFlow's argmax equals dense's. A benchmark, not a test.
// docs/benchmarks.md "LongFlow long-output quality".
#include <CLI/CLI.hpp>
#include <algorithm>
#include <cmath>
#include <cstdio>
#include <fstream>
#include <memory>
#include <nlohmann/json.hpp>
#include <sstream>
#include <string>
#include <vector>

#include "common/status.h"
#include "common/tokenizer/tokenizer.h"
#include "inference_rank/model/cpu_model.h"
#include "inference_rank/policies/longflow/longflow_policy.h"
#include "kernels/cpu/sampling.h"

namespace rubato {
namespace {

struct Options {
  std::string model = "models/qwen3-yardstick-16k";
  std::string text = "bench/accuracy/data/filler.txt";
  int prompt_tokens = 512;
  int continue_tokens = 4096;
  int samples = 4;
  std::vector<int> budgets = {512, 1024, 2048};
  int threads = 0;
  int block_size = 16;
  std::string out;
};

// One teacher-forced run: per continuation position, the NLL of the true next token and the
// argmax. Tokens [0, prompt) are the prompt; position t >= prompt - 1 predicts token t + 1.
struct Trace {
  std::vector<double> nll;
  std::vector<int> argmax;
};

double NextTokenNll(std::span<const float> logits, int token) {
  double max = -INFINITY;
  for (float x : logits) max = std::max(max, static_cast<double>(x));
  double sum = 0;
  for (float x : logits) sum += std::exp(static_cast<double>(x) - max);
  return std::log(sum) + max - logits[static_cast<size_t>(token)];
}

Result<Trace> Run(CpuModel& model, const std::vector<int>& tokens, int prompt,
                  LongFlowPolicy* policy, int block_size) {
  const int total = static_cast<int>(tokens.size());
  RUBATO_ASSIGN_OR_RETURN(std::unique_ptr<PagedKvCache> cache,
                          model.CreateKvCache(block_size, (total + block_size - 1) / block_size));
  std::unique_ptr<SlotKvPool> pool;
  std::unique_ptr<PolicyRequest> request;
  SlotKvForward evicting;
  if (policy != nullptr) {
    RUBATO_ASSIGN_OR_RETURN(std::unique_ptr<AttentionBackend> backend,
                            policy->MakeBackend(model, 1));
    RUBATO_RETURN_IF_ERROR(model.SetAttentionBackend(std::move(backend)));
    RUBATO_ASSIGN_OR_RETURN(pool, model.CreateSlotKvPool(policy->config().budget, 1));
    evicting.pool = pool.get();
    RUBATO_RETURN_IF_ERROR(pool->Reserve(evicting.arrays));
    request = policy->Admit(KvResidency::kEvicting);
  } else {
    RUBATO_RETURN_IF_ERROR(model.SetAttentionBackend(nullptr));
  }
  KvSequence sequence;
  ForwardResult result;
  Trace trace;
  for (int start = 0; start < total - 1;) {
    ForwardEntry entry;
    entry.sequence = &sequence;
    entry.start_position = start;
    const bool prefill = start == 0;
    const int count = prefill ? prompt : 1;
    entry.tokens = std::span<const int>(tokens).subspan(static_cast<size_t>(start), count);
    entry.logits = LogitsWanted::kLast;
    if (request != nullptr) {
      entry.attention =
          prefill ? request->PlanPrefill(0, prompt, true) : request->PlanDecode(start);
      entry.slots = &evicting;
    }
    RUBATO_RETURN_IF_ERROR(model.Forward(std::span<const ForwardEntry>(&entry, 1), *cache, result));
    start += count;
    if (request != nullptr && prefill) {  // as the engine does: the prompt is in the slots now
      RUBATO_RETURN_IF_ERROR(cache->Release(sequence));
      sequence.num_tokens = prompt;
    }
    const std::span<const float> logits = result.LastLogits(0);
    const int next = tokens[static_cast<size_t>(start)];
    trace.nll.push_back(NextTokenNll(logits, next));
    trace.argmax.push_back(ArgMax(logits));
    if (request != nullptr) request->Observe(!prefill, next, -1.f);
  }
  return trace;
}

// `samples` windows of prompt + continuation tokens at evenly spaced offsets of the text.
Result<std::vector<std::vector<int>>> Windows(const Options& o, const Tokenizer& tokenizer) {
  std::ifstream file(o.text);
  if (!file) return NotFoundError("cannot read the text '" + o.text + "'");
  std::stringstream contents;
  contents << file.rdbuf();
  const std::vector<int> all = tokenizer.Encode(contents.str());
  const size_t window = static_cast<size_t>(o.prompt_tokens) + o.continue_tokens;
  if (all.size() < window * o.samples) {
    return InvalidArgumentError("the text has " + std::to_string(all.size()) + " tokens, " +
                                std::to_string(window * o.samples) + " needed for " +
                                std::to_string(o.samples) + " disjoint windows");
  }
  std::vector<std::vector<int>> windows;
  const size_t stride = all.size() / o.samples;
  for (int s = 0; s < o.samples; ++s) {
    const auto begin = all.begin() + static_cast<std::ptrdiff_t>(s * stride);
    windows.emplace_back(begin, begin + static_cast<std::ptrdiff_t>(window));
  }
  return windows;
}

Status Main(const Options& o, nlohmann::json& report) {
  ModelLoadOptions load;
  load.num_threads = o.threads;
  RUBATO_ASSIGN_OR_RETURN(std::unique_ptr<CpuModel> model, CpuModel::Load(o.model, load));
  RUBATO_ASSIGN_OR_RETURN(std::unique_ptr<Tokenizer> tokenizer,
                          Tokenizer::LoadFromDirectory(o.model));
  if (o.prompt_tokens + o.continue_tokens > model->config().max_position_embeddings) {
    return InvalidArgumentError("prompt + continuation exceed the model's context");
  }
  RUBATO_ASSIGN_OR_RETURN(const auto windows, Windows(o, *tokenizer));
  std::vector<Trace> dense;
  for (const auto& tokens : windows) {
    RUBATO_ASSIGN_OR_RETURN(Trace trace,
                            Run(*model, tokens, o.prompt_tokens, nullptr, o.block_size));
    dense.push_back(std::move(trace));
  }
  double dense_sum = 0;
  size_t positions = 0;
  for (const Trace& t : dense) {
    for (double x : t.nll) dense_sum += x;
    positions += t.nll.size();
  }
  const double dense_mean = dense_sum / positions;
  std::printf("dense: mean NLL %.4f over %zu positions (%zu windows)\n", dense_mean, positions,
              windows.size());
  report["dense_mean_nll"] = dense_mean;
  report["positions"] = positions;
  for (int budget : o.budgets) {
    LongFlowConfig config;
    config.budget = budget;
    LongFlowPolicy policy(config);
    double sum = 0;
    size_t agree = 0;
    for (size_t w = 0; w < windows.size(); ++w) {
      RUBATO_ASSIGN_OR_RETURN(Trace trace,
                              Run(*model, windows[w], o.prompt_tokens, &policy, o.block_size));
      for (size_t i = 0; i < trace.nll.size(); ++i) {
        sum += trace.nll[i];
        agree += trace.argmax[i] == dense[w].argmax[i] ? 1 : 0;
      }
    }
    const double mean = sum / positions;
    const double agreement = static_cast<double>(agree) / positions;
    std::printf(
        "longflow B %d: mean NLL %.4f (+%.4f over dense), argmax equal to dense's %.4f; "
        "%s\n",
        budget, mean, mean - dense_mean, agreement, policy.StatsLine().c_str());
    report["budgets"].push_back({{"budget", budget},
                                 {"mean_nll", mean},
                                 {"nll_increase", mean - dense_mean},
                                 {"argmax_agreement", agreement},
                                 {"stats", policy.StatsLine()}});
  }
  return Status::Ok();
}

}  // namespace
}  // namespace rubato

int main(int argc, char** argv) {
  rubato::Options o;
  CLI::App app{"Teacher-forced long-output NLL: LongFlow against dense (CPU)"};
  app.add_option("--model", o.model);
  app.add_option("--text", o.text, "held-out text (not in the training corpus)");
  app.add_option("--prompt-tokens", o.prompt_tokens)->check(CLI::PositiveNumber);
  app.add_option("--continue-tokens", o.continue_tokens)->check(CLI::PositiveNumber);
  app.add_option("--samples", o.samples)->check(CLI::PositiveNumber);
  app.add_option("--budgets", o.budgets, "e.g. 512,1024,2048")->delimiter(',');
  app.add_option("--threads", o.threads)->check(CLI::NonNegativeNumber);
  app.add_option("--out", o.out, "JSON results");
  CLI11_PARSE(app, argc, argv);
  std::string command = argv[0];
  for (int i = 1; i < argc; ++i) command += std::string(" ") + argv[i];
  nlohmann::json report = {{"benchmark", "longflow_nll"},
                           {"command", command},
                           {"model", o.model},
                           {"text", o.text},
                           {"prompt_tokens", o.prompt_tokens},
                           {"continue_tokens", o.continue_tokens},
                           {"samples", o.samples},
                           {"engine", "cpu, teacher-forced decode, fp32"},
                           {"budgets", nlohmann::json::array()}};
  const rubato::Status status = rubato::Main(o, report);
  if (!status.ok()) {
    std::fprintf(stderr, "rubato_bench_longflow_nll: error: %s\n", status.ToString().c_str());
    return 1;
  }
  if (!o.out.empty()) {
    std::ofstream file(o.out);
    file << report.dump(1) << "\n";
    if (!file) {
      std::fprintf(stderr, "rubato_bench_longflow_nll: error: cannot write %s\n", o.out.c_str());
      return 1;
    }
  }
  return 0;
}
