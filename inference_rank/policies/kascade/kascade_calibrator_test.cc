// The Kascade calibrator end to end on the small random checkpoint: the file it writes loads,
// fits the model, keeps layer 0 and holds S; bad development sets are refused by name.
#include "inference_rank/policies/kascade/kascade_calibrator.h"

#include <gtest/gtest.h>
#include <sys/stat.h>
#include <unistd.h>

#include <filesystem>
#include <fstream>

namespace rubato {
namespace {

std::string TempPath(const std::string& name) {
  return (std::filesystem::temp_directory_path() /
          ("kascade_calibrator_test_" + std::to_string(::getpid()) + "_" + name))
      .string();
}

KascadeCalibrateOptions Options(const std::string& dev_set) {
  KascadeCalibrateOptions options;
  options.model_dir = "models/tiny-qwen3-random";  // 4 layers, 2 KV heads
  options.dev_set = dev_set;
  options.anchors = 2;
  options.top_k = 8;
  options.threads = 2;
  options.progress = nullptr;
  options.out = TempPath("out.json");
  return options;
}

TEST(KascadeCalibrator, WritesAFileThatLoadsAndFitsTheModel) {
  const std::string dev = TempPath("dev.jsonl");
  std::ofstream(dev) << "{\"prompt\": \"The value of key abc is 123. " << std::string(300, 'x')
                     << " What is the value of key abc?\"}\n\n"
                     << "{\"prompt\": \"In the beginning was the word, and the word was "
                        "with the text of a second prompt.\"}\n";
  KascadeCalibrateOptions options = Options(dev);
  const Result<KascadeCalibration> made = CalibrateKascade(options);
  ASSERT_TRUE(made.ok()) << made.status().ToString();
  EXPECT_EQ(made->prompts, 2);
  EXPECT_EQ(made->anchors.size(), 2u);
  EXPECT_EQ(made->anchors.front(), 0);
  const Result<KascadeCalibration> loaded = LoadCalibration(options.out);
  ASSERT_TRUE(loaded.ok()) << loaded.status().ToString();
  EXPECT_TRUE(CheckCalibrationFits(*loaded, 4, 8, 2, 32).ok());
  EXPECT_EQ(loaded->anchors, made->anchors);
  EXPECT_EQ(loaded->dev_set_fnv1a.size(), 16u);
  ASSERT_EQ(loaded->similarity.size(), 16u);
  for (int l = 0; l < 4; ++l) {
    EXPECT_GT(loaded->importance[l], 0.0) << "attention changes the residual stream";
    for (int a = 0; a < l; ++a) {
      // A reused top-k covers at most the layer's own top-k mass.
      EXPECT_LE(loaded->similarity[a * 4 + l], loaded->similarity[l * 4 + l] + 1e-12);
    }
  }
  std::filesystem::remove(dev);
  std::filesystem::remove(options.out);
}

TEST(KascadeCalibrator, RefusesBadInputByName) {
  const std::string dev = TempPath("bad.jsonl");
  std::ofstream(dev) << "{\"prompt\": \"fine\"}\n{\"text\": \"no prompt field\"}\n";
  Result<KascadeCalibration> made = CalibrateKascade(Options(dev));
  ASSERT_FALSE(made.ok());
  EXPECT_NE(made.status().message().find("bad.jsonl:2: not a JSON object with a string"),
            std::string::npos)
      << made.status().message();
  EXPECT_EQ(CalibrateKascade(Options(TempPath("missing.jsonl"))).status().code(),
            StatusCode::kNotFound);
  std::ofstream(dev) << "{\"prompt\": \"fine\"}\n";
  KascadeCalibrateOptions too_many = Options(dev);
  too_many.anchors = 5;
  made = CalibrateKascade(too_many);
  ASSERT_FALSE(made.ok());
  EXPECT_NE(made.status().message().find("--anchors 5 must lie in [1, 4]"), std::string::npos)
      << made.status().message();
  std::filesystem::remove(dev);
}

// Hostile options, refused by name before the weights load: an endless or special dev set is
// never read (a FIFO would block forever), an empty --out, a top-k past any prompt, and prompt
// lengths whose observations would not fit the machine.
TEST(KascadeCalibrator, RefusesHostileOptionsBeforeLoading) {
  const std::string dev = TempPath("ok.jsonl");
  std::ofstream(dev) << "{\"prompt\": \"fine\"}\n";
  auto refused = [](const KascadeCalibrateOptions& options, const std::string& needle) {
    const Result<KascadeCalibration> made = CalibrateKascade(options);
    ASSERT_FALSE(made.ok()) << needle;
    EXPECT_NE(made.status().message().find(needle), std::string::npos) << made.status().message();
    EXPECT_LT(made.status().message().size(), 600u);
  };
  refused(Options("/dev/zero"), "character device");
  const std::string fifo = TempPath("fifo.jsonl");
  ASSERT_EQ(mkfifo(fifo.c_str(), 0600), 0);
  refused(Options(fifo), "FIFO");
  std::filesystem::remove(fifo);
  KascadeCalibrateOptions options = Options(dev);
  options.out = "";
  refused(options, "--out: empty");
  options = Options(dev);
  options.out = "/nonexistent-dir/out.json";
  refused(options, "/nonexistent-dir");
  options = Options(dev);
  options.top_k = 1 << 20;
  refused(options, "--top-k 1048576 exceeds --max-tokens 2048");
  options.max_prompt_tokens = 1 << 24;
  refused(options, "--top-k 1048576 exceeds the model's max_position_embeddings");

  // The model's context raised to 2^24: one prompt of that length needs petabytes.
  const std::filesystem::path model = TempPath("model");
  std::filesystem::create_directories(model);
  for (const auto& entry : std::filesystem::directory_iterator("models/tiny-qwen3-random")) {
    std::filesystem::copy_file(entry.path(), model / entry.path().filename());
  }
  std::ifstream in(model / "config.json");
  std::string config((std::istreambuf_iterator<char>(in)), std::istreambuf_iterator<char>());
  const size_t at = config.find("\"max_position_embeddings\"");
  ASSERT_NE(at, std::string::npos);
  const size_t start = config.find(':', at) + 1;
  config = config.substr(0, start) + " 16777216" + config.substr(config.find_first_of(",}", start));
  std::ofstream(model / "config.json", std::ios::trunc) << config;
  options = Options(dev);
  options.model_dir = model.string();
  options.max_prompt_tokens = 1 << 24;
  refused(options, "more than half of this machine's");
  std::filesystem::remove_all(model);
  std::filesystem::remove(dev);
}

TEST(KascadeCalibrator, ObservationBytesGrowWithTokensAndClampTopK) {
  ModelConfig model;
  model.num_layers = 4;
  model.num_kv_heads = 2;
  model.hidden_size = 64;
  model.head_dim = 32;
  // probs 70*2*70*4 + sets 4*70*2*70*4 (k clamped to 70) + residual 70*64*4 + kv 2*4*70*2*32*4.
  const uint64_t expected = 39200 + 156800 + 17920 + 143360;
  EXPECT_EQ(KascadeCalibrationBytes(model, 70, 1 << 20), expected);
  EXPECT_EQ(KascadeCalibrationBytes(model, 70, 70), expected);
  EXPECT_LT(KascadeCalibrationBytes(model, 70, 8), expected);
}

}  // namespace
}  // namespace rubato
