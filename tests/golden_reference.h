// The committed transformers references of tests/data/golden/<model> (written on the GPU machine
// by tools/golden/hf_golden.py): read by the CPU golden test (golden_parity_test.cc) and the CUDA
// one (tests/gpu/cuda_model_golden_test.cc).
#pragma once

#include <gtest/gtest.h>

#include <cstring>
#include <filesystem>
#include <nlohmann/json.hpp>
#include <string>
#include <vector>

#include "common/text_file.h"

namespace rubato::golden {

struct GoldenReference {
  nlohmann::json meta;  // meta.json: prompt, prompt_ids, decode_ids, decode_text, vocab_size
  std::vector<int> prompt_ids;
  std::vector<int> decode_ids;  // transformers' greedy tokens after the prompt
  int vocab = 0;
  std::vector<float> prefill_logits;  // [prompt_ids.size()][vocab], f32
  std::vector<float> decode_logits;   // [decode_ids.size()][vocab], f32, teacher-forced
};

// The file's bytes; a test failure (and empty bytes) when it cannot be read.
inline std::string ReadGoldenFile(const std::filesystem::path& path) {
  Result<std::string> bytes = ReadTextFile(path);
  EXPECT_TRUE(bytes.ok()) << bytes.status().message();
  return bytes.ok() ? *bytes : std::string();
}

// [rows][vocab] little-endian f32; a test failure when the count is not `expected_count`.
inline std::vector<float> ReadGoldenF32(const std::filesystem::path& path, size_t expected_count) {
  const std::string bytes = ReadGoldenFile(path);
  std::vector<float> values(bytes.size() / sizeof(float));
  std::memcpy(values.data(), bytes.data(), values.size() * sizeof(float));
  EXPECT_EQ(values.size(), expected_count) << path;
  return values;
}

// tests/data/golden/<name>, relative to the source root (the tests' working directory).
inline GoldenReference LoadGoldenReference(const std::string& name) {
  const std::filesystem::path dir = std::filesystem::path("tests/data/golden") / name;
  GoldenReference ref;
  ref.meta = nlohmann::json::parse(ReadGoldenFile(dir / "meta.json"));
  ref.prompt_ids = ref.meta["prompt_ids"].get<std::vector<int>>();
  ref.decode_ids = ref.meta["decode_ids"].get<std::vector<int>>();
  ref.vocab = ref.meta["vocab_size"].get<int>();
  ref.prefill_logits =
      ReadGoldenF32(dir / "prefill_logits.f32", ref.prompt_ids.size() * size_t(ref.vocab));
  ref.decode_logits =
      ReadGoldenF32(dir / "decode_logits.f32", ref.decode_ids.size() * size_t(ref.vocab));
  return ref;
}

}  // namespace rubato::golden
