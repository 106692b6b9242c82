// SplitStepByCache (cache_step_split.h).
#include "inference_rank/residency/offloaded/cache_step_split.h"

#include <string>

namespace rubato {

Result<CacheStepSplit> SplitStepByCache(std::span<const CacheStepEntry> entries, int decode_rows,
                                        int num_caches) {
  if (num_caches < 1) return InvalidArgumentError("a step split over no cache rank");
  CacheStepSplit split;
  split.parts.resize(static_cast<size_t>(num_caches));
  // Each entry's first model row, and the parts' sizes.
  std::vector<int> first_row(entries.size());
  int row = 0;
  for (size_t e = 0; e < entries.size(); ++e) {
    const CacheStepEntry& entry = entries[e];
    if (entry.cache < 0 || entry.cache >= num_caches) {
      return InvalidArgumentError("step entry " + std::to_string(e) + ": cache rank " +
                                  std::to_string(entry.cache) + " of " +
                                  std::to_string(num_caches));
    }
    if (entry.run.tokens < 1 || (row < decode_rows && entry.run.tokens != 1)) {
      return InvalidArgumentError("step entry " + std::to_string(e) + ": " +
                                  std::to_string(entry.run.tokens) + " tokens" +
                                  (row < decode_rows ? " in a decode row" : ""));
    }
    first_row[e] = row;
    CacheStepPart& part = split.parts[static_cast<size_t>(entry.cache)];
    part.runs.push_back(entry.run);
    part.rows += static_cast<int>(entry.run.tokens);
    if (row < decode_rows) ++part.decode_rows;
    row += static_cast<int>(entry.run.tokens);
  }
  if (decode_rows > row) {
    return InvalidArgumentError("a step of " + std::to_string(row) + " rows has " +
                                std::to_string(decode_rows) + " decode rows");
  }
  int rows_before = 0, decode_before = 0;
  for (CacheStepPart& part : split.parts) {
    part.first_row = rows_before;
    part.first_decode_row = decode_before;
    rows_before += part.rows;
    decode_before += part.decode_rows;
    split.shape.push_back(part.rows);
    split.shape.push_back(part.decode_rows);
  }
  // Fill each part's block in model order: its decode rows come first because the model's do.
  split.gather.resize(static_cast<size_t>(row));
  split.scatter.resize(static_cast<size_t>(decode_rows));
  std::vector<int> next(split.parts.size());
  for (size_t c = 0; c < split.parts.size(); ++c) next[c] = split.parts[c].first_row;
  for (size_t e = 0; e < entries.size(); ++e) {
    const auto c = static_cast<size_t>(entries[e].cache);
    for (uint32_t t = 0; t < entries[e].run.tokens; ++t) {
      const int model_row = first_row[e] + static_cast<int>(t);
      const int staged = next[c]++;
      split.gather[static_cast<size_t>(staged)] = model_row;
      if (model_row < decode_rows) {
        // Staged decode rows of a part are its first rows, in the same order as its attention.
        split.scatter[static_cast<size_t>(model_row)] =
            split.parts[c].first_decode_row + (staged - split.parts[c].first_row);
      }
    }
  }
  return split;
}

}  // namespace rubato
