// The Kascade calibrator end to end on the small random checkpoint: the file it writes loads,
// fits the model, keeps layer 0 and holds S; bad development sets are refused by name.
#include "inference_rank/policies/kascade/kascade_calibrator.h"

#include <gtest/gtest.h>
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
  return options;
}

TEST(KascadeCalibrator, WritesAFileThatLoadsAndFitsTheModel) {
  const std::string dev = TempPath("dev.jsonl");
  std::ofstream(dev) << "{\"prompt\": \"The value of key abc is 123. " << std::string(300, 'x')
                     << " What is the value of key abc?\"}\n\n"
                     << "{\"prompt\": \"In the beginning was the word, and the word was "
                        "with the text of a second prompt.\"}\n";
  KascadeCalibrateOptions options = Options(dev);
  options.out = TempPath("out.json");
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

}  // namespace
}  // namespace rubato
