// Tests for config.json parsing: the three supported families in both transformers layouts,
// rejection of other architectures and features, and validation messages that name the key.
#include "common/hf_config.h"

#include <gmock/gmock.h>
#include <gtest/gtest.h>

#include <nlohmann/json.hpp>

#include "common/safetensors.h"
#include "common/test_temp_dir.h"

namespace rubato {
namespace {

using ::testing::AllOf;
using ::testing::HasSubstr;
using Json = nlohmann::json;

// A Qwen3-4B-like config.json in the transformers 4 layout.
Json Qwen3Config() {
  return Json::parse(R"({
    "architectures": ["Qwen3ForCausalLM"], "model_type": "qwen3",
    "vocab_size": 151936, "hidden_size": 2560, "intermediate_size": 9728,
    "num_hidden_layers": 36, "num_attention_heads": 32, "num_key_value_heads": 8,
    "head_dim": 128, "hidden_act": "silu", "rms_norm_eps": 1e-06, "rope_theta": 1000000,
    "rope_scaling": null, "max_position_embeddings": 40960, "tie_word_embeddings": true,
    "torch_dtype": "bfloat16", "bos_token_id": 151643, "eos_token_id": [151645, 151643],
    "attention_bias": false, "use_sliding_window": false, "sliding_window": null})");
}

// A Llama-3.1-8B-like config.json in the transformers 4 layout, llama3 rope scaling.
Json Llama3Config() {
  return Json::parse(R"({
    "architectures": ["LlamaForCausalLM"], "vocab_size": 128256, "hidden_size": 4096,
    "intermediate_size": 14336, "num_hidden_layers": 32, "num_attention_heads": 32,
    "num_key_value_heads": 8, "hidden_act": "silu", "rms_norm_eps": 1e-05,
    "rope_theta": 500000.0, "max_position_embeddings": 131072, "mlp_bias": false,
    "rope_scaling": {"factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                     "original_max_position_embeddings": 8192, "rope_type": "llama3"},
    "torch_dtype": "bfloat16", "bos_token_id": 128000, "eos_token_id": 128001})");
}

// A Qwen2.5-0.5B-like config.json: no head_dim, no attention_bias.
Json Qwen2Config() {
  return Json::parse(R"({
    "architectures": ["Qwen2ForCausalLM"], "vocab_size": 151936, "hidden_size": 896,
    "intermediate_size": 4864, "num_hidden_layers": 24, "num_attention_heads": 14,
    "num_key_value_heads": 2, "hidden_act": "silu", "rms_norm_eps": 1e-06,
    "rope_theta": 1000000.0, "max_position_embeddings": 32768, "tie_word_embeddings": true,
    "torch_dtype": "float32", "bos_token_id": null, "eos_token_id": 151643,
    "use_sliding_window": false})");
}

Result<ModelConfig> Parse(const Json& json) { return ParseModelConfig(json.dump(), "config.json"); }

// Parses `json`, expects failure with `code`, and returns the message.
std::string ParseError(const Json& json, StatusCode code) {
  Result<ModelConfig> result = Parse(json);
  EXPECT_FALSE(result.ok()) << json.dump();
  if (result.ok()) return "";
  EXPECT_EQ(result.status().code(), code) << result.status().message();
  return result.status().message();
}

TEST(HfConfig, ParsesQwen3) {
  auto config = Parse(Qwen3Config());
  ASSERT_TRUE(config.ok()) << config.status().message();
  EXPECT_EQ(config->arch, ModelArch::kQwen3);
  EXPECT_EQ(config->architecture, "Qwen3ForCausalLM");
  EXPECT_EQ(ModelArchName(config->arch), "qwen3");
  EXPECT_EQ(config->vocab_size, 151936);
  EXPECT_EQ(config->hidden_size, 2560);
  EXPECT_EQ(config->intermediate_size, 9728);
  EXPECT_EQ(config->num_layers, 36);
  EXPECT_EQ(config->num_heads, 32);
  EXPECT_EQ(config->num_kv_heads, 8);
  EXPECT_EQ(config->head_dim, 128);  // explicit, != hidden / heads
  EXPECT_EQ(config->q_dim(), 4096);
  EXPECT_EQ(config->kv_dim(), 1024);
  EXPECT_EQ(config->gqa_group(), 4);
  EXPECT_DOUBLE_EQ(config->rms_norm_eps, 1e-6);
  EXPECT_DOUBLE_EQ(config->rope_theta, 1e6);
  EXPECT_EQ(config->rope_scaling.type, RopeScaling::Type::kNone);
  EXPECT_EQ(config->max_position_embeddings, 40960);
  EXPECT_TRUE(config->tie_word_embeddings);
  EXPECT_TRUE(config->qk_norm);
  EXPECT_FALSE(config->qkv_bias);
  EXPECT_FALSE(config->o_proj_bias);
  EXPECT_EQ(config->bos_token_id, 151643);
  EXPECT_EQ(config->eos_token_ids, (std::vector<int>{151645, 151643}));
  EXPECT_EQ(config->torch_dtype, DType::kBF16);
}

TEST(HfConfig, ParsesQwen2WithDefaults) {
  auto config = Parse(Qwen2Config());
  ASSERT_TRUE(config.ok()) << config.status().message();
  EXPECT_EQ(config->arch, ModelArch::kQwen2);
  EXPECT_EQ(config->head_dim, 64);  // hidden / heads
  EXPECT_TRUE(config->qkv_bias);    // Qwen2 always has q/k/v biases
  EXPECT_FALSE(config->o_proj_bias);
  EXPECT_FALSE(config->qk_norm);
  EXPECT_EQ(config->bos_token_id, -1);
  EXPECT_EQ(config->eos_token_ids, (std::vector<int>{151643}));
  EXPECT_EQ(config->torch_dtype, DType::kF32);

  Json no_kv_heads = Qwen2Config();
  no_kv_heads.erase("num_key_value_heads");
  no_kv_heads.erase("torch_dtype");
  auto defaulted = Parse(no_kv_heads);
  ASSERT_TRUE(defaulted.ok()) << defaulted.status().message();
  EXPECT_EQ(defaulted->num_kv_heads, 14);
  EXPECT_EQ(defaulted->torch_dtype, DType::kBF16);
}

void ExpectLlama3Scaling(const ModelConfig& config) {
  EXPECT_EQ(config.arch, ModelArch::kLlama);
  EXPECT_DOUBLE_EQ(config.rope_theta, 500000.0);
  EXPECT_EQ(config.rope_scaling.type, RopeScaling::Type::kLlama3);
  EXPECT_DOUBLE_EQ(config.rope_scaling.factor, 8.0);
  EXPECT_DOUBLE_EQ(config.rope_scaling.low_freq_factor, 1.0);
  EXPECT_DOUBLE_EQ(config.rope_scaling.high_freq_factor, 4.0);
  EXPECT_EQ(config.rope_scaling.original_max_position_embeddings, 8192);
  EXPECT_EQ(config.head_dim, 128);
  EXPECT_FALSE(config.qk_norm);
}

TEST(HfConfig, ParsesLlama3ScalingInTransformers4Layout) {
  auto config = Parse(Llama3Config());
  ASSERT_TRUE(config.ok()) << config.status().message();
  ExpectLlama3Scaling(*config);
  EXPECT_EQ(config->bos_token_id, 128000);
  EXPECT_EQ(config->eos_token_ids, (std::vector<int>{128001}));

  // Older checkpoints spell the key `type`.
  Json legacy = Llama3Config();
  legacy["rope_scaling"].erase("rope_type");
  legacy["rope_scaling"]["type"] = "llama3";
  auto legacy_config = Parse(legacy);
  ASSERT_TRUE(legacy_config.ok()) << legacy_config.status().message();
  ExpectLlama3Scaling(*legacy_config);
}

TEST(HfConfig, ParsesLlama3ScalingInTransformers5Layout) {
  Json json = Llama3Config();
  json.erase("rope_theta");
  json.erase("rope_scaling");
  json.erase("torch_dtype");
  json["dtype"] = "float16";
  json["rope_parameters"] = Json::parse(R"({"rope_type": "llama3", "rope_theta": 500000.0,
      "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
      "original_max_position_embeddings": 8192})");
  auto config = Parse(json);
  ASSERT_TRUE(config.ok()) << config.status().message();
  ExpectLlama3Scaling(*config);
  EXPECT_EQ(config->torch_dtype, DType::kF16);

  Json plain = Qwen3Config();
  plain.erase("rope_theta");
  plain.erase("rope_scaling");
  plain["rope_parameters"] = {{"rope_type", "default"}, {"rope_theta", 5e6}};
  auto plain_config = Parse(plain);
  ASSERT_TRUE(plain_config.ok()) << plain_config.status().message();
  EXPECT_EQ(plain_config->rope_scaling.type, RopeScaling::Type::kNone);
  EXPECT_DOUBLE_EQ(plain_config->rope_theta, 5e6);
}

TEST(HfConfig, AttentionBiasAppliesToLlamaAndQwen3) {
  Json json = Llama3Config();
  json["attention_bias"] = true;
  auto config = Parse(json);
  ASSERT_TRUE(config.ok()) << config.status().message();
  EXPECT_TRUE(config->qkv_bias);
  EXPECT_TRUE(config->o_proj_bias);
}

TEST(HfConfig, RejectsUnsupportedArchitectureListingSupportedOnes) {
  Json json = Llama3Config();
  json["architectures"] = {"MistralForCausalLM"};
  EXPECT_THAT(ParseError(json, StatusCode::kUnsupported),
              HasSubstr("config.json: architecture 'MistralForCausalLM' is not supported "
                        "(supported: LlamaForCausalLM, Qwen2ForCausalLM, Qwen3ForCausalLM)"));
  json.erase("architectures");
  EXPECT_THAT(ParseError(json, StatusCode::kInvalidArgument),
              HasSubstr("config.json: architectures: expected a list"));
}

TEST(HfConfig, RejectsUnsupportedRopeTypes) {
  for (const char* type : {"yarn", "linear", "dynamic", "longrope"}) {
    Json json = Llama3Config();
    json["rope_scaling"] = {{"rope_type", type}, {"factor", 4.0}};
    EXPECT_THAT(ParseError(json, StatusCode::kUnsupported),
                HasSubstr("config.json: rope_scaling.rope_type '" + std::string(type) +
                          "' is not supported (supported: default, llama3)"));
  }
  Json v5 = Qwen3Config();
  v5["rope_parameters"] = {{"rope_type", "yarn"}, {"rope_theta", 1e6}};
  EXPECT_THAT(ParseError(v5, StatusCode::kUnsupported),
              HasSubstr("rope_parameters.rope_type 'yarn' is not supported"));
}

TEST(HfConfig, Llama3ScalingRequiresItsParameters) {
  Json json = Llama3Config();
  json["rope_scaling"].erase("low_freq_factor");
  EXPECT_THAT(ParseError(json, StatusCode::kInvalidArgument),
              HasSubstr("config.json: rope_scaling.low_freq_factor: missing (required)"));
  json = Llama3Config();
  json["rope_scaling"]["high_freq_factor"] = 0.5;
  EXPECT_THAT(ParseError(json, StatusCode::kInvalidArgument),
              HasSubstr("rope_scaling.high_freq_factor: must be greater than low_freq_factor "
                        "(1), got 0.5"));
  json = Llama3Config();
  json["rope_scaling"]["original_max_position_embeddings"] = "8192";
  EXPECT_THAT(ParseError(json, StatusCode::kInvalidArgument),
              HasSubstr("rope_scaling.original_max_position_embeddings: expected an integer, "
                        "got string"));
}

TEST(HfConfig, HeadsMustBeDivisibleByKvHeads) {
  Json json = Qwen3Config();
  json["num_attention_heads"] = 12;
  json["num_key_value_heads"] = 5;
  EXPECT_THAT(ParseError(json, StatusCode::kInvalidArgument),
              HasSubstr("config.json: num_attention_heads (12) is not divisible by "
                        "num_key_value_heads (5)"));
}

TEST(HfConfig, WrongTypesNameTheKey) {
  struct Case {
    const char* key;
    Json value;
    std::string expected;
  };
  const std::vector<Case> cases = {
      {"hidden_size", "4096", "config.json: hidden_size: expected an integer, got string"},
      {"num_hidden_layers", 3.5,
       "config.json: num_hidden_layers: expected an integer, got "
       "number 3.5"},
      {"vocab_size", nullptr, "config.json: vocab_size: missing (required)"},
      {"rms_norm_eps", "small", "config.json: rms_norm_eps: expected a number, got string"},
      {"tie_word_embeddings", "yes", "config.json: tie_word_embeddings: expected true or false"},
      {"eos_token_id", "</s>", "config.json: eos_token_id: expected a token id"},
      {"eos_token_id", Json::array({1, -2}), "config.json: eos_token_id: expected a token id"},
      {"bos_token_id", Json::array({1, 2}), "config.json: bos_token_id: expected one token id"},
      {"torch_dtype", "int8", "config.json: torch_dtype: unknown dtype 'int8'"},
      {"rope_scaling", "llama3", "config.json: rope_scaling: expected an object or null"},
      {"hidden_size", 5000000000LL, "config.json: hidden_size: integer 5000000000 is out of range"},
  };
  for (const Case& c : cases) {
    Json json = Qwen3Config();
    json[c.key] = c.value;
    EXPECT_THAT(ParseError(json, StatusCode::kInvalidArgument), HasSubstr(c.expected)) << c.key;
  }
}

TEST(HfConfig, ValuesOutOfRangeNameTheKey) {
  struct Case {
    const char* key;
    Json value;
    std::string expected;
  };
  const std::vector<Case> cases = {
      {"hidden_size", 0, "config.json: hidden_size: must be positive, got 0"},
      {"num_key_value_heads", -2, "config.json: num_key_value_heads: must be positive, got -2"},
      {"head_dim", 15, "config.json: head_dim: must be even (RoPE rotates pairs), got 15"},
      {"rms_norm_eps", 0, "config.json: rms_norm_eps: must be positive, got 0"},
      {"rope_theta", -1.5, "config.json: rope_theta: must be positive, got -1.5"},
  };
  for (const Case& c : cases) {
    Json json = Qwen3Config();
    json[c.key] = c.value;
    EXPECT_THAT(ParseError(json, StatusCode::kInvalidArgument), HasSubstr(c.expected)) << c.key;
  }
  Json no_head_dim = Qwen2Config();
  no_head_dim["hidden_size"] = 900;
  EXPECT_THAT(ParseError(no_head_dim, StatusCode::kInvalidArgument),
              HasSubstr("hidden_size (900) is not divisible by num_attention_heads (14) and "
                        "head_dim is not given"));
}

TEST(HfConfig, RejectsFeaturesRubatoDoesNotImplement) {
  Json gelu = Llama3Config();
  gelu["hidden_act"] = "gelu";
  EXPECT_THAT(ParseError(gelu, StatusCode::kUnsupported),
              HasSubstr("config.json: hidden_act 'gelu' is not supported"));
  Json mlp_bias = Llama3Config();
  mlp_bias["mlp_bias"] = true;
  EXPECT_THAT(ParseError(mlp_bias, StatusCode::kUnsupported),
              HasSubstr("config.json: mlp_bias: true is not supported"));
  Json sliding = Qwen2Config();
  sliding["use_sliding_window"] = true;
  EXPECT_THAT(ParseError(sliding, StatusCode::kUnsupported),
              HasSubstr("config.json: use_sliding_window: true is not supported"));
}

TEST(HfConfig, BadJsonIsReported) {
  Result<ModelConfig> result = ParseModelConfig("{\"vocab_size\": 12,", "model/config.json");
  ASSERT_FALSE(result.ok());
  EXPECT_EQ(result.status().code(), StatusCode::kInvalidArgument);
  EXPECT_THAT(result.status().message(), HasSubstr("model/config.json: not valid JSON"));
  EXPECT_THAT(ParseModelConfig("[1]", "config.json").status().message(),
              HasSubstr("config.json: expected a JSON object, got array"));
}

TEST(HfConfig, LoadModelConfigReadsTheDirectory) {
  TestTempDir dir("hf_config");
  Status missing = LoadModelConfig(dir.path()).status();
  EXPECT_EQ(missing.code(), StatusCode::kNotFound);
  EXPECT_THAT(missing.message(), HasSubstr((dir.path() / "config.json").string()));

  dir.WriteFile("config.json", R"({"architectures": ["GPT2LMHeadModel"]})");
  Status unsupported = LoadModelConfig(dir.path()).status();
  EXPECT_EQ(unsupported.code(), StatusCode::kUnsupported);
  EXPECT_THAT(unsupported.message(), HasSubstr((dir.path() / "config.json").string() +
                                               ": architecture 'GPT2LMHeadModel'"));

  dir.WriteFile("config.json", Qwen2Config().dump());
  auto config = LoadModelConfig(dir.path());
  ASSERT_TRUE(config.ok()) << config.status().message();
  EXPECT_EQ(config->arch, ModelArch::kQwen2);
}

// The tiny checkpoints in the repository were written by transformers: their config.json must
// parse and agree with the tensors in their safetensors files.
TEST(HfConfig, CommittedTinyModelsMatchTheirCheckpoints) {
  for (const char* dir : {"models/tiny-qwen3-random", "tests/data/models/tiny-llama3-random",
                          "tests/data/models/tiny-qwen2-random"}) {
    SCOPED_TRACE(dir);
    auto config = LoadModelConfig(dir);
    ASSERT_TRUE(config.ok()) << config.status().message();
    auto checkpoint = SafetensorsCheckpoint::OpenDirectory(dir);
    ASSERT_TRUE(checkpoint.ok()) << checkpoint.status().message();
    const SafetensorsTensor* embed = checkpoint->Find("model.embed_tokens.weight");
    ASSERT_NE(embed, nullptr);
    EXPECT_EQ(embed->view.shape, Shape({config->vocab_size, config->hidden_size}));
    EXPECT_EQ(embed->view.dtype, config->torch_dtype);
    const SafetensorsTensor* k_proj = checkpoint->Find("model.layers.0.self_attn.k_proj.weight");
    ASSERT_NE(k_proj, nullptr);
    EXPECT_EQ(k_proj->view.shape, Shape({config->kv_dim(), config->hidden_size}));
    EXPECT_EQ(checkpoint->Find("model.layers.0.self_attn.q_proj.bias") != nullptr,
              config->qkv_bias);
    EXPECT_EQ(checkpoint->Find("model.layers.0.self_attn.q_norm.weight") != nullptr,
              config->qk_norm);
    EXPECT_EQ(checkpoint->Find("lm_head.weight") == nullptr, config->tie_word_embeddings);
  }
}

}  // namespace
}  // namespace rubato
