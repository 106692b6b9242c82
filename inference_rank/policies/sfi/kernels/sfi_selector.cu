// SFI Selector on the GPU (sfi_selector.cuh): workspace layout, launcher, validation. Six
// kernels run back to back on the caller's stream and talk through the workspace: row
// statistics, evidence (and its normalization when W > 1), the wide-window maxima when needed,
// the scores, the top-K. The launches, their grids and the traffic: docs/sfi.md "Launches and
// workspace".
#include <algorithm>
#include <climits>
#include <cmath>
#include <cstdint>
#include <sstream>
#include <string>

#include "kernels/cuda/cuda_status.h"
#include "kernels/cuda/launch_checks.h"
#include "inference_rank/policies/sfi/kernels/sfi_cross_head.cuh"
#include "inference_rank/policies/sfi/kernels/sfi_head_scores.cuh"
#include "inference_rank/policies/sfi/kernels/sfi_selector.cuh"
#include "inference_rank/policies/sfi/kernels/sfi_selector_device.cuh"
#include "inference_rank/policies/sfi/kernels/sfi_top_k.cuh"

namespace rubato::cuda {
namespace {

using sfi::KernelArgs;

constexpr int kMaxGridY = 65535;

// Workspace rows: max_j_count entries rounded up to 64 (256-byte aligned f32 rows, whole words of
// forced bits).
int64_t RowStride(int max_j_count) { return (static_cast<int64_t>(max_j_count) + 63) / 64 * 64; }

int NumChunks(int max_j_count) { return (max_j_count + sfi::kChunk - 1) / sfi::kChunk; }

// The widths the kernels use: a half-width or reach past |J| acts like |J| (the window is all of
// J), so both are clamped to max_j_count; a reach of 0 stays 0 (stage C off).
int EffectiveHalf(const SfiSelectorConfig& c, int max_j_count) {
  return std::min(c.nms_window / 2, std::max(max_j_count, 1));
}
int EffectiveReach(const SfiSelectorConfig& c, int max_j_count) {
  return std::min(c.continuation, std::min(std::max(max_j_count, 1), INT_MAX - 1));
}

// Byte offsets of the workspace arrays (KernelArgs documents each), 256-byte aligned.
struct Layout {
  size_t f, keys, cont, forced_bits, position_prior, nms_prefix, nms_suffix, cont_prefix,
      cont_suffix, row_stats, prior_stats, mu_stats, lambda_sums, total;
};

Layout MakeLayout(int batch, int num_kv_heads, int max_j_count, int rows, bool nms_wide,
                  bool cont_wide) {
  const size_t r = static_cast<size_t>(batch) * num_kv_heads;
  const size_t n = static_cast<size_t>(RowStride(max_j_count));
  const size_t chunks = static_cast<size_t>(NumChunks(max_j_count));
  Layout l{};
  size_t at = 0;
  const auto take = [&at](size_t bytes) {
    const size_t offset = at;
    at += (bytes + 255) / 256 * 256;
    return offset;
  };
  l.f = take(r * n * sizeof(float));
  l.keys = take(r * n * sizeof(uint32_t));
  l.cont = take(r * n * sizeof(float));
  l.forced_bits = take(r * (n / 32) * sizeof(uint32_t));
  l.position_prior = take(static_cast<size_t>(batch) * n * sizeof(float));
  l.nms_prefix = nms_wide ? take(r * n * sizeof(float)) : 0;
  l.nms_suffix = nms_wide ? take(r * n * sizeof(float)) : 0;
  l.cont_prefix = cont_wide ? take(r * n * sizeof(float)) : 0;
  l.cont_suffix = cont_wide ? take(r * n * sizeof(float)) : 0;
  l.row_stats = take(r * static_cast<size_t>(rows) * chunks * sizeof(sfi::RowStat));
  l.prior_stats = take(r * chunks * sizeof(sfi::RowStat));
  l.mu_stats = take(r * chunks * sizeof(sfi::RowStat));
  l.lambda_sums = take(r * chunks * sizeof(sfi::LambdaSums));
  l.total = at;
  return l;
}

// How SfiScoresKernel runs: positions per block and halo, and whether the soft-NMS and stage C
// windows come from the shared-memory tile or from SfiLargeWindowKernel's per-row maxima ("wide":
// half-widths above kHaloMax, reaches above kDirectReach, or halos that leave no tile of 32
// positions room in 48 KB of shared memory).
struct ScoresPlan {
  int tile = 0;  // 0: not even 32 positions fit (too many KV heads)
  int halo = 0;
  bool nms_wide = false, cont_wide = false;
  size_t shared_bytes = 0;
};

ScoresPlan MakeScoresPlan(int num_kv_heads, int max_j_count, const SfiSelectorConfig& config) {
  constexpr size_t kMaxSharedBytes = 48 * 1024;  // no opt-in needed
  const int half = EffectiveHalf(config, max_j_count);
  const int reach = EffectiveReach(config, max_j_count);
  ScoresPlan plan;
  plan.nms_wide = half > sfi::kHaloMax;
  plan.cont_wide = reach > sfi::kDirectReach;
  for (;;) {
    const int z_halo = half > 0 && !plan.nms_wide ? sfi::RoundUp4(half) : 0;
    const int a_halo = reach > 0 && !plan.cont_wide ? sfi::RoundUp4(reach) : 0;
    const int halo = std::max(z_halo, a_halo);
    // Tiles whose rows (tile + 2 halo) are whole multiples of kThreads first (every thread busy
    // in the per-row loops), then powers of two; all multiples of 32 (forced_bits words).
    int tiles[10];
    int count = 0;
    for (int rows = 4; rows >= 1; --rows) {
      const int tile = rows * sfi::kThreads - 2 * halo;
      if (tile >= 32 && tile % 32 == 0) tiles[count++] = tile;
    }
    for (int tile = 512; tile >= 32; tile /= 2) tiles[count++] = tile;
    for (int c = 0; c < count; ++c) {
      const int tile = tiles[c];
      const size_t bytes =
          static_cast<size_t>(sfi::ScoresSharedFloats(tile, num_kv_heads, halo)) * sizeof(float);
      if (bytes <= kMaxSharedBytes) {
        plan.tile = tile;
        plan.halo = halo;
        plan.shared_bytes = bytes;
        return plan;
      }
    }
    if (z_halo > 0 && z_halo >= a_halo) {
      plan.nms_wide = true;
    } else if (a_halo > 0) {
      plan.cont_wide = true;
    } else {
      return plan;
    }
  }
}

sfi::DeviceConfig ToDeviceConfig(const SfiSelectorConfig& c, int window, int max_j_count) {
  sfi::DeviceConfig d{};
  d.budget = c.budget;
  d.nms_half = EffectiveHalf(c, max_j_count);
  d.continuation = EffectiveReach(c, max_j_count);
  d.continuation_threshold = static_cast<float>(c.continuation_threshold);
  d.alpha = static_cast<float>(c.alpha);
  d.inv_alpha = static_cast<float>(1.0 / c.alpha);
  d.inv_alpha_f64 = 1.0 / c.alpha;
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

size_t SfiSelectWorkspaceBytes(int batch, int num_kv_heads, int max_j_count, int window,
                               int group, const SfiSelectorConfig& config) {
  if (batch <= 0 || num_kv_heads <= 0 || max_j_count <= 0) return 0;
  const int rows = static_cast<int>(
      std::clamp<int64_t>(static_cast<int64_t>(window) * group, 1, sfi::kMaxRows));
  const ScoresPlan plan = MakeScoresPlan(num_kv_heads, max_j_count, config);
  return MakeLayout(batch, num_kv_heads, max_j_count, rows, plan.nms_wide, plan.cont_wide).total;
}

Status SfiSelect(const SfiSelectParams& params, cudaStream_t stream) {
  RUBATO_RETURN_IF_ERROR(Validate(params));
  if (params.batch == 0) return Status::Ok();
  const bool reads_norms = params.config.gamma > 0.0;
  const int max_j = params.max_j_count;
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
  args.max_j_count = max_j;
  args.position_limit = std::min<int64_t>(params.logits_stride, INT_MAX);
  if (reads_norms) args.position_limit = std::min(args.position_limit, params.norms_stride);
  args.config = ToDeviceConfig(params.config, params.window, max_j);
  args.selected = params.selected;
  args.selected_count = params.selected_count;
  args.scores = params.scores;
  args.continuation_out = params.continuation;
  args.row_stride = RowStride(max_j);
  args.num_chunks = NumChunks(max_j);
  const ScoresPlan plan = MakeScoresPlan(params.num_kv_heads, max_j, params.config);
  args.tile = plan.tile;
  args.halo = plan.halo;

  const int total_rows = params.batch * params.num_kv_heads;
  const unsigned grid_rows = static_cast<unsigned>(std::min(total_rows, kMaxGridY));
  const dim3 row_grid(1, grid_rows);
  if (max_j == 0) {  // every J is empty: only the counts (0) are written
    sfi::SfiTopKKernel<<<row_grid, sfi::kTopKThreads, 0, stream>>>(args);
    return LaunchStatus("sfi_top_k");
  }
  const bool nms_wide = plan.nms_wide;
  const bool cont_wide = plan.cont_wide;
  const Layout layout = MakeLayout(params.batch, params.num_kv_heads, max_j,
                                   params.window * params.group, nms_wide, cont_wide);
  char* base = static_cast<char*>(params.workspace);
  args.f = reinterpret_cast<float*>(base + layout.f);
  args.keys = reinterpret_cast<uint32_t*>(base + layout.keys);
  args.cont = reinterpret_cast<float*>(base + layout.cont);
  args.forced_bits = reinterpret_cast<uint32_t*>(base + layout.forced_bits);
  args.log_position_prior = reinterpret_cast<float*>(base + layout.position_prior);
  if (nms_wide) {
    args.nms_prefix = reinterpret_cast<float*>(base + layout.nms_prefix);
    args.nms_suffix = reinterpret_cast<float*>(base + layout.nms_suffix);
  }
  if (cont_wide) {
    args.cont_prefix = reinterpret_cast<float*>(base + layout.cont_prefix);
    args.cont_suffix = reinterpret_cast<float*>(base + layout.cont_suffix);
  }
  args.row_stats = reinterpret_cast<sfi::RowStat*>(base + layout.row_stats);
  args.prior_stats = reinterpret_cast<sfi::RowStat*>(base + layout.prior_stats);
  args.mu_stats = reinterpret_cast<sfi::RowStat*>(base + layout.mu_stats);
  args.lambda_sums = reinterpret_cast<sfi::LambdaSums*>(base + layout.lambda_sums);

  // Stage A: one warp per (row, chunk) (row = query row for the statistics, (sequence, KV head)
  // after), kWarps warps per block. Validate keeps batch * heads * group * window * chunks far
  // below 2^31 blocks.
  const auto warp_grid = [&](int64_t rows) {
    const int64_t warps = rows * args.num_chunks;
    return dim3(static_cast<unsigned>((warps + sfi::kWarps - 1) / sfi::kWarps));
  };
  const int64_t kv_rows = static_cast<int64_t>(params.batch) * params.num_kv_heads;
  const dim3 chunk_grid = warp_grid(kv_rows);
  sfi::SfiRowStatsKernel<<<warp_grid(kv_rows * params.window * params.group), sfi::kThreads, 0,
                           stream>>>(args);
  RUBATO_RETURN_IF_ERROR(LaunchStatus("sfi_row_stats"));
  if (params.window == 1) {
    sfi::SfiEvidenceKernel<true><<<chunk_grid, sfi::kThreads, 0, stream>>>(args);
    RUBATO_RETURN_IF_ERROR(LaunchStatus("sfi_evidence"));
  } else {
    sfi::SfiEvidenceKernel<false><<<chunk_grid, sfi::kThreads, 0, stream>>>(args);
    RUBATO_RETURN_IF_ERROR(LaunchStatus("sfi_evidence"));
    sfi::SfiNormalizeEvidenceKernel<<<chunk_grid, sfi::kThreads, 0, stream>>>(args);
    RUBATO_RETURN_IF_ERROR(LaunchStatus("sfi_normalize_evidence"));
  }
  if (nms_wide || cont_wide) {
    sfi::SfiLargeWindowKernel<<<row_grid, sfi::kThreads, 0, stream>>>(args);
    RUBATO_RETURN_IF_ERROR(LaunchStatus("sfi_large_window"));
  }
  const dim3 tile_grid(static_cast<unsigned>((max_j + args.tile - 1) / args.tile),
                       static_cast<unsigned>(std::min(params.batch, kMaxGridY)));
  sfi::SfiScoresKernel<<<tile_grid, sfi::kThreads, plan.shared_bytes, stream>>>(args);
  RUBATO_RETURN_IF_ERROR(LaunchStatus("sfi_scores"));
  sfi::SfiTopKKernel<<<row_grid, sfi::kTopKThreads, 0, stream>>>(args);
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
  if (p.num_kv_heads > sfi::kMaxKvHeads) {
    return Invalid("num_kv_heads = " + std::to_string(p.num_kv_heads) + " exceeds " +
                   std::to_string(sfi::kMaxKvHeads) +
                   " (cross-head exclusivity keeps every head of a tile in shared memory)");
  }
  if (p.group < 1) return Invalid("group = " + std::to_string(p.group) + " must be >= 1");
  if (p.window < 1) return Invalid("window = " + std::to_string(p.window) + " must be >= 1");
  if (static_cast<int64_t>(p.window) * p.group > sfi::kMaxRows) {
    return Invalid("window * group = " + std::to_string(static_cast<int64_t>(p.window) * p.group) +
                   " exceeds " + std::to_string(sfi::kMaxRows) +
                   " (per-row softmax statistics live in shared memory)");
  }
  if (static_cast<int64_t>(p.batch) * p.num_kv_heads * p.group > INT_MAX) {
    return Invalid("batch * num_kv_heads * group exceeds INT_MAX");
  }
  // Stage A runs one warp per (query row, chunk of 1024 positions).
  if (static_cast<int64_t>(p.batch) * p.num_kv_heads * p.group * p.window *
          ((std::max(p.max_j_count, 0) + sfi::kChunk - 1) / sfi::kChunk) >
      INT_MAX) {
    return Invalid("batch * num_kv_heads * group * window * ceil(max_j_count / " +
                   std::to_string(sfi::kChunk) + ") exceeds INT_MAX");
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
  const size_t needed = SfiSelectWorkspaceBytes(p.batch, p.num_kv_heads, p.max_j_count, p.window,
                                                p.group, p.config);
  if (p.workspace == nullptr || p.workspace_bytes < needed) {
    return Invalid("workspace of " + std::to_string(p.workspace_bytes) + " bytes; " +
                   std::to_string(needed) +
                   " needed (SfiSelectWorkspaceBytes with this window, group and config)");
  }
  if (!Aligned16(p.workspace)) return Invalid("workspace is not 16-byte aligned");
  return Status::Ok();
}

}  // namespace
}  // namespace rubato::cuda
