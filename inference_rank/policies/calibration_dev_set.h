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

// "\r<what> [####....] done/total prompts, N s" on `out` (null: nothing), a newline at the end.
void CalibrationProgress(std::FILE* out, const char* what, int done, int total, double seconds);

}  // namespace rubato
