// The SyncKV calibrator (see synckv_calibrator.h): an observing CPU attention backend feeds
// SyncKvHeadOverlap while the model prefills each development prompt in one chunk.
#include "inference_rank/policies/synckv/synckv_calibrator.h"

#include <unistd.h>

#include <algorithm>
#include <chrono>
#include <cmath>
#include <filesystem>
#include <memory>
#include <vector>

#include "common/hf_config.h"
#include "common/text_file.h"
#include "common/tokenizer/tokenizer.h"
#include "inference_rank/attention/cpu_backend.h"
#include "inference_rank/model/cpu_model.h"
#include "inference_rank/policies/calibration_dev_set.h"
#include "inference_rank/policies/kascade/kascade_calibration.h"
#include "kernels/cpu/dot.h"

namespace rubato {
namespace {

// Sees each layer's queries and keys (BeforeAttention): for each observed query position, per KV
// head, the post-softmax rows of its GQA group (the attention op's scale and dot product),
// max-pooled over the group (App. B.1).
class OverlapObserver final : public CpuAttentionBackend {
 public:
  OverlapObserver(const ModelConfig& model, SyncKvHeadOverlap& overlap, int decode_steps)
      : model_(model), overlap_(overlap), decode_steps_(decode_steps) {}

  Status BeforeAttention(const CpuLayerContext& context) override {
    if (context.entries.size() != 1) {
      return InternalError("synckv calibration: one prompt per forward");
    }
    const CpuEntryRows& entry = context.entries[0];
    const int tokens = entry.tokens;
    const int kv_heads = model_.num_kv_heads;
    const int group = model_.num_heads / kv_heads;
    const int head_dim = model_.head_dim;
    const float scale = static_cast<float>(1.0 / std::sqrt(static_cast<double>(head_dim)));
    const PagedKvView kv = context.cache->LayerView(context.layer, *entry.sequence);
    const int first = std::max(0, tokens - decode_steps_);
    const int steps = tokens - first;
    pooled_.assign(static_cast<size_t>(steps) * kv_heads * tokens, 0.0f);
    const int workers = context.pool->num_workers();
    if (static_cast<int>(scratch_.size()) < workers) scratch_.resize(static_cast<size_t>(workers));
    context.pool->ParallelFor(steps * kv_heads, [&](int item, int worker) {
      const int q = first + item / kv_heads, h = item % kv_heads;
      std::vector<double>& logits = scratch_[static_cast<size_t>(worker)];
      logits.resize(static_cast<size_t>(q) + 1);
      float* row = pooled_.data() + static_cast<size_t>(item) * tokens;
      for (int g = 0; g < group; ++g) {
        const float* query =
            context.q +
            (static_cast<size_t>(entry.first_token + q) * model_.num_heads + h * group + g) *
                head_dim;
        double max = -INFINITY;
        for (int i = 0; i <= q; ++i) {
          logits[i] = Dot(query, kv.keys + kv.Offset(i, h), head_dim) * scale;
          max = std::max(max, logits[i]);
        }
        double sum = 0.0;
        for (int i = 0; i <= q; ++i) sum += (logits[i] = std::exp(logits[i] - max));
        for (int i = 0; i <= q; ++i) row[i] = std::max(row[i], static_cast<float>(logits[i] / sum));
      }
    });
    // AddStep takes [kv_heads][length] for one query: repack each step's rows.
    for (int s = 0; s < steps; ++s) {
      const int length = first + s + 1;
      step_.resize(static_cast<size_t>(kv_heads) * length);
      for (int h = 0; h < kv_heads; ++h) {
        const float* row = pooled_.data() + (static_cast<size_t>(s) * kv_heads + h) * tokens;
        std::copy(row, row + length, step_.begin() + static_cast<long>(h) * length);
      }
      RUBATO_RETURN_IF_ERROR(overlap_.AddStep(context.layer, step_.data(), length));
    }
    return Status::Ok();
  }

  Result<CompactSegment> Compact(const CpuLayerContext& /*layer*/, int /*entry*/) override {
    return InternalError("synckv calibration: no compact segments");
  }

 private:
  ModelConfig model_;
  SyncKvHeadOverlap& overlap_;
  int decode_steps_;
  std::vector<float> pooled_;                 // [steps][kv_heads][tokens]
  std::vector<float> step_;                   // [kv_heads][length]
  std::vector<std::vector<double>> scratch_;  // [worker] one row's logits
};

}  // namespace

Result<SyncKvCalibration> CalibrateSyncKv(const SyncKvCalibrateOptions& options) {
  RUBATO_RETURN_IF_ERROR(CheckCalibrateArgs(options.out, options.top_k, options.max_prompt_tokens));
  if (options.decode_steps < 1) return InvalidArgumentError("--decode-steps must be >= 1");
  std::error_code error;  // a path too long for the OS is an answer, not an exception
  if (options.decode_steps > options.max_prompt_tokens) {
    return InvalidArgumentError("--decode-steps " + std::to_string(options.decode_steps) +
                                " exceeds --max-tokens " +
                                std::to_string(options.max_prompt_tokens));
  }
  if (!std::filesystem::is_directory(options.model_dir, error)) {
    return NotFoundError("model directory '" + DisplayPath(options.model_dir) + "' does not exist");
  }
  std::string bytes;
  RUBATO_ASSIGN_OR_RETURN(const std::vector<std::string> prompts,
                          ReadCalibrationDevSet(options.dev_set, bytes));
  RUBATO_ASSIGN_OR_RETURN(const ModelConfig shape, LoadModelConfig(options.model_dir));
  if (options.clusters < 1 || options.clusters > shape.num_kv_heads) {
    return InvalidArgumentError("--clusters " + std::to_string(options.clusters) +
                                " must lie in [1, " + std::to_string(shape.num_kv_heads) +
                                "] (the model's KV heads per layer)");
  }
  const int max_tokens = std::min(options.max_prompt_tokens, shape.max_position_embeddings);
  // One prompt's observations: the pooled rows of its observed steps and its KV.
  const uint64_t t = static_cast<uint64_t>(max_tokens),
                 h = static_cast<uint64_t>(shape.num_kv_heads);
  const uint64_t needed =
      static_cast<uint64_t>(std::min(options.decode_steps, max_tokens)) * h * t * sizeof(float) +
      2 * static_cast<uint64_t>(shape.num_layers) * t * h * static_cast<uint64_t>(shape.head_dim) *
          sizeof(float);
  const uint64_t memory = static_cast<uint64_t>(sysconf(_SC_PHYS_PAGES)) *
                          static_cast<uint64_t>(sysconf(_SC_PAGE_SIZE));
  if (needed > memory / 2) {
    return ResourceExhaustedError(
        "--max-tokens " + std::to_string(max_tokens) + " with --decode-steps " +
        std::to_string(options.decode_steps) + ": a prompt of that length needs " +
        std::to_string(needed >> 20) + " MiB of observations, more than half of this machine's " +
        std::to_string(memory >> 20) + " MiB; lower --max-tokens or --decode-steps");
  }
  RUBATO_ASSIGN_OR_RETURN(std::unique_ptr<Tokenizer> tokenizer,
                          Tokenizer::LoadFromDirectory(options.model_dir));
  ModelLoadOptions load;
  load.num_threads = options.threads;
  RUBATO_ASSIGN_OR_RETURN(std::unique_ptr<CpuModel> model, CpuModel::Load(options.model_dir, load));
  const ModelConfig& config = model->config();
  SyncKvHeadOverlap overlap(config.num_layers, config.num_kv_heads, options.top_k);
  RUBATO_RETURN_IF_ERROR(model->SetAttentionBackend(
      std::make_unique<OverlapObserver>(config, overlap, options.decode_steps)));
  const int block = 16;
  RUBATO_ASSIGN_OR_RETURN(std::unique_ptr<PagedKvCache> cache,
                          model->CreateKvCache(block, (max_tokens + block - 1) / block));
  const auto start = std::chrono::steady_clock::now();
  auto elapsed = [&] {
    return std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
  };
  const int total = static_cast<int>(prompts.size());
  CalibrationProgress(options.progress, "synckv calibration", 0, total, 0.0);
  for (size_t p = 0; p < prompts.size(); ++p) {
    std::vector<int> ids = tokenizer->Encode(prompts[p], /*add_special_tokens=*/true);
    if (static_cast<int>(ids.size()) > max_tokens) ids.erase(ids.begin(), ids.end() - max_tokens);
    KvSequence sequence;
    ForwardEntry entry;
    entry.sequence = &sequence;
    entry.tokens = ids;
    entry.logits = LogitsWanted::kNone;
    ForwardResult result;
    RUBATO_RETURN_IF_ERROR(model->Forward(std::span<const ForwardEntry>(&entry, 1), *cache, result)
                               .WithContext("dev prompt " + std::to_string(p + 1)));
    RUBATO_RETURN_IF_ERROR(cache->Release(sequence));
    CalibrationProgress(options.progress, "synckv calibration", static_cast<int>(p + 1), total,
                        elapsed());
  }
  RUBATO_RETURN_IF_ERROR(model->SetAttentionBackend(nullptr));

  SyncKvCalibration calibration;
  calibration.model = options.model_dir;
  calibration.num_layers = config.num_layers;
  calibration.num_heads = config.num_heads;
  calibration.num_kv_heads = config.num_kv_heads;
  calibration.head_dim = config.head_dim;
  calibration.dev_set = options.dev_set;
  calibration.dev_set_fnv1a = Fnv1a64Hex(bytes);
  calibration.prompts = total;
  calibration.top_k = options.top_k;
  calibration.decode_steps = options.decode_steps;
  calibration.steps = overlap.steps(0);
  calibration.similarity = overlap.Similarity();
  RUBATO_RETURN_IF_ERROR(ClusterCalibration(calibration, options.clusters));
  RUBATO_RETURN_IF_ERROR(SaveSyncKvCalibration(calibration, options.out));
  return calibration;
}

}  // namespace rubato
