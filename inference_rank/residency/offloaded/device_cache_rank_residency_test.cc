// The engine half of the offloaded residency over several GPU cache ranks, on the CPU: placement
// by free budget (lost ranks skipped), a lost rank ending only its requests by name, Broken only
// when every rank is lost, and a lost rank's reconnection: once its requests have ended, a new
// connection to its endpoint (a fake connector) takes new requests; while the endpoint stays
// down the attempts back off; destruction gives up an attempt in progress. The ranks are fakes
// of DeviceSessionControl; the data plane (the CUDA half) is never reached here:
// tests/gpu/device_cache_rank_test.cc runs it on a GPU.
#include "inference_rank/residency/offloaded/device_cache_rank_residency.h"

#include <gtest/gtest.h>

#include <atomic>
#include <chrono>
#include <condition_variable>
#include <functional>
#include <memory>
#include <mutex>
#include <string>
#include <thread>
#include <vector>

#include "inference_rank/residency/offloaded/gpu_cache_session.h"

namespace rubato {
namespace {

using Clock = std::chrono::steady_clock;
using std::chrono::milliseconds;

// Generous: a busy 2-core machine may run the watcher late, never this late.
constexpr auto kPatience = std::chrono::seconds(60);

// Sessions of `free_bytes` of budget; Health from any thread (the residency's watcher).
class FakeCacheRank final : public DeviceSessionControl {
 public:
  explicit FakeCacheRank(uint64_t free_bytes) : free_(free_bytes) {}
  Result<uint64_t> OpenSession(uint64_t /*request_id*/, int capacity_tokens) override {
    std::lock_guard lock(mutex_);
    const uint64_t bytes = static_cast<uint64_t>(capacity_tokens) * kBytesPerToken;
    if (bytes > free_) return ResourceExhaustedError("fake cache rank: budget");
    free_ -= bytes;
    ++opened_;
    return next_session_++;
  }
  Status CloseSession(uint64_t /*session_id*/) override {
    std::lock_guard lock(mutex_);
    ++closed_;
    return Status::Ok();
  }
  Status Health() override {
    std::lock_guard lock(mutex_);
    return lost_;
  }
  Result<uint64_t> FreeBytes() override {
    std::lock_guard lock(mutex_);
    return free_;
  }

  void Lose(Status why) {
    std::lock_guard lock(mutex_);
    lost_ = std::move(why);
  }
  int opened() {
    std::lock_guard lock(mutex_);
    return opened_;
  }
  int closed() {
    std::lock_guard lock(mutex_);
    return closed_;
  }

  static constexpr uint64_t kBytesPerToken = 1000;

 private:
  std::mutex mutex_;
  uint64_t free_;
  uint64_t next_session_ = 1;
  Status lost_;
  int opened_ = 0;
  int closed_ = 0;
};

// A cache rank's endpoint, down until Restart: each connection made while it is up is a fresh
// rank (an empty store of the restart's budget). Records every attempt's time; with
// HoldAttempts, an attempt waits until the residency abandons it (or kPatience).
class FakeEndpoint {
 public:
  DeviceCacheRankConnector Connector() {
    return [this](const std::atomic<bool>* abandon) -> Result<DeviceCacheRankConnection> {
      std::unique_lock lock(mutex_);
      attempts_.push_back(Clock::now());
      changed_.notify_all();
      if (hold_) {  // a stalled cache rank: only abandoning ends the attempt
        const Clock::time_point end = Clock::now() + kPatience;
        while (!abandon->load() && Clock::now() < end) changed_.wait_for(lock, milliseconds(1));
        abandoned_ = abandon->load();
        return UnavailableError("fake endpoint: no answer");
      }
      if (budget_ == 0) return UnavailableError("fake endpoint: connection refused");
      auto rank = std::make_unique<FakeCacheRank>(budget_);
      made_.push_back(rank.get());
      return DeviceCacheRankConnection{std::move(rank), nullptr};
    };
  }
  void Restart(uint64_t budget) {
    std::lock_guard lock(mutex_);
    budget_ = budget;
  }
  void HoldAttempts() {
    std::lock_guard lock(mutex_);
    hold_ = true;
  }
  // Waits (at most kPatience) until `count` attempts were made; their times.
  std::vector<Clock::time_point> WaitForAttempts(size_t count) {
    std::unique_lock lock(mutex_);
    changed_.wait_for(lock, kPatience, [&] { return attempts_.size() >= count; });
    return attempts_;
  }
  size_t attempts() {
    std::lock_guard lock(mutex_);
    return attempts_.size();
  }
  // The connections made; each lives while the residency holds it.
  std::vector<FakeCacheRank*> made() {
    std::lock_guard lock(mutex_);
    return made_;
  }
  bool abandoned() {
    std::lock_guard lock(mutex_);
    return abandoned_;
  }

 private:
  std::mutex mutex_;
  std::condition_variable changed_;
  uint64_t budget_ = 0;  // 0: down
  bool hold_ = false;
  bool abandoned_ = false;
  std::vector<Clock::time_point> attempts_;
  std::vector<FakeCacheRank*> made_;
};

struct Ranks {
  // `restartable`: [rank] reconnected through endpoints[rank] when lost.
  explicit Ranks(std::vector<uint64_t> budgets, std::vector<bool> restartable = {},
                 ReconnectBackoff backoff = {})
      : endpoints(budgets.size()) {
    for (const uint64_t budget : budgets) fakes.push_back(std::make_unique<FakeCacheRank>(budget));
    std::vector<DeviceCacheRankPeer> peers;
    for (size_t r = 0; r < fakes.size(); ++r) {
      // The client is the data plane's, which the engine half never reaches.
      DeviceCacheRankPeer& peer = peers.emplace_back();
      peer.control = fakes[r].get();
      peer.name = "cache rank 10.0.0." + std::to_string(r);
      if (r < restartable.size() && restartable[r]) peer.reconnect = endpoints[r].Connector();
    }
    residency = std::make_unique<DeviceCacheRankResidency>(std::move(peers), backoff);
  }
  int CacheOf(const ResidencyRequest& request) const {
    return static_cast<const GpuCacheRequest&>(request).cache();
  }
  std::unique_ptr<ResidencyRequest> Open(uint64_t id, int tokens = 999) {
    auto request = residency->Open(id, tokens);
    EXPECT_TRUE(request.ok()) << request.status().message();
    return request.ok() ? std::move(request).value() : nullptr;
  }
  // Declared before the residency, which holds their connectors and the fakes' pointers.
  std::vector<FakeEndpoint> endpoints;
  std::vector<std::unique_ptr<FakeCacheRank>> fakes;
  std::unique_ptr<DeviceCacheRankResidency> residency;
};

// Waits (at most kPatience) until `done` holds, looking every millisecond.
bool WaitFor(const std::function<bool()>& done) {
  const Clock::time_point end = Clock::now() + kPatience;
  while (!done()) {
    if (Clock::now() > end) return false;
    std::this_thread::sleep_for(milliseconds(1));
  }
  return true;
}

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
  ranks.fakes[1]->Lose(UnavailableError("cache rank 10.0.0.1 is lost: connection closed"));
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
  EXPECT_EQ(ranks.fakes[1]->closed(), 1);
}

TEST(DeviceCacheRankResidencyTest, EveryRankLostBreaksTheResidencyAndRefusesAdmission) {
  Ranks ranks({10'000'000, 10'000'000});
  ranks.fakes[0]->Lose(UnavailableError("cache rank 10.0.0.0 is lost: a"));
  ranks.fakes[1]->Lose(UnavailableError("cache rank 10.0.0.1 is lost: b"));
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
  ranks.fakes[0]->Lose(UnavailableError("cache rank 10.0.0.0 is lost: gone"));
  // One rank: its loss is the residency's (the engine ends every request), unprefixed.
  EXPECT_EQ(ranks.residency->Broken().message(), "cache rank 10.0.0.0 is lost: gone");
}

// Rank 1 of 3 dies mid-run and its endpoint answers again at once (a restart): nothing connects
// while its request is open; once the engine has ended it, the rank is reconnected and a new
// request goes there (the most free budget) on the new connection. The other ranks' requests
// are never disturbed.
TEST(DeviceCacheRankResidencyTest, ARestartedRankIsReconnectedAndTakesNewRequests) {
  Ranks ranks({10'000'000, 10'000'000, 10'000'000}, {false, true, false},
              {milliseconds(5), milliseconds(20)});
  std::vector<std::unique_ptr<ResidencyRequest>> requests;
  for (uint64_t id = 0; id < 3; ++id) requests.push_back(ranks.Open(id));
  ASSERT_EQ(ranks.CacheOf(*requests[1]), 1);
  ranks.fakes[1]->Lose(UnavailableError("cache rank 10.0.0.1 is lost: connection closed"));
  ranks.endpoints[1].Restart(50'000'000);
  const Status broken = ranks.residency->RequestBroken(*requests[1]);
  EXPECT_NE(broken.message().find("cache rank 1 of 3: cache rank 10.0.0.1 is lost"),
            std::string::npos)
      << broken.message();
  EXPECT_TRUE(ranks.residency->RequestBroken(*requests[0]).ok());
  EXPECT_TRUE(ranks.residency->RequestBroken(*requests[2]).ok());

  // Time for the watcher (it looks every 5 ms) to err, not time the test needs.
  std::this_thread::sleep_for(milliseconds(100));
  EXPECT_EQ(ranks.endpoints[1].attempts(), 0u) << "its request is still open";
  auto meanwhile = ranks.Open(3);
  ASSERT_NE(meanwhile, nullptr);
  EXPECT_NE(ranks.CacheOf(*meanwhile), 1);

  // The engine ends the lost rank's request.
  EXPECT_TRUE(ranks.residency->Close(*requests[1]).ok());
  ASSERT_TRUE(WaitFor([&] { return ranks.residency->reconnects() == 1; }));
  EXPECT_TRUE(ranks.residency->Broken().ok());
  auto fresh = ranks.Open(4);
  ASSERT_NE(fresh, nullptr);
  EXPECT_EQ(ranks.CacheOf(*fresh), 1);
  const std::vector<FakeCacheRank*> made = ranks.endpoints[1].made();
  ASSERT_EQ(made.size(), 1u);
  EXPECT_TRUE(ranks.residency->RequestBroken(*fresh).ok());
  EXPECT_TRUE(ranks.residency->Close(*fresh).ok());
  EXPECT_EQ(made[0]->opened(), 1);
  EXPECT_EQ(made[0]->closed(), 1);
  EXPECT_EQ(ranks.fakes[1]->opened(), 1) << "the lost connection took nothing more";
  EXPECT_EQ(ranks.fakes[1]->closed(), 1);
  EXPECT_EQ(ranks.endpoints[1].attempts(), 1u);

  for (const size_t r : {0, 2}) {
    EXPECT_TRUE(ranks.residency->RequestBroken(*requests[r]).ok());
    EXPECT_TRUE(ranks.residency->Close(*requests[r]).ok());
  }
  EXPECT_TRUE(ranks.residency->Close(*meanwhile).ok());
}

// While the lost rank's endpoint stays down, the attempts come at once, then after waits that
// double up to the maximum (lower bounds: a slow machine only waits longer); the other ranks
// serve on, and new requests never go to the lost one. Once the endpoint answers, the next
// attempt reconnects it.
TEST(DeviceCacheRankResidencyTest, WhileTheEndpointStaysDownAttemptsBackOff) {
  const ReconnectBackoff backoff{milliseconds(20), milliseconds(80)};
  Ranks ranks({10'000'000, 10'000'000, 10'000'000}, {false, true, false}, backoff);
  std::vector<std::unique_ptr<ResidencyRequest>> requests;
  for (uint64_t id = 0; id < 3; ++id) requests.push_back(ranks.Open(id));
  ranks.fakes[1]->Lose(UnavailableError("cache rank 10.0.0.1 is lost: connection closed"));
  EXPECT_TRUE(ranks.residency->Close(*requests[1]).ok());

  const std::vector<Clock::time_point> attempts = ranks.endpoints[1].WaitForAttempts(5);
  ASSERT_GE(attempts.size(), 5u);
  for (size_t i = 1; i < 5; ++i) {
    // Attempt i follows i failures: 20, 40, 80, 80 ms.
    EXPECT_GE(attempts[i] - attempts[i - 1], ReconnectDelay(backoff, static_cast<int>(i)))
        << "attempt " << i;
  }
  EXPECT_EQ(ranks.residency->reconnects(), 0);
  EXPECT_TRUE(ranks.residency->Broken().ok());
  EXPECT_TRUE(ranks.residency->RequestBroken(*requests[0]).ok());
  EXPECT_TRUE(ranks.residency->RequestBroken(*requests[2]).ok());
  for (uint64_t id = 3; id < 7; ++id) {
    auto request = ranks.Open(id);
    ASSERT_NE(request, nullptr);
    EXPECT_NE(ranks.CacheOf(*request), 1);
    EXPECT_TRUE(ranks.residency->Close(*request).ok());
  }

  ranks.endpoints[1].Restart(50'000'000);
  ASSERT_TRUE(WaitFor([&] { return ranks.residency->reconnects() == 1; }));
  auto fresh = ranks.Open(7);
  ASSERT_NE(fresh, nullptr);
  EXPECT_EQ(ranks.CacheOf(*fresh), 1);
  EXPECT_TRUE(ranks.residency->Close(*fresh).ok());
}

// A cache rank that never answers (accepts, then stalls): destroying the residency gives the
// attempt up at once instead of waiting it out (the fake would hold it 60 s).
TEST(DeviceCacheRankResidencyTest, DestructionGivesUpAnAttemptInProgress) {
  Ranks ranks({10'000'000, 10'000'000}, {false, true}, {milliseconds(5), milliseconds(20)});
  ranks.endpoints[1].HoldAttempts();
  ranks.fakes[1]->Lose(UnavailableError("cache rank 10.0.0.1 is lost: connection closed"));
  ASSERT_GE(ranks.endpoints[1].WaitForAttempts(1).size(), 1u);
  const Clock::time_point start = Clock::now();
  ranks.residency.reset();
  EXPECT_LT(Clock::now() - start, std::chrono::seconds(30));
  EXPECT_TRUE(ranks.endpoints[1].abandoned());
}

// With one cache rank its loss is the residency's (every request ends, admission refused,
// unprefixed); once they have ended it is reconnected and serves again.
TEST(DeviceCacheRankResidencyTest, OneRankIsReconnectedToo) {
  Ranks ranks({10'000'000}, {true}, {milliseconds(5), milliseconds(20)});
  auto request = ranks.Open(1);
  ranks.fakes[0]->Lose(UnavailableError("cache rank 10.0.0.0 is lost: gone"));
  EXPECT_EQ(ranks.residency->Broken().message(), "cache rank 10.0.0.0 is lost: gone");
  auto refused = ranks.residency->Open(2, 100);
  ASSERT_FALSE(refused.ok());
  EXPECT_EQ(refused.status().message(),
            "opening its session on cache rank 10.0.0.0: cache rank 10.0.0.0 is lost: gone");
  ranks.endpoints[0].Restart(10'000'000);
  EXPECT_TRUE(ranks.residency->Close(*request).ok());
  ASSERT_TRUE(WaitFor([&] { return ranks.residency->reconnects() == 1; }));
  EXPECT_TRUE(ranks.residency->Broken().ok());
  auto fresh = ranks.Open(3);
  ASSERT_NE(fresh, nullptr);
  ASSERT_EQ(ranks.endpoints[0].made().size(), 1u);
  EXPECT_EQ(ranks.endpoints[0].made()[0]->opened(), 1);
  EXPECT_TRUE(ranks.residency->Close(*fresh).ok());
}

}  // namespace
}  // namespace rubato
