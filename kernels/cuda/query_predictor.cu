// The device query predictor (query_predictor.cuh). One block per query head: the warps fill the
// Gram matrix of the newest m + 1 queries in double (m = min(W, count - 1)); then thread k - 1
// solves window size k's ridge system (k x k Cholesky in shared memory) and softmax-normalises
// its weights; the shifted-window weights are summed per query in a fixed order and applied
// along dim. The dot products are reduced in another order than the CPU twin's sequential sums,
// so the two agree to double rounding before the final fp32 rounding.
#include <cmath>
#include <string>

#include "kernels/cuda/cuda_status.h"
#include "kernels/cuda/query_predictor.cuh"

namespace rubato::cuda {
namespace {

constexpr int kThreads = 128;
constexpr int kRows = kDeviceQueryWindowMax + 1;  // the most queries a prediction reads
// Shared scratch of the solves: window size k's k x k matrix at offset sum_{j < k} j^2.
constexpr int kScratch =
    kDeviceQueryWindowMax * (kDeviceQueryWindowMax + 1) * (2 * kDeviceQueryWindowMax + 1) / 6;

// Solves A x = b in place (A [n][n] row-major, overwritten by its Cholesky factor; b by x), the
// twin of the CPU CholeskySolve with the same guard on a vanishing pivot.
__device__ void CholeskySolve(double* a, double* b, int n) {
  for (int j = 0; j < n; ++j) {
    double d = a[j * n + j];
    for (int p = 0; p < j; ++p) d -= a[j * n + p] * a[j * n + p];
    const double root = sqrt(fmax(d, 1e-300));
    a[j * n + j] = root;
    for (int i = j + 1; i < n; ++i) {
      double s = a[i * n + j];
      for (int p = 0; p < j; ++p) s -= a[i * n + p] * a[j * n + p];
      a[i * n + j] = s / root;
    }
  }
  for (int i = 0; i < n; ++i) {
    double s = b[i];
    for (int p = 0; p < i; ++p) s -= a[i * n + p] * b[p];
    b[i] = s / a[i * n + i];
  }
  for (int i = n - 1; i >= 0; --i) {
    double s = b[i];
    for (int p = i + 1; p < n; ++p) s -= a[p * n + i] * b[p];
    b[i] = s / a[i * n + i];
  }
}

__global__ void __launch_bounds__(kThreads) PredictQueriesKernel(PredictQueriesParams p) {
  __shared__ double gram[kRows][kRows];
  __shared__ double scratch[kScratch];
  __shared__ double weights[kDeviceQueryWindowMax][kDeviceQueryWindowMax];
  __shared__ double coef[kRows];
  const int head = static_cast<int>(blockIdx.x);
  const int tid = static_cast<int>(threadIdx.x);
  float* out = p.predicted + static_cast<size_t>(head) * p.dim;
  const int n = p.count[head];
  const int next = p.next[head];
  if (n < 1 || n > p.capacity || next < 0 || next >= p.capacity) {
    for (int d = tid; d < p.dim; d += kThreads) out[d] = 0.0f;
    return;
  }
  // Ordered row i (0 = oldest, n - 1 = newest) of this head's ring.
  auto row = [&](int i) {
    const int slot = (next - n + i + 2 * p.capacity) % p.capacity;
    return p.ring + (static_cast<size_t>(head) * p.capacity + slot) * p.dim;
  };
  const int m = min(p.max_window, n - 1);
  if (m <= 0) {
    const float* newest = row(n - 1);
    for (int d = tid; d < p.dim; d += kThreads) out[d] = newest[d];
    return;
  }
  // Gram of the rows n-1-m .. n-1 (local index a = row - (n - 1 - m); the target is a = m).
  const int base = n - 1 - m;
  const int warp = tid / 32, lane = tid % 32;
  const int pairs = (m + 1) * (m + 2) / 2;
  for (int pair = warp; pair < pairs; pair += kThreads / 32) {
    int a = 0;
    while ((a + 1) * (a + 2) / 2 <= pair) ++a;
    const int b = pair - a * (a + 1) / 2;
    const float* x = row(base + a);
    const float* y = row(base + b);
    double s = 0.0;
    for (int d = lane; d < p.dim; d += 32) s += static_cast<double>(x[d]) * y[d];
    for (int offset = 16; offset > 0; offset /= 2) s += __shfl_xor_sync(0xffffffffu, s, offset);
    if (lane == 0) gram[a][b] = gram[b][a] = s;
  }
  __syncthreads();
  if (tid < m) {
    // Window size k: H_k = rows n-1-k .. n-2 (local m-k .. m-1), the target the newest (m).
    const int k = tid + 1;
    double* a = scratch + (k - 1) * k * (2 * k - 1) / 6;
    double* w = weights[k - 1];
    double trace = 0.0;
    for (int i = 0; i < k; ++i) trace += gram[m - k + i][m - k + i];
    if (trace <= 0.0) {
      for (int i = 0; i < k; ++i) w[i] = 0.0;
    } else {
      const double lambda = p.ridge_lambda * trace / k;
      for (int i = 0; i < k; ++i) {
        for (int j = 0; j < k; ++j) a[i * k + j] = gram[m - k + i][m - k + j];
        a[i * k + i] += lambda;
        w[i] = gram[m - k + i][m];
      }
      CholeskySolve(a, w, k);
    }
    double top = w[0];
    for (int i = 1; i < k; ++i) top = fmax(top, w[i]);
    double z = 0.0;
    for (int i = 0; i < k; ++i) z += (w[i] = exp(w[i] - top));
    for (int i = 0; i < k; ++i) w[i] /= z;
  }
  __syncthreads();
  // Row r of H_k weighs ordered row n-k+r (local m+1-k+r); sum each row's weights over k.
  if (tid <= m) {
    double c = 0.0;
    for (int k = 1; k <= m; ++k) {
      const int r = tid - (m + 1 - k);
      if (r >= 0 && r < k) c += weights[k - 1][r];
    }
    coef[tid] = c;
  }
  __syncthreads();
  for (int d = tid; d < p.dim; d += kThreads) {
    double s = 0.0;
    for (int e = 1; e <= m; ++e) s += coef[e] * row(base + e)[d];
    out[d] = static_cast<float>(s / m);
  }
}

}  // namespace

Status PredictQueries(const PredictQueriesParams& params, cudaStream_t stream) {
  if (params.heads < 0 || params.dim <= 0 || params.capacity < 1 ||
      params.capacity > kDeviceQueryWindowMax + 1 || params.max_window < 0 ||
      params.max_window > params.capacity - 1 || !(params.ridge_lambda > 0.0)) {
    return InvalidArgumentError(
        "predict queries: heads " + std::to_string(params.heads) + ", dim " +
        std::to_string(params.dim) + ", capacity " + std::to_string(params.capacity) +
        " (at most " + std::to_string(kDeviceQueryWindowMax + 1) + "), max_window " +
        std::to_string(params.max_window) + " (at most capacity - 1), ridge_lambda " +
        std::to_string(params.ridge_lambda) + " (> 0)");
  }
  if (params.heads == 0) return Status::Ok();
  if (params.ring == nullptr || params.next == nullptr || params.count == nullptr ||
      params.predicted == nullptr) {
    return InvalidArgumentError("predict queries: ring, next, count and predicted must be set");
  }
  PredictQueriesKernel<<<params.heads, kThreads, 0, stream>>>(params);
  return CudaStatus(cudaGetLastError(), "predict queries launch");
}

}  // namespace rubato::cuda
