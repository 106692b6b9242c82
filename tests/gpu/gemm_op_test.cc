// GPU tests of CublasLtGemm (kernels/cuda/gemm.h) against its CPU twin kernels/cpu/linear.h on
// fresh bf16-rounded inputs: rows 1, 3, 17, 129 x in/out 96, 128, 1024, 4096, with and without
// bias, bf16 and f32 output; unaligned pointers; repeated shapes (cached plans) with new data;
// capture in a CUDA graph; rows == 0 as a no-op; bad arguments. *Large* tests hold the model-size
// shapes (MLP 4096 x 12288 both ways, a 151936-token lm_head), which the compute-sanitizer run
// skips.
#include <cuda_bf16.h>
#include <cuda_runtime_api.h>
#include <gtest/gtest.h>

#include <cmath>
#include <cstdint>
#include <random>
#include <string>
#include <string_view>
#include <vector>

#include "kernels/cpu/linear.h"
#include "kernels/cuda/gemm.h"
#include "tests/gpu/gpu_test_util.h"

namespace rubato::gpu_test {
namespace {

using gpu_test::FailsWith;

using cuda::CublasLtGemm;
using cuda::DeviceBuffer;
using cuda::LinearArgs;

// Tolerances against the fp32 reference. bf16 products are exact in fp32, so the GPU and the
// CPU differ by the fp32 summation order (~1e-6 of the sum of |terms|, which is O(1) here since
// weights are scaled by 1/sqrt(in)) and, for bf16 output, the final rounding: half a bf16 ulp
// (2^-9), or one ulp when the order moves a value across a rounding boundary.
constexpr double kBf16Atol = 1e-3, kBf16Rtol = 1e-2;
constexpr double kF32Atol = 1e-4, kF32Rtol = 1e-3;

// One problem: bf16-rounded x, W, bias on the host and their fp32 references.
struct Problem {
  int rows = 0, in = 0, out = 0;
  std::vector<float> x;         // [rows][in], bf16-rounded values
  std::vector<float> weight;    // [out][in], bf16-rounded values, scaled by 1/sqrt(in)
  std::vector<float> bias;      // [out], bf16-rounded values
  std::vector<float> ref;       // [rows][out], f32: x W^T
  std::vector<float> ref_bias;  // [rows][out], f32: x W^T + bias

  static Problem Make(std::mt19937_64& rng, int rows, int in, int out) {
    Problem p;
    p.rows = rows;
    p.in = in;
    p.out = out;
    const float scale = 1.0f / std::sqrt(static_cast<float>(in));
    p.x = RandomBf16Values(rng, static_cast<size_t>(rows) * in);
    p.weight = RandomBf16Values(rng, static_cast<size_t>(out) * in, -scale, scale);
    p.bias = RandomBf16Values(rng, static_cast<size_t>(out), -0.5f, 0.5f);
    p.ref.resize(static_cast<size_t>(rows) * out);
    p.ref_bias.resize(p.ref.size());
    Linear(p.x.data(), p.weight.data(), nullptr, rows, in, out, p.ref.data());
    Linear(p.x.data(), p.weight.data(), p.bias.data(), rows, in, out, p.ref_bias.data());
    return p;
  }
};

std::string Label(const Problem& p, bool bias, DType y_dtype) {
  return "linear rows=" + std::to_string(p.rows) + " in=" + std::to_string(p.in) +
         " out=" + std::to_string(p.out) + (bias ? " +bias" : "") + " " +
         std::string(DTypeName(y_dtype));
}

class GemmOpTest : public ::testing::Test {
 protected:
  void SetUp() override {
    auto gemm = CublasLtGemm::Create();
    ASSERT_TRUE(gemm.ok()) << gemm.status().message();
    gemm_ = std::move(gemm).value();
    ASSERT_CUDA_OK(cudaStreamCreate(&stream_));
  }
  void TearDown() override {
    if (stream_ != nullptr) cudaStreamDestroy(stream_);
  }

  // Runs the four variants (bias or not, bf16 or f32 output) of `p` on the GPU, each into a
  // poisoned output, and compares each with its reference.
  void CheckAllVariants(const Problem& p) {
    DeviceBuffer<__nv_bfloat16> x = UploadBf16(p.x);
    DeviceBuffer<__nv_bfloat16> weight = UploadBf16(p.weight);
    DeviceBuffer<__nv_bfloat16> bias = UploadBf16(p.bias);
    const size_t count = static_cast<size_t>(p.rows) * p.out;
    for (bool with_bias : {false, true}) {
      const std::vector<float>& ref = with_bias ? p.ref_bias : p.ref;
      LinearArgs args;
      args.x = x.data();
      args.weight = weight.data();
      args.bias = with_bias ? bias.data() : nullptr;
      args.rows = p.rows;
      args.in_features = p.in;
      args.out_features = p.out;

      DeviceBuffer<__nv_bfloat16> y_bf16 = Poisoned<__nv_bfloat16>(count);
      args.y = y_bf16.data();
      args.y_dtype = DType::kBF16;
      ASSERT_STATUS_OK(gemm_->Linear(args, stream_));
      ASSERT_CUDA_OK(cudaStreamSynchronize(stream_));
      EXPECT_TRUE(Bf16Close(Label(p, with_bias, DType::kBF16), DownloadBf16(y_bf16), ref, kBf16Atol,
                            kBf16Rtol));

      DeviceBuffer<float> y_f32 = Poisoned<float>(count);
      args.y = y_f32.data();
      args.y_dtype = DType::kF32;
      ASSERT_STATUS_OK(gemm_->Linear(args, stream_));
      ASSERT_CUDA_OK(cudaStreamSynchronize(stream_));
      EXPECT_TRUE(
          Bf16Close(Label(p, with_bias, DType::kF32), Download(y_f32), ref, kF32Atol, kF32Rtol));
    }
  }

  std::unique_ptr<CublasLtGemm> gemm_;
  cudaStream_t stream_ = nullptr;
};

TEST_F(GemmOpTest, MatchesCpuLinearOverShapes) {
  std::mt19937_64 rng = FreshRng();
  const int features[] = {96, 128, 1024, 4096};
  for (int rows : {1, 3, 17, 129}) {
    for (int in : features) {
      for (int out : features) {
        CheckAllVariants(Problem::Make(rng, rows, in, out));
        if (HasFatalFailure()) return;
      }
    }
  }
}

TEST_F(GemmOpTest, RepeatedShapesReuseTheirPlanOnNewData) {
  // Same shapes again, fresh values and fresh buffers: a cached plan must not hold on to the
  // first call's pointers (bias pointer included).
  std::mt19937_64 rng = FreshRng();
  for (int round = 0; round < 3; ++round) {
    CheckAllVariants(Problem::Make(rng, 17, 1024, 128));
    if (HasFatalFailure()) return;
    CheckAllVariants(Problem::Make(rng, 1, 128, 1024));
    if (HasFatalFailure()) return;
  }
}

TEST_F(GemmOpTest, UnalignedPointers) {
  // x, weight and bias starting one element past an allocation (2-byte alignment), y aligned
  // or not: the plan must be one that the heuristic chose for that alignment, not the 256-byte
  // one.
  std::mt19937_64 rng = FreshRng();
  const Problem p = Problem::Make(rng, 3, 128, 96);
  std::vector<float> x(p.x), weight(p.weight), bias(p.bias);
  x.insert(x.begin(), 0.f);
  weight.insert(weight.begin(), 0.f);
  bias.insert(bias.begin(), 0.f);
  DeviceBuffer<__nv_bfloat16> x_dev = UploadBf16(x), w_dev = UploadBf16(weight),
                              b_dev = UploadBf16(bias);
  for (int shift : {0, 1}) {
    LinearArgs args;
    args.x = x_dev.data() + 1;
    args.weight = w_dev.data() + 1;
    args.bias = b_dev.data() + 1;
    args.rows = p.rows;
    args.in_features = p.in;
    args.out_features = p.out;
    const size_t count = static_cast<size_t>(p.rows) * p.out;
    DeviceBuffer<__nv_bfloat16> y_bf16 = Poisoned<__nv_bfloat16>(count + 1);
    args.y = y_bf16.data() + shift;
    ASSERT_STATUS_OK(gemm_->Linear(args, stream_));
    std::vector<float> got = DownloadBf16(y_bf16);
    got.erase(got.begin() + shift + static_cast<ptrdiff_t>(count), got.end());
    got.erase(got.begin(), got.begin() + shift);
    EXPECT_TRUE(Bf16Close("unaligned bf16", got, p.ref_bias, kBf16Atol, kBf16Rtol));

    DeviceBuffer<float> y_f32 = Poisoned<float>(count + 1);
    args.y = y_f32.data() + shift;
    args.y_dtype = DType::kF32;
    ASSERT_STATUS_OK(gemm_->Linear(args, stream_));
    std::vector<float> got_f32 = Download(y_f32);
    got_f32.erase(got_f32.begin() + shift + static_cast<ptrdiff_t>(count), got_f32.end());
    got_f32.erase(got_f32.begin(), got_f32.begin() + shift);
    EXPECT_TRUE(Bf16Close("unaligned f32", got_f32, p.ref_bias, kF32Atol, kF32Rtol));
  }
}

TEST_F(GemmOpTest, CapturedInACudaGraph) {
  // A warm-up call makes the plans; then the same calls, with the bias widening of the f32 one,
  // are captured and replayed: nothing in them may allocate, synchronize or query.
  std::mt19937_64 rng = FreshRng();
  const Problem p = Problem::Make(rng, 3, 1024, 128);
  DeviceBuffer<__nv_bfloat16> x = UploadBf16(p.x), weight = UploadBf16(p.weight),
                              bias = UploadBf16(p.bias);
  const size_t count = static_cast<size_t>(p.rows) * p.out;
  DeviceBuffer<__nv_bfloat16> y_bf16 = Poisoned<__nv_bfloat16>(count);
  DeviceBuffer<float> y_f32 = Poisoned<float>(count);
  LinearArgs bf16_args{x.data(),     weight.data(), bias.data(), y_bf16.data(),
                       DType::kBF16, p.rows,        p.in,        p.out};
  LinearArgs f32_args = bf16_args;
  f32_args.y = y_f32.data();
  f32_args.y_dtype = DType::kF32;
  ASSERT_STATUS_OK(gemm_->Linear(bf16_args, stream_));
  ASSERT_STATUS_OK(gemm_->Linear(f32_args, stream_));
  ASSERT_CUDA_OK(cudaStreamSynchronize(stream_));
  ASSERT_CUDA_OK(cudaMemset(y_bf16.data(), 0xFF, y_bf16.bytes()));
  ASSERT_CUDA_OK(cudaMemset(y_f32.data(), 0xFF, y_f32.bytes()));

  cudaGraph_t graph = nullptr;
  ASSERT_CUDA_OK(cudaStreamBeginCapture(stream_, cudaStreamCaptureModeGlobal));
  const Status bf16_status = gemm_->Linear(bf16_args, stream_);
  const Status f32_status = gemm_->Linear(f32_args, stream_);
  ASSERT_CUDA_OK(cudaStreamEndCapture(stream_, &graph));
  ASSERT_STATUS_OK(bf16_status);
  ASSERT_STATUS_OK(f32_status);
  cudaGraphExec_t exec = nullptr;
  ASSERT_CUDA_OK(cudaGraphInstantiate(&exec, graph, 0));
  ASSERT_CUDA_OK(cudaGraphLaunch(exec, stream_));
  ASSERT_CUDA_OK(cudaStreamSynchronize(stream_));
  EXPECT_TRUE(Bf16Close("graph bf16", DownloadBf16(y_bf16), p.ref_bias, kBf16Atol, kBf16Rtol));
  EXPECT_TRUE(Bf16Close("graph f32", Download(y_f32), p.ref_bias, kF32Atol, kF32Rtol));
  cudaGraphExecDestroy(exec);
  cudaGraphDestroy(graph);
}

TEST_F(GemmOpTest, ZeroRowsIsANoOp) {
  DeviceBuffer<__nv_bfloat16> weight = Poisoned<__nv_bfloat16>(96 * 128);
  DeviceBuffer<float> y = Poisoned<float>(16);
  LinearArgs args;
  args.weight = weight.data();
  args.rows = 0;
  args.in_features = 128;
  args.out_features = 96;
  ASSERT_STATUS_OK(gemm_->Linear(args, stream_));  // x and y may be null
  args.y = y.data();
  args.y_dtype = DType::kF32;
  ASSERT_STATUS_OK(gemm_->Linear(args, stream_));
  for (float v : Download(y)) EXPECT_TRUE(std::isnan(v)) << "rows == 0 wrote to y";
}

TEST_F(GemmOpTest, RejectsBadArguments) {
  DeviceBuffer<__nv_bfloat16> buffer = Poisoned<__nv_bfloat16>(128 * 128);
  const LinearArgs good{
      buffer.data(), buffer.data(), nullptr, buffer.data(), DType::kBF16, 1, 128, 96};
  LinearArgs a = good;
  a.weight = nullptr;
  EXPECT_TRUE(FailsWith(gemm_->Linear(a, stream_), StatusCode::kInvalidArgument, "weight"));
  a = good;
  a.x = nullptr;
  EXPECT_TRUE(FailsWith(gemm_->Linear(a, stream_), StatusCode::kInvalidArgument, "x is null"));
  a = good;
  a.y = nullptr;
  EXPECT_TRUE(FailsWith(gemm_->Linear(a, stream_), StatusCode::kInvalidArgument, "y is null"));
  a = good;
  a.rows = -1;
  EXPECT_TRUE(FailsWith(gemm_->Linear(a, stream_), StatusCode::kInvalidArgument, "rows"));
  a = good;
  a.in_features = 0;
  EXPECT_TRUE(FailsWith(gemm_->Linear(a, stream_), StatusCode::kInvalidArgument, "in_features"));
  a = good;
  a.out_features = -3;
  EXPECT_TRUE(FailsWith(gemm_->Linear(a, stream_), StatusCode::kInvalidArgument, "out_features"));
  a = good;
  a.y_dtype = DType::kF16;
  EXPECT_TRUE(FailsWith(gemm_->Linear(a, stream_), StatusCode::kInvalidArgument, "y_dtype"));
  // The message names the shape.
  a = good;
  a.weight = nullptr;
  EXPECT_TRUE(FailsWith(gemm_->Linear(a, stream_), StatusCode::kInvalidArgument,
                        "y[1 x 96] bf16 = x[1 x 128] . W[96 x 128]^T"));
  ASSERT_CUDA_OK(cudaStreamSynchronize(stream_));
}

TEST_F(GemmOpTest, LargeModelShapes) {
  // Qwen3-8B's MLP (gate/up 4096 -> 12288, down 12288 -> 4096) at decode and prefill row counts.
  std::mt19937_64 rng = FreshRng();
  for (int rows : {1, 17, 129}) {
    CheckAllVariants(Problem::Make(rng, rows, 4096, 12288));
    if (HasFatalFailure()) return;
    CheckAllVariants(Problem::Make(rng, rows, 12288, 4096));
    if (HasFatalFailure()) return;
  }
}

TEST_F(GemmOpTest, LargeLmHeadF32Logits) {
  // Qwen3-0.6B's lm_head: hidden 1024 -> vocab 151936, f32 logits for 3 rows.
  std::mt19937_64 rng = FreshRng();
  const Problem p = Problem::Make(rng, 3, 1024, 151936);
  DeviceBuffer<__nv_bfloat16> x = UploadBf16(p.x), weight = UploadBf16(p.weight);
  DeviceBuffer<float> y = Poisoned<float>(static_cast<size_t>(p.rows) * p.out);
  const LinearArgs args{x.data(),    weight.data(), nullptr, y.data(),
                        DType::kF32, p.rows,        p.in,    p.out};
  ASSERT_STATUS_OK(gemm_->Linear(args, stream_));
  EXPECT_TRUE(Bf16Close("lm_head f32", Download(y), p.ref, kF32Atol, kF32Rtol));
}

}  // namespace
}  // namespace rubato::gpu_test
