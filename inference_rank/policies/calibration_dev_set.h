// What the offline calibrations (`rubato calibrate kascade|synckv`) share: the development set
// (JSON lines, each {"prompt": "..."}, a bounded regular file) and the progress bar.
#pragma once

#include <cstdio>
#include <string>
#include <vector>

#include "common/status.h"

namespace rubato {

// The prompts of the dev set at `path`; `bytes` receives the file's bytes (for its hash). Only a
// regular file within kMaxPromptSetBytes is read (a FIFO or /dev/zero is refused by kind).
Result<std::vector<std::string>> ReadCalibrationDevSet(const std::string& path, std::string& bytes);

// The checks every `rubato calibrate` makes before reading anything: --out names a file in an
// existing directory, 1 <= --top-k <= --max-tokens and --max-tokens >= 2.
Status CheckCalibrateArgs(const std::string& out, int top_k, int max_prompt_tokens);

// "\r<what> [####....] done/total prompts, N s" on `out` (null: nothing), a newline at the end.
void CalibrationProgress(std::FILE* out, const char* what, int done, int total, double seconds);

}  // namespace rubato
