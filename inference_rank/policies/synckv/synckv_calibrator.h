// `rubato calibrate synckv`: dense prefill of a development set on the CPU model; the last
// `decode_steps` query positions of each prompt stand for decode steps (teacher forcing: a
// prefill query attends exactly what decoding that position would), each layer's GQA-pooled
// attention rows feed SyncKvHeadOverlap, then S is clustered (synckv_calibration.h).
// docs/synckv.md "Calibration".
#pragma once

#include <cstdio>
#include <string>

#include "common/status.h"
#include "inference_rank/policies/synckv/synckv_calibration.h"

namespace rubato {

struct SyncKvCalibrateOptions {
  std::string model_dir;
  std::string dev_set;           // JSON lines, each {"prompt": "..."}
  int clusters = 1;              // N_r of the recorded clustering
  int top_k = 64;                // k of Eq. 2
  int decode_steps = 64;         // observed query positions per prompt (its last ones)
  int max_prompt_tokens = 2048;  // longer prompts keep their last tokens
  int threads = 0;               // CPU threads, 0 = all cores
  std::string out;               // the calibration file (required)
  std::FILE* progress = stderr;  // the progress bar; null: none
};

// Refuses by name before loading weights: an empty --out or one in a missing directory, a
// --top-k or --decode-steps above --max-tokens, a dev set that is not a regular file within
// kMaxPromptSetBytes; after reading the model's shape, --clusters outside [1, KV heads] and
// a prompt whose observations would exceed half of the machine's memory.
Result<SyncKvCalibration> CalibrateSyncKv(const SyncKvCalibrateOptions& options);

}  // namespace rubato
