// The token loop of `rubato generate`: steps the engine until its requests end and writes their
// text (or ids) to a stream as it is produced, timing the first and the last token. Apart from
// generate_command.cc so that bench/host_path.cc measures the same code.
#pragma once

#include <chrono>
#include <cstdio>

#include "common/status.h"
#include "common/tokenizer/stream_decoder.h"
#include "inference_rank/engine/engine.h"

namespace rubato {

struct GenerateStreamStats {
  std::chrono::steady_clock::time_point first_token;  // when the first token came back
  std::chrono::steady_clock::time_point last_token;
  int generated = 0;  // tokens, a final stop token included
  // Averaged over the generated tokens (an SFI slow step counts as 1: it attends densely); the
  // last token's alone would usually be a slow step after a trigger.
  double retained_kv_sum = 0.0;
};

// Steps `engine` until it has no work. Each token's text goes to `out` through `decoder`
// (null: the ids, "12 7 93 "); a stop token prints nothing. `out` is flushed once per step, so a
// reader sees every token as its step ends. A request that fails ends the loop with its error
// (after the text so far and a newline). `stats.first_token` / `last_token` start at `start`.
Status StreamGeneratedTokens(Engine& engine, StreamDecoder* decoder, std::FILE* out,
                             std::chrono::steady_clock::time_point start,
                             GenerateStreamStats& stats);

}  // namespace rubato
