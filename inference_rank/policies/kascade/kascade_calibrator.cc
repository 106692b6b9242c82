// The Kascade calibrator (see kascade_calibrator.h): an observing CPU attention backend feeds
// KascadeSimilarity while the model prefills each development prompt in one chunk.
#include "inference_rank/policies/kascade/kascade_calibrator.h"

#include <unistd.h>

#include <algorithm>
#include <chrono>
#include <cmath>
#include <filesystem>
#include <fstream>
#include <memory>
#include <nlohmann/json.hpp>
#include <sstream>
#include <vector>

#include "common/hf_config.h"
#include "common/text_file.h"
#include "common/tokenizer/tokenizer.h"
#include "inference_rank/attention/cpu_backend.h"
#include "inference_rank/model/cpu_model.h"
#include "inference_rank/policies/calibration_dev_set.h"
#include "kernels/cpu/dot.h"

namespace rubato {
namespace {

// Sees each layer's queries and keys (BeforeAttention) and its residual update; computes the
// GQA-pooled post-softmax rows with the attention op's scale and score rounding (dot.h).
class CalibrationObserver final : public CpuAttentionBackend {
 public:
  CalibrationObserver(const ModelConfig& model, KascadeSimilarity& similarity)
      : model_(model), similarity_(similarity) {}

  Status BeforeAttention(const CpuLayerContext& context) override {
    if (context.entries.size() != 1) {
      return InternalError("kascade calibration: one prompt per forward");
    }
    const CpuEntryRows& entry = context.entries[0];
    const int tokens = entry.tokens;
    const int kv_heads = model_.num_kv_heads;
    const int group = model_.num_heads / kv_heads;
    const int head_dim = model_.head_dim;
    const float scale = static_cast<float>(1.0 / std::sqrt(static_cast<double>(head_dim)));
    const PagedKvView kv = context.cache->LayerView(context.layer, *entry.sequence);
    probs_.assign(static_cast<size_t>(tokens) * kv_heads * tokens, 0.0f);
    const int workers = context.pool->num_workers();
    if (static_cast<int>(scratch_.size()) < workers) scratch_.resize(static_cast<size_t>(workers));
    context.pool->ParallelFor(tokens * kv_heads, [&](int item, int worker) {
      const int q = item / kv_heads, h = item % kv_heads;
      std::vector<double>& logits = scratch_[static_cast<size_t>(worker)];
      logits.resize(static_cast<size_t>(q) + 1);
      float* row = probs_.data() + (static_cast<size_t>(q) * kv_heads + h) * tokens;
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
        for (int i = 0; i <= q; ++i) row[i] += static_cast<float>(logits[i] / sum / group);
      }
    });
    return similarity_.AddLayer(context.layer, probs_.data());
  }

  Result<CompactSegment> Compact(const CpuLayerContext& /*layer*/, int /*entry*/) override {
    return InternalError("kascade calibration: no compact segments");
  }

  Status AfterAttentionBlock(int layer, const float* residual, const float* update,
                             int tokens) override {
    const size_t n = static_cast<size_t>(tokens) * model_.hidden_size;
    after_.resize(n);
    for (size_t i = 0; i < n; ++i) after_[i] = residual[i] + update[i];
    return similarity_.AddImportance(layer, residual, after_.data(), tokens, model_.hidden_size);
  }

 private:
  ModelConfig model_;
  KascadeSimilarity& similarity_;
  std::vector<float> probs_;  // [tokens][kv_heads][tokens]
  std::vector<float> after_;
  std::vector<std::vector<double>> scratch_;  // [worker] one row's logits
};

}  // namespace

uint64_t KascadeCalibrationBytes(const ModelConfig& model, int tokens, int top_k) {
  const uint64_t t = static_cast<uint64_t>(tokens);
  const uint64_t h = static_cast<uint64_t>(model.num_kv_heads);
  const uint64_t k = static_cast<uint64_t>(std::min(top_k, tokens));
  const uint64_t probs = t * h * t * sizeof(float);  // [tokens][kv_heads][tokens]
  const uint64_t sets = static_cast<uint64_t>(model.num_layers) * t * h * k * sizeof(int);
  const uint64_t residual = t * static_cast<uint64_t>(model.hidden_size) * sizeof(float);
  const uint64_t kv = 2 * static_cast<uint64_t>(model.num_layers) * t * h *
                      static_cast<uint64_t>(model.head_dim) * sizeof(float);
  return probs + sets + residual + kv;
}

Result<KascadeCalibration> CalibrateKascade(const KascadeCalibrateOptions& options) {
  RUBATO_RETURN_IF_ERROR(CheckCalibrateArgs(options.out, options.top_k, options.max_prompt_tokens));
  std::error_code error;  // a path too long for the OS is an answer, not an exception
  if (!std::filesystem::is_directory(options.model_dir, error)) {
    return NotFoundError("model directory '" + DisplayPath(options.model_dir) + "' does not exist");
  }
  std::string bytes;
  RUBATO_ASSIGN_OR_RETURN(const std::vector<std::string> prompts,
                          ReadCalibrationDevSet(options.dev_set, bytes));
  // The model's shape alone first: what one prompt costs is known before any weight is read.
  RUBATO_ASSIGN_OR_RETURN(const ModelConfig shape, LoadModelConfig(options.model_dir));
  const int max_tokens = std::min(options.max_prompt_tokens, shape.max_position_embeddings);
  if (options.top_k > max_tokens) {
    return InvalidArgumentError("--top-k " + std::to_string(options.top_k) +
                                " exceeds the model's max_position_embeddings (" +
                                std::to_string(max_tokens) +
                                "): a top-k set holds at most a prompt's positions");
  }
  const uint64_t needed = KascadeCalibrationBytes(shape, max_tokens, options.top_k);
  const uint64_t memory = static_cast<uint64_t>(sysconf(_SC_PHYS_PAGES)) *
                          static_cast<uint64_t>(sysconf(_SC_PAGE_SIZE));
  if (needed > memory / 2) {
    return ResourceExhaustedError(
        "--max-tokens " + std::to_string(max_tokens) + " with --top-k " +
        std::to_string(options.top_k) + ": a prompt of that length needs " +
        std::to_string(needed >> 20) + " MiB of observations, more than half of this machine's " +
        std::to_string(memory >> 20) + " MiB; lower --max-tokens");
  }
  RUBATO_ASSIGN_OR_RETURN(std::unique_ptr<Tokenizer> tokenizer,
                          Tokenizer::LoadFromDirectory(options.model_dir));
  ModelLoadOptions load;
  load.num_threads = options.threads;
  RUBATO_ASSIGN_OR_RETURN(std::unique_ptr<CpuModel> model, CpuModel::Load(options.model_dir, load));
  const ModelConfig& config = model->config();
  if (options.anchors < 1 || options.anchors > config.num_layers) {
    return InvalidArgumentError("--anchors " + std::to_string(options.anchors) +
                                " must lie in [1, " + std::to_string(config.num_layers) +
                                "] (the model's layers; layer 0 counts)");
  }
  KascadeSimilarity similarity(config.num_layers, config.num_kv_heads, options.top_k);
  RUBATO_RETURN_IF_ERROR(
      model->SetAttentionBackend(std::make_unique<CalibrationObserver>(config, similarity)));
  const int block = 16;
  RUBATO_ASSIGN_OR_RETURN(std::unique_ptr<PagedKvCache> cache,
                          model->CreateKvCache(block, (max_tokens + block - 1) / block));
  const auto start = std::chrono::steady_clock::now();
  auto elapsed = [&] {
    return std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
  };
  CalibrationProgress(options.progress, "kascade calibration", 0, static_cast<int>(prompts.size()),
                      0.0);
  for (size_t p = 0; p < prompts.size(); ++p) {
    std::vector<int> ids = tokenizer->Encode(prompts[p], /*add_special_tokens=*/true);
    if (static_cast<int>(ids.size()) > max_tokens) {
      ids.erase(ids.begin(), ids.end() - max_tokens);
    }
    KvSequence sequence;
    ForwardEntry entry;
    entry.sequence = &sequence;
    entry.tokens = ids;
    entry.logits = LogitsWanted::kNone;
    ForwardResult result;
    similarity.BeginPrompt(static_cast<int>(ids.size()));
    RUBATO_RETURN_IF_ERROR(model->Forward(std::span<const ForwardEntry>(&entry, 1), *cache, result)
                               .WithContext("dev prompt " + std::to_string(p + 1)));
    RUBATO_RETURN_IF_ERROR(similarity.EndPrompt());
    RUBATO_RETURN_IF_ERROR(cache->Release(sequence));
    CalibrationProgress(options.progress, "kascade calibration", static_cast<int>(p + 1),
                        static_cast<int>(prompts.size()), elapsed());
  }
  RUBATO_RETURN_IF_ERROR(model->SetAttentionBackend(nullptr));

  KascadeCalibration calibration;
  calibration.model = options.model_dir;
  calibration.num_layers = config.num_layers;
  calibration.num_heads = config.num_heads;
  calibration.num_kv_heads = config.num_kv_heads;
  calibration.head_dim = config.head_dim;
  calibration.dev_set = options.dev_set;
  calibration.dev_set_fnv1a = Fnv1a64Hex(bytes);
  calibration.prompts = similarity.prompts();
  calibration.top_k = options.top_k;
  calibration.head_similarity = similarity.HeadSimilarity();
  calibration.importance = similarity.Importance();
  calibration.similarity = LayerSimilarity(calibration.head_similarity, calibration.importance,
                                           config.num_layers, config.num_kv_heads);
  RUBATO_ASSIGN_OR_RETURN(
      calibration.anchors,
      SelectAnchorLayers(calibration.similarity, config.num_layers, options.anchors));
  calibration.head_map = HeadMap(calibration.head_similarity, calibration.anchors,
                                 config.num_layers, config.num_kv_heads);
  RUBATO_RETURN_IF_ERROR(SaveCalibration(calibration, options.out));
  return calibration;
}

}  // namespace rubato
