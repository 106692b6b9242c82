// The query ring ops (kernels/cuda/query_rings.cuh) against their CPU twins
// (cache_rank/query_rings.h), element by element and exactly (a widening copy and a rounding):
// a dozen steps of pushes over rings that wrap, entries that restart their window, a slot
// outside the rings and a ring with a bad next; then PredictQueries over the pushed rings against
// PredictQueriesFromRings over the twin's, and the packing of predicted queries into bf16 rows.
#include <gtest/gtest.h>

#include <cmath>
#include <cstdint>
#include <random>
#include <vector>

#include "cache_rank/query_predictor.h"
#include "cache_rank/query_rings.h"
#include "common/dtype.h"
#include "kernels/cuda/query_predictor.cuh"
#include "kernels/cuda/query_rings.cuh"
#include "tests/gpu/gpu_test_util.h"

namespace rubato {
namespace {

using gpu_test::Download;
using gpu_test::FailsWith;
using gpu_test::Upload;

TEST(QueryRingsOp, PushPredictAndPackMatchTheCpuTwins) {
  std::mt19937_64 rng = gpu_test::FreshRng();
  constexpr int kSlots = 5, kHeads = 6, kDim = 128, kWindow = 4, kCapacity = kWindow + 1;
  constexpr int64_t kStride = kHeads * kDim + 2 * 2 * kDim;  // q | k | v of 2 KV heads
  std::normal_distribution<float> normal(0.0f, 1.0f);
  std::vector<float> ring(size_t{kSlots} * kHeads * kCapacity * kDim, 0.0f);
  std::vector<int32_t> next(size_t{kSlots} * kHeads, 0), count(size_t{kSlots} * kHeads, 0);
  next[3 * kHeads + 2] = 9;  // a bad next: the ring restarts
  auto ring_dev = Upload(ring);
  auto next_dev = Upload(next);
  auto count_dev = Upload(count);
  for (int step = 0; step < 12; ++step) {
    constexpr int kRows = 7;
    std::vector<uint16_t> rows(size_t{kRows} * kStride);
    for (uint16_t& x : rows) x = F32ToBf16(normal(rng));
    // Entries: slots 3, 0, 4 and one outside the rings; slot 0 a chunk every fifth step.
    const std::vector<int32_t> slot = {3, 0, 4, kSlots + 1};
    const std::vector<int32_t> row = {0, step % 5 == 0 ? 6 : 1, 2, 3};
    const std::vector<int32_t> restart = {0, step % 5 == 0 ? 1 : 0, step == 7 ? 1 : 0, 0};
    PushQueryRowsCpu(ring, next, count, rows, kStride, {slot, row, restart}, kSlots, kHeads,
                     kCapacity, kDim);
    auto rows_dev = Upload(rows);
    auto slot_dev = Upload(slot);
    auto row_dev = Upload(row);
    auto restart_dev = Upload(restart);
    cuda::PushQueryRowsParams push;
    push.ring = ring_dev.data();
    push.next = next_dev.data();
    push.count = count_dev.data();
    push.rows = reinterpret_cast<const __nv_bfloat16*>(rows_dev.data());
    push.row_stride = kStride;
    push.entry_slot = slot_dev.data();
    push.entry_row = row_dev.data();
    push.entry_restart = restart_dev.data();
    push.entries = static_cast<int>(slot.size());
    push.slots = kSlots;
    push.heads = kHeads;
    push.capacity = kCapacity;
    push.dim = kDim;
    ASSERT_STATUS_OK(cuda::PushQueryRows(push, nullptr));
    ASSERT_CUDA_OK(cudaDeviceSynchronize());
    ASSERT_EQ(Download(next_dev), next) << "step " << step;
    ASSERT_EQ(Download(count_dev), count) << "step " << step;
    ASSERT_EQ(Download(ring_dev), ring) << "step " << step;

    // The predictor over the pushed rings, then the packed rows of the entries.
    std::vector<float> want(size_t{kSlots} * kHeads * kDim);
    PredictQueriesFromRings(ring, next, count, kSlots * kHeads, kCapacity, kDim, kWindow, 1e-2,
                            want);
    auto predicted_dev = gpu_test::Poisoned<float>(want.size());
    cuda::PredictQueriesParams predict;
    predict.ring = ring_dev.data();
    predict.next = next_dev.data();
    predict.count = count_dev.data();
    predict.predicted = predicted_dev.data();
    predict.heads = kSlots * kHeads;
    predict.capacity = kCapacity;
    predict.dim = kDim;
    predict.max_window = kWindow;
    ASSERT_STATUS_OK(cuda::PredictQueries(predict, nullptr));
    ASSERT_CUDA_OK(cudaDeviceSynchronize());
    const std::vector<float> got = Download(predicted_dev);
    for (size_t i = 0; i < want.size(); ++i) {
      ASSERT_LE(std::abs(double{got[i]} - want[i]), 1e-5 * (1.0 + std::abs(want[i])))
          << "step " << step << " element " << i;
    }
    // Packing reads the device's own prediction (the twin's differs in the last bits).
    constexpr int64_t kOutStride = kHeads * kDim + 8;
    std::vector<uint16_t> packed(slot.size() * kOutStride, 0x7fff);
    PackPredictedQueriesCpu(got, slot, kSlots, kHeads, kDim, kOutStride, packed);
    auto out_dev = Upload(std::vector<uint16_t>(packed.size(), 0x7fff));
    cuda::PackPredictedQueriesParams pack;
    pack.predicted = predicted_dev.data();
    pack.entry_slot = slot_dev.data();
    pack.out = reinterpret_cast<__nv_bfloat16*>(out_dev.data());
    pack.out_stride = kOutStride;
    pack.entries = static_cast<int>(slot.size());
    pack.slots = kSlots;
    pack.heads = kHeads;
    pack.dim = kDim;
    ASSERT_STATUS_OK(cuda::PackPredictedQueries(pack, nullptr));
    ASSERT_CUDA_OK(cudaDeviceSynchronize());
    ASSERT_EQ(Download(out_dev), packed) << "step " << step;
  }
}

TEST(QueryRingsOp, RefusesBadArguments) {
  cuda::PushQueryRowsParams push;
  push.entries = 1;
  push.heads = 2;
  push.dim = 64;
  push.capacity = 0;
  push.row_stride = 128;
  EXPECT_TRUE(
      FailsWith(cuda::PushQueryRows(push, nullptr), StatusCode::kInvalidArgument, "capacity"));
  push.capacity = 3;
  push.row_stride = 64;
  EXPECT_TRUE(
      FailsWith(cuda::PushQueryRows(push, nullptr), StatusCode::kInvalidArgument, "row_stride"));
  push.row_stride = 128;
  EXPECT_TRUE(
      FailsWith(cuda::PushQueryRows(push, nullptr), StatusCode::kInvalidArgument, "must be set"));
  cuda::PackPredictedQueriesParams pack;
  pack.entries = 1;
  pack.heads = 2;
  pack.dim = 64;
  pack.out_stride = 100;
  EXPECT_TRUE(FailsWith(cuda::PackPredictedQueries(pack, nullptr), StatusCode::kInvalidArgument,
                        "out_stride"));
  pack.entries = 0;
  pack.out_stride = 128;
  EXPECT_TRUE(cuda::PackPredictedQueries(pack, nullptr).ok());
}

}  // namespace
}  // namespace rubato
