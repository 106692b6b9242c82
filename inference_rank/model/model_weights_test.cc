// Tests for the weight table: names and shapes per family, accounting, random init, and
// loading fabricated checkpoints (dtype conversion, missing / misshapen / unexpected tensors).
#include "inference_rank/model/model_weights.h"

#include <gtest/gtest.h>

#include <cmath>
#include <functional>
#include <map>

#include "common/dtype.h"
#include "common/safetensors_writer.h"
#include "common/test_temp_dir.h"
#include "inference_rank/model/tiny_test_models.h"

namespace rubato {
namespace {

ModelConfig TinyConfig(TinyModelKind kind) {
  Result<ModelConfig> config = ParseModelConfig(TinyConfigJson(kind), "config.json");
  EXPECT_TRUE(config.ok()) << config.status().ToString();
  return *config;
}

std::map<std::string, Shape> SlotShapes(const ModelConfig& config) {
  std::map<std::string, Shape> shapes;
  for (const WeightSlot& slot : ListWeights(config, nullptr)) shapes[slot.name] = slot.shape;
  return shapes;
}

// Writes `weights` (listed by `config`) as model.safetensors in `dir`, in `dtype`; `edit` may
// rename, reshape, drop or add tensors before writing.
using TensorList = std::vector<std::pair<std::string, TensorView>>;
Status WriteCheckpoint(const std::filesystem::path& dir, const ModelConfig& config,
                       ModelWeights& weights, DType dtype,
                       const std::function<void(TensorList&)>& edit = {}) {
  TensorList tensors;
  std::vector<std::vector<uint16_t>> converted;  // keeps bf16/f16 copies alive
  converted.reserve(1000);
  for (const WeightSlot& slot : ListWeights(config, &weights)) {
    const void* data = slot.storage->data();
    if (dtype != DType::kF32) {
      converted.emplace_back(slot.storage->size());
      ConvertFromF32(dtype, slot.storage->data(), converted.back().data(), slot.storage->size());
      data = converted.back().data();
    }
    tensors.push_back({slot.name, TensorView{data, dtype, slot.shape}});
  }
  if (edit) edit(tensors);
  return WriteSafetensors(dir / "model.safetensors", tensors);
}

TEST(ListWeights, Qwen3HasQkNormAndNoLmHeadWhenTied) {
  const std::map<std::string, Shape> shapes = SlotShapes(TinyConfig(TinyModelKind::kQwen3));
  EXPECT_EQ(shapes.at("model.embed_tokens.weight"), (Shape{97, 64}));
  EXPECT_EQ(shapes.at("model.layers.1.self_attn.q_norm.weight"), (Shape{16}));
  EXPECT_EQ(shapes.at("model.layers.0.self_attn.k_proj.weight"), (Shape{32, 64}));
  EXPECT_EQ(shapes.at("model.layers.0.self_attn.o_proj.weight"), (Shape{64, 64}));
  EXPECT_EQ(shapes.at("model.layers.1.mlp.down_proj.weight"), (Shape{64, 96}));
  EXPECT_EQ(shapes.count("lm_head.weight"), 0u);
  EXPECT_EQ(shapes.count("model.layers.0.self_attn.q_proj.bias"), 0u);
  // embed + norm + 2 x (2 norms + q,k,v,o + q/k-norm + 3 MLP) = 2 + 2 x 11.
  EXPECT_EQ(shapes.size(), 24u);
}

TEST(ListWeights, Qwen2HasQkvBiasesButNoOutputBias) {
  const std::map<std::string, Shape> shapes = SlotShapes(TinyConfig(TinyModelKind::kQwen2));
  EXPECT_EQ(shapes.at("model.layers.1.self_attn.q_proj.bias"), (Shape{64}));
  EXPECT_EQ(shapes.at("model.layers.1.self_attn.v_proj.bias"), (Shape{32}));
  EXPECT_EQ(shapes.count("model.layers.1.self_attn.o_proj.bias"), 0u);
  EXPECT_EQ(shapes.count("model.layers.1.self_attn.q_norm.weight"), 0u);
  EXPECT_EQ(shapes.at("lm_head.weight"), (Shape{97, 64}));
}

TEST(ListWeights, LlamaAttentionBiasAlsoBiasesOutputProjection) {
  const std::map<std::string, Shape> shapes = SlotShapes(TinyConfig(TinyModelKind::kLlama));
  EXPECT_EQ(shapes.at("model.layers.0.self_attn.k_proj.bias"), (Shape{32}));
  EXPECT_EQ(shapes.at("model.layers.0.self_attn.o_proj.bias"), (Shape{64}));
}

TEST(WeightAccounting, CountsEveryParameter) {
  // Qwen2 tiny: embed 97x64 + lm_head 97x64 + final norm 64 + per layer: 2 norms (128),
  // q 64x64+64, k,v 2 x (32x64+32), o 64x64, MLP 3 x 96x64.
  const int64_t per_layer = 128 + (4096 + 64) + 2 * (2048 + 32) + 4096 + 3 * 6144;
  const int64_t expected = 2 * 97 * 64 + 64 + 2 * per_layer;
  const ModelConfig config = TinyConfig(TinyModelKind::kQwen2);
  EXPECT_EQ(ParameterCount(config), expected);
  EXPECT_EQ(WeightBytes(config), static_cast<size_t>(expected) * 4);
}

TEST(RandomWeights, DeterministicPerSeedWithUnitNormsAndSmallNormals) {
  const ModelConfig config = TinyConfig(TinyModelKind::kQwen2);
  Result<ModelWeights> a = RandomWeights(config, 7);
  Result<ModelWeights> b = RandomWeights(config, 7);
  Result<ModelWeights> c = RandomWeights(config, 8);
  ASSERT_TRUE(a.ok() && b.ok() && c.ok());
  EXPECT_TRUE(CheckWeightSizes(config, *a).ok());
  EXPECT_EQ(a->layers[1].up_proj, b->layers[1].up_proj);
  EXPECT_NE(a->layers[1].up_proj, c->layers[1].up_proj);
  EXPECT_NE(a->layers[0].up_proj, a->layers[1].up_proj);  // tensors differ from each other
  for (float w : a->layers[0].input_norm) ASSERT_EQ(w, 1.0f);
  for (float w : a->final_norm) ASSERT_EQ(w, 1.0f);
  // The embedding has 6208 values: mean ~ 0, std ~ 0.02.
  double sum = 0, sum_sq = 0;
  for (float w : a->embed_tokens) {
    sum += w;
    sum_sq += double(w) * w;
  }
  const double n = static_cast<double>(a->embed_tokens.size());
  EXPECT_NEAR(sum / n, 0.0, 0.002);
  EXPECT_NEAR(std::sqrt(sum_sq / n), 0.02, 0.001);
}

TEST(LoadWeights, ConvertsEveryDtypeToF32) {
  const ModelConfig config = TinyConfig(TinyModelKind::kQwen3);
  ModelWeights original = *RandomWeights(config, 3);
  for (DType dtype : {DType::kF32, DType::kBF16, DType::kF16}) {
    TestTempDir dir("weights");
    ASSERT_TRUE(WriteCheckpoint(dir.path(), config, original, dtype).ok());
    Result<SafetensorsCheckpoint> checkpoint = SafetensorsCheckpoint::OpenDirectory(dir.path());
    ASSERT_TRUE(checkpoint.ok()) << checkpoint.status().ToString();
    Result<ModelWeights> loaded = LoadWeights(config, *checkpoint, "tiny");
    ASSERT_TRUE(loaded.ok()) << loaded.status().ToString();
    const std::vector<float>& before = original.layers[1].q_proj;
    const std::vector<float>& after = loaded->layers[1].q_proj;
    ASSERT_EQ(before.size(), after.size());
    for (size_t i = 0; i < before.size(); ++i) {
      uint16_t stored = 0;
      float expected = before[i];
      if (dtype != DType::kF32) {  // the value went through the 16-bit format
        ConvertFromF32(dtype, &before[i], &stored, 1);
        ConvertToF32(dtype, &stored, &expected, 1);
      }
      ASSERT_EQ(after[i], expected) << DTypeName(dtype) << " element " << i;
    }
  }
}

TEST(LoadWeights, MissingTensorIsNamed) {
  const ModelConfig config = TinyConfig(TinyModelKind::kQwen3);
  ModelWeights weights = *RandomWeights(config, 1);
  TestTempDir dir("weights");
  ASSERT_TRUE(WriteCheckpoint(dir.path(), config, weights, DType::kF32, [](TensorList& t) {
                std::erase_if(t, [](const auto& entry) {
                  return entry.first == "model.layers.1.self_attn.k_norm.weight";
                });
              }).ok());
  Result<ModelWeights> loaded =
      LoadWeights(config, *SafetensorsCheckpoint::OpenDirectory(dir.path()), "/m/tiny");
  ASSERT_FALSE(loaded.ok());
  EXPECT_EQ(loaded.status().code(), StatusCode::kNotFound);
  EXPECT_EQ(loaded.status().message(),
            "/m/tiny: the checkpoint has no tensor 'model.layers.1.self_attn.k_norm.weight', "
            "which Qwen3ForCausalLM with this config.json requires");
}

TEST(LoadWeights, WrongShapeNamesTensorAndBothShapes) {
  const ModelConfig config = TinyConfig(TinyModelKind::kQwen2);
  ModelWeights weights = *RandomWeights(config, 1);
  TestTempDir dir("weights");
  ASSERT_TRUE(WriteCheckpoint(dir.path(), config, weights, DType::kF32, [](TensorList& t) {
                for (auto& [name, view] : t) {
                  if (name == "model.layers.1.mlp.up_proj.weight") view.shape = Shape{64, 96};
                }
              }).ok());
  Result<ModelWeights> loaded =
      LoadWeights(config, *SafetensorsCheckpoint::OpenDirectory(dir.path()), "/m/tiny");
  ASSERT_FALSE(loaded.ok());
  EXPECT_EQ(loaded.status().code(), StatusCode::kInvalidArgument);
  EXPECT_NE(loaded.status().message().find(
                "tensor 'model.layers.1.mlp.up_proj.weight' has shape [64, 96] but config.json "
                "implies [96, 64]"),
            std::string::npos)
      << loaded.status().message();
}

TEST(LoadWeights, UnexpectedTensorsAreErrorsExceptRopeBuffersAndTiedLmHead) {
  const ModelConfig config = TinyConfig(TinyModelKind::kQwen3);  // tied embeddings
  ModelWeights weights = *RandomWeights(config, 1);
  const std::vector<float> extra(97 * 64, 0.5f);
  {
    TestTempDir dir("weights");
    ASSERT_TRUE(WriteCheckpoint(dir.path(), config, weights, DType::kF32, [&](TensorList& t) {
                  t.push_back({"lm_head.weight", TensorView{extra.data(), DType::kF32, {97, 64}}});
                  t.push_back({"model.layers.0.self_attn.rotary_emb.inv_freq",
                               TensorView{extra.data(), DType::kF32, {8}}});
                }).ok());
    Result<ModelWeights> loaded =
        LoadWeights(config, *SafetensorsCheckpoint::OpenDirectory(dir.path()), "tiny");
    ASSERT_TRUE(loaded.ok()) << loaded.status().ToString();
    EXPECT_TRUE(loaded->lm_head.empty());  // tied: the embedding is the output projection
    EXPECT_EQ(&loaded->output_projection(), &loaded->embed_tokens);
  }
  {
    TestTempDir dir("weights");
    ASSERT_TRUE(WriteCheckpoint(dir.path(), config, weights, DType::kF32, [&](TensorList& t) {
                  t.push_back({"model.layers.0.self_attn.q_proj.bias",
                               TensorView{extra.data(), DType::kF32, {64}}});
                }).ok());
    Result<ModelWeights> loaded =
        LoadWeights(config, *SafetensorsCheckpoint::OpenDirectory(dir.path()), "tiny");
    ASSERT_FALSE(loaded.ok());
    EXPECT_EQ(loaded.status().code(), StatusCode::kInvalidArgument);
    EXPECT_NE(loaded.status().message().find(
                  "1 tensor(s) that Qwen3ForCausalLM with this config.json does not use: "
                  "'model.layers.0.self_attn.q_proj.bias'"),
              std::string::npos)
        << loaded.status().message();
  }
}

TEST(CheckWeightSizes, ReportsTheFirstWrongTensor) {
  const ModelConfig config = TinyConfig(TinyModelKind::kLlama);
  ModelWeights weights = *RandomWeights(config, 1);
  weights.layers[1].o_bias.pop_back();
  const Status status = CheckWeightSizes(config, weights);
  EXPECT_EQ(status.code(), StatusCode::kInvalidArgument);
  EXPECT_NE(status.message().find("'model.layers.1.self_attn.o_proj.bias' has 63 values"),
            std::string::npos)
      << status.message();
}

}  // namespace
}  // namespace rubato
