// The weight table and what it drives: loading, checks, accounting, random init
// (see model_weights.h).
#include "inference_rank/model/model_weights.h"

#include <algorithm>
#include <cmath>
#include <new>
#include <numbers>
#include <set>
#include <thread>

#include "common/dtype.h"
#include "common/logging.h"

namespace rubato {
namespace {

constexpr const char* kLogSubsystem = "model";

int64_t Numel(const Shape& shape) { return shape.numel(); }

std::string ShapeOfConfigExplanation(const ModelConfig& config) {
  return config.architecture + " with hidden_size " + std::to_string(config.hidden_size) + ", " +
         std::to_string(config.num_heads) + " heads x head_dim " + std::to_string(config.head_dim) +
         ", " + std::to_string(config.num_kv_heads) + " KV heads";
}

// ---- deterministic random numbers --------------------------------------------------------

uint64_t SplitMix64(uint64_t x) {
  x += 0x9e3779b97f4a7c15ull;
  x = (x ^ (x >> 30)) * 0xbf58476d1ce4e5b9ull;
  x = (x ^ (x >> 27)) * 0x94d049bb133111ebull;
  return x ^ (x >> 31);
}

uint64_t HashName(const std::string& name) {  // FNV-1a
  uint64_t hash = 0xcbf29ce484222325ull;
  for (unsigned char c : name) hash = (hash ^ c) * 0x100000001b3ull;
  return hash;
}

// Fills values[begin, end) (begin even) with N(0, std^2) numbers: Box-Muller on two uniforms
// hashed from (key, pair index) gives the pair (2i, 2i + 1).
void FillNormalRange(uint64_t key, float std_dev, float* values, size_t begin, size_t end) {
  for (size_t i = begin; i < end; i += 2) {
    const uint64_t pair = i / 2;
    const uint64_t h1 = SplitMix64(key ^ SplitMix64(2 * pair));
    const uint64_t h2 = SplitMix64(key ^ SplitMix64(2 * pair + 1));
    const double u1 = (static_cast<double>(h1 >> 11) + 1.0) * 0x1.0p-53;  // (0, 1]
    const double u2 = static_cast<double>(h2 >> 11) * 0x1.0p-53;          // [0, 1)
    const double radius = std::sqrt(-2.0 * std::log(u1)) * std_dev;
    const double angle = 2.0 * std::numbers::pi * u2;
    values[i] = static_cast<float>(radius * std::cos(angle));
    if (i + 1 < end) values[i + 1] = static_cast<float>(radius * std::sin(angle));
  }
}

// Large tensors are split over threads; each element's value depends only on its index.
void FillNormal(uint64_t key, float std_dev, std::vector<float>& values) {
  constexpr size_t kElementsPerThread = size_t{1} << 20;
  const size_t n = values.size();
  const size_t hardware = std::max(1u, std::thread::hardware_concurrency());
  const size_t threads = std::min(hardware, std::max<size_t>(1, n / kElementsPerThread));
  if (threads <= 1) {
    FillNormalRange(key, std_dev, values.data(), 0, n);
    return;
  }
  const size_t chunk = ((n + threads - 1) / threads + 1) & ~size_t{1};  // even chunk starts
  std::vector<std::thread> workers;
  for (size_t begin = 0; begin < n; begin += chunk) {
    workers.emplace_back(FillNormalRange, key, std_dev, values.data(), begin,
                         std::min(n, begin + chunk));
  }
  for (std::thread& t : workers) t.join();
}

bool IsIgnorableExtraTensor(const ModelConfig& config, const std::string& name) {
  const std::string inv_freq = "rotary_emb.inv_freq";
  if (name.size() >= inv_freq.size() &&
      name.compare(name.size() - inv_freq.size(), inv_freq.size(), inv_freq) == 0) {
    return true;
  }
  return config.tie_word_embeddings && name == "lm_head.weight";
}

}  // namespace

std::vector<WeightSlot> ListWeights(const ModelConfig& config, ModelWeights* weights) {
  const int64_t hidden = config.hidden_size;
  const int64_t q_dim = config.q_dim();
  const int64_t kv_dim = config.kv_dim();
  const int64_t head_dim = config.head_dim;
  const int64_t intermediate = config.intermediate_size;
  const int64_t vocab = config.vocab_size;
  if (weights != nullptr) weights->layers.resize(static_cast<size_t>(config.num_layers));

  std::vector<WeightSlot> slots;
  auto add = [&](std::string name, Shape shape, WeightInit init, std::vector<float>* storage) {
    slots.push_back(
        WeightSlot{std::move(name), std::move(shape), init, weights ? storage : nullptr});
  };
  using enum WeightInit;
  add("model.embed_tokens.weight", {vocab, hidden}, kNormal,
      weights ? &weights->embed_tokens : nullptr);
  for (int i = 0; i < config.num_layers; ++i) {
    LayerWeights* layer = weights ? &weights->layers[static_cast<size_t>(i)] : nullptr;
    auto slot = [&](std::vector<float> LayerWeights::*member) {
      return layer ? &(layer->*member) : nullptr;
    };
    const std::string prefix = "model.layers." + std::to_string(i) + ".";
    const std::string attn = prefix + "self_attn.";
    add(prefix + "input_layernorm.weight", {hidden}, kOnes, slot(&LayerWeights::input_norm));
    add(attn + "q_proj.weight", {q_dim, hidden}, kNormal, slot(&LayerWeights::q_proj));
    if (config.qkv_bias) add(attn + "q_proj.bias", {q_dim}, kNormal, slot(&LayerWeights::q_bias));
    add(attn + "k_proj.weight", {kv_dim, hidden}, kNormal, slot(&LayerWeights::k_proj));
    if (config.qkv_bias) add(attn + "k_proj.bias", {kv_dim}, kNormal, slot(&LayerWeights::k_bias));
    add(attn + "v_proj.weight", {kv_dim, hidden}, kNormal, slot(&LayerWeights::v_proj));
    if (config.qkv_bias) add(attn + "v_proj.bias", {kv_dim}, kNormal, slot(&LayerWeights::v_bias));
    if (config.qk_norm) {
      add(attn + "q_norm.weight", {head_dim}, kOnes, slot(&LayerWeights::q_norm));
      add(attn + "k_norm.weight", {head_dim}, kOnes, slot(&LayerWeights::k_norm));
    }
    add(attn + "o_proj.weight", {hidden, q_dim}, kNormal, slot(&LayerWeights::o_proj));
    if (config.o_proj_bias) {
      add(attn + "o_proj.bias", {hidden}, kNormal, slot(&LayerWeights::o_bias));
    }
    add(prefix + "post_attention_layernorm.weight", {hidden}, kOnes,
        slot(&LayerWeights::post_attention_norm));
    add(prefix + "mlp.gate_proj.weight", {intermediate, hidden}, kNormal,
        slot(&LayerWeights::gate_proj));
    add(prefix + "mlp.up_proj.weight", {intermediate, hidden}, kNormal,
        slot(&LayerWeights::up_proj));
    add(prefix + "mlp.down_proj.weight", {hidden, intermediate}, kNormal,
        slot(&LayerWeights::down_proj));
  }
  add("model.norm.weight", {hidden}, kOnes, weights ? &weights->final_norm : nullptr);
  if (!config.tie_word_embeddings) {
    add("lm_head.weight", {vocab, hidden}, kNormal, weights ? &weights->lm_head : nullptr);
  }
  return slots;
}

int64_t ParameterCount(const ModelConfig& config) {
  int64_t count = 0;
  for (const WeightSlot& slot : ListWeights(config, nullptr)) count += Numel(slot.shape);
  return count;
}

size_t WeightBytes(const ModelConfig& config) {
  return static_cast<size_t>(ParameterCount(config)) * sizeof(float);
}

Status CheckCheckpointTensors(const ModelConfig& config, const SafetensorsCheckpoint& checkpoint,
                              const std::string& source) {
  const std::vector<WeightSlot> slots = ListWeights(config, nullptr);
  std::vector<std::string> missing;
  std::set<std::string> listed;
  for (const WeightSlot& slot : slots) {
    listed.insert(slot.name);
    const SafetensorsTensor* tensor = checkpoint.Find(slot.name);
    if (tensor == nullptr) {
      missing.push_back(slot.name);
      continue;
    }
    if (tensor->view.shape != slot.shape) {
      return InvalidArgumentError(source + ": tensor '" + slot.name + "' has shape " +
                                  tensor->view.shape.ToString() + " but config.json implies " +
                                  slot.shape.ToString() + " (" + ShapeOfConfigExplanation(config) +
                                  ", intermediate_size " +
                                  std::to_string(config.intermediate_size) + ", vocab_size " +
                                  std::to_string(config.vocab_size) + ")");
    }
  }
  if (!missing.empty()) {
    std::string more;
    if (missing.size() > 1) more = " (and " + std::to_string(missing.size() - 1) + " more)";
    return NotFoundError(source + ": the checkpoint has no tensor '" + missing.front() + "'" +
                         more + ", which " + config.architecture +
                         " with this config.json requires");
  }
  std::vector<std::string> unexpected;
  for (const std::string& name : checkpoint.Names()) {
    if (listed.count(name)) continue;
    if (IsIgnorableExtraTensor(config, name)) {
      RUBATO_LOG_DEBUG(kLogSubsystem, "{}: ignoring tensor '{}'", source, name);
      continue;
    }
    unexpected.push_back(name);
  }
  if (!unexpected.empty()) {
    std::string names;
    for (size_t i = 0; i < unexpected.size() && i < 3; ++i) {
      names += (i ? ", '" : "'") + unexpected[i] + "'";
    }
    if (unexpected.size() > 3) names += " and " + std::to_string(unexpected.size() - 3) + " more";
    return InvalidArgumentError(
        source + ": the checkpoint has " + std::to_string(unexpected.size()) + " tensor(s) that " +
        config.architecture + " with this config.json does not use: " + names +
        "; does config.json belong to this checkpoint?");
  }
  return Status::Ok();
}

Result<ModelWeights> LoadWeights(const ModelConfig& config, const SafetensorsCheckpoint& checkpoint,
                                 const std::string& source) {
  // Check names and shapes of everything before converting anything.
  RUBATO_RETURN_IF_ERROR(CheckCheckpointTensors(config, checkpoint, source));
  ModelWeights weights;
  const std::vector<WeightSlot> slots = ListWeights(config, &weights);
  try {
    for (const WeightSlot& slot : slots) {
      const SafetensorsTensor* tensor = checkpoint.Find(slot.name);
      const size_t count = static_cast<size_t>(Numel(slot.shape));
      slot.storage->resize(count);
      ConvertToF32(tensor->view.dtype, tensor->view.data, slot.storage->data(), count);
    }
  } catch (const std::bad_alloc&) {
    return ResourceExhaustedError(source + ": not enough memory for the fp32 weights (" +
                                  std::to_string(WeightBytes(config) >> 20) + " MiB)");
  }
  return weights;
}

Result<ModelWeights> RandomWeights(const ModelConfig& config, uint64_t seed) {
  ModelWeights weights;
  try {
    for (const WeightSlot& slot : ListWeights(config, &weights)) {
      std::vector<float>& values = *slot.storage;
      values.resize(static_cast<size_t>(Numel(slot.shape)));
      if (slot.init == WeightInit::kOnes) {
        std::fill(values.begin(), values.end(), 1.0f);
      } else {
        FillNormal(SplitMix64(seed) ^ HashName(slot.name), kRandomWeightStd, values);
      }
    }
  } catch (const std::bad_alloc&) {
    return ResourceExhaustedError("random weights for " + config.architecture +
                                  ": not enough memory for the fp32 weights (" +
                                  std::to_string(WeightBytes(config) >> 20) + " MiB)");
  }
  return weights;
}

Status CheckWeightSizes(const ModelConfig& config, const ModelWeights& weights) {
  if (weights.layers.size() != static_cast<size_t>(config.num_layers)) {
    return InvalidArgumentError("weights have " + std::to_string(weights.layers.size()) +
                                " layers but config.json has num_hidden_layers " +
                                std::to_string(config.num_layers));
  }
  // ListWeights only resizes `layers`, which already has the right size.
  for (const WeightSlot& slot : ListWeights(config, const_cast<ModelWeights*>(&weights))) {
    if (slot.storage->size() != static_cast<size_t>(Numel(slot.shape))) {
      return InvalidArgumentError("tensor '" + slot.name + "' has " +
                                  std::to_string(slot.storage->size()) +
                                  " values but config.json implies " + slot.shape.ToString());
    }
  }
  if (config.tie_word_embeddings && !weights.lm_head.empty()) {
    return InvalidArgumentError(
        "weights have an lm_head but config.json ties it to the embedding "
        "(tie_word_embeddings); leave lm_head empty");
  }
  return Status::Ok();
}

}  // namespace rubato
