// GatherRows (kernels/cuda/gather_rows.cuh) against a host loop: odd row counts and widths,
// repeated and reversed indices, the NaN row for an out-of-range index, and bad parameters.
#include <gtest/gtest.h>

#include <cmath>
#include <cstdint>
#include <vector>

#include "kernels/cuda/gather_rows.cuh"
#include "tests/gpu/gpu_test_util.h"

namespace rubato::cuda {
namespace {

using gpu_test::DownloadBf16;
using gpu_test::Poisoned;
using gpu_test::RandomBf16Values;
using gpu_test::Upload;
using gpu_test::UploadBf16;

// The CPU twin.
std::vector<float> GatherOnHost(const std::vector<float>& in, const std::vector<int32_t>& indices,
                                int dim) {
  std::vector<float> out;
  for (int32_t row : indices) {
    out.insert(out.end(), in.begin() + int64_t(row) * dim, in.begin() + int64_t(row + 1) * dim);
  }
  return out;
}

TEST(GatherRowsOpTest, MatchesHostLoop) {
  std::mt19937_64 rng = gpu_test::FreshRng();
  for (int in_rows : {1, 3, 17, 4099}) {
    for (int dim : {8, 16, 64, 128, 1032, 4096}) {
      for (int rows : {1, 3, 17}) {
        const std::vector<float> in = RandomBf16Values(rng, size_t(in_rows) * dim);
        std::vector<int32_t> indices(static_cast<size_t>(rows));
        for (int32_t& index : indices) index = static_cast<int32_t>(rng() % in_rows);
        indices.back() = in_rows - 1;  // the last row, as a decode batch's last entry
        auto device_in = UploadBf16(in);
        auto device_indices = Upload(indices);
        auto out = Poisoned<__nv_bfloat16>(size_t(rows) * dim);
        GatherRowsParams params;
        params.in = device_in.data();
        params.in_rows = in_rows;
        params.row_indices = device_indices.data();
        params.rows = rows;
        params.dim = dim;
        params.out = out.data();
        ASSERT_STATUS_OK(GatherRows(params, nullptr));
        const std::vector<float> got = DownloadBf16(out);
        // A copy: exact.
        ASSERT_EQ(got, GatherOnHost(in, indices, dim))
            << "in_rows " << in_rows << " dim " << dim << " rows " << rows;
      }
    }
  }
}

TEST(GatherRowsOpTest, OutOfRangeIndexWritesNaNRow) {
  std::mt19937_64 rng = gpu_test::FreshRng();
  const int dim = 24, in_rows = 5;
  const std::vector<float> in = RandomBf16Values(rng, size_t(in_rows) * dim);
  const std::vector<int32_t> indices = {4, -1, 5, 0};
  auto device_in = UploadBf16(in);
  auto device_indices = Upload(indices);
  auto out = Poisoned<__nv_bfloat16>(indices.size() * dim);
  GatherRowsParams params{
      device_in.data(), in_rows, device_indices.data(), static_cast<int>(indices.size()), dim,
      out.data()};
  ASSERT_STATUS_OK(GatherRows(params, nullptr));
  const std::vector<float> got = DownloadBf16(out);
  for (int r = 0; r < 4; ++r) {
    for (int c = 0; c < dim; ++c) {
      const float v = got[size_t(r) * dim + c];
      if (r == 1 || r == 2) {
        EXPECT_TRUE(std::isnan(v)) << "row " << r;
      } else {
        EXPECT_EQ(v, in[size_t(indices[size_t(r)]) * dim + c]) << "row " << r;
      }
    }
  }
}

TEST(GatherRowsOpTest, RejectsBadParams) {
  auto in = Poisoned<__nv_bfloat16>(64);
  auto indices = Upload(std::vector<int32_t>{0, 1});
  auto out = Poisoned<__nv_bfloat16>(64);
  const GatherRowsParams good{in.data(), 2, indices.data(), 2, 32, out.data()};
  EXPECT_TRUE(GatherRows(good, nullptr).ok());
  auto expect_invalid = [](GatherRowsParams p, const std::string& mentions) {
    const Status s = GatherRows(p, nullptr);
    EXPECT_EQ(s.code(), StatusCode::kInvalidArgument) << s.message();
    EXPECT_NE(s.message().find(mentions), std::string::npos) << s.message();
  };
  GatherRowsParams p = good;
  p.dim = 12;
  expect_invalid(p, "dim");
  p = good;
  p.in = nullptr;
  expect_invalid(p, "in is null");
  p = good;
  p.row_indices = nullptr;
  expect_invalid(p, "row_indices");
  p = good;
  p.out = nullptr;
  expect_invalid(p, "out");
  p = good;
  p.in_rows = 0;
  expect_invalid(p, "in_rows");
  p = good;
  p.rows = -1;
  expect_invalid(p, "rows");
  p = good;
  p.out = out.data() + 1;
  expect_invalid(p, "aligned");
  p = good;
  p.rows = 0;
  p.in = nullptr;  // nothing to do
  EXPECT_TRUE(GatherRows(p, nullptr).ok());
}

}  // namespace
}  // namespace rubato::cuda
