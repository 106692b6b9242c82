// The residency table: its names, the residencies it makes (each names itself and its kind), and
// its refusals, each by name: an unknown residency, split_by_head without a policy naming its
// representative heads, and a policy that does not support the residency asked for.
#include "inference_rank/residency/residency_registry.h"

#include <gtest/gtest.h>

#include <memory>
#include <string>
#include <vector>

#include "common/config.h"
#include "common/test_temp_dir.h"
#include "inference_rank/engine/engine.h"
#include "inference_rank/model/tiny_test_models.h"
#include "inference_rank/policies/policy_registry.h"

namespace rubato {
namespace {

// The policy of `yaml` (its engine.kv_residency checked by the policy registry).
std::shared_ptr<AttentionPolicy> PolicyOf(const std::string& yaml) {
  auto config = ParseConfig(yaml, "r.yaml");
  EXPECT_TRUE(config.ok()) << config.status().message();
  if (!config.ok()) return nullptr;
  auto choice = ResolvePolicy(*config);
  EXPECT_TRUE(choice.ok()) << choice.status().message();
  return choice.ok() ? choice->policy : nullptr;
}

class ResidencyRegistryTest : public ::testing::Test {
 protected:
  void SetUp() override {
    auto model = LoadTinyModel(TinyModelKind::kQwen3, dir_.path(), /*seed=*/3);
    ASSERT_TRUE(model.ok()) << model.status().ToString();
    model_ = std::move(model).value();
  }

  ResidencySetup Setup(const AttentionPolicy* policy) const {
    ResidencySetup setup;
    setup.policy = policy;
    setup.model = &model_->config();
    return setup;
  }

  TestTempDir dir_{"residency_registry"};
  std::unique_ptr<Model> model_;
};

TEST_F(ResidencyRegistryTest, TheTableNamesEveryResidencyAndWhichAreBuilt) {
  EXPECT_EQ(KnownResidencyNames(), (std::vector<std::string>{"local", "evicting", "offloaded",
                                                             "split_by_head", "placed"}));
  EXPECT_EQ(BuiltResidencyNames(), (std::vector<std::string>{"local", "evicting", "offloaded",
                                                             "split_by_head", "placed"}));
  for (const char* name : {"local", "evicting", "offloaded", "split_by_head"}) {
    auto kind = LookUpResidency(name);
    ASSERT_TRUE(kind.ok()) << name << ": " << kind.status().message();
    EXPECT_EQ(KvResidencyName(*kind), name);
  }
  // Placement is offloaded KV with this rank's paged cache as one more tier.
  EXPECT_EQ(*LookUpResidency("placed"), KvResidency::kOffloaded);
}

TEST_F(ResidencyRegistryTest, MadeResidenciesNameThemselvesAndTheirKind) {
  const auto dense = PolicyOf("policy: {name: dense}\n");
  const auto longflow = PolicyOf("engine: {kv_residency: evicting}\npolicy: {name: longflow}\n");
  ASSERT_NE(dense, nullptr);
  ASSERT_NE(longflow, nullptr);
  const struct {
    const char* name;
    const AttentionPolicy* policy;
    KvResidency kind;
  } cases[] = {{"local", dense.get(), KvResidency::kLocal},
               {"local", nullptr, KvResidency::kLocal},
               {"evicting", longflow.get(), KvResidency::kEvicting},
               {"offloaded", dense.get(), KvResidency::kOffloaded},
               {"offloaded", nullptr, KvResidency::kOffloaded},
               {"placed", dense.get(), KvResidency::kOffloaded}};
  for (const auto& c : cases) {
    auto residency = CreateResidency(c.name, Setup(c.policy));
    ASSERT_TRUE(residency.ok()) << c.name << ": " << residency.status().message();
    EXPECT_EQ((*residency)->name(), c.name);
    EXPECT_EQ((*residency)->kind(), c.kind);
    EXPECT_TRUE((*residency)->Broken().ok()) << c.name;
  }
}

TEST_F(ResidencyRegistryTest, AnUnknownResidencyIsRefusedByName) {
  auto unknown = CreateResidency("remote", Setup(nullptr));
  ASSERT_FALSE(unknown.ok());
  EXPECT_EQ(unknown.status().code(), StatusCode::kInvalidArgument);
  EXPECT_EQ(unknown.status().message(),
            "engine.kv_residency: unknown residency 'remote' (known: local, evicting, offloaded, "
            "split_by_head, placed)");
  EXPECT_EQ(LookUpResidency("").status().code(), StatusCode::kInvalidArgument);
}

TEST_F(ResidencyRegistryTest, SplitByHeadNeedsAPolicyThatNamesRepresentativeHeads) {
  const Status none = CreateResidency("split_by_head", Setup(nullptr)).status();
  EXPECT_EQ(none.code(), StatusCode::kInvalidArgument);
  EXPECT_EQ(none.message(),
            "engine.kv_residency: split_by_head needs a policy that names representative heads "
            "(synckv); policy 'dense' names none");
  const auto dense = PolicyOf("policy: {name: dense}\n");
  ASSERT_NE(dense, nullptr);
  EXPECT_EQ(CreateResidency("split_by_head", Setup(dense.get())).status().message(),
            "policy 'dense' does not support split_by_head KV (supported: local, offloaded)");
}

TEST_F(ResidencyRegistryTest, APolicyThatDoesNotSupportTheResidencyIsRefusedByName) {
  const auto sfi = PolicyOf("policy: {name: sfi}\n");
  const auto dense = PolicyOf("policy: {name: dense}\n");
  const auto longflow = PolicyOf("engine: {kv_residency: evicting}\npolicy: {name: longflow}\n");
  ASSERT_NE(sfi, nullptr);
  const struct {
    const char* name;
    const AttentionPolicy* policy;
    const char* message;
  } cases[] = {
      {"offloaded", sfi.get(), "policy 'sfi' does not support offloaded KV (supported: local)"},
      {"evicting", dense.get(),
       "policy 'dense' does not support evicting KV (supported: local, offloaded)"},
      {"local", longflow.get(),
       "policy 'longflow' does not support local KV (supported: evicting)"},
  };
  for (const auto& c : cases) {
    auto refused = CreateResidency(c.name, Setup(c.policy));
    ASSERT_FALSE(refused.ok()) << c.name;
    EXPECT_EQ(refused.status().code(), StatusCode::kUnsupported);
    EXPECT_EQ(refused.status().message(), c.message);
  }
  // Evicting KV without a policy: the residency's own refusal, by name.
  auto no_policy = CreateResidency("evicting", Setup(nullptr));
  ASSERT_FALSE(no_policy.ok());
  EXPECT_EQ(no_policy.status().message(),
            "evicting KV needs a policy that supports it (none given: dense attention)");
}

// The engine refuses a residency the policy does not support, by both names, before it
// allocates anything; and installs the offloaded residency's model half in the model.
TEST_F(ResidencyRegistryTest, TheEngineChecksAndAttachesTheResidency) {
  const auto sfi = PolicyOf("policy: {name: sfi}\n");
  auto offloaded = CreateResidency("offloaded", Setup(nullptr));
  ASSERT_TRUE(offloaded.ok()) << offloaded.status().message();
  EngineOptions options;
  options.max_batch = 2;
  options.policy = sfi;
  options.residency = *offloaded;
  auto refused = Engine::Create(std::move(model_), options);
  ASSERT_FALSE(refused.ok());
  EXPECT_EQ(refused.status().message(),
            "engine: policy 'sfi' does not support offloaded KV (supported: local)");

  auto model = LoadTinyModel(TinyModelKind::kQwen3, dir_.path(), /*seed=*/3);
  ASSERT_TRUE(model.ok());
  options.policy = nullptr;
  auto engine = Engine::Create(std::move(model).value(), options);
  ASSERT_TRUE(engine.ok()) << engine.status().message();
  const Model& attached = (*engine)->model();
  ASSERT_NE(attached.residency_backend(), nullptr);
  EXPECT_EQ(attached.residency_backend()->residency_name(), "offloaded");
  EXPECT_EQ(attached.residency_backend()->backend_name(), "cpu");
}

}  // namespace
}  // namespace rubato
