// Hugging Face config.json parsing and validation (see hf_config.h).
//
// Both layouts of transformers are read: v4 (`rope_theta` at the top level, `rope_scaling`
// with `rope_type` or the older `type`) and v5 (`rope_parameters` holding `rope_type`,
// `rope_theta` and the scaling values). Keys rubato does not use are ignored; keys that change
// the computation in a way rubato does not implement are rejected by name.
#include "common/hf_config.h"

#include <fmt/format.h>

#include <climits>
#include <nlohmann/json.hpp>
#include <optional>

#include "common/json_limits.h"
#include "common/text_file.h"

namespace rubato {
namespace {

using Json = nlohmann::json;

// "string \"4096\"", "number 1.5", "null", "array": what a wrong value is, for error messages.
std::string DescribeJson(const Json& value) {
  if (value.is_object() || value.is_array() || value.is_null()) return value.type_name();
  std::string text = value.dump();
  if (text.size() > 40) text = text.substr(0, 37) + "...";
  return std::string(value.is_number() ? "number" : value.type_name()) + " " + text;
}

// Typed reads from one JSON object of config.json. `prefix` is the key path of the object
// ("" for the top level, "rope_scaling." inside it) so that errors name the full key.
class ConfigObjectReader {
 public:
  ConfigObjectReader(const Json& object, const std::string& source, std::string prefix)
      : object_(object), source_(source), prefix_(std::move(prefix)) {}

  // True when `key` is present with a non-null value.
  bool Has(const char* key) const { return object_.contains(key) && !object_[key].is_null(); }

  Status Error(const char* key, const std::string& message) const {
    return InvalidArgumentError(source_ + ": " + prefix_ + key + ": " + message);
  }
  // An error about several keys at once; `message` names them.
  Status Fail(const std::string& message) const {
    return InvalidArgumentError(source_ + ": " + message);
  }
  Status Unsupported(const std::string& message) const {
    return UnsupportedError(source_ + ": " + message);
  }

  // Each Read* leaves *value unchanged when the key is absent or null and `required` is false.
  Status ReadInt(const char* key, int* value, bool required) const {
    if (!Has(key)) return required ? Missing(key) : Status::Ok();
    const Json& json = object_[key];
    if (!json.is_number_integer()) {
      return Error(key, "expected an integer, got " + DescribeJson(json));
    }
    const bool fits = json.is_number_unsigned() ? json.get<uint64_t>() <= INT_MAX
                                                : json.get<int64_t>() >= INT_MIN;
    if (!fits) return Error(key, "integer " + json.dump() + " is out of range");
    *value = static_cast<int>(json.get<int64_t>());
    return Status::Ok();
  }

  Status ReadDouble(const char* key, double* value, bool required) const {
    if (!Has(key)) return required ? Missing(key) : Status::Ok();
    const Json& json = object_[key];
    if (!json.is_number()) return Error(key, "expected a number, got " + DescribeJson(json));
    *value = json.get<double>();
    return Status::Ok();
  }

  Status ReadBool(const char* key, bool* value) const {
    if (!Has(key)) return Status::Ok();
    const Json& json = object_[key];
    if (!json.is_boolean()) return Error(key, "expected true or false, got " + DescribeJson(json));
    *value = json.get<bool>();
    return Status::Ok();
  }

  Status ReadString(const char* key, std::string* value) const {
    if (!Has(key)) return Status::Ok();
    const Json& json = object_[key];
    if (!json.is_string()) return Error(key, "expected a string, got " + DescribeJson(json));
    *value = json.get<std::string>();
    return Status::Ok();
  }

  // A token id or a list of them (eos_token_id); null or absent leaves `ids` empty.
  Status ReadTokenIds(const char* key, std::vector<int>* ids) const {
    if (!Has(key)) return Status::Ok();
    const Json& json = object_[key];
    const Json list = json.is_array() ? json : Json::array({json});
    for (const Json& id : list) {
      if (!id.is_number_unsigned() || id.get<uint64_t>() > INT_MAX) {
        return Error(key,
                     "expected a token id or a list of token ids (non-negative integers), "
                     "got " +
                         DescribeJson(json));
      }
      ids->push_back(static_cast<int>(id.get<int64_t>()));
    }
    return Status::Ok();
  }

 private:
  Status Missing(const char* key) const { return Error(key, "missing (required)"); }

  const Json& object_;
  const std::string& source_;
  std::string prefix_;
};

struct ArchName {
  const char* name;
  ModelArch arch;
};
constexpr ArchName kSupportedArchitectures[] = {{"LlamaForCausalLM", ModelArch::kLlama},
                                                {"Qwen2ForCausalLM", ModelArch::kQwen2},
                                                {"Qwen3ForCausalLM", ModelArch::kQwen3}};

Status ReadArchitecture(const Json& root, const std::string& source, ModelConfig* config) {
  const Json* list = root.contains("architectures") ? &root["architectures"] : nullptr;
  if (list == nullptr || !list->is_array() || list->empty() || !(*list)[0].is_string()) {
    return InvalidArgumentError(source +
                                ": architectures: expected a list like "
                                "[\"LlamaForCausalLM\"], got " +
                                (list == nullptr ? std::string("nothing") : DescribeJson(*list)));
  }
  config->architecture = (*list)[0].get<std::string>();
  std::string supported;
  for (const ArchName& entry : kSupportedArchitectures) {
    if (config->architecture == entry.name) {
      config->arch = entry.arch;
      return Status::Ok();
    }
    supported += (supported.empty() ? "" : ", ") + std::string(entry.name);
  }
  return UnsupportedError(source + ": architecture '" + config->architecture +
                          "' is not supported (supported: " + supported + ")");
}

// RoPE: `rope_parameters` (transformers 5) or `rope_theta` + `rope_scaling` (transformers 4).
Status ReadRope(const Json& root, const ConfigObjectReader& top, const std::string& source,
                ModelConfig* config) {
  RUBATO_RETURN_IF_ERROR(top.ReadDouble("rope_theta", &config->rope_theta, false));
  const char* block_key = top.Has("rope_parameters") ? "rope_parameters" : "rope_scaling";
  if (!top.Has(block_key)) return Status::Ok();
  const Json& block = root[block_key];
  if (!block.is_object()) {
    return top.Error(block_key, "expected an object or null, got " + DescribeJson(block));
  }
  const ConfigObjectReader rope(block, source, std::string(block_key) + ".");
  RUBATO_RETURN_IF_ERROR(rope.ReadDouble("rope_theta", &config->rope_theta, false));

  const char* type_key = rope.Has("rope_type") ? "rope_type" : "type";
  std::string type = "default";
  RUBATO_RETURN_IF_ERROR(rope.ReadString(type_key, &type));
  if (type == "default") return Status::Ok();
  if (type != "llama3") {
    return rope.Unsupported(std::string(block_key) + "." + type_key + " '" + type +
                            "' is not supported (supported: default, llama3)");
  }
  RopeScaling& scaling = config->rope_scaling;
  scaling.type = RopeScaling::Type::kLlama3;
  RUBATO_RETURN_IF_ERROR(rope.ReadDouble("factor", &scaling.factor, true));
  RUBATO_RETURN_IF_ERROR(rope.ReadDouble("low_freq_factor", &scaling.low_freq_factor, true));
  RUBATO_RETURN_IF_ERROR(rope.ReadDouble("high_freq_factor", &scaling.high_freq_factor, true));
  RUBATO_RETURN_IF_ERROR(rope.ReadInt("original_max_position_embeddings",
                                      &scaling.original_max_position_embeddings, true));
  if (!(scaling.factor > 0)) {
    return rope.Error("factor", "must be positive, got " + fmt::format("{}", scaling.factor));
  }
  if (!(scaling.low_freq_factor > 0)) {
    return rope.Error("low_freq_factor",
                      "must be positive, got " + fmt::format("{}", scaling.low_freq_factor));
  }
  // The llama3 rule interpolates between the two wavelengths, dividing by their difference.
  if (!(scaling.high_freq_factor > scaling.low_freq_factor)) {
    return rope.Error("high_freq_factor", "must be greater than low_freq_factor (" +
                                              fmt::format("{}", scaling.low_freq_factor) +
                                              "), got " +
                                              fmt::format("{}", scaling.high_freq_factor));
  }
  if (scaling.original_max_position_embeddings <= 0) {
    return rope.Error(
        "original_max_position_embeddings",
        "must be positive, got " + std::to_string(scaling.original_max_position_embeddings));
  }
  return Status::Ok();
}

// Features that change the computation in ways rubato does not implement.
Status RejectUnsupportedFeatures(const ConfigObjectReader& top) {
  std::string hidden_act = "silu";
  RUBATO_RETURN_IF_ERROR(top.ReadString("hidden_act", &hidden_act));
  if (hidden_act != "silu") {
    return top.Unsupported("hidden_act '" + hidden_act +
                           "' is not supported (rubato's MLP is SwiGLU with silu)");
  }
  bool mlp_bias = false;
  RUBATO_RETURN_IF_ERROR(top.ReadBool("mlp_bias", &mlp_bias));
  if (mlp_bias) return top.Unsupported("mlp_bias: true is not supported (MLP without biases)");
  bool sliding_window = false;
  RUBATO_RETURN_IF_ERROR(top.ReadBool("use_sliding_window", &sliding_window));
  if (sliding_window) {
    return top.Unsupported("use_sliding_window: true is not supported (full attention only)");
  }
  return Status::Ok();
}

Status Validate(const ConfigObjectReader& top, const ModelConfig& config) {
  const std::pair<const char*, int> sizes[] = {
      {"vocab_size", config.vocab_size},
      {"hidden_size", config.hidden_size},
      {"intermediate_size", config.intermediate_size},
      {"num_hidden_layers", config.num_layers},
      {"num_attention_heads", config.num_heads},
      {"num_key_value_heads", config.num_kv_heads},
      {"head_dim", config.head_dim},
      {"max_position_embeddings", config.max_position_embeddings}};
  for (const auto& [key, value] : sizes) {
    if (value <= 0) return top.Error(key, "must be positive, got " + std::to_string(value));
  }
  // Upper bounds far above any released model, checked before anything is sized from them: the
  // products below (weights, KV blocks) then fit 64-bit arithmetic.
  const std::pair<const char*, std::pair<int, int>> bounded[] = {
      {"vocab_size", {config.vocab_size, 1 << 22}},
      {"hidden_size", {config.hidden_size, 1 << 16}},
      {"intermediate_size", {config.intermediate_size, 1 << 20}},
      {"num_hidden_layers", {config.num_layers, 1 << 10}},
      {"num_attention_heads", {config.num_heads, 1 << 10}},
      {"num_key_value_heads", {config.num_kv_heads, 1 << 10}},
      {"head_dim", {config.head_dim, 1 << 10}},
      {"max_position_embeddings", {config.max_position_embeddings, 1 << 24}}};
  for (const auto& [key, limit] : bounded) {
    if (limit.first > limit.second) {
      return top.Error(key, "must be at most " + std::to_string(limit.second) + ", got " +
                                std::to_string(limit.first));
    }
  }
  if (config.bos_token_id >= config.vocab_size) {
    return top.Error("bos_token_id", "is " + std::to_string(config.bos_token_id) +
                                         ", outside the vocabulary [0, " +
                                         std::to_string(config.vocab_size) + ")");
  }
  for (int id : config.eos_token_ids) {
    if (id < 0 || id >= config.vocab_size) {
      return top.Error("eos_token_id", "holds " + std::to_string(id) +
                                           ", outside the vocabulary [0, " +
                                           std::to_string(config.vocab_size) + ")");
    }
  }
  if (config.num_heads % config.num_kv_heads != 0) {
    return top.Fail("num_attention_heads (" + std::to_string(config.num_heads) +
                    ") is not divisible by num_key_value_heads (" +
                    std::to_string(config.num_kv_heads) + ")");
  }
  if (config.head_dim % 2 != 0) {
    return top.Error("head_dim",
                     "must be even (RoPE rotates pairs), got " + std::to_string(config.head_dim));
  }
  if (!(config.rms_norm_eps > 0)) {
    return top.Error("rms_norm_eps",
                     "must be positive, got " + fmt::format("{}", config.rms_norm_eps));
  }
  if (!(config.rope_theta > 0)) {
    return top.Error("rope_theta", "must be positive, got " + fmt::format("{}", config.rope_theta));
  }
  return Status::Ok();
}

}  // namespace

std::string_view ModelArchName(ModelArch arch) {
  switch (arch) {
    case ModelArch::kLlama:
      return "llama";
    case ModelArch::kQwen2:
      return "qwen2";
    case ModelArch::kQwen3:
      return "qwen3";
  }
  return "?";
}

Result<ModelConfig> ParseModelConfig(std::string_view json_text, const std::string& source) {
  RUBATO_RETURN_IF_ERROR(CheckJsonNesting(json_text, source));
  Json root;
  try {
    root = Json::parse(json_text);
  } catch (const Json::exception& e) {
    return InvalidArgumentError(source + ": not valid JSON: " + e.what());
  }
  if (!root.is_object()) {
    return InvalidArgumentError(source + ": expected a JSON object, got " + DescribeJson(root));
  }
  ModelConfig config;
  RUBATO_RETURN_IF_ERROR(ReadArchitecture(root, source, &config));
  const ConfigObjectReader top(root, source, "");
  RUBATO_RETURN_IF_ERROR(RejectUnsupportedFeatures(top));

  RUBATO_RETURN_IF_ERROR(top.ReadInt("vocab_size", &config.vocab_size, true));
  RUBATO_RETURN_IF_ERROR(top.ReadInt("hidden_size", &config.hidden_size, true));
  RUBATO_RETURN_IF_ERROR(top.ReadInt("intermediate_size", &config.intermediate_size, true));
  RUBATO_RETURN_IF_ERROR(top.ReadInt("num_hidden_layers", &config.num_layers, true));
  RUBATO_RETURN_IF_ERROR(top.ReadInt("num_attention_heads", &config.num_heads, true));
  RUBATO_RETURN_IF_ERROR(
      top.ReadInt("max_position_embeddings", &config.max_position_embeddings, true));
  config.num_kv_heads = config.num_heads;
  RUBATO_RETURN_IF_ERROR(top.ReadInt("num_key_value_heads", &config.num_kv_heads, false));
  if (top.Has("head_dim")) {
    RUBATO_RETURN_IF_ERROR(top.ReadInt("head_dim", &config.head_dim, true));
  } else if (config.num_heads > 0) {
    if (config.hidden_size % config.num_heads != 0) {
      return top.Fail("hidden_size (" + std::to_string(config.hidden_size) +
                      ") is not divisible by num_attention_heads (" +
                      std::to_string(config.num_heads) + ") and head_dim is not given");
    }
    config.head_dim = config.hidden_size / config.num_heads;
  }
  RUBATO_RETURN_IF_ERROR(top.ReadDouble("rms_norm_eps", &config.rms_norm_eps, false));
  RUBATO_RETURN_IF_ERROR(ReadRope(root, top, source, &config));
  RUBATO_RETURN_IF_ERROR(top.ReadBool("tie_word_embeddings", &config.tie_word_embeddings));

  bool attention_bias = false;
  RUBATO_RETURN_IF_ERROR(top.ReadBool("attention_bias", &attention_bias));
  switch (config.arch) {
    case ModelArch::kQwen2:  // q, k, v always have biases, o_proj never
      config.qkv_bias = true;
      break;
    case ModelArch::kQwen3:
      config.qk_norm = true;
      [[fallthrough]];
    case ModelArch::kLlama:  // attention_bias puts biases on q, k, v and o_proj
      config.qkv_bias = attention_bias;
      config.o_proj_bias = attention_bias;
      break;
  }

  if (top.Has("bos_token_id")) {
    std::vector<int> bos;
    RUBATO_RETURN_IF_ERROR(top.ReadTokenIds("bos_token_id", &bos));
    if (bos.size() != 1) return top.Error("bos_token_id", "expected one token id or null");
    config.bos_token_id = bos[0];
  }
  RUBATO_RETURN_IF_ERROR(top.ReadTokenIds("eos_token_id", &config.eos_token_ids));

  // transformers 5 writes `dtype`, 4 writes `torch_dtype`.
  const char* dtype_key = top.Has("dtype") ? "dtype" : "torch_dtype";
  std::string dtype_name;
  RUBATO_RETURN_IF_ERROR(top.ReadString(dtype_key, &dtype_name));
  if (!dtype_name.empty()) {
    Result<DType> dtype = ParseDTypeName(dtype_name);
    if (!dtype.ok()) return top.Error(dtype_key, dtype.status().message());
    config.torch_dtype = *dtype;
  }

  RUBATO_RETURN_IF_ERROR(Validate(top, config));
  return config;
}

Result<ModelConfig> LoadModelConfig(const std::filesystem::path& model_dir) {
  const std::filesystem::path path = model_dir / "config.json";
  Result<std::string> text = ReadTextFile(path, kMaxConfigFileBytes);
  if (!text.ok()) {
    return text.status().WithContext("reading the model config of " + DisplayPath(model_dir));
  }
  return ParseModelConfig(*text, DisplayPath(path));
}

}  // namespace rubato
