// GPU tests of the row-wise and elementwise CUDA ops against their CPU twins (docs/design.md §7):
// embedding, rmsnorm (with and without the fused residual add), qk-norm, rope (default and llama3
// frequencies, positions up to ~200000) and swiglu, on fresh random inputs of odd sizes, plus the
// launchers' rejection of bad parameters. *Large* tests hold the big shapes, which the
// compute-sanitizer run skips.
#include <cuda_bf16.h>
#include <cuda_runtime_api.h>
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <initializer_list>
#include <random>
#include <string>
#include <string_view>
#include <utility>
#include <vector>

#include "common/hf_config.h"
#include "kernels/cpu/add.h"
#include "kernels/cpu/embedding.h"
#include "kernels/cpu/qk_norm.h"
#include "kernels/cpu/rmsnorm.h"
#include "kernels/cpu/rope.h"
#include "kernels/cpu/swiglu.h"
#include "kernels/cuda/embedding.cuh"
#include "kernels/cuda/qk_norm.cuh"
#include "kernels/cuda/rmsnorm.cuh"
#include "kernels/cuda/rope.cuh"
#include "kernels/cuda/swiglu.cuh"
#include "tests/gpu/gpu_test_util.h"

namespace rubato::gpu_test {
namespace {

using gpu_test::FailsWith;

using cuda::DeviceBuffer;

// Tolerances of a bf16 output against the fp32 CPU twin: the final rounding to bf16 is at most
// half a bf16 ulp (2^-9 relative), and a different fp32 summation order can move a value across
// a rounding boundary, one bf16 ulp (2^-8 ~ 0.4 %). Inputs are O(1), so atol only matters for
// results that cancel to almost zero.
constexpr double kBf16Atol = 1e-3;
constexpr double kBf16Rtol = 1e-2;
constexpr float kEps = 1e-6f;

std::string Label(std::string_view op,
                  std::initializer_list<std::pair<const char*, int64_t>> args) {
  std::string label(op);
  for (const auto& [name, value] : args)
    label += " " + std::string(name) + "=" + std::to_string(value);
  return label;
}

// Heads [first_head, first_head + heads) of every token of a [tokens][row_stride] buffer, as the
// contiguous [tokens][heads][head_dim] array the CPU ops take.
std::vector<float> GatherHeads(const std::vector<float>& rows, int tokens, int64_t row_stride,
                               int first_head, int heads, int head_dim) {
  std::vector<float> out;
  out.reserve(static_cast<size_t>(tokens) * heads * head_dim);
  for (int t = 0; t < tokens; ++t) {
    const auto begin = rows.begin() + t * row_stride + static_cast<int64_t>(first_head) * head_dim;
    out.insert(out.end(), begin, begin + static_cast<int64_t>(heads) * head_dim);
  }
  return out;
}

class ElementwiseOpTest : public ::testing::Test {
 protected:
  void SetUp() override { ASSERT_CUDA_OK(cudaStreamCreate(&stream_)); }
  void TearDown() override { EXPECT_EQ(cudaSuccess, cudaStreamDestroy(stream_)); }

  void CheckEmbedding(int tokens, int hidden, int vocab) {
    const std::vector<float> table =
        RandomBf16Values(rng_, static_cast<size_t>(vocab) * hidden, -2, 2);
    std::uniform_int_distribution<int> pick(0, vocab - 1);
    std::vector<int32_t> ids(tokens);
    for (int32_t& id : ids) id = pick(rng_);
    ids.front() = vocab - 1;  // the last row of the table
    ids.back() = 0;
    DeviceBuffer<__nv_bfloat16> d_table = UploadBf16(table);
    DeviceBuffer<int32_t> d_ids = Upload(ids);
    DeviceBuffer<float> d_out = Poisoned<float>(static_cast<size_t>(tokens) * hidden);
    ASSERT_STATUS_OK(cuda::EmbeddingLookup({.table = d_table.data(),
                                            .token_ids = d_ids.data(),
                                            .tokens = tokens,
                                            .hidden = hidden,
                                            .vocab_size = vocab,
                                            .out = d_out.data()},
                                           stream_));
    const std::vector<float> out = Download(d_out);
    std::vector<float> ref(out.size());
    ASSERT_STATUS_OK(::rubato::EmbeddingLookup(table.data(), vocab, hidden, ids, ref.data()));
    // Widening bf16 to fp32 is exact: the rows must match bit for bit.
    EXPECT_TRUE(Bf16Close(Label("embedding", {{"tokens", tokens}, {"hidden", hidden}}), out, ref,
                          0.0, 0.0));
  }

  void CheckRmsNorm(int rows, int dim, bool with_delta) {
    const size_t count = static_cast<size_t>(rows) * dim;
    std::uniform_real_distribution<float> uniform(-3.f, 3.f);
    std::vector<float> residual(count);  // fp32, not rounded to bf16: the residual stream
    for (float& v : residual) v = uniform(rng_);
    const std::vector<float> delta = RandomBf16Values(rng_, count, -2, 2);
    const std::vector<float> weight = RandomBf16Values(rng_, dim, -1.5f, 1.5f);
    DeviceBuffer<float> d_residual = Upload(residual);
    DeviceBuffer<__nv_bfloat16> d_delta;
    if (with_delta) d_delta = UploadBf16(delta);
    DeviceBuffer<__nv_bfloat16> d_weight = UploadBf16(weight);
    DeviceBuffer<__nv_bfloat16> d_out = Poisoned<__nv_bfloat16>(count);
    ASSERT_STATUS_OK(cuda::RmsNorm({.residual = d_residual.data(),
                                    .delta = with_delta ? d_delta.data() : nullptr,
                                    .weight = d_weight.data(),
                                    .out = d_out.data(),
                                    .rows = rows,
                                    .dim = dim,
                                    .eps = kEps},
                                   stream_));
    const std::vector<float> out = DownloadBf16(d_out);
    const std::vector<float> new_residual = Download(d_residual);

    std::vector<float> ref_residual = residual;
    if (with_delta) AddInPlace(ref_residual.data(), delta.data(), static_cast<int64_t>(count));
    std::vector<float> ref(count);
    ::rubato::RmsNorm(ref_residual.data(), weight.data(), rows, dim, kEps, ref.data());
    const std::string label =
        Label("rmsnorm", {{"rows", rows}, {"dim", dim}, {"with_delta", with_delta}});
    // One fp32 add per element, on both sides: exact. Without delta it must be left alone.
    EXPECT_TRUE(Bf16Close(label + " residual", new_residual, ref_residual, 0.0, 0.0));
    EXPECT_TRUE(Bf16Close(label + " out", out, ref, kBf16Atol, kBf16Rtol));
  }

  // Normalizes the q heads and then the k heads of a fused [tokens][q | k | v] buffer, as the
  // Qwen3 attention does; v must come back untouched.
  void CheckHeadRmsNorm(int tokens, int q_heads, int kv_heads, int head_dim) {
    const int64_t stride = static_cast<int64_t>(q_heads + 2 * kv_heads) * head_dim;
    const std::vector<float> qkv = RandomBf16Values(rng_, tokens * stride, -4, 4);
    const std::vector<float> q_weight = RandomBf16Values(rng_, head_dim, -1.5f, 1.5f);
    const std::vector<float> k_weight = RandomBf16Values(rng_, head_dim, -1.5f, 1.5f);
    DeviceBuffer<__nv_bfloat16> d_qkv = UploadBf16(qkv);
    DeviceBuffer<__nv_bfloat16> d_q_weight = UploadBf16(q_weight);
    DeviceBuffer<__nv_bfloat16> d_k_weight = UploadBf16(k_weight);
    cuda::HeadRmsNormParams params{.x = d_qkv.data(),
                                   .row_stride = stride,
                                   .tokens = tokens,
                                   .heads = q_heads,
                                   .head_dim = head_dim,
                                   .weight = d_q_weight.data(),
                                   .eps = kEps};
    ASSERT_STATUS_OK(cuda::HeadRmsNormInPlace(params, stream_));
    params.x = d_qkv.data() + static_cast<int64_t>(q_heads) * head_dim;
    params.heads = kv_heads;
    params.weight = d_k_weight.data();
    ASSERT_STATUS_OK(cuda::HeadRmsNormInPlace(params, stream_));
    const std::vector<float> out = DownloadBf16(d_qkv);

    std::vector<float> q_ref = GatherHeads(qkv, tokens, stride, 0, q_heads, head_dim);
    std::vector<float> k_ref = GatherHeads(qkv, tokens, stride, q_heads, kv_heads, head_dim);
    ::rubato::HeadRmsNormInPlace(q_ref.data(), q_weight.data(), tokens, q_heads, head_dim, kEps);
    ::rubato::HeadRmsNormInPlace(k_ref.data(), k_weight.data(), tokens, kv_heads, head_dim, kEps);
    const std::string label =
        Label("qk_norm", {{"tokens", tokens}, {"heads", q_heads}, {"head_dim", head_dim}});
    EXPECT_TRUE(Bf16Close(label + " q", GatherHeads(out, tokens, stride, 0, q_heads, head_dim),
                          q_ref, kBf16Atol, kBf16Rtol));
    EXPECT_TRUE(Bf16Close(label + " k",
                          GatherHeads(out, tokens, stride, q_heads, kv_heads, head_dim), k_ref,
                          kBf16Atol, kBf16Rtol));
    const int v_head = q_heads + kv_heads;
    EXPECT_TRUE(Bf16Close(label + " v untouched",
                          GatherHeads(out, tokens, stride, v_head, kv_heads, head_dim),
                          GatherHeads(qkv, tokens, stride, v_head, kv_heads, head_dim), 0.0, 0.0));
  }

  // Rotates the adjacent q and k heads of a fused [tokens][q | k | v] buffer in one call.
  void CheckRope(const std::vector<int32_t>& positions, int q_heads, int kv_heads, int head_dim,
                 double theta, const RopeScaling& scaling) {
    const int tokens = static_cast<int>(positions.size());
    const int heads = q_heads + kv_heads;
    const int64_t stride = static_cast<int64_t>(heads + kv_heads) * head_dim;
    const std::vector<float> qkv = RandomBf16Values(rng_, tokens * stride);
    const std::vector<float> inv_freq = RopeInverseFrequencies(head_dim, theta, scaling);
    DeviceBuffer<__nv_bfloat16> d_qkv = UploadBf16(qkv);
    DeviceBuffer<int32_t> d_positions = Upload(positions);
    DeviceBuffer<float> d_inv_freq = Upload(inv_freq);
    ASSERT_STATUS_OK(cuda::ApplyRope({.x = d_qkv.data(),
                                      .row_stride = stride,
                                      .tokens = tokens,
                                      .heads = heads,
                                      .head_dim = head_dim,
                                      .positions = d_positions.data(),
                                      .inv_freq = d_inv_freq.data()},
                                     stream_));
    const std::vector<float> out = DownloadBf16(d_qkv);

    std::vector<float> ref = GatherHeads(qkv, tokens, stride, 0, heads, head_dim);
    std::vector<float> cos(static_cast<size_t>(tokens) * head_dim / 2);
    std::vector<float> sin(cos.size());
    RopeCosSin(positions, inv_freq, cos.data(), sin.data());
    ::rubato::ApplyRope(ref.data(), tokens, heads, head_dim, cos.data(), sin.data());
    const std::string label =
        Label(scaling.type == RopeScaling::Type::kLlama3 ? "rope llama3" : "rope default",
              {{"tokens", tokens},
               {"head_dim", head_dim},
               {"max_position", *std::max_element(positions.begin(), positions.end())}});
    EXPECT_TRUE(Bf16Close(label + " q|k", GatherHeads(out, tokens, stride, 0, heads, head_dim), ref,
                          kBf16Atol, kBf16Rtol));
    EXPECT_TRUE(Bf16Close(label + " v untouched",
                          GatherHeads(out, tokens, stride, heads, kv_heads, head_dim),
                          GatherHeads(qkv, tokens, stride, heads, kv_heads, head_dim), 0.0, 0.0));
  }

  std::vector<int32_t> RandomPositions(int tokens, int max_position) {
    std::uniform_int_distribution<int32_t> pick(0, max_position);
    std::vector<int32_t> positions(tokens);
    for (int32_t& p : positions) p = pick(rng_);
    positions.front() = max_position;
    return positions;
  }

  void CheckSwiGlu(int tokens, int intermediate) {
    const size_t count = static_cast<size_t>(tokens) * intermediate;
    // Gate spans the saturated ends of silu as well as its curved middle.
    const std::vector<float> gate = RandomBf16Values(rng_, count, -8, 8);
    const std::vector<float> up = RandomBf16Values(rng_, count, -2, 2);
    std::vector<float> gate_up(2 * count);  // [tokens][gate | up]
    for (int t = 0; t < tokens; ++t) {
      std::copy_n(gate.begin() + t * intermediate, intermediate,
                  gate_up.begin() + 2 * t * intermediate);
      std::copy_n(up.begin() + t * intermediate, intermediate,
                  gate_up.begin() + (2 * t + 1) * intermediate);
    }
    DeviceBuffer<__nv_bfloat16> d_gate_up = UploadBf16(gate_up);
    DeviceBuffer<__nv_bfloat16> d_out = Poisoned<__nv_bfloat16>(count);
    ASSERT_STATUS_OK(cuda::SwiGlu({.gate_up = d_gate_up.data(),
                                   .out = d_out.data(),
                                   .tokens = tokens,
                                   .intermediate = intermediate},
                                  stream_));
    const std::vector<float> out = DownloadBf16(d_out);
    std::vector<float> ref(count);
    ::rubato::SwiGlu(gate.data(), up.data(), static_cast<int64_t>(count), ref.data());
    EXPECT_TRUE(Bf16Close(Label("swiglu", {{"tokens", tokens}, {"intermediate", intermediate}}),
                          out, ref, kBf16Atol, kBf16Rtol));
  }

  cudaStream_t stream_ = nullptr;
  std::mt19937_64 rng_ = FreshRng();
};

const RopeScaling kNoScaling{};
// Llama 3.1's rope_scaling.
const RopeScaling kLlama3Scaling{.type = RopeScaling::Type::kLlama3,
                                 .factor = 8.0,
                                 .low_freq_factor = 1.0,
                                 .high_freq_factor = 4.0,
                                 .original_max_position_embeddings = 8192};

// ---- embedding -------------------------------------------------------------------------------

TEST_F(ElementwiseOpTest, EmbeddingMatchesCpu) {
  for (int tokens : {1, 3, 17}) {
    for (int hidden : {8, 96, 128, 1024, 4096}) CheckEmbedding(tokens, hidden, 1009);
  }
}

TEST_F(ElementwiseOpTest, EmbeddingWritesNanRowsForOutOfRangeIds) {
  const int hidden = 96, vocab = 7;
  const std::vector<float> table = RandomBf16Values(rng_, vocab * hidden);
  const std::vector<int32_t> ids = {2, -1, 7, 6};
  DeviceBuffer<__nv_bfloat16> d_table = UploadBf16(table);
  DeviceBuffer<int32_t> d_ids = Upload(ids);
  DeviceBuffer<float> d_out = Poisoned<float>(ids.size() * hidden);
  ASSERT_STATUS_OK(cuda::EmbeddingLookup({.table = d_table.data(),
                                          .token_ids = d_ids.data(),
                                          .tokens = 4,
                                          .hidden = hidden,
                                          .vocab_size = vocab,
                                          .out = d_out.data()},
                                         stream_));
  const std::vector<float> out = Download(d_out);
  for (size_t t = 0; t < ids.size(); ++t) {
    const bool valid = ids[t] >= 0 && ids[t] < vocab;
    for (int i = 0; i < hidden; ++i) {
      const float got = out[t * hidden + i];
      if (valid) {
        ASSERT_EQ(got, table[ids[t] * hidden + i]) << "token " << t << " element " << i;
      } else {
        ASSERT_TRUE(std::isnan(got)) << "token " << t << " (id " << ids[t] << ") element " << i;
      }
    }
  }
}

TEST_F(ElementwiseOpTest, EmbeddingLarge) { CheckEmbedding(4099, 4096, 5003); }

// ---- rmsnorm ---------------------------------------------------------------------------------

TEST_F(ElementwiseOpTest, RmsNormMatchesCpuWithAndWithoutResidualAdd) {
  // 8..4096: one vector per thread; 4104 and 8200: 513 / 1025 vectors, so the last warp and the
  // last vector slot of each thread are partly past the row end; 32768: the longest row.
  for (bool with_delta : {false, true}) {
    for (int rows : {1, 3, 17}) {
      for (int dim : {8, 96, 128, 256, 1024, 4096, 4104, 8200, 32768}) {
        CheckRmsNorm(rows, dim, with_delta);
      }
    }
  }
}

TEST_F(ElementwiseOpTest, RmsNormLarge) {
  for (bool with_delta : {false, true}) {
    CheckRmsNorm(4099, 4096, with_delta);
    CheckRmsNorm(4099, 8192, with_delta);
  }
}

// ---- qk-norm ---------------------------------------------------------------------------------

TEST_F(ElementwiseOpTest, HeadRmsNormMatchesCpuOnStridedHeads) {
  for (int tokens : {1, 3, 17}) {
    for (int head_dim : {16, 32, 64, 128}) {
      CheckHeadRmsNorm(tokens, 4, 2, head_dim);
      CheckHeadRmsNorm(tokens, 7, 1, head_dim);  // odd head counts: a partial last warp
    }
  }
}

TEST_F(ElementwiseOpTest, HeadRmsNormLarge) {
  CheckHeadRmsNorm(4099, 32, 8, 128);
  CheckHeadRmsNorm(4099, 16, 8, 64);
}

// ---- rope ------------------------------------------------------------------------------------

TEST_F(ElementwiseOpTest, RopeMatchesCpuAtNearAndFarPositions) {
  for (int tokens : {1, 3, 17}) {
    for (int head_dim : {16, 32, 64, 128}) {
      for (int max_position : {0, 127, 4098, 65536, 200000}) {
        const std::vector<int32_t> positions = RandomPositions(tokens, max_position);
        CheckRope(positions, 4, 2, head_dim, 1e6, kNoScaling);      // Qwen3
        CheckRope(positions, 5, 1, head_dim, 5e5, kLlama3Scaling);  // Llama 3.1; odd head count
      }
    }
  }
}

TEST_F(ElementwiseOpTest, RopeLarge) {
  // A prefill chunk of consecutive positions far into a long context.
  std::vector<int32_t> positions(4099);
  for (size_t t = 0; t < positions.size(); ++t) positions[t] = 196000 + static_cast<int32_t>(t);
  CheckRope(positions, 32, 8, 128, 1e6, kNoScaling);
  CheckRope(positions, 32, 8, 128, 5e5, kLlama3Scaling);
}

// ---- swiglu ----------------------------------------------------------------------------------

TEST_F(ElementwiseOpTest, SwiGluMatchesCpu) {
  for (int tokens : {1, 3, 17}) {
    for (int intermediate : {8, 96, 128, 1024, 3072, 4104}) CheckSwiGlu(tokens, intermediate);
  }
}

TEST_F(ElementwiseOpTest, SwiGluLarge) { CheckSwiGlu(4099, 3072); }

// ---- bad parameters --------------------------------------------------------------------------

TEST_F(ElementwiseOpTest, LaunchersRejectBadParams) {
  DeviceBuffer<__nv_bfloat16> bf16 = Poisoned<__nv_bfloat16>(4096);
  DeviceBuffer<float> f32 = Poisoned<float>(4096);
  DeviceBuffer<int32_t> ints = Poisoned<int32_t>(16);
  const StatusCode kInvalid = StatusCode::kInvalidArgument;
  const StatusCode kUnsupported = StatusCode::kUnsupported;

  const cuda::EmbeddingParams embedding{.table = bf16.data(),
                                        .token_ids = ints.data(),
                                        .tokens = 2,
                                        .hidden = 96,
                                        .vocab_size = 4,
                                        .out = f32.data()};
  auto e = embedding;
  e.hidden = 100;
  EXPECT_TRUE(FailsWith(cuda::EmbeddingLookup(e, stream_), kInvalid, "hidden is 100"));
  e = embedding;
  e.table = nullptr;
  EXPECT_TRUE(FailsWith(cuda::EmbeddingLookup(e, stream_), kInvalid, "table is null"));
  e = embedding;
  e.out = f32.data() + 2;
  EXPECT_TRUE(FailsWith(cuda::EmbeddingLookup(e, stream_), kInvalid, "out is not 16-byte aligned"));
  e = embedding;
  e.tokens = 0;
  e.table = nullptr;
  EXPECT_TRUE(cuda::EmbeddingLookup(e, stream_).ok()) << "tokens = 0 is a no-op";

  const cuda::RmsNormParams rmsnorm{.residual = f32.data(),
                                    .delta = nullptr,
                                    .weight = bf16.data(),
                                    .out = bf16.data() + 1024,
                                    .rows = 2,
                                    .dim = 96};
  auto r = rmsnorm;
  r.dim = 100;
  EXPECT_TRUE(FailsWith(cuda::RmsNorm(r, stream_), kInvalid, "dim is 100"));
  r.dim = 40000;
  EXPECT_TRUE(FailsWith(cuda::RmsNorm(r, stream_), kUnsupported, "dim 40000"));
  r = rmsnorm;
  r.weight = nullptr;
  EXPECT_TRUE(FailsWith(cuda::RmsNorm(r, stream_), kInvalid, "weight is null"));
  r = rmsnorm;
  r.residual = nullptr;
  EXPECT_TRUE(FailsWith(cuda::RmsNorm(r, stream_), kInvalid, "residual is null"));
  r = rmsnorm;
  r.delta = bf16.data() + 4;
  EXPECT_TRUE(FailsWith(cuda::RmsNorm(r, stream_), kInvalid, "delta is not 16-byte aligned"));

  const cuda::HeadRmsNormParams qk_norm{.x = bf16.data(),
                                        .row_stride = 256,
                                        .tokens = 3,
                                        .heads = 2,
                                        .head_dim = 128,
                                        .weight = bf16.data()};
  auto q = qk_norm;
  q.head_dim = 96;
  q.row_stride = 192;
  EXPECT_TRUE(FailsWith(cuda::HeadRmsNormInPlace(q, stream_), kUnsupported, "head_dim 96"));
  q = qk_norm;
  q.x = nullptr;
  EXPECT_TRUE(FailsWith(cuda::HeadRmsNormInPlace(q, stream_), kInvalid, "x is null"));
  q = qk_norm;
  q.row_stride = 128;
  EXPECT_TRUE(FailsWith(cuda::HeadRmsNormInPlace(q, stream_), kInvalid, "row_stride is 128"));

  const cuda::RopeParams rope{.x = bf16.data(),
                              .row_stride = 256,
                              .tokens = 3,
                              .heads = 2,
                              .head_dim = 128,
                              .positions = ints.data(),
                              .inv_freq = f32.data()};
  auto p = rope;
  p.head_dim = 256;
  p.row_stride = 512;
  EXPECT_TRUE(FailsWith(cuda::ApplyRope(p, stream_), kUnsupported, "head_dim 256"));
  p.head_dim = 7;
  EXPECT_TRUE(FailsWith(cuda::ApplyRope(p, stream_), kInvalid, "head_dim is 7"));
  p = rope;
  p.positions = nullptr;
  EXPECT_TRUE(FailsWith(cuda::ApplyRope(p, stream_), kInvalid, "positions is null"));
  p = rope;
  p.inv_freq = nullptr;
  EXPECT_TRUE(FailsWith(cuda::ApplyRope(p, stream_), kInvalid, "inv_freq is null"));
  p = rope;
  p.row_stride = 260;
  EXPECT_TRUE(FailsWith(cuda::ApplyRope(p, stream_), kInvalid, "row_stride is 260"));

  const cuda::SwiGluParams swiglu{
      .gate_up = bf16.data(), .out = bf16.data() + 2048, .tokens = 3, .intermediate = 96};
  auto s = swiglu;
  s.intermediate = 100;
  EXPECT_TRUE(FailsWith(cuda::SwiGlu(s, stream_), kInvalid, "intermediate is 100"));
  s = swiglu;
  s.gate_up = nullptr;
  EXPECT_TRUE(FailsWith(cuda::SwiGlu(s, stream_), kInvalid, "gate_up is null"));
  s = swiglu;
  s.tokens = -1;
  EXPECT_TRUE(FailsWith(cuda::SwiGlu(s, stream_), kInvalid, "tokens is -1"));

  // A rejected call launches nothing: no error is pending and the stream is idle and healthy.
  EXPECT_EQ(cudaSuccess, cudaGetLastError());
  EXPECT_EQ(cudaSuccess, cudaStreamSynchronize(stream_));
}

}  // namespace
}  // namespace rubato::gpu_test
