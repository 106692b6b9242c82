// The fused q/k-norm + RoPE + KV append (cuda::QkNormRopeAppend) against the three separate CUDA
// ops it replaces, bit for bit (qkv and both pools), and against its CPU twin within bf16
// tolerances; with and without q/k-norm weights, near and far positions, skipped slots.
#include <cuda_bf16.h>
#include <cuda_runtime_api.h>
#include <gtest/gtest.h>

#include <cstdint>
#include <random>
#include <string>
#include <vector>

#include "common/hf_config.h"
#include "kernels/cpu/qk_rope_append.h"
#include "kernels/cpu/rope.h"
#include "kernels/cuda/kv_append.cuh"
#include "kernels/cuda/qk_norm.cuh"
#include "kernels/cuda/qk_rope_append.cuh"
#include "kernels/cuda/rope.cuh"
#include "tests/gpu/gpu_test_util.h"

namespace rubato {
namespace {

using cuda::DeviceBuffer;
using namespace gpu_test;

struct Shape {
  int tokens, heads, kv_heads, head_dim, block_tokens;
  bool norm;
};

class QkRopeAppendOpTest : public ::testing::TestWithParam<Shape> {
 protected:
  void SetUp() override { ASSERT_CUDA_OK(cudaStreamCreate(&stream_)); }
  void TearDown() override { EXPECT_EQ(cudaSuccess, cudaStreamDestroy(stream_)); }
  cudaStream_t stream_ = nullptr;
};

TEST_P(QkRopeAppendOpTest, EqualsTheSeparateOpsBitForBitAndTheCpuTwin) {
  const Shape s = GetParam();
  std::mt19937_64 rng(s.tokens * 131 + s.head_dim);
  const int64_t stride = static_cast<int64_t>(s.heads + 2 * s.kv_heads) * s.head_dim;
  const std::vector<float> qkv = RandomBf16Values(rng, s.tokens * stride, -4, 4);
  const std::vector<float> q_weight = RandomBf16Values(rng, s.head_dim, -1.5f, 1.5f);
  const std::vector<float> k_weight = RandomBf16Values(rng, s.head_dim, -1.5f, 1.5f);
  std::vector<int32_t> positions(s.tokens), slots(s.tokens);
  const int blocks = (s.tokens + s.block_tokens - 1) / s.block_tokens + 2;
  std::uniform_int_distribution<int32_t> far(0, 200000);
  for (int t = 0; t < s.tokens; ++t) {
    positions[t] = t % 3 == 0 ? far(rng) : t;
    slots[t] = t % 7 == 3 ? -1 : (blocks * s.block_tokens - 1 - t);  // reversed, some skipped
  }
  const std::vector<float> inv_freq = RopeInverseFrequencies(s.head_dim, 1e6, RopeScaling{});
  const size_t pool = static_cast<size_t>(blocks) * s.kv_heads * s.block_tokens * s.head_dim;
  const std::vector<float> pool_init = RandomBf16Values(rng, pool, -1, 1);

  DeviceBuffer<int32_t> d_positions = Upload(positions), d_slots = Upload(slots);
  DeviceBuffer<float> d_inv_freq = Upload(inv_freq);
  DeviceBuffer<__nv_bfloat16> d_q_weight = UploadBf16(q_weight), d_k_weight = UploadBf16(k_weight);

  // The separate ops, as the model ran them before the fusion.
  DeviceBuffer<__nv_bfloat16> a_qkv = UploadBf16(qkv), a_keys = UploadBf16(pool_init),
                              a_values = UploadBf16(pool_init);
  if (s.norm) {
    cuda::HeadRmsNormParams qk{.x = a_qkv.data(),
                               .row_stride = stride,
                               .tokens = s.tokens,
                               .heads = s.heads,
                               .head_dim = s.head_dim,
                               .weight = d_q_weight.data(),
                               .eps = 1e-6f};
    ASSERT_STATUS_OK(cuda::HeadRmsNormInPlace(qk, stream_));
    qk.x = a_qkv.data() + static_cast<int64_t>(s.heads) * s.head_dim;
    qk.heads = s.kv_heads;
    qk.weight = d_k_weight.data();
    ASSERT_STATUS_OK(cuda::HeadRmsNormInPlace(qk, stream_));
  }
  ASSERT_STATUS_OK(cuda::ApplyRope({.x = a_qkv.data(),
                                    .row_stride = stride,
                                    .tokens = s.tokens,
                                    .heads = s.heads + s.kv_heads,
                                    .head_dim = s.head_dim,
                                    .positions = d_positions.data(),
                                    .inv_freq = d_inv_freq.data()},
                                   stream_));
  cuda::KvAppendParams append;
  append.keys = a_qkv.data() + static_cast<int64_t>(s.heads) * s.head_dim;
  append.values = append.keys + static_cast<int64_t>(s.kv_heads) * s.head_dim;
  append.row_stride = stride;
  append.slots = d_slots.data();
  append.tokens = s.tokens;
  append.num_kv_heads = s.kv_heads;
  append.head_dim = s.head_dim;
  append.block_tokens = s.block_tokens;
  append.key_pool = a_keys.data();
  append.value_pool = a_values.data();
  ASSERT_STATUS_OK(cuda::AppendToPagedKv(append, stream_));

  // The fused op.
  DeviceBuffer<__nv_bfloat16> b_qkv = UploadBf16(qkv), b_keys = UploadBf16(pool_init),
                              b_values = UploadBf16(pool_init);
  cuda::QkRopeAppendParams fused;
  fused.qkv = b_qkv.data();
  fused.row_stride = stride;
  fused.tokens = s.tokens;
  fused.num_heads = s.heads;
  fused.num_kv_heads = s.kv_heads;
  fused.head_dim = s.head_dim;
  fused.q_norm_weight = s.norm ? d_q_weight.data() : nullptr;
  fused.k_norm_weight = s.norm ? d_k_weight.data() : nullptr;
  fused.eps = 1e-6f;
  fused.positions = d_positions.data();
  fused.inv_freq = d_inv_freq.data();
  fused.slots = d_slots.data();
  fused.block_tokens = s.block_tokens;
  fused.key_pool = b_keys.data();
  fused.value_pool = b_values.data();
  ASSERT_STATUS_OK(cuda::QkNormRopeAppend(fused, stream_));
  ASSERT_CUDA_OK(cudaStreamSynchronize(stream_));

  const std::vector<float> fused_qkv = DownloadBf16(b_qkv), fused_keys = DownloadBf16(b_keys),
                           fused_values = DownloadBf16(b_values);
  EXPECT_TRUE(Bf16Close("qkv, fused vs separate", fused_qkv, DownloadBf16(a_qkv), 0.0, 0.0));
  EXPECT_TRUE(Bf16Close("keys, fused vs separate", fused_keys, DownloadBf16(a_keys), 0.0, 0.0));
  EXPECT_TRUE(
      Bf16Close("values, fused vs separate", fused_values, DownloadBf16(a_values), 0.0, 0.0));

  // The CPU twin (f32 throughout): bf16 tolerances.
  std::vector<float> cpu_qkv = qkv, cpu_keys = pool_init, cpu_values = pool_init;
  const std::vector<int> cpu_positions(positions.begin(), positions.end());
  QkNormRopeAppend({.qkv = cpu_qkv.data(),
                    .row_stride = stride,
                    .tokens = s.tokens,
                    .num_heads = s.heads,
                    .num_kv_heads = s.kv_heads,
                    .head_dim = s.head_dim,
                    .q_norm_weight = s.norm ? q_weight.data() : nullptr,
                    .k_norm_weight = s.norm ? k_weight.data() : nullptr,
                    .eps = 1e-6f,
                    .positions = cpu_positions,
                    .inv_freq = inv_freq,
                    .slots = slots,
                    .block_tokens = s.block_tokens,
                    .key_pool = cpu_keys.data(),
                    .value_pool = cpu_values.data()});
  EXPECT_TRUE(Bf16Close("qkv, fused vs CPU", fused_qkv, cpu_qkv, 2e-2, 2e-2));
  EXPECT_TRUE(Bf16Close("keys, fused vs CPU", fused_keys, cpu_keys, 2e-2, 2e-2));
  EXPECT_TRUE(Bf16Close("values, fused vs CPU", fused_values, cpu_values, 0.0, 0.0));
}

INSTANTIATE_TEST_SUITE_P(
    Shapes, QkRopeAppendOpTest,
    ::testing::Values(Shape{1, 32, 8, 128, 64, true}, Shape{37, 32, 8, 128, 16, true},
                      Shape{300, 16, 4, 64, 16, true}, Shape{9, 8, 2, 128, 16, false},
                      Shape{5, 4, 2, 16, 16, true}, Shape{17, 6, 2, 32, 64, false}));

TEST(QkRopeAppendOp, RefusesBadParamsByName) {
  cuda::QkRopeAppendParams p;
  p.tokens = 1;
  p.num_heads = 4;
  p.num_kv_heads = 2;
  p.head_dim = 24;
  EXPECT_TRUE(FailsWith(cuda::QkNormRopeAppend(p, nullptr), StatusCode::kInvalidArgument,
                        "head_dim is 24"));
  p.head_dim = 64;
  p.row_stride = 64;
  EXPECT_TRUE(FailsWith(cuda::QkNormRopeAppend(p, nullptr), StatusCode::kInvalidArgument,
                        "row_stride is 64"));
}

}  // namespace
}  // namespace rubato
