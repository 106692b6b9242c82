// SampleTokens (kernels/cuda/sampling.cuh) against its CPU twin (kernels/cpu ArgMax and
// SampleTokenWithUniform): batches mixing greedy, temperature, top-k and top-p rows; logits with
// exact ties (bf16 values repeat, plus copied maxima) and -inf entries; vocabularies 1 to Qwen3's
// 151936, odd sizes and unaligned rows included; uniforms at and near 0 and 1. The token must be
// the CPU's exactly, except for a uniform within 1e-6 (relative) of a cumulative boundary of the
// CPU's distribution (or a top-p threshold that close to a cumulative value): the GPU keeps
// probabilities in f32 (boundaries move by at most ~1.2e-7 relative), so such a draw may pick the
// neighbour. Those are skipped, counted and printed, and must stay a minority.
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <functional>
#include <string>
#include <vector>

#include "kernels/cpu/sampling.h"
#include "kernels/cuda/sampling.cuh"
#include "tests/gpu/gpu_test_util.h"

namespace rubato::cuda {
namespace {

using gpu_test::Download;
using gpu_test::Poisoned;
using gpu_test::RandomBf16Values;
using gpu_test::Upload;

constexpr double kBoundaryTolerance = 1e-6;  // relative

// Runs SampleTokens over `logits` [rows][vocab], placed `offset` floats into the device buffer
// (offset 1 breaks the rows' 16-byte alignment), with a poisoned workspace and output.
std::vector<int32_t> SampleOnGpu(const std::vector<float>& logits, int rows, int vocab,
                                 const std::vector<SamplingRow>& row_params, int offset = 0) {
  std::vector<float> shifted(static_cast<size_t>(offset), 0.f);
  shifted.insert(shifted.end(), logits.begin(), logits.end());
  auto device_logits = Upload(shifted);
  auto device_rows = Upload(row_params);
  auto tokens = Poisoned<int32_t>(static_cast<size_t>(rows));
  const size_t bytes = SampleWorkspaceBytes(rows, vocab);
  auto workspace = Poisoned<uint8_t>(bytes);
  const SampleParams params{device_logits.data() + offset,
                            rows,
                            vocab,
                            device_rows.data(),
                            tokens.data(),
                            workspace.data(),
                            bytes};
  const Status status = SampleTokens(params, nullptr);
  EXPECT_TRUE(status.ok()) << status.message();
  return Download(tokens);
}

// The CPU twin's token, and whether the draw is too close to a boundary to demand equality.
struct CpuChoice {
  int token;
  bool ambiguous;
};

CpuChoice SampleOnCpu(std::span<const float> logits, const SamplingRow& row,
                      SamplingWorkspace& workspace) {
  if (!(row.temperature > 0.f)) return {ArgMax(logits), false};
  const SamplingFilter filter{row.temperature, row.top_k, row.top_p};
  const int token = SampleTokenWithUniform(logits, filter, row.uniform, workspace);
  bool ambiguous = false;
  // The walk's cumulative values (the workspace still holds this filter's distribution).
  double cumulative = 0.0;
  for (double p : workspace.probabilities) {
    cumulative += p;
    if (p > 0.0 && std::abs(row.uniform - cumulative) <= kBoundaryTolerance * cumulative) {
      ambiguous = true;
    }
  }
  if (row.top_p < 1.f) {
    // The nucleus itself: a cumulative value of the top-k distribution, most probable first,
    // that close to top_p.
    FilteredDistribution(logits, SamplingFilter{row.temperature, row.top_k, 1.f}, workspace);
    std::vector<double> sorted = workspace.probabilities;
    std::sort(sorted.begin(), sorted.end(), std::greater<>());
    const double top_p = row.top_p;
    cumulative = 0.0;
    for (double p : sorted) {
      cumulative += p;
      if (std::abs(cumulative - top_p) <= kBoundaryTolerance * top_p) ambiguous = true;
    }
  }
  return {token, ambiguous};
}

// One row of logits of one of five shapes: flat in [-1, 1] (bf16, so values repeat: ties
// everywhere), wide in [-8, 8] with 3 % -inf, wide with a few spikes tied at the top, (vocab >= 16)
// all -inf but five entries, and narrow in [0.5, 1) (one binade: 128 distinct values, so every
// value is a large tie group, and a radix select cannot narrow its candidates after one pass).
// Every shape gets copies of random entries (ties) and of its maximum (a tie at the top, and at a
// top-k cut).
constexpr int kShapes = 5;
std::vector<float> RandomLogitRow(std::mt19937_64& rng, int vocab, int shape) {
  const float lo = shape == 0 ? -1.f : shape == 4 ? 0.5f : -8.f;
  const float hi = shape == 0 ? 1.f : shape == 4 ? 0.999f : 8.f;
  std::vector<float> row = RandomBf16Values(rng, size_t(vocab), lo, hi);
  const auto index = [&] { return static_cast<size_t>(rng() % uint64_t(vocab)); };
  if (shape == 1) {
    for (int i = 0; i < vocab / 33; ++i) row[index()] = -INFINITY;
  } else if (shape == 2) {
    for (int i = 0; i < 4; ++i) row[index()] = 9.5f + 0.5f * float(i % 2);
  } else if (shape == 3 && vocab >= 16) {
    std::vector<float> sparse(size_t(vocab), -INFINITY);
    for (int i = 0; i < 5; ++i) sparse[index()] = row[index()];
    row = sparse;
  }
  for (int i = 0; i < 6; ++i) row[index()] = row[index()];
  const float max = *std::max_element(row.begin(), row.end());
  if (std::isinf(max) && max < 0) row[index()] = 0.f;  // at least one finite entry
  row[index()] = *std::max_element(row.begin(), row.end());
  return row;
}

// The row configurations a batch cycles through (uniform set per draw).
std::vector<SamplingRow> RowConfigs(int vocab) {
  return {
      {0.f, 0, 1.f, 0.0},                         // greedy
      {1.f, 0, 1.f, 0.0},                         // plain softmax: the CPU walks ids in order
      {0.7f, 0, 1.f, 0.0},                        //
      {1.f, 50, 1.f, 0.0},                        // top-k
      {0.8f, 1, 1.f, 0.0},                        // top-1: the lowest id of the maxima
      {2.f, 5, 1.f, 0.0},                         //
      {1.3f, 0, 0.9f, 0.0},                       // top-p
      {0.6f, 0, 0.5f, 0.0},                       //
      {1.f, 0, 1e-3f, 0.0},                       // top-p keeping one token
      {0.25f, 0, 0.99f, 0.0},                     //
      {0.9f, 40, 0.8f, 0.0},                      // both
      {1.f, std::max(1, vocab - 1), 0.95f, 0.0},  // top-k cutting one token, and top-p
      {1.1f, vocab + 3, 1.f, 0.0},                // top-k past the vocabulary: off
  };
}

struct Tally {
  int compared = 0, skipped = 0, greedy = 0;
};

// Draws several batches over the same random logits, cycling configurations and uniforms (fixed
// ones at and near 0 and 1, then random ones), and compares every row with the CPU twin.
void ExpectMatchesCpuTwin(std::mt19937_64& rng, int vocab, int rows, int offset, Tally& tally) {
  std::vector<float> logits;
  const int first_shape = static_cast<int>(rng() % kShapes);
  for (int r = 0; r < rows; ++r) {
    const std::vector<float> row = RandomLogitRow(rng, vocab, (first_shape + r) % kShapes);
    logits.insert(logits.end(), row.begin(), row.end());
  }
  const std::vector<SamplingRow> configs = RowConfigs(vocab);
  // 1 - 2^-53, the largest DrawUniform value, always lies within the tolerance of the last
  // boundary (1): it checks that the kernel picks a valid token there, and counts as skipped.
  const std::vector<double> fixed_uniforms = {0.0, 0x1.0p-53, 1e-12,    1e-6,         0.25,
                                              0.5, 0.75,      1 - 1e-5, 1 - 0x1.0p-53};
  const int draws = 16;
  SamplingWorkspace workspace;
  for (int d = 0; d < draws; ++d) {
    std::vector<SamplingRow> batch(static_cast<size_t>(rows));
    for (int r = 0; r < rows; ++r) {
      SamplingRow& row = batch[size_t(r)];
      row = configs[size_t(r + 5 * d) % configs.size()];
      row.uniform = d < int(fixed_uniforms.size())
                        ? fixed_uniforms[size_t(r + d) % fixed_uniforms.size()]
                        : DrawUniform(rng);
    }
    const std::vector<int32_t> tokens = SampleOnGpu(logits, rows, vocab, batch, offset);
    ASSERT_EQ(tokens.size(), size_t(rows));
    for (int r = 0; r < rows; ++r) {
      const SamplingRow& row = batch[size_t(r)];
      const std::span<const float> row_logits(logits.data() + size_t(r) * vocab, size_t(vocab));
      const CpuChoice want = SampleOnCpu(row_logits, row, workspace);
      const int32_t got = tokens[size_t(r)];
      ASSERT_GE(got, 0) << "row " << r << " not written";
      ASSERT_LT(got, vocab) << "row " << r;
      if (want.ambiguous) {
        ++tally.skipped;
        continue;
      }
      ++(row.temperature > 0.f ? tally.compared : tally.greedy);
      EXPECT_EQ(got, want.token) << "vocab " << vocab << " rows " << rows << " offset " << offset
                                 << " draw " << d << " row " << r << ": temperature "
                                 << row.temperature << " top_k " << row.top_k << " top_p "
                                 << row.top_p << " uniform " << row.uniform
                                 << "; logit of the GPU token " << row_logits[size_t(got)]
                                 << ", of the CPU token " << row_logits[size_t(want.token)];
    }
  }
}

void ExpectFewSkipped(const Tally& tally) {
  std::cout << "[ sampled   ] " << tally.compared << " sampled draws compared with the CPU twin, "
            << tally.greedy << " greedy rows, " << tally.skipped
            << " draws skipped (uniform or top_p within " << kBoundaryTolerance
            << " of a cumulative boundary)\n";
  EXPECT_GT(tally.compared, 0);
  // Measured (host emulation of the kernel): ~7 % skipped up to vocab 4099, ~22 % at 65537 and
  // 151936, where ~1e5 boundaries lie in [0, 1] and 1e-6 * u around each covers a lot of it.
  EXPECT_LE(tally.skipped * 3, tally.compared + tally.skipped) << "more than a third skipped";
}

TEST(SampleOpTest, MatchesCpuTwinOnMixedBatches) {
  std::mt19937_64 rng = gpu_test::FreshRng();
  Tally tally;
  for (int vocab : {1, 127, 832, 1024, 4099}) {
    for (int rows : {1, 3, 17}) ExpectMatchesCpuTwin(rng, vocab, rows, 0, tally);
  }
  // Rows that are not 16-byte aligned although the vocabulary is a multiple of 4.
  ExpectMatchesCpuTwin(rng, 1024, 3, 1, tally);
  ExpectFewSkipped(tally);
}

TEST(SampleOpTest, LargeMatchesCpuTwinAtQwen3Vocab) {
  std::mt19937_64 rng = gpu_test::FreshRng();
  Tally tally;
  for (int vocab : {65537, 151936}) {
    for (int rows : {1, 3, 17}) ExpectMatchesCpuTwin(rng, vocab, rows, 0, tally);
  }
  ExpectFewSkipped(tally);
}

TEST(SampleOpTest, TiesNaNAndSignedZeros) {
  // Each case: logits and the row (greedy unless a temperature is given); the CPU twin decides.
  struct Case {
    std::vector<float> logits;
    SamplingRow row;
    int want;
  };
  std::vector<float> far_tie(10000, -1.f);
  far_tie[9999] = 3.f;
  far_tie[5000] = 3.f;  // same maximum, another tile: the lower id
  const std::vector<Case> cases = {
      {{1, 3, 2, 3}, {}, 1},
      {{NAN, 0.5f, NAN, 2}, {}, 3},
      {{NAN, NAN, NAN}, {}, 0},
      {{-1.f, -0.f, 0.f}, {}, 1},  // -0 == +0: the lower id
      {{-INFINITY, -5.f}, {}, 1},
      {far_tie, {}, 5000},
      {{-1.f, -0.f, 0.f, -INFINITY}, {1.f, 1, 1.f, 0.7}, 1},  // top-1 of equal zeros
      {{2.f, 5.f, 5.f, 5.f, 1.f}, {0.5f, 2, 1.f, 0.9}, 2},    // top-k cut inside a tie
      {far_tie, {1.f, 0, 1e-3f, 0.99}, 5000},                 // top-p of one token of a tie
  };
  SamplingWorkspace workspace;
  for (size_t i = 0; i < cases.size(); ++i) {
    const Case& c = cases[i];
    const int vocab = static_cast<int>(c.logits.size());
    const std::vector<int32_t> got = SampleOnGpu(c.logits, 1, vocab, {c.row});
    ASSERT_EQ(got.size(), 1u);
    const CpuChoice cpu = SampleOnCpu(c.logits, c.row, workspace);
    EXPECT_EQ(cpu.token, c.want) << "case " << i << " (the CPU twin)";
    EXPECT_FALSE(cpu.ambiguous) << "case " << i;
    EXPECT_EQ(got[0], c.want) << "case " << i;
  }
}

TEST(SampleOpTest, SameInputsSameTokens) {
  std::mt19937_64 rng = gpu_test::FreshRng();
  const int vocab = 4099, rows = 17;
  std::vector<float> logits;
  std::vector<SamplingRow> batch;
  const std::vector<SamplingRow> configs = RowConfigs(vocab);
  for (int r = 0; r < rows; ++r) {
    const std::vector<float> row = RandomLogitRow(rng, vocab, r % kShapes);
    logits.insert(logits.end(), row.begin(), row.end());
    batch.push_back(configs[size_t(r) % configs.size()]);
    batch.back().uniform = DrawUniform(rng);
  }
  EXPECT_EQ(SampleOnGpu(logits, rows, vocab, batch), SampleOnGpu(logits, rows, vocab, batch));
}

// Rows with report_probability get kernels/cpu TokenProbability of the token the kernel chose
// (to f32 rounding: the block sums in another order), the others -1; NaN, -inf, a single entry
// and a row without a finite logit included. Reporting does not change the token.
TEST(SampleOpTest, ReportsTheTokenProbability) {
  std::mt19937_64 rng = gpu_test::FreshRng();
  for (int vocab : {1, 4099, 151936}) {
    const int rows = 11;
    std::vector<float> logits;
    std::vector<SamplingRow> batch;
    const std::vector<SamplingRow> configs = RowConfigs(vocab);
    for (int r = 0; r < rows; ++r) {
      std::vector<float> row = RandomLogitRow(rng, vocab, r % kShapes);
      if (r == 5 && vocab > 1) row[static_cast<size_t>(rng() % uint64_t(vocab))] = NAN;
      if (r == 7) std::fill(row.begin(), row.end(), -INFINITY);  // no finite logit: 0
      logits.insert(logits.end(), row.begin(), row.end());
      batch.push_back(configs[size_t(r) % configs.size()]);
      batch.back().uniform = DrawUniform(rng);
      batch.back().report_probability = r % 4 != 3;
    }
    auto device_logits = Upload(logits);
    auto device_rows = Upload(batch);
    auto tokens = Poisoned<int32_t>(size_t(rows));
    auto probabilities = Poisoned<float>(size_t(rows));
    const size_t bytes = SampleWorkspaceBytes(rows, vocab);
    auto workspace = Poisoned<uint8_t>(bytes);
    SampleParams params{device_logits.data(), rows, vocab, device_rows.data(), tokens.data(),
                        workspace.data(),     bytes};
    params.probabilities = probabilities.data();
    ASSERT_TRUE(SampleTokens(params, nullptr).ok());
    const std::vector<int32_t> got_tokens = Download(tokens);
    const std::vector<float> got = Download(probabilities);
    for (auto& row : batch) row.report_probability = 0;
    device_rows = Upload(batch);
    params.row_params = device_rows.data();
    params.probabilities = nullptr;
    ASSERT_TRUE(SampleTokens(params, nullptr).ok());
    EXPECT_EQ(Download(tokens), got_tokens) << "vocab " << vocab;
    for (int r = 0; r < rows; ++r) {
      const std::span<const float> row(logits.data() + size_t(r) * vocab, size_t(vocab));
      if (r % 4 == 3) {
        EXPECT_EQ(got[size_t(r)], -1.f) << "vocab " << vocab << " row " << r;
        continue;
      }
      const float want = TokenProbability(row, got_tokens[size_t(r)]);
      EXPECT_NEAR(got[size_t(r)], want, 1e-6f * want + 1e-12f) << "vocab " << vocab << " row " << r;
      if (r == 7) {
        EXPECT_EQ(got[size_t(r)], 0.f);
      }
    }
  }
}

TEST(SampleOpTest, RejectsBadParams) {
  const int rows = 2, vocab = 832;
  auto logits = Poisoned<float>(size_t(rows) * vocab);
  auto row_params = Upload(std::vector<SamplingRow>(size_t(rows)));
  auto tokens = Poisoned<int32_t>(size_t(rows));
  const size_t bytes = SampleWorkspaceBytes(rows, vocab);
  ASSERT_GT(bytes, 0u);
  auto workspace = Poisoned<uint8_t>(bytes + 16);
  const SampleParams good{logits.data(),    rows, vocab, row_params.data(), tokens.data(),
                          workspace.data(), bytes};
  EXPECT_TRUE(SampleTokens(good, nullptr).ok());
  ASSERT_EQ(cudaSuccess, cudaDeviceSynchronize());
  auto expect_invalid = [](const SampleParams& p, const std::string& mentions) {
    const Status s = SampleTokens(p, nullptr);
    EXPECT_EQ(s.code(), StatusCode::kInvalidArgument) << s.message();
    EXPECT_NE(s.message().find(mentions), std::string::npos) << s.message();
  };
  SampleParams p = good;
  p.logits = nullptr;
  expect_invalid(p, "logits is null");
  p = good;
  p.row_params = nullptr;
  expect_invalid(p, "row_params is null");
  p = good;
  p.tokens = nullptr;
  expect_invalid(p, "tokens is null");
  p = good;
  p.workspace = nullptr;
  expect_invalid(p, "workspace is null");
  p = good;
  p.workspace_bytes = bytes - 1;
  expect_invalid(p, "workspace_bytes");
  p = good;
  p.workspace = workspace.data() + 4;
  expect_invalid(p, "aligned");
  p = good;
  p.rows = -1;
  expect_invalid(p, "rows");
  p = good;
  p.vocab_size = 0;
  expect_invalid(p, "vocab_size");
  p = good;
  p.vocab_size = 1 << 30;
  expect_invalid(p, "vocab_size");
  EXPECT_EQ(SampleWorkspaceBytes(0, vocab), 0u);
  p = SampleParams{};  // zero rows: nothing to do
  EXPECT_TRUE(SampleTokens(p, nullptr).ok());
}

}  // namespace
}  // namespace rubato::cuda
