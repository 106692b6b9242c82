// `rubato calibrate kascade`: dense prefill of a development set on the CPU model, observing
// every layer's attention (GQA-pooled post-softmax rows) and its effect on the residual stream,
// then the anchors and head map of kascade_calibration.h. docs/kascade.md "Calibration".
#pragma once

#include <cstdint>
#include <cstdio>
#include <string>

#include "common/hf_config.h"
#include "common/status.h"
#include "inference_rank/policies/kascade/kascade_calibration.h"

namespace rubato {

struct KascadeCalibrateOptions {
  std::string model_dir;
  std::string dev_set;           // JSON lines, each {"prompt": "..."}
  int anchors = 5;               // anchor layers, layer 0 included
  int top_k = 64;                // k of Eq. 3
  int max_prompt_tokens = 2048;  // longer prompts keep their last tokens
  int threads = 0;               // CPU threads, 0 = all cores
  std::string out;               // the calibration file (required)
  std::FILE* progress = stderr;  // the progress bar; null: none
};

// Refuses before loading weights: an empty --out, --top-k above the longest prompt, a dev set
// that is not a regular file within kMaxPromptSetBytes, and a prompt length whose observations
// (KascadeCalibrationBytes) exceed half the machine's memory.
Result<KascadeCalibration> CalibrateKascade(const KascadeCalibrateOptions& options);

// Bytes the calibration holds for one prompt of `tokens` tokens: the pooled attention rows,
// every layer's top-k sets, the residual update and the KV.
uint64_t KascadeCalibrationBytes(const ModelConfig& model, int tokens, int top_k);

}  // namespace rubato
