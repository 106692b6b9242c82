// `rubato serve`: load a model like `rubato generate` (config, policy, backend, offload cache
// rank) and serve the OpenAI-compatible HTTP API (inference_rank/server/) until SIGINT or
// SIGTERM. Prints "rubato serve: listening on http://HOST:PORT" once it accepts requests (port
// 0 picks a free port; the line says which). On a signal it stops accepting, gives requests in
// flight up to server.shutdown_grace_s to finish, ends the rest with an error and returns ok.
#pragma once

#include <optional>
#include <string>

#include "common/status.h"
#include "inference_rank/cli/engine_setup.h"

namespace rubato {

struct ServeArgs {
  ConfigOverrides overrides;          // --config --model --policy --threads --backend --cache
  std::optional<std::string> host;    // overrides server.host
  std::optional<int> port;            // overrides server.port; 0: any free port
  std::optional<double> shutdown_grace_s;  // overrides server.shutdown_grace_s
  std::optional<std::string> metrics_names;  // overrides server.metrics_names
  // Overrides server.api_key, as the environment's RUBATO_API_KEY does (the flag wins).
  std::optional<std::string> api_key;
  // --check: check the config, the flags and the model's config.json as serving would, print
  // one line and return, loading no weights and contacting no cache rank.
  bool check = false;
};

Status RunServe(const ServeArgs& args);

}  // namespace rubato
