// kernels/cuda/attention_merge against its CPU twin, kernels/cpu/attention_merge.h, element by
// element: random bf16 partials of odd sizes and strides, lse gaps from 0 to past f32 exp's
// range, one side empty (its o NaN: it must not leak), both empty, merging into o_a in place, and
// the launcher's input checks.
#include <cmath>
#include <limits>
#include <random>
#include <string>
#include <vector>

#include "kernels/cpu/attention_merge.h"
#include "kernels/cuda/attention_merge.cuh"
#include "tests/gpu/gpu_test_util.h"

namespace rubato {
namespace {

using gpu_test::Download;
using gpu_test::DownloadBf16;
using gpu_test::FailsWith;
using gpu_test::Poisoned;
using gpu_test::RandomBf16Values;
using gpu_test::Upload;
using gpu_test::UploadBf16;

constexpr float kInf = std::numeric_limits<float>::infinity();

struct MergeCase {
  int rows = 1, heads = 1, head_dim = 8;
  int64_t pad = 0;  // elements between rows
  double gap = 0.0;
  bool a_empty = false, b_empty = false;
  bool in_place = false;  // out = o_a
};

std::string Describe(const MergeCase& c) {
  return "rows " + std::to_string(c.rows) + " heads " + std::to_string(c.heads) + " head_dim " +
         std::to_string(c.head_dim) + " pad " + std::to_string(c.pad) + " gap " +
         std::to_string(c.gap) + (c.a_empty ? " a empty" : "") + (c.b_empty ? " b empty" : "") +
         (c.in_place ? " in place" : "");
}

void RunCase(std::mt19937_64& rng, const MergeCase& c) {
  SCOPED_TRACE(Describe(c));
  const int64_t stride = static_cast<int64_t>(c.heads) * c.head_dim + c.pad;
  const size_t elements = static_cast<size_t>(c.rows * stride);
  const size_t stats = static_cast<size_t>(c.rows) * c.heads;
  std::vector<float> o_a = RandomBf16Values(rng, elements, -2.f, 2.f);
  std::vector<float> o_b = RandomBf16Values(rng, elements, -2.f, 2.f);
  std::vector<float> lse_a(stats), lse_b(stats);
  std::uniform_real_distribution<float> base(-20.f, 20.f),
      gap(static_cast<float>(-c.gap), static_cast<float>(c.gap));
  for (size_t i = 0; i < stats; ++i) {
    lse_a[i] = c.a_empty ? -kInf : base(rng);
    lse_b[i] = c.b_empty ? -kInf : (c.a_empty ? base(rng) : lse_a[i] + gap(rng));
  }
  if (c.a_empty) o_a.assign(elements, std::nanf(""));
  if (c.b_empty) o_b.assign(elements, std::nanf(""));

  // The CPU twin on the same (bf16-rounded) values.
  std::vector<float> want(elements, 0.f), want_lse(stats);
  const AttentionMergeArgs args{o_a.data(), stride,       lse_a.data(), o_b.data(),
                                stride,     lse_b.data(), c.rows,       c.heads,
                                c.head_dim, want.data(),  stride,       want_lse.data()};
  ASSERT_TRUE(MergeAttention(args).ok());

  auto device_a = UploadBf16(o_a);
  auto device_b = UploadBf16(o_b);
  auto device_lse_a = Upload(lse_a);
  auto device_lse_b = Upload(lse_b);
  auto device_out = Poisoned<__nv_bfloat16>(elements);
  auto device_lse = Poisoned<float>(stats);
  cuda::AttentionMergeParams params;
  params.o_a = device_a.data();
  params.o_a_row_stride = stride;
  params.lse_a = device_lse_a.data();
  params.o_b = device_b.data();
  params.o_b_row_stride = stride;
  params.lse_b = device_lse_b.data();
  params.rows = c.rows;
  params.num_heads = c.heads;
  params.head_dim = c.head_dim;
  params.out = c.in_place ? device_a.data() : device_out.data();
  params.out_row_stride = stride;
  params.lse_out = device_lse.data();
  ASSERT_STATUS_OK(cuda::MergeAttention(params, nullptr));
  const std::vector<float> out = DownloadBf16(c.in_place ? device_a : device_out);
  const std::vector<float> lse = Download(device_lse);

  std::vector<float> got, expected;  // the written elements; padding checked apart
  for (int r = 0; r < c.rows; ++r) {
    for (int64_t col = 0; col < stride; ++col) {
      const size_t i = static_cast<size_t>(r * stride + col);
      if (col < stride - c.pad) {
        got.push_back(out[i]);
        expected.push_back(want[i]);
      } else if (!c.in_place) {
        ASSERT_TRUE(std::isnan(out[i])) << "padding written at " << i;
      }
    }
  }
  // bf16 output: the twin's f32 value rounded once (2^-9 relative) plus f32 noise.
  EXPECT_TRUE(AllClose<float>("o", got, expected, 1e-5, 1.0 / 256));
  for (size_t i = 0; i < stats; ++i) {
    if (std::isinf(want_lse[i])) {
      EXPECT_EQ(lse[i], want_lse[i]) << "lse " << i;
    } else {
      EXPECT_NEAR(lse[i], want_lse[i], 1e-6 + 1e-6 * std::fabs(want_lse[i])) << "lse " << i;
    }
  }
}

TEST(AttentionMergeOpTest, MatchesCpuTwin) {
  std::mt19937_64 rng = gpu_test::FreshRng();
  for (int rows : {1, 3, 17}) {
    for (int heads : {1, 7, 32}) {
      for (int head_dim : {8, 24, 64, 128}) {
        for (double gap : {0.0, 3.0, 120.0}) {  // 120: e^-120 underflows f32
          RunCase(rng, {rows, heads, head_dim, rows == 3 ? 16 : 0, gap, false, false, false});
        }
      }
    }
  }
}

TEST(AttentionMergeOpTest, EmptySidesAndInPlace) {
  std::mt19937_64 rng = gpu_test::FreshRng();
  RunCase(rng, {5, 8, 128, 8, 2.0, true, false, false});
  RunCase(rng, {5, 8, 64, 0, 2.0, false, true, false});
  RunCase(rng, {4, 3, 16, 8, 0.0, true, true, false});
  RunCase(rng, {9, 32, 128, 0, 4.0, false, false, true});
  RunCase(rng, {2, 4, 128, 0, 4.0, true, false, true});
}

TEST(AttentionMergeOpTest, RejectsBadParams) {
  auto o = Poisoned<__nv_bfloat16>(256);
  auto lse = Poisoned<float>(8);
  auto out = Poisoned<__nv_bfloat16>(256);
  auto lse_out = Poisoned<float>(8);
  cuda::AttentionMergeParams good;
  good.o_a = good.o_b = o.data();
  good.lse_a = good.lse_b = lse.data();
  good.o_a_row_stride = good.o_b_row_stride = good.out_row_stride = 64;
  good.rows = 2;
  good.num_heads = 4;
  good.head_dim = 16;
  good.out = out.data();
  good.lse_out = lse_out.data();
  ASSERT_STATUS_OK(cuda::MergeAttention(good, nullptr));
  const auto invalid = [](const cuda::AttentionMergeParams& p, const char* field) {
    return FailsWith(cuda::MergeAttention(p, nullptr), StatusCode::kInvalidArgument, field);
  };
  cuda::AttentionMergeParams p = good;
  p.rows = -1;
  EXPECT_TRUE(invalid(p, "rows"));
  p = good;
  p.num_heads = 0;
  EXPECT_TRUE(invalid(p, "num_heads"));
  p = good;
  p.head_dim = 12;
  EXPECT_TRUE(invalid(p, "head_dim"));
  p = good;
  p.o_a = nullptr;
  EXPECT_TRUE(invalid(p, "o_a"));
  p = good;
  p.lse_b = nullptr;
  EXPECT_TRUE(invalid(p, "lse_b"));
  p = good;
  p.out = nullptr;
  EXPECT_TRUE(invalid(p, "out"));
  p = good;
  p.o_b_row_stride = 60;
  EXPECT_TRUE(invalid(p, "o_b_row_stride"));
  p = good;
  p.out_row_stride = 72 + 4;
  EXPECT_TRUE(invalid(p, "out_row_stride"));
  p = good;
  p.lse_out = lse.data();
  EXPECT_TRUE(invalid(p, "lse_out"));
  p = good;
  p.out = out.data() + 4;
  EXPECT_TRUE(invalid(p, "aligned"));
  p = good;
  p.rows = 0;
  p.o_a = nullptr;  // nothing to do
  EXPECT_TRUE(cuda::MergeAttention(p, nullptr).ok());
  ASSERT_CUDA_OK(cudaDeviceSynchronize());
}

}  // namespace
}  // namespace rubato
