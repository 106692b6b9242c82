// The `rubato` command: subcommands generate, serve (OpenAI-compatible HTTP API), cache (a cache
// rank) and tokenize; `rubato SUBCOMMAND --help` lists the flags. Every error ends the process
// with one line on stderr ("rubato: error: ...") and exit 1; command-line syntax errors exit 2.
// Synopsis: docs/engine_and_models.md "The command line".
#include <CLI/CLI.hpp>
#include <charconv>
#include <cstdint>
#include <cstdio>
#include <exception>
#include <string>

#include "inference_rank/cli/bench_serve_command.h"
#include "inference_rank/cli/cache_command.h"
#include "inference_rank/cli/generate_command.h"
#include "inference_rank/cli/serve_command.h"
#include "inference_rank/cli/tokenize_command.h"
#include "inference_rank/policies/kascade/kascade_calibrator.h"
#include "inference_rank/policies/synckv/synckv_calibrator.h"

namespace {

int PrintError(const std::string& message, int exit_code) {
  std::fprintf(stderr, "rubato: error: %s\n", message.c_str());
  return exit_code;
}

// A decimal integer in [0, 2^64 - 1], the whole argument (CLI11 alone wraps -1 and saturates
// 2^64, so that every such seed gave the same stream).
const CLI::Validator kUint64(
    [](std::string& text) -> std::string {
      uint64_t value = 0;
      const char* end = text.data() + text.size();
      const auto [stop, error] = std::from_chars(text.data(), end, value);
      if (text.empty() || error != std::errc() || stop != end) {
        return "expected an integer in [0, 18446744073709551615], got '" +
               (text.size() > 32 ? text.substr(0, 32) + "...'" : text + "'");
      }
      return "";
    },
    "UINT64");

}  // namespace

int main(int argc, char** argv) {
  CLI::App app{"rubato: long-context LLM decoding runtime"};
  app.set_version_flag("--version", "rubato 0.1.0");
  app.require_subcommand(1);

  rubato::GenerateArgs gen;
  CLI::App* generate = app.add_subcommand("generate", "Generate text from a prompt");
  generate->add_option("--model", gen.model_dir,
                       "Hugging Face model directory (overrides "
                       "model.path of the config)");
  CLI::Option* prompt = generate->add_option("--prompt", gen.prompt, "Prompt text");
  CLI::Option* prompt_ids = generate->add_option(
      "--prompt-ids", gen.prompt_ids, "Prompt as comma-separated token ids (no tokenizer needed)");
  prompt->excludes(prompt_ids);
  generate->add_option("--backend", gen.backend, "Compute backend (overrides engine.backend)")
      ->check(CLI::IsMember({"cpu", "cuda"}));
  generate->add_flag("--random-weights", gen.random_weights,
                     "Random weights from the model's config.json alone (sets "
                     "model.random_weights; for benchmarks at real shapes)");
  generate->add_flag("--chat", gen.chat,
                     "Wrap the prompt as a user turn in the model's chat "
                     "template (ChatML or Llama-3)");
  generate->add_option("--max-tokens", gen.max_tokens, "Tokens to generate at most")
      ->check(CLI::Range(1, 1 << 24));
  generate->add_flag("--output-ids", gen.output_ids,
                     "Print the generated token ids (\"12 7 93 \") instead of their text");
  generate->add_option("--temperature", gen.temperature, "Sampling temperature; 0 = greedy")
      ->check(CLI::Range(0.0f, 100.0f));
  generate->add_option("--top-p", gen.top_p, "Nucleus sampling mass in (0, 1]")
      ->check(CLI::Range(1e-6f, 1.0f));
  generate->add_option("--top-k", gen.top_k, "Sample among the k most likely tokens; 0 = off")
      ->check(CLI::Range(0, 1 << 30));
  generate->add_option("--seed", gen.seed, "Sampling seed (same seed, same text)")->check(kUint64);
  generate->add_option("--policy", gen.policy, "Attention policy (overrides policy.name)");
  generate->add_option("--kv-residency", gen.kv_residency,
                       "Where the KV lives: local | offloaded (a cache rank) | evicting (a "
                       "fixed budget, --policy longflow) | split_by_head (--policy synckv) | "
                       "placed (each request local or on a cache rank by free memory); "
                       "overrides engine.kv_residency");
  generate->add_option("--config", gen.config_file, "YAML config file");
  generate->add_option("--threads", gen.threads, "CPU threads (overrides engine.threads)")
      ->check(CLI::Range(0, 1024));

  generate->add_option("--cache", gen.cache_endpoint,
                       "host:port of a cache rank (rubato cache --listen) for offloaded KV; "
                       "several, comma-separated: requests placed by free budget");

  rubato::ServeArgs serve_args;
  CLI::App* serve = app.add_subcommand(
      "serve",
      "Serve the OpenAI-compatible HTTP API (/v1/completions, /v1/chat/completions, "
      "/v1/models, /health, /metrics) until SIGINT or SIGTERM");
  serve->add_option("--config", serve_args.overrides.config_file, "YAML config file");
  serve->add_option("--model", serve_args.overrides.model_dir,
                    "Hugging Face model directory (overrides model.path)");
  serve->add_option("--policy", serve_args.overrides.policy,
                    "Attention policy (overrides policy.name)");
  serve->add_option("--kv-residency", serve_args.overrides.kv_residency,
                    "Where requests' KV lives: local | offloaded | evicting | placed "
                    "(overrides engine.kv_residency)");
  serve->add_option("--host", serve_args.host, "Address to listen on (overrides server.host)");
  serve
      ->add_option("--port", serve_args.port,
                   "TCP port (overrides server.port; 0: any free port, printed at start)")
      ->check(CLI::Range(0, 65535));
  serve
      ->add_option("--shutdown-grace-s", serve_args.shutdown_grace_s,
                   "Seconds requests in flight get to finish after SIGTERM / SIGINT (overrides "
                   "server.shutdown_grace_s)")
      ->check(CLI::Range(0.0, 86400.0));
  serve
      ->add_option("--metrics-names", serve_args.metrics_names,
                   "Names of the serving metrics: rubato | vllm (vLLM's, for its dashboards) | "
                   "both (overrides server.metrics_names)")
      ->check(CLI::IsMember({"rubato", "vllm", "both"}));
  serve->add_option("--api-key", serve_args.api_key,
                    "Require 'Authorization: Bearer KEY' on /v1/* (overrides server.api_key and "
                    "RUBATO_API_KEY)");
  serve->add_option("--cache", serve_args.overrides.cache_endpoint,
                    "host:port of a cache rank (rubato cache --listen) for offloaded KV; "
                    "several, comma-separated: requests placed by free budget");
  serve
      ->add_option("--threads", serve_args.overrides.threads,
                   "CPU threads (overrides engine.threads)")
      ->check(CLI::Range(0, 1024));
  serve
      ->add_option("--backend", serve_args.overrides.backend,
                   "Compute backend (overrides engine.backend)")
      ->check(CLI::IsMember({"cpu", "cuda"}));
  serve->add_flag("--check", serve_args.check,
                  "Check the config, the flags and the model's config.json as serving would, "
                  "print one line and exit (no weights loaded, no cache rank contacted)");

  rubato::CacheArgs cache_args;
  CLI::App* cache =
      app.add_subcommand("cache",
                         "Run a cache rank: offloaded KV, token selection and compact buffers for "
                         "inference ranks that connect to it");
  cache->add_option("--listen", cache_args.listen, "host:port of its RPC server (port 0: any)");
  cache
      ->add_option("--budget-mb", cache_args.budget_mb,
                   "KV storage for all sessions, MiB (overrides cache.budget_gib)")
      ->check(CLI::Range(int64_t{1}, int64_t{1} << 30));
  cache
      ->add_option("--peer-budget-mb", cache_args.peer_budget_mb,
                   "What one inference rank's sessions may reserve, MiB (0: --budget-mb)")
      ->check(CLI::Range(int64_t{0}, int64_t{1} << 30));
  cache
      ->add_option("--max-sessions-per-peer", cache_args.max_sessions_per_peer,
                   "Sessions one inference rank may hold open")
      ->check(CLI::Range(1, 1 << 30));
  cache
      ->add_option("--memory", cache_args.memory,
                   "Where the KV lives: pageable (or host), pinned (page-locked, CUDA builds) or "
                   "device (overrides cache.memory)")
      ->check(CLI::IsMember({"host", "pageable", "pinned", "device"}));
  cache->add_option("--config", cache_args.config_file,
                    "YAML config (its cache section, limits, logging)");
  cache->add_option("--metrics", cache_args.metrics_listen,
                    "host:port of an HTTP endpoint for GET /metrics and /health (port 0: any)");
  cache
      ->add_option("--device", cache_args.device,
                   "GPU of this rank's side of NCCL data planes (inference ranks with "
                   "topology.transport nccl; another GPU than theirs) and of pinned memory "
                   "(overrides cache.device)")
      ->check(CLI::NonNegativeNumber);

  rubato::BenchServeArgs bench_serve_args;
  CLI::App* bench = app.add_subcommand("bench", "Benchmarks against a running server");
  bench->require_subcommand(1);
  CLI::App* bench_serve = rubato::AddBenchServeCommand(*bench, bench_serve_args);

  rubato::TokenizeArgs tok;
  CLI::App* tokenize = app.add_subcommand(
      "tokenize", "Token ids (or counts) of JSON strings read from stdin, one per line");
  tokenize->add_option("--model", tok.model_dir, "Hugging Face model directory")->required();
  tokenize->add_flag("--count", tok.count_only, "Print the number of tokens, not the ids");
  tokenize->add_flag("--add-special-tokens", tok.add_special_tokens,
                     "Run the post-processor (adds BOS where the model has one)");

  rubato::KascadeCalibrateOptions kascade;
  CLI::App* calibrate = app.add_subcommand(
      "calibrate", "Offline calibration of a policy from a development set (kascade, synckv)");
  calibrate->require_subcommand(1);
  CLI::App* calibrate_kascade = calibrate->add_subcommand(
      "kascade", "Kascade's anchor layers and head map (docs/kascade.md), dense CPU prefill");
  calibrate_kascade->add_option("--model", kascade.model_dir, "Hugging Face model directory")
      ->required();
  calibrate_kascade
      ->add_option("--dev-set", kascade.dev_set,
                   "Development prompts: JSON lines {\"prompt\": ...}")
      ->required();
  calibrate_kascade->add_option("--anchors", kascade.anchors, "Anchor layers, layer 0 included")
      ->check(CLI::Range(1, 4096));
  calibrate_kascade->add_option("--top-k", kascade.top_k, "k of the similarity (Eq. 3)")
      ->check(CLI::Range(1, 1 << 20));
  calibrate_kascade
      ->add_option("--max-tokens", kascade.max_prompt_tokens,
                   "Longer prompts keep their last tokens")
      ->check(CLI::Range(2, 1 << 24));
  calibrate_kascade->add_option("--threads", kascade.threads, "CPU threads, 0 = all cores")
      ->check(CLI::Range(0, 1024));
  calibrate_kascade->add_option("--out", kascade.out, "The calibration file (JSON)")->required();

  rubato::SyncKvCalibrateOptions synckv;
  CLI::App* calibrate_synckv = calibrate->add_subcommand(
      "synckv", "SyncKV's head clusters and R-heads (docs/synckv.md), dense CPU prefill");
  calibrate_synckv->add_option("--model", synckv.model_dir, "Hugging Face model directory")
      ->required();
  calibrate_synckv
      ->add_option("--dev-set", synckv.dev_set, "Development prompts: JSON lines {\"prompt\": ...}")
      ->required();
  calibrate_synckv->add_option("--clusters", synckv.clusters, "N_r, clusters per layer")
      ->check(CLI::Range(1, 4096));
  calibrate_synckv->add_option("--top-k", synckv.top_k, "k of the overlap (Eq. 2)")
      ->check(CLI::Range(1, 1 << 20));
  calibrate_synckv
      ->add_option("--decode-steps", synckv.decode_steps,
                   "Query positions per prompt observed as decode steps (its last ones)")
      ->check(CLI::Range(1, 1 << 24));
  calibrate_synckv
      ->add_option("--max-tokens", synckv.max_prompt_tokens,
                   "Longer prompts keep their last tokens")
      ->check(CLI::Range(2, 1 << 24));
  calibrate_synckv->add_option("--threads", synckv.threads, "CPU threads, 0 = all cores")
      ->check(CLI::Range(0, 1024));
  calibrate_synckv->add_option("--out", synckv.out, "The calibration file (JSON)")->required();

  try {
    app.parse(argc, argv);
  } catch (const CLI::CallForHelp& e) {
    return app.exit(e);
  } catch (const CLI::CallForAllHelp& e) {
    return app.exit(e);
  } catch (const CLI::CallForVersion& e) {
    return app.exit(e);
  } catch (const CLI::ParseError& e) {
    return PrintError(e.what(), 2);
  }
  if (*generate && !gen.prompt && !gen.prompt_ids) {
    return PrintError("generate: --prompt or --prompt-ids is required", 2);
  }

  try {
    if (*generate) {
      const rubato::Status status = rubato::RunGenerate(gen);
      if (!status.ok()) return PrintError(status.message(), 1);
    }
    if (*serve) {
      const rubato::Status status = rubato::RunServe(serve_args);
      if (!status.ok()) return PrintError(status.message(), 1);
    }
    if (*cache) {
      const rubato::Status status = rubato::RunCache(cache_args);
      if (!status.ok()) return PrintError(status.message(), 1);
    }
    if (*calibrate_kascade) {
      const auto calibration = rubato::CalibrateKascade(kascade);
      if (!calibration.ok()) return PrintError(calibration.status().message(), 1);
      std::printf("kascade calibration: anchors");
      for (int layer : calibration->anchors) std::printf(" %d", layer);
      std::printf(" of %d layers; wrote %s\n", calibration->num_layers, kascade.out.c_str());
    }
    if (*calibrate_synckv) {
      const auto calibration = rubato::CalibrateSyncKv(synckv);
      if (!calibration.ok()) return PrintError(calibration.status().message(), 1);
      std::printf("synckv calibration: R-heads per layer");
      for (const rubato::HeadClusters& layer : calibration->layers) {
        std::printf(" [");
        for (size_t g = 0; g < layer.representative.size(); ++g) {
          std::printf("%s%d", g == 0 ? "" : " ", layer.representative[g]);
        }
        std::printf("]");
      }
      std::printf(" of %d KV heads; wrote %s\n", calibration->num_kv_heads, synckv.out.c_str());
    }
    if (*bench_serve) {
      const rubato::Status status = rubato::RunBenchServe(bench_serve_args);
      if (!status.ok()) return PrintError(status.message(), 1);
    }
    if (*tokenize) {
      const rubato::Status status = rubato::RunTokenize(tok, stdin, stdout);
      if (!status.ok()) return PrintError(status.message(), 1);
    }
  } catch (const std::exception& e) {
    // Library code reports errors as values; an exception here is a bug, still reported as
    // one line rather than a crash.
    return PrintError(std::string("internal error: ") + e.what(), 1);
  }
  return 0;
}
