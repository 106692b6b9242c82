// CublasLtGemm (gemm.h): y = x W^T (+ bias) through cuBLASLt, bf16 A/B, fp32 accumulation, bf16
// or f32 D, computed as the column-major transpose ("TN") with nothing moved. Plans are cached
// per (shape, bias, y dtype, pointer alignments): a new key's first call queries the heuristic
// (and may allocate the f32 bias copy), and for a weight-bound shape times the heuristic's answers
// and keeps the fastest (a host sync, once per key), so make it outside graph capture. Not
// thread-safe: calls must be ordered (one stream, or streams ordered by events).
// Narrative (the layouts, plan keys, bias widening): docs/cuda_model.md "GEMM".
#include "kernels/cuda/gemm.h"

#include <cublasLt.h>

#include <algorithm>
#include <cstdint>
#include <cstdlib>
#include <string>
#include <unordered_map>
#include <utility>
#include <vector>

#include "kernels/cuda/cuda_status.h"
#include "kernels/cuda/device_buffer.h"

namespace rubato::cuda {
namespace {

Status CublasStatus(cublasStatus_t status, const std::string& what) {
  if (status == CUBLAS_STATUS_SUCCESS) return Status::Ok();
  std::string message = "cuBLASLt: " + what + ": " + cublasLtGetStatusName(status) + " (" +
                        cublasLtGetStatusString(status) + ")";
  switch (status) {
    case CUBLAS_STATUS_ALLOC_FAILED:
      return ResourceExhaustedError(std::move(message));
    case CUBLAS_STATUS_NOT_SUPPORTED:
    case CUBLAS_STATUS_ARCH_MISMATCH:
      return UnsupportedError(std::move(message));
    case CUBLAS_STATUS_NOT_INITIALIZED:
      return UnavailableError(std::move(message));
    default:
      return InternalError(std::move(message));
  }
}

#define RUBATO_CUBLAS_RETURN_IF_ERROR(expr, what)                          \
  do {                                                                     \
    ::rubato::Status rubato_cublas_status_ = CublasStatus((expr), (what)); \
    if (!rubato_cublas_status_.ok()) return rubato_cublas_status_;         \
  } while (0)

// Largest power of two (<= 256, cuBLASLt's default assumption) dividing the address.
uint32_t AlignmentOf(const void* pointer) {
  const uintptr_t address = reinterpret_cast<uintptr_t>(pointer);
  if (address == 0) return 256;
  return static_cast<uint32_t>(std::min<uintptr_t>(256, address & (~address + 1)));
}

// What a plan depends on. Pointers themselves are not part of it: they are passed per call.
struct PlanKey {
  int rows = 0;
  int in_features = 0;
  int out_features = 0;
  bool bias = false;
  DType y_dtype = DType::kBF16;
  uint32_t align_x = 0, align_weight = 0, align_y = 0, align_bias = 0;

  bool operator==(const PlanKey&) const = default;
};

struct PlanKeyHash {
  size_t operator()(const PlanKey& k) const {
    uint64_t h = 1469598103934665603ull;  // FNV-1a over the fields
    for (uint64_t v : {uint64_t(k.rows), uint64_t(k.in_features), uint64_t(k.out_features),
                       uint64_t(k.bias), uint64_t(k.y_dtype), uint64_t(k.align_x),
                       uint64_t(k.align_weight), uint64_t(k.align_y), uint64_t(k.align_bias)}) {
      h = (h ^ v) * 1099511628211ull;
    }
    return static_cast<size_t>(h);
  }
};

// One shape's cuBLASLt objects. Owns its descriptors (destroyed with it).
struct Plan {
  cublasLtMatmulDesc_t matmul = nullptr;
  cublasLtMatrixLayout_t weight_layout = nullptr;  // A: col-major [in x out], ld in, bf16
  cublasLtMatrixLayout_t x_layout = nullptr;       // B: col-major [in x rows], ld in, bf16
  cublasLtMatrixLayout_t y_layout = nullptr;       // C = D: col-major [out x rows], ld out
  cublasLtMatmulAlgo_t algo{};
  size_t workspace_bytes = 0;  // what the chosen algorithm uses (<= the gemm's workspace)
  // The heuristic's other answers, timed at the plan's first call outside capture (Tune).
  std::vector<cublasLtMatmulHeuristicResult_t> candidates;
  bool tuned = false;
  DeviceBuffer<float> bias_f32;  // [out_features], f32: the bias widened, f32 output only

  Plan() = default;
  Plan(const Plan&) = delete;
  Plan& operator=(const Plan&) = delete;
  ~Plan() {
    if (y_layout != nullptr) cublasLtMatrixLayoutDestroy(y_layout);
    if (x_layout != nullptr) cublasLtMatrixLayoutDestroy(x_layout);
    if (weight_layout != nullptr) cublasLtMatrixLayoutDestroy(weight_layout);
    if (matmul != nullptr) cublasLtMatmulDescDestroy(matmul);
  }
};

std::string Describe(const LinearArgs& a) {
  return "y[" + std::to_string(a.rows) + " x " + std::to_string(a.out_features) + "] " +
         std::string(DTypeName(a.y_dtype)) + " = x[" + std::to_string(a.rows) + " x " +
         std::to_string(a.in_features) + "] . W[" + std::to_string(a.out_features) + " x " +
         std::to_string(a.in_features) + "]^T" + (a.bias != nullptr ? " + bias" : "");
}

Status ValidateLinearArgs(const LinearArgs& a) {
  const std::string where = "cuBLASLt linear " + Describe(a) + ": ";
  if (a.rows < 0) return InvalidArgumentError(where + "rows must be >= 0");
  if (a.in_features <= 0) return InvalidArgumentError(where + "in_features must be positive");
  if (a.out_features <= 0) return InvalidArgumentError(where + "out_features must be positive");
  if (a.y_dtype != DType::kBF16 && a.y_dtype != DType::kF32) {
    return InvalidArgumentError(where + "y_dtype must be bf16 or f32");
  }
  if (a.weight == nullptr) return InvalidArgumentError(where + "weight is null");
  if (a.rows > 0 && a.x == nullptr) return InvalidArgumentError(where + "x is null");
  if (a.rows > 0 && a.y == nullptr) return InvalidArgumentError(where + "y is null");
  return Status::Ok();
}

class CublasLtGemmImpl final : public CublasLtGemm {
 public:
  CublasLtGemmImpl(cublasLtHandle_t handle, DeviceBuffer<uint8_t> workspace)
      : handle_(handle), workspace_(std::move(workspace)) {}
  ~CublasLtGemmImpl() override {
    plans_.clear();  // descriptors before the handle
    cublasLtDestroy(handle_);
  }

  Status Linear(const LinearArgs& args, cudaStream_t stream) override {
    RUBATO_RETURN_IF_ERROR(ValidateLinearArgs(args));
    if (args.rows == 0) return Status::Ok();
    const bool f32_bias = args.bias != nullptr && args.y_dtype == DType::kF32;
    const PlanKey key{args.rows, args.in_features, args.out_features, args.bias != nullptr,
                      args.y_dtype, AlignmentOf(args.x), AlignmentOf(args.weight),
                      AlignmentOf(args.y),
                      // The f32 bias copy is the plan's own (cudaMalloc, 256-aligned).
                      args.bias == nullptr || f32_bias ? 256u : AlignmentOf(args.bias)};
    auto found = plans_.find(key);
    if (found == plans_.end()) {
      Result<std::unique_ptr<Plan>> plan = MakePlan(key, args);
      if (!plan.ok()) return plan.status();
      found = plans_.emplace(key, std::move(plan).value()).first;
    }
    Plan& plan = *found->second;
    const std::string what = "cublasLtMatmul " + Describe(args);

    const void* bias = args.bias;
    if (f32_bias) {
      RUBATO_RETURN_IF_ERROR(WidenBias(args, plan, stream));
      bias = plan.bias_f32.data();
    }
    if (bias != nullptr) {
      // The descriptor is the plan's; only the pointer changes from call to call (each layer's
      // bias), read by cublasLtMatmul when it enqueues.
      RUBATO_CUBLAS_RETURN_IF_ERROR(
          cublasLtMatmulDescSetAttribute(plan.matmul, CUBLASLT_MATMUL_DESC_BIAS_POINTER, &bias,
                                         sizeof(bias)),
          what + ": setting the bias pointer");
    }
    if (!plan.tuned) RUBATO_RETURN_IF_ERROR(Tune(args, plan, stream));
    const float alpha = 1.0f, beta = 0.0f;
    RUBATO_CUBLAS_RETURN_IF_ERROR(
        cublasLtMatmul(handle_, plan.matmul, &alpha, args.weight, plan.weight_layout, args.x,
                       plan.x_layout, &beta, args.y, plan.y_layout, args.y, plan.y_layout,
                       &plan.algo, workspace_.data(), plan.workspace_bytes, stream),
        what);
    return Status::Ok();
  }

 private:
  Result<std::unique_ptr<Plan>> MakePlan(const PlanKey& key, const LinearArgs& args) {
    const std::string what = "planning " + Describe(args);
    auto plan = std::make_unique<Plan>();
    const cudaDataType_t y_type = key.y_dtype == DType::kF32 ? CUDA_R_32F : CUDA_R_16BF;
    RUBATO_CUBLAS_RETURN_IF_ERROR(
        cublasLtMatmulDescCreate(&plan->matmul, CUBLAS_COMPUTE_32F, CUDA_R_32F), what);
    const cublasOperation_t transpose = CUBLAS_OP_T, keep = CUBLAS_OP_N;
    RUBATO_CUBLAS_RETURN_IF_ERROR(
        cublasLtMatmulDescSetAttribute(plan->matmul, CUBLASLT_MATMUL_DESC_TRANSA, &transpose,
                                       sizeof(transpose)),
        what);
    RUBATO_CUBLAS_RETURN_IF_ERROR(
        cublasLtMatmulDescSetAttribute(plan->matmul, CUBLASLT_MATMUL_DESC_TRANSB, &keep,
                                       sizeof(keep)),
        what);
    const void* bias = nullptr;
    if (key.bias) {
      if (key.y_dtype == DType::kF32) {
        RUBATO_ASSIGN_OR_RETURN(
            plan->bias_f32,
            DeviceBuffer<float>::Allocate(static_cast<size_t>(key.out_features), "f32 GEMM bias"));
        bias = plan->bias_f32.data();
      } else {
        bias = args.bias;  // only its alignment matters to the heuristic
      }
      const cublasLtEpilogue_t epilogue = CUBLASLT_EPILOGUE_BIAS;
      RUBATO_CUBLAS_RETURN_IF_ERROR(
          cublasLtMatmulDescSetAttribute(plan->matmul, CUBLASLT_MATMUL_DESC_EPILOGUE, &epilogue,
                                         sizeof(epilogue)),
          what);
      RUBATO_CUBLAS_RETURN_IF_ERROR(
          cublasLtMatmulDescSetAttribute(plan->matmul, CUBLASLT_MATMUL_DESC_BIAS_POINTER, &bias,
                                         sizeof(bias)),
          what);
    }
    const uint64_t in = static_cast<uint64_t>(key.in_features);
    const uint64_t out = static_cast<uint64_t>(key.out_features);
    const uint64_t rows = static_cast<uint64_t>(key.rows);
    RUBATO_CUBLAS_RETURN_IF_ERROR(cublasLtMatrixLayoutCreate(&plan->weight_layout, CUDA_R_16BF, in,
                                                             out, static_cast<int64_t>(in)),
                                  what);
    RUBATO_CUBLAS_RETURN_IF_ERROR(cublasLtMatrixLayoutCreate(&plan->x_layout, CUDA_R_16BF, in, rows,
                                                             static_cast<int64_t>(in)),
                                  what);
    RUBATO_CUBLAS_RETURN_IF_ERROR(
        cublasLtMatrixLayoutCreate(&plan->y_layout, y_type, out, rows, static_cast<int64_t>(out)),
        what);

    cublasLtMatmulPreference_t preference = nullptr;
    RUBATO_CUBLAS_RETURN_IF_ERROR(cublasLtMatmulPreferenceCreate(&preference), what);
    const uint64_t workspace_bytes = workspace_.bytes();
    const uint32_t alignments[4] = {key.align_weight, key.align_x, key.align_y, key.align_y};
    const cublasLtMatmulPreferenceAttributes_t alignment_attributes[4] = {
        CUBLASLT_MATMUL_PREF_MIN_ALIGNMENT_A_BYTES, CUBLASLT_MATMUL_PREF_MIN_ALIGNMENT_B_BYTES,
        CUBLASLT_MATMUL_PREF_MIN_ALIGNMENT_C_BYTES, CUBLASLT_MATMUL_PREF_MIN_ALIGNMENT_D_BYTES};
    cublasStatus_t status =
        cublasLtMatmulPreferenceSetAttribute(preference, CUBLASLT_MATMUL_PREF_MAX_WORKSPACE_BYTES,
                                             &workspace_bytes, sizeof(workspace_bytes));
    for (int i = 0; i < 4 && status == CUBLAS_STATUS_SUCCESS; ++i) {
      status = cublasLtMatmulPreferenceSetAttribute(preference, alignment_attributes[i],
                                                    &alignments[i], sizeof(alignments[i]));
    }
    const bool tunable = Tunable(key);
    std::vector<cublasLtMatmulHeuristicResult_t> results(tunable ? kTuneCandidates : 1);
    int returned = 0;
    if (status == CUBLAS_STATUS_SUCCESS) {
      status = cublasLtMatmulAlgoGetHeuristic(
          handle_, plan->matmul, plan->weight_layout, plan->x_layout, plan->y_layout,
          plan->y_layout, preference, static_cast<int>(results.size()), results.data(), &returned);
    }
    cublasLtMatmulPreferenceDestroy(preference);
    RUBATO_CUBLAS_RETURN_IF_ERROR(status, what + ": cublasLtMatmulAlgoGetHeuristic");
    if (returned == 0) {
      return UnsupportedError("cuBLASLt: " + what + ": no algorithm for this shape (alignments " +
                              "x " + std::to_string(key.align_x) + ", W " +
                              std::to_string(key.align_weight) + ", y " +
                              std::to_string(key.align_y) + " bytes)");
    }
    plan->algo = results[0].algo;
    plan->workspace_bytes = results[0].workspaceSize;
    results.resize(static_cast<size_t>(returned));
    if (returned > 1) plan->candidates = std::move(results);
    plan->tuned = plan->candidates.empty();
    return plan;
  }

  // Weight-bound shapes (a decode step's few rows against a large weight) are where cuBLASLt's
  // first answer can leave bandwidth unused; everything else keeps it. Off unless
  // RUBATO_GEMM_TUNE=1 (docs/cuda_model.md "GEMM": measured no faster on an H200).
  static bool Tunable(const PlanKey& key) {
    static const bool enabled = [] {
      const char* flag = std::getenv("RUBATO_GEMM_TUNE");
      return flag != nullptr && std::string(flag) == "1";
    }();
    const double weight_bytes = 2.0 * key.in_features * static_cast<double>(key.out_features);
    return enabled && key.rows <= kTuneMaxRows && weight_bytes >= kTuneMinWeightBytes;
  }

  // Times every candidate on the call's own operands (y is written, then the real call rewrites
  // it), one call at a time after an L2 flush, and keeps the fastest when it beats the heuristic's
  // first answer by kTuneMargin: a margin, so that timing noise does not make runs pick different
  // algorithms (and round differently) for a few percent. Inside stream capture nothing can be
  // timed: the plan keeps the first answer for good, so eager and replayed steps always run one
  // algorithm.
  Status Tune(const LinearArgs& args, Plan& plan, cudaStream_t stream) {
    plan.tuned = true;
    cudaStreamCaptureStatus capture = cudaStreamCaptureStatusNone;
    RUBATO_CUDA_RETURN_IF_ERROR(cudaStreamIsCapturing(stream, &capture), "querying capture");
    if (capture != cudaStreamCaptureStatusNone) return Status::Ok();
    if (flush_.bytes() == 0) {
      int device = 0, l2_bytes = 0;
      RUBATO_CUDA_RETURN_IF_ERROR(cudaGetDevice(&device), "querying the device");
      RUBATO_CUDA_RETURN_IF_ERROR(cudaDeviceGetAttribute(&l2_bytes, cudaDevAttrL2CacheSize, device),
                                  "querying the L2");
      RUBATO_ASSIGN_OR_RETURN(
          flush_, DeviceBuffer<uint8_t>::Allocate(2 * static_cast<size_t>(l2_bytes) + (1 << 20),
                                                  "the GEMM tuning's L2 flush buffer"));
    }
    cudaEvent_t start = nullptr, stop = nullptr;
    RUBATO_CUDA_RETURN_IF_ERROR(cudaEventCreate(&start), "creating a GEMM tuning event");
    RUBATO_CUDA_RETURN_IF_ERROR(cudaEventCreate(&stop), "creating a GEMM tuning event");
    const float alpha = 1.0f, beta = 0.0f;
    std::vector<float> mean_ms(plan.candidates.size(), -1.0f);
    Status status;
    for (size_t i = 0; i < plan.candidates.size() && status.ok(); ++i) {
      const cublasLtMatmulHeuristicResult_t& c = plan.candidates[i];
      if (c.state != CUBLAS_STATUS_SUCCESS || c.workspaceSize > workspace_.bytes()) continue;
      bool ran = true;
      float total_ms = 0;
      for (int call = 0; call < kTuneWarmup + kTuneCalls && ran && status.ok(); ++call) {
        // The weights must come from HBM as in a step, not from the L2 the previous call left
        // them in (an o_proj fits in an H200's L2): overwrite a buffer twice the L2's size first.
        RUBATO_RETURN_IF_ERROR(
            CudaStatus(cudaMemsetAsync(flush_.data(), call & 0xff, flush_.bytes(), stream),
                       "flushing the L2 between GEMM candidates"));
        cudaEventRecord(start, stream);
        ran = cublasLtMatmul(handle_, plan.matmul, &alpha, args.weight, plan.weight_layout, args.x,
                             plan.x_layout, &beta, args.y, plan.y_layout, args.y, plan.y_layout,
                             &c.algo, workspace_.data(), c.workspaceSize,
                             stream) == CUBLAS_STATUS_SUCCESS;
        cudaEventRecord(stop, stream);
        status = CudaStatus(cudaEventSynchronize(stop), "timing a GEMM candidate");
        float ms = 0;
        if (status.ok() && ran && call >= kTuneWarmup &&
            cudaEventElapsedTime(&ms, start, stop) == cudaSuccess) {
          total_ms += ms;
        }
      }
      if (status.ok() && ran) mean_ms[i] = total_ms / kTuneCalls;
    }
    cudaEventDestroy(start);
    cudaEventDestroy(stop);
    RUBATO_RETURN_IF_ERROR(status);
    size_t best = 0;
    for (size_t i = 1; i < mean_ms.size(); ++i) {
      if (mean_ms[i] > 0 && (mean_ms[best] <= 0 || mean_ms[i] < mean_ms[best])) best = i;
    }
    if (best != 0 && mean_ms[0] > 0 && mean_ms[best] > mean_ms[0] * (1.0f - kTuneMargin)) {
      best = 0;
    }
    if (mean_ms[best] > 0) {
      plan.algo = plan.candidates[best].algo;
      plan.workspace_bytes = plan.candidates[best].workspaceSize;
    }
    plan.candidates.clear();
    return Status::Ok();
  }

  static constexpr int kTuneCandidates = 16;
  static constexpr int kTuneMaxRows = 64;
  static constexpr double kTuneMinWeightBytes = 8.0 * (1 << 20);
  static constexpr int kTuneWarmup = 2;
  static constexpr int kTuneCalls = 10;
  static constexpr float kTuneMargin = 0.03f;

  // plan.bias_f32 = f32(args.bias), exactly: zero the low halves, copy the bf16 bits into the
  // high halves (little-endian: bytes 2..3 of each float).
  static Status WidenBias(const LinearArgs& args, Plan& plan, cudaStream_t stream) {
    const size_t count = static_cast<size_t>(args.out_features);
    RUBATO_CUDA_RETURN_IF_ERROR(
        cudaMemsetAsync(plan.bias_f32.data(), 0, count * sizeof(float), stream),
        "zeroing the f32 GEMM bias");
    RUBATO_CUDA_RETURN_IF_ERROR(
        cudaMemcpy2DAsync(reinterpret_cast<char*>(plan.bias_f32.data()) + 2, sizeof(float),
                          args.bias, sizeof(__nv_bfloat16), sizeof(__nv_bfloat16), count,
                          cudaMemcpyDeviceToDevice, stream),
        "widening the GEMM bias to f32");
    return Status::Ok();
  }

  cublasLtHandle_t handle_;
  DeviceBuffer<uint8_t> workspace_;  // [workspace bytes], shared by every call (calls are ordered)
  DeviceBuffer<uint8_t> flush_;      // twice the L2, allocated at the first tuning (Tune)
  std::unordered_map<PlanKey, std::unique_ptr<Plan>, PlanKeyHash> plans_;
};

}  // namespace

Result<std::unique_ptr<CublasLtGemm>> CublasLtGemm::Create(size_t workspace_bytes) {
  // The workspace first: on a machine without a GPU its cudaMalloc names the missing device.
  RUBATO_ASSIGN_OR_RETURN(
      DeviceBuffer<uint8_t> workspace,
      DeviceBuffer<uint8_t>::Allocate(workspace_bytes, "the cuBLASLt workspace"));
  cublasLtHandle_t handle = nullptr;
  RUBATO_CUBLAS_RETURN_IF_ERROR(cublasLtCreate(&handle), "creating the handle");
  return std::unique_ptr<CublasLtGemm>(new CublasLtGemmImpl(handle, std::move(workspace)));
}

}  // namespace rubato::cuda
