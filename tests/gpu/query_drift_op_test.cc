// The fidelity guard's query-drift op (inference_rank/policies/sfi/kernels/query_drift.cuh)
// against its CPU twin QueryDriftGuard: references remembered by RememberQueries, then every
// entry's mean head cosine from AddQueryDrift compared with QueryDriftGuard::LayerCosine on the
// same bf16 queries, at near and far positions, on shuffled slots and query rows. Half of the
// entries ask for the same content at another position (cosine near 1: RoPE is taken out), the
// others for unrelated content; one head is zero. The tolerance per element is 3e-5 plus the
// angle rounding: the GPU un-rotates by the fp32 angle float(p) * inv_freq[i] (the forward's),
// the twin by the angle in double; a pair's cosine moves by at most the angle difference, at most
// 2^-24 |angle| per side. Then a second layer adds, slots outside the pool are skipped, untouched
// slots stay as they were, and bad parameters name the field.
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <numeric>
#include <random>
#include <string>
#include <vector>

#include "inference_rank/attention/fidelity_guard.h"
#include "inference_rank/policies/sfi/kernels/query_drift.cuh"
#include "kernels/cpu/rope.h"
#include "tests/gpu/gpu_test_util.h"

namespace rubato::cuda {
namespace {

using gpu_test::Download;
using gpu_test::FailsWith;
using gpu_test::Poisoned;
using gpu_test::Upload;
using gpu_test::UploadBf16;

struct DriftCase {
  int heads = 2;
  int head_dim = 16;
  int batch = 3;
  bool far = false;       // positions in [30000, 131072) instead of [0, 64)
  bool row_index = true;  // queries found by q_rows (else rows 0..batch-1)
};

// `content` ([heads][head_dim]) rotated by RoPE at `position` (fp32 angles, as the model's
// forward), rounded to bf16.
std::vector<float> RotatedBf16(std::vector<float> content, int position, int heads,
                               const std::vector<float>& inv_freq) {
  const size_t half = inv_freq.size();
  std::vector<float> cos(half), sin(half);
  const int positions[] = {position};
  RopeCosSin(positions, inv_freq, cos.data(), sin.data());
  ApplyRope(content.data(), 1, heads, static_cast<int>(2 * half), cos.data(), sin.data());
  for (float& v : content) v = Bf16ToF32(F32ToBf16(v));
  return content;
}

void RunCase(const DriftCase& c) {
  SCOPED_TRACE("heads " + std::to_string(c.heads) + " head_dim " + std::to_string(c.head_dim) +
               " batch " + std::to_string(c.batch) + (c.far ? " far" : " near"));
  std::mt19937_64 rng = gpu_test::FreshRng();
  const std::vector<float> inv_freq = RopeInverseFrequencies(c.head_dim, 1e6, RopeScaling{});
  const QueryDriftGuard::Shape shape{c.heads, c.head_dim, inv_freq.data()};
  const int q_dim = c.heads * c.head_dim;
  const int64_t stride = q_dim + 2 * c.head_dim;  // a fused q|k|v row, k and v unused
  const int rows = c.batch + 3;
  const int num_slots = c.batch + 2;

  // Distinct slots and query rows in shuffled order.
  std::vector<int32_t> slots(static_cast<size_t>(num_slots)), q_rows(static_cast<size_t>(rows));
  std::iota(slots.begin(), slots.end(), 0);
  std::iota(q_rows.begin(), q_rows.end(), 0);
  std::shuffle(slots.begin(), slots.end(), rng);
  std::shuffle(q_rows.begin(), q_rows.end(), rng);
  slots.resize(static_cast<size_t>(c.batch));
  q_rows.resize(static_cast<size_t>(c.batch));
  if (!c.row_index) std::iota(q_rows.begin(), q_rows.end(), 0);

  std::uniform_int_distribution<int> near(0, 63), far(30000, 131071), step(1, 200);
  std::normal_distribution<float> normal(0.f, 1.f);
  std::vector<int32_t> ref_positions, now_positions;
  std::vector<float> ref_q(static_cast<size_t>(rows) * stride, 0.f), now_q = ref_q;
  std::vector<QueryDriftGuard> twins(static_cast<size_t>(c.batch));
  for (int b = 0; b < c.batch; ++b) {
    const int ref_position = c.far ? far(rng) : near(rng);
    const int now_position = ref_position + step(rng);
    ref_positions.push_back(ref_position);
    now_positions.push_back(now_position);
    std::vector<float> content(static_cast<size_t>(q_dim)), other(content.size());
    for (float& v : content) v = 2.f * normal(rng);
    for (float& v : other) v = 2.f * normal(rng);
    std::vector<float> now_content = content;
    if (b % 2 == 1) now_content = other;  // unrelated content
    for (float& v : now_content) v += 0.05f * normal(rng);
    std::vector<float> ref = RotatedBf16(content, ref_position, c.heads, inv_freq);
    std::vector<float> now = RotatedBf16(now_content, now_position, c.heads, inv_freq);
    if (b == 0) std::fill(now.begin(), now.begin() + c.head_dim, 0.f);  // a zero head counts 1
    const size_t row = static_cast<size_t>(q_rows[static_cast<size_t>(b)]) * stride;
    std::copy(ref.begin(), ref.end(), ref_q.begin() + static_cast<ptrdiff_t>(row));
    std::copy(now.begin(), now.end(), now_q.begin() + static_cast<ptrdiff_t>(row));
    twins[static_cast<size_t>(b)].Remember(0, ref.data(), ref_position, shape);
  }

  const auto d_ref_q = UploadBf16(ref_q);
  const auto d_now_q = UploadBf16(now_q);
  const auto d_q_rows = Upload(q_rows);
  const auto d_slots = Upload(slots);
  const auto d_ref_positions = Upload(ref_positions);
  const auto d_now_positions = Upload(now_positions);
  const auto d_inv_freq = Upload(inv_freq);
  auto references = Poisoned<float>(static_cast<size_t>(num_slots) * q_dim);
  auto sums = Poisoned<float>(static_cast<size_t>(num_slots));

  QueryDriftParams p;
  p.q = d_ref_q.data();
  p.q_row_stride = stride;
  p.q_rows = c.row_index ? d_q_rows.data() : nullptr;
  p.positions = d_ref_positions.data();
  p.slots = d_slots.data();
  p.num_slots = num_slots;
  p.inv_freq = d_inv_freq.data();
  p.references = references.data();
  p.cosine_sums = sums.data();
  p.batch = c.batch;
  p.num_heads = c.heads;
  p.head_dim = c.head_dim;
  ASSERT_STATUS_OK(RememberQueries(p, nullptr));
  p.q = d_now_q.data();
  p.positions = d_now_positions.data();
  p.reset = true;  // the first layer
  ASSERT_STATUS_OK(AddQueryDrift(p, nullptr));
  const std::vector<float> first = Download(sums);
  p.reset = false;  // the next layer adds
  ASSERT_STATUS_OK(AddQueryDrift(p, nullptr));
  const std::vector<float> second = Download(sums);

  double max_error = 0.0, min_same = 1.0;
  for (int b = 0; b < c.batch; ++b) {
    const double expected = twins[static_cast<size_t>(b)].LayerCosine(
        0, now_q.data() + static_cast<size_t>(q_rows[static_cast<size_t>(b)]) * stride,
        now_positions[static_cast<size_t>(b)], shape);
    const double angles = std::ldexp(static_cast<double>(ref_positions[static_cast<size_t>(b)]) +
                                         now_positions[static_cast<size_t>(b)],
                                     -24);
    const double tolerance = 3e-5 + angles;
    const float got = first[static_cast<size_t>(slots[static_cast<size_t>(b)])];
    const double error = std::fabs(static_cast<double>(got) - expected);
    max_error = std::max(max_error, error);
    EXPECT_LE(error, tolerance) << "entry " << b << ": GPU " << got << ", CPU " << expected;
    EXPECT_NEAR(second[static_cast<size_t>(slots[static_cast<size_t>(b)])], 2.0 * got,
                1e-6 + 1e-6 * std::fabs(got))
        << "entry " << b << ": the second layer adds";
    if (b % 2 == 0) min_same = std::min(min_same, static_cast<double>(got));
  }
  std::cout << "[ max error ] cosine: " << max_error << " over " << c.batch
            << " entries; same content at another position: cosine >= " << min_same << "\n";
  EXPECT_GT(min_same, 0.9) << "the same content rotated elsewhere must read as no drift";

  // Slots no entry holds keep their poison (0xFF bytes), references and sums alike.
  std::vector<bool> held(static_cast<size_t>(num_slots), false);
  for (int32_t s : slots) held[static_cast<size_t>(s)] = true;
  const std::vector<float> stored = Download(references);
  for (int s = 0; s < num_slots; ++s) {
    if (held[static_cast<size_t>(s)]) continue;
    uint32_t bits;
    std::memcpy(&bits, &second[static_cast<size_t>(s)], sizeof(bits));
    EXPECT_EQ(bits, 0xFFFFFFFFu) << "slot " << s << "'s sum was written";
    std::memcpy(&bits, &stored[static_cast<size_t>(s) * q_dim], sizeof(bits));
    EXPECT_EQ(bits, 0xFFFFFFFFu) << "slot " << s << "'s reference was written";
  }
}

TEST(QueryDriftOpTest, MatchesTheCpuGuardAtNearAndFarPositions) {
  for (bool far : {false, true}) {
    RunCase({2, 16, 3, far, true});
    RunCase({8, 64, 5, far, false});
    RunCase({16, 128, 7, far, true});
    RunCase({40, 128, 4, far, true});
    RunCase({3, 256, 2, far, false});
    RunCase({64, 80, 9, far, true});
  }
}

TEST(QueryDriftOpTest, SkipsSlotsOutsideThePool) {
  const std::vector<float> inv_freq = RopeInverseFrequencies(16, 1e4, RopeScaling{});
  const auto q = UploadBf16(std::vector<float>(2 * 32, 0.5f));
  const auto slots = Upload(std::vector<int32_t>{-1, 2});  // both outside a pool of 2
  const auto positions = Upload(std::vector<int32_t>{3, 4});
  const auto d_inv_freq = Upload(inv_freq);
  auto references = Poisoned<float>(2 * 32);
  auto sums = Poisoned<float>(2);
  QueryDriftParams p;
  p.q = q.data();
  p.q_row_stride = 32;
  p.positions = positions.data();
  p.slots = slots.data();
  p.num_slots = 2;
  p.inv_freq = d_inv_freq.data();
  p.references = references.data();
  p.cosine_sums = sums.data();
  p.batch = 2;
  p.num_heads = 2;
  p.head_dim = 16;
  ASSERT_STATUS_OK(RememberQueries(p, nullptr));
  p.reset = true;
  ASSERT_STATUS_OK(AddQueryDrift(p, nullptr));
  for (float v : Download(sums)) EXPECT_TRUE(std::isnan(v));
  for (float v : Download(references)) EXPECT_TRUE(std::isnan(v));
}

TEST(QueryDriftOpTest, BadParametersNameTheField) {
  float dummy = 0.f;
  int32_t index = 0;
  __nv_bfloat16 q[4];
  QueryDriftParams p;
  p.q = q;
  p.q_row_stride = 4;
  p.positions = &index;
  p.slots = &index;
  p.num_slots = 1;
  p.inv_freq = &dummy;
  p.references = &dummy;
  p.cosine_sums = &dummy;
  p.batch = 1;
  p.num_heads = 2;
  p.head_dim = 2;
  auto with = [&p](auto change) {
    QueryDriftParams bad = p;
    change(bad);
    return bad;
  };
  EXPECT_TRUE(FailsWith(AddQueryDrift(with([](auto& b) { b.head_dim = 3; }), nullptr),
                        StatusCode::kInvalidArgument, "head_dim"));
  EXPECT_TRUE(FailsWith(AddQueryDrift(with([](auto& b) { b.head_dim = 258; }), nullptr),
                        StatusCode::kInvalidArgument, "head_dim"));
  EXPECT_TRUE(FailsWith(RememberQueries(with([](auto& b) { b.num_heads = 0; }), nullptr),
                        StatusCode::kInvalidArgument, "num_heads"));
  EXPECT_TRUE(FailsWith(RememberQueries(with([](auto& b) { b.q_row_stride = 3; }), nullptr),
                        StatusCode::kInvalidArgument, "q_row_stride"));
  EXPECT_TRUE(FailsWith(RememberQueries(with([](auto& b) { b.q = nullptr; }), nullptr),
                        StatusCode::kInvalidArgument, "q is null"));
  EXPECT_TRUE(FailsWith(AddQueryDrift(with([](auto& b) { b.cosine_sums = nullptr; }), nullptr),
                        StatusCode::kInvalidArgument, "cosine_sums"));
  EXPECT_TRUE(FailsWith(AddQueryDrift(with([](auto& b) { b.num_slots = 0; }), nullptr),
                        StatusCode::kInvalidArgument, "num_slots"));
  // Nothing to do: no pointer is needed.
  EXPECT_TRUE(AddQueryDrift(with([](auto& b) {
                              b.batch = 0;
                              b.q = nullptr;
                            }),
                            nullptr)
                  .ok());
}

}  // namespace
}  // namespace rubato::cuda
