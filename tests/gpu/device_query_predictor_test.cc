// The device query predictor (kernels/cuda/query_predictor.cuh) against its CPU twin
// PredictQueriesFromRings (cache_rank/query_predictor.h): heads at every fill level and ring
// position, W from 0 to the device maximum, random and exactly linear query sequences, head_dim
// 64 and 128; every element within 1e-5 relative (both solve in double, summing in other
// orders). Heads with a count or next slot outside their ring get zeros; bad launch arguments
// are refused by name.
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <random>
#include <string>
#include <vector>

#include "cache_rank/query_predictor.h"
#include "kernels/cuda/query_predictor.cuh"
#include "tests/gpu/gpu_test_util.h"

namespace rubato {
namespace {

using gpu_test::Download;
using gpu_test::FailsWith;
using gpu_test::Poisoned;
using gpu_test::Upload;

struct Case {
  int heads = 0, capacity = 0, dim = 0, max_window = 0;
  bool linear = false;  // queries on a line: q_i = a + i b (the predictor's exact case)
};

void CheckCase(std::mt19937_64& rng, const Case& c) {
  std::normal_distribution<float> normal(0.0f, 1.5f);
  std::vector<float> rings(size_t(c.heads) * c.capacity * c.dim);
  for (int h = 0; h < c.heads; ++h) {
    std::vector<float> a(c.dim), b(c.dim);
    for (int d = 0; d < c.dim; ++d) a[d] = normal(rng), b[d] = 0.1f * normal(rng);
    for (int s = 0; s < c.capacity; ++s) {
      for (int d = 0; d < c.dim; ++d) {
        rings[(size_t(h) * c.capacity + s) * c.dim + d] =
            c.linear ? a[d] + static_cast<float>(s) * b[d] : normal(rng);
      }
    }
  }
  std::vector<int32_t> next(c.heads), count(c.heads);
  std::uniform_int_distribution<int> slot(0, c.capacity - 1), fill(1, c.capacity);
  for (int h = 0; h < c.heads; ++h) {
    // Linear rings hold their line in slot order: the newest is the last slot.
    next[h] = c.linear ? 0 : slot(rng);
    count[h] = c.linear ? c.capacity : fill(rng);
  }
  if (c.heads > 2 && !c.linear) {
    count[1] = 0;          // empty: zeros
    next[2] = c.capacity;  // outside the ring: zeros
  }
  std::vector<float> want(size_t(c.heads) * c.dim);
  PredictQueriesFromRings(rings, next, count, c.heads, c.capacity, c.dim, c.max_window, 1e-2, want);

  auto ring_dev = Upload(rings);
  auto next_dev = Upload(next);
  auto count_dev = Upload(count);
  auto got_dev = Poisoned<float>(want.size());
  cuda::PredictQueriesParams params;
  params.ring = ring_dev.data();
  params.next = next_dev.data();
  params.count = count_dev.data();
  params.predicted = got_dev.data();
  params.heads = c.heads;
  params.capacity = c.capacity;
  params.dim = c.dim;
  params.max_window = c.max_window;
  params.ridge_lambda = 1e-2;
  ASSERT_STATUS_OK(cuda::PredictQueries(params, nullptr));
  ASSERT_CUDA_OK(cudaDeviceSynchronize());
  const std::vector<float> got = Download(got_dev);
  const std::string label = "heads " + std::to_string(c.heads) + " capacity " +
                            std::to_string(c.capacity) + " dim " + std::to_string(c.dim) + " W " +
                            std::to_string(c.max_window) + (c.linear ? " linear" : " random");
  double worst = 0.0;
  for (size_t i = 0; i < want.size(); ++i) {
    const double error = std::abs(double{got[i]} - want[i]);
    worst = std::max(worst, error / (1.0 + std::abs(want[i])));
    ASSERT_LE(error, 1e-5 * (1.0 + std::abs(want[i])))
        << label << ": element " << i << " got " << got[i] << " want " << want[i];
  }
  std::printf("[ predictor ] %s: worst relative error %.3g\n", label.c_str(), worst);
}

TEST(QueryPredictorOp, MatchesTheCpuTwin) {
  std::mt19937_64 rng = gpu_test::FreshRng();
  for (const int dim : {64, 128}) {
    for (const int capacity : {1, 2, 5, cuda::kDeviceQueryWindowMax + 1}) {
      for (const int w : {0, 1, capacity - 1}) {
        if (w < 0 || w > capacity - 1) continue;
        CheckCase(rng, {.heads = 37, .capacity = capacity, .dim = dim, .max_window = w});
        if (HasFatalFailure()) return;
      }
    }
    CheckCase(rng, {.heads = 8, .capacity = 17, .dim = dim, .max_window = 16, .linear = true});
    if (HasFatalFailure()) return;
  }
}

TEST(QueryPredictorOp, RefusesBadArguments) {
  cuda::PredictQueriesParams params;
  params.heads = 1;
  params.dim = 128;
  params.capacity = cuda::kDeviceQueryWindowMax + 2;
  params.max_window = 1;
  EXPECT_TRUE(
      FailsWith(cuda::PredictQueries(params, nullptr), StatusCode::kInvalidArgument, "capacity"));
  params.capacity = 4;
  params.max_window = 4;
  EXPECT_TRUE(
      FailsWith(cuda::PredictQueries(params, nullptr), StatusCode::kInvalidArgument, "max_window"));
  params.max_window = 3;
  EXPECT_TRUE(FailsWith(cuda::PredictQueries(params, nullptr), StatusCode::kInvalidArgument,
                        "must be set"));
  params.heads = 0;
  EXPECT_TRUE(cuda::PredictQueries(params, nullptr).ok());
}

}  // namespace
}  // namespace rubato
