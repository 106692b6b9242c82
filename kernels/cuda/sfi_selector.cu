// SFI Selector on the GPU (sfi_selector.cuh): workspace layout, launcher, validation. The three
// kernels are in sfi_head_scores.cuh (Eqs. 6–19 and the soft-NMS window maxima, one block per
// (sequence, KV head)), sfi_cross_head.cuh (Eqs. 20–23, one thread per (sequence, position)) and
// sfi_top_k.cuh (Eq. 24, one block per (sequence, KV head)); they run back to back on the
// caller's stream and talk through the workspace.
//
// Cost: kernel 1 reads the logits twice (softmax statistics, then the probabilities) and walks
// [|J|] f32 arrays about ten more times, all from one block per (sequence, KV head); with few
// KV heads and a long J that uses few multiprocessors (the Selector is meant to run on a
// low-priority aux stream beside the next layer, DESIGN §4.2). Splitting J over several blocks
// per head would need a cross-block reduction per pass; measure before doing it.
#include <algorithm>
#include <climits>
#include <cmath>
#include <cstdint>
#include <sstream>
#include <string>

#include "kernels/cuda/cuda_status.h"
#include "kernels/cuda/launch_checks.h"
#include "kernels/cuda/sfi_cross_head.cuh"
#include "kernels/cuda/sfi_head_scores.cuh"
#include "kernels/cuda/sfi_selector.cuh"
#include "kernels/cuda/sfi_selector_device.cuh"
#include "kernels/cuda/sfi_top_k.cuh"

namespace rubato::cuda {
namespace {

using sfi::KernelArgs;

constexpr int kMaxGridY = 65535;

// Workspace rows: max_j_count f32 rounded up to 64 (256-byte aligned rows).
int64_t WorkspaceRowStride(int max_j_count) {
  return (static_cast<int64_t>(max_j_count) + 63) / 64 * 64;
}

sfi::DeviceConfig ToDeviceConfig(const SfiSelectorConfig& c, int window) {
  sfi::DeviceConfig d{};
  d.budget = c.budget;
  d.nms_half = c.nms_window / 2;
  d.alpha = static_cast<float>(c.alpha);
  d.inv_alpha = static_cast<float>(1.0 / c.alpha);
  d.inv_window = static_cast<float>(1.0 / window);
  d.gamma = static_cast<float>(c.gamma);
  d.beta = static_cast<float>(c.beta);
  d.p = static_cast<float>(c.p);
  d.eta = static_cast<float>(c.eta);
  d.lambda_clip = c.lambda_clip;
  d.epsilon = static_cast<float>(c.epsilon);
  d.log_epsilon = static_cast<float>(std::log(c.epsilon));
  d.alpha_soft = static_cast<float>(c.alpha_soft);
  d.alpha_cross = static_cast<float>(c.alpha_cross);
  d.temperature = static_cast<float>(c.temperature);
  return d;
}

Status Validate(const SfiSelectParams& p);

}  // namespace

// ---- launcher ---------------------------------------------------------------------------------

size_t SfiSelectWorkspaceBytes(int batch, int num_kv_heads, int max_j_count) {
  if (batch <= 0 || num_kv_heads <= 0 || max_j_count <= 0) return 0;
  return 3 * static_cast<size_t>(batch) * static_cast<size_t>(num_kv_heads) *
         static_cast<size_t>(WorkspaceRowStride(max_j_count)) * sizeof(float);
}

Status SfiSelect(const SfiSelectParams& params, cudaStream_t stream) {
  RUBATO_RETURN_IF_ERROR(Validate(params));
  if (params.batch == 0) return Status::Ok();
  const bool reads_norms = params.config.gamma > 0.0;
  KernelArgs args{};
  args.logits = params.logits;
  args.logits_stride = params.logits_stride;
  args.logit_scale = params.logit_scale;
  args.j_begin = params.j_begin;
  args.j_count = params.j_count;
  args.key_norms = reads_norms ? params.key_norms : nullptr;
  args.norms_stride = params.norms_stride;
  args.batch = params.batch;
  args.num_kv_heads = params.num_kv_heads;
  args.group = params.group;
  args.window = params.window;
  args.max_j_count = params.max_j_count;
  args.position_limit = std::min<int64_t>(params.logits_stride, INT_MAX);
  if (reads_norms) args.position_limit = std::min(args.position_limit, params.norms_stride);
  args.config = ToDeviceConfig(params.config, params.window);
  args.selected = params.selected;
  args.selected_count = params.selected_count;
  args.scores = params.scores;
  args.row_stride = WorkspaceRowStride(params.max_j_count);
  if (params.max_j_count > 0) {
    const int64_t array =
        static_cast<int64_t>(params.batch) * params.num_kv_heads * args.row_stride;
    args.z = static_cast<float*>(params.workspace);
    args.a = args.z + array;
    args.b = args.a + array;
  }

  const unsigned heads = static_cast<unsigned>(params.batch) * params.num_kv_heads;
  if (params.max_j_count > 0) {  // with max_j_count 0 every J is empty: only the counts remain
    sfi::SfiHeadScoresKernel<<<heads, sfi::kThreads, 0, stream>>>(args);
    RUBATO_RETURN_IF_ERROR(LaunchStatus("sfi_head_scores"));
    const dim3 cross_grid(static_cast<unsigned>((params.max_j_count + sfi::kCrossHeadThreads - 1) /
                                                sfi::kCrossHeadThreads),
                          static_cast<unsigned>(std::min(params.batch, kMaxGridY)));
    sfi::SfiCrossHeadKernel<<<cross_grid, sfi::kCrossHeadThreads, 0, stream>>>(args);
    RUBATO_RETURN_IF_ERROR(LaunchStatus("sfi_cross_head"));
  }
  sfi::SfiTopKKernel<<<heads, sfi::kThreads, 0, stream>>>(args);
  return LaunchStatus("sfi_top_k");
}

// ---- validation -------------------------------------------------------------------------------

namespace {

Status Invalid(const std::string& what) { return InvalidArgumentError("SfiSelect: " + what); }

// The f32 pipeline's extra bounds on the config (on top of ValidateSfiSelectorConfig): they keep
// every intermediate finite in f32 (e.g. |z_nms / T| stays below ~1e15).
Status ValidateFloatRanges(const SfiSelectorConfig& c) {
  struct Range {
    const char* name;
    double value, lo, hi;
  };
  const Range ranges[] = {
      {"alpha", c.alpha, 1e-6, 1.0},
      {"gamma", c.gamma, 0.0, 1e6},
      {"beta", c.beta, 0.0, 1e6},
      {"p", c.p, 1.0, 1e6},
      {"eta", c.eta, 0.0, 1e6},
      {"epsilon", c.epsilon, 1e-30, 1e6},
      {"alpha_soft", c.alpha_soft, 0.0, 1e6},
      {"alpha_cross", c.alpha_cross, 0.0, 1e6},
      {"temperature", c.temperature, 1e-6, 1e6},
  };
  for (const Range& r : ranges) {
    if (!(r.value >= r.lo && r.value <= r.hi)) {
      std::ostringstream message;
      message << "SfiSelectorConfig." << r.name << " = " << r.value << " is outside [" << r.lo
              << ", " << r.hi << "], the range the f32 GPU pipeline supports";
      return Invalid(message.str());
    }
  }
  return Status::Ok();
}

Status Validate(const SfiSelectParams& p) {
  if (Status config = ValidateSfiSelectorConfig(p.config); !config.ok()) {
    return config.WithContext("SfiSelect");
  }
  RUBATO_RETURN_IF_ERROR(ValidateFloatRanges(p.config));
  if (p.batch < 0) return Invalid("batch = " + std::to_string(p.batch) + " must be >= 0");
  if (p.num_kv_heads < 1) {
    return Invalid("num_kv_heads = " + std::to_string(p.num_kv_heads) + " must be >= 1");
  }
  if (p.group < 1) return Invalid("group = " + std::to_string(p.group) + " must be >= 1");
  if (p.window < 1) return Invalid("window = " + std::to_string(p.window) + " must be >= 1");
  if (static_cast<int64_t>(p.window) * p.group > sfi::kMaxRows) {
    return Invalid("window * group = " + std::to_string(static_cast<int64_t>(p.window) * p.group) +
                   " exceeds " + std::to_string(sfi::kMaxRows) +
                   " (per-row softmax statistics live in shared memory)");
  }
  if (static_cast<int64_t>(p.batch) * p.num_kv_heads * p.group > INT_MAX) {
    return Invalid("batch * num_kv_heads * group exceeds INT_MAX (one block per KV head)");
  }
  if (p.max_j_count < 0) {
    return Invalid("max_j_count = " + std::to_string(p.max_j_count) + " must be >= 0");
  }
  if (!std::isfinite(p.logit_scale) || !(p.logit_scale > 0.f)) {
    return Invalid("logit_scale = " + std::to_string(p.logit_scale) + " must be finite and > 0");
  }
  if (p.batch == 0) return Status::Ok();  // nothing is read or written
  if (p.j_begin == nullptr) return Invalid("j_begin is null");
  if (p.j_count == nullptr) return Invalid("j_count is null");
  if (p.selected == nullptr) return Invalid("selected is null");
  if (p.selected_count == nullptr) return Invalid("selected_count is null");
  if (p.max_j_count == 0) return Status::Ok();  // only the counts (all 0) are written
  if (p.logits == nullptr) return Invalid("logits is null");
  if (p.logits_stride < p.max_j_count) {
    return Invalid("logits_stride = " + std::to_string(p.logits_stride) +
                   " < max_j_count = " + std::to_string(p.max_j_count));
  }
  if (p.config.gamma > 0.0) {
    if (p.key_norms == nullptr) {
      return Invalid("key_norms is null but SfiSelectorConfig.gamma > 0 needs them");
    }
    if (p.norms_stride < p.max_j_count) {
      return Invalid("norms_stride = " + std::to_string(p.norms_stride) +
                     " < max_j_count = " + std::to_string(p.max_j_count));
    }
  }
  const size_t needed = SfiSelectWorkspaceBytes(p.batch, p.num_kv_heads, p.max_j_count);
  if (p.workspace == nullptr || p.workspace_bytes < needed) {
    return Invalid("workspace of " + std::to_string(p.workspace_bytes) + " bytes; " +
                   std::to_string(needed) + " needed (SfiSelectWorkspaceBytes)");
  }
  if (!Aligned16(p.workspace)) return Invalid("workspace is not 16-byte aligned");
  return Status::Ok();
}

}  // namespace
}  // namespace rubato::cuda
