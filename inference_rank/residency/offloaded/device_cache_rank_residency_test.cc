// The engine half of the offloaded residency over several GPU cache ranks, on the CPU: placement
// by free budget (lost ranks skipped), a lost rank ending only its requests by name, Broken only
// when every rank is lost. The ranks are fakes of DeviceSessionControl; the data plane (the
// CUDA half) is never reached here: tests/gpu/device_cache_rank_test.cc runs it on a GPU.
#include "inference_rank/residency/offloaded/device_cache_rank_residency.h"

#include <gtest/gtest.h>

#include <memory>
#include <string>
#include <vector>

#include "inference_rank/residency/offloaded/gpu_cache_session.h"

namespace rubato {
namespace {

class FakeCacheRank final : public DeviceSessionControl {
 public:
  explicit FakeCacheRank(uint64_t free_bytes) : free_(free_bytes) {}
  Result<uint64_t> OpenSession(uint64_t /*request_id*/, int capacity_tokens) override {
    const uint64_t bytes = static_cast<uint64_t>(capacity_tokens) * kBytesPerToken;
    if (bytes > free_) return ResourceExhaustedError("fake cache rank: budget");
    free_ -= bytes;
    return next_session_++;
  }
  Status CloseSession(uint64_t /*session_id*/) override {
    ++closed;
    return Status::Ok();
  }
  Status Health() override { return lost; }
  Result<uint64_t> FreeBytes() override { return free_; }

  static constexpr uint64_t kBytesPerToken = 1000;
  Status lost;
  int closed = 0;

 private:
  uint64_t free_;
  uint64_t next_session_ = 1;
};

struct Ranks {
  explicit Ranks(std::vector<uint64_t> budgets) {
    for (const uint64_t budget : budgets) fakes.push_back(std::make_unique<FakeCacheRank>(budget));
    std::vector<DeviceCacheRankPeer> peers;
    for (size_t r = 0; r < fakes.size(); ++r) {
      // The client is the data plane's, which the engine half never reaches.
      peers.push_back({nullptr, fakes[r].get(), "cache rank 10.0.0." + std::to_string(r)});
    }
    residency = std::make_unique<DeviceCacheRankResidency>(std::move(peers));
  }
  int CacheOf(const ResidencyRequest& request) const {
    return static_cast<const GpuCacheRequest&>(request).cache();
  }
  std::vector<std::unique_ptr<FakeCacheRank>> fakes;
  std::unique_ptr<DeviceCacheRankResidency> residency;
};

TEST(DeviceCacheRankResidencyTest, PlacesEachRequestOnTheRankWithTheMostFreeBudget) {
  Ranks ranks({8'000'000, 20'000'000, 15'000'000});
  std::vector<int> placed;
  for (uint64_t id = 0; id < 4; ++id) {
    auto request = ranks.residency->Open(id, 5999);  // 6000 tokens: 6 MB
    ASSERT_TRUE(request.ok()) << request.status().message();
    placed.push_back(ranks.CacheOf(**request));
  }
  // Free: 8 / 20 / 15 -> rank 1 (14 left) -> rank 2 (9 left) -> rank 1 (8 left) -> rank 2 (3).
  EXPECT_EQ(placed, (std::vector<int>{1, 2, 1, 2}));
}

TEST(DeviceCacheRankResidencyTest, ALostRankTakesNothingAndEndsOnlyItsRequests) {
  Ranks ranks({10'000'000, 10'000'000, 10'000'000});
  std::vector<std::unique_ptr<ResidencyRequest>> requests;
  for (uint64_t id = 0; id < 3; ++id) {
    auto request = ranks.residency->Open(id, 999);
    ASSERT_TRUE(request.ok()) << request.status().message();
    requests.push_back(std::move(request).value());
  }
  ASSERT_EQ(ranks.CacheOf(*requests[1]), 1);
  ranks.fakes[1]->lost = UnavailableError("cache rank 10.0.0.1 is lost: connection closed");
  for (size_t r = 0; r < requests.size(); ++r) {
    const Status broken = ranks.residency->RequestBroken(*requests[r]);
    if (ranks.CacheOf(*requests[r]) != 1) {
      EXPECT_TRUE(broken.ok()) << broken.message();
      continue;
    }
    EXPECT_EQ(broken.code(), StatusCode::kUnavailable);
    EXPECT_NE(broken.message().find("cache rank 1 of 3: cache rank 10.0.0.1 is lost"),
              std::string::npos)
        << broken.message();
  }
  EXPECT_TRUE(ranks.residency->Broken().ok()) << "two ranks still work";
  // New requests go to the working ranks only, although the lost one has the most room.
  for (uint64_t id = 3; id < 7; ++id) {
    auto request = ranks.residency->Open(id, 999);
    ASSERT_TRUE(request.ok()) << request.status().message();
    EXPECT_NE(ranks.CacheOf(**request), 1);
  }
  // Closing a lost rank's request still reaches its control (which forgets it).
  EXPECT_TRUE(ranks.residency->Close(*requests[1]).ok());
  EXPECT_EQ(ranks.fakes[1]->closed, 1);
}

TEST(DeviceCacheRankResidencyTest, EveryRankLostBreaksTheResidencyAndRefusesAdmission) {
  Ranks ranks({10'000'000, 10'000'000});
  ranks.fakes[0]->lost = UnavailableError("cache rank 10.0.0.0 is lost: a");
  ranks.fakes[1]->lost = UnavailableError("cache rank 10.0.0.1 is lost: b");
  const Status broken = ranks.residency->Broken();
  EXPECT_EQ(broken.code(), StatusCode::kUnavailable);
  EXPECT_NE(broken.message().find("every cache rank is lost"), std::string::npos)
      << broken.message();
  auto refused = ranks.residency->Open(9, 100);
  ASSERT_FALSE(refused.ok());
  EXPECT_NE(refused.status().message().find("no cache rank can take request 9"), std::string::npos)
      << refused.status().message();
  EXPECT_NE(refused.status().message().find("cache rank 1 of 2"), std::string::npos)
      << refused.status().message();
}

TEST(DeviceCacheRankResidencyTest, OneRankKeepsItsErrorsAsTheyWere) {
  Ranks ranks({1'000'000});
  auto too_big = ranks.residency->Open(1, 5000);
  ASSERT_FALSE(too_big.ok());
  EXPECT_NE(too_big.status().message().find("opening its session on cache rank 10.0.0.0"),
            std::string::npos)
      << too_big.status().message();
  ranks.fakes[0]->lost = UnavailableError("cache rank 10.0.0.0 is lost: gone");
  // One rank: its loss is the residency's (the engine ends every request), unprefixed.
  EXPECT_EQ(ranks.residency->Broken().message(), "cache rank 10.0.0.0 is lost: gone");
}

}  // namespace
}  // namespace rubato
