// Tests for the KV pool's sizing: vLLM's gpu_memory_utilization rule on injected memory
// snapshots (the pool never exceeds what is free, pending workspaces count, the max_batch x
// max_context cap), bad utilizations refused by name, and /proc/meminfo and cgroup parsing.
#include "inference_rank/kv/kv_pool_sizing.h"

#include <gtest/gtest.h>

#include <cmath>
#include <limits>
#include <string>

namespace rubato {
namespace {

constexpr uint64_t kGiB = uint64_t{1} << 30;
constexpr uint64_t kMiB = uint64_t{1} << 20;

KvPoolMemory Memory(uint64_t total, uint64_t free, uint64_t per_block, uint64_t pending = 0) {
  return KvPoolMemory{"test memory", total, free, per_block, pending};
}

TEST(KvPoolSizing, TakesUtilizationOfTotalLessWhatIsInUse) {
  // 100 GiB card, 80 GiB free (20 GiB of weights): 0.9 leaves 90 - 20 = 70 GiB.
  auto size = SizeKvPool(Memory(100 * kGiB, 80 * kGiB, kMiB), 0.9, INT32_MAX);
  ASSERT_TRUE(size.ok()) << size.status().message();
  EXPECT_EQ(size->num_blocks, 70 * 1024);
  EXPECT_FALSE(size->capped);
  // Workspaces still to come count as in use.
  size = SizeKvPool(Memory(100 * kGiB, 80 * kGiB, kMiB, 6 * kGiB), 0.9, INT32_MAX);
  ASSERT_TRUE(size.ok());
  EXPECT_EQ(size->num_blocks, 64 * 1024);
  // 1.0: everything free.
  size = SizeKvPool(Memory(100 * kGiB, 80 * kGiB, kMiB), 1.0, INT32_MAX);
  ASSERT_TRUE(size.ok());
  EXPECT_EQ(size->num_blocks, 80 * 1024);
}

// Whatever the snapshot, the pool fits in the free memory and the utilization's share.
TEST(KvPoolSizing, NeverLargerThanFreeMemory) {
  const uint64_t per_block = 147456;  // Qwen3-8B, 16 tokens: 36 layers x 8 heads x 128 x 2 x 2 B
  for (uint64_t total : {8 * kGiB, 80 * kGiB, 141 * kGiB}) {
    for (double free_share : {0.0, 0.01, 0.05, 0.3, 0.9, 1.0}) {
      for (double utilization : {0.05, 0.5, 0.9, 0.95, 1.0}) {
        for (uint64_t pending : {uint64_t{0}, kGiB}) {
          const uint64_t free = static_cast<uint64_t>(free_share * static_cast<double>(total));
          auto size = SizeKvPool(Memory(total, free, per_block, pending), utilization, INT32_MAX);
          if (!size.ok()) {
            EXPECT_EQ(size.status().code(), StatusCode::kResourceExhausted);
            continue;
          }
          const uint64_t bytes = static_cast<uint64_t>(size->num_blocks) * per_block;
          EXPECT_LE(bytes, free) << total << " " << free_share << " " << utilization;
          EXPECT_LE(static_cast<double>(bytes + total - free + pending),
                    utilization * static_cast<double>(total) + 1.0);
        }
      }
    }
  }
}

TEST(KvPoolSizing, CappedAtWhatMaxBatchTimesMaxContextCanUse) {
  auto size = SizeKvPool(Memory(100 * kGiB, 80 * kGiB, kMiB), 0.9, 1000);
  ASSERT_TRUE(size.ok());
  EXPECT_EQ(size->num_blocks, 1000);
  EXPECT_TRUE(size->capped);
  EXPECT_EQ(size->budget_bytes, 70 * kGiB);
}

TEST(KvPoolSizing, NoRoomForOneBlockIsAnErrorWithTheNumbers) {
  // Another process holds most of the card: 0.9 of 80 GiB is already in use.
  auto size = SizeKvPool(Memory(80 * kGiB, 4 * kGiB, kMiB), 0.9, INT32_MAX);
  ASSERT_FALSE(size.ok());
  EXPECT_EQ(size.status().code(), StatusCode::kResourceExhausted);
  const std::string message = size.status().message();
  EXPECT_NE(message.find("engine.gpu_memory_utilization 0.9 of test memory (80.00 GiB total)"),
            std::string::npos)
      << message;
  EXPECT_NE(message.find("4.00 GiB free now"), std::string::npos) << message;
  EXPECT_NE(message.find("engine.kv_pool_tokens"), std::string::npos) << message;
}

TEST(KvPoolSizing, UtilizationOutsideZeroOneIsRefusedByName) {
  for (double bad : {0.0, -0.5, 1.01, 2.0, std::nan(""), std::numeric_limits<double>::infinity()}) {
    auto size = SizeKvPool(Memory(kGiB, kGiB, kMiB), bad, 10);
    ASSERT_FALSE(size.ok()) << bad;
    EXPECT_EQ(size.status().code(), StatusCode::kInvalidArgument);
    EXPECT_NE(size.status().message().find("engine.gpu_memory_utilization must be in (0, 1]"),
              std::string::npos)
        << size.status().message();
  }
  EXPECT_TRUE(CheckMemoryUtilization(1e-6).ok());
  EXPECT_TRUE(CheckMemoryUtilization(1.0).ok());
}

TEST(KvPoolSizing, ParsesMeminfoAndTheCgroupLimit) {
  const std::string meminfo =
      "MemTotal:       24684092 kB\nMemFree:        19756172 kB\n"
      "MemAvailable:   23911656 kB\nBuffers:           23520 kB\n";
  auto host = ParseHostMemory(meminfo);
  ASSERT_TRUE(host.ok()) << host.status().message();
  EXPECT_EQ(host->total_bytes, uint64_t{24684092} * 1024);
  EXPECT_EQ(host->free_bytes, uint64_t{23911656} * 1024);
  EXPECT_EQ(host->where, "host memory");
  // No limit ("max"), then a 4 GiB limit with 1 GiB used.
  host = ParseHostMemory(meminfo, "max\n", "123\n");
  ASSERT_TRUE(host.ok());
  EXPECT_EQ(host->total_bytes, uint64_t{24684092} * 1024);
  host = ParseHostMemory(meminfo, std::to_string(4 * kGiB) + "\n", std::to_string(kGiB) + "\n");
  ASSERT_TRUE(host.ok());
  EXPECT_EQ(host->total_bytes, 4 * kGiB);
  EXPECT_EQ(host->free_bytes, 3 * kGiB);
  // Of 3 GiB in use, 2 GiB is page cache the cgroup can drop: 3 GiB free.
  host = ParseHostMemory(meminfo, std::to_string(4 * kGiB), std::to_string(3 * kGiB),
                         "anon 1073741824\ninactive_file " + std::to_string(2 * kGiB) + "\n");
  ASSERT_TRUE(host.ok());
  EXPECT_EQ(host->free_bytes, 3 * kGiB);
  // An old kernel without MemAvailable: MemFree.
  host = ParseHostMemory("MemTotal: 1000 kB\nMemFree: 600 kB\n");
  ASSERT_TRUE(host.ok());
  EXPECT_EQ(host->free_bytes, 600u * 1024);
  auto broken = ParseHostMemory("MemFree: 600 kB\n");
  ASSERT_FALSE(broken.ok());
  EXPECT_NE(broken.status().message().find("MemTotal"), std::string::npos);
}

TEST(KvPoolSizing, ReadsThisMachine) {
  auto host = ReadHostMemory();
  ASSERT_TRUE(host.ok()) << host.status().message();
  EXPECT_GT(host->total_bytes, 0u);
  EXPECT_LE(host->free_bytes, host->total_bytes);
}

}  // namespace
}  // namespace rubato
