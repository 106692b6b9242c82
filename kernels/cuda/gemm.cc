// CublasLtGemm (gemm.h): y = x W^T (+ bias) through cuBLASLt, bf16 A/B, fp32 accumulation, bf16
// or f32 D, computed as the column-major transpose ("TN") with nothing moved. Plans are cached
// per (shape, bias, y dtype, pointer alignments): a new key's first call queries the heuristic
// (and may allocate the f32 bias copy), so make it outside graph capture. Not thread-safe: calls
// must be ordered (one stream, or streams ordered by events).
// Narrative (the layouts, plan keys, bias widening): docs/cuda_model.md "GEMM".
#include "kernels/cuda/gemm.h"

#include <cublasLt.h>

#include <algorithm>
#include <cstdint>
#include <string>
#include <unordered_map>
#include <utility>

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
  size_t workspace_bytes = 0;    // what the chosen algorithm uses (<= the gemm's workspace)
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
    cublasLtMatmulHeuristicResult_t result{};
    int returned = 0;
    if (status == CUBLAS_STATUS_SUCCESS) {
      status = cublasLtMatmulAlgoGetHeuristic(handle_, plan->matmul, plan->weight_layout,
                                              plan->x_layout, plan->y_layout, plan->y_layout,
                                              preference, 1, &result, &returned);
    }
    cublasLtMatmulPreferenceDestroy(preference);
    RUBATO_CUBLAS_RETURN_IF_ERROR(status, what + ": cublasLtMatmulAlgoGetHeuristic");
    if (returned == 0) {
      return UnsupportedError("cuBLASLt: " + what + ": no algorithm for this shape (alignments " +
                              "x " + std::to_string(key.align_x) + ", W " +
                              std::to_string(key.align_weight) + ", y " +
                              std::to_string(key.align_y) + " bytes)");
    }
    plan->algo = result.algo;
    plan->workspace_bytes = result.workspaceSize;
    return plan;
  }

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
