// Helpers shared by the GPU op tests (tests/gpu): fresh random inputs, device upload and
// download, poisoned outputs, and the two accuracy checks of docs/design.md §7 (every element
// within atol + rtol * |ref|, and relative L2 error under a bound).
#pragma once

#include <cuda_bf16.h>
#include <cuda_runtime_api.h>
#include <gtest/gtest.h>

#include <cmath>
#include <cstdint>
#include <cstring>
#include <random>
#include <span>
#include <string>
#include <string_view>
#include <vector>

#include "common/dtype.h"
#include "common/status.h"
#include "kernels/cpu/all_close_for_test.h"
#include "kernels/cuda/device_buffer.h"

namespace rubato::gpu_test {

#define ASSERT_CUDA_OK(expr) \
  ASSERT_EQ(cudaSuccess, (expr)) << cudaGetErrorString(cudaGetLastError())
#define ASSERT_STATUS_OK(expr)            \
  do {                                    \
    const ::rubato::Status s_ = (expr);   \
    ASSERT_TRUE(s_.ok()) << s_.message(); \
  } while (0)

// A generator seeded from the test's wall clock unless RUBATO_TEST_SEED is set; the seed is
// printed so a failure can be replayed (fresh inputs every run: docs/design.md §10 "Every
// element").
inline std::mt19937_64 FreshRng() {
  uint64_t seed = std::random_device{}();
  if (const char* fixed = std::getenv("RUBATO_TEST_SEED")) seed = std::strtoull(fixed, nullptr, 10);
  std::cout << "[ seed      ] RUBATO_TEST_SEED=" << seed << "\n";
  return std::mt19937_64(seed);
}

// `count` values uniform in [lo, hi), already rounded to bf16 (so the CPU reference sees exactly
// what the GPU sees).
inline std::vector<float> RandomBf16Values(std::mt19937_64& rng, size_t count, float lo = -1.f,
                                           float hi = 1.f) {
  std::uniform_real_distribution<float> dist(lo, hi);
  std::vector<float> values(count);
  for (float& v : values) v = Bf16ToF32(F32ToBf16(dist(rng)));
  return values;
}

inline std::vector<__nv_bfloat16> ToBf16(std::span<const float> values) {
  std::vector<__nv_bfloat16> out(values.size());
  for (size_t i = 0; i < values.size(); ++i) {
    const uint16_t bits = F32ToBf16(values[i]);
    std::memcpy(static_cast<void*>(&out[i]), &bits, sizeof(bits));  // __nv_bfloat16: raw bits
  }
  return out;
}

inline std::vector<float> FromBf16(std::span<const __nv_bfloat16> values) {
  std::vector<float> out(values.size());
  for (size_t i = 0; i < values.size(); ++i) {
    uint16_t bits;
    std::memcpy(&bits, &values[i], sizeof(bits));
    out[i] = Bf16ToF32(bits);
  }
  return out;
}

// Uploads host values to a new device buffer (synchronously); aborts the test on failure.
template <typename T>
cuda::DeviceBuffer<T> Upload(std::span<const T> host) {
  auto buffer = cuda::DeviceBuffer<T>::Allocate(host.size(), "test input");
  EXPECT_TRUE(buffer.ok()) << buffer.status().message();
  if (!buffer.ok()) return {};
  EXPECT_EQ(cudaSuccess, cudaMemcpy(buffer->data(), host.data(), host.size() * sizeof(T),
                                    cudaMemcpyHostToDevice));
  return std::move(*buffer);
}
template <typename T>
cuda::DeviceBuffer<T> Upload(const std::vector<T>& host) {
  return Upload(std::span<const T>(host));
}

inline cuda::DeviceBuffer<__nv_bfloat16> UploadBf16(std::span<const float> host) {
  return Upload(ToBf16(host));
}

// A device buffer of `count` elements filled with 0xFF bytes (NaN for floats, -1 for ints), so
// that an element the kernel forgot to write fails the comparison.
template <typename T>
cuda::DeviceBuffer<T> Poisoned(size_t count) {
  auto buffer = cuda::DeviceBuffer<T>::Allocate(count, "test output");
  EXPECT_TRUE(buffer.ok()) << buffer.status().message();
  if (!buffer.ok()) return {};
  EXPECT_EQ(cudaSuccess, cudaMemset(buffer->data(), 0xFF, count * sizeof(T)));
  return std::move(*buffer);
}

// Synchronizes and downloads the whole buffer.
template <typename T>
std::vector<T> Download(const cuda::DeviceBuffer<T>& buffer) {
  std::vector<T> host(buffer.size());
  EXPECT_EQ(cudaSuccess, cudaDeviceSynchronize()) << cudaGetErrorString(cudaGetLastError());
  EXPECT_EQ(cudaSuccess,
            cudaMemcpy(host.data(), buffer.data(), buffer.bytes(), cudaMemcpyDeviceToHost));
  return host;
}

inline std::vector<float> DownloadBf16(const cuda::DeviceBuffer<__nv_bfloat16>& buffer) {
  return FromBf16(Download(buffer));
}

// ||actual - expected|| / ||expected|| <= bound (NaN fails), printing the error.
inline ::testing::AssertionResult RelativeL2Below(const std::string& what,
                                                  std::span<const float> actual,
                                                  std::span<const float> expected, double bound) {
  if (actual.size() != expected.size()) {
    return ::testing::AssertionFailure()
           << what << ": size " << actual.size() << " vs " << expected.size();
  }
  double diff = 0.0, norm = 0.0;
  for (size_t i = 0; i < actual.size(); ++i) {
    const double d = static_cast<double>(actual[i]) - expected[i];
    diff += d * d;
    norm += static_cast<double>(expected[i]) * expected[i];
  }
  const double relative = std::sqrt(diff) / std::max(std::sqrt(norm), 1e-30);
  std::cout << "[ rel L2    ] " << what << ": " << relative << "\n";
  if (relative <= bound) return ::testing::AssertionSuccess();
  return ::testing::AssertionFailure()
         << what << ": relative L2 error " << relative << " > " << bound;
}

// Both checks of docs/design.md §7 at once (the bf16 defaults: rel L2 1e-2).
inline ::testing::AssertionResult Bf16Close(const std::string& what, std::span<const float> actual,
                                            std::span<const float> expected, double atol,
                                            double rtol, double rel_l2 = 1e-2) {
  auto elementwise = AllClose<float>(what, actual, expected, atol, rtol);
  if (!elementwise) return elementwise;
  return RelativeL2Below(what, actual, expected, rel_l2);
}

// `status` is an error of `code` whose message contains `needle` (the launchers' validation
// names the field at fault); the message is printed either way.
inline ::testing::AssertionResult FailsWith(const Status& status, StatusCode code,
                                            std::string_view needle) {
  if (status.ok()) return ::testing::AssertionFailure() << "accepted; expected '" << needle << "'";
  if (status.code() != code || status.message().find(needle) == std::string::npos) {
    return ::testing::AssertionFailure()
           << "got '" << status.message() << "' (" << StatusCodeName(status.code())
           << "), expected '" << needle << "' (" << StatusCodeName(code) << ")";
  }
  return ::testing::AssertionSuccess() << status.message();
}

}  // namespace rubato::gpu_test
