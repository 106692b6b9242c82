// NcclTransport between two GPUs of one host, one rank a thread (needs 2 GPUs: the
// nvidia-h200-x2 machine; NCCL refuses two ranks on one GPU). Round trips checked byte for
// byte, grouped send + receive, the ready event ordering a send after its producer, refused ops,
// and a receive nobody sends to: Wait times out, Cancel aborts the communicator, later calls
// say so. The host-staging wrapper (nccl_host_staging.h): host buffers of many sizes both ways,
// staging buffers reused, a mix of host and device ops in one group, the pair helper's refusals.
#include <cuda_runtime_api.h>
#include <gtest/gtest.h>

#include <barrier>
#include <cstdint>
#include <functional>
#include <memory>
#include <string>
#include <thread>
#include <vector>

#include "transport/nccl_host_staging.h"
#include "transport/nccl_transport.h"

namespace rubato::transport {
namespace {

using std::chrono::milliseconds;

constexpr milliseconds kTimeout{20000};

class NcclTransportTest : public ::testing::Test {
 protected:
  void SetUp() override {
    int devices = 0;
    ASSERT_EQ(cudaGetDeviceCount(&devices), cudaSuccess);
    if (devices < 2) GTEST_SKIP() << "needs two GPUs (nvidia-h200-x2), found " << devices;
    auto id = NcclTransport::NewUniqueId();
    ASSERT_TRUE(id.ok()) << id.status().message();
    std::thread threads[2];
    Status statuses[2];
    for (int r = 0; r < 2; ++r) {
      threads[r] = std::thread([&, r] {
        auto created = NcclTransport::Create({.unique_id = *id, .rank = r, .world_size = 2,
                                              .device = r});
        if (created.ok()) {
          ranks_[r] = std::move(created).value();
        } else {
          statuses[r] = created.status();
        }
      });
    }
    for (std::thread& thread : threads) thread.join();
    for (const Status& status : statuses) ASSERT_TRUE(status.ok()) << status.message();
  }

  // Runs body(rank) on two threads, each with its device selected.
  void OnBothRanks(const std::function<void(int)>& body) {
    std::thread threads[2];
    for (int r = 0; r < 2; ++r) {
      threads[r] = std::thread([&, r] {
        ASSERT_EQ(cudaSetDevice(r), cudaSuccess);
        body(r);
      });
    }
    for (std::thread& thread : threads) thread.join();
  }

  std::unique_ptr<NcclTransport> ranks_[2];
};

std::vector<uint8_t> Pattern(size_t bytes, uint8_t seed) {
  std::vector<uint8_t> data(bytes);
  for (size_t i = 0; i < bytes; ++i) data[i] = static_cast<uint8_t>(i * 131 + seed * 7 + i / 251);
  return data;
}

void* DeviceCopy(const std::vector<uint8_t>& host) {
  void* device = nullptr;
  EXPECT_EQ(cudaMalloc(&device, host.empty() ? 1 : host.size()), cudaSuccess);
  EXPECT_EQ(cudaMemcpy(device, host.data(), host.size(), cudaMemcpyHostToDevice), cudaSuccess);
  return device;
}

std::vector<uint8_t> HostCopy(const void* device, size_t bytes) {
  std::vector<uint8_t> host(bytes);
  EXPECT_EQ(cudaMemcpy(host.data(), device, bytes, cudaMemcpyDeviceToHost), cudaSuccess);
  return host;
}

TEST_F(NcclTransportTest, ExchangesMessagesOfManySizesBothWays) {
  for (const size_t bytes : {size_t{0}, size_t{1}, size_t{4093}, size_t{1} << 20,
                             (size_t{33} << 20) + 5}) {
    OnBothRanks([&](int r) {
      const std::vector<uint8_t> mine = Pattern(bytes, static_cast<uint8_t>(r + 1));
      void* send = DeviceCopy(mine);
      void* receive = nullptr;
      ASSERT_EQ(cudaMalloc(&receive, bytes == 0 ? 1 : bytes), cudaSuccess);
      const TransferOp ops[] = {TransferOp::Send(1 - r, 5, send, bytes, MemoryKind::kCuda),
                                TransferOp::Recv(1 - r, 5, receive, bytes, MemoryKind::kCuda)};
      auto id = ranks_[r]->Post(ops);
      ASSERT_TRUE(id.ok()) << id.status().message();
      ASSERT_TRUE(ranks_[r]->Wait(*id, kTimeout).ok());
      EXPECT_EQ(HostCopy(receive, bytes), Pattern(bytes, static_cast<uint8_t>(2 - r)))
          << bytes << " bytes, rank " << r;
      cudaFree(send);
      cudaFree(receive);
    });
  }
  EXPECT_GT(ranks_[0]->Stats().bytes_sent, size_t{33} << 20);
  EXPECT_EQ(ranks_[0]->Stats().bytes_sent, ranks_[1]->Stats().bytes_received);
}

TEST_F(NcclTransportTest, ReadyEventOrdersTheSendAfterItsProducer) {
  constexpr size_t kBytes = 64 << 20;
  std::barrier posted(2);
  OnBothRanks([&](int r) {
    void* buffer = nullptr;
    ASSERT_EQ(cudaMalloc(&buffer, kBytes), cudaSuccess);
    ASSERT_EQ(cudaMemset(buffer, 0, kBytes), cudaSuccess);
    ASSERT_EQ(cudaDeviceSynchronize(), cudaSuccess);
    if (r == 0) {
      // The producer fills the buffer on its own stream; the send must see the 0x5a bytes.
      cudaStream_t producer = nullptr;
      cudaEvent_t filled = nullptr;
      ASSERT_EQ(cudaStreamCreateWithFlags(&producer, cudaStreamNonBlocking), cudaSuccess);
      ASSERT_EQ(cudaEventCreateWithFlags(&filled, cudaEventDisableTiming), cudaSuccess);
      ASSERT_EQ(cudaMemsetAsync(buffer, 0x5a, kBytes, producer), cudaSuccess);
      ASSERT_EQ(cudaEventRecord(filled, producer), cudaSuccess);
      const TransferOp send =
          TransferOp::Send(1, 9, buffer, kBytes, MemoryKind::kCuda, filled);
      auto id = ranks_[0]->Post({&send, 1});
      posted.arrive_and_wait();
      ASSERT_TRUE(id.ok()) << id.status().message();
      ASSERT_TRUE(ranks_[0]->Wait(*id, kTimeout).ok());
      cudaEventDestroy(filled);
      cudaStreamDestroy(producer);
    } else {
      posted.arrive_and_wait();
      const TransferOp receive = TransferOp::Recv(0, 9, buffer, kBytes, MemoryKind::kCuda);
      auto id = ranks_[1]->Post({&receive, 1});
      ASSERT_TRUE(id.ok());
      ASSERT_TRUE(ranks_[1]->Wait(*id, kTimeout).ok());
      const std::vector<uint8_t> got = HostCopy(buffer, kBytes);
      EXPECT_EQ(got.front(), 0x5a);
      EXPECT_EQ(got.back(), 0x5a);
      EXPECT_EQ(std::vector<uint8_t>(got.begin(), got.begin() + 4096),
                std::vector<uint8_t>(4096, 0x5a));
    }
    cudaFree(buffer);
  });
}

TEST_F(NcclTransportTest, RefusesHostMemoryBadPeersAndTags) {
  uint8_t host[16] = {};
  const TransferOp host_send = TransferOp::Send(1, 1, host, sizeof(host));
  auto refused = ranks_[0]->Post({&host_send, 1});
  ASSERT_FALSE(refused.ok());
  EXPECT_NE(refused.status().message().find("host"), std::string::npos)
      << refused.status().message();
  void* device = nullptr;
  ASSERT_EQ(cudaSetDevice(0), cudaSuccess);
  ASSERT_EQ(cudaMalloc(&device, 16), cudaSuccess);
  const TransferOp to_self = TransferOp::Send(0, 1, device, 16, MemoryKind::kCuda);
  EXPECT_FALSE(ranks_[0]->Post({&to_self, 1}).ok());
  const TransferOp big_tag = TransferOp::Send(1, kMaxTag + 1, device, 16, MemoryKind::kCuda);
  EXPECT_FALSE(ranks_[0]->Post({&big_tag, 1}).ok());
  EXPECT_FALSE(ranks_[0]->Test(12345).ok());
  cudaFree(device);
}

TEST_F(NcclTransportTest, AReceiveNobodySendsTimesOutAndCancelAbortsTheTransport) {
  ASSERT_EQ(cudaSetDevice(1), cudaSuccess);
  void* device = nullptr;
  ASSERT_EQ(cudaMalloc(&device, 1024), cudaSuccess);
  const TransferOp receive = TransferOp::Recv(0, 77, device, 1024, MemoryKind::kCuda);
  auto id = ranks_[1]->Post({&receive, 1});
  ASSERT_TRUE(id.ok()) << id.status().message();
  const Status waited = ranks_[1]->Wait(*id, milliseconds(200));
  EXPECT_EQ(waited.code(), StatusCode::kDeadlineExceeded) << waited.message();
  ranks_[1]->Cancel(*id);
  auto after = ranks_[1]->Post({&receive, 1});
  ASSERT_FALSE(after.ok());
  EXPECT_EQ(after.status().code(), StatusCode::kUnavailable);
  EXPECT_NE(after.status().message().find("aborted"), std::string::npos)
      << after.status().message();
  ranks_[1].reset();  // the destructor returns although rank 0 never joined the transfer
  cudaFree(device);
}

class NcclHostStagingTest : public ::testing::Test {
 protected:
  void SetUp() override {
    int devices = 0;
    ASSERT_EQ(cudaGetDeviceCount(&devices), cudaSuccess);
    if (devices < 2) GTEST_SKIP() << "needs two GPUs (nvidia-h200-x2), found " << devices;
    auto pair = CreateNcclHostStagingPair({0, 1});
    ASSERT_TRUE(pair.ok()) << pair.status().message();
    for (int r = 0; r < 2; ++r) {
      ranks_[r] = static_cast<NcclHostStagingTransport*>((*pair)[r].get());
      owned_[r] = std::move((*pair)[r]);
    }
  }

  // Each rank sends `bytes` of its pattern to the other from host memory and receives the
  // other's; both compared byte for byte.
  void ExchangeHost(size_t bytes, uint64_t tag) {
    std::thread threads[2];
    for (int r = 0; r < 2; ++r) {
      threads[r] = std::thread([&, r] {
        const std::vector<uint8_t> mine = Pattern(bytes, static_cast<uint8_t>(r + 3));
        std::vector<uint8_t> theirs(bytes, 0xee);
        const TransferOp ops[] = {TransferOp::Send(1 - r, tag, mine.data(), bytes),
                                  TransferOp::Recv(1 - r, tag, theirs.data(), bytes)};
        auto id = ranks_[r]->Post(ops);
        ASSERT_TRUE(id.ok()) << id.status().message();
        const Status waited = ranks_[r]->Wait(*id, kTimeout);
        ASSERT_TRUE(waited.ok()) << waited.message();
        EXPECT_EQ(theirs, Pattern(bytes, static_cast<uint8_t>(4 - r)))
            << bytes << " bytes, rank " << r;
      });
    }
    for (std::thread& thread : threads) thread.join();
  }

  std::unique_ptr<Transport> owned_[2];
  NcclHostStagingTransport* ranks_[2] = {nullptr, nullptr};
};

TEST_F(NcclHostStagingTest, HostBuffersOfManySizesCrossBothWaysAndStagingIsReused) {
  const size_t sizes[] = {0, 1, 64, 4093, size_t{1} << 20, (size_t{17} << 20) + 3};
  for (const size_t bytes : sizes) ExchangeHost(bytes, 11);
  const uint64_t staged = ranks_[0]->StagingBytes();
  EXPECT_GT(staged, 0u);
  for (const size_t bytes : sizes) ExchangeHost(bytes, 12);
  EXPECT_EQ(ranks_[0]->StagingBytes(), staged) << "the second round reused the pool";
  EXPECT_EQ(ranks_[0]->Stats().bytes_sent, ranks_[1]->Stats().bytes_received);
}

TEST_F(NcclHostStagingTest, HostAndDeviceOpsMixInOneGroup) {
  constexpr size_t kBytes = 3000;
  std::thread threads[2];
  for (int r = 0; r < 2; ++r) {
    threads[r] = std::thread([&, r] {
      ASSERT_EQ(cudaSetDevice(r), cudaSuccess);
      if (r == 0) {  // a host send and a device send
        const std::vector<uint8_t> host = Pattern(kBytes, 7), device_bytes = Pattern(kBytes, 8);
        void* device = DeviceCopy(device_bytes);
        const TransferOp ops[] = {TransferOp::Send(1, 1, host.data(), kBytes),
                                  TransferOp::Send(1, 2, device, kBytes, MemoryKind::kCuda)};
        auto id = ranks_[0]->Post(ops);
        ASSERT_TRUE(id.ok()) << id.status().message();
        ASSERT_TRUE(ranks_[0]->Wait(*id, kTimeout).ok());
        cudaFree(device);
      } else {  // received into device memory and into host memory
        void* device = nullptr;
        ASSERT_EQ(cudaMalloc(&device, kBytes), cudaSuccess);
        std::vector<uint8_t> host(kBytes, 0);
        const TransferOp ops[] = {TransferOp::Recv(0, 1, device, kBytes, MemoryKind::kCuda),
                                  TransferOp::Recv(0, 2, host.data(), kBytes)};
        auto id = ranks_[1]->Post(ops);
        ASSERT_TRUE(id.ok()) << id.status().message();
        ASSERT_TRUE(ranks_[1]->Wait(*id, kTimeout).ok());
        EXPECT_EQ(HostCopy(device, kBytes), Pattern(kBytes, 7));
        EXPECT_EQ(host, Pattern(kBytes, 8));
        cudaFree(device);
      }
    });
  }
  for (std::thread& thread : threads) thread.join();
}

TEST_F(NcclHostStagingTest, AHostReceiveNobodySendsTimesOutAndCancelAbortsTheTransport) {
  std::vector<uint8_t> host(256, 0xab);
  const TransferOp receive = TransferOp::Recv(0, 77, host.data(), host.size());
  auto id = ranks_[1]->Post({&receive, 1});
  ASSERT_TRUE(id.ok()) << id.status().message();
  EXPECT_EQ(ranks_[1]->Wait(*id, milliseconds(200)).code(), StatusCode::kDeadlineExceeded);
  ranks_[1]->Cancel(*id);
  EXPECT_EQ(host, std::vector<uint8_t>(256, 0xab)) << "a cancelled receive wrote its buffer";
  auto after = ranks_[1]->Post({&receive, 1});
  ASSERT_FALSE(after.ok());
  EXPECT_EQ(after.status().code(), StatusCode::kUnavailable) << after.status().message();
  owned_[1].reset();
}

TEST(NcclHostStagingPair, RefusesOneDeviceForBothRanks) {
  auto pair = CreateNcclHostStagingPair({0, 0});
  ASSERT_FALSE(pair.ok());
  EXPECT_NE(pair.status().message().find("both ranks on device 0"), std::string::npos)
      << pair.status().message();
}

}  // namespace
}  // namespace rubato::transport
