// configs/models: every config.json parses, has the published shape, and its parameter count
// (inference_rank/model ParameterCount: every tensor the weight table lists; a tied lm_head is
// not listed) equals the count computed from the shapes below and is within 1% of the size
// the model card publishes.
#include <gtest/gtest.h>

#include <cmath>
#include <cstdint>
#include <ostream>
#include <string>

#include "common/hf_config.h"
#include "inference_rank/model/model_weights.h"

namespace rubato {
namespace {

struct PublishedModel {
  const char* dir;  // under configs/models
  ModelArch arch;
  int layers, hidden, heads, kv_heads, head_dim, intermediate, vocab;
  bool tied;
  bool qk_norm;
  int64_t expected_parameters;  // from the shapes, see ExpectedParameters
  double published_parameters;  // the model card's figure
};

void PrintTo(const PublishedModel& m, std::ostream* os) { *os << m.dir; }

// Embedding + per layer (q, k, v, o projections, [q/k norm], two RMSNorms, gate/up/down) +
// final norm + lm_head when untied. No biases in these four models.
int64_t ExpectedParameters(const PublishedModel& m) {
  const int64_t h = m.hidden, q = int64_t{m.heads} * m.head_dim,
                kv = int64_t{m.kv_heads} * m.head_dim;
  const int64_t attention = h * q + 2 * h * kv + q * h + (m.qk_norm ? 2 * m.head_dim : 0);
  const int64_t layer = attention + 2 * h + 3 * h * m.intermediate;
  const int64_t embedding = int64_t{m.vocab} * h;
  return embedding * (m.tied ? 1 : 2) + m.layers * layer + h;
}

// Published sizes: Qwen3 model cards ("Number of Parameters": 0.6B, 4.0B, 8.2B) and Llama 3.1
// 8B (8.03B).
const PublishedModel kModels[] = {
    // 151936*1024 + 28*(6291456 + 256 + 2048 + 9437184) + 1024 = 596,049,920
    {"qwen3-0.6b", ModelArch::kQwen3, 28, 1024, 16, 8, 128, 3072, 151936, true, true, 596049920,
     0.6e9},
    // 151936*2560 + 36*(26214400 + 256 + 5120 + 74711040) + 2560 = 4,022,468,096
    {"qwen3-4b", ModelArch::kQwen3, 36, 2560, 32, 8, 128, 9728, 151936, true, true, 4022468096,
     4.0e9},
    // 2*151936*4096 + 36*(41943040 + 256 + 8192 + 150994944) + 4096 = 8,190,735,360
    {"qwen3-8b", ModelArch::kQwen3, 36, 4096, 32, 8, 128, 12288, 151936, false, true, 8190735360,
     8.2e9},
    // 2*128256*4096 + 32*(41943040 + 8192 + 176160768) + 4096 = 8,030,261,248
    {"llama-3.1-8b", ModelArch::kLlama, 32, 4096, 32, 8, 128, 14336, 128256, false, false,
     8030261248, 8.03e9},
};

class ModelConfigsTest : public ::testing::TestWithParam<PublishedModel> {};

TEST_P(ModelConfigsTest, ParsesWithThePublishedShapeAndSize) {
  const PublishedModel& m = GetParam();
  Result<ModelConfig> parsed = LoadModelConfig(std::string("configs/models/") + m.dir);
  ASSERT_TRUE(parsed.ok()) << parsed.status().ToString();
  const ModelConfig& c = *parsed;
  EXPECT_EQ(c.arch, m.arch);
  EXPECT_EQ(c.num_layers, m.layers);
  EXPECT_EQ(c.hidden_size, m.hidden);
  EXPECT_EQ(c.num_heads, m.heads);
  EXPECT_EQ(c.num_kv_heads, m.kv_heads);
  EXPECT_EQ(c.head_dim, m.head_dim);
  EXPECT_EQ(c.intermediate_size, m.intermediate);
  EXPECT_EQ(c.vocab_size, m.vocab);
  EXPECT_EQ(c.tie_word_embeddings, m.tied);
  EXPECT_EQ(c.qk_norm, m.qk_norm);
  EXPECT_FALSE(c.qkv_bias);
  EXPECT_EQ(c.torch_dtype, DType::kBF16);
  EXPECT_FALSE(c.eos_token_ids.empty());

  EXPECT_EQ(ExpectedParameters(m), m.expected_parameters);  // the comment's arithmetic
  const int64_t count = ParameterCount(c);
  EXPECT_EQ(count, m.expected_parameters);
  EXPECT_LT(std::abs(static_cast<double>(count) - m.published_parameters),
            0.01 * m.published_parameters)
      << m.dir << ": " << count << " parameters vs " << m.published_parameters << " published";
}

TEST(ModelConfigs, LlamaUsesLlama3RopeScaling) {
  Result<ModelConfig> parsed = LoadModelConfig("configs/models/llama-3.1-8b");
  ASSERT_TRUE(parsed.ok()) << parsed.status().ToString();
  EXPECT_EQ(parsed->rope_scaling.type, RopeScaling::Type::kLlama3);
  EXPECT_EQ(parsed->rope_scaling.factor, 8.0);
  EXPECT_EQ(parsed->rope_scaling.low_freq_factor, 1.0);
  EXPECT_EQ(parsed->rope_scaling.high_freq_factor, 4.0);
  EXPECT_EQ(parsed->rope_scaling.original_max_position_embeddings, 8192);
  EXPECT_EQ(parsed->rope_theta, 500000.0);
  EXPECT_EQ(parsed->max_position_embeddings, 131072);
  EXPECT_EQ(parsed->bos_token_id, 128000);
}

TEST(ModelConfigs, QwenUsesPlainRope) {
  Result<ModelConfig> parsed = LoadModelConfig("configs/models/qwen3-8b");
  ASSERT_TRUE(parsed.ok()) << parsed.status().ToString();
  EXPECT_EQ(parsed->rope_scaling.type, RopeScaling::Type::kNone);
  EXPECT_EQ(parsed->rope_theta, 1000000.0);
  EXPECT_EQ(parsed->max_position_embeddings, 40960);
  EXPECT_EQ(parsed->bos_token_id, 151643);
  ASSERT_EQ(parsed->eos_token_ids.size(), 1u);
  EXPECT_EQ(parsed->eos_token_ids[0], 151645);
}

INSTANTIATE_TEST_SUITE_P(Published, ModelConfigsTest, ::testing::ValuesIn(kModels),
                         [](const ::testing::TestParamInfo<PublishedModel>& info) {
                           std::string name = info.param.dir;
                           for (char& ch : name) {
                             if (ch == '-' || ch == '.') ch = '_';
                           }
                           return name;
                         });

}  // namespace
}  // namespace rubato
